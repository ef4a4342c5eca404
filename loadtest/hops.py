"""Where a call's time goes, hop by hop, read off the wire.

:class:`Wiretap` subscribes to ``>`` on a connection of its own and notes every message of
the account with the time it read it (``time.monotonic_ns()``: one clock for every process
of the machine, so the caller's own start and end of each call sit on the same axis). For a
few sequential calls (``loadtest.caller``'s ``trace``) :func:`timeline` finds each call's
messages — the route request and its reply, the task, the claim's create and end in KV
``reach_claims`` and their PubAcks, the receipt, the ack records and their PubAcks, the
result — by the request id (in the task's header, the claim's key, the ack subject) and by
reply subjects (a reply or PubAck goes to the subject its request named).
:func:`breakdown` takes the median of each mark and of each hop of the critical path.

Every mark is the time the *tap* read the message: it lags the real send by one delivery
from the server, about the same for every message, so hops (differences) are close to
true; the first and last hop (the caller's own work) include that lag once. The tap costs
the server one more delivery per message while a trace runs, so traced calls are a little
slower than the measured rounds: the rounds, not the trace, give the figures.
"""

from __future__ import annotations

import contextlib
import itertools
import statistics
import time
from collections import defaultdict
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

import nats

from jetstream.acks import state_of
from jetstream.claims import claim_key
from jetstream.names import CLAIMS_BUCKET, H_REQUEST_ID
from reach_agent.connection import connect_options
from reach_agent.wire import schema
from reach_agent.wire.subjects import Subjects

JS_ACK_PREFIX = "$JS.ACK."
HEAD_BYTES = 16


class Seen(NamedTuple):
    """One message as the tap read it."""

    t_ns: int
    subject: str
    reply: str
    headers: dict[str, str]
    head: bytes = b""
    """The body's first ``HEAD_BYTES`` bytes (a bare request carries nothing else to know it
    by)."""


class Wiretap:
    """Every message of the account while running (``>``), with the time it was read."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.seen: list[Seen] = []
        self._nc: Any = None

    async def start(self) -> None:
        self._nc = await nats.connect(
            **connect_options("loadtest-wiretap", self.url, pending_size=256 * 1024 * 1024)
        )
        clock = time.monotonic_ns
        seen = self.seen

        async def note(msg: Any) -> None:
            headers = dict(msg.headers or {})
            seen.append(Seen(clock(), msg.subject, msg.reply or "", headers, msg.data[:HEAD_BYTES]))

        await self._nc.subscribe(
            ">", cb=note, pending_msgs_limit=10_000_000, pending_bytes_limit=1 << 30
        )
        await self._nc.flush()
        await self._nc.flush()  # the SUB is in place before the PONG of the second

    async def stop(self) -> list[Seen]:
        if self._nc is not None:
            with contextlib.suppress(Exception):
                await self._nc.flush()
                await self._nc.close()
        return self.seen


# --- the marks of one call --------------------------------------------------------------

CLAIMED_PATH = (
    "start",
    "task",
    "claim_create",
    "claim_create_puback",
    "receipt",
    "ack_completed",
    "result",
    "end",
)
"""The marks a claimed call passes in order (its critical path), routed from the caller's
route table: no route request. Its ``completed`` record is the claim's end, sent ahead of
the result (its PubAck is not waited for)."""
IDEMPOTENT_PATH = ("start", "task", "receipt", "result", "end")
ROUTED = {
    CLAIMED_PATH: (CLAIMED_PATH[0], "route_request", "route_reply", *CLAIMED_PATH[1:]),
    IDEMPOTENT_PATH: (IDEMPOTENT_PATH[0], "route_request", "route_reply", *IDEMPOTENT_PATH[1:]),
}
"""The same calls when each asks a broker for its route (a caller without route tables, or
the code before them): a route request and its reply come first."""
RAW_PATH = ("start", "request", "reply", "end")
"""A bare request-reply, traced the same way: its first and last hop are the tap's lag and
the caller's own work, the part of the calls' first and last hop that is not reach's."""
OFF_PATH = (
    "ack_received",
    "ack_received_puback",
    "ack_completed",
    "ack_completed_puback",
    "claim_end",
    "claim_end_puback",
)
"""Marks the call does not wait for (the ack records and their PubAcks; a claim's end,
written only for a run that ends in an error)."""

HOPS: dict[tuple[str, str], str] = {
    ("start", "task"): "caller: call() → task sent (routed from its table)",
    ("start", "route_request"): "caller: call() → route request on the wire",
    ("route_request", "route_reply"): "route round trip (broker)",
    ("route_reply", "task"): "caller: route reply → task sent",
    ("task", "claim_create"): "agent: task → claim create sent",
    ("claim_create", "claim_create_puback"): "JetStream: claim create → PubAck (the claim write)",
    ("claim_create_puback", "receipt"): "agent: claim PubAck → receipt sent",
    ("task", "receipt"): "agent: task → receipt sent",
    ("receipt", "ack_completed"): "agent: receipt → completed record sent, the claim's end "
    "(record 'received' to the WAL, handler)",
    ("ack_completed", "result"): "agent: completed record → result sent",
    ("receipt", "result"): "agent: receipt → result sent (records to the WAL, handler)",
    ("result", "end"): "caller: result → call() returns",
    ("start", "request"): "caller: request() → on the wire",
    ("request", "reply"): "echo responder round trip",
    ("reply", "end"): "caller: reply → request() returns",
}


