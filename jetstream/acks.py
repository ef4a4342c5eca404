"""Durable acknowledgements on ``REACH_ACKS``: the agent's write-ahead sender and the readers.

An agent records ``received`` and ``completed``/``failed`` for every task. :class:`AckWriter`
appends each record to a local write-ahead file (:mod:`jetstream.wal`) *first*, then
publishes it on ``reach.ack.<author>.<request_id>`` (the author is the agent's id: with
reach's credentials nobody else may publish there) with ``Nats-Msg-Id:
<author>.<request_id>.<state>.<tag>`` over a NATS connection of its own, re-sending until
JetStream's PubAck confirms; a ``D`` line then marks it stored. At start the write-ahead
files of dead processes of the same agent (and its own earlier life) are replayed, so a crash
between "handler done" and "ack stored" loses nothing. Re-sends are harmless: the stream's
duplicate window drops a second copy of the same id.

**Folded records.** The sender waits ``linger_s`` (20 ms) after a record before sending what
has come, so a short run's ``received`` and final record are often both unsent when the final
one is written: then ``received`` is not sent at all (marked stored in the log) and the final
record carries its time instead (``received_ms``): one JetStream write (a synced one, under
``sync_interval: always``) per task where there were two.

**Records sent ahead.** An agent's ``completed`` record of a claimed run is its claim's end
(docs/protocol.md, Claims): :meth:`AckWriter.record_ahead` writes it to the WAL and publishes
it over the *agent's* connection, ahead of the reply on that connection, instead of leaving it
to the sender; the agent checks its PubAck after the reply, and one not confirmed goes back
to the sender. One synced write ends the run where a claim's end and a record were two.

The ``tag`` is random, drawn once per record and kept in the write-ahead file: the server
checks the subject a record is published to but never its headers, so a message id anyone
could compute (``beta.<rid>.completed``) would let another agent store it first, on its own
subject, and JetStream's duplicate detection would then drop beta's real record.

The readers are :mod:`jetstream.ackreads`. This module works on bytes and headers: it knows
the stream, not the message type (the state is read from the message id).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import random
import re
import secrets
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any, NamedTuple

import msgspec
import nats
from nats.aio.client import Client as NATS
from nats.js.errors import NoStreamResponseError

from . import wal
from .names import H_MSG_ID, StreamSubjects
from .tasks import raise_if_cancelled

log = logging.getLogger(__name__)

FINAL_STATES = ("completed", "failed")
REQUEST_ID_PATTERN = r"^[A-Za-z0-9_-]{1,128}$"
_REQUEST_ID_RE = re.compile(REQUEST_ID_PATTERN)
TAG_BYTES = 6
"""Random bytes of a message id's tag (12 hex digits)."""


class InvalidRequestId(ValueError):
    """A request id that cannot be one subject token of ``reach.ack.<author>.<request_id>``."""


def check_request_id(request_id: str) -> str:
    if _REQUEST_ID_RE.match(request_id) is None:
        raise InvalidRequestId(
            f"request_id {request_id[:160]!r} is not valid for reach.ack.<author>.<request_id> "
            "(1-128 chars of [A-Za-z0-9_-], e.g. a UUID4)"
        )
    return request_id


class MsgId(NamedTuple):
    """The parts of an ack record's ``Nats-Msg-Id``."""

    author: str
    request_id: str
    state: str
    tag: str


def ack_msg_id(author: str, request_id: str, state: str, tag: str | None = None) -> str:
    """``<author>.<request_id>.<state>.<tag>``; a fresh random ``tag`` unless given."""
    return f"{author}.{request_id}.{state}.{tag or secrets.token_hex(TAG_BYTES)}"


def parse_msg_id(msg_id: str | None) -> MsgId | None:
    """The parts of an ack message id, or None when it is not one."""
    if not msg_id:
        return None
    parts = msg_id.split(".")
    if len(parts) != 4 or not all(parts):
        return None
    return MsgId(*parts)


def state_of(headers: Mapping[str, str] | None) -> str | None:
    """The ack state a record's ``Nats-Msg-Id`` carries."""
    parsed = parse_msg_id((headers or {}).get(H_MSG_ID))
    return parsed.state if parsed else None


# --- the write-ahead sender -----------------------------------------------------------------


