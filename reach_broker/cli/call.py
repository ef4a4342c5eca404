"""``reach call CAP [JSON]``: run one task on an agent with the capability and print its
result, through the SDK's :class:`reach_agent.Client` (route, send with a receipt, retry
elsewhere on busy, draining or lost agents, all with one request id)."""

from __future__ import annotations

import argparse
import asyncio
import sys

import msgspec

from .common import (
    EXIT_USAGE,
    CliError,
    Subcommands,
    add_common,
    capability,
    connect,
    subjects,
    tags,
)
from .output import print_json

DEFAULT_TIMEOUT_S = 30.0


def add_parser(sub: Subcommands) -> None:
    p = sub.add_parser("call", help="call an agent by capability and print its result")
    add_common(p, timeout=DEFAULT_TIMEOUT_S, timeout_help="the call's deadline in seconds")
    p.add_argument("capability", help="the capability to call, e.g. text_processing")
    p.add_argument("payload", nargs="?", default="{}", metavar="JSON",
                   help="the task's payload as JSON (default {}; - reads stdin)")  # fmt: skip
    p.add_argument("--sticky-key", help="send every call with this key to the same agent")
    p.add_argument("--region", help="only agents announced in this region")
    p.add_argument("--tag", action="append", metavar="K=V",
                   help="only agents with this tag (repeatable: all must match)")  # fmt: skip
    p.add_argument("--request-id", help="the call's request id (a repeat gets the first result)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    return asyncio.run(_call(args))


def _payload(text: str) -> bytes:
    data = (sys.stdin.read() if text == "-" else text).encode()
    try:
        msgspec.json.decode(data)
    except msgspec.DecodeError as exc:
        shown = text if len(text) <= 60 else text[:57] + "..."
        raise CliError(f"payload {shown!r} is not JSON ({exc})", EXIT_USAGE) from None
    return data


async def _call(args: argparse.Namespace) -> int:
    import reach_agent

    cap = capability(args.capability)
    payload = _payload(args.payload)
    if args.timeout <= 0:
        raise CliError(f"--timeout {args.timeout:g} must be above zero", EXIT_USAGE)
    # The deadline is exactly --timeout: the client's clamp is widened to include it.
    config = reach_agent.ClientConfig(
        prefix=subjects(args).prefix,
        min_timeout_s=min(args.timeout, reach_agent.ClientConfig().min_timeout_s),
        max_timeout_s=max(args.timeout, reach_agent.ClientConfig().max_timeout_s),
    )
    nc = await connect(args, name="reach-call")
    try:
        async with reach_agent.Client(config=config, nc=nc, name="reach-call") as client:
            result = await client.call(
                cap, payload, timeout=args.timeout, sticky_key=args.sticky_key,
                region=args.region, tags=tags(args.tag) or None, request_id=args.request_id,
            )  # fmt: skip
    finally:
        await nc.close()
    print_json(result)
    return 0
