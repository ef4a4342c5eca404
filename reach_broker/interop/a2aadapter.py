"""An A2A agent made a reach agent by a sidecar (``reach adapt a2a URL``).

The sidecar reads the agent's card (``<URL>/.well-known/agent-card.json``; A2A 1.0 and 0.3,
through the a2a-sdk's resolver) and is a :class:`reach_agent.Agent` whose capabilities are
the card's skills. Each task becomes an A2A message to the agent, through the a2a-sdk's own
client (JSON-RPC, 1.0's ``SendMessage`` or 0.3's ``message/send``, picked by the card):

* **skills → capabilities** (:func:`capability_of`): each skill id sanitised to a capability
  name (lower case, characters outside ``[a-z0-9_-]`` as ``_``); ``skills=`` picks some,
  ``rename=`` names them; the mapping is :attr:`A2AAdapter.mapping` (the CLI prints it);
* **the message**: its ``message_id`` is the request id and its metadata carries
  ``request_id``, ``skill`` and ``capability``, so the agent can tell a retry; the payload is
  one part (:func:`parts_of`): a string, or ``{"text": s}``, as a text part, any other JSON
  value as a data part;
* **streaming** (the card's ``capabilities.streaming``): ``SendStreamingMessage`` (0.3:
  ``message/stream``), each artifact part a chunk of reach's streamed answer (a caller that
  does not stream gets them joined, :func:`reach_agent.wire.streams.join`); otherwise
  ``SendMessage`` with ``return_immediately`` (0.3: ``blocking: false``) and ``GetTask``
  until the task ends, its artifact parts (one: as it is; several: joined) the result. A
  ``Message`` answer's parts are the result alike;
* **states and errors → reach codes** (:func:`error_of_state`, :func:`error_of_a2a`):
  ``completed`` → the result; ``rejected`` → ``BIZ_REJECT``; ``failed`` → ``INTERNAL``;
  ``canceled`` → ``CANCELLED``; ``input-required`` → ``INPUT_REQUIRED`` and
  ``auth-required`` → ``FORBIDDEN`` (the A2A task is cancelled: reach has no second turn, so
  the caller gets the agent's question at once, never a hang); an HTTP 429/503 →
  ``TARGET_BUSY``; other 4xx → ``BIZ_REJECT``; a JSON-RPC invalid-params error →
  ``INVALID_REQUEST``; 5xx, a timeout or a refused connection → ``TIMEOUT`` (retryable
  elsewhere); the caller's deadline → ``TIMEOUT`` too;
* **cancellation**: a reach request cancelled while it runs (the SDK cancels the handler)
  is forwarded as A2A ``CancelTask`` (0.3: ``tasks/cancel``) for the task the agent made;
  the agent's events are read by a task of their own (:class:`_Events`), so a cancel that
  comes before the agent named its task waits for the name (``CANCEL_TIMEOUT_S``) and
  cancels it, rather than leaving it running;
* **load**: ``active`` in the heartbeats is the tasks in flight through the sidecar;
  ``max_concurrency`` caps them (``TARGET_BUSY`` beyond, without a request);
* **health**: the card is fetched again every second (the agent's readiness check, within
  ``CARD_TIMEOUT_S``); an agent that does not answer makes the sidecar report ``draining``
  at once, so it is out of the routes within 1.5 s, and back once it answers.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import re
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from reach_agent import Agent, Task
from reach_agent.wire import streams
from reach_agent.wire.errors import (
    BizReject,
    Cancelled,
    Forbidden,
    InputRequired,
    InternalError,
    InvalidRequest,
    ReachError,
    Timeout,
)
from reach_agent.wire.schema import check_agent_id, check_capability

from .httpadapter import answers, error_of

if TYPE_CHECKING:
    import httpx
    from a2a.client import Client as A2AClient
    from a2a.types import a2a_pb2 as pb

log = logging.getLogger(__name__)

CARD_TIMEOUT_S = 0.5
"""A card fetch (the health check) slower than this fails: with the check every second, an
agent that hangs is out of the routes within 1.5 s."""
CANCEL_TIMEOUT_S = 2.0
"""How long forwarding a cancel (``CancelTask``) may take."""
DEFAULT_TIMEOUT_S = 300.0
"""How long a task may take when the caller gave no deadline."""
POLL_S = (0.02, 0.05, 0.1, 0.2, 0.5, 1.0)
"""The waits between ``GetTask`` polls of a task still running (the last one repeats)."""

_BAD = re.compile(r"[^a-z0-9_-]+")


def missing_extra() -> str | None:
    """Why the sidecar cannot run here (the a2a-sdk not installed), else None."""
    try:
        import a2a.client  # noqa: F401
        import httpx  # noqa: F401
    except ImportError:
        return "reach adapt a2a needs the a2a-sdk: pip install 'nats-reach[a2a]'"
    return None


def capability_of(skill_id: str) -> str:
    """A skill id as a capability name: lower case, dot-separated tokens of
    ``[a-z0-9][a-z0-9_-]*`` (any other run of characters becomes ``_``), at most 128."""
    tokens = []
    for raw in skill_id.lower().split("."):
        token = _BAD.sub("_", raw).lstrip("_-")
        if token:
            tokens.append(token)
    name = ".".join(tokens)[:128].rstrip(".")
    return name or "skill"


def agent_id_of(name: str) -> str:
    """A card's name as an agent id: ``Echo Agent`` → ``echo-agent``."""
    token = re.sub(r"[^a-z0-9_-]+", "-", name.lower()).strip("-_")[:128]
    return token or "a2a-agent"


