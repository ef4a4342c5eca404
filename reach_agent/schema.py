"""Wire contract v1: every message that crosses NATS, as msgspec Structs.

Evolution rules (msgspec's): new fields get defaults, a field's type never changes, unknown
fields are ignored (an older broker accepts a newer agent). Structural checks (types, ranges,
patterns) are declared on the types with ``Meta`` so msgspec reports them with a path
(``Expected `int` >= 1 - at `$.max_concurrency```); checks that span fields, or that msgspec
cannot express, live in ``validate_*`` functions that raise :class:`InvalidRequest`.

The field vocabulary (``Base``, patterns, bounded types, one-value checks) lives in
:mod:`~reach_agent.wiretypes`, the task path's stored records (receipt, ack record, event,
claim) in :mod:`~reach_agent.wirerecords`, an explained route's Structs in
:mod:`~reach_agent.wireexplain`; all are re-exported here.
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec
from msgspec import Meta

from jetstream.names import H_MSG_ID, H_REQUEST_ID  # noqa: F401 - headers of the contract

from .errors import H_SERVICE_ERROR, H_SERVICE_ERROR_CODE, InvalidCapability, InvalidRequest  # noqa: F401

# Re-exported, so ``schema.X`` names every part of the contract as before the split:
from .wireexplain import AgentExplain, Exclusion, RouteExplain, ScoreTerms  # noqa: F401
from .wirerecords import (  # noqa: F401
    AckRecord,
    Claim,
    Event,
    Receipt,
    decode_ack_record,
    is_body_receipt,
)
from .wiretypes import (  # noqa: F401
    AGENT_ID_PATTERN,
    AGENT_STATES,
    CAPABILITY_MAX_LEN,
    CAPABILITY_PATTERN,
    CAPABILITY_TOKEN,
    MAX_BODY_BYTES,
    PROTOCOL_REACH,
    PROTOCOL_SYNADIA,
    PROTOCOL_VERSION,
    TAG_KEY_PATTERN,
    AckState,
    AgentId,
    AgentState,
    AgentStatus,
    Base,
    Capability,
    ClaimState,
    Concurrency,
    Count,
    EventKind,
    IntervalMs,
    Millis,
    Percent,
    ShortText,
    check_agent_id,
    check_capability,
    check_tags,
    is_agent_id,
)

# --- agent → broker ---------------------------------------------------------------------


class Announce(Base, frozen=True):
    """``reach.announce.<agent_id>``: idempotent upsert of an agent's registration."""

    agent_id: AgentId
    capabilities: Annotated[list[Capability], Meta(min_length=1, max_length=256)]
    max_concurrency: Concurrency
    heartbeat_interval_ms: IntervalMs
    agent_type: ShortText | None = None
    version: ShortText | None = None
    region: ShortText | None = None
    tags: Annotated[dict[str, ShortText], Meta(max_length=64)] = {}
    timeout_hint_ms: Annotated[int, Meta(ge=1, le=24 * 3600 * 1000)] | None = None
    context_window: Annotated[int, Meta(ge=0, le=2**40)] | None = None
    permissions: Annotated[list[ShortText], Meta(max_length=256)] = []
    metadata: Annotated[dict[str, Any], Meta(max_length=64)] = {}
    instance_id: Annotated[str, Meta(min_length=1, max_length=64)] | None = None
    """Random per process: tells a second process with the same agent_id from a re-announce."""


class AnnounceAck(Base, frozen=True):
    """Reply to an announce: the token every later heartbeat must carry."""

    agent_id: str
    token: str
    heartbeat_interval_ms: int
    broker_id: str


class Heartbeat(Base, frozen=True):
    """``reach.hb.<agent_id>``: liveness and load, judged on the broker's clock."""

    agent_id: AgentId
    token: Annotated[str, Meta(max_length=256)]
    seq: Count
    status: AgentStatus = "idle"
    active: Count = 0
    queue_depth: Count = 0
    ok_total: Count = 0
    fail_total: Count = 0
    task_ms_p50: Millis | None = None
    oldest_task_ms: Millis | None = None
    context_usage_pct: Percent | None = None
    initial: bool = False


class Leave(Base, frozen=True):
    """``reach.leave.<agent_id>``: the agent stops taking work; body may be ``{}``."""

    agent_id: AgentId | None = None
    token: Annotated[str, Meta(max_length=256)] | None = None
    reason: ShortText | None = None


class Ok(msgspec.Struct, frozen=True, kw_only=True):
    """``{"ok": true}``: the reply to a leave (not omitted although it is the default)."""

    ok: bool = True


