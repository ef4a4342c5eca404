"""Broker configuration: one Struct per section of ``configs/broker.toml``.

Every field has a default (the defaults from the field reports) and a one-line docstring;
unknown keys are refused, so a typo in ``broker.toml`` is a clear error rather than a
silently ignored setting.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Literal

import msgspec
from msgspec import Meta

from reach_agent.wire.schema import CAPABILITY_MAX_LEN, CAPABILITY_PATTERN

Positive = Annotated[float, Meta(gt=0)]
RootSkill = Annotated[str, Meta(pattern=CAPABILITY_PATTERN, max_length=CAPABILITY_MAX_LEN)]
Share = Annotated[float, Meta(ge=0, le=1)]


class Section(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Shared options of config sections."""


class NatsSection(Section):
    url: str | None = None
    """NATS server URL(s), comma-separated; unset starts an embedded nats-server."""
    creds: str | None = None
    """Path of a NATS credentials file (``reach auth``: ``DIR/broker.creds``)."""
    tls_ca: str | None = None
    """CA certificate (PEM) the server's certificate must chain to; turns TLS on."""
    context: str | None = None
    """A ``nats`` CLI context (``~/.config/nats/context/NAME.json``) whose server and
    credentials fill what ``url``, ``creds`` and ``tls_ca`` leave unset (``NATS_CONTEXT``
    also names one); with a server of its own, no embedded server starts."""
    auth_dir: str | None = None
    """A ``reach auth init`` DIR: the embedded server runs ``DIR/server.conf`` and the broker
    connects with ``DIR/broker.creds`` (and ``DIR/tls/ca.pem`` with TLS)."""
    ping_interval_s: Annotated[int, Meta(ge=1)] = 2
    """Client PING interval: a dead server is noticed in about ping * outstanding seconds."""
    max_outstanding_pings: Annotated[int, Meta(ge=1)] = 2
    """Unanswered PINGs before the client treats the connection as stale."""
    embedded_port: Annotated[int, Meta(ge=0, le=65535)] = 4222
    """Port of the embedded server (0: any free port)."""
    embedded_store_dir: str | None = None
    """JetStream store dir of the embedded server, kept across restarts (unset:
    ``reach-data`` in the current directory)."""
    embedded_ephemeral: bool = False
    """Give the embedded server a throwaway store instead (a temp dir removed at exit)."""


class BrokerSection(Section):
    prefix: str = "reach"
    """Subject prefix of every reach subject."""
    broker_id: str | None = None
    """This replica's id (unset: host-pid-random)."""
    token_secret: str | None = None
    """HMAC secret for agent tokens, shared by replicas (unset: kept in KV reach_registry)."""
    token_max_age_s: Positive = 7 * 24 * 3600.0
    """Tokens older than this are refused; agents rotate them by re-announcing."""
    metrics_port: Annotated[int, Meta(ge=0, le=65535)] = 9464
    """Port of the Prometheus /metrics endpoint (0 turns it off)."""
    metrics_host: str = "127.0.0.1"
    """Address the metrics endpoint listens on."""
    min_heartbeat_interval_ms: Annotated[int, Meta(ge=50)] = 100
    """Shortest heartbeat interval the broker accepts from an agent (it is raised to this)."""
    max_heartbeat_interval_ms: Annotated[int, Meta(ge=50)] = 300_000
    """Longest heartbeat interval the broker accepts (lowered to this)."""
    shutdown_grace_s: Positive = 5.0
    """How long shutdown waits for in-flight work before closing."""

    @property
    def interval_ms(self) -> tuple[int, int]:
        """The heartbeat intervals an agent may announce: (shortest, longest), in ms."""
        return self.min_heartbeat_interval_ms, self.max_heartbeat_interval_ms


