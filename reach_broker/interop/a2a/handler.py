"""A2A ``SendMessage`` (and 0.3's ``message/send``) as a reach call, and back.

The a2a-sdk's JSON-RPC dispatcher parses and checks the request and writes the response;
:class:`GatewayHandler` is its request handler: it finds the skill (the endpoint's
capability, or metadata ``skill``), turns the message into a payload (:func:`payload_of`),
calls through the gateway's :class:`reach_agent.Client` — routing, receipts, retries,
failover, one request id — and answers:

* the agent's result → a ``Message`` (role agent) whose one part is the result (a string as
  a text part, anything else as a data part), metadata ``request_id`` and ``capability``;
* ``BIZ_REJECT``, ``INPUT_REQUIRED`` → a ``Task`` in state ``REJECTED``; ``INTERNAL``,
  ``LOOP_DETECTED``, ``STREAM_BROKEN`` (the agent took it and failed) → a ``Task`` in state
  ``FAILED``, its status message ``CODE: message``;
* nothing took it (``NO_REACHABLE_AGENT`` with the route's reason, ``OVERLOADED``,
  ``TIMEOUT``, ``TARGET_BUSY``, ...) → a JSON-RPC error ``-32603`` whose message is
  ``CODE: message`` and whose ``data`` carries ``code``; a bad request → ``-32602``.

``SendStreamingMessage`` streams: a ``Task`` (``WORKING``) once the first chunk is there,
each chunk as an artifact update, then the ``COMPLETED`` status (the client's
:meth:`~reach_agent.Client.stream`; a plain handler's result is one chunk). The gateway
keeps no tasks: ``GetTask`` answers task-not-found.

``CancelTask`` (0.3: ``tasks/cancel``) of a task id — the request id, as every ``Task`` the
gateway answers names it — is :meth:`reach_agent.Client.cancel`: the agent running it is
told, a message still waiting on it ends as a ``Task`` in state ``CANCELED``, and the
answer is that ``CANCELED`` task; one that had finished is task-not-cancelable.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncGenerator, Callable
from typing import Any

from a2a.server.context import ServerCallContext
from a2a.server.events.event_queue import Event
from a2a.server.request_handlers.request_handler import RequestHandler
from a2a.types import a2a_pb2 as pb
from a2a.utils.errors import (
    ExtendedAgentCardNotConfiguredError,
    InternalError,
    InvalidParamsError,
    PushNotificationNotSupportedError,
    TaskNotCancelableError,
    TaskNotFoundError,
)
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
)

from .local import PINNED

SAFE_INT = 2**53
"""Whole numbers below this arrive as ints (protobuf's ``Value`` holds every number as a
double; JSON does not tell 4 from 4.0)."""


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
    """The task payload of a message: its one ``data`` part's value, or ``{"text": ...}``
    of its text parts (joined by newlines). Anything else is refused, naming the part."""
    texts: list[str] = []
    data: list[Any] = []
    for i, part in enumerate(message.parts):
        kind = part.WhichOneof("content")
        if kind == "text":
            texts.append(part.text)
        elif kind == "data":
            data.append(json_of(MessageToDict(part.data)))
        else:
            raise InvalidParamsError(
                message=f"message.parts[{i}] is a {kind or 'empty'} part: the gateway forwards "
                "text parts or one data part (a JSON value)"
            )
    if data and (texts or len(data) > 1):
        raise InvalidParamsError(
            message=f"message has {len(data)} data and {len(texts)} text parts: send one data "
            "part (the payload) or only text parts"
        )
    if data:
        return data[0]
    if not texts:
        raise InvalidParamsError(message="message.parts is empty: nothing to send")
    return {"text": "\n".join(texts)}


def check_required(params: pb.SendMessageRequest) -> None:
    """The REQUIRED fields of a ``SendMessageRequest`` (the a2a-sdk's own check,
    ``validate_proto_required_fields``, costs 0.18 ms a request; this one a microsecond)."""
    if not params.HasField("message"):
        raise InvalidParamsError(message="params.message is required")
    if not params.message.message_id:
        raise InvalidParamsError(message="params.message.messageId is required")
    if params.message.role == pb.ROLE_UNSPECIFIED:
        raise InvalidParamsError(message="params.message.role is required (ROLE_USER)")


def metadata_of(struct: struct_pb2.Struct) -> dict[str, Any]:
    return json_of(MessageToDict(struct)) if struct.fields else {}


def part_of(value: Any) -> pb.Part:
    """A result (or chunk) as a part: a string as text, any other JSON value as data."""
    if isinstance(value, str):
        return pb.Part(text=value, media_type="text/plain")
    return pb.Part(data=ParseDict(value, struct_pb2.Value()), media_type="application/json")


class Target:
    """Where one request goes: the capability, and the agent when it is pinned; the
    request's own options (metadata ``timeout_s``, ``request_id``)."""

    __slots__ = ("agent_id", "capability", "context_id", "request_id", "timeout")

    def __init__(
        self,
        params: pb.SendMessageRequest,
        context: ServerCallContext,
        capabilities_of: Callable[[str], tuple[str, ...] | None],
        default_timeout: float,
    ) -> None:
        check_required(params)
        meta = {**metadata_of(params.message.metadata), **metadata_of(params.metadata)}
        self.agent_id: str | None = context.state.get("agent_id")
        skill = meta.get("skill")
        if skill is not None and not isinstance(skill, str):
            raise InvalidParamsError(message=f"metadata.skill {skill!r} is not a string")
        capability = context.state.get("capability") or skill
        if capability is None and self.agent_id is not None:
            caps = capabilities_of(self.agent_id)
            if caps is None:
                unknown = errors.NoReachableAgent(f"agent {self.agent_id!r} is not registered")
                raise a2a_error(unknown)
            if len(caps) != 1:
                raise InvalidParamsError(
                    message=f"agent {self.agent_id!r} has the skills {', '.join(caps)}: name "
                    "one in metadata.skill"
                )
            capability = caps[0]
        if capability is None:
            raise InvalidParamsError(message="no skill: name one in metadata.skill, or POST to "
                                     "/a2a/<skill>")  # fmt: skip
        self.capability: str = capability
        timeout = meta.get("timeout_s", default_timeout)
        if isinstance(timeout, bool) or not isinstance(timeout, int | float) or timeout <= 0:
            raise InvalidParamsError(message=f"metadata.timeout_s {timeout!r} is not a "
                                     "number of seconds above 0")  # fmt: skip
        self.timeout = float(timeout)
        request_id = meta.get("request_id")
        if request_id is not None and (not isinstance(request_id, str) or not request_id):
            raise InvalidParamsError(message=f"metadata.request_id {request_id!r} is not a "
                                     "non-empty string")  # fmt: skip
        self.request_id: str = request_id or str(uuid.uuid4())
        self.context_id = params.message.context_id or self.request_id

    def metadata(self) -> dict[str, str]:
        return {"request_id": self.request_id, "capability": self.capability}

    def answer(self, value: Any) -> pb.Message:
        return pb.Message(message_id=str(uuid.uuid4()), context_id=self.context_id,
                          role=pb.ROLE_AGENT, parts=[part_of(value)],
                          metadata=self.metadata())  # fmt: skip

    def task(self, state: pb.TaskState, text: str | None = None) -> pb.Task:
        status = pb.TaskStatus(state=state)
        if text is not None:
            status.message.CopyFrom(pb.Message(
                message_id=str(uuid.uuid4()), context_id=self.context_id, task_id=self.request_id,
                role=pb.ROLE_AGENT, parts=[pb.Part(text=text)],
            ))  # fmt: skip
        return pb.Task(id=self.request_id, context_id=self.context_id, status=status,
                       metadata=self.metadata())  # fmt: skip


