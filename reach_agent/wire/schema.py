"""Wire contract v1: every message that crosses NATS, as msgspec Structs, in one module.

Evolution rules (msgspec's): new fields get defaults, a field's type never changes, unknown
fields are ignored (an older broker accepts a newer agent). Structural checks (types, ranges,
patterns) are declared on the types with ``Meta`` so msgspec reports them with a path
(``Expected `int` >= 1 - at `$.max_concurrency```); checks that span fields, or that msgspec
cannot express, live in ``validate_*`` functions that raise :class:`InvalidRequest`.

In order: the vocabulary every Struct is built from (``Base``, the id and capability
patterns and their one-value checks, the bounded field types, the literal states); an
explained route's Structs (``RouteRequest.explain``); the task path's records that JetStream
stores and the broker and SDK read back (receipt, ack record, event, claim, and the body
digest the ack record and claim carry); the
control-plane messages (announce, heartbeat, route, agents, outcome summaries); the
headers; the codecs; the cross-field validation.
"""

from __future__ import annotations

import hashlib
import re
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from .errors import InvalidCapability, InvalidRequest

PROTOCOL_VERSION = 1

AGENT_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_-]{0,127}$"
CAPABILITY_TOKEN = r"[a-z0-9][a-z0-9_-]*"
CAPABILITY_PATTERN = rf"^{CAPABILITY_TOKEN}(\.{CAPABILITY_TOKEN})*$"
CAPABILITY_MAX_LEN = 128
TAG_KEY_PATTERN = r"^[a-z0-9_]+$"

_AGENT_ID_RE = re.compile(AGENT_ID_PATTERN)
_CAPABILITY_RE = re.compile(CAPABILITY_PATTERN)
_TAG_KEY_RE = re.compile(TAG_KEY_PATTERN)

MAX_BODY_BYTES = 64 * 1024
"""Largest control-plane body (announce, heartbeat, route) the broker decodes."""

AgentId = Annotated[str, Meta(pattern=AGENT_ID_PATTERN)]
Capability = Annotated[str, Meta(max_length=CAPABILITY_MAX_LEN)]
ShortText = Annotated[str, Meta(max_length=256)]
Count = Annotated[int, Meta(ge=0, le=2**53)]
Millis = Annotated[int, Meta(ge=0, le=7 * 24 * 3600 * 1000)]
IntervalMs = Annotated[int, Meta(ge=50, le=3600 * 1000)]
Concurrency = Annotated[int, Meta(ge=1, le=100_000)]
Percent = Annotated[float, Meta(ge=0, le=100)]

AgentState = Literal["healthy", "suspect", "offline", "recovering", "draining"]
AGENT_STATES: tuple[AgentState, ...] = ("healthy", "suspect", "offline", "recovering", "draining")
AgentStatus = Literal["idle", "busy", "draining"]
EventKind = Literal["registered", "state", "left", "evicted", "released", "rule"]
AckState = Literal["received", "completed", "failed"]
PROTOCOL_REACH = "reach"
PROTOCOL_SYNADIA = "synadia-agents"
"""How a candidate is spoken to: reach's task protocol, or the Synadia Agent Protocol's
prompt protocol (an agent the broker discovered on ``$SRV.INFO.agents``)."""
ClaimState = Literal["running", "completed", "failed", "released"]


