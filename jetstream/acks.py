"""Durable acknowledgements on ``REACH_ACKS``: the agent's write-ahead sender and the readers.

An agent records ``received`` and ``completed``/``failed`` for every task. :class:`AckWriter`
appends each record to a local write-ahead file (:mod:`jetstream.wal`) *first*, then
publishes it on ``reach.ack.<request_id>`` with ``Nats-Msg-Id: <request_id>.<state>`` over a
NATS connection of its own, re-sending until JetStream's PubAck confirms; a ``D`` line then
marks it stored. At start the write-ahead files of dead processes of the same agent (and its own
earlier life) are replayed, so a crash between "handler done" and "ack stored" loses nothing.
Re-sends are harmless: the stream's duplicate window drops a second copy of the same id.

The readers find the last record of a request id, or wait for a final one. This module works
on bytes and headers: it knows the stream, not the message type (the state is read from the
``Nats-Msg-Id`` suffix).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, NamedTuple

import msgspec
import nats
from nats.aio.client import Client as NATS
from nats.js.errors import NoStreamResponseError, NotFoundError

from . import wal
from .names import ACK_STREAM, H_MSG_ID, StreamSubjects

log = logging.getLogger(__name__)

FINAL_STATES = ("completed", "failed")
REQUEST_ID_PATTERN = r"^[A-Za-z0-9_-]{1,128}$"
_REQUEST_ID_RE = re.compile(REQUEST_ID_PATTERN)


class InvalidRequestId(ValueError):
    """A request id that cannot be one subject token of ``reach.ack.<request_id>``."""


def check_request_id(request_id: str) -> str:
    if _REQUEST_ID_RE.match(request_id) is None:
        raise InvalidRequestId(
            f"request_id {request_id[:160]!r} is not valid for reach.ack.<request_id> "
            "(1-128 chars of [A-Za-z0-9_-], e.g. a UUID4)"
        )
    return request_id


def ack_msg_id(request_id: str, state: str) -> str:
    return f"{request_id}.{state}"


def state_of(headers: Mapping[str, str] | None) -> str | None:
    """The ack state carried by a stored record's ``Nats-Msg-Id`` (``<rid>.<state>``)."""
    msg_id = (headers or {}).get(H_MSG_ID)
    return msg_id.rpartition(".")[2] if msg_id else None


# --- the write-ahead sender -----------------------------------------------------------------


