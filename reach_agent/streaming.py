"""Streamed answers, both sides: the agent sends chunks under credit, the caller reads them.

A handler that is an async generator streams. The caller asks with ``Reach-Stream: 1``
(and ``Reach-Stream-Window: W``, default 64); the agent then sends, on the task's reply
subject, one message per chunk — headers ``Reach-Status: chunk`` and ``Reach-Seq: n``
(1, 2, ...), the chunk's JSON as body, and the agent's *credit subject* as reply subject —
and finally ``Reach-Status: completed`` with ``Reach-Chunks: <count>`` and an empty body (or
an error reply). A caller that did not ask for a stream gets one ordinary result: the
chunks *joined* (:func:`join`).

Flow control is credit: the agent sends chunk ``n`` only while ``n <= credited + W``, where
``credited`` is the highest ``Reach-Seq`` the caller sent back to the credit subject (a
headers-only message, after its reader *consumed* that chunk; every ``W/2`` chunks). A slow
reader therefore holds the handler's generator suspended — the agent never buffers more
than ``W`` chunks, nor does the caller. ``Reach-Stream: cancel`` on the credit subject stops
the stream; a caller that sends no credit for as long as the task's deadline (or
``CREDIT_WAIT_S`` without one) has gone, and the stream ends as ``STREAM_BROKEN``.

The caller checks the sequence: chunks are yielded in order, a repeat is dropped, a gap
or a ``completed`` whose count differs from what arrived is ``STREAM_BROKEN``. So is the
agent dying mid-stream (its liveness, as for any call): the error carries ``delivered``,
and nothing is re-run — the chunks already yielded would repeat.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any, Protocol

import msgspec
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from . import prompting, schema, trace
from .calls import CANCELLED, CLOSED, LOST, Call, StreamStart
from .cancel import Cancels
from .errors import InternalError, InvalidRequest, ReachError, StreamBroken, from_reply
from .liveness import Liveness
from .prompting import join as join  # the rule lives with the codec calls.py uses
from .subjects import is_inbox

log = trace.logger(__name__)

DEFAULT_WINDOW = 64
"""Chunks a reader takes ahead of its credits unless it asks otherwise."""
MAX_WINDOW = 1024
"""The largest window an agent grants (a larger ``Reach-Stream-Window`` is lowered to it)."""
CREDIT_WAIT_S = 60.0
"""How long an agent waits for credit when the task carries no deadline."""

_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder()


class Joined:
    """:func:`join` built up chunk by chunk, from the encoded chunks (no re-encoding)."""

    __slots__ = ("_parts", "_texts")

    def __init__(self) -> None:
        self._parts: list[bytes] = []
        self._texts: list[str] | None = []

    def add(self, chunk: Any, encoded: bytes) -> None:
        self._parts.append(encoded)
        if self._texts is not None:
            if isinstance(chunk, str):
                self._texts.append(chunk)
            else:
                self._texts = None

    def encode(self) -> bytes:
        if self._texts is not None and self._parts:
            return _encoder.encode("".join(self._texts))
        return b"[" + b",".join(self._parts) + b"]"


def window_of(headers: Mapping[str, str]) -> int:
    """The window a streamed task asks for (``Reach-Stream-Window``), within 1..MAX_WINDOW."""
    raw = headers.get(schema.H_STREAM_WINDOW)
    if raw is None:
        return DEFAULT_WINDOW
    try:
        w = int(raw)
    except ValueError:
        w = 0
    if w < 1:
        raise InvalidRequest(f"header Reach-Stream-Window {raw[:40]!r} is not a positive integer")
    return min(w, MAX_WINDOW)


# --- the agent side ---------------------------------------------------------------------


class _Credit:
    __slots__ = ("cancelled", "event", "seq")

    def __init__(self) -> None:
        self.seq = 0
        self.cancelled = False
        self.event = asyncio.Event()


class Credits:
    """The agent's credit subjects: one wildcard subscription ``<inbox>.*``, one token per
    running stream."""

    def __init__(self) -> None:
        self.inbox = ""
        self._streams: dict[str, _Credit] = {}
        self._ids = itertools.count(1)
        self._sub: Any = None

    async def subscribe(self, nc: NATS) -> None:
        self.inbox = nc.new_inbox()
        self._sub = await nc.subscribe(f"{self.inbox}.*", cb=self._on_credit)

    def forget(self) -> None:
        self._sub = None
        self._streams.clear()

    def open(self) -> tuple[str, _Credit]:
        sid = format(next(self._ids), "x")
        credit = self._streams[sid] = _Credit()
        return f"{self.inbox}.{sid}", credit

    def close(self, subject: str) -> None:
        self._streams.pop(subject.rpartition(".")[2], None)

    async def _on_credit(self, msg: Msg) -> None:
        credit = self._streams.get(msg.subject.rpartition(".")[2])
        if credit is None:
            return
        hdrs = msg.headers or {}
        if hdrs.get(schema.H_STREAM) == "cancel":
            credit.cancelled = True
        try:
            seq = int(hdrs.get(schema.H_SEQ, "0"))
        except ValueError:
            seq = 0
        if seq > credit.seq:
            credit.seq = seq
        credit.event.set()


async def send(
    nc: NATS,
    chunks: AsyncIterator[Any],
    *,
    reply: str,
    request_id: str,
    window: int,
    credits: Credits,
    wait_s: Callable[[], float],
) -> tuple[int, bytes]:
    """Send the generator's chunks to ``reply`` under credit; returns (count, joined JSON).

    ``wait_s()`` is how long the agent may still wait for credit (the task's time left).
    Raises ``StreamBroken`` when the reader cancels or stops taking chunks, ``InternalError``
    for a chunk that is not JSON; the generator is closed either way.
    """
    subject, credit = credits.open()
    joined = Joined()
    n = 0
    try:
        async for chunk in chunks:
            try:
                encoded = _encoder.encode(chunk)
            except (TypeError, msgspec.EncodeError) as exc:
                raise InternalError(f"stream chunk {n + 1} is not JSON ({exc})") from None
            while n + 1 > credit.seq + window and not credit.cancelled:
                credit.event.clear()
                try:
                    async with asyncio.timeout(max(wait_s(), 0.0)):
                        await credit.event.wait()
                except TimeoutError:
                    raise StreamBroken(
                        f"the reader took no chunk beyond {credit.seq} (window {window}) in "
                        f"time: stopped after {n} chunks", delivered=n,
                    ) from None  # fmt: skip
            if credit.cancelled:
                raise StreamBroken(f"the reader cancelled the stream after {n} chunks",
                                   delivered=n)  # fmt: skip
            n += 1
            joined.add(chunk, encoded)
            await nc.publish(reply, encoded, reply=subject, headers={
                schema.H_REQUEST_ID: request_id, schema.H_STATUS: "chunk", schema.H_SEQ: str(n),
            })  # fmt: skip
    finally:
        credits.close(subject)
        aclose = getattr(chunks, "aclose", None)
        if aclose is not None:
            await aclose()
    return n, joined.encode()


async def collect(chunks: AsyncIterator[Any]) -> bytes:
    """A streaming handler asked without ``Reach-Stream``: every chunk, joined."""
    joined = Joined()
    n = 0
    async for chunk in chunks:
        n += 1
        try:
            joined.add(chunk, _encoder.encode(chunk))
        except (TypeError, msgspec.EncodeError) as exc:
            raise InternalError(f"stream chunk {n} is not JSON ({exc})") from None
    return joined.encode()


# --- the caller side --------------------------------------------------------------------


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
    """The chunks of a Synadia agent's prompt stream (:mod:`~reach_agent.prompting`), from
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
    while True:  # (asyncio.timeout, not wait_for: a cancel here is never lost)
        try:
            async with asyncio.timeout(max(call.deadline - clock(), 0.0)):
                a, msg = await call.queue.get()
        except TimeoutError:
            raise StreamBroken(
                f"stream from agent {agent!r} did not complete by the call's deadline "
                f"({delivered()} chunks delivered)", delivered=delivered(),
            ) from None  # fmt: skip
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
                  sticky_key: str | None, request_id: str | None,
                  headers: dict[str, str] | None, traceparent: str | None, region: str | None,
                  tags: dict[str, str] | None, stream: int) -> Call: ...  # fmt: skip
    async def _run(self, call: Call) -> Any: ...
    def close_call(self, call: Call, ok: bool) -> None: ...


