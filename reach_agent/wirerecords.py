"""The records of the task path: the receipt, the ack record (and its decoding), the
event, the claim, and the task body's digest both of them carry.

Its own module because these are what JetStream stores and the broker and SDK read back,
apart from the control-plane messages of ``schema``, which re-exports every name here.
"""

from __future__ import annotations

import hashlib
from typing import Any, Literal

import msgspec

from .wiretypes import AckState, AgentState, Base, ClaimState, EventKind


def body_digest(body: bytes) -> str:
    """The digest of a task body as sent (its bytes, not its meaning): the 32 hex digits of
    BLAKE2b-128. Stored with a request id's claim and ack records (``body_digest``) and on
    its compensation entry, so that the request id reused with another body is refused
    (``IDEMPOTENCY_MISMATCH``) instead of answered with the first body's result."""
    return hashlib.blake2b(body, digest_size=16).hexdigest()


class Receipt(msgspec.Struct, frozen=True, kw_only=True):
    """Interim reply sent before the result when a task asks ``Reach-Receipt: 1``.

    Not a ``Base``: ``status`` must be on the wire although it is the default (readers tell
    a receipt from a result by it, docs/protocol.md).
    """

    request_id: str
    status: Literal["received"] = "received"
    agent_id: str | msgspec.UnsetType = msgspec.UNSET
    """Who took the task: not on the wire. The SDK client fills it in from the attempt the
    receipt answered (the agent it sent that attempt to): the one to ``wait`` on."""


class _BodyReceipt(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A receipt told by its body alone: exactly these two fields, nothing else."""

    request_id: str
    status: Literal["received"]


_body_receipt_decoder = msgspec.json.Decoder(_BodyReceipt)
_RECEIPT_MAX_BYTES = 512


def is_body_receipt(data: bytes, request_id: str) -> bool:
    """Whether a reply without ``Reach-Status`` is the receipt of ``request_id`` all the same:
    its body is exactly ``{"request_id": <request_id>, "status": "received"}`` (an agent
    written from the text alone may leave the header out). Anything else is a result."""
    if len(data) > _RECEIPT_MAX_BYTES or b'"received"' not in data:
        return False  # most results: no decode at all
    try:
        return _body_receipt_decoder.decode(data).request_id == request_id
    except msgspec.MsgspecError:
        return False


class AckRecord(Base, frozen=True):
    """``reach.ack.<author>.<request_id>`` in ``REACH_ACKS``; ``Nats-Msg-Id:
    <author>.<request_id>.<state>.<tag>``. ``agent_id`` equals the subject's author, except
    in the broker's own records (author ``_broker``), where it names the agent concerned."""

    request_id: str
    agent_id: str
    capability: str
    state: AckState
    at_ms: int
    result: Any = None
    """The handler's result: written as ``msgspec.Raw`` (its JSON as the agent replied it,
    never decoded on the way) and so read by :func:`decode_ack_record`; decoded (a dict,
    list, ...) in what ``Client.wait`` returns. None when there is none."""
    error: dict[str, str] | None = None
    parent_request_id: str | None = None
    """The flow run this request is a step of (the task's ``Reach-Parent-Id``)."""
    body_digest: str | None = None
    """:func:`body_digest` of the task body the record is about (absent in records written
    before it existed)."""


class Event(Base, frozen=True):
    """``reach.event.<kind>.<agent_id>``: one state transition, with why (kind
    ``released``: a claim of the agent released, ``request_id`` names it; kind ``rule``: a
    route rule set or cleared, on ``reach.event.rule._rules``)."""

    kind: EventKind
    agent_id: str
    reason: str
    at_ms: int
    broker_id: str
    to: AgentState | None = None
    from_: AgentState | None = msgspec.field(default=None, name="from")
    request_id: str | None = None
    capability: str | None = None
    """Kind ``rule``: the capability whose route rule changed (``agent_id`` is ``_rules``)."""


class Claim(Base, frozen=True):
    """The value of a request id's key in KV ``reach_claims``: who runs it, how far it got,
    where its result is. Created once (before the handler runs), then changed only by
    compare-and-set on its revision."""

    request_id: str
    agent_id: str
    """The holder: the agent that runs (or ran) the request."""
    instance: str
    """The holder's process (random per process): a restarted agent knows its old claims."""
    capability: str
    state: ClaimState
    at_ms: int
    """When the claim last changed (Unix ms)."""
    ack_subject: str | None = None
    """The result location: the ``REACH_ACKS`` subject of the holder's final ack record."""
    reason: str | None = None
    """Why it was released."""
    body_digest: str | None = None
    """:func:`body_digest` of the body the holder runs: another body under the same request
    id is refused ``IDEMPOTENCY_MISMATCH`` (absent in claims written before it existed:
    accepted)."""


class _StoredAck(msgspec.Struct, kw_only=True):
    """AckRecord as decoded: msgspec cannot decode ``Raw | None`` from a non-null value, so
    ``result`` is read as ``Raw`` here and turned into ``None`` when absent or null."""

    request_id: str
    agent_id: str
    capability: str
    state: AckState
    at_ms: int
    result: msgspec.Raw = msgspec.Raw()
    error: dict[str, str] | None = None
    parent_request_id: str | None = None
    body_digest: str | None = None


_stored_ack_decoder = msgspec.json.Decoder(_StoredAck)
_result_decoder = msgspec.json.Decoder()


def decode_ack_record(data: bytes, *, decode_result: bool = False) -> AckRecord:
    """An :class:`AckRecord` from its JSON (``result`` is None when absent or null): the
    result as ``msgspec.Raw``, or decoded with ``decode_result`` (as ``Client.wait`` gives it)."""
    s = _stored_ack_decoder.decode(data)
    result: Any = s.result if s.result and bytes(s.result) != b"null" else None
    if decode_result and result is not None:
        result = _result_decoder.decode(result)
    return AckRecord(request_id=s.request_id, agent_id=s.agent_id, capability=s.capability,
                     state=s.state, at_ms=s.at_ms, result=result, error=s.error,
                     parent_request_id=s.parent_request_id,
                     body_digest=s.body_digest)  # fmt: skip
