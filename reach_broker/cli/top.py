"""``reach top``: the live view of the fleet (:mod:`.view`) until ``q``, Ctrl-C or SIGTERM."""

from __future__ import annotations

import argparse
import asyncio

from reach_agent.connection import DEFAULT_URL

from .common import Subcommands, add_common, connect, stop_on_signals, subjects
from .view import view_loop


def add_parser(sub: Subcommands) -> None:
    p = sub.add_parser("top", help="live view of the fleet: states, scores, load, route rate")
    add_common(p)
    p.add_argument("--interval", type=float, default=1.0, help="seconds between refreshes")
    p.add_argument("--once", action="store_true", help="print one snapshot and exit")
    p.add_argument("--events", type=int, default=8, help="recent events shown")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    return asyncio.run(_top(args))


async def _top(args: argparse.Namespace) -> int:
    stop = stop_on_signals()
    subs = subjects(args)
    nc = await connect(args, name="reach-top")
    try:
        await view_loop(
            nc,
            subjects=subs,
            server=args.server or DEFAULT_URL,
            interval=args.interval,
            timeout_s=args.timeout,
            max_events=args.events,
            once=args.once,
            as_json=args.json,
            stop=stop,
            reconnect=None if args.once else lambda: connect(args, name="reach-top"),
        )
    finally:
        await nc.close()
    return 0
