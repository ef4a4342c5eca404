"""A2A's JSON-RPC methods as reach calls and reach's durable acks.

The a2a-sdk's JSON-RPC dispatcher parses and checks the request and writes the response;
:class:`GatewayHandler` is its request handler. It finds the skill (the endpoint's
capability, or metadata ``skill``), turns the message into a payload (:func:`payload_of`)
and calls through the gateway's :class:`reach_agent.Client` — routing, receipts, retries,
failover, one request id. How ``SendMessage`` answers:

* **A task, at once** when the request says ``returnImmediately`` (0.3: ``blocking:
  false``) or the capability runs long (its best agent announces a ``timeout_hint_ms`` of
  at least ``a2a.long_task_hint_s``): the message is sent with ``Reach-Ack-Mode:
  received``, and once an agent has taken it the answer is a ``Task`` in state
  ``WORKING`` whose id is the request id. Nothing waits for it in the gateway: the agent
  writes its result to ``REACH_ACKS``, where ``GetTask``, ``ListTasks`` and
  ``SubscribeToTask`` read it (:mod:`.tasks`), also after the broker restarted.
* **The result** otherwise: the agent's result is a ``Message`` (role agent, one part: a
  string as text, anything else as data; metadata ``request_id`` and ``capability``). A
  request the agent took and refused or failed is a ``Task`` in the state of
  :data:`.tasks.STATE_OF_CODE` (``REJECTED``, ``INPUT_REQUIRED``, ``CANCELED``, else
  ``FAILED``) with the status message ``CODE: message``, kept like any task.
* **An error** when nothing took it (``NO_REACHABLE_AGENT`` with the route's reason,
  ``OVERLOADED``, ``TIMEOUT``, ...): JSON-RPC ``-32603``, message ``CODE: message``,
  ``data`` ``{"code": CODE}``; a bad request is ``-32602``.

A message naming a task (``message.taskId``) is the task's next turn: it runs as request
``<task id>-<n>`` on the task's capability (and agent, for a pinned endpoint), preferably
the agent of the earlier turns (the task id is its sticky key), and is answered with the
task. A task in a terminal state takes no more messages (``UnsupportedOperationError``).

``SendStreamingMessage``: for a task answered at once, the ``Task`` (working) once an agent
took it, then its results as artifact updates and its last state as a status update,
read from the ack records as they are stored; otherwise the answer as it is made (a
streaming handler's chunks as they come, ``Client.stream()`` underneath): a ``Task``
(``WORKING``) with the first chunk, each chunk an artifact update (``append`` after the
first), then the ``COMPLETED`` status. ``SubscribeToTask`` is the first kind for any task
not in a terminal state, from its state now: a client that lost its stream opens it again.

``CancelTask`` of a task is :meth:`reach_agent.Client.cancel` of its running requests: the
agent running each is told (its handler sees ``asyncio.CancelledError``), and the answer
is the task in state ``CANCELED``; a task that had finished is task-not-cancelable. A
message still waiting on its result can be cancelled by its request id the same way.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncGenerator, Callable
from typing import Any

import msgspec
from a2a.server.context import ServerCallContext
from a2a.server.events.event_queue import Event
from a2a.server.request_handlers.request_handler import RequestHandler
from a2a.types import a2a_pb2 as pb
from a2a.utils.errors import (
    A2AError,
    ContentTypeNotSupportedError,
    ExtendedAgentCardNotConfiguredError,
    InternalError,
    InvalidParamsError,
    PushNotificationNotSupportedError,
    TaskNotCancelableError,
    TaskNotFoundError,
    UnsupportedOperationError,
)
from a2a.utils.task import validate_history_length, validate_page_size
from google.protobuf import struct_pb2
from google.protobuf.json_format import MessageToDict, ParseDict

from reach_agent.client.client import Client
from reach_agent.wire import errors
from reach_agent.wire.errors import (
    BizReject,
    Cancelled,
    InputRequired,
    LoopDetected,
    ReachError,
    RequestError,
    StreamBroken,
    Timeout,
)

from . import tasks
from .local import PINNED
from .tasks import TaskRecord, Tasks, Turn, state_name, state_of

log = logging.getLogger(__name__)

SAFE_INT = 2**53
"""Whole numbers below this arrive as ints (protobuf's ``Value`` holds every number as a
double; JSON does not tell 4 from 4.0)."""
DEFAULT_PAGE_SIZE = 50
"""Tasks on a ``ListTasks`` page when the request names no ``pageSize`` (the spec's)."""
FOLLOW_SLICE_S = 5.0
"""A task stream waits this long for a final ack record before it reads the task again
(a holder lost meanwhile, a turn added, a record it was not told of)."""
CANCEL_REASON = "A2A CancelTask"


def json_of(value: Any) -> Any:
    """A protobuf ``Value``'s dict form with whole numbers as ints, as the JSON was."""
    if isinstance(value, float) and value.is_integer() and abs(value) < SAFE_INT:
        return int(value)
    if isinstance(value, dict):
        return {k: json_of(v) for k, v in value.items()}
    if isinstance(value, list):
        return [json_of(v) for v in value]
    return value


def payload_of(message: pb.Message) -> Any:
    """The task payload of a message: its one ``data`` part's value; ``{"text": ...}`` of
    only text parts (joined by newlines); with several data parts, or text and data,
    ``{"text"?: ..., "data": [values]}``. Other parts (raw bytes, URLs) are refused with
    ``ContentTypeNotSupportedError`` naming the part: the gateway forwards JSON."""
    texts: list[str] = []
    data: list[Any] = []
    for i, part in enumerate(message.parts):
        kind = part.WhichOneof("content")
        if kind == "text":
            texts.append(part.text)
        elif kind == "data":
            data.append(json_of(MessageToDict(part.data)))
        elif kind is None:
            raise InvalidParamsError(message=f"message.parts[{i}] is empty: a part holds text, "
                                     "data, raw bytes or a URL")  # fmt: skip
        else:
            media = f" ({part.media_type})" if part.media_type else ""
            raise ContentTypeNotSupportedError(
                message=f"message.parts[{i}] is a {kind} part{media}: the gateway forwards text "
                "and data parts (text/plain, application/json) to reach agents"
            )
    if not texts and not data:
        raise InvalidParamsError(message="message.parts is empty: nothing to send")
    if len(data) == 1 and not texts:
        return data[0]
    if not data:
        return {"text": "\n".join(texts)}
    return {"text": "\n".join(texts), "data": data} if texts else {"data": data}


def check_required(params: pb.SendMessageRequest) -> None:
    """The REQUIRED fields of a ``SendMessageRequest`` (the a2a-sdk's own check,
    ``validate_proto_required_fields``, costs 0.18 ms a request; this one a microsecond),
    and its configuration's history length."""
    if not params.HasField("message"):
        raise InvalidParamsError(message="params.message is required")
    if not params.message.message_id:
        raise InvalidParamsError(message="params.message.messageId is required")
    if params.message.role == pb.ROLE_UNSPECIFIED:
        raise InvalidParamsError(message="params.message.role is required (ROLE_USER)")
    if params.HasField("configuration"):
        validate_history_length(params.configuration)
        if params.configuration.HasField("task_push_notification_config"):
            raise PushNotificationNotSupportedError(
                message="push notifications are not supported (the card says so): poll "
                "GetTask or SubscribeToTask"
            )


def metadata_of(struct: struct_pb2.Struct) -> dict[str, Any]:
    return json_of(MessageToDict(struct)) if struct.fields else {}


def part_of(value: Any) -> pb.Part:
    """A result (or chunk) as a part: a string as text, any other JSON value as data."""
    if isinstance(value, str):
        return pb.Part(text=value, media_type="text/plain")
    return pb.Part(data=ParseDict(value, struct_pb2.Value()), media_type="application/json")


def timeout_of(meta: dict[str, Any], default: float) -> float:
    timeout = meta.get("timeout_s", default)
    if isinstance(timeout, bool) or not isinstance(timeout, int | float) or timeout <= 0:
        raise InvalidParamsError(message=f"metadata.timeout_s {timeout!r} is not a "
                                 "number of seconds above 0")  # fmt: skip
    return float(timeout)


class Target:
    """Where one request goes: the capability, and the agent when it is pinned; the
    request's own options (metadata ``timeout_s``, ``request_id``)."""

    __slots__ = ("agent_id", "capability", "context_id", "request_id", "sticky", "timeout")

    def __init__(
        self,
        capability: str,
        agent_id: str | None,
        request_id: str,
        context_id: str,
        timeout: float,
        sticky: str | None = None,
    ) -> None:
        self.capability = capability
        self.agent_id = agent_id
        self.request_id = request_id
        self.context_id = context_id
        self.timeout = timeout
        self.sticky = sticky
        """The sticky key of the call: a task's id, for its later turns."""

    @classmethod
    def of_message(
        cls,
        params: pb.SendMessageRequest,
        context: ServerCallContext,
        capabilities_of: Callable[[str], tuple[str, ...] | None],
        default_timeout: float,
    ) -> Target:
        meta = {**metadata_of(params.message.metadata), **metadata_of(params.metadata)}
        agent_id: str | None = context.state.get("agent_id")
        skill = meta.get("skill")
        if skill is not None and not isinstance(skill, str):
            raise InvalidParamsError(message=f"metadata.skill {skill!r} is not a string")
        capability = context.state.get("capability") or skill
        if capability is None and agent_id is not None:
            caps = capabilities_of(agent_id)
            if caps is None:
                unknown = errors.NoReachableAgent(f"agent {agent_id!r} is not registered")
                raise a2a_error(unknown)
            if len(caps) != 1:
                raise InvalidParamsError(
                    message=f"agent {agent_id!r} has the skills {', '.join(caps)}: name "
                    "one in metadata.skill"
                )
            capability = caps[0]
        if capability is None:
            raise InvalidParamsError(message="no skill: name one in metadata.skill, or POST to "
                                     "/a2a/<skill>")  # fmt: skip
        timeout = timeout_of(meta, default_timeout)
        request_id = meta.get("request_id")
        if request_id is not None and (not isinstance(request_id, str) or not request_id):
            raise InvalidParamsError(message=f"metadata.request_id {request_id!r} is not a "
                                     "non-empty string")  # fmt: skip
        request_id = request_id or str(uuid.uuid4())
        return cls(capability, agent_id, request_id, params.message.context_id or request_id,
                   timeout)  # fmt: skip

    def metadata(self) -> dict[str, str]:
        return {"request_id": self.request_id, "capability": self.capability}

    def answer(self, value: Any) -> pb.Message:
        return pb.Message(message_id=str(uuid.uuid4()), context_id=self.context_id,
                          role=pb.ROLE_AGENT, parts=[part_of(value)],
                          metadata=self.metadata())  # fmt: skip


def outcome_of(err: ReachError) -> tuple[pb.TaskState, str]:
    """The task state and status text of a request the agent took and refused or failed;
    any other error is raised as the A2A error (:func:`a2a_error`)."""
    if isinstance(err, BizReject | InputRequired | Cancelled | LoopDetected | StreamBroken |
                  errors.InternalError):  # fmt: skip
        return tasks.state_of_code(err.code), f"{err.code}: {err.message}"
    raise a2a_error(err) from None


def a2a_error(err: ReachError) -> InvalidParamsError | InternalError:
    """The JSON-RPC error of a request nothing took: its message is ``CODE: message``
    (the route's reason for ``NO_REACHABLE_AGENT``), its data ``{"code": CODE}``."""
    data = {"code": err.code}
    text = f"{err.code}: {err.message}"
    if isinstance(err, RequestError):
        return InvalidParamsError(message=text, data=data)
    return InternalError(message=text, data=data)


def history_entry(message: pb.Message, task_id: str, context_id: str) -> dict[str, Any]:
    """A user's message as the task's history keeps it (with the task's ids)."""
    entry = pb.Message()
    entry.CopyFrom(message)
    entry.task_id, entry.context_id = task_id, context_id
    return MessageToDict(entry)


def artifact_event(record: TaskRecord, artifact: pb.Artifact) -> pb.TaskArtifactUpdateEvent:
    return pb.TaskArtifactUpdateEvent(task_id=record.id, context_id=record.context_id,
                                      artifact=artifact, last_chunk=True)  # fmt: skip


def status_event(record: TaskRecord) -> pb.TaskStatusUpdateEvent:
    return pb.TaskStatusUpdateEvent(task_id=record.id, context_id=record.context_id,
                                    status=tasks.status_of(record))  # fmt: skip


class GatewayHandler(RequestHandler):
    """The A2A request handler of the gateway: messages become reach calls, tasks are
    read from reach's acks (:class:`~.tasks.Tasks`)."""

    def __init__(
        self,
        client: Client,
        tasks: Tasks,
        capabilities_of: Callable[[str], tuple[str, ...] | None],
        hint_of: Callable[[str, str | None], int | None],
        *,
        default_timeout: float,
        long_task_hint_s: float,
        wall_ms: Callable[[], int],
    ) -> None:
        self.client = client
        self.tasks = tasks
        self.capabilities_of = capabilities_of
        self.hint_of = hint_of
        """The ``timeout_hint_ms`` of the agent a capability's message would go to (the
        pinned one, else its best ranked), or None."""
        self.default_timeout = default_timeout
        self.long_task_ms = long_task_hint_s * 1000
        self.wall_ms = wall_ms
        self.waiting: dict[str, tuple[Target, pb.Message]] = {}
        """Messages waiting on their result, by request id (a CancelTask may name them)."""

    # --- SendMessage -------------------------------------------------------------------

    def target(self, params: pb.SendMessageRequest, context: ServerCallContext) -> Target:
        return Target.of_message(params, context, self.capabilities_of, self.default_timeout)

    def runs_long(self, target: Target) -> bool:
        hint = self.hint_of(target.capability, target.agent_id)
        return bool(self.long_task_ms) and hint is not None and hint >= self.long_task_ms

    def at_once(self, params: pb.SendMessageRequest, target: Target) -> bool:
        """Whether the answer is a task as soon as an agent took the message."""
        if params.configuration.return_immediately:
            if not self.tasks.available:
                raise UnsupportedOperationError(message="returnImmediately needs the "
                                                "gateway's tasks, and its NATS server has "
                                                "no JetStream")  # fmt: skip
            return True
        return self.tasks.available and self.runs_long(target)

    async def on_message_send(
        self, params: pb.SendMessageRequest, context: ServerCallContext
    ) -> pb.Task | pb.Message:
        check_required(params)
        history = params.configuration.history_length if (
            params.configuration.HasField("history_length")) else None  # fmt: skip
        if params.message.task_id:
            record, known = await self.next_turn(params, context, stream=False)
            return await self.task(record, history, known)
        target = self.target(params, context)
        payload = payload_of(params.message)
        if self.at_once(params, target):
            return tasks.task_of(await self.start(target, params.message, payload),
                                 history_length=history)  # fmt: skip
        token = PINNED.set(target.agent_id)
        self.waiting[target.request_id] = (target, params.message)
        try:
            result = await self.client.call(target.capability, payload, timeout=target.timeout,
                                            request_id=target.request_id)  # fmt: skip
        except ReachError as err:
            state, text = outcome_of(err)
            record = await self.keep(target, params.message, state, text)
            return tasks.task_of(record, history_length=history)
        finally:
            PINNED.reset(token)
            self.waiting.pop(target.request_id, None)
        return target.answer(result)

    async def start(self, target: Target, message: pb.Message, payload: Any) -> TaskRecord:
        """Send a message as a task answered at once: its record is kept first (a store that
        cannot keep it refuses the message before anything runs), then the message goes
        with ``Reach-Ack-Mode: received``; once an agent took it, the task is working. The
        same request id again is its task."""
        rid = target.request_id
        record = self.record(target, message, tasks.SUBMITTED, None)
        try:
            fresh = await self.tasks.create(record, self.client.nc.max_payload)
        except InvalidParamsError:
            raise
        except Exception as exc:  # noqa: BLE001 - refused before anything runs: retryable
            log.warning("a2a.task_not_kept task=%s error=%r", rid, exc)
            why = f"TIMEOUT: the task could not be kept ({exc!r}); nothing was sent, try again"
            raise InternalError(message=why, data={"code": "TIMEOUT"}) from None
        if not fresh and (got := await self.tasks.get(rid)) is not None:
            record = got[0]
        token = PINNED.set(target.agent_id)
        try:
            receipt = await self.client.call(target.capability, payload, timeout=target.timeout,
                                             ack_mode="received", request_id=rid)  # fmt: skip
        except ReachError as err:
            try:
                state, text = outcome_of(err)
            except A2AError:
                if fresh:  # nothing took it: no task
                    await self.tasks.delete(rid)
                raise
            turn = Turn(request_id=rid, state=state_name(state), at_ms=self.wall_ms(),
                        taker=self.client.takers.get(rid), text=text)  # fmt: skip
        else:
            taker = receipt.agent_id if isinstance(receipt.agent_id, str) else None
            turn = Turn(request_id=rid, state=state_name(tasks.WORKING), at_ms=self.wall_ms(),
                        taker=taker)  # fmt: skip
        finally:
            PINNED.reset(token)

        def taken(stored: TaskRecord) -> TaskRecord | None:
            first = stored.turns[0]
            return stored.with_turn(turn) if state_of(first.state) == tasks.SUBMITTED else None

        try:
            changed = await self.tasks.change(rid, taken)
        except Exception as exc:  # noqa: BLE001 - it runs: a read finds it by its claim
            log.warning("a2a.task_not_updated task=%s error=%r", rid, exc)
            return record.with_turn(turn)
        return await self.tasks.refresh(changed) if changed is not None else record

    def record(
        self,
        target: Target,
        message: pb.Message,
        state: pb.TaskState,
        text: str | None,
        taker: str | None = None,
    ) -> TaskRecord:
        """The record of a new task of one message."""
        now = self.wall_ms()
        rid = target.request_id
        return TaskRecord(
            id=rid, context_id=target.context_id, capability=target.capability,
            created_ms=now, agent_id=target.agent_id,
            turns=[Turn(request_id=rid, state=state_name(state), at_ms=now,
                        taker=taker or self.client.takers.get(rid), text=text)],
            history=[history_entry(message, rid, target.context_id)],
        )  # fmt: skip

    async def keep(
        self,
        target: Target,
        message: pb.Message,
        state: pb.TaskState,
        text: str | None,
    ) -> TaskRecord:
        """The task a message was answered with (its result came, or its end): kept, so
        ``GetTask`` finds it; the one already kept under its request id, if any."""
        record = self.record(target, message, state, text)
        if not self.tasks.available:
            return record  # answered, not kept: the server has no JetStream
        try:
            if await self.tasks.create(record, self.client.nc.max_payload):
                return record
            got = await self.tasks.get(target.request_id)
        except InvalidParamsError:
            raise
        except Exception as exc:  # noqa: BLE001 - the answer stands; only GetTask misses it
            log.warning("a2a.task_not_kept task=%s error=%r", target.request_id, exc)
            return record
        return await self.tasks.refresh(got[0]) if got is not None else record

    async def next_turn(
        self, params: pb.SendMessageRequest, context: ServerCallContext, *, stream: bool
    ) -> tuple[TaskRecord, dict[str, Any]]:
        """A message to an existing task: its next request, ``<task id>-<n>``; the task, and
        the turn's result by its request id when it was waited for (its ack record may not
        be stored yet)."""
        message = params.message
        record = await self.tasks.refresh(await self.scoped(message.task_id, context))
        if message.context_id and message.context_id != record.context_id:
            raise InvalidParamsError(message=f"message.contextId {message.context_id!r} is not "
                                     f"the context of task {record.id} "
                                     f"({record.context_id!r})")  # fmt: skip
        if record.state in tasks.TERMINAL:
            raise UnsupportedOperationError(message=f"task {record.id} is "
                                            f"{state_name(record.state)}: it takes no more "
                                            "messages (send one without taskId)")  # fmt: skip
        meta = {**metadata_of(message.metadata), **metadata_of(params.metadata)}
        payload = payload_of(message)
        rid = ""
        known: dict[str, Any] = {}

        def add(stored: TaskRecord) -> TaskRecord:
            nonlocal rid
            n = len(stored.turns) + 1
            rid = f"{stored.id}-{n}"
            if n > tasks.MAX_TURNS or not tasks.TASK_ID.match(rid):
                raise UnsupportedOperationError(message=f"task {stored.id} takes no more "
                                                f"messages ({n - 1} already): start a new "
                                                "one")  # fmt: skip
            turn = Turn(request_id=rid, state=state_name(tasks.SUBMITTED), at_ms=self.wall_ms())
            entry = history_entry(message, stored.id, stored.context_id)
            return msgspec.structs.replace(stored, turns=[*stored.turns, turn],
                                   history=[*stored.history, entry])  # fmt: skip

        record = await self.change(record.id, add)
        target = Target(record.capability, record.agent_id, rid, record.context_id,
                        timeout_of(meta, self.default_timeout), sticky=record.id)  # fmt: skip
        as_task = stream or params.configuration.return_immediately or self.runs_long(target)
        token = PINNED.set(target.agent_id)
        try:
            value = await self.client.call(target.capability, payload, timeout=target.timeout,
                                           ack_mode="received" if as_task else "completed",
                                           request_id=rid, sticky_key=target.sticky)  # fmt: skip
        except ReachError as err:
            try:
                state, text = outcome_of(err)
            except (InternalError, InvalidParamsError):
                await self.change(record.id, lambda r: drop_turn(r, rid))  # nothing took it
                raise
            turn = Turn(request_id=rid, state=state_name(state), at_ms=self.wall_ms(),
                        taker=self.client.takers.get(rid), text=text)  # fmt: skip
        else:
            done = pb.TASK_STATE_WORKING if as_task else pb.TASK_STATE_COMPLETED
            taker = getattr(value, "agent_id", None) if as_task else None
            turn = Turn(
                request_id=rid,
                state=state_name(done),
                at_ms=self.wall_ms(),
                taker=taker if isinstance(taker, str) else self.client.takers.get(rid),
            )
            if not as_task:
                known[rid] = value
        finally:
            PINNED.reset(token)
        return await self.change(record.id, lambda r: r.with_turn(turn)), known

    async def change(
        self, task_id: str, edit: Callable[[TaskRecord], TaskRecord | None]
    ) -> TaskRecord:
        changed = await self.tasks.change(task_id, edit)
        if changed is None:
            raise TaskNotFoundError(message=f"task {task_id} not found")
        return changed

    # --- SendStreamingMessage, SubscribeToTask -----------------------------------------

    async def on_message_send_stream(
        self, params: pb.SendMessageRequest, context: ServerCallContext
    ) -> AsyncGenerator[Event]:
        check_required(params)
        if params.message.task_id:
            record, _ = await self.next_turn(params, context, stream=True)
            yield await self.task(record, None)
            async for event in self.follow(record, told(record)):
                yield event
            return
        target = self.target(params, context)
        payload = payload_of(params.message)
        if self.tasks.available and self.runs_long(target):
            record = await self.start(target, params.message, payload)
            yield tasks.task_of(record)
            async for event in self.follow(record, set()):
                yield event
            return
        async for event in self.live(target, params.message, payload):
            yield event

    async def live(
        self, target: Target, message: pb.Message, payload: Any
    ) -> AsyncGenerator[Event]:
        """A streamed answer as it is made: the task (working) with the first chunk, each
        chunk an artifact update, the last state a status update."""
        chunks = self.client.stream(target.capability, payload, timeout=target.timeout,
                                    request_id=target.request_id).__aiter__()  # fmt: skip
        token = PINNED.set(target.agent_id)
        try:  # routing and retries happen until the first chunk: pinned only until then
            first = await anext(chunks)
        except StopAsyncIteration:
            first = None
        except ReachError as err:
            state, text = outcome_of(err)
            yield tasks.task_of(await self.keep(target, message, state, text))
            return
        finally:
            PINNED.reset(token)
        record = await self.keep(target, message, tasks.WORKING, None)
        yield tasks.task_of(record)  # (the same request id streamed again: its task)
        index = 0
        done: tuple[pb.TaskState, str | None] = (pb.TASK_STATE_COMPLETED, None)
        try:
            if first is not None:
                yield self.chunk(record, first, index)
                index += 1
                async for chunk in chunks:
                    yield self.chunk(record, chunk, index)
                    index += 1
        except ReachError as err:
            done = (tasks.state_of_code(err.code), f"{err.code}: {err.message}")
        turn = Turn(request_id=record.id, state=state_name(done[0]), at_ms=self.wall_ms(),
                    taker=self.client.takers.get(record.id), text=done[1])  # fmt: skip
        record = record.with_turn(turn)
        if self.tasks.available:
            record = await self.tasks.change(record.id, lambda r: r.with_turn(turn)) or record
        yield status_event(record)

    @staticmethod
    def chunk(record: TaskRecord, chunk: Any, index: int) -> pb.TaskArtifactUpdateEvent:
        return pb.TaskArtifactUpdateEvent(
            task_id=record.id, context_id=record.context_id, append=index > 0,
            artifact=pb.Artifact(artifact_id="result", name="result", parts=[part_of(chunk)]),
        )  # fmt: skip

    async def on_subscribe_to_task(
        self, params: pb.SubscribeToTaskRequest, context: ServerCallContext
    ) -> AsyncGenerator[Event]:
        record = await self.tasks.refresh(await self.scoped(params.id, context))
        if record.state in tasks.TERMINAL:
            raise UnsupportedOperationError(message=f"task {record.id} is "
                                            f"{state_name(record.state)}: nothing more to "
                                            "stream (GetTask gives its final state)")  # fmt: skip
        yield await self.task(record, None)
        async for event in self.follow(record, told(record)):
            yield event

    async def follow(self, record: TaskRecord, told: set[str]) -> AsyncGenerator[Event]:
        """A task's results (artifact updates) and last state (a status update), from its
        ack records as they are stored; ``told``: the turns whose end was already told."""
        while True:
            for turn in record.turns:
                if turn.request_id in told or state_of(turn.state) in tasks.OPEN:
                    continue
                told.add(turn.request_id)
                if state_of(turn.state) == pb.TASK_STATE_COMPLETED:
                    for artifact in await self.artifacts(record, turn.request_id):
                        yield artifact_event(record, artifact)
            if record.state != tasks.WORKING:
                yield status_event(record)
                return
            running = [t for t in record.turns if state_of(t.state) in tasks.OPEN][-1]
            try:
                await self.client.wait(running.request_id, FOLLOW_SLICE_S,
                                       agent_id=running.taker)  # fmt: skip
            except Timeout:
                pass  # read the task again: a lost holder, a new turn, a record missed
            except ReachError:
                pass
            got = await self.tasks.get(record.id)
            if got is None:
                raise TaskNotFoundError(message=f"task {record.id} is gone")
            record = await self.tasks.refresh(got[0])

    # --- GetTask, ListTasks, CancelTask ------------------------------------------------

    async def scoped(self, task_id: str, context: ServerCallContext) -> TaskRecord:
        """The task ``task_id`` as this endpoint sees it: a capability's endpoint its tasks,
        an agent's endpoint the tasks made at it, reach's own endpoint every task."""
        not_found = TaskNotFoundError(message=f"task {task_id[:160]} not found")
        if not self.tasks.available:
            raise not_found
        got = await self.tasks.get(task_id)
        if got is None or not admits(context, got[0]):
            raise not_found
        return got[0]

    async def task(
        self, record: TaskRecord, history_length: int | None, known: dict[str, Any] | None = None
    ) -> pb.Task:
        """The ``Task`` of a record, with its results as artifacts."""
        return tasks.task_of(record, history_length=history_length,
                             artifacts=await self.artifacts(record, known=known))  # fmt: skip

    async def artifacts(
        self, record: TaskRecord, only: str | None = None, known: dict[str, Any] | None = None
    ) -> list[pb.Artifact]:
        results = await self.tasks.results(record, only, known)
        return [pb.Artifact(artifact_id=aid, name="result", parts=[part_of(value)])
                for aid, value in results]  # fmt: skip

    async def on_get_task(self, params: pb.GetTaskRequest, context: ServerCallContext) -> pb.Task:
        validate_history_length(params)
        record = await self.tasks.refresh(await self.scoped(params.id, context))
        history = params.history_length if params.HasField("history_length") else None
        return await self.task(record, history)

    async def on_list_tasks(
        self, params: pb.ListTasksRequest, context: ServerCallContext
    ) -> pb.ListTasksResponse:
        """The caller's tasks at this endpoint, newest status first, filtered and paged."""
        validate_history_length(params)
        size = DEFAULT_PAGE_SIZE
        if params.HasField("page_size"):
            validate_page_size(params.page_size)
            size = params.page_size
        after = tasks.read_page_token(params.page_token) if params.page_token else None
        if not self.tasks.available:
            return pb.ListTasksResponse(page_size=0, total_size=0, next_page_token="")
        records = [r for r in await self.tasks.all() if admits(context, r)
                   and (not params.context_id or r.context_id == params.context_id)]  # fmt: skip
        records = await self.tasks.refresh_all(records)
        if params.status != pb.TASK_STATE_UNSPECIFIED:
            records = [r for r in records if r.state == params.status]
        if params.HasField("status_timestamp_after"):
            since = params.status_timestamp_after.ToMilliseconds()
            records = [r for r in records if r.updated_ms >= since]
        records.sort(key=tasks.order_key)
        total = len(records)
        if after is not None:
            position = (-after[0], after[1])
            records = [r for r in records if tasks.order_key(r) > position]
        page = records[:size]
        history = params.history_length if params.HasField("history_length") else None
        gate = asyncio.Semaphore(tasks.READS_AT_ONCE)

        async def listed(record: TaskRecord) -> pb.Task:
            if not params.include_artifacts:
                return tasks.task_of(record, history_length=history)
            async with gate:
                return await self.task(record, history)

        found = list(await asyncio.gather(*(listed(r) for r in page)))
        more = len(records) > size
        return pb.ListTasksResponse(
            tasks=found, page_size=len(found), total_size=total,
            next_page_token=tasks.page_token(page[-1]) if more and page else "",
        )  # fmt: skip

    async def on_cancel_task(
        self, params: pb.CancelTaskRequest, context: ServerCallContext
    ) -> pb.Task:
        """``CancelTask``: the cancel (:meth:`reach_agent.Client.cancel`) of the task's
        running requests, or of a message still waiting on its result."""
        try:
            record = await self.tasks.refresh(await self.scoped(params.id, context))
        except TaskNotFoundError:
            if params.id not in self.waiting:
                raise
            return await self.cancel_waiting(params.id)
        if record.state in tasks.TERMINAL:
            raise TaskNotCancelableError(message=f"task {record.id} is already "
                                         f"{state_name(record.state)}")  # fmt: skip
        cancelled: list[Turn] = []
        for turn in record.turns:
            if state_of(turn.state) in tasks.OPEN:
                reply = await self.cancel_request(turn.request_id)
                if reply.state != "finished":
                    cancelled.append(Turn(request_id=turn.request_id,
                                          state=state_name(pb.TASK_STATE_CANCELED),
                                          at_ms=self.wall_ms(), taker=turn.taker,
                                          text=f"CANCELLED: {CANCEL_REASON}"))  # fmt: skip
        if record.state == pb.TASK_STATE_INPUT_REQUIRED:  # waiting on the caller: ends here
            last = record.turns[-1]
            cancelled.append(msgspec.structs.replace(last, state=state_name(pb.TASK_STATE_CANCELED),
                                             at_ms=self.wall_ms(),
                                             text=f"CANCELLED: {CANCEL_REASON}"))  # fmt: skip

        def apply(stored: TaskRecord) -> TaskRecord:
            for turn in cancelled:
                stored = stored.with_turn(turn)
            return stored

        record = await self.tasks.refresh(await self.change(record.id, apply))
        if record.state != pb.TASK_STATE_CANCELED:
            raise TaskNotCancelableError(message=f"task {record.id} finished before the "
                                         f"cancel: it is {state_name(record.state)}")  # fmt: skip
        return await self.task(record, None)

    async def cancel_request(self, request_id: str) -> Any:
        try:
            return await self.client.cancel(request_id, reason=CANCEL_REASON)
        except ReachError as err:
            raise a2a_error(err) from None

    async def cancel_waiting(self, request_id: str) -> pb.Task:
        """Cancel a message still waiting on its result: it ends as a task ``CANCELED``
        (kept, so ``GetTask`` finds it)."""
        target, message = self.waiting[request_id]
        reply = await self.cancel_request(request_id)
        if reply.state == "finished":
            raise TaskNotCancelableError(message=f"task {request_id} already finished on "
                                         f"agent {reply.agent_id}")  # fmt: skip
        record = await self.keep(target, message, pb.TASK_STATE_CANCELED,
                                 f"CANCELLED: {CANCEL_REASON}")  # fmt: skip
        return tasks.task_of(record)

    # --- what the gateway does not offer -----------------------------------------------

    async def on_create_task_push_notification_config(self, params: Any, context: Any) -> Any:
        raise PushNotificationNotSupportedError

    async def on_get_task_push_notification_config(self, params: Any, context: Any) -> Any:
        raise PushNotificationNotSupportedError

    async def on_list_task_push_notification_configs(self, params: Any, context: Any) -> Any:
        raise PushNotificationNotSupportedError

    async def on_delete_task_push_notification_config(self, params: Any, context: Any) -> None:
        raise PushNotificationNotSupportedError

    async def on_get_extended_agent_card(self, params: Any, context: Any) -> Any:
        raise ExtendedAgentCardNotConfiguredError


def admits(context: ServerCallContext, record: TaskRecord) -> bool:
    """Whether the endpoint of ``context`` shows ``record`` (see :meth:`GatewayHandler.scoped`)."""
    agent_id = context.state.get("agent_id")
    if agent_id is not None:
        return record.agent_id == agent_id
    capability = context.state.get("capability")
    return capability is None or record.capability == capability


def told(record: TaskRecord) -> set[str]:
    """The turns whose end a task's first event (the ``Task``) already tells."""
    return {t.request_id for t in record.turns if state_of(t.state) not in tasks.OPEN}


def drop_turn(record: TaskRecord, request_id: str) -> TaskRecord | None:
    """``record`` without the turn ``request_id`` (and its message): a turn nothing took."""
    n = next((i for i, t in enumerate(record.turns) if t.request_id == request_id), None)
    if n is None:
        return None
    return msgspec.structs.replace(record, turns=record.turns[:n] + record.turns[n + 1 :],
                           history=record.history[:n] + record.history[n + 1 :])  # fmt: skip
