"""``reach cancel REQUEST_ID``: stop a request wherever it is — the agent running it is told
(its handler is cancelled), or, when none runs it, a broker makes it final (its queued entry
removed); either way it ends ``CANCELLED`` and never runs again
(:meth:`reach_agent.Client.cancel`)."""

from __future__ import annotations

import argparse
import asyncio

from .common import Subcommands, add_common, connect, subjects
from .output import print_json


def add_parser(sub: Subcommands) -> None:
    p = sub.add_parser("cancel", help="cancel a request: its agent stops, it never runs again")
    add_common(p, timeout=2.0, timeout_help="how long a broker may take to answer")
    p.add_argument("request_id", metavar="REQUEST_ID", help="the request to cancel")
    p.add_argument("--reason", help="why (in the CANCELLED error the caller and wait() see)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    return asyncio.run(_cancel(args))


async def _cancel(args: argparse.Namespace) -> int:
    import reach_agent

    config = reach_agent.ClientConfig(prefix=subjects(args).prefix)
    nc = await connect(args, name="reach-cancel")
    try:
        async with reach_agent.Client(config=config, nc=nc, name="reach-cancel") as client:
            reply = await client.cancel(args.request_id, reason=args.reason,
                                        timeout=args.timeout)  # fmt: skip
    finally:
        await nc.close()
    if args.json:
        print_json(reply)
        return 0
    who = "a broker" if reply.agent_id == "_broker" else f"agent {reply.agent_id}"
    line = (f"{reply.request_id}: cancelled by {who}" if reply.state == "cancelled" else
            f"{reply.request_id}: already finished on {who}; its result stands")  # fmt: skip
    print(line + (f" ({reply.detail})" if reply.detail else ""))
    return 0
