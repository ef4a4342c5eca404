"""The stream protocol: how a streamed answer crosses NATS, the window, and the joined result.

The agent's side is :mod:`reach_agent.agent.streaming` (sending under credit), the caller's
:mod:`reach_agent.client.streaming` (the ordered reader).

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

from collections.abc import Iterable, Mapping
from typing import Any

import msgspec

from reach_agent.wire.errors import InvalidRequest
from reach_agent.wire.schema import H_STREAM_WINDOW

DEFAULT_WINDOW = 64
"""Chunks a reader takes ahead of its credits unless it asks otherwise."""
MAX_WINDOW = 1024
"""The largest window an agent grants (a larger ``Reach-Stream-Window`` is lowered to it)."""
_encoder = msgspec.json.Encoder()


def join(chunks: Iterable[Any]) -> Any:
    """A stream's chunks as one result: their concatenation when every chunk is a string
    (and there is at least one), otherwise the list of chunks (``[]`` for none). (Reach
    streams and Synadia prompt streams alike; :mod:`~reach_agent.client.streaming` re-exports
    it.)"""
    items = list(chunks)
    if items and all(isinstance(c, str) for c in items):
        return "".join(items)
    return items


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
    raw = headers.get(H_STREAM_WINDOW)
    if raw is None:
        return DEFAULT_WINDOW
    try:
        w = int(raw)
    except ValueError:
        w = 0
    if w < 1:
        raise InvalidRequest(f"header Reach-Stream-Window {raw[:40]!r} is not a positive integer")
    return min(w, MAX_WINDOW)