class Base(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """Shared options of every wire type."""


# --- checks of one value that msgspec cannot express --------------------------------------


def is_agent_id(value: str) -> bool:
    return _AGENT_ID_RE.match(value) is not None


def check_agent_id(value: str, field: str = "agent_id") -> str:
    if not is_agent_id(value):
        raise InvalidRequest(
            f"{field} {value[:160]!r} is not a valid agent id "
            "(one subject token: [A-Za-z0-9][A-Za-z0-9_-]{0,127})"
        )
    return value


def check_capability(value: str, field: str = "capability") -> str:
    if len(value) > CAPABILITY_MAX_LEN:
        raise InvalidCapability(
            f"{field} {value[:40]!r}... is {len(value)} chars, longer than {CAPABILITY_MAX_LEN}"
        )
    if _CAPABILITY_RE.match(value) is None:
        raise InvalidCapability(
            f"{field} {value!r} is not a valid capability "
            "(dot-separated lowercase tokens [a-z0-9][a-z0-9_-]*)"
        )
    return value


def check_tags(tags: dict[str, str], field: str = "tags") -> None:
    for key in tags:
        if _TAG_KEY_RE.match(key) is None:
            raise InvalidRequest(f"{field} key {key[:80]!r} is not lowercase [a-z0-9_]+")


# --- an explained route (RouteRequest.explain) ------------------------------------------


class ScoreTerms(Base, frozen=True):
    """The factors of an agent's score, each in [0, 1]: score = 100 x the product of each
    term raised to its weight (``scoring.weight_*``); ``stuck`` is 1 or the stuck penalty."""

    liveness: float
    latency: float
    load: float
    success: float
    stuck: float
    delivery: float = 1.0
    """What callers saw (``<p>.outcome.<agent_id>`` summaries): 1, or 1 - the failure share
    that at least ``outcomes.min_callers`` callers report; 0 when ejected by the outlier or
    the unanswered rule."""


class AgentExplain(Base, frozen=True):
    """Why an agent scores what it scores, and where it stands in the capability's routing
    (with ``RouteRequest.explain``)."""

    terms: ScoreTerms
    weakest: str | None = None
    """The term that pulls the score down most (None: every term is 1)."""
    slow_start: float = 1.0
    """The slow-start factor on its weight (below 1 for a while after recovering)."""
    weight: float = 0.0
    """Its weight in the weighted draw: score x free capacity x slow start."""
    rank: int = 0
    """Its place in the capability's ranking, 1 the best; 0: not ranked."""
    kept: str | None = None
    """Why it is routed although below the minimum score (``eject_cap``, ``panic``) or
    although suspect (``allow_suspect``)."""
    task_ms: float | None = None
    """Task duration EWMA (from heartbeats)."""
    rtt_ms: float | None = None
    """Probe round-trip EWMA."""
    success_rate: float = 1.0
    ok_total: int = 0
    fail_total: int = 0
    active: int = 0
    queue_depth: int = 0
    max_concurrency: int = 0
    oldest_task_ms: int | None = None
    timeout_hint_ms: int | None = None
    probe_failures: int = 0
    """Probes unanswered in a row."""


class Exclusion(Base, frozen=True):
    """An agent of the capability that is not among the candidates, and why."""

    agent_id: str
    reason: str
    """A reason code (``state``, ``load``, ``score``, ...; the table in docs/protocol.md)."""
    detail: str
    """The reason in one sentence, with the figures."""
    state: AgentState
    score: float
    load: float
    explain: AgentExplain | None = None


class RouteExplain(Base, frozen=True):
    """How a route request was decided (with ``RouteRequest.explain``)."""

    members: int
    """Agents with the capability, in any state."""
    healthy: int
    ranked: int
    """Healthy agents in the ranking (not ejected for their score)."""
    choice: str
    min_reach_score: float
    load_watermark: float
    ejected: int = 0
    panic: bool = False
    pool: int = 0
    """Agents that passed every filter and made the pool the choice was made from."""
    counts: dict[str, int] = {}
    """Agents left out, by reason code: all of them, also beyond the ``excluded`` listed."""
    excluded: list[Exclusion] = []
    """The agents left out (at most 100: the best ranked and scored first), with why."""
    shared: int = 0
    """With several brokers: agents of the capability in the other owners' route-table shares
    the answering broker follows (routed with the rest, not explained one by one)."""
    unseen_partitions: list[int] = []
    """With several brokers: partitions whose agents this explanation does not cover (owned by
    another broker and none of their agents in the answering broker's registry): routed from
    their owners' shares (``shared``), or not at all while no share of them is held."""


# --- the task path's records ------------------------------------------------------------


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
    received_ms: int | None = None
    """On a final record: when the agent accepted the task, its ``received`` record folded
    into this one (a writer that had not stored ``received`` yet when the run ended stores
    one record instead of two)."""
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
    """Why it was released; :data:`CLAIM_CANCELLED` on a ``failed`` claim a cancel ended."""
    body_digest: str | None = None
    """:func:`body_digest` of the body the holder runs: another body under the same request
    id is refused ``IDEMPOTENCY_MISMATCH`` (absent in claims written before it existed:
    accepted)."""


CLAIM_CANCELLED = "cancelled"
"""The ``reason`` of a claim ended by a cancel (state ``failed``; its result the holder's
``failed`` record with ``CANCELLED``): no retry or replay runs the request again."""


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
    received_ms: int | None = None
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
                     received_ms=s.received_ms, body_digest=s.body_digest)  # fmt: skip


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
    finished: int | None = None
    """Tasks this process has ended (a result or an error of its own) since it started: a
    caller waiting on it whose count moved reads its record (its reply may be lost)."""


