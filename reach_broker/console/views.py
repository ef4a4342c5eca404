"""What the console page is sent: the fleet, each capability's ranking with its reasons, one
agent in detail, the timeline and the compensation queue, as msgspec Structs encoded once
per push (however many pages watch).

Built from the registry, the router and the explainer as they are at that moment (pure: the
clocks are arguments). The page's JSON is the console's own, not the wire contract; its
score terms and reasons are the wire's (``AgentExplain``, ``Exclusion``), so the page says
what ``reach route --explain`` says.
"""

from __future__ import annotations

import heapq
from typing import cast

import msgspec

from reach_agent.wire.schema import AGENT_STATES, AgentExplain, Event, Exclusion, RouteRequest
from reach_broker.core.explain import Explainer
from reach_broker.core.registry import Registry

from .history import Entry, History, Samples

RANKING_ROWS = 25
"""Rows of each capability's ranking (routable first, then the agents left out)."""
CAPABILITIES = 100
"""Capabilities whose ranking the page gets (the least reachable first, then by name)."""

DEFAULT_REQUEST = RouteRequest()
"""A capability's ranking is explained for the request a plain caller sends."""

_encode = msgspec.json.Encoder().encode

_SEVERITY = {"offline": 0, "suspect": 1, "recovering": 2, "draining": 3, "healthy": 4}


class View(msgspec.Struct, kw_only=True):
    """Shared options of the page's JSON."""


class AgentRow(View):
    agent_id: str
    state: str
    score: float
    load: float
    active: int
    max_concurrency: int
    capabilities: list[str]
    last_seen_ms: int
    state_since_ms: int
    """Wall-clock time the agent entered its state."""
    explain: AgentExplain
    region: str | None = None
    version: str | None = None


class Routable(View):
    agent_id: str
    state: str
    score: float
    share: float
    """Its expected share of first picks: its weight over the pool's."""
    explain: AgentExplain


class CapabilityView(View):
    name: str
    members: int
    healthy: int
    reachable: int
    """Agents a plain route request can be given (the pool passes every filter)."""
    ranked: int
    ejected: int
    panic: bool
    routable: list[Routable]
    excluded: list[Exclusion]
    counts: dict[str, int]


class FleetView(View):
    at_ms: int
    broker_id: str
    by_state: dict[str, int]
    agents: list[AgentRow]
    capabilities: list[CapabilityView]
    total: int
    """Agents in the fleet (``agents`` lists at most ``console.max_agents``)."""
    capability_total: int
    """Capabilities in the fleet (``capabilities`` has at most 100)."""


class EventView(View):
    event: Event
    brokers: list[str]


class AgentDetail(View):
    agent: AgentRow
    transitions: list[EventView]
    samples: Samples
    sample_s: float


class QueueDepth(View):
    capability: str
    depth: int
    oldest_ms: int | None = None
    """When the oldest waiting entry was enqueued (Unix ms)."""


class CompensationView(View):
    at_ms: int
    available: bool
    """False when the server has no JetStream (no queue)."""
    total: int = 0
    capabilities: list[QueueDepth] = []
    error: str | None = None


def event_view(entry: Entry) -> EventView:
    return EventView(event=entry.event, brokers=entry.brokers)