def parts_of(payload: Any) -> list[pb.Part]:
    """A task payload as the message's one part: a string (or ``{"text": s}``, what reach's
    own A2A gateway makes of text parts) as a text part, any other JSON value as data."""
    from a2a.types import a2a_pb2 as pb
    from google.protobuf import struct_pb2
    from google.protobuf.json_format import ParseDict

    if isinstance(payload, dict) and set(payload) == {"text"} and isinstance(payload["text"], str):
        payload = payload["text"]
    if isinstance(payload, str):
        return [pb.Part(text=payload, media_type="text/plain")]
    return [pb.Part(data=ParseDict(payload, struct_pb2.Value()), media_type="application/json")]


def value_of(part: pb.Part) -> Any:
    """A result part as a JSON value: text as a string, data as its value, a file as
    ``{"url"|"raw_base64", "filename"?, "media_type"?}``."""
    from google.protobuf.json_format import MessageToDict

    from .a2a.handler import json_of

    kind = part.WhichOneof("content")
    if kind == "text":
        return part.text
    if kind == "data":
        return json_of(MessageToDict(part.data))
    out: dict[str, Any] = {}
    if kind == "url":
        out["url"] = part.url
    elif kind == "raw":
        out["raw_base64"] = base64.b64encode(part.raw).decode("ascii")
    if part.filename:
        out["filename"] = part.filename
    if part.media_type:
        out["media_type"] = part.media_type
    return out


def result_of(values: Sequence[Any]) -> Any:
    """The result of a task that did not stream: one value as it is, several joined."""
    if len(values) == 1:
        return values[0]
    return streams.join(list(values))


def text_of(message: pb.Message) -> str:
    """The text of a status message (its text parts), for an error's message."""
    return " ".join(p.text for p in message.parts if p.WhichOneof("content") == "text")


def error_of_state(state: int, task_id: str, says: str) -> ReachError | None:
    """The reach error of an A2A task that ended (or stopped) in ``state``; None for
    ``completed``."""
    from a2a.types import a2a_pb2 as pb

    text = f"A2A task {task_id} {pb.TaskState.Name(state).removeprefix('TASK_STATE_').lower()}"
    text += f": {says}" if says else ""
    if state == pb.TASK_STATE_COMPLETED:
        return None
    if state == pb.TASK_STATE_REJECTED:
        return BizReject(text)
    if state == pb.TASK_STATE_CANCELED:
        return Cancelled(text)
    if state == pb.TASK_STATE_INPUT_REQUIRED:
        return InputRequired(text)
    if state == pb.TASK_STATE_AUTH_REQUIRED:
        return Forbidden(text)
    return InternalError(text)  # failed, or a state A2A does not define


def error_of_a2a(exc: Exception, url: str) -> ReachError:
    """The reach error of what the a2a-sdk client raised."""
    import httpx
    from a2a.client.errors import A2AClientError, A2AClientTimeoutError
    from a2a.utils import errors as a2a_errors

    cause = exc.__cause__
    if isinstance(exc, A2AClientTimeoutError):
        return Timeout(f"A2A agent {url} did not answer in time")
    if isinstance(exc, A2AClientError):
        if isinstance(cause, httpx.HTTPStatusError):
            status = cause.response.status_code
            return error_of(status, f"A2A agent {url} answered HTTP {status}")
        return Timeout(f"A2A agent {url} unreachable: {exc}")
    message = f"A2A agent {url}: {type(exc).__name__}: {getattr(exc, 'message', exc)}"
    refused = (a2a_errors.InvalidParamsError, a2a_errors.InvalidRequestError,
               a2a_errors.JSONParseError, a2a_errors.ContentTypeNotSupportedError)  # fmt: skip
    if isinstance(exc, refused):
        return InvalidRequest(message)
    return InternalError(message)