class DetectionSection(Section):
    suspect_after: Positive = 3.0
    """Missed heartbeat intervals before `suspect` (the ceiling when phi decides earlier)."""
    offline_after: Positive = 6.0
    """Missed heartbeat intervals before `offline`."""
    probe_timeout_s: Positive = 3.0
    """How long a probe waits for the agent's answer."""
    forget_after_s: Positive = 24 * 3600.0
    """Offline records are kept this long, then `evicted`."""
    tick_s: Positive = 0.05
    """How often the broker checks deadlines (resolution of missed-heartbeat detection)."""
    phi_enabled: bool = True
    """Adaptive (phi accrual) detection over each agent's own heartbeat history."""
    phi_suspect: Positive = 8.0
    """Phi at which an agent becomes `suspect` (earlier than the fixed threshold)."""
    phi_offline: Positive = 16.0
    """Phi at which a suspect agent becomes `offline`."""
    phi_min_std_ratio: Share = 0.25
    """Minimum standard deviation as a share of the interval: one late packet is not death."""
    phi_window: Annotated[int, Meta(ge=4, le=1000)] = 100
    """Inter-arrival samples kept per agent."""
    phi_min_samples: Annotated[int, Meta(ge=2)] = 5
    """Samples needed before phi is trusted; before that only fixed thresholds apply."""
    phi_prior_samples: Annotated[int, Meta(ge=0, le=1000)] = 5
    """Pseudo-samples at the announced interval a new agent's history starts from, each
    displaced by a real one (0: none, a new agent waits for phi_min_samples real ones)."""
    probe_concurrency: Annotated[int, Meta(ge=1)] = 64
    """At most this many probes in flight."""
    probe_backoff_max_s: Positive = 60.0
    """Ceiling of the jittered exponential backoff between probes of a failing agent."""
    rtt_sample_interval_s: Annotated[float, Meta(ge=0)] = 10.0
    """How often every healthy agent is probed for an RTT sample (0: never), while the
    probe budget allows it."""
    probe_budget_per_s: Annotated[float, Meta(ge=0)] = 1000.0
    """RTT samples sent per second at most, whatever the size of the fleet: N healthy agents
    are sampled every max(rtt_sample_interval_s, N / budget) seconds, in turn (0: none)."""
    advisories: bool = True
    """Use the server's $SYS connect/disconnect advisories when the account exports them."""
    advisory_account: str | None = None
    """Account whose advisories to follow (unset: this connection's, via $SYS.REQ.USER.INFO)."""
    observer_suspect_share: Share = 0.3
    """Share of the fleet that, going silent at once, makes the broker doubt its own link and
    hold every state until heartbeats flow again or the server's connection list confirms."""


class ScoringSection(Section):
    """score = 100 * L^w_live * T^w_lat * F^w_load * S^w_succ (see reach_broker/core/scoring.py)."""

    weight_liveness: Annotated[float, Meta(ge=0)] = 1.0
    """Exponent of the liveness ratio over the last heartbeat/probe outcomes."""
    weight_latency: Annotated[float, Meta(ge=0)] = 1.0
    """Exponent of the latency term (probe RTT and task duration EWMAs vs tolerances)."""
    weight_load: Annotated[float, Meta(ge=0)] = 0.4
    """Exponent of the load term 1 / (1 + (active + queue) / max_concurrency)."""
    weight_success: Annotated[float, Meta(ge=0)] = 2.0
    """Exponent of the task success rate over the last results."""
    weight_delivery: Annotated[float, Meta(ge=0)] = 2.0
    """Exponent of the delivery term (what callers saw: ``reach.outcome.<agent_id>``)."""
    success_prior: Annotated[float, Meta(ge=0)] = 5.0
    """Virtual successes added to the success rate, so one early failure is not a verdict."""
    liveness_window: Annotated[int, Meta(ge=1, le=1000)] = 20
    """Heartbeat/probe outcomes the liveness ratio is computed over."""
    success_window: Annotated[int, Meta(ge=1)] = 100
    """Task results the success rate is computed over."""
    rtt_tolerance_ms: Positive = 100.0
    """Probe RTT EWMA above this scales the latency term by tolerance / RTT."""
    task_tolerance_ratio: Positive = 2.0
    """Task EWMA above this multiple of the capability's median task time is penalised."""
    task_tolerance_floor_ms: Positive = 250.0
    """Task durations below this are never penalised, whatever the peers do."""
    ewma_alpha: Share = 0.3
    """Smoothing of the RTT and task-duration EWMAs."""
    stuck_factor: Positive = 3.0
    """A task running longer than this * timeout_hint_ms counts as stuck."""
    stuck_penalty: Share = 0.5
    """Score multiplier while the agent has a stuck task."""


