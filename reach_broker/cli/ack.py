"""``reach ack REQUEST_ID``: the durable ack records of one request (``REACH_ACKS``), each with
its author: the agent (or ``_broker``) whose subject it was stored on, which only that author
may publish to under reach's credentials. Copies of stored messages and records whose body
disagrees with their subject are left out (and logged).

``--steps``: the request is a flow run (:mod:`reach_agent.client.flow`); its steps' records follow,
read at the step ids ``<REQUEST_ID>-1``, ``-2``, … until ``--gap`` ids in a row have none
(a step that reached no agent has no record)."""

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
    p.add_argument("request_id", help="the request id (Reach-Request-Id) of the task")
    p.add_argument("--all", action="store_true", help="every record, not only the latest")
    p.add_argument("--agent", metavar="AGENT_ID", help="only the records this agent wrote")
    p.add_argument(
        "--steps",
        action="store_true",
        help="a flow run: also the latest record of each step (REQUEST_ID-1, -2, ...)",
    )
    p.add_argument(
        "--gap",
        type=int,
        default=3,
        metavar="N",
        help="with --steps: stop after N step ids in a row without a record",
    )
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
    from reach_agent.results import attributed

    try:
        acks.check_request_id(args.request_id)
    except acks.InvalidRequestId as exc:
        raise CliError(str(exc), EXIT_USAGE) from None
    if args.steps and args.gap < 1:
        raise CliError(f"--gap {args.gap} is not a positive number of step ids", EXIT_USAGE)
    subs = subjects(args)
    nc = await connect(args)
    steps: list[tuple[int, str, Any]] = []
    try:
        await _check_stream(nc, args.timeout)
        stored = await ackreads.all_records(nc, args.request_id, subjects=subs, author=args.agent,
                                        timeout_s=args.timeout)  # fmt: skip
        if args.steps:
            steps = await _steps(nc, args, subs)
    except (NatsError, TimeoutError) as exc:  # e.g. the server went away in between
        raise refusal(nc, f"cannot read {ACK_STREAM}") or CliError(
            f"cannot read {ACK_STREAM}: {exc or type(exc).__name__}", EXIT_UNAVAILABLE
        ) from None
    finally:
        await nc.close()
    if args.steps:
        return _show_steps(args, stored, steps)
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


async def _steps(nc: Any, args: argparse.Namespace, subs: Any) -> list[tuple[int, str, Any]]:
    """(step number, step request id, its latest attributed record) of a flow run's steps;
    a step without a record is left out, and ``--gap`` of them in a row end the list."""
    from jetstream import ackreads
    from reach_agent.results import attributed

    out: list[tuple[int, str, Any]] = []
    n = misses = 0
    while misses < args.gap:
        n += 1
        rid = f"{args.request_id}-{n}"
        if len(rid) > 128:
            break
        got = await ackreads.last_record(nc, rid, subjects=subs, author=args.agent,
                                         timeout_s=args.timeout)  # fmt: skip
        rec = attributed(got) if got is not None else None
        if rec is None:
            misses += 1
            continue
        misses = 0
        out.append((n, rid, rec))
    return out


def _show_steps(
    args: argparse.Namespace, stored: list[Any], steps: list[tuple[int, str, Any]]
) -> int:
    """The run's own latest record (when it has one: a flow inside a handler) and a row per
    step."""
    from reach_agent.results import attributed

    own = [r for s in stored if (r := attributed(s)) is not None]
    if not own and not steps:
        raise CliError(f"no ack record for request_id {args.request_id!r} nor for its steps "
                       f"{args.request_id}-1, -2, ... (acks are kept 24 h)")  # fmt: skip
    if args.json:
        print_json({"request_id": args.request_id, "record": own[-1] if own else None,
                    "steps": [{"step": n, "request_id": rid, "record": r}
                              for n, rid, r in steps]})  # fmt: skip
        return 0
    rows: list[tuple[Any, ...]] = []
    if own:
        last = own[-1]
        rows.append(("-", args.request_id, last.state, last.agent_id, last.capability,
                     utc(last.at_ms), (last.error or {}).get("code", "")))  # fmt: skip
    rows += [(n, rid, r.state, r.agent_id, r.capability, utc(r.at_ms),
              (r.error or {}).get("code", "")) for n, rid, r in steps]  # fmt: skip
    print(f"flow {args.request_id}: {len(steps)} step(s) with records")
    print_table(rows, ["STEP", "REQUEST ID", "STATE", "AGENT", "CAPABILITY", "AT", "ERROR"])
    return 0