class AckWriter:
    """Write-ahead, at-least-once sender of ack records (an agent's ``ack_sink``).

    ``record(rec)`` takes any msgspec-encodable object with ``request_id`` and ``state``
    (the SDK's ``AckRecord``), appends it to the write-ahead log (:mod:`jetstream.wal`) and
    returns; a background task publishes it on ``subjects.ack(author, request_id)`` and
    re-sends with jittered backoff until JetStream confirms. ``author`` is the agent id the
    writer writes for (its credential may publish only its own ack subjects).
    ``after_wal(request_id, state)``, when given, is called once a record is in the log and
    before it is queued for sending (tests crash the process there).
    """

    def __init__(
        self,
        wal_dir: str | os.PathLike[str],
        *,
        author: str,
        connect: Mapping[str, Any],
        subjects: StreamSubjects,
        fsync: bool = False,
        batch: int = 256,
        publish_timeout_s: float = 2.0,
        retry_max_s: float = 5.0,
        linger_s: float = 0.02,
        compact_bytes: int = 1 << 20,
        after_wal: Callable[[str, str], None] | None = None,
    ) -> None:
        self.wal_dir = Path(wal_dir)
        self.author = author
        self.connect = dict(connect)
        """nats-py ``connect()`` options (``reach_agent.connection.connect_options``)."""
        self.name: str = self.connect.get("name") or "reach-acks"
        self.subjects = subjects
        self.batch = batch
        self.publish_timeout_s = publish_timeout_s
        self.retry_max_s = retry_max_s
        self.linger_s = linger_s
        """How long the sender waits after a record for more (so a run's ``received`` and
        final record go as one, and records go in batches)."""
        self.compact_bytes = compact_bytes
        self.after_wal = after_wal
        self.stored = 0
        """Records confirmed by JetStream (duplicates included) since start."""
        self.duplicates = 0
        self.dropped = 0
        """Records refused before the WAL (invalid request id), logged with the reason."""
        self.retries = 0
        self.folded = 0
        """``received`` records not sent: folded into their final record (``received_ms``)."""
        self.no_stream = False
        """True while the last attempt found no stream for reach.ack.> (none provisioned)."""
        self._wal = wal.Wal(self.wal_dir, fsync=fsync)
        self._pending: dict[str, wal.Entry] = {}
        self._received: dict[str, tuple[str, int]] = {}
        """request id → (message id, at_ms) of its ``received`` record not sent yet."""
        self._sending: set[str] = set()
        """Message ids of the batch being sent (too late to fold)."""
        self._ahead: set[str] = set()
        """Message ids published by :meth:`record_ahead`, not confirmed yet: the sender
        leaves them alone."""
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
        self._migrate()
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

    def final_unsent(self, request_id: str) -> bytes | None:
        """The final record (``completed``/``failed``) of ``request_id`` this writer holds
        and JetStream has not confirmed yet (its own, or one adopted from a dead process's
        log), or None. O(pending): asked when a process takes over its predecessor's
        claim."""
        for msg_id, entry in self._pending.items():
            parsed = parse_msg_id(msg_id)
            if parsed is None or parsed.request_id != request_id:
                continue
            if parsed.state in FINAL_STATES:
                return entry.data
        return None

    async def flush(self, timeout_s: float = 5.0) -> bool:
        """Wait until every record written so far is stored; False on timeout."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
            return True
        except TimeoutError:
            return False

    def _migrate(self) -> None:
        """Records an older writer left (``Nats-Msg-Id: <request_id>.<state>`` on
        ``reach.ack.<request_id>``) get this writer's subject and message id."""
        old = [m for m in self._pending if parse_msg_id(m) is None]
        for msg_id in old:
            entry = self._pending.pop(msg_id)
            request_id, _, state = msg_id.rpartition(".")
            if not request_id or _REQUEST_ID_RE.match(request_id) is None:
                log.warning("acks.unreadable_wal_entry msg_id=%s dropped", msg_id)
                continue
            new_id = ack_msg_id(self.author, request_id, state)
            self._pending[new_id] = wal.Entry(self.subjects.ack(self.author, request_id),
                                              entry.data)  # fmt: skip
        if old:
            self._wal.compact(self._pending)

    async def _on_error(self, exc: Exception) -> None:
        if "permissions violation" in str(exc):
            # The server refused a record (the credential may not publish there): it stays
            # in the write-ahead log and is re-sent, so say it loudly.
            log.error("acks.refused writer=%s error=%s", self.name, exc)
        else:
            log.debug("acks.nats_error error=%s", exc)

    # --- writing ----------------------------------------------------------------------

    async def record(self, rec: Any) -> None:
        """The ``ack_sink`` hook: durable in the WAL on return, stored in JetStream soon. A
        final record whose ``received`` is still unsent takes its place (the record type's
        ``received_ms`` gets its ``at_ms``; see the module docstring)."""
        self._add(rec)

    async def record_ahead(self, rec: Any, js: Any) -> Callable[[], Awaitable[bool]] | None:
        """:meth:`record` for a final record that must reach the server ahead of what the
        caller publishes next (an agent's reply: the record ends the run's claim, see the
        module docstring): in the WAL, then published at once over ``js`` — the JetStream
        context of the caller's own connection — instead of by the sender. On return it is
        in that connection's buffer, ahead of anything published after it. Await the
        returned function after the reply: True once JetStream confirmed it; False when it
        did not in time, or it could not be published at all (the sender then sends it: the
        same message id, stored once). None when the record was refused (an invalid request
        id, logged): it is not in the WAL, and the caller ends its claim the other way."""
        msg_id = self._add(rec)
        if msg_id is None:
            return None
        entry = self._pending[msg_id]
        self._ahead.add(msg_id)
        try:
            answer = await js.publish_async(entry.subject, entry.data, headers={H_MSG_ID: msg_id})
        except Exception as exc:  # a closed connection: the sender sends it
            self._ahead.discard(msg_id)
            self._wake.set()
            log.info("acks.ahead_unsent msg_id=%s error=%r", msg_id, exc)
            return _unsent

        async def confirmed() -> bool:
            try:
                ack = await asyncio.wait_for(answer, self.publish_timeout_s)
            except Exception as exc:  # noqa: BLE001 - no PubAck: the sender tries again
                log.info("acks.ahead_unconfirmed msg_id=%s error=%r", msg_id, exc)
                self._ahead.discard(msg_id)
                self.retries += 1
                self._wake.set()
                return False
            self._ahead.discard(msg_id)
            if ack.duplicate:
                self.duplicates += 1
            if msg_id in self._pending:
                self._stored([msg_id])
            return True

        return confirmed

    def _add(self, rec: Any) -> str | None:
        """Append ``rec`` to the WAL and queue it (folding an unsent ``received`` into a
        final record); its message id (None: refused, logged)."""
        request_id, state = rec.request_id, rec.state
        if state in FINAL_STATES:
            unsent = self._received.pop(request_id, None)
            if unsent is not None and unsent[0] in self._pending and unsent[0] not in self._sending:
                rec = msgspec.structs.replace(rec, received_ms=unsent[1])
                msg_id = self.write(request_id, state, self._encoder.encode(rec))  # final first
                self._pending.pop(unsent[0])
                self._wal.mark_stored([unsent[0]])
                self.folded += 1
                return msg_id
        msg_id = self.write(request_id, state, self._encoder.encode(rec))
        if state == "received" and msg_id is not None:
            self._received[request_id] = (msg_id, rec.at_ms)
        return msg_id

    def write(self, request_id: str, state: str, data: bytes) -> str | None:
        """Append one record to the WAL and queue it for sending; its message id (None:
        refused, logged)."""
        if not self._wal.is_open:
            raise RuntimeError("AckWriter.write before start()")
        try:
            check_request_id(request_id)
        except InvalidRequestId as exc:
            self.dropped += 1
            log.warning("acks.dropped state=%s reason=%s", state, exc)
            return None
        msg_id = ack_msg_id(self.author, request_id, state)
        entry = self._wal.add(msg_id, self.subjects.ack(self.author, request_id), data)
        if self.after_wal is not None:
            self.after_wal(request_id, state)
        self._pending[msg_id] = entry
        self._idle.clear()
        self._wake.set()
        return msg_id

    # --- sending ----------------------------------------------------------------------

    async def _sender(self) -> None:
        backoff = 0.05
        while True:
            raise_if_cancelled()
            await self._wake.wait()
            if self.linger_s > 0:
                await asyncio.sleep(self.linger_s)  # more may come: a fold, a fuller batch
            self._wake.clear()
            while True:
                # The first ``batch`` pending records (not those sent ahead by their agent),
                # without copying the rest: a backlog of n records is sent in n / batch
                # slices, not n**2 / batch copies.
                sendable = ((m, e) for m, e in self._pending.items() if m not in self._ahead)
                batch = list(itertools.islice(sendable, self.batch))
                if not batch:
                    break
                self._sending = {msg_id for msg_id, _ in batch}
                try:
                    results = await asyncio.gather(
                        *(self._publish(msg_id, e) for msg_id, e in batch),
                        return_exceptions=True,
                    )
                finally:
                    self._sending = set()
                done = [
                    msg_id for (msg_id, _), ok in zip(batch, results, strict=True) if ok is True
                ]
                if done:
                    self._stored(done)
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

    def _stored(self, done: list[str]) -> None:
        """JetStream confirmed ``done``: marked stored in the WAL, no longer pending."""
        self._wal.mark_stored(done)
        for m in done:
            self._pending.pop(m, None)
            parsed = parse_msg_id(m)  # a stored ``received`` can no longer be folded
            if parsed is not None and parsed.state == "received":
                unsent = self._received.get(parsed.request_id)
                if unsent is not None and unsent[0] == m:
                    del self._received[parsed.request_id]
        self.stored += len(done)
        if not self._pending:
            self._idle.set()

    async def _publish(self, msg_id: str, entry: wal.Entry) -> bool:
        assert self._nc is not None
        js = self._nc.jetstream(timeout=self.publish_timeout_s)
        if await publish_record(js, entry.subject, msg_id, entry.data):
            self.duplicates += 1
        return True


async def _unsent() -> bool:
    return False


async def publish_record(js: Any, subject: str, msg_id: str, data: bytes) -> bool:
    """Store one ack record on ``REACH_ACKS`` with its de-duplication id (see
    :func:`ack_msg_id`); returns True when the stream already had it (a duplicate).

    The one writer of ack records: the agent's :class:`AckWriter` and the broker's
    ``failed``/``expired`` records both go through it. Raises what ``js.publish`` raises.
    """
    ack = await js.publish(subject, data, headers={H_MSG_ID: msg_id})
    return bool(ack.duplicate)
