"""What the routing knows of one agent, whoever routes: :class:`Member`.

The broker's ``AgentRecord`` is a member (it adds what detection and scoring keep); so is a
caller's route-table entry. Everything a route filter, the ranking or a draw reads is here,
and so is the one bookkeeping every router does between two reports of the agent: the
tasks it handed out since (:meth:`Member.handed_out`), fading with the agent's task time,
which is what makes an agent look full (:meth:`Member.busy_at`) and what its weight in the
draw (:func:`weight`) pays for.
"""

from __future__ import annotations

import math
from typing import Protocol, TypeVar

from reach_agent.wire.schema import PROTOCOL_REACH, AgentState, Candidate

from .hashing import hash64


class TaskTime(Protocol):
    """What the routing reads of an agent's task history."""

    task_ewma_ms: float | None


class TaskStats:
    """A task history that is only its time: a member that keeps no other (a table entry)."""

    __slots__ = ("task_ewma_ms",)

    def __init__(self, task_ewma_ms: float | None = None) -> None:
        self.task_ewma_ms = task_ewma_ms


def weight(score: float, busy: float) -> float:
    """An agent's weight in the routing draw before slow start: its score (at least 1) times
    its free capacity (``1 - busy``, at least 0.05). The draw multiplies in the slow-start
    factor (:func:`reach_agent.routing.draws.weight`)."""
    return (score if score > 1.0 else 1.0) * (1.0 - busy if busy < 0.95 else 0.05)


NO_PERMISSIONS: frozenset[str] = frozenset()
"""The permissions of every member that announces none: one empty set, not one each
(``frozenset([])`` makes a new 216-byte object at every call)."""

M = TypeVar("M", bound="Member")
"""A kind of member (the broker's records, a caller's table entries)."""


def faded(tasks: float, elapsed_s: float, task_ms: float) -> float:
    """``tasks`` running ``elapsed_s`` ago, as many as still run now if each takes the task
    time ``task_ms`` on average: ``tasks x exp(-elapsed / task time)``."""
    return tasks * math.exp(-elapsed_s * 1000.0 / (task_ms if task_ms > 1.0 else 1.0))