def outcome_of(err: ReachError, target: Target) -> pb.Task:
    """What a reach error answers: a ``Task`` when the agent took the request and refused
    or failed it; otherwise it is raised as the A2A error (:func:`a2a_error`)."""
    text = f"{err.code}: {err.message}"
    if isinstance(err, BizReject | InputRequired):  # taken and refused (no second turn here)
        return target.task(pb.TASK_STATE_REJECTED, text)
    if isinstance(err, Cancelled):
        return target.task(pb.TASK_STATE_CANCELED, text)
    if isinstance(err, LoopDetected | StreamBroken | errors.InternalError):
        return target.task(pb.TASK_STATE_FAILED, text)
    raise a2a_error(err) from None


def a2a_error(err: ReachError) -> InvalidParamsError | InternalError:
    """The JSON-RPC error of a request nothing took: its message is ``CODE: message``
    (the route's reason for ``NO_REACHABLE_AGENT``), its data ``{"code": CODE}``."""
    data = {"code": err.code}
    text = f"{err.code}: {err.message}"
    if isinstance(err, RequestError):
        return InvalidParamsError(message=text, data=data)
    return InternalError(message=text, data=data)


class GatewayHandler(RequestHandler):
    """The A2A request handler of the gateway: messages become reach calls."""

    def __init__(
        self,
        client: Client,
        capabilities_of: Callable[[str], tuple[str, ...] | None],
        default_timeout: float,
    ) -> None:
        self.client = client
        self.capabilities_of = capabilities_of
        self.default_timeout = default_timeout

    def target(self, params: pb.SendMessageRequest, context: ServerCallContext) -> Target:
        return Target(params, context, self.capabilities_of, self.default_timeout)

    async def on_message_send(
        self, params: pb.SendMessageRequest, context: ServerCallContext
    ) -> pb.Task | pb.Message:
        target = self.target(params, context)
        payload = payload_of(params.message)
        token = PINNED.set(target.agent_id)
        try:
            result = await self.client.call(target.capability, payload, timeout=target.timeout,
                                            request_id=target.request_id)  # fmt: skip
        except ReachError as err:
            return outcome_of(err, target)
        finally:
            PINNED.reset(token)
        return target.answer(result)

    async def on_message_send_stream(
        self, params: pb.SendMessageRequest, context: ServerCallContext
    ) -> AsyncGenerator[Event]:
        target = self.target(params, context)
        payload = payload_of(params.message)
        chunks = self.client.stream(target.capability, payload, timeout=target.timeout,
                                    request_id=target.request_id).__aiter__()  # fmt: skip
        token = PINNED.set(target.agent_id)
        try:  # routing and retries happen until the first chunk: pinned only until then
            first = await anext(chunks)
        except StopAsyncIteration:
            first = None
        except ReachError as err:
            yield outcome_of(err, target)
            return
        finally:
            PINNED.reset(token)
        yield target.task(pb.TASK_STATE_WORKING)
        index = 0
        try:
            if first is not None:
                yield self._chunk(target, first, index)
                index += 1
                async for chunk in chunks:
                    yield self._chunk(target, chunk, index)
                    index += 1
        except ReachError as err:
            state = (pb.TASK_STATE_REJECTED if isinstance(err, BizReject) else
                     pb.TASK_STATE_CANCELED if isinstance(err, Cancelled) else
                     pb.TASK_STATE_FAILED)  # fmt: skip
            yield self._status(target, state, f"{err.code}: {err.message}")
            return
        yield self._status(target, pb.TASK_STATE_COMPLETED, None)

    @staticmethod
    def _chunk(target: Target, chunk: Any, index: int) -> pb.TaskArtifactUpdateEvent:
        return pb.TaskArtifactUpdateEvent(
            task_id=target.request_id, context_id=target.context_id, append=index > 0,
            artifact=pb.Artifact(artifact_id="result", name="result", parts=[part_of(chunk)]),
        )  # fmt: skip

    @staticmethod
    def _status(target: Target, state: pb.TaskState, text: str | None) -> pb.TaskStatusUpdateEvent:
        task = target.task(state, text)
        return pb.TaskStatusUpdateEvent(task_id=target.request_id, context_id=target.context_id,
                                        status=task.status)  # fmt: skip

    # --- what a stateless gateway does not keep -------------------------------------------

    async def on_get_task(self, params: Any, context: ServerCallContext) -> pb.Task | None:
        return None  # answered TaskNotFoundError: the gateway keeps no tasks

    async def on_list_tasks(self, params: Any, context: ServerCallContext) -> Any:
        return pb.ListTasksResponse()

    async def on_cancel_task(
        self, params: pb.CancelTaskRequest, context: ServerCallContext
    ) -> pb.Task | None:
        """``CancelTask``: the request id's cancel (:meth:`reach_agent.Client.cancel`)."""
        try:
            reply = await self.client.cancel(params.id, reason="A2A CancelTask")
        except ReachError as err:
            raise a2a_error(err) from None
        if reply.state == "finished":
            raise TaskNotCancelableError(message=f"task {params.id} already finished on agent "
                                         f"{reply.agent_id}")  # fmt: skip
        status = pb.TaskStatus(state=pb.TASK_STATE_CANCELED)
        meta = {"request_id": params.id, "cancelled_by": reply.agent_id}
        return pb.Task(id=params.id, context_id=params.id, status=status, metadata=meta)

    async def on_subscribe_to_task(
        self, params: Any, context: ServerCallContext
    ) -> AsyncGenerator[Event]:
        raise TaskNotFoundError(message="the gateway keeps no tasks to subscribe to")
        yield  # an async generator, as the interface requires

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
