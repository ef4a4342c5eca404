"""Streaming, the agent's side: a handler's chunks sent under the caller's credit.

The protocol is :mod:`reach_agent.wire.streams`'s. The agent sends chunk ``n`` only while
``n <= credited + W``; a reader that cancels, or sends no credit for as long as the task's
deadline (or :data:`CREDIT_WAIT_S` without one), ends the stream as ``STREAM_BROKEN``.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator, Callable
from typing import Any

import msgspec
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from jetstream.names import H_REQUEST_ID
from reach_agent.wire import schema
from reach_agent.wire.errors import InternalError, StreamBroken
from reach_agent.wire.streams import Joined

CREDIT_WAIT_S = 60.0
"""How long an agent waits for credit when the task carries no deadline."""


_encoder = msgspec.json.Encoder()


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
                H_REQUEST_ID: request_id, schema.H_STATUS: "chunk", schema.H_SEQ: str(n),
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