class RoutingSection(Section):
    default_limit: Annotated[int, Meta(ge=1, le=100)] = 3
    """Candidates returned when the request does not say."""
    min_reach_score: Annotated[float, Meta(ge=0, le=100)] = 60.0
    """Candidates scoring below this are not routed."""
    load_watermark: Share = 0.85
    """Candidates with active / max_concurrency at or above this are not routed."""
    choice: Literal["weighted", "p2c", "ranked"] = "weighted"
    """How the order of a reply is chosen: weighted-random sample, power of two choices on
    expected completion time, or plain ranking."""
    pool_factor: Annotated[int, Meta(ge=1, le=100)] = 4
    """The weighted sample is drawn from the best limit * pool_factor candidates."""
    vnodes: Annotated[int, Meta(ge=1, le=10_000)] = 150
    """Unused: sticky keys go by rendezvous hashing, which keeps no ring (accepted so older
    files load; the route tables still carry it for callers of older SDKs)."""
    rank_refresh_ms: Annotated[float, Meta(ge=0)] = 50.0
    """A capability's ranking is rebuilt at most this often, and a capability of more than 500
    agents at most this often per 500 of them (a ranking sorts them all); state changes apply
    at once (the walk reads them)."""
    slow_start_share: Share = 0.2
    """Share of traffic a just-recovered agent gets at first."""
    slow_start_s: Annotated[float, Meta(ge=0)] = 30.0
    """Length of the slow-start ramp after recovery (0 turns slow start off)."""
    max_eject_share: Share = 0.5
    """At most this share of a capability's agents is kept out for a low score at once."""
    panic_threshold: Share = 0.5
    """Below this healthy share a capability is in panic mode (logged, counted)."""
    inflight_ceiling: Annotated[int, Meta(ge=1)] | None = None
    """Fleet-wide in-flight tasks (reported active) above which routes answer OVERLOADED
    (unset: ``inflight_share`` of the fleet's slots, so it scales with the fleet)."""
    inflight_share: Annotated[float, Meta(gt=0, le=10)] = 0.9
    """With no fixed ceiling: the ceiling is this share of Σ max_concurrency over the agents
    that are not offline."""
    overloaded_retry_after_ms: Annotated[int, Meta(ge=0, le=3_600_000)] = 250
    """The ``retry_after_ms`` an ``OVERLOADED`` for the in-flight ceiling carries."""


class CompensationSection(Section):
    max_entries: Annotated[int, Meta(ge=1)] = 2000
    """Bound of the compensation queue (REACH_COMPENSATION max_msgs, discard new)."""
    default_ttl_s: Positive = 3600.0
    """Expiry of a queued entry when the caller does not give one."""
    replay_concurrency: Annotated[int, Meta(ge=1)] = 8
    """Replayed tasks in flight at once, per capability."""
    receipt_timeout_s: Positive = 2.0
    """How long a replay waits for the agent's receipt before trying another agent."""
    ack_wait_s: Positive = 15.0
    """A fetched entry not acked (nor kept alive) within this is redelivered: its broker died
    mid-replay, or a nak was lost in a leader change. The longest such an entry waits; kept
    alive every third of it while an agent runs it. Was 30 s, as long as a caller's usual
    wait: nemesis seeds 38 and 39 saw 19 waits time out just before such an entry ran."""
    sweep_interval_s: Positive = 5.0
    """How often expired entries are recorded `failed`/`expired` and removed, the depth gauge
    refreshed, and capabilities with waiting entries and a reachable agent replayed again."""
    busy_retry_max_s: Positive = 1.0
    """Ceiling of the backoff while every agent of a capability answers TARGET_BUSY."""


class JetStreamSection(Section):
    replicas: Annotated[int, Meta(ge=1, le=5)] | None = None
    """Replicas of every stream and the KV bucket (unset: 3 when the server reports a cluster
    of three or more nodes, else 1); an existing asset is moved to this count in place."""


