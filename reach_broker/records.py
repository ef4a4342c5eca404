"""What the broker knows of one agent (:class:`AgentRecord`) and of one change (a `Transition`).

Data only: the registry mutates records, the capability indexes and the router read them,
the components are told of transitions. Kept apart so none of those imports another.
"""

from __future__ import annotations

import math
from sys import intern
from typing import Literal, NamedTuple

import msgspec

from reach_agent.schema import AgentState, AgentView, Announce

from .detector import ArrivalWindow
from .scoring import Stats

HeartbeatResult = Literal["accepted", "stale", "forged", "unknown"]
TransitionKind = Literal["registered", "state", "left", "evicted"]


class Transition(NamedTuple):
    """One change of an agent: published as an ``Event``, handed to every listener."""

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
        "capabilities",
        "context_usage_pct",
        "context_window",
        "deadline_gen",
        "delivery",
        "disconnected",
        "fail_total",
        "forget_at",
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
        """The delivery term of the score: what callers saw (:mod:`reach_broker.outcomes`)."""
        self.apply_announce(msg, interval_s)

    def apply_announce(self, msg: Announce, interval_s: float) -> None:
        msg = _interned(msg)
        self.announce = msg
        self.capabilities = tuple(msg.capabilities)
        self.max_concurrency = msg.max_concurrency
        self.interval_s = interval_s
        self.region = msg.region
        self.version = msg.version
        self.tags = msg.tags
        self.timeout_hint_ms = msg.timeout_hint_ms
        self.permissions = frozenset(msg.permissions)
        self.context_window = msg.context_window
        self.set_context(self.context_usage_pct)

    def set_context(self, usage_pct: float | None) -> None:
        """The reported context usage, and the headroom it leaves:
        ``context_window x (1 - usage / 100)`` tokens (0 without a ``context_window``)."""
        self.context_usage_pct = usage_pct
        window = self.context_window or 0
        self.headroom = int(window * (1.0 - usage_pct / 100.0)) if usage_pct else window

    def set_load(self, active: int, queue_depth: int) -> int:
        """Record the agent's reported load; returns the change of ``active``. (Its
        ``weight`` follows at the next :meth:`set_score`.)"""
        delta = active - self.active
        self.active = active
        self.queue_depth = queue_depth
        self.load = min(active / self.max_concurrency, 1.0)
        return delta

    def set_score(self, score: float) -> bool:
        """Record the score the registry computed from the current inputs (load among them)
        and the agent's weight in the routing draw that follows: its score (at least 1) times
        its free capacity (at least 0.05), kept here so a route request reads it instead of
        computing it per candidate. False when the score did not move."""
        load = self.load
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
        )


def _opt_intern(value: str | None) -> str | None:
    return None if value is None else intern(value)


def _interned(msg: Announce) -> Announce:
    """``msg`` with its repeated strings interned (capabilities, agent_type, version, region,
    tags): a fleet of one kind shares one ``"summarize"`` instead of one copy an agent. Equal
    to ``msg``; about 0.3 KiB less per agent kept (issue 7: < 4 KiB an agent)."""
    return msgspec.structs.replace(
        msg,
        capabilities=[intern(c) for c in msg.capabilities],
        agent_type=_opt_intern(msg.agent_type),
        version=_opt_intern(msg.version),
        region=_opt_intern(msg.region),
        tags={intern(k): intern(v) for k, v in msg.tags.items()} if msg.tags else msg.tags,
    )
