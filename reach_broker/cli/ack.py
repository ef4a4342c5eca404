"""``reach ack REQUEST_ID``: the durable ack records of one request (``REACH_ACKS``), each with
its author: the agent (or ``_broker``) whose subject it was stored on, which only that author
may publish to under reach's credentials. Copies of stored messages and records whose body
disagrees with their subject are left out (and logged)."""

from __future__ import annotations

import argparse
import asyncio
from typing import Any

from jetstream.names import ACK_STREAM, JS_NOT_ENABLED

from .common import (
    EXIT_UNAVAILABLE,
    EXIT_USAGE,
    CliError,
    Subcommands,
    add_common,
    connect,
    refusal,
    subjects,
)
from .output import print_json, print_table, utc


def add_parser(sub: Subcommands) -> None:
    p = sub.add_parser("ack", help=f"the durable ack record of a request id ({ACK_STREAM})")
    add_common(p)
    p.add_argument("request_id")
    p.add_argument("--all", action="store_true", help="every record, not only the latest")
    p.add_argument("--agent", metavar="AGENT_ID", help="only the records this agent wrote")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    return asyncio.run(_ack(args))


async def _check_stream(nc: Any, timeout_s: float) -> None:
    """A clear error when the server has no JetStream, or no ack stream (no broker set it
    up); reading records on either would only say "none"."""
    from nats.errors import NoRespondersError
    from nats.errors import TimeoutError as NatsTimeout
    from nats.js.errors import APIError, NotFoundError, ServiceUnavailableError

    try:
        await nc.jetstream(timeout=timeout_s).stream_info(ACK_STREAM)
    except NotFoundError:
        raise CliError(f"stream {ACK_STREAM} not found on this server: the broker creates it "
                       "at start when JetStream is on", EXIT_UNAVAILABLE) from None  # fmt: skip
    except (NoRespondersError, ServiceUnavailableError, NatsTimeout):
        denied = refusal(nc, f"cannot read {ACK_STREAM}")
        if denied is not None:
            raise denied from None
        raise CliError(f"JetStream is not available on this server (or this account), so there "
                       f"is no {ACK_STREAM} to read", EXIT_UNAVAILABLE) from None  # fmt: skip
    except APIError as exc:
        if exc.err_code == JS_NOT_ENABLED:
            raise CliError(f"JetStream is not enabled for this account, so there is no "
                           f"{ACK_STREAM} to read", EXIT_UNAVAILABLE) from None  # fmt: skip
        raise CliError(f"cannot read {ACK_STREAM}: {exc}", EXIT_UNAVAILABLE) from None


async def _ack(args: argparse.Namespace) -> int:
    """Every record stored for one request id (received, completed/failed)."""
    from nats.errors import Error as NatsError

    from jetstream import ackreads, acks
    from reach_agent.durable import attributed

    try:
        acks.check_request_id(args.request_id)
    except acks.InvalidRequestId as exc:
        raise CliError(str(exc), EXIT_USAGE) from None
    subs = subjects(args)
    nc = await connect(args)
    try:
        await _check_stream(nc, args.timeout)
        stored = await ackreads.all_records(nc, args.request_id, subjects=subs, author=args.agent,
                                        timeout_s=args.timeout)  # fmt: skip
    except (NatsError, TimeoutError) as exc:  # e.g. the server went away in between
        raise refusal(nc, f"cannot read {ACK_STREAM}") or CliError(
            f"cannot read {ACK_STREAM}: {exc or type(exc).__name__}", EXIT_UNAVAILABLE
        ) from None
    finally:
        await nc.close()
    if not stored:
        raise CliError(f"no ack record for request_id {args.request_id!r} (acks are kept 24 h)")
    found = [(s.author, r) for s in stored if (r := attributed(s)) is not None]
    if not found:
        raise CliError(f"no attributable ack record for request_id {args.request_id!r} (see "
                       "the warnings above)")  # fmt: skip
    records = [r for _, r in found]
    if args.json:
        print_json(records if args.all else records[-1])
        return 0
    shown = found if args.all else [found[-1]]
    rows = [
        (r.state, author, r.agent_id, r.capability, utc(r.at_ms),
         (r.error or {}).get("code", "") or "",
         (bytes(r.result).decode(errors="replace")[:60] if r.result else
          (r.error or {}).get("message", "")[:60]))
        for author, r in shown
    ]  # fmt: skip
    print(f"request {args.request_id}")
    print_table(rows, ["STATE", "AUTHOR", "AGENT", "CAPABILITY", "AT", "ERROR",
                       "RESULT / MESSAGE"])  # fmt: skip
    return 0