async def stream(
    client: Caller,
    capability: str,
    payload: Any,
    *,
    timeout: float | None,  # noqa: ASYNC109 - the whole stream's deadline, as for call()
    window: int,
    sticky_key: str | None = None,
    request_id: str | None = None,
    headers: dict[str, str] | None = None,
    traceparent: str | None = None,
    region: str | None = None,
    tags: dict[str, str] | None = None,
) -> AsyncIterator[Any]:
    """:meth:`reach_agent.Client.stream`. Until the first chunk the call is routed and
    retried like ``call()``; after it nothing is retried: an agent lost mid-stream raises
    ``StreamBroken`` (``delivered``: the chunks yielded). An agent answering one whole
    result (a plain handler, or the stored result of a request id that already ran) yields
    that result as the only chunk. The deadline covers the whole stream."""
    if not 1 <= window <= MAX_WINDOW:
        raise InvalidRequest(f"window {window!r} is not within 1..{MAX_WINDOW}")
    call = client.open_call(capability, payload, timeout, "completed", sticky_key, request_id,
                            headers, traceparent, region, tags, window)  # fmt: skip
    ok = False
    gave_up: str | None = None
    everyone = False  # (a cancelled task: every agent it was sent to, see Cancels.tell)
    try:
        value = await client._run(call)
        if not isinstance(value, StreamStart):
            yield value
        else:
            agent = call.agents.get(value.attempt)
            if agent is not None:
                client.liveness.track(agent, call)  # a death mid-stream breaks the stream
            chunks = (read_prompted(call, value, client.clock)
                      if call.protocol == schema.PROTOCOL_SYNADIA
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
