"""Streaming, the caller's side: the ordered reader of a streamed answer, and ``Client.stream``.

The protocol is :mod:`reach_agent.wire.streams`'s; the agent's side is
:mod:`reach_agent.agent.streaming`. The reader checks the sequence (in order, a repeat
dropped, a gap or a wrong count ``STREAM_BROKEN``), sends credit as chunks are consumed and
a cancel when it stops early; an agent lost mid-stream is ``STREAM_BROKEN``, never re-run.

"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any, Protocol

import msgspec
from nats.aio.client import Client as NATS

from reach_agent import trace
from reach_agent.wire import schema
from reach_agent.wire.errors import (
    InternalError,
    InvalidRequest,
    ReachError,
    StreamBroken,
    from_reply,
)
from reach_agent.wire.streams import MAX_WINDOW
from reach_agent.wire.subjects import is_inbox

from . import prompting
from .calls import CANCELLED, CLOSED, LOST, Call, StreamStart
from .cancel import Cancels
from .liveness import Liveness

log = trace.logger(__name__)

_decoder = msgspec.json.Decoder()


async def read(
    nc: NATS, call: Call, start: StreamStart, clock: Callable[[], float]
) -> AsyncIterator[Any]:
    """The chunks of ``call``'s streamed answer, from its first message ``start`` on, in
    order; ends at the agent's ``completed``. Sends credit as chunks are consumed and a
    cancel when the reader stops early."""
    agent = call.agents.get(start.attempt)
    half = max(1, call.stream // 2)
    delivered = 0
    credit_to: str | None = None
    finished = False
    try:
        # The count read when an error ends the stream: the lambda binds late on purpose.
        async for msg in _messages(call, start, clock, lambda: delivered):  # noqa: B023
            hdrs = msg.headers or {}
            err = from_reply(hdrs, msg.data)
            if err is not None:
                finished = True
                raise err
            status = hdrs.get(schema.H_STATUS)
            if status == "completed":
                finished = True
                count = hdrs.get(schema.H_CHUNKS)
                if count != str(delivered):
                    raise StreamBroken(
                        f"agent {agent!r} completed the stream with {count} chunks, "
                        f"{delivered} arrived", delivered=delivered,
                    )  # fmt: skip
                return
            if status != "chunk":
                continue  # the receipt
            seq = int(hdrs.get(schema.H_SEQ, "0"))
            if seq <= delivered:
                continue  # a repeat
            if seq != delivered + 1:
                raise StreamBroken(
                    f"chunk {delivered + 1} of agent {agent!r} is missing (got {seq})",
                    delivered=delivered,
                )  # fmt: skip
            # Credit subjects are inboxes: a chunk naming any other reply gets no credit.
            if msg.reply and is_inbox(msg.reply):
                credit_to = msg.reply  # credits go to inboxes only, never a reach subject
            value = _decoder.decode(msg.data) if msg.data else None
            yield value
            delivered = seq
            if credit_to and seq % half == 0:
                await nc.publish(credit_to, b"", headers={schema.H_SEQ: str(seq)})
    finally:
        if not finished and credit_to:
            try:
                cancel = {schema.H_STREAM: "cancel", schema.H_SEQ: str(delivered)}
                await nc.publish(credit_to, b"", headers=cancel)
            except Exception:  # the connection may be gone: the agent times out instead
                log.debug("stream.cancel_failed request_id=%s", call.request_id)


async def read_prompted(
    call: Call, start: StreamStart, clock: Callable[[], float]
) -> AsyncIterator[Any]:
    """The chunks of a Synadia agent's prompt stream (:mod:`~reach_agent.client.prompting`), from
    the first one (``start``) to the end; their protocol has no credit, so the window is
    the subscription's buffer."""
    agent = call.agents.get(start.attempt)
    delivered = 0
    async for msg in _messages(call, start, clock, lambda: delivered):  # noqa: B023
        kind, value = prompting.read(msg, agent)
        if kind == "end":
            return
        if kind == "error":
            raise value
        if kind == "chunk":
            delivered += 1
            yield value


