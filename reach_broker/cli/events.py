"""``reach events``: the audit trail from a time ago (``--since``), then live (``--follow``).

History and the live tail come through :mod:`jetstream.audit` (one follow, so
nothing is missed or printed twice between them); ``--follow`` alone subscribes to the
event subjects and needs no JetStream.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import re
import sys
import time
from collections.abc import Awaitable
from datetime import datetime
from typing import Any

import msgspec

from jetstream.names import AUDIT_STREAM

from .common import (
    EXIT_UNAVAILABLE,
    EXIT_USAGE,
    CliError,
    Subcommands,
    add_common,
    connect,
    parse_duration,
    refusal,
    stop_on_signals,
    subjects,
)
from .output import format_event, print_json

log = logging.getLogger("reach")

DEFAULT_SINCE_S = 3600.0
"""Plain ``reach events``: the last hour of the audit trail."""


def add_parser(sub: Subcommands) -> None:
    p = sub.add_parser("events", help=f"the event stream ({AUDIT_STREAM} history and live)")
    add_common(p)
    p.add_argument("--since", metavar="DURATION|TIME",
                   help=f"replay {AUDIT_STREAM} from this long ago (90s, 15m, 1h; default "
                        "1h) or from this time (ISO 8601 with its offset, e.g. "
                        "2026-12-01T13:00:00Z)")  # fmt: skip
    p.add_argument("--follow", "-f", action="store_true", help="keep printing live events")
    p.set_defaults(func=run)


def parse_since(text: str, now: float) -> float:
    """``--since``: a duration, or an ISO 8601 time with its UTC offset; seconds before
    ``now`` (the Unix time)."""
    if not re.fullmatch(r"\d{4}-\d\d-\d\d[T ].*", text.strip()):
        return parse_duration(text)
    try:
        at = datetime.fromisoformat(text.strip())
    except ValueError:
        raise CliError(f"--since {text!r} is not a time (like 2026-12-01T13:00:00Z)",
                       EXIT_USAGE) from None  # fmt: skip
    if at.tzinfo is None:
        raise CliError(f"--since {text!r} has no UTC offset (add Z or +01:00)", EXIT_USAGE)
    seconds = now - at.timestamp()
    if seconds <= 0:
        raise CliError(f"--since {text!r} is in the future", EXIT_USAGE)
    return seconds


def run(args: argparse.Namespace) -> int:
    since = parse_since(args.since, time.time()) if args.since else None
    if since is None and not args.follow:
        since = DEFAULT_SINCE_S
    return asyncio.run(_events(args, since))


async def _events(args: argparse.Namespace, since: float | None) -> int:
    """Print the events from ``since`` seconds ago until caught up, or (``--follow``) until
    a signal; ``since`` None: live events only."""
    from jetstream import audit
    from reach_agent.connection import flush_subscriptions
    from reach_agent.wire import schema

    stop = stop_on_signals()
    subs = subjects(args)
    printed = 0
    reader_gone = False

    async def emit(stored: audit.StoredEvent) -> None:
        nonlocal printed, reader_gone
        try:
            event = schema.event_decoder.decode(stored.data)
        except msgspec.DecodeError as exc:
            log.warning("events.undecodable subject=%s error=%s", stored.subject, exc)
            return
        if reader_gone:
            return
        try:
            if args.json:
                print_json(event)
            else:
                sys.stdout.write(format_event(event) + "\n")
            sys.stdout.flush()
        except BrokenPipeError:  # `| head` has read enough: stop (raised again below)
            reader_gone = True
            stop.set()
            return
        printed += 1

    nc = await connect(args)
    try:
        if since is None:
            await audit.live_events(nc, emit, subjects=subs)
            await flush_subscriptions(nc)
        else:
            try:
                follow = await audit.follow_events(nc, emit, subjects=subs, since_s=since,
                                                   timeout_s=args.timeout)  # fmt: skip
            except audit.NoAuditStream:
                raise CliError(
                    f"stream {AUDIT_STREAM} not found on this server: the broker creates it at "
                    "start when JetStream is on (use --follow for live events only)",
                    EXIT_UNAVAILABLE,
                ) from None
            except audit.NoJetStream:
                denied = refusal(nc, f"cannot read {AUDIT_STREAM}'s history (use --follow for "
                                     "live events only)")  # fmt: skip
                if denied is not None:
                    raise denied from None
                raise CliError(
                    f"JetStream is not available on this server, so there is no {AUDIT_STREAM} "
                    "history (use --follow for live events only)",
                    EXIT_UNAVAILABLE,
                ) from None
            if not args.follow:
                # Until caught up, or a quiet stream after the last pending event.
                await _until(follow.until_caught_up(max(args.timeout, 2.0)), stop)
                if not printed and not reader_gone:
                    window = (f"since {args.since}" if args.since and "-" in args.since
                              else f"in the last {args.since or '1h'}")  # fmt: skip
                    sys.stderr.write(f"reach: no events in {AUDIT_STREAM} {window}\n")
                stop.set()
        await stop.wait()
    finally:
        await nc.close()
    if reader_gone:
        raise BrokenPipeError
    return 0


async def _until(work: Awaitable[Any], stop: asyncio.Event) -> None:
    """Await ``work`` unless ``stop`` is set first."""
    job = asyncio.ensure_future(work)
    stopper = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({job, stopper}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        job.cancel()
        stopper.cancel()