class ProbeReply(Base, frozen=True):
    """Reply to ``reach.probe.<agent_id>``."""

    agent_id: str
    status: AgentStatus = "idle"
    active: int = 0
    queue_depth: int = 0
    seq: int = 0
    instance_id: str | None = None
    """The announce's ``instance_id``: which process answered."""
    server: str | None = None
    """Name of the NATS server the agent is connected to."""
    cid: int | None = None
    """The agent's client id on that server."""


class Reannounce(Base, frozen=True):
    """``<p>.reannounce.<agent_id>``: a broker that does not know the agent asks it to
    announce again (body may be ``{}``)."""

    reason: ShortText | None = None
    broker_id: str | None = None


# --- caller → broker ----------------------------------------------------------------------


class RouteRequest(Base, frozen=True):
    """``reach.route.<capability>``; an empty body means all defaults."""

    limit: Annotated[int, Meta(ge=1, le=100)] = 3
    region: ShortText | None = None
    tags: Annotated[dict[str, ShortText], Meta(max_length=64)] = {}
    sticky_key: Annotated[str, Meta(max_length=1024)] | None = None
    exclude: Annotated[list[AgentId], Meta(max_length=1000)] = []
    allow_suspect: bool = False
    peek: bool = False
    """A look, not a pick: no task will follow, so the broker does not count the answer's
    first candidate as handed a task (``reach route``, ``Client.route``, cache refreshes)."""
    explain: bool = False
    """Ask for the reasons: each candidate's ``explain`` and the reply's ``explain``."""
    canary: ShortText | None = None
    """Take this arm of the capability's split rule (a ``version`` or tag value) instead of
    the weighted one; without a split rule, agents of this ``version``."""
    requires: Annotated[list[ShortText], Meta(max_length=64)] = []
    """Permissions every candidate must hold (its announce's ``permissions``)."""
    min_context_tokens: Annotated[int, Meta(ge=0, le=2**40)] | None = None
    """Candidates' context headroom, ``context_window x (1 - context_usage_pct / 100)``,
    must be at least this (an agent that announces no ``context_window`` has none)."""


class Candidate(Base, frozen=True):
    agent_id: str
    subject: str
    score: float
    state: AgentState
    load: float
    region: str | None = None
    version: str | None = None
    timeout_hint_ms: int | None = None
    """The agent's announced ``timeout_hint_ms``: callers wait at least this long."""
    protocol: str | None = None
    """``reach`` or ``synadia-agents`` (brokers always say; absent from an older broker:
    ``reach``)."""
    explain: AgentExplain | None = None


class RouteReply(Base, frozen=True):
    capability: str
    candidates: list[Candidate]
    generated_at_ms: int
    explain: RouteExplain | None = None


class AgentView(Base, frozen=True):
    """One row of ``reach.agents``."""

    agent_id: str
    state: AgentState
    score: float
    load: float
    last_seen_ms: int
    capabilities: list[str]
    success_rate: float
    region: str | None = None
    version: str | None = None
    active: int = 0
    max_concurrency: int = 0
    protocol: str = PROTOCOL_REACH
    """``synadia-agents`` for an agent the broker discovered (absent: ``reach``)."""


class AgentsRequest(Base, frozen=True):
    """``reach.agents``: optional filters; ``{}`` or empty lists everything."""

    capability: Capability | None = None
    state: AgentState | None = None


class OutcomeSummary(Base, frozen=True):
    """``<p>.outcome.<agent_id>``: what one caller saw of one agent since its last summary
    (published every ``ClientConfig.outcome_interval_s`` while there is something to say)."""

    caller: ShortText
    """Who saw it (the client's caller name; see docs/protocol.md, "Outcomes")."""
    attempts: Count = 0
    """Attempts sent to the agent."""
    ok: Count = 0
    """Attempts answered with a result (or an error reply other than a rejection)."""
    not_delivered: Count = 0
    """No receipt within ``ack_timeout_s`` (or no responders)."""
    lost: Count = 0
    """Receipted, then abandoned: the agent was reported gone while running it."""
    timeouts: Count = 0
    """Receipted, then no result before the call's deadline."""
    rejected: Count = 0
    """Business rejections (``BIZ_REJECT``): answers, not failures."""
    interval_ms: Millis = 0
    """The span the counts cover."""


# --- headers ------------------------------------------------------------------------------
# (H_MSG_ID, JetStream's de-duplication id, and H_REQUEST_ID, also a queue header, have their
# address in jetstream/names.py and are imported above.)

