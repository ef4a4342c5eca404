"""``reach ack REQUEST_ID``: the durable ack records of one request (``REACH_ACKS``)."""

from __future__ import annotations

import argparse
import asyncio

from jetstream.names import ACK_STREAM

from .common import (
    EXIT_UNAVAILABLE,
    EXIT_USAGE,
    CliError,
    Subcommands,
    add_common,
    connect,
    subjects,
)
from .output import print_json, print_table, utc


def add_parser(sub: Subcommands) -> None:
    p = sub.add_parser("ack", help=f"the durable ack record of a request id ({ACK_STREAM})")
    add_common(p)
    p.add_argument("request_id")
    p.add_argument("--all", action="store_true", help="every record, not only the latest")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    return asyncio.run(_ack(args))


async def _ack(args: argparse.Namespace) -> int:
    """Every record stored for one request id (received, completed/failed)."""
    from jetstream import acks
    from reach_agent.schema import decode_ack_record

    try:
        acks.check_request_id(args.request_id)
    except acks.InvalidRequestId as exc:
        raise CliError(str(exc), EXIT_USAGE) from None
    subs = subjects(args)
    nc = await connect(args)
    try:
        stored = await acks.all_records(nc, args.request_id, subjects=subs,
                                        timeout_s=args.timeout)  # fmt: skip
    except Exception as exc:  # no stream, no JetStream: one clear line
        raise CliError(f"cannot read {ACK_STREAM}: {exc or type(exc).__name__}",
                       EXIT_UNAVAILABLE) from None  # fmt: skip
    finally:
        await nc.close()
    if not stored:
        raise CliError(f"no ack record for request_id {args.request_id!r} (acks are kept 24 h)")
    records = [decode_ack_record(s.data) for s in stored]
    if args.json:
        print_json(records if args.all else records[-1])
        return 0
    shown = records if args.all else [records[-1]]
    rows = [
        (r.state, r.agent_id, r.capability, utc(r.at_ms),
         (r.error or {}).get("code", "") or "",
         (bytes(r.result).decode(errors="replace")[:60] if r.result else
          (r.error or {}).get("message", "")[:60]))
        for r in shown
    ]  # fmt: skip
    print(f"request {args.request_id}")
    print_table(rows, ["STATE", "AGENT", "CAPABILITY", "AT", "ERROR", "RESULT / MESSAGE"])
    return 0