class A2AAdapter:
    """One A2A agent behind one sidecar: ``await A2AAdapter.connect(url, ...)`` reads its
    card; ``await start(servers)``, ``await stop()``."""

    def __init__(
        self,
        url: str,
        card: pb.AgentCard,
        http: httpx.AsyncClient,
        client: A2AClient,
        *,
        agent_id: str | None = None,
        skills: Sequence[str] = (),
        rename: dict[str, str] | None = None,
        max_concurrency: int = 8,
        timeout_hint_ms: int | None = None,
        heartbeat_interval: float = 5.0,
        **agent_options: Any,
    ) -> None:
        self.url = url.rstrip("/")
        self.card = card
        self.http = http
        self.client = client
        self.streams = bool(card.capabilities.streaming)
        """The card says the agent streams: tasks go as ``SendStreamingMessage``."""
        known = [s.id for s in card.skills]
        if not known:
            raise InvalidRequest(f"the card of {url} lists no skills: nothing to announce")
        picked = list(skills) or known
        unknown = [s for s in picked if s not in known]
        rename = dict(rename or {})
        unknown += [s for s in rename if s not in known]
        if unknown:
            raise InvalidRequest(f"skills {unknown!r} are not on the card of {url} "
                                 f"(its skills: {', '.join(known)})")  # fmt: skip
        self.mapping: dict[str, str] = {}
        """Skill id → the capability it is announced as (in the card's order)."""
        for skill in picked:
            cap = rename.get(skill) or capability_of(skill)
            check_capability(cap, f"the capability of skill {skill!r}")
            if cap in self.mapping.values():
                raise InvalidRequest(f"skills {[s for s, c in self.mapping.items() if c == cap]!r}"
                                     f" and {skill!r} are both capability {cap!r}: rename one "
                                     "(--capability SKILL=NAME)")  # fmt: skip
            self.mapping[skill] = cap
        self.agent_id = agent_id or agent_id_of(card.name)
        check_agent_id(self.agent_id, "agent_id")
        self.version = version_of(card)
        """The A2A protocol version the client speaks to it (from the card)."""
        self.sent = 0
        """Messages sent to the agent (tests count them)."""
        self.agent = Agent(
            self.agent_id, list(self.mapping.values()), max_concurrency, agent_type="a2a",
            timeout_hint=timeout_hint_ms / 1000 if timeout_hint_ms else None,
            heartbeat_interval=heartbeat_interval, version=card.version or None,
            metadata={"url": self.url, "a2a_version": self.version, "name": card.name},
            readiness=self.ready, **agent_options,
        )  # fmt: skip
        for skill, cap in self.mapping.items():
            handler = self._streamer(skill) if self.streams else self._sender(skill)
            self.agent.handler(cap)(handler)

    @classmethod
    async def connect(cls, url: str, **options: Any) -> A2AAdapter:
        """Read the card at ``url`` and build the adapter (raises ``ConnectionError`` naming
        the URL when there is no card to read)."""
        import httpx
        from a2a.client import A2ACardResolver, ClientConfig, ClientFactory
        from a2a.client.errors import AgentCardResolutionError

        # No read timeout of the client's own: each call has its deadline (asyncio.timeout).
        http = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=5.0))
        try:
            card = await A2ACardResolver(http, url).get_agent_card()
            client = ClientFactory(
                ClientConfig(httpx_client=http, streaming=card.capabilities.streaming)
            ).create(card)
            return cls(url, card, http, client, **options)
        except AgentCardResolutionError as exc:
            await http.aclose()
            raise ConnectionError(f"no A2A agent card at {url}: {exc.message}") from None
        except BaseException:
            await http.aclose()
            raise

    async def start(self, servers: str | list[str] | None = None) -> None:
        await self.agent.start(servers)

    async def stop(self, grace: float | None = None) -> None:
        try:
            await self.agent.stop(grace)
        finally:
            await self.http.aclose()

    async def ready(self) -> bool:
        """Whether the agent answers: its card, fetched within ``CARD_TIMEOUT_S``."""
        from a2a.utils.constants import AGENT_CARD_WELL_KNOWN_PATH

        card = self.url + AGENT_CARD_WELL_KNOWN_PATH
        return await answers(self.http, card, CARD_TIMEOUT_S, "adapt.card_failed")

    # --- one task -------------------------------------------------------------------------

    def _request(self, task: Task, skill: str, *, immediately: bool) -> pb.SendMessageRequest:
        from a2a.types import a2a_pb2 as pb

        meta = {"request_id": task.request_id, "skill": skill, "capability": task.capability}
        message = pb.Message(message_id=task.request_id, role=pb.ROLE_USER,
                             parts=parts_of(task.payload), metadata=meta)  # fmt: skip
        config = pb.SendMessageConfiguration(return_immediately=immediately)
        self.sent += 1
        return pb.SendMessageRequest(message=message, configuration=config)

    def _sender(self, skill: str) -> Callable[[Task], Awaitable[Any]]:
        async def send(task: Task) -> Any:
            return await self._send(task, skill)

        return send

    def _streamer(self, skill: str) -> Callable[[Task], AsyncIterator[Any]]:
        async def stream(task: Task) -> AsyncIterator[Any]:
            async for chunk in self._stream(task, skill):
                yield chunk

        return stream

    async def _send(self, task: Task, skill: str) -> Any:
        """``SendMessage`` (returning at once), then ``GetTask`` until the task ends."""
        request = self._request(task, skill, immediately=True)
        running = _Running(self, _Events(self.client.send_message(request)))
        try:
            async with self._deadline(task):
                async for event in running.events:
                    if event.HasField("message"):
                        return result_of([value_of(p) for p in event.message.parts])
                    running.task_id = event.task.id
                    found = event.task
                    for wait in _polls():
                        if running.ended(found.status.state):
                            break
                        await asyncio.sleep(wait)
                        found = await self._get(found.id)
                    return result_of(running.finish(found))
                raise InternalError(f"A2A agent {self.url} answered nothing")
        except BaseException as exc:
            raise await running.failed(exc) from None
        finally:
            await running.events.close()

    async def _stream(self, task: Task, skill: str) -> AsyncIterator[Any]:
        """``SendStreamingMessage``: each artifact part a chunk, until a final state."""
        request = self._request(task, skill, immediately=False)
        running = _Running(self, _Events(self.client.send_message(request)))
        try:
            async with self._deadline(task):
                async for event in running.events:
                    kind = event.WhichOneof("payload")
                    if kind == "message":
                        for part in event.message.parts:
                            yield value_of(part)
                        return
                    if kind == "task":
                        running.task_id = event.task.id
                        state = event.task.status
                        for artifact in event.task.artifacts:
                            for part in artifact.parts:
                                yield value_of(part)
                    elif kind == "artifact_update":
                        running.task_id = event.artifact_update.task_id
                        for part in event.artifact_update.artifact.parts:
                            yield value_of(part)
                        continue
                    elif kind == "status_update":
                        running.task_id = event.status_update.task_id
                        state = event.status_update.status
                    else:
                        continue
                    if running.ended(state.state):
                        running.check(state)
                        return
                if running.task_id is None:
                    raise InternalError(f"A2A agent {self.url} ended its stream without a task")
                # The stream ended before a final state: ask for it.
                for wait in _polls():
                    found = await self._get(running.task_id)
                    if running.ended(found.status.state):
                        running.check(found.status)
                        return
                    await asyncio.sleep(wait)
        except BaseException as exc:
            raise await running.failed(exc) from None
        finally:
            await running.events.close()

    async def _get(self, task_id: str) -> pb.Task:
        from a2a.types import a2a_pb2 as pb

        return await self.client.get_task(pb.GetTaskRequest(id=task_id))

    def _deadline(self, task: Task) -> asyncio.Timeout:
        left = task.time_left
        return asyncio.timeout(DEFAULT_TIMEOUT_S if left is None else max(left, 0.0))

    async def cancel_remote(self, task_id: str, why: str) -> None:
        """Forward a cancel: ``CancelTask`` (0.3: ``tasks/cancel``), bounded, best effort."""
        from a2a.types import a2a_pb2 as pb

        try:
            async with asyncio.timeout(CANCEL_TIMEOUT_S):
                done = await self.client.cancel_task(pb.CancelTaskRequest(id=task_id))
            log.info("adapt.cancelled url=%s task=%s state=%s why=%s", self.url, task_id,
                     pb.TaskState.Name(done.status.state), why)  # fmt: skip
        except Exception as exc:  # the agent may have ended it already, or be gone
            log.info("adapt.cancel_failed url=%s task=%s why=%s error=%r", self.url, task_id,
                     why, exc)  # fmt: skip


