"""Reading the audit trail ``REACH_AUDIT`` (every ``<prefix>.event.>``; delete and purge denied).

One mechanism serves every reader: :func:`follow_events` hands a callback the stored events
from a start point (a time, the last *n*, or the whole trail), oldest first, and then every
event stored after them, through one :class:`~jetstream.follow.Follower`, so there is neither
a gap nor a duplicate between the history and the live tail, nor after a reconnect or the
loss of the node that held its consumer. :func:`read_events` is the same read that
stops once it has caught up. :func:`live_events` is the live half alone, on the event
subjects themselves: it needs no JetStream.

Events are handed over as stored (subject and bytes); decoding them is the caller's
(:mod:`reach_agent.wire.schema`), as this floor imports nothing above it. A message on an event
subject that carries JetStream's ``Nats-Stream`` header is a copy of a stored message that
someone had JetStream answer onto that subject (the server never checks reply subjects), not
an event a broker published: it is skipped and logged, live or stored.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, NamedTuple

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeout
from nats.js import api
from nats.js.errors import APIError, NotFoundError, ServiceUnavailableError

from .follow import ALL, UNCOUNTED, Follower, FollowMetrics, Start
from .names import AUDIT_STREAM, H_STREAM, JS_NOT_ENABLED, StreamSubjects
from .tasks import raise_if_cancelled

log = logging.getLogger(__name__)


class StoredEvent(NamedTuple):
    subject: str
    data: bytes
    seq: int
    """Stream sequence; 0 for an event from :func:`live_events` (not read from the stream)."""
    time: dt.datetime | None
    """When the stream stored it (None from :func:`live_events`)."""
    pending: int = 0
    """Stored events still to come after this one when it was delivered (0: caught up)."""


EventCallback = Callable[[StoredEvent], Awaitable[None]]


class AuditUnavailable(Exception):
    """The audit trail cannot be read on this server."""


class NoAuditStream(AuditUnavailable):
    """The server has JetStream but no ``REACH_AUDIT`` stream (no broker provisioned it)."""


class NoJetStream(AuditUnavailable):
    """The server (or the account) has no JetStream, hence no stored events at all."""


class Follow:
    """A running read of the events: ``caught_up`` is set once every event stored in the
    window when it started has been handed to the callback (at once for live events)."""

    def __init__(self, cb: EventCallback) -> None:
        self._cb = cb
        self._sub: Any = None
        self.follower: Follower | None = None
        """What reads the stored events (None for :func:`live_events`)."""
        self.caught_up = asyncio.Event()
        self.delivered = 0
        """Events handed to the callback so far."""

    async def _on_stored(self, msg: Msg) -> None:
        md = msg.metadata
        event = StoredEvent(msg.subject, msg.data, md.sequence.stream, md.timestamp,
                            md.num_pending)  # fmt: skip
        self.delivered += 1
        if not is_copy(msg, live=False):
            await self._cb(event)
        if event.pending == 0:
            self.caught_up.set()

    async def _on_live(self, msg: Msg) -> None:
        self.delivered += 1
        if not is_copy(msg, live=True):
            await self._cb(StoredEvent(msg.subject, msg.data, 0, None))

    async def until_caught_up(self, quiet_s: float) -> bool:
        """Wait until caught up; False when no event arrived for ``quiet_s`` before that
        (stored events aged out while being read, or the server stalled)."""
        while not self.caught_up.is_set():
            raise_if_cancelled()
            seen = self.delivered
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.caught_up.wait(), quiet_s)
            if self.delivered == seen and not self.caught_up.is_set():
                return False
        return True

    async def stop(self, *, delete: bool = False) -> None:
        """Stop the deliveries (the server removes the consumer once unused; ``delete``: at
        once, see :meth:`Follower.stop`)."""
        if self.follower is not None:
            follower, self.follower = self.follower, None
            await follower.stop(delete=delete)
        if self._sub is not None:
            sub, self._sub = self._sub, None
            with contextlib.suppress(Exception):  # a closed connection has nothing to undo
                await sub.unsubscribe()


def is_copy(msg: Msg, *, live: bool) -> bool:
    """Whether a message on an event subject is not an event a broker published but a copy
    of a stored message: a ``Nats-Stream`` header, or, for one received ``live`` on the
    subject itself, a reply subject (brokers publish events plainly; a push consumer's
    deliveries carry one). Logged when it is."""
    why = None
    if msg.headers and H_STREAM in msg.headers:
        why = f"copied from {msg.headers[H_STREAM]}"
    elif live and msg.reply:
        why = "it has a reply subject"
    if why is not None:
        log.warning("audit.not_an_event subject=%s reason=%s", msg.subject, why)
    return why is not None


def _start_at(state: api.StreamState, since_s: float | None, last: int | None) -> Start:
    """Where the follow starts: a stored time, the last ``last`` sequences, or all.

    By sequence rather than ``deliver_policy=new``, so an event stored between reading the
    stream state and creating the consumer is delivered, not skipped."""
    if since_s is not None:
        return Start.at_time(time.time() - since_s)
    if last is not None:
        return Start.at_seq(max(state.first_seq, state.last_seq - max(last, 0) + 1, 1))
    return ALL


async def follow_events(
    nc: NATS,
    cb: EventCallback,
    *,
    subjects: StreamSubjects,
    since_s: float | None = None,
    last: int | None = None,
    subject: str | None = None,
    timeout_s: float = 2.0,
    metrics: FollowMetrics = UNCOUNTED,
) -> Follow:
    """Hand ``cb`` the stored events, oldest first, then each event stored after them, until
    :meth:`Follow.stop` (or the connection closes). Callbacks run one at a time.

    The history starts ``since_s`` seconds ago, or at the last ``last`` events stored (0:
    none), or (neither) at the start of the trail. ``subject`` narrows the events (default:
    every ``<prefix>.event.>``). ``metrics`` counts the follow's losses and rebuilds (it is
    named ``audit``). Raises :class:`NoAuditStream` or :class:`NoJetStream`.
    """
    js = nc.jetstream(timeout=timeout_s)
    follow = Follow(cb)
    try:
        info = await js.stream_info(AUDIT_STREAM)
        follower = Follower(nc, follow._on_stored, name="audit", stream=AUDIT_STREAM,
                            subject=subject or subjects.all_events,
                            start=_start_at(info.state, since_s, last), metrics=metrics,
                            timeout_s=timeout_s)  # fmt: skip
        consumer = await follower.start()
        follow.follower = follower
    except NotFoundError:
        await follow.stop()
        raise NoAuditStream(f"stream {AUDIT_STREAM} not found on this server") from None
    except (NoRespondersError, ServiceUnavailableError, NatsTimeout):
        await follow.stop()
        raise NoJetStream("JetStream is not available on this server") from None
    except APIError as exc:
        await follow.stop()
        if exc.err_code == JS_NOT_ENABLED:
            raise NoJetStream("JetStream is not enabled for this account") from None
        raise
    # Nothing delivered and nothing pending: the window is empty. (Delivered but not yet
    # handed over: the last of those, pending 0, sets it.)
    delivered = consumer.delivered.consumer_seq if consumer.delivered is not None else 0
    if consumer.num_pending == 0 and delivered == 0:
        follow.caught_up.set()
    return follow


async def live_events(
    nc: NATS, cb: EventCallback, *, subjects: StreamSubjects, subject: str | None = None
) -> Follow:
    """Hand ``cb`` every event published from now on (a plain subscription: no JetStream, no
    history). The caller flushes when it must know the server has the interest."""
    follow = Follow(cb)
    follow._sub = await nc.subscribe(subject or subjects.all_events, cb=follow._on_live)
    follow.caught_up.set()
    return follow


async def read_events(
    nc: NATS,
    *,
    since_s: float | None = None,
    last: int | None = None,
    subject: str | None = None,
    subjects: StreamSubjects,
    limit: int = 10_000,
    timeout_s: float = 2.0,
) -> list[StoredEvent]:
    """The stored events of a window (as :func:`follow_events` starts it), oldest first, at
    most ``limit``; the read ends when caught up or quiet for ``timeout_s``."""
    out: list[StoredEvent] = []
    full = asyncio.Event()

    async def keep(event: StoredEvent) -> None:
        if len(out) < limit:
            out.append(event)
        if len(out) >= limit:
            full.set()

    follow = await follow_events(nc, keep, subjects=subjects, since_s=since_s, last=last,
                                 subject=subject, timeout_s=timeout_s)  # fmt: skip
    try:
        reading = asyncio.ensure_future(follow.until_caught_up(timeout_s))
        enough = asyncio.ensure_future(full.wait())
        await asyncio.wait({reading, enough}, return_when=asyncio.FIRST_COMPLETED)
        reading.cancel()
        enough.cancel()
    finally:
        await follow.stop()
    return out