class Views:
    """Builds the page's views over the broker's core."""

    def __init__(self, registry: Registry, explainer: Explainer, broker_id: str) -> None:
        self.registry = registry
        self.explainer = explainer
        self.broker_id = broker_id
        self._rows: dict[str, tuple[tuple[object, ...], msgspec.Raw]] = {}
        """Each listed agent's encoded row and what it was built from (see fleet)."""

    def agent_row(
        self, agent_id: str, now: float, wall_ms: int, full: bool = False
    ) -> AgentRow | None:
        """``agent_id``'s row: its score terms, and with ``full`` every figure (its detail)."""
        rec = self.registry.agents.get(agent_id)
        if rec is None:
            return None
        ex = self.explainer
        explain = ex.agent(rec, now) if full else ex.brief(rec)
        since_ms = wall_ms - int(max(now - rec.state_since, 0.0) * 1000)
        return AgentRow(
            agent_id=rec.agent_id, state=rec.state, score=rec.score, load=round(rec.load, 3),
            active=rec.active, max_concurrency=rec.max_concurrency,
            capabilities=list(rec.capabilities), last_seen_ms=rec.last_seen_wall_ms,
            state_since_ms=since_ms, explain=explain,
            region=rec.region, version=rec.version,
        )  # fmt: skip

    def fleet(self, now: float, wall_ms: int, max_agents: int) -> FleetView:
        """The fleet (the least healthy first, then by id) and every capability's ranking."""
        agents = self.registry.agents
        # The first max_agents only: O(fleet) a push, not a sort of the fleet.
        order = heapq.nsmallest(max_agents, agents.values(),
                                key=lambda r: (_SEVERITY.get(r.state, 9), r.agent_id))  # fmt: skip
        # A row is built and encoded again only when its agent was heard from or changed
        # since the last push (most agents, between two heartbeats, did not).
        rows: dict[str, tuple[tuple[object, ...], msgspec.Raw]] = {}
        for rec in order[:max_agents]:
            key = (rec.last_seen_wall_ms, rec.state, rec.state_since, rec.score,
                   rec.stats.rtt_ewma_ms, rec.probe_failures, rec.announce)  # fmt: skip
            hit = self._rows.get(rec.agent_id)
            if hit is None or hit[0] != key:
                row = self.agent_row(rec.agent_id, now, wall_ms)
                hit = (key, msgspec.Raw(_encode(row)))
            rows[rec.agent_id] = hit
        self._rows = rows
        by_state: dict[str, int] = {s: self.registry.counts.get(s, 0) for s in AGENT_STATES}
        indexes = self.registry.indexes
        names = sorted(indexes, key=lambda n: (indexes[n].healthy > 0, n))[:CAPABILITIES]
        caps = [c for n in sorted(names) if (c := self.capability(n, now)) is not None]
        return FleetView(at_ms=wall_ms, broker_id=self.broker_id, by_state=by_state,
                         agents=cast(list[AgentRow], [raw for _, raw in rows.values()]),
                         capabilities=caps, total=len(agents),
                         capability_total=len(indexes))  # fmt: skip

    def capability(self, name: str, now: float) -> CapabilityView | None:
        """``name``'s ranking as a plain request sees it: the pool with each agent's share of
        first picks, then the agents left out with why."""
        idx = self.registry.indexes.get(name)
        if idx is None:
            return None
        ex = self.explainer
        ex.router.refresh(idx, now)  # as a route request would
        walk = ex.walk(idx, DEFAULT_REQUEST, now)
        ranks = {rec.agent_id: i for i, rec in enumerate(idx.ranked, 1)}
        weights = [ex.router.weight(rec, now) for rec in walk.pool]
        total = sum(weights) or 1.0
        routable = [
            Routable(agent_id=rec.agent_id, state=rec.state, score=rec.score,
                     share=round(w / total, 3),
                     explain=ex.agent(rec, now, rank=ranks.get(rec.agent_id, 0),
                                      kept=ex.kept(rec, idx)))
            for rec, w in zip(walk.pool, weights, strict=True)
        ]  # fmt: skip
        limit = max(RANKING_ROWS - len(routable), 0)
        counts, excluded = ex.left_out(idx, DEFAULT_REQUEST, walk.pool, now, walk, limit)
        reachable = sum(1 for code in walk.failed.values() if code is None)
        return CapabilityView(
            name=name, members=len(idx.members), healthy=idx.healthy, reachable=reachable,
            ranked=len(idx.ranked), ejected=idx.ejected, panic=idx.panic,
            routable=routable[:RANKING_ROWS], excluded=excluded, counts=counts,
        )  # fmt: skip

    def agent(self, agent_id: str, history: History, sample_s: float, now: float,
              wall_ms: int) -> AgentDetail | None:  # fmt: skip
        row = self.agent_row(agent_id, now, wall_ms, full=True)
        if row is None:
            return None
        return AgentDetail(agent=row, transitions=[event_view(e) for e in
                                                   history.transitions(agent_id)],
                           samples=history.samples(agent_id), sample_s=sample_s)  # fmt: skip