class _Events:
    """The agent's answer to one message (its events), read by a task of their own: a
    cancel of the reach task does not break off the stream before the agent has named its
    task, so that task can still be cancelled (:meth:`task_id`)."""

    __slots__ = ("_queue", "_reader")

    def __init__(self, source: AsyncIterator[Any]) -> None:
        self._queue: asyncio.Queue[Any] = asyncio.Queue()
        self._reader = asyncio.create_task(self._read(source), name="reach-a2a-events")

    async def _read(self, source: AsyncIterator[Any]) -> None:
        try:
            async for event in source:
                self._queue.put_nowait(event)
        except Exception as exc:  # noqa: BLE001 - handed to the reader of the events
            self._queue.put_nowait(exc)
        self._queue.put_nowait(_END)

    def __aiter__(self) -> _Events:
        return self

    async def __anext__(self) -> Any:
        item = await self._queue.get()
        if item is _END:
            self._queue.put_nowait(_END)  # ended for every later read too
            raise StopAsyncIteration
        if isinstance(item, Exception):
            raise item
        return item

    async def task_id(self, within: float) -> str | None:
        """The task the agent names in its next events (waiting ``within`` seconds at most),
        or None: how a cancel that came first finds what to cancel."""
        try:
            async with asyncio.timeout(within):
                async for event in self:
                    task_id = _task_id_of(event)
                    if task_id:
                        return task_id
        except Exception:  # noqa: BLE001 - the agent ended, failed or took too long
            return None
        return None

    async def close(self) -> None:
        self._reader.cancel()
        await asyncio.gather(self._reader, return_exceptions=True)


