"""``reach route CAP``: the candidates a caller would get (``<prefix>.route.<capability>``)."""

from __future__ import annotations

import argparse
import asyncio

from .common import Subcommands, add_common, ask, capability, subjects, tags
from .output import print_json, print_table


def add_parser(sub: Subcommands) -> None:
    p = sub.add_parser("route", help="ask for the candidates a caller would get")
    add_common(p)
    p.add_argument("capability")
    p.add_argument("--limit", "-n", type=int, default=3)
    p.add_argument("--region")
    p.add_argument("--tag", action="append", metavar="K=V")
    p.add_argument("--sticky-key")
    p.add_argument("--exclude", action="append", metavar="AGENT_ID")
    p.add_argument("--allow-suspect", action="store_true")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    return asyncio.run(_route(args))


async def _route(args: argparse.Namespace) -> int:
    from reach_agent import schema

    cap = capability(args.capability)
    req = schema.RouteRequest(
        limit=args.limit, region=args.region, tags=tags(args.tag), sticky_key=args.sticky_key,
        exclude=args.exclude or [], allow_suspect=args.allow_suspect, peek=True,
    )  # fmt: skip
    data = await ask(args, subjects(args).route(cap), schema.encoder.encode(req))
    reply = schema.route_reply_decoder.decode(data)
    if args.json:
        print_json(reply)
        return 0
    rows = [(i + 1, c.agent_id, c.state, f"{c.score:.1f}", f"{c.load:.2f}", c.region or "-",
             c.subject) for i, c in enumerate(reply.candidates)]  # fmt: skip
    print_table(rows, ["#", "AGENT", "STATE", "SCORE", "LOAD", "REGION", "SUBJECT"])
    return 0