class ClaimsSection(Section):
    scan_window_s: Positive = 3600.0
    """At start, claims (KV reach_claims) written this long ago are read to know who runs
    what; a task running longer than this when the broker starts is not released if its
    agent then goes offline (its claim waits for the agent, or for the bucket's max age)."""
    release: bool = True
    """Release the running claims of agents the broker declares offline, so their requests
    can run elsewhere (off: they stay claimed until their agent returns or they expire)."""


HTTP_TOKEN_PATTERN = r"^[A-Za-z0-9._~+/=-]{16,256}$"
HttpToken = Annotated[str, Meta(pattern=HTTP_TOKEN_PATTERN)]
"""A token of the broker's HTTP surfaces (the console's, the A2A gateway's): 16-256 URL-,
header- and cookie-safe characters."""


def http_token(value: str, source: str, what: str) -> str:
    """``value`` if it can be a ``what`` token (16-256 of ``A-Z a-z 0-9 . _ ~ + / = -``)."""
    try:
        return msgspec.convert(value, HttpToken)
    except msgspec.ValidationError:
        raise ConfigError(
            f"{source}: {what} token is 16 to 256 of the characters A-Z a-z 0-9 . _ ~ + / = -"
            f" (got {len(value)} characters)"
        ) from None


def console_token(value: str, source: str) -> str:
    """``value`` if it can be a console token."""
    return http_token(value, source, "a console")


def a2a_token(value: str, source: str) -> str:
    """``value`` if it can be an A2A gateway token."""
    return http_token(value, source, "an A2A")


class ConsoleSection(Section):
    enabled: bool = True
    """Serve the web console at / on the metrics port (beside /metrics)."""
    token: HttpToken | None = None
    """Token the console asks for; required when the metrics port listens beyond loopback
    (without one the console is off there, /metrics stays open)."""
    sample_s: Positive = 5.0
    """How often each agent's score, task time and load are sampled for its chart."""
    history_s: Positive = 300.0
    """How far back the samples go (bounded memory: history_s / sample_s per agent)."""
    events: Annotated[int, Meta(ge=1, le=100_000)] = 500
    """Events kept for the timeline (the last ones read from REACH_AUDIT when a page starts
    watching, then live)."""
    follow_idle_s: Positive = 60.0
    """How long REACH_AUDIT and the ack records are still followed after the last page left
    (nobody watching: no consumer, no event or ack record decoded)."""
    push_s: Positive = 1.0
    """How often a watching page gets the fleet (and at once after a transition)."""
    max_agents: Annotated[int, Meta(ge=1)] = 500
    """Agents sent to the page, the least healthy first (the counts cover all)."""
    chart_agents: Annotated[int, Meta(ge=0)] = 1_000
    """Agents with a chart (samples kept) at most: the history's memory and its tick's work
    are bounded by it whatever the fleet (beyond it the charts are a sample: the first agents
    seen, then each agent a viewer opens, taking the ring opened least recently)."""


class A2ASection(Section):
    port: Annotated[int, Meta(ge=0, le=65535)] = 0
    """Port of the A2A registry and gateway (Agent Cards, JSON-RPC per capability; 0: off)."""
    host: str = "127.0.0.1"
    """Address it listens on; anything but loopback requires a token."""
    token: HttpToken | None = None
    """Bearer token every request must carry (``Authorization: Bearer <token>``; unset: the
    console's token, if any)."""
    public_url: str | None = None
    """Base URL the cards name (unset: the scheme and host each request came in on)."""
    call_timeout_s: Positive = 30.0
    """Deadline of a ``message/send`` the caller gives none for (message metadata
    ``timeout_s``); an agent's ``timeout_hint_ms`` still stretches it."""
    root_skill: RootSkill | None = None
    """A capability the origin stands for: ``/.well-known/agent-card.json`` is its card and
    ``POST /`` its JSON-RPC endpoint, so an A2A client given only ``http://host:port`` talks
    to it (unset: the origin is reach's own card, the skill named per message)."""
    long_task_hint_s: Annotated[float, Meta(ge=0)] = 30.0
    """A capability whose best agent announces a ``timeout_hint_ms`` of at least this is
    answered with a ``Task`` (working) as soon as an agent takes a message, instead of
    the result: the caller polls, subscribes to or cancels it (0: only when asked with
    ``returnImmediately``)."""