class Member:
    """One agent as the routing sees it. Set by its owner (the registry, a route table)."""

    __slots__ = (
        "active",
        "agent_id",
        "busy",
        "capabilities",
        "context_usage_pct",
        "context_window",
        "full_until",
        "handed",
        "handed_at",
        "headroom",
        "hrw",
        "interval_s",
        "last_seen",
        "load",
        "max_concurrency",
        "permissions",
        "protocol",
        "queue_depth",
        "recovered_at",
        "region",
        "score",
        "state",
        "state_since",
        "stats",
        "subject",
        "tags",
        "timeout_hint_ms",
        "version",
        "weight",
    )

    def __init__(self, agent_id: str, max_concurrency: int, stats: TaskTime) -> None:
        self.agent_id = agent_id
        self.hrw = hash64(agent_id)
        """Its id's hash: its weight for a sticky key is ``rendezvous(hrw, slot_hash(key))``."""
        self.capabilities: tuple[str, ...] = ()
        """The capabilities it is a member of (the indexes it is in)."""
        self.state: AgentState = "healthy"
        self.state_since = 0.0
        """When it entered its state (the owner's monotonic clock)."""
        self.stats = stats
        self.max_concurrency = max_concurrency
        self.active = 0
        self.queue_depth = 0
        self.last_seen = 0.0
        """When the agent last reported its load (the owner's monotonic clock)."""
        self.interval_s = 1.0
        """How often it reports (its heartbeat interval)."""
        self.load = 0.0
        """The load the agent last reported: ``active / max_concurrency``, at most 1."""
        self.busy = 0.0
        """The share of its slots believed taken now: the reported load, plus the tasks
        this router handed out since the last report, fading over the agent's task time
        (:meth:`handed_out`). Routing filters on it against the load watermark."""
        self.handed = 0.0
        self.handed_at = -math.inf
        """Tasks believed in flight (reported and handed out) as of the last hand-out."""
        self.full_until = -math.inf
        """When an agent found full (:meth:`busy_at`) is next worth a look: until then a
        route skips it at the cost of a comparison."""
        self.score = 100.0
        self.weight = weight(100.0, 0.0)
        """Weight in the routing draw (:func:`weight`), as of the last score or hand-out."""
        self.recovered_at: float | None = None
        """When it last became healthy after recovering (slow start runs from there)."""
        self.region: str | None = None
        self.version: str | None = None
        self.tags: dict[str, str] = {}
        self.permissions: frozenset[str] = NO_PERMISSIONS
        self.context_window: int | None = None
        self.context_usage_pct: float | None = None
        self.headroom = 0
        """Context tokens free: ``context_window x (1 - usage / 100)`` (0 without a window)."""
        self.timeout_hint_ms: int | None = None
        self.protocol = PROTOCOL_REACH
        self.subject: str | None = None
        """The task subject when it is not ``<p>.task.<agent_id>.<capability>``."""

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
        self.load = self.busy = load if load < 1.0 else 1.0  # a conditional: cheaper than min()
        return delta

    def set_score(self, score: float) -> bool:
        """Record the agent's score and its weight in the routing draw that follows, kept
        here so a route reads it instead of computing it per candidate. False when the
        score did not move."""
        self.weight = weight(score, self.busy)
        if score == self.score:
            return False
        self.score = score
        return True

    # --- hand-out accounting (the route path: O(1), this member only) ----------------------

    def handed_out(self, now: float) -> None:
        """A route just named the agent first: count the task it is about to get until its
        next report does, so routes between two reports do not all go to an agent that
        looked idle at the last one. Each router counts its own hand-outs; the report's
        ``active`` counts everyone's. Not for an agent that reports no ``active`` (a Synadia
        Agent Protocol agent): nothing would ever replace the count."""
        if self.protocol != PROTOCOL_REACH:
            return
        self.handed = self.in_flight(now) + 1.0
        self.handed_at = now
        self._set_busy(self.handed)

    def busy_at(self, now: float, watermark: float) -> float:
        """``busy`` as of ``now`` (kept): tasks finish, so an agent that looked full at its
        last report or hand-out may have room again. Asked only of an agent that looks full
        (the load filter's second look), never per candidate. Still at or above
        ``watermark``: ``full_until`` is set to when the estimate falls below it (without a
        task time: to the next report, which says)."""
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
        """Tasks believed running now: the reported ``active`` (as of the last report), or
        the count at the last hand-out since, each fading with the agent's task time
        (``exp(-elapsed / task EWMA)``: the steady-state count is then rate x task time, as
        Little's law has it). Without a task time nothing fades: the count holds until the
        next report says ``active``."""
        if self.handed_at > self.last_seen:
            base, since = self.handed, self.handed_at
        else:
            base, since = float(self.active), self.last_seen
        if base <= 0.0:
            return 0.0
        task_ms = self.stats.task_ewma_ms
        if task_ms is None:
            return base
        return faded(base, now - since, task_ms)

    def _set_busy(self, tasks: float) -> None:
        busy = tasks / self.max_concurrency
        self.busy = busy = busy if busy < 1.0 else 1.0
        self.weight = weight(self.score, busy)

    def candidate(self, subject: str) -> Candidate:
        """The member as a route candidate; ``subject`` is its task subject unless it has
        one of its own (a Synadia agent's prompt subject)."""
        return Candidate(
            agent_id=self.agent_id,
            subject=self.subject or subject,
            score=self.score,
            state=self.state,
            load=self.load,
            region=self.region,
            version=self.version,
            timeout_hint_ms=self.timeout_hint_ms,
            protocol=self.protocol,
        )