class Reannounce(Base, frozen=True):
    """``<p>.reannounce.<agent_id>``: a broker that does not know the agent asks it to
    announce again (body may be ``{}``)."""

    reason: ShortText | None = None
    broker_id: str | None = None


# --- caller → agent (or broker): cancellation ---------------------------------------------


class Cancel(Base, frozen=True):
    """``<p>.cancel.<agent_id>`` (the agent running the request) or ``<p>.cancel._broker``
    (brokers: a request nobody runs): stop running ``request_id``, and never run it again."""

    request_id: Annotated[str, Meta(pattern=r"^[A-Za-z0-9_-]{1,128}$")]
    reason: ShortText | None = None
    """Why (``deadline``, ``call cancelled``, or the canceller's words): in the error message."""
    capability: Capability | None = None
    """The request's capability, when the canceller knows it (a claim the broker makes)."""
    holder: AgentId | None = None
    """To a broker: the agent believed to run it, which did not answer the cancel."""


CancelState = Literal["cancelled", "finished", "unknown"]


class CancelReply(Base, frozen=True):
    """The answer to a :class:`Cancel` sent as a request."""

    request_id: str
    state: CancelState
    """``cancelled``: it was running (or queued, or not yet started) and will end as
    ``CANCELLED``; ``finished``: it had already ended, its result stands; ``unknown``: not
    running here (an agent remembers it for its duplicate window and answers a copy arriving
    later ``CANCELLED``)."""
    agent_id: str
    """Who answered: the agent, or ``_broker``."""
    detail: ShortText | None = None


# --- caller → broker ----------------------------------------------------------------------


class Filters(Base, frozen=True):
    """Who may take a call: the route request's filters, as a call carries them through
    every route it asks (a :class:`RouteRequest` adds what changes per route)."""

    region: ShortText | None = None
    tags: Annotated[dict[str, ShortText], Meta(max_length=64)] = {}
    sticky_key: Annotated[str, Meta(max_length=1024)] | None = None
    allow_suspect: bool = False
    canary: ShortText | None = None
    """Take this arm of the capability's split rule (a ``version`` or tag value) instead of
    the weighted one; without a split rule, agents of this ``version``."""
    requires: Annotated[list[ShortText], Meta(max_length=64)] = []
    """Permissions every candidate must hold (its announce's ``permissions``)."""
    min_context_tokens: Annotated[int, Meta(ge=0, le=2**40)] | None = None
    """Candidates' context headroom, ``context_window x (1 - context_usage_pct / 100)``,
    must be at least this (an agent that announces no ``context_window`` has none)."""