class SynadiaSection(Section):
    """Agents of the Synadia Agent Protocol for NATS (``$SRV.INFO.agents``), routed as they
    are (reach_broker/interop/synadia.py)."""

    enabled: bool = True
    """Discover them, follow their heartbeats and route to them."""
    sweep_interval_s: Positive = 30.0
    """How often ``$SRV.INFO.agents`` is asked for every instance (and the server which
    connection holds which), besides at start and on a heartbeat of an unknown instance."""
    max_concurrency: Annotated[int, Meta(ge=1, le=100_000)] = 1
    """Prompts one instance is taken to serve at once (their protocol does not say; their
    host SDK serves one at a time unless told otherwise)."""
    forget_after_s: Positive = 300.0
    """An instance offline this long is evicted (a restarted agent is a new instance; one that
    only reconnects is found again on its next heartbeat)."""


class QuotaLimit(Section):
    rate: Annotated[float, Meta(gt=0)]
    """Route requests per second."""
    burst: Annotated[int, Meta(ge=1)] | None = None
    """Bucket size: requests allowed at once after a quiet spell (unset: max(1, rate))."""


class QuotasSection(Section):
    """Token buckets per (caller, capability) on route requests (reach_broker/core/quotas.py)."""

    rate: Annotated[float, Meta(ge=0)] = 0.0
    """Route requests per second each caller may make for each capability (0: no quota
    unless a caller's own limit or the capability's route rule sets one)."""
    burst: Annotated[int, Meta(ge=1)] | None = None
    """Bucket size of that default (unset: max(1, rate))."""
    per_caller: dict[str, QuotaLimit] = {}
    """A caller's own limit, per capability, over the default and the route rules."""
    callers: list[str] = []
    """Callers named in the ``caller`` label of the quota metrics (any other is ``other``):
    the label stays bounded by this list."""
    max_buckets: Annotated[int, Meta(ge=1)] = 100_000
    """Buckets kept at most (the oldest dropped first: it comes back full)."""


class OutcomesSection(Section):
    """What callers saw, folded into the delivery term (reach_broker/core/delivery.py)."""

    enabled: bool = True
    """Follow ``<prefix>.outcome.*`` and score delivery by it."""
    window_s: Positive = 60.0
    """The span the outlier and unanswered rules look at."""
    min_callers: Annotated[int, Meta(ge=1)] = 2
    """Distinct callers that must see failures before they count against an agent: the
    delivery term takes the failure share of the min_callers-th worst caller."""
    min_attempts: Annotated[int, Meta(ge=1)] = 5
    """Attempts a caller must have sent within the window before its share counts."""
    max_failure_share: Share = 0.05
    """The outlier rule: above this failure share over the window, the agent is ejected."""
    unanswered_after: Annotated[int, Meta(ge=1)] = 3
    """N of the unanswered rule: receipted calls without a result (any callers), with no
    result nor finished task from the agent meanwhile, after which it is out for everyone."""


class FleetSection(Section):
    """How the fleet is split into partitions, and the route tables their owners publish
    (reach_broker/core/tables.py, service/tables.py, service/partitions.py)."""

    partitions: Annotated[int, Meta(ge=1, le=4096)] = 32
    """Partitions of the fleet (by the agent id's FNV-1a hash): each has one owner at a time,
    which publishes its share of every capability's route table. Every broker of a
    deployment must say the same."""
    lease_ttl_s: Annotated[float, Meta(ge=1, le=600)] = 6.0
    """A partition's lease (KV ``reach_partitions``) lapses this long after its owner last
    renewed it (every third of it); another broker then takes the partition."""
    tables: bool = True
    """Publish route tables, so callers route locally (off: every call asks a broker)."""
    table_batch_ms: Annotated[float, Meta(ge=10, le=10_000)] = 250.0
    """Load and score changes go out at most this often; a change of state (or a score
    across ``min_reach_score``) at once."""
    table_store_s: Annotated[float, Meta(ge=0.1, le=3600)] = 1.0
    """A share whose agents or their states changed is written to KV ``reach_tables`` (what
    a caller reads when no broker answers) at most this often; one whose load or scores only
    drifted at most every 10 x this (``service/tables.DRIFT_STORE_FACTOR``)."""
    forward_timeout_s: Annotated[float, Meta(gt=0, le=60)] = 0.5
    """How long a broker waits for a capability's owner to answer a route request it
    forwarded (service/forwarding.py) before refusing it ``OVERLOADED`` (retryable); below
    the callers' route timeout (1 s by default) so the refusal reaches them."""


