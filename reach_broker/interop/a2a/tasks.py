"""A2A tasks on reach's acks: what the gateway keeps of a task, and how its state is read.

A task is one or more reach requests, its *turns*, answered as one A2A ``Task``. The first
turn's request id is the task id; a follow-up message naming the task (``message.taskId``)
runs as turn n, request id ``<task id>-<n>``. Each turn's truth is its ack records in
``REACH_ACKS`` — written by the agent that took it, or by a broker that settled a cancel —
read with the rule of :func:`reach_agent.client.durable.wait` (:meth:`Tasks.read_turn`):
a turn's state comes from them, and a completed turn's result is the task's artifact.

What the ack records do not hold — the context id, the user's messages (the history),
the turns and who took each, the endpoint the task was made at — the gateway keeps in KV
``reach_a2a_tasks`` (:class:`TaskRecord`), one key per task, ``<owner>.<task id>``, as
long as the ack records live (``max_age`` follows ``REACH_ACKS``). The *owner* is the
gateway's caller: the gateway authenticates one principal (its bearer token, or nobody on
loopback), so the owner is ``anon``, or ``t`` and a digest of the token — tasks made under
another token are not visible. ``ListTasks`` reads the owner's keys through the bucket's
subject filter (``$KV.reach_a2a_tasks.<owner>.>``: the server's per-subject index, so the
caller's tasks of the last 24 h, never a scan of ``REACH_ACKS``) and re-reads the ack
records of the tasks still open only; a record is brought up to date whenever a read finds
its turns moved on (compare-and-set on its revision).

State (the A2A ``TaskState`` of a turn, and of the task):

=============================================  ========================================
the agent took it (its receipt), ``received``  ``TASK_STATE_WORKING``
``completed``                                  ``TASK_STATE_COMPLETED`` (artifact: result)
``failed`` ``CANCELLED``                       ``TASK_STATE_CANCELED``
``failed`` ``BIZ_REJECT``                      ``TASK_STATE_REJECTED``
``failed`` ``INPUT_REQUIRED``                  ``TASK_STATE_INPUT_REQUIRED`` (continuable)
``failed``, any other code                     ``TASK_STATE_FAILED``
no final record, its claim released            ``TASK_STATE_FAILED`` (its agent was lost)
=============================================  ========================================

A task is working while any turn is; otherwise it is in its last turn's state. Its status
timestamp is the latest change of any turn (the order ``ListTasks`` sorts by).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hashlib
import logging
import re
from collections.abc import Callable, Iterable
from typing import Any

import msgspec
from a2a.types import a2a_pb2 as pb
from a2a.utils.errors import InvalidParamsError
from google.protobuf.json_format import ParseDict
from nats.aio.client import Client as NATS
from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError
from nats.js.kv import KeyValue

from jetstream import ackreads, lastvalues
from jetstream.names import A2A_TASKS_BUCKET, A2A_TASKS_STREAM, H_KV_OPERATION
from jetstream.provision import ensure_stream, load_definitions, say_replicas
from reach_agent.client import durable
from reach_agent.wire.schema import AckRecord, Claim
from reach_agent.wire.subjects import Subjects

log = logging.getLogger(__name__)

WORKING = pb.TASK_STATE_WORKING
SUBMITTED = pb.TASK_STATE_SUBMITTED
OPEN = frozenset({SUBMITTED, WORKING})
"""A turn still running (or about to): its ack records are re-read."""
TERMINAL = frozenset({pb.TASK_STATE_COMPLETED, pb.TASK_STATE_FAILED, pb.TASK_STATE_CANCELED,
                      pb.TASK_STATE_REJECTED})  # fmt: skip
"""A task in one of these takes no more messages and cannot be cancelled."""
STATE_OF_CODE = {
    "CANCELLED": pb.TASK_STATE_CANCELED,
    "BIZ_REJECT": pb.TASK_STATE_REJECTED,
    "INPUT_REQUIRED": pb.TASK_STATE_INPUT_REQUIRED,
}
"""The A2A state of a turn that ended with a reach error code (any other: FAILED)."""
MAX_TURNS = 100
"""Messages one task takes (its record holds them all)."""
TASK_ID = re.compile(r"^[A-Za-z0-9_-]{1,128}$")
"""A task id is a request id (docs/protocol.md): anything else names no task."""
READS_AT_ONCE = 16
"""Open tasks whose ack records one ListTasks re-reads concurrently."""
RECORD_GRACE_MS = 30_000
"""How long after a request's claim ended its final ack record may still be on its way
(the agent's write-ahead log publishes it)."""
CHANGE_TRIES = 8
"""Compare-and-set attempts on one record before a change gives up."""


def state_name(state: pb.TaskState) -> str:
    return pb.TaskState.Name(state)


def state_of(name: str) -> pb.TaskState:
    return pb.TaskState.Value(name)


def state_of_code(code: str) -> pb.TaskState:
    return STATE_OF_CODE.get(code, pb.TASK_STATE_FAILED)


def owner_of(token: str | None) -> str:
    """The owner of a gateway's tasks: ``anon`` without a token, else ``t`` and 16 hex
    digits of a digest of it (a KV key token; the token itself is never stored)."""
    if token is None:
        return "anon"
    return "t" + hashlib.blake2b(token.encode(), digest_size=8).hexdigest()


class Turn(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One message of a task, run as one reach request."""

    request_id: str
    state: str
    """Its A2A ``TaskState`` name, as last read."""
    at_ms: int
    """When that state began (Unix ms): the ack record's ``at_ms``, or the gateway's clock."""
    taker: str | None = None
    """The agent that took it (its receipt or result reached the gateway)."""
    text: str | None = None
    """``CODE: message`` of a turn that ended with an error."""


class TaskRecord(msgspec.Struct, kw_only=True, omit_defaults=True):
    """The value of ``<owner>.<task id>`` in KV ``reach_a2a_tasks``."""

    id: str
    context_id: str
    capability: str
    created_ms: int
    turns: list[Turn]
    history: list[dict[str, Any]]
    """The user's messages, oldest first, as A2A 1.0 JSON."""
    agent_id: str | None = None
    """The agent whose endpoint (``/agents/<id>/a2a``) the task was made at: every turn
    goes to it."""

    @property
    def state(self) -> pb.TaskState:
        """Working while any turn is; else its last turn's state."""
        if any(state_of(t.state) in OPEN for t in self.turns):
            return WORKING
        return state_of(self.turns[-1].state)

    @property
    def text(self) -> str | None:
        return None if self.state == WORKING else self.turns[-1].text

    @property
    def updated_ms(self) -> int:
        """The status timestamp: the latest change of any turn."""
        return max(t.at_ms for t in self.turns)

    def with_turn(self, turn: Turn) -> TaskRecord:
        turns = [turn if t.request_id == turn.request_id else t for t in self.turns]
        return msgspec.structs.replace(self, turns=turns)


_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder(TaskRecord)


def status_of(record: TaskRecord) -> pb.TaskStatus:
    status = pb.TaskStatus(state=record.state)
    status.timestamp.FromMilliseconds(record.updated_ms)
    text = record.text
    if text is not None:
        status.message.CopyFrom(pb.Message(
            message_id=f"{record.turns[-1].request_id}-status", context_id=record.context_id,
            task_id=record.id, role=pb.ROLE_AGENT, parts=[pb.Part(text=text)],
        ))  # fmt: skip
    return status


def task_of(
    record: TaskRecord,
    *,
    history_length: int | None = None,
    artifacts: Iterable[pb.Artifact] = (),
) -> pb.Task:  # fmt: skip
    """The A2A ``Task`` of a record: its status, its last ``history_length`` messages (all
    when None, none when 0) and the given artifacts."""
    history = record.history if history_length is None else (
        record.history[-history_length:] if history_length else [])  # fmt: skip
    return pb.Task(
        id=record.id, context_id=record.context_id, status=status_of(record),
        artifacts=list(artifacts),
        history=[ParseDict(m, pb.Message(), ignore_unknown_fields=True) for m in history],
        metadata={"request_id": record.id, "capability": record.capability,
                  "requests": [t.request_id for t in record.turns]},
    )  # fmt: skip


def artifact_id(record: TaskRecord, request_id: str) -> str:
    """``result`` for the first turn's result, ``result-<n>`` for turn n's."""
    n = next(i for i, t in enumerate(record.turns, 1) if t.request_id == request_id)
    return "result" if n == 1 else f"result-{n}"


# --- page tokens: the position after the last task of a page -----------------------------

_TOKEN_PREFIX = "p1."


def page_token(record: TaskRecord) -> str:
    raw = f"{record.updated_ms}:{record.id}".encode()
    return _TOKEN_PREFIX + base64.urlsafe_b64encode(raw).decode().rstrip("=")


def read_page_token(token: str) -> tuple[int, str]:
    """The (status timestamp, task id) a page token stands for; InvalidParamsError when it is
    not one this gateway gave."""
    bad = InvalidParamsError(message=f"params.pageToken {token[:80]!r} is not a page token "
                             "of this gateway (pass nextPageToken as it was given)")  # fmt: skip
    if not token.startswith(_TOKEN_PREFIX):
        raise bad
    body = token[len(_TOKEN_PREFIX) :]
    try:
        ms, _, task_id = base64.urlsafe_b64decode(body + "=" * (-len(body) % 4)).decode() \
            .partition(":")  # fmt: skip
        updated_ms = int(ms)
    except (binascii.Error, UnicodeDecodeError, ValueError):
        raise bad from None
    if not TASK_ID.match(task_id):
        raise bad
    return updated_ms, task_id


def order_key(record: TaskRecord) -> tuple[int, str]:
    """Newest status first; ties by task id (a stable position for page tokens)."""
    return (-record.updated_ms, record.id)


def lost_reason(claim: Claim | None, now_ms: int) -> str | None:
    """Why a request without a final ack record never gets one (None: it may still): its
    claim was released (its agent declared offline mid-run: nothing runs it now), or it
    ended :data:`RECORD_GRACE_MS` ago and its holder stored no record (an agent that writes
    none, e.g. ``durable_acks=False``)."""
    if claim is None:
        return None
    if claim.state == "released":
        return (f"LOST: agent {claim.agent_id} went offline before it finished "
                f"({claim.reason or 'its claim was released'}); nothing runs it now")  # fmt: skip
    if claim.state in ("completed", "failed") and now_ms - claim.at_ms > RECORD_GRACE_MS:
        return (f"LOST: agent {claim.agent_id} ended it ({claim.state}) but stored no ack "
                "record: its result is not kept (an agent without durable acks)")  # fmt: skip
    return None


# --- the store ---------------------------------------------------------------------------


class TasksUnavailable(RuntimeError):
    """The task bucket cannot be used (no JetStream, or it did not answer)."""


class Tasks:
    """The gateway's tasks of one owner: the KV records, and their turns' ack records."""

    def __init__(
        self, nc: NATS, subjects: Subjects, owner: str, wall_ms: Callable[[], int]
    ) -> None:
        self.nc = nc
        self.subjects = subjects
        self.owner = owner
        self.wall_ms = wall_ms
        self.kv: KeyValue | None = None

    @property
    def available(self) -> bool:
        return self.kv is not None

    async def open(self, replicas: int | None) -> None:
        """Provision the bucket (``replicas``: the broker's count; None: the server has no
        JetStream, and the gateway keeps no tasks). The count is a least, never lowering the
        bucket's: it may be the broker's count of the nodes up (one down at a start)."""
        if replicas is None:
            log.warning("a2a.no_tasks the server has no JetStream: SendMessage answers only "
                        "when it has the result, and no task can be read or cancelled")  # fmt: skip
            return
        [definition] = load_definitions(self.subjects, {A2A_TASKS_STREAM: {
            "num_replicas": replicas}}, names=(A2A_TASKS_STREAM,))  # fmt: skip
        say_replicas(await ensure_stream(self.nc, definition, least_replicas=True),
                     "until the gateway starts with enough nodes up")  # fmt: skip
        self.kv = await self.nc.jetstream(timeout=2.0).key_value(A2A_TASKS_BUCKET)

    def _kv(self) -> KeyValue:
        if self.kv is None:
            raise TasksUnavailable("this gateway keeps no tasks: its NATS server has no "
                                   "JetStream")  # fmt: skip
        return self.kv

    def key(self, task_id: str) -> str:
        return f"{self.owner}.{task_id}"

    async def get(self, task_id: str) -> tuple[TaskRecord, int] | None:
        """The record of ``task_id`` and its revision, or None."""
        if not TASK_ID.match(task_id):
            return None
        try:
            entry = await self._kv().get(self.key(task_id))
        except KeyNotFoundError:
            return None
        return _decoder.decode(entry.value or b""), entry.revision or 0

    async def create(self, record: TaskRecord, limit: int) -> bool:
        """Store a new record; False when the task id is taken. A record over ``limit``
        bytes (the connection's ``max_payload``) is refused naming its size."""
        data = _encoder.encode(record)
        if len(data) > limit:
            raise InvalidParamsError(message=f"the message makes a task of {len(data)} bytes, "
                                     f"more than the {limit} a task may keep (its messages "
                                     "are its history)")  # fmt: skip
        try:
            await self._kv().create(self.key(record.id), data)
        except KeyWrongLastSequenceError:
            return False
        return True

    async def change(
        self, task_id: str, edit: Callable[[TaskRecord], TaskRecord | None]
    ) -> TaskRecord | None:
        """Apply ``edit`` to the stored record by compare-and-set (``edit`` returns None: no
        change); the record as stored after it, or None when there is no such task."""
        kv = self._kv()
        for _ in range(CHANGE_TRIES):
            got = await self.get(task_id)
            if got is None:
                return None
            record, revision = got
            changed = edit(record)
            if changed is None:
                return record
            try:
                await kv.update(self.key(task_id), _encoder.encode(changed), last=revision)
                return changed
            except KeyWrongLastSequenceError:
                continue  # changed meanwhile: edit the newer one
        raise TasksUnavailable(f"task {task_id} kept changing: try again")

    async def delete(self, task_id: str) -> None:
        """Forget a task (one whose message nothing took)."""
        try:
            await self._kv().delete(self.key(task_id))
        except Exception as exc:  # noqa: BLE001 - an orphan record, logged; it ages out
            log.warning("a2a.task_not_deleted task=%s error=%r", task_id, exc)

    async def all(self) -> list[TaskRecord]:
        """Every record of this owner (the bucket's subject filter ``<owner>.>``)."""
        self._kv()  # raises when this gateway keeps no tasks
        # Not nats-py's KV watch: it can end before its first key (jetstream/lastvalues.py).
        pre = f"$KV.{A2A_TASKS_BUCKET}."
        stored = await lastvalues.messages(self.nc, A2A_TASKS_STREAM, f"{pre}{self.owner}.>",
                                           name="a2a-tasks", timeout_s=5.0)  # fmt: skip
        out: list[TaskRecord] = []
        for msg in stored:
            if not msg.data or (msg.headers or {}).get(H_KV_OPERATION) in ("DEL", "PURGE"):
                continue
            try:
                out.append(_decoder.decode(msg.data))
            except msgspec.MsgspecError as exc:
                log.warning("a2a.task_unreadable key=%s error=%s", msg.subject[len(pre) :], exc)
        return out

    # --- turns, from their ack records ------------------------------------------------

    async def read_turn(self, turn: Turn) -> tuple[Turn, AckRecord | None]:
        """``turn`` as its ack records tell it now, and its final record (None while it runs):
        the records of its taker or of its claim's holder count, and a broker's final one."""
        rid = turn.request_id
        try:
            stored = await ackreads.all_records(self.nc, rid, subjects=self.subjects)
        except Exception as exc:  # noqa: BLE001 - unreadable now: the record's word stands
            log.info("a2a.acks_unreadable request_id=%s error=%r", rid, exc)
            return turn, None
        claim = await durable.read_claim(self.nc, rid)
        takers = {turn.taker} if turn.taker else set()
        if claim is not None and claim.state != "released":
            takers.add(claim.agent_id)
        final = durable.final_of(stored, takers)
        if final is not None:
            error = final.error or {}
            code = str(error.get("code", "")) if final.state == "failed" else ""
            state = state_of_code(code) if code else pb.TASK_STATE_COMPLETED
            text = f"{code}: {error.get('message', '')}" if code else None
            taker = turn.taker or (claim.agent_id if claim is not None else None)
            return Turn(request_id=rid, state=state_name(state), at_ms=final.at_ms,
                        taker=taker, text=text), final  # fmt: skip
        lost = None if state_of(turn.state) not in OPEN else lost_reason(claim, self.wall_ms())
        if lost is not None:
            return Turn(request_id=rid, state=state_name(pb.TASK_STATE_FAILED),
                        at_ms=self.wall_ms(), taker=turn.taker, text=lost), None  # fmt: skip
        return turn, None

    async def refresh(self, record: TaskRecord) -> TaskRecord:
        """``record`` with its open turns re-read from their ack records (stored back when
        one moved on)."""
        open_turns = [t for t in record.turns if state_of(t.state) in OPEN]
        if not open_turns:
            return record
        read = [await self.read_turn(t) for t in open_turns]
        moved = [t for (t, _), old in zip(read, open_turns, strict=True) if t != old]
        if not moved:
            return record

        def apply(stored: TaskRecord) -> TaskRecord | None:
            out = stored
            for turn in moved:
                current = next((t for t in out.turns if t.request_id == turn.request_id), None)
                if current is not None and state_of(current.state) in OPEN:
                    out = out.with_turn(turn)
            return out if out is not stored else None

        try:
            return await self.change(record.id, apply) or record
        except Exception as exc:  # noqa: BLE001 - stored next time: the read is what counts
            log.info("a2a.task_not_updated task=%s error=%r", record.id, exc)
            updated = record
            for turn in moved:
                updated = updated.with_turn(turn)
            return updated

    async def refresh_all(self, records: list[TaskRecord]) -> list[TaskRecord]:
        """:meth:`refresh` of many, at most :data:`READS_AT_ONCE` at a time."""
        gate = asyncio.Semaphore(READS_AT_ONCE)

        async def one(record: TaskRecord) -> TaskRecord:
            if not any(state_of(t.state) in OPEN for t in record.turns):
                return record
            async with gate:
                return await self.refresh(record)

        return list(await asyncio.gather(*(one(r) for r in records)))

    async def results(
        self, record: TaskRecord, only: str | None = None, known: dict[str, Any] | None = None
    ) -> list[tuple[str, Any]]:
        """The results of the record's completed turns (only the turn ``only``, when given),
        in turn order, each with the id of its artifact (:func:`artifact_id`); ``known``:
        results at hand by request id, not read again."""
        out: list[tuple[str, Any]] = []
        for turn in record.turns:
            if state_of(turn.state) != pb.TASK_STATE_COMPLETED:
                continue
            if only is not None and turn.request_id != only:
                continue
            if known is not None and turn.request_id in known:
                out.append((artifact_id(record, turn.request_id), known[turn.request_id]))
                continue
            _, final = await self.read_turn(turn)
            if final is None or final.state != "completed":
                continue  # (an agent that writes no ack records: no result to show)
            out.append((artifact_id(record, turn.request_id), final.result))
        return out
