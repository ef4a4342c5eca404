"""What the broker knows of one agent (:class:`AgentRecord`) and of one change (a `Transition`).

Data only: the registry mutates records, the capability indexes and the router read them,
the components are told of transitions. Kept apart so none of those imports another.
"""

from __future__ import annotations

import math
from sys import intern
from typing import Literal, NamedTuple

import msgspec

from reach_agent.routing.member import NO_PERMISSIONS, Member
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

TransitionKind = Literal["registered", "state", "left", "evicted"]


class Transition(NamedTuple):
    """One change of an agent: published as an ``Event``, handed to every consumer."""

    kind: TransitionKind
    agent_id: str
    from_: AgentState | None
    to: AgentState | None
    reason: str


class AgentRecord(Member):
    """What the broker knows of one agent: what the routing reads
    (:class:`~reach_agent.routing.member.Member`) and what detection and scoring keep.
    Mutated only by the registry (and the router's hand-out count)."""

    __slots__ = (
        "announce",
        "deadline_gen",
        "delivery",
        "disconnected",
        "fail_total",
        "forget_at",
        "heap_at",
        "last_seen_wall_ms",
        "offline_at",
        "ok_total",
        "oldest_task_ms",
        "probe_failures",
        "recover_hbs",
        "resync",
        "seq",
        "status",
        "stuck",
        "suspect_at",
        "token",
        "window",
    )

    stats: Stats

    def __init__(self, msg: Announce, interval_s: float, window: ArrivalWindow) -> None:
        super().__init__(msg.agent_id, msg.max_concurrency, Stats())
        self.window = window
        self.seq = -1
        self.token = ""
        self.last_seen_wall_ms = 0
        self.ok_total = 0
        self.fail_total = 0
        self.oldest_task_ms: int | None = None
        self.status = "idle"
        self.stuck = False
        self.suspect_at = 0.0
        self.offline_at = 0.0
        self.forget_at = 0.0
        self.deadline_gen = 0
        self.heap_at = math.inf  # due time of the live deadline entry (inf: none)
        self.recover_hbs = 0
        self.probe_failures = 0
        self.disconnected = False
        self.resync = False
        """The broker's own link was down since the last heartbeat: the next gap is not the
        agent's (no arrival sample, no missed beat)."""
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
        self.subject = msg.metadata.get("prompt") if foreign else None
        # Most agents declare none: they share one empty set (a frozenset is 216 B).
        self.permissions = frozenset(msg.permissions) if msg.permissions else NO_PERMISSIONS
        self.context_window = msg.context_window
        self.set_context(self.context_usage_pct)

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