async def _messages(
    call: Call, start: StreamStart, clock: Callable[[], float], delivered: Callable[[], int]
) -> AsyncIterator[Any]:
    """The replies to the stream's attempt, from its first (``start``) on; the deadline, the
    agent's loss or the client closing end it with an error (``delivered``: chunks so far)."""
    attempt, agent = start.attempt, call.agents.get(start.attempt)
    yield start.msg
    while True:
        got = await call.next_reply(call.deadline, clock)
        if got is None:
            raise StreamBroken(
                f"stream from agent {agent!r} did not complete by the call's deadline "
                f"({delivered()} chunks delivered)", delivered=delivered(),
            )  # fmt: skip
        a, msg = got
        if msg is CLOSED:
            raise InternalError("client closed while the stream was in flight")
        if msg is CANCELLED and call.cancelled is not None:
            raise call.cancelled  # Client.cancel: stops at the next chunk
        if msg is LOST:
            raise StreamBroken(
                f"agent {agent!r} was lost mid-stream after {delivered()} chunks: not re-run "
                "(that would repeat them)", delivered=delivered(),
            )  # fmt: skip
        if a == attempt and hasattr(msg, "headers"):
            yield msg  # (not another attempt's reply, nor a marker for a wait that is over)


class Caller(Protocol):
    """What :func:`stream` uses of a :class:`reach_agent.Client`."""

    nc: NATS
    liveness: Liveness
    clock: Callable[[], float]
    cancels: Cancels

    def open_call(self, capability: str, payload: Any, timeout: float | None, ack_mode: Any,
                  request_id: str | None, headers: dict[str, str] | None,
                  traceparent: str | None, filters: schema.Filters,
                  stream: int = 0) -> Call: ...  # fmt: skip
    async def _run(self, call: Call) -> Any: ...
    def close_call(self, call: Call, ok: bool) -> None: ...


async def stream(
    client: Caller,
    capability: str,
    payload: Any,
    *,
    timeout: float | None,  # noqa: ASYNC109 - the whole stream's deadline, as for call()
    window: int,
    request_id: str | None = None,
    headers: dict[str, str] | None = None,
    traceparent: str | None = None,
    filters: schema.Filters = schema.NO_FILTERS,
) -> AsyncIterator[Any]:
    """:meth:`reach_agent.Client.stream`. Until the first chunk the call is routed and
    retried like ``call()``; after it nothing is retried: an agent lost mid-stream raises
    ``StreamBroken`` (``delivered``: the chunks yielded). An agent answering one whole
    result (a plain handler, or the stored result of a request id that already ran) yields
    that result as the only chunk. The deadline covers the whole stream."""
    if not 1 <= window <= MAX_WINDOW:
        raise InvalidRequest(f"window {window!r} is not within 1..{MAX_WINDOW}")
    call = client.open_call(capability, payload, timeout, "completed", request_id, headers,
                            traceparent, filters, window)  # fmt: skip
    ok = False
    gave_up: str | None = None
    everyone = False  # (a cancelled task: every agent it was sent to, see Cancels.tell)
    try:
        value = await client._run(call)
        if not isinstance(value, StreamStart):
            yield value
        else:
            agent = call.agents.get(value.attempt)
            synadia = call.protocol == schema.PROTOCOL_SYNADIA
            if agent is not None:
                # A death mid-stream breaks the stream. A Synadia agent answers no reach
                # probe: the broker's events alone tell (probed, its silence read as a death).
                client.liveness.track(agent, call, probe=not synadia)
            chunks = (read_prompted(call, value, client.clock) if synadia
                      else read(client.nc, call, value, client.clock))  # fmt: skip
            try:
                async for chunk in chunks:
                    yield chunk
            finally:
                if agent is not None:
                    client.liveness.untrack(agent, call)
        ok = True
    except asyncio.CancelledError:
        gave_up, everyone = "the stream was cancelled", True
        raise
    except GeneratorExit:
        gave_up = "the stream's reader stopped"
        raise
    except ReachError:
        if client.clock() >= call.deadline:
            gave_up = "the caller's deadline passed"
        raise
    finally:
        if gave_up is not None:
            client.cancels.tell(call, gave_up, everyone=everyone)
        client.close_call(call, ok)
