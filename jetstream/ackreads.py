"""Reading ack records on ``REACH_ACKS``: every author's records of a request, attributed.

The readers hand back only *attributed* records (:func:`attribute`): the message id names the
subject's author and request, and the record is not a copy JetStream made of a stored message
(a ``Nats-Stream`` header: a direct get answered onto an ack subject, which the server allows
since it never checks reply subjects). They read with message gets (``STREAM.MSG.GET``),
which return a record's headers as stored; a direct get adds ``Nats-Stream`` to every answer.
Whether the body agrees too, and which author to believe, is the caller's
(:mod:`reach_agent.client.durable`): this module works on bytes and headers.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from datetime import UTC, datetime
from typing import Any, NamedTuple

from nats.aio.client import Client as NATS
from nats.errors import Error as NatsError
from nats.js import api
from nats.js.errors import NotFoundError

from .acks import FINAL_STATES, check_request_id, parse_msg_id
from .names import ACK_STREAM, H_MSG_ID, H_STREAM, StreamSubjects
from .roundtrip import round_trip

log = logging.getLogger(__name__)

MAX_RECORDS = 100
"""Most records read for one request id (it has a handful): a runaway loop stops there."""


class StoredAck(NamedTuple):
    """One ack record as stored (or as it arrived live), attributed to its author."""

    subject: str
    author: str
    """Who wrote it: the subject's author token (an agent id, or the broker's ``_broker``)."""
    request_id: str
    state: str
    data: bytes
    msg_id: str
    seq: int | None
    """Stream sequence (None for a record that arrived live)."""


def attribute(
    subject: str, headers: Mapping[str, str] | None, data: bytes, seq: int | None,
    subjects: StreamSubjects,
) -> StoredAck | str:  # fmt: skip
    """The record on ``subject``, or why it is not one: a copy JetStream made of a stored
    message, or a message id that names another author or request than the subject."""
    hdrs = headers or {}
    if H_STREAM in hdrs:
        return f"a copy of a message stored in {hdrs[H_STREAM]} ({H_STREAM} header)"
    author, request_id = subjects.ack_of(subject)
    msg_id = hdrs.get(H_MSG_ID)
    parsed = parse_msg_id(msg_id)
    if parsed is None or msg_id is None:
        return f"{H_MSG_ID} {msg_id!r} is not <author>.<request_id>.<state>.<tag>"
    if (parsed.author, parsed.request_id) != (author, request_id):
        return (f"{H_MSG_ID} {msg_id!r} names {parsed.author}/{parsed.request_id}, the "
                f"subject {author}/{request_id}")  # fmt: skip
    return StoredAck(subject, author, request_id, parsed.state, data, msg_id, seq)


def _keep(rec: StoredAck | str, subject: str) -> StoredAck | None:
    if isinstance(rec, str):
        log.warning("acks.ignored subject=%s reason=%s", subject, rec)
        return None
    return rec


async def _get(js: Any, subjects: StreamSubjects, **query: Any) -> tuple[int, StoredAck | None]:
    """One stored record (``STREAM.MSG.GET``: the stored headers as they are, without the
    ones a direct get adds): (its sequence, the record if attributed); (0, None) when there
    is none."""
    try:
        raw = await js.get_msg(ACK_STREAM, **query)
    except NotFoundError:
        return 0, None
    subject = raw.subject or ""
    rec = attribute(subject, raw.headers, raw.data or b"", raw.seq, subjects)
    return int(raw.seq or 0), _keep(rec, subject)


async def all_records(
    nc: NATS, request_id: str, *, subjects: StreamSubjects, author: str | None = None,
    timeout_s: float = 2.0,
) -> list[StoredAck]:  # fmt: skip
    """Every attributed record stored for ``request_id`` (by ``author`` only, when given),
    oldest first; anything else on its subjects is logged and left out."""
    check_request_id(request_id)
    js = nc.jetstream(timeout=timeout_s)
    subject = subjects.acks_of(request_id) if author is None else subjects.ack(author, request_id)
    return (await _read(js, subjects, subject, after=0))[1]


async def _read(
    js: Any, subjects: StreamSubjects, subject: str, *, after: int
) -> tuple[int, list[StoredAck]]:
    """The attributed records stored on ``subject`` after sequence ``after``, oldest first,
    and the last sequence read (``after`` when there was none): where to read on from."""
    out: list[StoredAck] = []
    for _ in range(MAX_RECORDS):
        seq, rec = await _get(js, subjects, seq=after + 1, subject=subject, next=True)
        if not seq:
            break
        after = seq
        if rec is not None:
            out.append(rec)
    return after, out


async def last_record(
    nc: NATS, request_id: str, *, subjects: StreamSubjects, author: str | None = None,
    timeout_s: float = 2.0,
) -> StoredAck | None:  # fmt: skip
    """The latest attributed record of ``request_id`` (by ``author`` only, when given)."""
    check_request_id(request_id)
    js = nc.jetstream(timeout=timeout_s)
    subject = subjects.acks_of(request_id) if author is None else subjects.ack(author, request_id)
    seq, got = await _get(js, subjects, subject=subject)
    if not seq or got is not None:
        return got
    found = await all_records(nc, request_id, subjects=subjects, author=author,
                              timeout_s=timeout_s)  # fmt: skip
    return found[-1] if found else None


Accept = Callable[[StoredAck], StoredAck | None]
"""Told of each attributed record of a request, oldest first (history, then live); returns
the record to answer with (possibly one it was told of earlier), or None to go on."""


REREAD_S = 2.0
"""A wait reads ``REACH_ACKS`` again this often (from where it left off): its core
subscription hears nothing published while its connection is down (a reconnect) or before
a cluster's other nodes learnt its interest, and the record is in the stream all the same.
Such a record answers at most this long (and a read) after the stream can be read again;
each wait costs one message get this often, one more per record stored meanwhile."""


async def wait_for(
    nc: NATS, request_id: str, timeout_s: float, *, subjects: StreamSubjects, accept: Accept,
    again: Callable[[], Awaitable[StoredAck | None]] | None = None,
) -> StoredAck:  # fmt: skip
    """The record ``accept`` settles on among those of ``request_id``, stored or yet to come.

    Subscribes to every author's subject of the request before reading the stream, so a
    record stored in between is not missed (a record seen both ways is told once); reads
    the stream on every ``REREAD_S``, so a record the subscription missed (stored while the
    connection was down) is told too. ``again``, asked before each of those reads, may
    settle on a record told earlier (what it learnt meanwhile makes one the answer). A read
    that fails (JetStream electing a leader, no answer in time) is logged and the wait goes
    on listening and reading. Raises ``TimeoutError`` after ``timeout_s`` seconds — or, when
    no read of the stream succeeded in that time, what the last read raised: the wait could
    not tell —, ``ConnectionClosedError`` once the connection is closed.
    """
    check_request_id(request_id)
    live: asyncio.Queue[StoredAck] = asyncio.Queue()

    async def on_msg(msg: Any) -> None:
        rec = _keep(attribute(msg.subject, msg.headers, msg.data, None, subjects), msg.subject)
        if rec is not None:
            live.put_nowait(rec)

    seen: set[str] = set()

    def tell(rec: StoredAck) -> StoredAck | None:
        if rec.msg_id in seen:
            return None
        seen.add(rec.msg_id)
        return accept(rec)

    async def heard_while(reading: asyncio.Future[tuple[int, list[StoredAck]]]) -> StoredAck | None:
        """The answer among the records heard live while ``reading`` runs, or None once it
        is done: a read the store is slow to answer (up to 2 s) does not hold up a record
        heard meanwhile (nemesis seed 77: c1-000380's one wait, 1.4 s, spent in a read while
        a4's completed record was heard 0.39 s before the deadline)."""
        while not reading.done():
            getting = asyncio.ensure_future(live.get())
            try:
                await asyncio.wait((reading, getting), return_when=asyncio.FIRST_COMPLETED)
            finally:
                getting.cancel()  # (not done: no record taken from the queue)
            if getting.done() and not getting.cancelled():
                answer = tell(getting.result())
                if answer is not None:
                    return answer
        return None

    async def heard() -> StoredAck | None:
        """The answer among the records heard live for ``REREAD_S``, or None."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(REREAD_S):
                while True:
                    answer = tell(await live.get())
                    if answer is not None:
                        return answer
        return None

    unread: NatsError | None = None
    """The last read's error while no read has succeeded: the wait cannot tell yet."""
    have_read = False

    async def reread(after: int, *, first: bool = False) -> tuple[int, list[StoredAck]]:
        """:func:`_read` on from ``after``; nothing new when the stream cannot say now."""
        nonlocal unread, have_read
        try:
            if first:  # not nc.flush: see roundtrip
                await round_trip(nc, max(1, int(min(timeout_s, 2.0))))
            read = await _read(js, subjects, subject, after=after)
        except NatsError as exc:  # nats-py's TimeoutError is one
            if nc.is_closed:
                raise  # nothing more is heard either
            if not have_read:
                unread = exc
            log.debug("acks.reread_failed request_id=%s error=%r: listening on", request_id,
                      exc)  # fmt: skip
            return after, []
        have_read, unread = True, None
        return read

    subject = subjects.acks_of(request_id)
    js = nc.jetstream(timeout=min(timeout_s, 2.0))
    sub = await nc.subscribe(subject, cb=on_msg)
    reading: asyncio.Future[tuple[int, list[StoredAck]]] | None = None
    try:
        async with asyncio.timeout(timeout_s):
            reading = asyncio.ensure_future(reread(0, first=True))
            rereads = 0
            while True:
                answer = await heard_while(reading)
                if answer is not None:
                    return answer
                read, found = reading.result()
                for rec in found:
                    answer = tell(rec)
                    if answer is not None:
                        if rereads:
                            log.debug("acks.reread_found request_id=%s msg_id=%s rereads=%d",
                                      request_id, answer.msg_id, rereads)  # fmt: skip
                        return answer
                answer = await heard()
                if answer is None and again is not None:
                    answer = await again()
                if answer is not None:
                    return answer
                rereads += 1
                reading = asyncio.ensure_future(reread(read))
    except TimeoutError:
        if unread is not None:
            raise unread from None
        raise
    finally:
        if reading is not None:
            if not reading.done():
                reading.cancel()
            elif not reading.cancelled():
                reading.exception()  # (retrieved: an answer heard as it failed)
        with contextlib.suppress(Exception):
            await sub.unsubscribe()


async def final_at(
    nc: NATS, subject: str, *, subjects: StreamSubjects, timeout_s: float = 2.0
) -> StoredAck | None:
    """The first attributed ``completed``/``failed`` record stored on exactly ``subject`` (one
    author's records of one request: a claim holder's result location), or None."""
    author, request_id = subjects.ack_of(subject)
    found = await all_records(nc, request_id, subjects=subjects, author=author,
                              timeout_s=timeout_s)  # fmt: skip
    return next((r for r in found if r.state in FINAL_STATES), None)


async def wait_final_at(
    nc: NATS, subject: str, timeout_s: float, *, subjects: StreamSubjects
) -> StoredAck:
    """:func:`final_at`, waiting up to ``timeout_s`` for one to be stored (see
    :func:`wait_for`). Raises ``TimeoutError``."""
    author, request_id = subjects.ack_of(subject)

    def accept(rec: StoredAck) -> StoredAck | None:
        return rec if rec.author == author and rec.state in FINAL_STATES else None

    return await wait_for(nc, request_id, timeout_s, subjects=subjects, accept=accept)


Completed = Callable[[str, str], None]
"""Told of a stored ``completed`` record: (request id, author)."""

CATCH_UP_IDLE_S = 5.0
"""A catch-up that delivers nothing for this long has nothing (more) to deliver."""


class CatchUp:
    """Every attributed ``completed`` record stored since a time, told to a callback
    (request id, author) through one ordered consumer delivering headers only (the message
    id says author, request and state); it ends itself once caught up (nothing pending, or
    nothing delivered for ``CATCH_UP_IDLE_S``): a reader learns of later records as they are
    published. Not a :class:`~jetstream.follow.Follower`: a catch-up has an end, and one
    whose consumer is lost on the way ends early (what it did not tell is not known to the
    reader: the broker's releaser then keeps those claims as running, which costs memory,
    never a release: a release reads the record first)."""

    def __init__(self, nc: NATS, cb: Completed, *, since: float, subjects: StreamSubjects) -> None:
        self.nc = nc
        self.cb = cb
        self.since = since
        self.subjects = subjects
        self.told = 0
        self._sub: Any = None
        self._task: asyncio.Task[None] | None = None
        self._done = asyncio.Event()
        self._last = 0.0

    def start(self) -> None:
        """Begin in the background: its owner's start never waits for it, nor fails with it
        (a stream without a leader now is logged, and the catch-up given up)."""
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="reach-acks-catch-up")

    async def _run(self) -> None:
        js = self.nc.jetstream()
        try:
            info = await js.stream_info(ACK_STREAM)
            if not info.state.messages:
                return
            start = datetime.fromtimestamp(max(self.since, 0.0), UTC)
            config = api.ConsumerConfig(deliver_policy=api.DeliverPolicy.BY_START_TIME,
                                        opt_start_time=start, headers_only=True)  # fmt: skip
            self._last = time.monotonic()
            self._sub = await js.subscribe(self.subjects.all_acks, stream=ACK_STREAM,
                                           cb=self._on_msg, ordered_consumer=True,
                                           config=config, pending_msgs_limit=1_000_000)  # fmt: skip
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - no stream, no leader, a timeout: given up
            log.warning("acks.catch_up_failed error=%r: records stored before this start are "
                        "not read", exc)  # fmt: skip
            return
        await self._end_when_caught_up()

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        await self._unsubscribe()

    async def _on_msg(self, msg: Any) -> None:
        self._last = time.monotonic()
        rec = attribute(msg.subject, msg.headers, b"", None, self.subjects)
        if isinstance(rec, StoredAck) and rec.state == "completed":
            self.told += 1
            self.cb(rec.request_id, rec.author)
        if msg.metadata.num_pending == 0:
            self._done.set()

    async def _end_when_caught_up(self) -> None:
        while not self._done.is_set():
            idle = CATCH_UP_IDLE_S - (time.monotonic() - self._last)
            if idle <= 0:
                break
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._done.wait(), idle)
        await self._unsubscribe()
        log.info("acks.caught_up completed=%d", self.told)

    async def _unsubscribe(self) -> None:
        if self._sub is not None:
            sub, self._sub = self._sub, None
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