H_ACK_MODE = "Reach-Ack-Mode"
H_TIMEOUT_MS = "Reach-Timeout-Ms"
H_RECEIPT = "Reach-Receipt"
H_TRACE_ID = "Reach-Trace-Id"
H_HOPS = "Reach-Hops"
H_STATUS = "Reach-Status"
H_TRACEPARENT = "traceparent"
H_PARENT_ID = "Reach-Parent-Id"
"""On a flow's step: the run's parent request id (recorded in the step's ack records)."""
H_STREAM = "Reach-Stream"
"""``1`` on a task: answer in chunks. ``cancel`` on a credit message: stop the stream."""
H_STREAM_WINDOW = "Reach-Stream-Window"
"""On a streamed task: chunks the caller takes ahead of its credits (default 64)."""
H_SEQ = "Reach-Seq"
"""A chunk's sequence number (1, 2, ...); on a credit message, the last chunk consumed."""
H_CHUNKS = "Reach-Chunks"
"""On the ``completed`` message that ends a stream: how many chunks it had."""
H_HOLDER = "Reach-Holder"
"""On a reply answered from another agent's claim (its stored final record): that agent,
the holder, whose record the result is (the caller's ``wait`` believes it, not the agent
that answered)."""
H_CALLER = "Reach-Caller"
"""On a route request: who asks (the SDK's connection name; quotas are per caller). With the
server enforcing identities the broker reads the caller from the private reply inbox."""


# --- codecs (module level, reused: no per-message construction) ---------------------------

encoder = msgspec.json.Encoder()
announce_decoder = msgspec.json.Decoder(Announce)
heartbeat_decoder = msgspec.json.Decoder(Heartbeat)
leave_decoder = msgspec.json.Decoder(Leave)
route_request_decoder = msgspec.json.Decoder(RouteRequest)
route_reply_decoder = msgspec.json.Decoder(RouteReply)
announce_ack_decoder = msgspec.json.Decoder(AnnounceAck)
agents_request_decoder = msgspec.json.Decoder(AgentsRequest)
agent_views_decoder = msgspec.json.Decoder(list[AgentView])
probe_reply_decoder = msgspec.json.Decoder(ProbeReply)
event_decoder = msgspec.json.Decoder(Event)
claim_decoder = msgspec.json.Decoder(Claim)
outcome_decoder = msgspec.json.Decoder(OutcomeSummary)


def decode(decoder: msgspec.json.Decoder[Any], data: bytes, what: str) -> Any:
    """Decode ``data`` or raise :class:`InvalidRequest` whose message names the field.

    An empty body decodes as ``{}`` so every field takes its default.
    """
    if len(data) > MAX_BODY_BYTES:
        raise InvalidRequest(
            f"{what}: body is {len(data)} bytes, larger than the limit of {MAX_BODY_BYTES}"
        )
    try:
        return decoder.decode(data or b"{}")
    except msgspec.ValidationError as exc:
        raise InvalidRequest(f"{what}: {exc}") from None
    except msgspec.DecodeError as exc:
        raise InvalidRequest(f"{what}: malformed JSON ({exc})") from None


# --- validation that msgspec cannot express ------------------------------------------------


def validate_announce(msg: Announce, subject_agent_id: str) -> Announce:
    """Cross-field checks of an announce; the subject's agent id is authoritative."""
    if msg.agent_id != subject_agent_id:
        raise InvalidRequest(
            f"agent_id {msg.agent_id!r} in the body disagrees with the subject's "
            f"{subject_agent_id!r}"
        )
    for i, cap in enumerate(msg.capabilities):
        check_capability(cap, f"capabilities[{i}]")
    if len(set(msg.capabilities)) != len(msg.capabilities):
        raise InvalidRequest(f"capabilities {msg.capabilities!r} lists a capability twice")
    check_tags(msg.tags)
    return msg


def validate_heartbeat(msg: Heartbeat, subject_agent_id: str) -> Heartbeat:
    if msg.agent_id != subject_agent_id:
        raise InvalidRequest(
            f"agent_id {msg.agent_id!r} in the body disagrees with the subject's "
            f"{subject_agent_id!r}"
        )
    return msg


def validate_route_request(msg: RouteRequest) -> RouteRequest:
    check_tags(msg.tags)
    return msg


def validate_outcome(msg: OutcomeSummary) -> OutcomeSummary:
    """An outcome summary's counts must add up: every failure or answer was an attempt."""
    told = msg.ok + msg.not_delivered + msg.lost + msg.timeouts + msg.rejected
    if told > msg.attempts:
        raise InvalidRequest(
            f"outcome: ok + not_delivered + lost + timeouts + rejected = {told} exceeds "
            f"attempts {msg.attempts}"
        )
    return msg
