"""Which healthy agents get an RTT sample now: a budget per second, not a plan per agent.

The fleet is sampled in turn (the registry's listing walked partition by partition, id by id,
round and round), newcomers first, at ``min(probe_budget_per_s, healthy /
rtt_sample_interval_s)`` samples a second: a small fleet is sampled every
``rtt_sample_interval_s`` as before, a large one as often as the budget allows (every
``healthy / budget`` seconds), and the cost stays the budget's, not the fleet's. Nothing is
kept per agent: a cursor, a short batch of ids, the newcomers not yet sampled.

Pure: :meth:`Sampler.due` takes the clock and returns the agents to probe;
:mod:`reach_broker.service.probes` sends them.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from reach_broker.config import DetectionSection

from .listing import Listing, parse_cursor
from .records import AgentRecord

BURST_S = 0.1
"""Samples saved up while the loop slept: at most this many seconds' worth go out at once."""
BATCH = 64
"""Ids read from the listing at a time."""
SCAN = 4096
"""Ids looked at per call at most (a fleet mostly not healthy is skipped through in steps)."""


class Sampler:
    """The RTT-sample rotation of one broker, within its budget."""

    __slots__ = ("_after", "_at", "_batch", "_p", "agents", "cfg", "credit", "listing", "newcomers")

    def __init__(
        self, cfg: DetectionSection, listing: Listing, agents: dict[str, AgentRecord]
    ) -> None:
        self.cfg = cfg
        self.listing = listing
        self.agents = agents
        self.newcomers: deque[str] = deque()
        """Agents registered since and not sampled yet: sampled before the rotation goes on."""
        self.credit = 1.0
        """Samples that may go out now (the budget accrued since the last call, bounded; the
        first at once)."""
        self._at: float | None = None
        self._p, self._after = 0, ""
        self._batch: deque[str] = deque()

    def joined(self, agent_id: str) -> None:
        """A newcomer: sampled soon, before the rotation reaches it."""
        if self.cfg.rtt_sample_interval_s > 0 and self.cfg.probe_budget_per_s > 0:
            self.newcomers.append(agent_id)

    def rate(self, healthy: int) -> float:
        """Samples a second for ``healthy`` agents: each every interval, within the budget."""
        interval = self.cfg.rtt_sample_interval_s
        if interval <= 0:
            return 0.0
        return min(self.cfg.probe_budget_per_s, healthy / interval)

    def every(self, healthy: int) -> float:
        """How often each of ``healthy`` agents is sampled at :meth:`rate`, in seconds
        (0.0: sampling is off, or there is nothing to sample)."""
        rate = self.rate(healthy)
        return healthy / rate if rate > 0 else 0.0

    def due(self, now: float, healthy: int, free: int, busy: Callable[[str], bool]) -> list[str]:
        """The healthy agents to sample at ``now``: at most ``free`` (probe slots free) and
        what the budget has accrued; an agent ``busy`` (a probe in flight or planned) is
        passed over until the rotation comes round again."""
        rate = self.rate(healthy)
        last, self._at = self._at, now
        if rate <= 0:
            return []
        if last is not None:
            self.credit = min(self.credit + rate * (now - last), max(1.0, rate * BURST_S))
        out: list[str] = []
        agents = self.agents
        for _ in range(SCAN):
            if self.credit < 1.0 or len(out) >= free:
                break
            agent_id = self._next()
            if agent_id is None:
                break
            rec = agents.get(agent_id)
            if rec is None or rec.state != "healthy" or busy(agent_id) or agent_id in out:
                continue
            out.append(agent_id)
            self.credit -= 1.0
        return out

    def wait(self, healthy: int) -> float | None:
        """Seconds until the next sample is due (None: sampling is off or nothing to sample)."""
        rate = self.rate(healthy)
        if rate <= 0:
            return None
        return max(0.0, (1.0 - self.credit) / rate)

    def _next(self) -> str | None:
        """The next agent: a newcomer, else the rotation's next (None: the fleet is empty)."""
        if self.newcomers:
            return self.newcomers.popleft()
        listing = self.listing
        for _ in range(listing.partitions + 1):
            if self._batch:
                return self._batch.popleft()
            ids, cursor = listing.page(self._p, self._after, BATCH)
            self._batch.extend(ids)
            if cursor is None:
                self._p, self._after = 0, ""  # round again
            else:
                self._p, self._after = parse_cursor(cursor, listing.partitions)
        return self._batch.popleft() if self._batch else None
