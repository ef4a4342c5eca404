"""``reach agents``: the fleet as one broker sees it (``<prefix>.agents``)."""

from __future__ import annotations

import argparse
import asyncio
import json

from .common import Subcommands, add_common, ask, capability, subjects
from .output import AGENT_HEADER, agent_rows, print_json, print_table


def add_parser(sub: Subcommands) -> None:
    p = sub.add_parser("agents", help="list agents with state, score and load")
    add_common(p)
    p.add_argument("--capability", "-C", help="only agents with this capability")
    p.add_argument("--state", choices=["healthy", "suspect", "offline", "recovering", "draining"],
                   help="only agents in this state")  # fmt: skip
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    return asyncio.run(_agents(args))


async def _agents(args: argparse.Namespace) -> int:
    from reach_agent.wire import schema

    body: dict[str, str] = {}
    if args.capability is not None:
        body["capability"] = capability(args.capability, "--capability")
    if args.state:
        body["state"] = args.state
    data = await ask(args, subjects(args).agents, json.dumps(body).encode())
    views = schema.agent_views_decoder.decode(data)
    if args.json:
        print_json(views)
        return 0
    print_table(agent_rows(views), AGENT_HEADER)
    return 0