class RouteRequest(Filters, frozen=True):
    """``reach.route.<capability>``; an empty body means all defaults."""

    limit: Annotated[int, Meta(ge=1, le=100)] = 3
    exclude: Annotated[list[AgentId], Meta(max_length=1000)] = []
    peek: bool = False
    """A look, not a pick: no task will follow, so the broker does not count the answer's
    first candidate as handed a task (``reach route``, ``Client.route``, cache refreshes)."""
    explain: bool = False
    """Ask for the reasons: each candidate's ``explain`` and the reply's ``explain``."""


NO_FILTERS = Filters()
"""A call that asks nothing of its agent but the capability."""


def route_request(
    filters: Filters, limit: int, exclude: list[str] | None = None, *, peek: bool = False
) -> RouteRequest:
    """The route request of a call with ``filters``: ``limit`` candidates, not ``exclude``."""
    return RouteRequest(limit=limit, exclude=exclude or [], peek=peek,
                        **msgspec.structs.asdict(filters))  # fmt: skip


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


# --- route tables: broker (a share's owner) → callers -------------------------------------


class TableEntry(Base, frozen=True, gc=False):
    """One agent in a capability's route table: what a caller needs to choose it (the
    filters' inputs, its weight's, its load) and to reach it. Not tracked by the garbage
    collector (16 B less an entry, a broker keeping one per agent): nothing it holds can
    hold it."""

    agent_id: str
    state: AgentState
    score: float
    max_concurrency: int
    active: int = 0
    """Tasks it reported running at its last heartbeat."""
    queue_depth: int = 0
    task_ms: float | None = None
    """Its task time (the broker's EWMA, ms): how fast what it runs finishes."""
    interval_ms: int = 1000
    """Its heartbeat interval: how long a load report holds without a task time."""
    slow_start_ms: int | None = None
    """Milliseconds since it recovered, while it is slow-started (absent: not ramping up)."""
    region: str | None = None
    version: str | None = None
    tags: dict[str, str] = {}
    permissions: list[str] = []
    context_window: int | None = None
    context_usage_pct: float | None = None
    timeout_hint_ms: int | None = None
    protocol: str | None = None
    """``reach`` (absent) or ``synadia-agents`` (as a route candidate's)."""
    subject: str | None = None
    """Its task subject when it is not ``<p>.task.<agent_id>.<capability>`` (a Synadia
    agent's prompt subject)."""


class TableRouting(Base, frozen=True):
    """The brokers' ``[routing]`` settings a caller chooses with (as in broker.toml)."""

    choice: Literal["weighted", "p2c", "ranked"] = "weighted"
    pool_factor: int = 4
    vnodes: int = 150
    min_reach_score: float = 60.0
    load_watermark: float = 0.85
    slow_start_share: float = 0.2
    slow_start_s: float = 30.0
    max_eject_share: float = 0.5
    panic_threshold: float = 0.5
    rank_refresh_ms: float = 50.0


NO_RULE = msgspec.Raw()
"""A table's ``rule`` when the capability has none (omitted on the wire). A ``Raw`` field is
never ``Raw | None``: msgspec decodes that union only as ``null``, so a rule would make the
whole share or delta undecodable."""


