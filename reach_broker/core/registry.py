"""The registry: every known agent and its reach state, as a pure state machine.

Inputs (announce, heartbeat, leave, probe results, disconnects, the passing of time) take the
broker's monotonic clock ``now`` as an argument and return :class:`Transition`s; the service
publishes them as events afterwards. Nothing here does I/O. Which input moves which state
where is the table in :mod:`reach_broker.core.states`; this module turns inputs into its events,
applies the moves, and keeps what those moves read and write: the agents, the counts (per
state, Σ active, Σ slots), the capability indexes, the deadlines each sign of life re-arms (a
heap with one live entry per agent), the score of an agent recomputed after any change, the
read-only views, and the two ways time is set right after a gap: the broker's own outage
(:meth:`Registry.observer_gap`) and the silence moves held while the observer doubted itself
(:meth:`Registry.release_held`).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Container

from reach_agent.routing.index import CapabilityIndexes
from reach_agent.wire.schema import AgentState, AgentView, Announce, Heartbeat
from reach_broker.config import DetectionSection, ScoringSection

from .detector import Detector
from .listing import DEFAULT_PARTITIONS, Listing
from .records import AgentRecord, HeartbeatResult, Transition, TransitionKind
from .scoring import score
from .states import EVICTED, MOVES, SILENCE_EVENTS, Event, Move
from .tokens import TokenSigner

RECOVER_HEARTBEATS = 2
"""On-time heartbeats that also complete a recovery (agents that do not answer probes), once
it has lasted :data:`RECOVER_SPAN` of an interval (at most :data:`RECOVER_SPAN_MAX_S`)."""
RECOVER_SPAN = 0.5
"""How long (in intervals) a recovery by heartbeats lasts at least: beats queued while the
broker or its link stalled arrive together, within milliseconds, each "on time", and made an
agent killed meanwhile healthy within a millisecond of its first (nemesis seed 62: a2,
offline -> recovering -> healthy in 1 ms, routed to for 2.4 s)."""
RECOVER_SPAN_MAX_S = 1.0
"""The span's bound: an agent that beats faster than it announced is not held back longer."""


