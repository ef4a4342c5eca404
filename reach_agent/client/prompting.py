"""The caller's side of the Synadia Agent Protocol's prompt protocol (v0.3): the codec.

A route candidate marked ``protocol: "synadia-agents"`` is an instance of their micro service
``agents``; its ``subject`` is the instance's prompt endpoint. A prompt is a JSON envelope
``{"prompt": "<text>", ...}`` published there with a reply subject, and the agent answers on
it with a stream of messages:

1. the leading ack ``{"type": "status", "data": "ack"}`` — the receipt;
2. typed chunks: ``{"type": "response", "data": "<text>"}`` (or ``data`` an object with
   ``text`` and ``attachments``) — the content; ``{"type": "status", ...}`` — keep-alive
   (every 30 s on a long prompt), ignored; ``{"type": "query", ...}`` — a question back to
   the caller, not answered here (the agent's own timeout decides); unknown types ignored;
3. the end: an empty message *without headers*; an error is a message carrying
   ``Nats-Service-Error-Code`` (an HTTP-like status) before it.

:func:`read` classifies one message; ``Call`` (calls.py) and the stream reader
(:func:`reach_agent.client.streaming.read`) act on it. A call's result is its response chunks joined
(:func:`reach_agent.wire.streams.join`: their concatenation when all are text).
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

from reach_agent.wire.errors import (
    H_SERVICE_ERROR,
    H_SERVICE_ERROR_CODE,
    InternalError,
    from_status,
)

Kind = Literal["ack", "chunk", "other", "end", "error"]
"""What a message of a prompt stream is: the receipt, content, anything to skip, the end,
an error (the agent's, or a message that breaks the protocol)."""


class _Chunk(msgspec.Struct):
    type: str
    data: Any = None


_chunk_decoder = msgspec.json.Decoder(_Chunk)
_json = msgspec.json.Decoder()
_encoder = msgspec.json.Encoder()


def envelope(body: bytes) -> bytes:
    """The prompt envelope for a task body (the caller's payload as JSON): an object with a
    string ``prompt`` goes as it is; a JSON string ``s`` becomes ``{"prompt": s}``; any
    other JSON becomes ``{"prompt": "<that JSON text>"}``; an empty body ``{"prompt": ""}``
    (which their agents refuse: 400, a ``BIZ_REJECT``)."""
    if not body:
        return b'{"prompt": ""}'
    try:
        value = _json.decode(body)
    except msgspec.DecodeError:
        return _encoder.encode({"prompt": body.decode("utf-8", "replace")})
    if isinstance(value, dict) and isinstance(value.get("prompt"), str):
        return body
    if isinstance(value, str):
        return _encoder.encode({"prompt": value})
    return _encoder.encode({"prompt": body.decode("utf-8", "replace")})


def read(msg: Any, agent: str | None) -> tuple[Kind, Any]:
    """One message of a prompt stream: (kind, value) — the chunk's ``data`` for ``chunk``,
    the :class:`ReachError` for ``error``."""
    hdrs = msg.headers
    if hdrs and H_SERVICE_ERROR_CODE in hdrs:
        try:
            status = int(hdrs[H_SERVICE_ERROR_CODE])
        except ValueError:
            status = 500
        text = hdrs.get(H_SERVICE_ERROR, "")
        return "error", from_status(status, f"agent {agent!r} answered {status}: {text}")
    if not msg.data:
        return ("end", None) if not hdrs else ("other", None)
    try:
        chunk = _chunk_decoder.decode(msg.data)
    except msgspec.MsgspecError as exc:
        return "error", InternalError(f"agent {agent!r} sent a chunk that is not one ({exc})")
    if chunk.type == "response":
        data = chunk.data
        if (
            isinstance(data, dict)
            and not data.get("attachments")
            and isinstance(data.get("text"), str)
        ):
            return "chunk", data["text"]  # text alone: as a plain response chunk
        if isinstance(data, str | dict):
            return "chunk", data
        return "error", InternalError(f"agent {agent!r} sent a response chunk without data")
    if chunk.type == "status" and chunk.data == "ack":
        return "ack", None
    return "other", None
