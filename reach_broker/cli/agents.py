"""``reach agents``: the whole fleet, paged through ``<prefix>.agents.<partition>`` (each
partition answered by the broker that owns it)."""

from __future__ import annotations

import argparse
import asyncio
import os
from typing import TYPE_CHECKING, Any

from .common import (
    EXIT_UNAVAILABLE,
    EXIT_USAGE,
    CliError,
    Subcommands,
    add_common,
    capability,
    connect,
    subjects,
)
from .output import AGENT_HEADER, agent_rows, print_json, print_table

if TYPE_CHECKING:
    from reach_agent.wire.schema import AgentView
    from reach_agent.wire.subjects import Subjects

PAGE_SIZE = 1000
"""Agents asked per page (``--page-size``, ``REACH_PAGE_SIZE``)."""


def add_parser(sub: Subcommands) -> None:
    p = sub.add_parser("agents", help="list agents with state, score and load")
    add_common(p)
    p.add_argument("--capability", "-C", help="only agents with this capability")
    p.add_argument("--state", choices=["healthy", "suspect", "offline", "recovering", "draining"],
                   help="only agents in this state")  # fmt: skip
    page_size = int(os.environ.get("REACH_PAGE_SIZE", PAGE_SIZE))
    p.add_argument("--page-size", type=int, default=page_size,
                   help=f"agents per page asked of each partition's owner (1-5000, default "
                        f"{PAGE_SIZE}; env REACH_PAGE_SIZE)")  # fmt: skip
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    return asyncio.run(_agents(args))


async def _agents(args: argparse.Namespace) -> int:
    cap = None if args.capability is None else capability(args.capability, "--capability")
    if not 1 <= args.page_size <= 5000:
        raise CliError(f"--page-size {args.page_size} is not within 1-5000", EXIT_USAGE)
    s = subjects(args)
    nc = await connect(args)
    try:
        views = await fleet(nc, s, args.timeout, capability=cap, state=args.state,
                            page_size=args.page_size)  # fmt: skip
    finally:
        await nc.close()
    if args.json:
        print_json(views)
        return 0
    print_table(agent_rows(views), AGENT_HEADER)
    return 0


async def fleet(
    nc: Any,
    s: Subjects,
    timeout_s: float,
    *,
    capability: str | None = None,
    state: Any = None,
    page_size: int = PAGE_SIZE,
) -> list[AgentView]:
    """Every agent of the fleet, sorted by id: ``<prefix>.agents.<partition>`` paged, each
    partition from its owner; a CliError saying why not."""
    from nats.errors import NoRespondersError
    from nats.errors import TimeoutError as NatsTimeout

    from reach_agent.client.listing import agent_pages
    from reach_agent.wire.errors import ReachError

    views: list[AgentView] = []
    try:
        async for page in agent_pages(nc, s, capability=capability, state=state,
                                      limit=page_size, timeout_s=timeout_s):  # fmt: skip
            views.extend(page.agents)
    except NoRespondersError:
        raise CliError(
            f"no broker answers on {s.agent_page(0)} (is `reach broker` running on this "
            "server?)", EXIT_UNAVAILABLE,
        ) from None  # fmt: skip
    except NatsTimeout:
        raise CliError(
            f"a partition's owner did not answer on {s.prefix}.agents.<partition> within "
            f"{timeout_s}s (3 tries)", EXIT_UNAVAILABLE,
        ) from None  # fmt: skip
    except ReachError as err:
        raise CliError.of(err) from None
    views.sort(key=lambda v: v.agent_id)
    return views