_END = object()
"""The end of an agent's events."""


def _task_id_of(event: Any) -> str:
    """The task id an event of ``SendMessage`` or ``SendStreamingMessage`` names ("" if none)."""
    kind = event.WhichOneof("payload")
    if kind == "task":
        return str(event.task.id)
    if kind == "artifact_update":
        return str(event.artifact_update.task_id)
    if kind == "status_update":
        return str(event.status_update.task_id)
    return ""


class _Running:
    """The A2A task one reach task made, and how it ends: the result, or a reach error —
    cancelling the A2A task when reach gives it up (cancelled, deadline, a question)."""

    __slots__ = ("adapter", "events", "task_id")

    def __init__(self, adapter: A2AAdapter, events: _Events) -> None:
        self.adapter = adapter
        self.events = events
        self.task_id: str | None = None

    @staticmethod
    def ended(state: int) -> bool:
        """A final state, or one that waits for a second turn (which reach never sends)."""
        from a2a.types import a2a_pb2 as pb

        return state not in (pb.TASK_STATE_SUBMITTED, pb.TASK_STATE_WORKING,
                              pb.TASK_STATE_UNSPECIFIED)  # fmt: skip

    def check(self, status: pb.TaskStatus) -> None:
        """Raise the reach error of a task that did not complete."""
        err = error_of_state(status.state, self.task_id or "?", text_of(status.message))
        if err is not None:
            raise err

    def finish(self, task: pb.Task) -> list[Any]:
        """The values of a task that completed (its artifacts' parts, else its status
        message's); the error of one that did not."""
        self.check(task.status)
        values = [value_of(p) for a in task.artifacts for p in a.parts]
        return values or [value_of(p) for p in task.status.message.parts]

    async def failed(self, exc: BaseException) -> BaseException:
        """What to raise for ``exc`` (ours, the a2a-sdk's, a cancel, the deadline); the A2A
        task is cancelled when reach gives it up."""
        adapter = self.adapter
        if isinstance(exc, InputRequired | Forbidden) and self.task_id:
            await adapter.cancel_remote(self.task_id, exc.code)  # no second turn: free it
        if isinstance(exc, ReachError):
            return exc
        # Cancelled (the reach request was), the deadline, or a stream closed early; before
        # the agent named its task, its name is waited for (bounded).
        if isinstance(exc, asyncio.CancelledError | TimeoutError | GeneratorExit):
            task_id = self.task_id or await self.events.task_id(CANCEL_TIMEOUT_S)
            if task_id:
                await adapter.cancel_remote(task_id, type(exc).__name__)
        if isinstance(exc, TimeoutError):
            return Timeout(f"A2A agent {adapter.url} did not finish within the caller's deadline")
        if not isinstance(exc, Exception):
            return exc  # a cancel (or an exit): as it is
        return error_of_a2a(exc, adapter.url)


def _polls() -> Iterator[float]:
    """The waits between polls: :data:`POLL_S`, then its last value for ever."""
    yield from POLL_S
    while True:
        yield POLL_S[-1]


def version_of(card: pb.AgentCard) -> str:
    """The protocol version of the card's JSON-RPC interface (the client's pick)."""
    for iface in card.supported_interfaces:
        if iface.protocol_binding == "JSONRPC" and iface.protocol_version:
            return iface.protocol_version
    return "1.0"
