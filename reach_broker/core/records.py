"""What the broker knows of one agent (:class:`AgentRecord`) and of one change (a `Transition`).

Data only: the registry mutates records, the capability indexes and the router read them,
the components are told of transitions. Kept apart so none of those imports another.
"""

from __future__ import annotations

import math
from sys import intern
from typing import Literal, NamedTuple

import msgspec

from reach_agent.wire.schema import (
    PROTOCOL_REACH,
    PROTOCOL_SYNADIA,
    AgentState,
    AgentView,
    Announce,
)

from .detector import ArrivalWindow
from .scoring import Stats

HeartbeatResult = Literal["accepted", "stale", "forged", "unknown"]

NO_PERMISSIONS: frozenset[str] = frozenset()
TransitionKind = Literal["registered", "state", "left", "evicted"]


class Transition(NamedTuple):
    """One change of an agent: published as an ``Event``, handed to every consumer."""

    kind: TransitionKind
    agent_id: str
    from_: AgentState | None
    to: AgentState | None
    reason: str


class AgentRecord:
    """What the broker knows of one agent. Mutated only by the registry."""

    __slots__ = (
        "active",
        "agent_id",
        "announce",
        "busy",
        "capabilities",
        "context_usage_pct",
        "context_window",
        "deadline_gen",
        "delivery",
        "disconnected",
        "fail_total",
        "forget_at",
        "full_until",
        "handed",
        "handed_at",
        "headroom",
        "heap_at",
        "interval_s",
        "last_seen",
        "last_seen_wall_ms",
        "load",
        "max_concurrency",
        "offline_at",
        "ok_total",
        "oldest_task_ms",
        "permissions",
        "probe_failures",
        "protocol",
        "queue_depth",
        "recover_hbs",
        "recovered_at",
        "region",
        "resync",
        "score",
        "seq",
        "state",
        "state_since",
        "stats",
        "status",
        "stuck",
        "subject",
        "suspect_at",
        "tags",
        "timeout_hint_ms",
        "token",
        "version",
        "weight",
        "window",
    )

    def __init__(self, msg: Announce, interval_s: float, window: ArrivalWindow) -> None:
        self.agent_id = msg.agent_id
        self.state: AgentState = "healthy"
        self.state_since = 0.0
        self.stats = Stats()
        self.window = window
        self.seq = -1
        self.token = ""
        self.last_seen = 0.0
        self.last_seen_wall_ms = 0
        self.active = 0
        self.queue_depth = 0
        self.ok_total = 0
        self.fail_total = 0
        self.oldest_task_ms: int | None = None
        self.status = "idle"
        self.load = 0.0
        """The load the agent last reported: ``active / max_concurrency``, at most 1."""
        self.busy = 0.0
        """The share of its slots this broker believes taken now: the reported load, plus the
        routes this broker handed out since the last heartbeat, decaying over the agent's
        task time (:meth:`handed_out`). Routing filters on it against the load watermark."""
        self.handed = 0.0
        self.handed_at = -math.inf
        """Tasks believed in flight (reported and handed out) as of the last hand-out."""
        self.full_until = -math.inf
        """When an agent found full (:meth:`busy_at`) is next worth a look: until then a
        route skips it at the cost of a comparison."""
        self.score = 100.0
        self.weight = 0.0
        """Weight in the routing draw (see set_score), as of the last rescore: every input
        that can make the agent routable (announce, heartbeat, probe answer) rescores."""
        self.set_score(100.0)
        self.stuck = False
        self.suspect_at = 0.0
        self.offline_at = 0.0
        self.forget_at = 0.0
        self.deadline_gen = 0
        self.heap_at = math.inf  # due time of the live deadline entry (inf: none)
        self.recovered_at: float | None = None
        self.recover_hbs = 0
        self.probe_failures = 0
        self.disconnected = False
        self.resync = False
        """The broker's own link was down since the last heartbeat: the next gap is not the
        agent's (no arrival sample, no missed beat)."""
        self.context_usage_pct: float | None = None
        self.delivery = 1.0
        """The delivery term of the score: what callers saw
        (:mod:`reach_broker.service.outcomes`)."""
        self.apply_announce(msg, interval_s)

    def apply_announce(self, msg: Announce, interval_s: float) -> None:
        msg, self.capabilities = _interned(msg)
        self.announce = msg
        self.max_concurrency = msg.max_concurrency
        self.interval_s = interval_s
        self.region = msg.region
        self.version = msg.version
        self.tags = msg.tags
        self.timeout_hint_ms = msg.timeout_hint_ms
        # A Synadia Agent Protocol instance (reach_broker/interop/synadia.py registers it; the reach
        # announce handler refuses that agent_type): spoken to on its own prompt subject.
        foreign = msg.agent_type == PROTOCOL_SYNADIA
        self.protocol = PROTOCOL_SYNADIA if foreign else PROTOCOL_REACH
        self.subject: str | None = msg.metadata.get("prompt") if foreign else None
        """The task subject when it is not ``<p>.task.<agent_id>.<capability>``."""
        # Most agents declare none: they share one empty set (a frozenset is 216 B).
        self.permissions = frozenset(msg.permissions) if msg.permissions else NO_PERMISSIONS
        self.context_window = msg.context_window
        self.set_context(self.context_usage_pct)

    def set_context(self, usage_pct: float | None) -> None:
        """The reported context usage, and the headroom it leaves:
        ``context_window x (1 - usage / 100)`` tokens (0 without a ``context_window``)."""
        self.context_usage_pct = usage_pct
        window = self.context_window or 0
        self.headroom = int(window * (1.0 - usage_pct / 100.0)) if usage_pct else window

    def set_load(self, active: int, queue_depth: int) -> int:
        """Record the agent's reported load (which replaces the hand-outs counted since the
        last report); returns the change of ``active``. (Its ``weight`` follows at the next
        :meth:`set_score`.)"""
        delta = active - self.active
        self.active = active
        self.queue_depth = queue_depth
        load = active / self.max_concurrency
        self.load = self.busy = load if load < 1.0 else 1.0
        return delta

    # --- hand-out accounting (the route path: O(1), this record only) ----------------------

    def handed_out(self, now: float) -> None:
        """A route reply of this broker just named the agent first: count the task it is
        about to get until a heartbeat reports it, so routes between two heartbeats do not
        all go to an agent that looked idle at the last one. Each replica counts its own
        hand-outs; the heartbeat's ``active`` counts everyone's. Not for an agent that
        reports no ``active`` (a Synadia Agent Protocol agent): nothing would ever replace
        the count."""
        if self.protocol != PROTOCOL_REACH:
            return
        self.handed = self.in_flight(now) + 1.0
        self.handed_at = now
        self._set_busy(self.handed)

    def busy_at(self, now: float, watermark: float) -> float:
        """``busy`` as of ``now`` (kept): tasks finish, so an agent that looked full at its
        last heartbeat or hand-out may have room again. Asked only of an agent that looks
        full (the filter's second look), never per candidate. Still at or above
        ``watermark``: ``full_until`` is set to when the estimate falls below it (without a
        task time: to the next heartbeat, which says)."""
        tasks = self.in_flight(now)
        self._set_busy(tasks)
        if self.busy >= watermark:
            task_ms = self.stats.task_ewma_ms
            if task_ms is None:
                self.full_until = max(self.last_seen + self.interval_s, now)
            else:
                room = watermark * self.max_concurrency
                tau = max(task_ms, 1.0) / 1000.0
                self.full_until = now + tau * math.log(tasks / room) if tasks > room else now
        return self.busy

    def in_flight(self, now: float) -> float:
        """Tasks believed running now: the reported ``active`` (as of the last heartbeat), or
        the count at the last hand-out since, each fading with the agent's task time
        (``exp(-elapsed / task EWMA)``: the steady-state count is then rate x task time, as
        Little's law has it). Without a task time nothing fades: the count holds until the
        next heartbeat reports ``active``."""
        if self.handed_at > self.last_seen:
            base, since = self.handed, self.handed_at
        else:
            base, since = float(self.active), self.last_seen
        if base <= 0.0:
            return 0.0
        task_ms = self.stats.task_ewma_ms
        if task_ms is None:
            return base
        return base * math.exp((since - now) * 1000.0 / (task_ms if task_ms > 1.0 else 1.0))

    def _set_busy(self, tasks: float) -> None:
        busy = tasks / self.max_concurrency
        self.busy = busy = busy if busy < 1.0 else 1.0
        score = self.score  # the weight follows, as in set_score
        self.weight = (score if score > 1.0 else 1.0) * (1.0 - busy if busy < 0.95 else 0.05)

    def set_score(self, score: float) -> bool:
        """Record the score the registry computed from the current inputs (load among them)
        and the agent's weight in the routing draw that follows: its score (at least 1) times
        its free capacity (``1 - busy``, at least 0.05), kept here so a route request reads
        it instead of computing it per candidate. False when the score did not move."""
        load = self.busy
        self.weight = (score if score > 1.0 else 1.0) * (1.0 - load if load < 0.95 else 0.05)
        if score == self.score:
            return False
        self.score = score
        return True

    def view(self, wall_ms_now: int, now: float) -> AgentView:
        return AgentView(
            agent_id=self.agent_id,
            state=self.state,
            score=self.score,
            load=round(self.load, 3),
            last_seen_ms=self.last_seen_wall_ms,
            capabilities=list(self.capabilities),
            region=self.region,
            version=self.version,
            success_rate=round(self.stats.success_rate, 4),
            active=self.active,
            max_concurrency=self.max_concurrency,
            protocol=self.protocol,
        )