class TableLoad(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """An agent's load and score in a :class:`TableDelta`, when nothing else of its entry
    moved (most heartbeats): ``[agent_id, active, queue_depth, score, task_ms,
    context_usage_pct]``, each as in :class:`TableEntry` (``null``: absent; the last two may
    be left out). A few dozen bytes instead of the whole entry: the broker makes, and every
    follower decodes, one per agent a second at a 1 s heartbeat."""

    agent_id: str
    active: int
    queue_depth: int
    score: float
    task_ms: float | None = None
    context_usage_pct: float | None = None


def with_load(entry: TableEntry, load: TableLoad) -> TableEntry:
    """``entry`` with ``load``'s figures (``entry`` itself when they are its own)."""
    if (
        entry.active == load.active
        and entry.queue_depth == load.queue_depth
        and entry.score == load.score
        and entry.task_ms == load.task_ms
        and entry.context_usage_pct == load.context_usage_pct
    ):
        return entry
    return msgspec.structs.replace(
        entry, active=load.active, queue_depth=load.queue_depth, score=load.score,
        task_ms=load.task_ms, context_usage_pct=load.context_usage_pct,
    )  # fmt: skip


class TableShare(Base, frozen=True):
    """One share of a capability's route table: its agents of one partition, as of
    ``version`` of its owner's ``epoch``, with what a caller routes them by."""

    capability: str
    partition: int
    epoch: int
    version: int
    entries: list[TableEntry] = []
    local: bool = True
    """Whether callers may route this capability themselves (false: a quota applies to
    it, which only a broker enforces: ask ``<p>.route.<capability>``)."""
    rule: msgspec.Raw = NO_RULE
    """The capability's route rule in force (``RouteRule`` JSON, as in KV ``reach_rules``;
    absent: none)."""
    routing: TableRouting = TableRouting()
    at_ms: int = 0
    """When its owner made it (Unix ms)."""


class TableDelta(Base, frozen=True):
    """A share's change from ``prev`` to ``version`` (same ``epoch``): agents upserted (their
    whole entry), agents removed from the capability and agents whose load alone moved
    (``loads``); ``local`` and ``rule`` as they are now (as :class:`TableShare`'s)."""

    capability: str
    partition: int
    epoch: int
    version: int
    prev: int
    upserts: list[TableEntry] = []
    removed: list[str] = []
    local: bool = True
    rule: msgspec.Raw = NO_RULE
    loads: list[TableLoad] = []
    """Agents of the share whose load or score alone moved: their entry as held, with these
    figures."""


class Table(Base, frozen=True):
    """``<p>.tables.<capability>``'s answer from one broker: the shares of the partitions it
    owns (a partition it owns and has no share of has no agent of the capability)."""

    capability: str
    partitions: int
    """How many partitions the fleet is split into (a share's ``partition`` is below it)."""
    owned: list[int]
    shares: list[TableShare] = []
    broker_id: str | None = None


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
    """``reach.agents`` and ``<p>.agents.<partition>``: optional filters; ``{}`` or empty
    lists everything (a page of it on ``<p>.agents.<partition>``)."""

    capability: Capability | None = None
    state: AgentState | None = None
    limit: Annotated[int, Meta(ge=1)] | None = None
    """``<p>.agents.<partition>`` only: agents in the page (default 500, at most 5000)."""
    cursor: ShortText | None = None
    """``<p>.agents.<partition>`` only: where the page starts (the previous page's
    ``cursor``; absent: the partition's first agent)."""


class AgentsPage(Base, frozen=True):
    """``<p>.agents.<partition>``'s answer, from the partition's owner: a page of its agents
    sorted by id, and the cursor of the next page (absent: the whole fleet is listed)."""

    agents: list[AgentView]
    partition: int
    partitions: int
    """How many partitions the fleet is split into."""
    cursor: str | None = None
    """``"<partition>.<after>"``: ask ``<p>.agents.<partition>`` with it for the next page."""
    count: int = 0
    """Agents the partition holds now (all of them, whatever the filters)."""
    broker_id: str | None = None


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
# address in jetstream/names.py.)

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
agents_page_decoder = msgspec.json.Decoder(AgentsPage)
probe_reply_decoder = msgspec.json.Decoder(ProbeReply)
event_decoder = msgspec.json.Decoder(Event)
claim_decoder = msgspec.json.Decoder(Claim)
outcome_decoder = msgspec.json.Decoder(OutcomeSummary)
table_decoder = msgspec.json.Decoder(Table)
table_share_decoder = msgspec.json.Decoder(TableShare)
table_delta_decoder = msgspec.json.Decoder(TableDelta)
cancel_decoder = msgspec.json.Decoder(Cancel)
cancel_reply_decoder = msgspec.json.Decoder(CancelReply)


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