def _first(events: Sequence[Seen] | None, after: int = 0) -> Seen | None:
    for ev in events or ():
        if ev.t_ns >= after:
            return ev
    return None


def timeline(
    by_subject: dict[str, list[Seen]],
    subjects: Subjects,
    agent_id: str,
    capability: str,
    request_id: str,
    start_ns: int,
    end_ns: int,
) -> dict[str, int]:
    """The marks of one call found on the wire, in ns since its start (a mark not seen is
    absent)."""
    at: dict[str, int] = {"start": start_ns, "end": end_ns}

    def mark(name: str, ev: Seen | None) -> Seen | None:
        if ev is not None:
            at[name] = ev.t_ns
        return ev

    task = None
    for ev in by_subject.get(subjects.task(agent_id, capability), ()):
        if ev.headers.get(H_REQUEST_ID) == request_id:
            task = mark("task", ev)
            break
    if task is not None:
        # The route request the call sent: the last one before its task (the client's
        # background refresh may send others).
        routes = [
            ev
            for ev in by_subject.get(subjects.route(capability), ())
            if start_ns <= ev.t_ns <= task.t_ns
        ]
        if routes:
            mark("route_request", routes[-1])
            mark("route_reply", _first(by_subject.get(routes[-1].reply), routes[-1].t_ns))
        for ev in by_subject.get(task.reply, ()):
            status = ev.headers.get(schema.H_STATUS)
            if status == "received" and "receipt" not in at:
                mark("receipt", ev)
            elif status is not None and status != "received" and "result" not in at:
                mark("result", ev)
    claims = by_subject.get(f"$KV.{CLAIMS_BUCKET}.{claim_key(request_id)}", [])
    for name, ev in zip(("claim_create", "claim_end"), claims, strict=False):
        mark(name, ev)
        mark(f"{name}_puback", _first(by_subject.get(ev.reply), ev.t_ns))
    for ev in by_subject.get(subjects.ack(agent_id, request_id), ()):
        state = state_of(ev.headers)
        if state in ("received", "completed") and f"ack_{state}" not in at:
            mark(f"ack_{state}", ev)
            mark(f"ack_{state}_puback", _first(by_subject.get(ev.reply), ev.t_ns))
    return {name: t - start_ns for name, t in at.items()}


def raw_timeline(
    by_subject: dict[str, list[Seen]], subject: str, body: bytes, start_ns: int, end_ns: int
) -> dict[str, int]:
    """The marks of one bare request on ``subject``, known by its ``body``. (Not "the first
    after the start": the tap may read a request after its reply has come back, and so
    after the next request's start.)"""
    at = {"start": 0, "end": end_ns - start_ns}
    for request in by_subject.get(subject, ()):
        if request.head == body[:HEAD_BYTES] and request.t_ns >= start_ns:
            at["request"] = request.t_ns - start_ns
            reply = _first(by_subject.get(request.reply), request.t_ns)
            if reply is not None:
                at["reply"] = reply.t_ns - start_ns
            break
    return at


def index(seen: Iterable[Seen]) -> dict[str, list[Seen]]:
    """The messages by subject, in the order read, without a consumer's deliveries: a
    push consumer's message (the broker follows ``reach_claims``) reaches a ``>``
    subscription under the stored message's own subject, its reply ``$JS.ACK.…``; it is a
    copy of a write, not a send."""
    by_subject: dict[str, list[Seen]] = defaultdict(list)
    for ev in seen:
        if not ev.reply.startswith(JS_ACK_PREFIX):
            by_subject[ev.subject].append(ev)
    return by_subject


def breakdown(timelines: Sequence[dict[str, int]], path: Sequence[str]) -> dict[str, Any]:
    """Medians over the calls, in µs: each mark since the call's start, each hop of
    ``path``, the JetStream writes a call made (publishes answered by a PubAck), and how
    many calls had every mark of the path. A path of :data:`ROUTED` is taken with its route
    request when most calls made one."""
    if path in ROUTED and 2 * sum("route_request" in t for t in timelines) > len(timelines):
        path = ROUTED[tuple(path)]
    complete = [t for t in timelines if all(m in t for m in path)]

    def med(values: list[int]) -> float | None:
        return round(statistics.median(values) / 1000.0, 1) if values else None

    marks = {m: med([t[m] for t in timelines if m in t]) for m in (*path, *OFF_PATH)}
    hops = {}
    for a, b in itertools.pairwise(path):
        hops[HOPS[(a, b)]] = med([t[b] - t[a] for t in complete])
    writes = [sum(1 for m in t if m.endswith("_puback")) for t in timelines]
    return {
        "calls": len(timelines),
        "complete": len(complete),
        "total_us": med([t["end"] for t in complete]),
        "hops_us": hops,
        "marks_us": {m: v for m, v in marks.items() if v is not None},
        "jetstream_writes_per_call": statistics.median(writes) if writes else None,
        "on_path_writes": [m for m in path if m.endswith("_puback")],
        "off_path_writes": [m for m in OFF_PATH if m.endswith("_puback")],
    }