def _opt_intern(value: str | None) -> str | None:
    return None if value is None else intern(value)


SHARED_MAX = 4096
"""Distinct capability lists and tag sets shared between announces, at most (beyond it each
announce keeps its own: the table never grows with the fleet)."""
_NO_TAGS: dict[str, str] = {}
_NO_LIST: list[str] = []
_NO_METADATA: dict[str, object] = {}
_caps: dict[tuple[str, ...], tuple[list[str], tuple[str, ...]]] = {}
_tags: dict[tuple[tuple[str, str], ...], dict[str, str]] = {}


def _shared_caps(names: list[str]) -> tuple[list[str], tuple[str, ...]]:
    """One list (the announce's) and one tuple (the record's) for every agent announcing the
    same capabilities."""
    key = tuple(intern(c) for c in names)
    shared = _caps.get(key)
    if shared is None:
        shared = (list(key), key)
        if len(_caps) < SHARED_MAX:
            _caps[key] = shared
    return shared


def _shared_tags(tags: dict[str, str]) -> dict[str, str]:
    if not tags:
        return _NO_TAGS
    key = tuple((intern(k), intern(v)) for k, v in tags.items())
    shared = _tags.get(key)
    if shared is None:
        shared = dict(key)
        if len(_tags) < SHARED_MAX:
            _tags[key] = shared
    return shared


def _interned(msg: Announce) -> tuple[Announce, tuple[str, ...]]:
    """``msg`` with what agents of one kind repeat shared, not copied: its strings interned
    (capabilities, agent_type, version, region, tags), the same capability list and tag set
    one object for all (and no metadata, permissions or tags: one empty object for all);
    and its capabilities as a (shared) tuple. Equal to ``msg``; about 0.6 KiB less per
    agent kept (issue 7 and 27: <= 4 KiB an agent). An announce is never mutated, so its
    containers can be shared."""
    caps, caps_tuple = _shared_caps(msg.capabilities)
    return msgspec.structs.replace(
        msg,
        capabilities=caps,
        agent_type=_opt_intern(msg.agent_type),
        version=_opt_intern(msg.version),
        region=_opt_intern(msg.region),
        tags=_shared_tags(msg.tags),
        permissions=msg.permissions or _NO_LIST,
        metadata=msg.metadata or _NO_METADATA,
    ), caps_tuple