class AckWriter:
    """Write-ahead, at-least-once sender of ack records (an agent's ``ack_sink``).

    ``record(rec)`` takes any msgspec-encodable object with ``request_id`` and ``state``
    (the SDK's ``AckRecord``), appends it to the write-ahead log (:mod:`jetstream.wal`) and
    returns; a background task publishes it and re-sends with jittered backoff until
    JetStream confirms. ``after_wal(request_id, state)``, when given, is called once a record
    is in the log and before it is queued for sending (tests crash the process there).
    """

    def __init__(
        self,
        wal_dir: str | os.PathLike[str],
        *,
        connect: Mapping[str, Any],
        subjects: StreamSubjects,
        fsync: bool = False,
        batch: int = 256,
        publish_timeout_s: float = 2.0,
        retry_max_s: float = 5.0,
        compact_bytes: int = 1 << 20,
        after_wal: Callable[[str, str], None] | None = None,
    ) -> None:
        self.wal_dir = Path(wal_dir)
        self.connect = dict(connect)
        """nats-py ``connect()`` options (``reach_agent.connection.connect_options``)."""
        self.name: str = self.connect.get("name") or "reach-acks"
        self.subjects = subjects
        self.batch = batch
        self.publish_timeout_s = publish_timeout_s
        self.retry_max_s = retry_max_s
        self.compact_bytes = compact_bytes
        self.after_wal = after_wal
        self.stored = 0
        """Records confirmed by JetStream (duplicates included) since start."""
        self.duplicates = 0
        self.dropped = 0
        """Records refused before the WAL (invalid request id), logged with the reason."""
        self.retries = 0
        self.no_stream = False
        """True while the last attempt found no stream for reach.ack.> (none provisioned)."""
        self._wal = wal.Wal(self.wal_dir, fsync=fsync)
        self._pending: dict[str, wal.Entry] = {}
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._task: asyncio.Task[None] | None = None
        self._nc: NATS | None = None
        self._encoder = msgspec.json.Encoder()

    @property
    def fsync(self) -> bool:
        return self._wal.fsync

    # --- lifecycle --------------------------------------------------------------------

    async def start(self) -> None:
        """Open this process's WAL, adopt the pending records of dead ones, connect."""
        if self._task is not None:
            return
        self._pending.update(self._wal.open())
        self._nc = await nats.connect(**{**self.connect, "error_cb": self._on_error})
        self._task = asyncio.create_task(self._sender(), name=f"{self.name}-sender")
        if self._pending:
            log.info("acks.replaying count=%d dir=%s", len(self._pending), self.wal_dir)
            self._idle.clear()
            self._wake.set()

    async def stop(self, timeout_s: float = 5.0) -> None:
        """Send what is pending (up to ``timeout``), then close; the rest stays in the WAL."""
        if self._task is None:
            return
        # With no stream to store into, waiting is pointless: the WAL keeps the records.
        await self.flush(min(timeout_s, 0.2) if self.no_stream else timeout_s)
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)
        self._task = None
        if self._nc is not None and not self._nc.is_closed:
            with contextlib.suppress(Exception):
                await self._nc.close()
        # Releases the lock; pending lines stay for the next start.
        self._wal.close(remove=not self._pending)

    async def __aenter__(self) -> AckWriter:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    @property
    def pending(self) -> int:
        return len(self._pending)

    async def flush(self, timeout_s: float = 5.0) -> bool:
        """Wait until every record written so far is stored; False on timeout."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
            return True
        except TimeoutError:
            return False

    async def _on_error(self, exc: Exception) -> None:
        log.debug("acks.nats_error error=%s", exc)

    # --- writing ----------------------------------------------------------------------

    async def record(self, rec: Any) -> None:
        """The ``ack_sink`` hook: durable in the WAL on return, stored in JetStream soon."""
        self.write(rec.request_id, rec.state, self._encoder.encode(rec))

    def write(self, request_id: str, state: str, data: bytes) -> None:
        """Append one record to the WAL and queue it for sending."""
        if not self._wal.is_open:
            raise RuntimeError("AckWriter.write before start()")
        try:
            check_request_id(request_id)
        except InvalidRequestId as exc:
            self.dropped += 1
            log.warning("acks.dropped state=%s reason=%s", state, exc)
            return
        msg_id = ack_msg_id(request_id, state)
        entry = self._wal.add(msg_id, self.subjects.ack(request_id), data)
        if self.after_wal is not None:
            self.after_wal(request_id, state)
        self._pending[msg_id] = entry
        self._idle.clear()
        self._wake.set()

    # --- sending ----------------------------------------------------------------------

    async def _sender(self) -> None:
        backoff = 0.05
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._pending:
                batch = list(self._pending.items())[: self.batch]
                results = await asyncio.gather(
                    *(self._publish(msg_id, e) for msg_id, e in batch), return_exceptions=True
                )
                done = [
                    msg_id for (msg_id, _), ok in zip(batch, results, strict=True) if ok is True
                ]
                if done:
                    self._wal.mark_stored(done)
                    for m in done:
                        self._pending.pop(m, None)
                    self.stored += len(done)
                if len(done) < len(batch):
                    self.retries += len(batch) - len(done)
                    failure = next(r for r in results if r is not True)
                    self.no_stream = isinstance(failure, NoStreamResponseError)
                    delay = min(backoff, self.retry_max_s) * (0.5 + random.random())
                    log.warning("acks.retry pending=%d in=%.2fs error=%r",
                                len(self._pending), delay, failure)  # fmt: skip
                    await asyncio.sleep(delay)
                    backoff = min(backoff * 2, self.retry_max_s)
                else:
                    backoff = 0.05
                    self.no_stream = False
            if self._wal.size > self.compact_bytes:
                try:
                    self._wal.compact(self._pending)
                except OSError:
                    log.exception("acks.compact_failed path=%s", self._wal.path)
            if not self._pending:
                self._idle.set()

    async def _publish(self, msg_id: str, entry: wal.Entry) -> bool:
        assert self._nc is not None
        js = self._nc.jetstream(timeout=self.publish_timeout_s)
        if await publish_record(js, entry.subject, msg_id, entry.data):
            self.duplicates += 1
        return True


async def publish_record(js: Any, subject: str, msg_id: str, data: bytes) -> bool:
    """Store one ack record on ``REACH_ACKS`` with its de-duplication id (see
    :func:`ack_msg_id`); returns True when the stream already had it (a duplicate).

    The one writer of ack records: the agent's :class:`AckWriter` and the broker's
    ``failed``/``expired`` records both go through it. Raises what ``js.publish`` raises.
    """
    ack = await js.publish(subject, data, headers={H_MSG_ID: msg_id})
    return bool(ack.duplicate)


# --- readers ----------------------------------------------------------------------------


class StoredAck(NamedTuple):
    subject: str
    data: bytes
    state: str | None
    seq: int | None


async def last_record(
    nc: NATS, request_id: str, *, subjects: StreamSubjects, timeout_s: float = 2.0
) -> StoredAck | None:
    """The latest record stored for ``request_id`` (None when there is none)."""
    check_request_id(request_id)
    js = nc.jetstream(timeout=timeout_s)
    subject = subjects.ack(request_id)
    try:
        raw = await js.get_last_msg(ACK_STREAM, subject, direct=True)
    except NotFoundError:
        return None
    return StoredAck(subject, raw.data or b"", state_of(raw.headers), raw.seq)


async def all_records(
    nc: NATS, request_id: str, *, subjects: StreamSubjects, timeout_s: float = 2.0
) -> list[StoredAck]:
    """Every record stored for ``request_id``, oldest first (for ``reach ack``)."""
    check_request_id(request_id)
    js = nc.jetstream(timeout=timeout_s)
    subject = subjects.ack(request_id)
    out: list[StoredAck] = []
    seq = 0
    while True:
        try:
            raw = await js.get_msg(ACK_STREAM, seq=seq + 1, subject=subject, next=True)
        except NotFoundError:
            return out
        out.append(StoredAck(subject, raw.data or b"", state_of(raw.headers), raw.seq))
        assert raw.seq is not None
        seq = raw.seq
        if len(out) >= 100:  # a request id has at most a handful: stop a runaway loop
            return out


async def wait_final(
    nc: NATS, request_id: str, timeout_s: float, *, subjects: StreamSubjects
) -> StoredAck:
    """The first ``completed``/``failed`` record of ``request_id``, stored or yet to come
    (:func:`wait_final_at` on its ack subject). Raises ``asyncio.TimeoutError`` after
    ``timeout`` seconds."""
    check_request_id(request_id)
    return await wait_final_at(nc, subjects.ack(request_id), timeout_s)


async def final_at(nc: NATS, subject: str, *, timeout_s: float = 2.0) -> StoredAck | None:
    """The ``completed``/``failed`` record stored on exactly ``subject`` (a claim's result
    location), or None while there is none."""
    js = nc.jetstream(timeout=timeout_s)
    try:
        raw = await js.get_last_msg(ACK_STREAM, subject, direct=True)
    except NotFoundError:
        return None
    state = state_of(raw.headers)
    if state in FINAL_STATES:
        return StoredAck(subject, raw.data or b"", state, raw.seq)
    # A late duplicate `received` may follow the final record: walk the subject's records.
    seq = 0
    for _ in range(100):
        try:
            raw = await js.get_msg(ACK_STREAM, seq=seq + 1, subject=subject, next=True)
        except NotFoundError:
            return None
        state = state_of(raw.headers)
        if state in FINAL_STATES:
            return StoredAck(subject, raw.data or b"", state, raw.seq)
        assert raw.seq is not None
        seq = raw.seq
    return None


async def wait_final_at(nc: NATS, subject: str, timeout_s: float) -> StoredAck:
    """:func:`final_at`, waiting up to ``timeout_s`` for one to be stored. Subscribed before
    reading: the SUB and the read leave on one connection in that order, so the server
    delivers any record stored after the read looked. Raises ``TimeoutError``."""
    found: asyncio.Future[StoredAck] = asyncio.get_running_loop().create_future()

    async def on_msg(msg: Any) -> None:
        state = state_of(msg.headers)
        if state in FINAL_STATES and not found.done():
            found.set_result(StoredAck(subject, msg.data, state, None))

    sub = await nc.subscribe(subject, cb=on_msg)
    try:
        stored = await final_at(nc, subject, timeout_s=min(max(timeout_s, 0.1), 2.0))
        if stored is not None:
            return stored
        async with asyncio.timeout(timeout_s):
            return await asyncio.shield(found)
    finally:
        with contextlib.suppress(Exception):
            await sub.unsubscribe()