class Registry:
    """All agents, their capability indexes, and the deadlines that move their states: the
    inputs and the moves they make, the counts and the views."""

    def __init__(
        self,
        detection: DetectionSection,
        scoring: ScoringSection,
        signer: TokenSigner,
        *,
        interval_ms: tuple[int, int],
        partitions: int = DEFAULT_PARTITIONS,
    ) -> None:
        self.detection = detection
        """When silence makes an agent suspect, then offline, then forgotten."""
        self.scoring = scoring
        """How the signs of life, results and task times make an agent's score."""
        self.interval_ms = interval_ms
        """The heartbeat intervals an agent may announce, (shortest, longest) in ms
        (``broker.min/max_heartbeat_interval_ms``): others are clamped to them."""
        self.signer = signer
        self.detector = Detector(detection)
        self.agents: dict[str, AgentRecord] = {}
        self.indexes: CapabilityIndexes[AgentRecord] = CapabilityIndexes()
        self.listing = Listing(partitions)
        """Every agent's id, sorted within its partition (``<p>.agents.<partition>`` pages)."""
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
        self.changed: set[str] = set()
        """Agents rescored, moved or evicted since the route tables last took this set
        (``service/tables.py`` swaps it for an empty one): what their shares may have to say."""
        self.unheard: list[str] = []
        """Agents restored from the snapshot since the broker last began to listen: their
        clocks start again at :meth:`listening`."""
        self.partitions = partitions
        """``[fleet] partitions``: the listing keeps each partition's agents, so a partition
        handed over is dropped in O(partition) (:meth:`drop`)."""

    # --- queries ------------------------------------------------------------------------

    def interval_for(self, msg: Announce) -> float:
        shortest, longest = self.interval_ms
        return min(max(msg.heartbeat_interval_ms, shortest), longest) / 1000.0

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

    # --- inputs ---------------------------------------------------------------------------

    def announce(
        self, msg: Announce, now: float, wall_ms: int
    ) -> tuple[AgentRecord, list[Transition]]:
        """Idempotent upsert; issues a fresh token (rotation) on every announce."""
        interval = self.interval_for(msg)
        rec = self.agents.get(msg.agent_id)
        out: list[Transition] = []
        if rec is None:
            rec = AgentRecord(msg, interval, self.detector.new_window())
            rec.state_since = now
            self.agents[rec.agent_id] = rec
            self.counts["healthy"] += 1
            self.capacity += rec.max_concurrency
            self.indexes.add(rec)
            self.listing.add(rec.agent_id)
            out.append(Transition("registered", rec.agent_id, None, "healthy", "announced"))
        else:
            old_caps, old_slots = rec.capabilities, rec.max_concurrency
            rec.apply_announce(msg, interval)
            if rec.state != "offline":
                self.capacity += rec.max_concurrency - old_slots
            self.indexes.recapability(rec, old_caps)
            rec.window.clear()  # a new process: its rhythm starts afresh
            t = self._fire(rec, "announce", now)
            if t is not None:
                out.append(t)
            self.indexes.state_changed(rec)
        rec.seq = -1  # seq is per process; a (re-)announce starts a new sequence
        rec.token = self.signer.issue(rec.agent_id)
        self._seen(rec, now, wall_ms)
        self.rescore(rec, now)
        return rec, out

    def heartbeat(
        self, hb: Heartbeat, now: float, wall_ms: int
    ) -> tuple[HeartbeatResult, list[Transition]]:
        self.beats += 1
        rec = self.agents.get(hb.agent_id)
        if rec is None:
            return "unknown", []
        if hb.token != rec.token:
            if not self.signer.verify(hb.agent_id, hb.token):
                return "forged", []
            rec.token = hb.token  # genuine, issued by another replica or before a restart
        if hb.seq <= rec.seq:
            return "stale", []
        rec.seq = hb.seq
        cfg = self.scoring
        gap = now - rec.last_seen
        sample = not hb.initial
        if rec.resync:  # the first beat after the broker's own outage: the gap is not its
            rec.resync = sample = False
            gap = 0.0
        on_time = gap <= 1.5 * rec.interval_s
        rec.stats.outcome(on_time, cfg.liveness_window)
        if sample and rec.state in ("healthy", "recovering", "suspect"):
            rec.window.add(gap)
        d_ok = hb.ok_total - rec.ok_total
        d_fail = hb.fail_total - rec.fail_total
        if d_ok >= 0 and d_fail >= 0 and (d_ok or d_fail):
            rec.stats.results(d_ok, d_fail, cfg.success_window)
        rec.ok_total, rec.fail_total = hb.ok_total, hb.fail_total
        if hb.task_ms_p50 is not None and (d_ok or d_fail):
            rec.stats.task(hb.task_ms_p50, cfg.ewma_alpha)
        elif hb.active == 0 and rec.stats.task_ewma_ms is not None:
            # Idle (e.g. ejected for slowness, so no tasks): the verdict fades towards the
            # peers', so the agent is tried again rather than kept out on old evidence.
            rec.stats.idle(self.indexes.peer_task_ms(rec), cfg.ewma_alpha)
        self.inflight += rec.set_load(hb.active, hb.queue_depth)  # replaces the hand-outs
        rec.oldest_task_ms = hb.oldest_task_ms
        if hb.context_usage_pct != rec.context_usage_pct:
            rec.set_context(hb.context_usage_pct)
            self.indexes.score_changed(rec)  # the ranking's tie-break moved
        rec.status = hb.status
        event: Event = "heartbeat"
        if hb.status == "draining":
            event = "heartbeat_draining"
        elif rec.state == "recovering":
            rec.recover_hbs += 1 if on_time else 0
            span = min(RECOVER_SPAN * rec.interval_s, RECOVER_SPAN_MAX_S)
            if rec.recover_hbs >= RECOVER_HEARTBEATS and now - rec.state_since >= span:
                event = "heartbeats_on_time"
        t = self._fire(rec, event, now)
        self._seen(rec, now, wall_ms)
        self.rescore(rec, now)
        return "accepted", [] if t is None else [t]

    def offline_at_ms(self, agent_id: str, now: float, wall_ms: int) -> int | None:
        """When ``agent_id`` was declared offline, on the wall clock (``now`` and
        ``wall_ms``: the same moment on both clocks); None when it is not offline."""
        rec = self.agents.get(agent_id)
        if rec is None or rec.state != "offline":
            return None
        return wall_ms - int((now - rec.state_since) * 1000)

    def leave(self, agent_id: str, now: float, reason: str = "leave") -> list[Transition]:
        rec = self.agents.get(agent_id)
        t = None if rec is None else self._fire(rec, "leave", now, reason=reason)
        return [] if t is None else [t]

    def disconnected(
        self, agent_id: str, now: float, reason: str = "connection closed"
    ) -> list[Transition]:
        """The server saw the agent's connection close: suspect at once (probe follows)."""
        rec = self.agents.get(agent_id)
        t = None if rec is None else self._fire(rec, "disconnect", now, reason=reason)
        if t is None:
            return []
        if t.to == "suspect":
            assert rec is not None
            rec.disconnected = True
            # Probe timeout bounds the wait: no answer by then and the agent is offline.
            self._schedule(rec, rec.suspect_at, now + self.detection.probe_timeout_s)
        return [t]

    def reconcile(self, connected: set[str], now: float) -> list[Transition]:
        """Known agents with no live connection (per the server) are treated as disconnected.

        O(fleet): run at start and after the broker reconnects, never per message.
        """
        out: list[Transition] = []
        for agent_id in [a for a in self.agents if a not in connected]:
            out += self.disconnected(agent_id, now, "no connection at reconcile")
        return out

    def probe_result(
        self, agent_id: str, ok: bool, rtt_ms: float | None, now: float
    ) -> list[Transition]:
        rec = self.agents.get(agent_id)
        if rec is None:
            return []
        rec.stats.outcome(ok, self.scoring.liveness_window)
        if ok:
            rec.probe_failures = 0
            rec.disconnected = False
            if rtt_ms is not None:
                rec.stats.rtt(rtt_ms, self.scoring.ewma_alpha)
            t = self._fire(rec, "probe_ok", now)
            self._rearm(rec, now)  # an answer is a sign of life
        else:
            rec.probe_failures += 1
            # After a disconnect an unanswered probe settles it; after mere silence the
            # offline deadline decides (a raw agent may not answer probes at all).
            t = self._fire(rec, "probe_failed_disconnected", now) if rec.disconnected else None
        self.rescore(rec, now)
        return [] if t is None else [t]

    def expire(
        self, now: float, max_silent: int | None = None, counted: Container[str] = ()
    ) -> list[Transition]:
        """Apply every deadline that has passed: suspect, offline, eviction.

        ``max_silent``: when more agents than this would move for silence now, none of them
        moves; they are :attr:`held` until :meth:`release_held` (the observer doubts its own
        view, see :mod:`reach_broker.service.observer`). Agents in ``counted`` (moved for
        silence lately: the observer's allowance has them already) are not counted again
        (an agent going suspect, then offline, is one agent gone silent, not two).
        Disconnect-confirmed moves and evictions are never held.
        """
        out: list[Transition] = []
        heap = self._deadlines
        forget = self.detection.forget_after_s
        due: list[tuple[AgentRecord, Event]] = []
        while heap and heap[0][0] <= now:
            _, gen, agent_id = heapq.heappop(heap)
            rec = self.agents.get(agent_id)
            if rec is None or gen != rec.deadline_gen:
                continue
            rec.heap_at = math.inf  # the live entry is consumed; re-armed below or by a move
            event = self._deadline_passed(rec, now)
            if event is None:
                self._push(rec, self._next_deadline(rec))
            else:
                due.append((rec, event))
        silent = [r for r, e in due if e in SILENCE_EVENTS and r.agent_id not in counted]
        hold = max_silent is not None and len(silent) > max_silent
        self.silenced = []
        for rec, event in due:
            if hold and event in SILENCE_EVENTS:
                self.held.add(rec.agent_id)  # re-armed by its next sign of life or the release
                continue
            t = self._fire(rec, event, now, silence=now - rec.last_seen,
                           interval=rec.interval_s, forget=forget)  # fmt: skip
            if t is not None:
                out.append(t)
                if event in SILENCE_EVENTS:
                    self.silenced.append(rec.agent_id)
            if t is None or t.to == "suspect":
                self._push(rec, self._next_deadline(rec))
        return out

    def evict(self, agent_id: str, reason: str, now: float = 0.0) -> list[Transition]:
        rec = self.agents.get(agent_id)
        t = None if rec is None else self._fire(rec, "evict", now, reason=reason)
        return [] if t is None else [t]

    def restore(
        self,
        msg: Announce,
        state: AgentState,
        now: float,
        wall_ms: int,
        task_ewma_ms: float | None = None,
        *,
        warm: bool,
    ) -> AgentRecord | None:
        """An agent from the registry snapshot (KV reach_registry) this broker has not heard.

        ``warm`` (its partition held by a live broker until moments ago: taken over while
        other brokers are present or by a broker holding partitions of its own, or handed
        back): it keeps the state the snapshot holds
        (``state``), since its owner changed, not the agent; its first heartbeat confirms that
        state without a transition, an event or a snapshot write (a ``healthy`` agent is
        routed as one from here). Cold (alone, holding no partition: this broker's start, or
        every lease lost while its link was down; nobody heard the agent meanwhile, perhaps
        for a long outage): it starts ``suspect`` (``offline`` and
        ``draining`` stay so) and becomes routable only when a heartbeat or probe answer
        confirms it. Either way its silence is counted from ``now`` and counted again from
        :meth:`listening`, when the broker can first hear it: one that stays silent through
        that whole window moves as any silent agent does, with its events. The gap until
        its first heartbeat is not a sample of its rhythm (``resync``, which also marks it
        not heard since its restore). Its task-time history (``task_ewma_ms``) is kept, so
        its score does not start from nothing. No transition is returned: nothing changed
        in the fleet. An agent already known (it announced first) is left alone and None is
        returned. Call :meth:`restored` once the snapshot is read.
        """
        if msg.agent_id in self.agents:
            return None
        rec = AgentRecord(msg, self.interval_for(msg), self.detector.new_window())
        rec.stats.task_ewma_ms = task_ewma_ms
        to: AgentState = state if warm or state in ("offline", "draining") else "suspect"
        rec.state = to
        rec.state_since = now
        rec.last_seen = now
        rec.last_seen_wall_ms = wall_ms
        rec.resync = True  # not heard since the restore: its first beat's gap is not a sample
        self.agents[rec.agent_id] = rec
        self.counts[to] += 1
        if to != "offline":
            self.capacity += rec.max_concurrency
        self.indexes.add(rec)
        self.listing.add(rec.agent_id)
        if to == "offline":
            rec.forget_at = now + self.detection.forget_after_s
            self._push(rec, rec.forget_at)
        else:
            suspect_s, offline_s = self.detector.deadlines(rec.window, rec.interval_s)
            self._schedule(rec, now + suspect_s, now + offline_s)
            self.unheard.append(rec.agent_id)
        self.rescore(rec, now)
        return rec

    def restored(self, now: float, agents: list[AgentRecord] | None = None) -> None:
        """The snapshot is read: each capability's median task time from the restored
        history, and every score against it: the ``agents`` restored (a partition taken
        over: O(partition)), or every agent (None)."""
        self.indexes.update_medians()
        for rec in self.agents.values() if agents is None else agents:
            self.rescore(rec, now)

    def drop(self, p: int) -> int:
        """Forget partition ``p``'s agents, without a transition: they are not gone, another
        broker owns them now (O(partition)). Returns how many were dropped."""
        ids = self.listing.drop(p)
        for agent_id in ids:
            rec = self.agents.pop(agent_id, None)
            if rec is None:
                continue
            self.counts[rec.state] -= 1
            if rec.state != "offline":
                self.capacity -= rec.max_concurrency
            self.inflight += rec.set_load(0, 0)
            self.indexes.discard(rec)
            rec.deadline_gen += 1  # its heap entries are stale from now on
            self.held.discard(agent_id)
        return len(ids)

    def _fire(
        self, rec: AgentRecord, event: Event, now: float, **details: object
    ) -> Transition | None:
        """Apply the move ``event`` makes from ``rec``'s state (states.MOVES), if any."""
        m = MOVES[rec.state].get(event)
        return None if m is None else self._apply(rec, m, now, **details)

    def _apply(self, rec: AgentRecord, m: Move, now: float, **details: object) -> Transition:
        """Make the move ``m`` (a row of states.MOVES), its reason filled in from ``details``."""
        reason = m.reason.format_map(details) if details else m.reason
        if m.to == EVICTED:
            return self._evict(rec, reason)
        return self._move(rec, m.to, reason, now, m.kind)

    def _deadline_passed(self, rec: AgentRecord, now: float) -> Event | None:
        """Which of ``rec``'s deadlines has passed by ``now`` in its state, if any."""
        state = rec.state
        if state == "suspect":
            if now < rec.offline_at:
                return None
            return "silent_disconnected" if rec.disconnected else "silent_long"
        if state == "offline":
            return "forgotten" if now >= rec.forget_at else None
        return "silent" if now >= rec.suspect_at else None

    def _move(self, rec: AgentRecord, to: AgentState, reason: str, now: float,
              kind: TransitionKind = "state") -> Transition:  # fmt: skip
        """Change ``rec``'s state, with what entering the new state entails."""
        frm = rec.state
        self.counts[frm] -= 1
        self.counts[to] += 1
        if (frm == "offline") != (to == "offline"):
            self.capacity += rec.max_concurrency if frm == "offline" else -rec.max_concurrency
        rec.state = to
        rec.state_since = now
        self.changed.add(rec.agent_id)
        if to == "suspect":
            rec.stats.outcome(False, self.scoring.liveness_window)  # one missed sign
        elif to == "recovering":
            rec.recover_hbs = 0
        elif to == "healthy" and frm == "recovering":
            rec.recovered_at = now  # slow start begins
        elif to == "offline":
            self.inflight += rec.set_load(0, 0)
            # Every way into offline (silence, probe, disconnect) starts the forget clock.
            rec.forget_at = now + self.detection.forget_after_s
            self._push(rec, rec.forget_at)
        self.indexes.state_changed(rec)
        return Transition(kind, rec.agent_id, frm, to, reason)

    def _evict(self, rec: AgentRecord, reason: str) -> Transition:
        frm = rec.state
        self.counts[frm] -= 1
        if frm != "offline":
            self.capacity -= rec.max_concurrency
        self.inflight += rec.set_load(0, 0)
        del self.agents[rec.agent_id]
        self.changed.add(rec.agent_id)
        self.indexes.discard(rec)
        self.listing.remove(rec.agent_id)
        rec.deadline_gen += 1
        return Transition("evicted", rec.agent_id, frm, None, reason)

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

    def listening(self, now: float, agents: list[str] | None = None) -> int:
        """The broker hears heartbeats from ``now`` on (its heartbeat subscription is live).

        An agent restored since, not heard from (no heartbeat since: ``resync``) and not
        ``offline``, gets its whole window again, counted from ``now`` plus one heartbeat
        interval of grace (its next beat is due within one interval, and a cluster takes a
        moment to carry the new subscription to every node), as after the broker's own
        outage (:meth:`observer_gap`): a silence that began before the broker could hear is
        not the agent's, and a start slowed by a busy machine or a slow server takes
        seconds. O(restored), once per start. Returns how many were given their window
        again.

        ``agents``: only these (a partition taken over, restored and heard from ``now`` on:
        the observer's self-doubt extended to a takeover, whose restore names its own agents:
        :attr:`unheard` is then emptied, not to grow with every takeover); None: every agent
        restored."""
        unheard, self.unheard = self.unheard if agents is None else agents, []
        count = 0
        for agent_id in unheard:
            rec = self.agents.get(agent_id)
            if rec is None or not rec.resync or rec.state == "offline":
                continue  # heard since its restore (its clock is its own), or dropped
            rec.last_seen = now
            self._rearm(rec, now + rec.interval_s)
            count += 1
        return count

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
        self.changed.add(rec.agent_id)
        cfg = self.scoring
        hint = rec.timeout_hint_ms
        oldest = rec.oldest_task_ms
        rec.stuck = bool(hint and oldest and oldest > cfg.stuck_factor * hint)
        # The peer median only matters to an agent with a task EWMA.
        peer = self.indexes.peer_task_ms(rec) if rec.stats.task_ewma_ms is not None else None
        new = score(rec, cfg, peer)
        # The routing weight follows the score and load; if only the score moved, the
        # ranking is refreshed on a slower cadence (index.py).
        if rec.set_score(new):
            self.indexes.score_changed(rec)

    def _seen(self, rec: AgentRecord, now: float, wall_ms: int) -> None:
        rec.last_seen = now
        rec.last_seen_wall_ms = wall_ms
        rec.disconnected = False
        self._rearm(rec, now)

    def _rearm(self, rec: AgentRecord, base: float) -> None:
        """Deadlines counted from ``base``, the last sign of life (none while offline)."""
        if rec.state != "offline":
            suspect_s, offline_s = self.detector.deadlines(rec.window, rec.interval_s)
            self._schedule(rec, base + suspect_s, base + offline_s)

    def _schedule(self, rec: AgentRecord, suspect_at: float, offline_at: float) -> None:
        rec.suspect_at = suspect_at
        rec.offline_at = offline_at
        at = self._next_deadline(rec)
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