class RuleSection(Section):
    """One capability's route rule in broker.toml (reach_agent/routing/rules.py)."""

    split: str | None = None
    """``version=1:95,2:5`` or ``TAG=a:90,b:10``."""
    require: dict[str, str] = {}
    """Tags every routed agent must carry, e.g. ``{ env = "prod" }``."""
    quota: str | None = None
    """``RATE[:BURST]``: route requests per second per caller for this capability."""


class Config(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """The whole broker configuration."""

    nats: NatsSection = msgspec.field(default_factory=NatsSection)
    broker: BrokerSection = msgspec.field(default_factory=BrokerSection)
    detection: DetectionSection = msgspec.field(default_factory=DetectionSection)
    scoring: ScoringSection = msgspec.field(default_factory=ScoringSection)
    routing: RoutingSection = msgspec.field(default_factory=RoutingSection)
    compensation: CompensationSection = msgspec.field(default_factory=CompensationSection)
    jetstream: JetStreamSection = msgspec.field(default_factory=JetStreamSection)
    claims: ClaimsSection = msgspec.field(default_factory=ClaimsSection)
    console: ConsoleSection = msgspec.field(default_factory=ConsoleSection)
    a2a: A2ASection = msgspec.field(default_factory=A2ASection)
    synadia: SynadiaSection = msgspec.field(default_factory=SynadiaSection)
    quotas: QuotasSection = msgspec.field(default_factory=QuotasSection)
    fleet: FleetSection = msgspec.field(default_factory=FleetSection)
    outcomes: OutcomesSection = msgspec.field(default_factory=OutcomesSection)
    rules: dict[str, RuleSection] = {}
    """Route rules by capability (``[rules."summarize"]``); KV reach_rules overrides them."""


class ConfigError(ValueError):
    """The configuration file is unreadable or invalid; the message names the key."""


def load(path: str | os.PathLike[str] | None = None) -> Config:
    """Read ``broker.toml`` (or defaults when ``path`` is None); then apply env overrides."""
    if path is None:
        cfg = Config()
    else:
        try:
            data = Path(path).read_bytes()
        except OSError as exc:
            raise ConfigError(f"cannot read config {str(path)!r}: {exc.strerror}") from None
        try:
            cfg = msgspec.toml.decode(data, type=Config)
        except msgspec.ValidationError as exc:
            raise ConfigError(f"{path}: {exc}") from None
        except msgspec.DecodeError as exc:
            raise ConfigError(f"{path}: not valid TOML ({exc})") from None
    if os.environ.get("NATS_URL"):
        cfg.nats.url = os.environ["NATS_URL"]
    if os.environ.get("REACH_TOKEN_SECRET"):
        cfg.broker.token_secret = os.environ["REACH_TOKEN_SECRET"]
    if os.environ.get("REACH_CONSOLE_TOKEN"):
        cfg.console.token = console_token(os.environ["REACH_CONSOLE_TOKEN"], "REACH_CONSOLE_TOKEN")
    if os.environ.get("REACH_A2A_TOKEN"):
        cfg.a2a.token = a2a_token(os.environ["REACH_A2A_TOKEN"], "REACH_A2A_TOKEN")
    if cfg.detection.offline_after < cfg.detection.suspect_after:
        raise ConfigError(
            f"detection.offline_after ({cfg.detection.offline_after}) is below "
            f"detection.suspect_after ({cfg.detection.suspect_after})"
        )
    return cfg
