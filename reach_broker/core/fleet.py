"""The registry's state and clocks: every known agent, the fleet's counts, the capability
indexes, the deadline heap and each agent's score.

:class:`Fleet` is the base of :class:`reach_broker.core.registry.Registry`, which turns inputs
into moves; this holds what those moves read and write: the agents, the counts (per state,
Σ active, Σ slots), the deadlines each sign of life re-arms (a heap with one live entry per
agent), the score of an agent recomputed after any change, the read-only views, and the two
ways time is set right after a gap: the broker's own outage (:meth:`Fleet.observer_gap`) and
the silence moves held while the observer doubted itself (:meth:`Fleet.release_held`).
Pure: no I/O, the caller's clock.
"""

from __future__ import annotations

import heapq
import math

from reach_agent.wire.schema import AgentView, Announce
from reach_broker.config import Config

from .detector import Detector
from .index import CapabilityIndexes
from .records import AgentRecord
from .scoring import score
from .tokens import TokenSigner


class Fleet:
    """Every agent, the counts and indexes over them, and their deadlines."""

    def __init__(self, cfg: Config, signer: TokenSigner) -> None:
        self.cfg = cfg
        self.signer = signer
        self.detector = Detector(cfg.detection)
        self.agents: dict[str, AgentRecord] = {}
        self.indexes = CapabilityIndexes()
        self._deadlines: list[tuple[float, int, str]] = []
        self.inflight = 0  # Σ active over the fleet, kept incrementally
        self.capacity = 0
        """Σ max_concurrency over the agents not offline, kept incrementally: the fleet's
        slots (the default in-flight ceiling is a share of it)."""
        self.counts: dict[str, int] = dict.fromkeys(
            ("healthy", "suspect", "offline", "recovering", "draining"), 0
        )
        self.beats = 0
        """Heartbeats received (any result): the observer's sign that its link carries them."""
        self.held: set[str] = set()
        """Agents whose silence deadline passed while the broker doubted itself: not moved
        until :meth:`release_held`."""
        self.silenced: list[str] = []
        """Agents the last :meth:`expire` moved for silence."""

    # --- queries ------------------------------------------------------------------------

    def interval_for(self, msg: Announce) -> float:
        b = self.cfg.broker
        ms = min(max(msg.heartbeat_interval_ms, b.min_heartbeat_interval_ms),
                 b.max_heartbeat_interval_ms)  # fmt: skip
        return ms / 1000.0

    def views(
        self, wall_ms: int, now: float, capability: str | None = None, state: str | None = None
    ) -> list[AgentView]:
        if capability is not None:
            idx = self.indexes.get(capability)
            recs = list(idx.members.values()) if idx else []
        else:
            recs = list(self.agents.values())
        return [
            r.view(wall_ms, now)
            for r in sorted(recs, key=lambda r: r.agent_id)
            if state is None or r.state == state
        ]

    def next_deadline(self) -> float | None:
        return self._deadlines[0][0] if self._deadlines else None

    # --- internals ------------------------------------------------------------------------

    # --- after a gap ----------------------------------------------------------------------

    def release_held(self) -> int:
        """Let the held agents' deadlines run again (the next :meth:`expire` applies them);
        returns how many were held."""
        held, self.held = self.held, set()
        for agent_id in held:
            rec = self.agents.get(agent_id)
            if rec is not None and rec.heap_at == math.inf:
                self._push(rec, self._next_deadline(rec))
        return len(held)

    def observer_gap(self, start: float, end: float) -> None:
        """The broker heard nothing from ``start`` to ``end`` (its own link was down): no
        agent is blamed for it. Every clock is shifted by the gap (silence before ``start``
        still counts), with a grace of one heartbeat interval on top; the next heartbeat's
        gap is not sampled. O(fleet): once per outage, never per message."""
        shift = max(end - start, 0.0)
        self._deadlines = []
        self.held = set()
        for rec in self.agents.values():
            if rec.last_seen < start:
                rec.last_seen += shift
                rec.resync = True
                if rec.recovered_at is not None:
                    rec.recovered_at += shift
            if rec.state == "offline":
                rec.forget_at += shift
            else:
                grace = shift + rec.interval_s
                rec.suspect_at += grace
                rec.offline_at += grace
            self._push(rec, self._next_deadline(rec))

    # --- score and clocks -----------------------------------------------------------------

    def rescore(self, rec: AgentRecord, now: float) -> None:
        cfg = self.cfg.scoring
        hint = rec.timeout_hint_ms
        oldest = rec.oldest_task_ms
        rec.stuck = stuck = bool(hint and oldest and oldest > cfg.stuck_factor * hint)
        # The peer median only matters to an agent with a task EWMA (peer_task_ms inline).
        peer = None
        if rec.stats.task_ewma_ms is not None and rec.capabilities:
            idx = self.indexes.get(rec.capabilities[0])
            peer = idx.median_task_ms if idx else None
        new = score(
            rec.stats,
            cfg,
            active=rec.active,
            queue_depth=rec.queue_depth,
            max_concurrency=rec.max_concurrency,
            stuck=stuck,
            peer_task_ms=peer,
            delivery=rec.delivery,
        )
        # AgentRecord.set_score, inline (every heartbeat): the routing weight follows the
        # score and load; if only the score moved, the ranking is refreshed on a slower
        # cadence (index.py).
        load = rec.busy
        rec.weight = (new if new > 1.0 else 1.0) * (1.0 - load if load < 0.95 else 0.05)
        if new != rec.score:
            rec.score = new
            self.indexes.score_changed(rec)

    def _seen(self, rec: AgentRecord, now: float, wall_ms: int) -> None:
        rec.last_seen = now
        rec.last_seen_wall_ms = wall_ms
        rec.disconnected = False
        if rec.state != "offline":  # _rearm(rec, now), inline (every heartbeat)
            suspect_s, offline_s = self.detector.deadlines(rec.window, rec.interval_s)
            self._schedule(rec, now + suspect_s, now + offline_s)

    def _rearm(self, rec: AgentRecord, base: float) -> None:
        """Deadlines counted from ``base``, the last sign of life."""
        suspect_s, offline_s = self.detector.deadlines(rec.window, rec.interval_s)
        if rec.state != "offline":
            self._schedule(rec, base + suspect_s, base + offline_s)

    def _schedule(self, rec: AgentRecord, suspect_at: float, offline_at: float) -> None:
        rec.suspect_at = suspect_at
        rec.offline_at = offline_at
        state = rec.state  # _next_deadline(rec), inline (every heartbeat)
        if state == "suspect":
            at = offline_at
        else:
            at = rec.forget_at if state == "offline" else suspect_at
        if at >= rec.heap_at:
            # Every heartbeat moves the deadline later: keep the earlier live entry (expire()
            # re-arms from it when it fires) rather than push one heap entry per heartbeat.
            return
        self._push(rec, at)

    def _next_deadline(self, rec: AgentRecord) -> float:
        if rec.state == "suspect":
            return rec.offline_at
        if rec.state == "offline":
            return rec.forget_at
        return rec.suspect_at

    def _push(self, rec: AgentRecord, at: float) -> None:
        rec.deadline_gen += 1
        rec.heap_at = at
        heapq.heappush(self._deadlines, (at, rec.deadline_gen, rec.agent_id))
