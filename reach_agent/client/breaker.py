"""Per-(agent, capability) circuit breakers: CLOSED → OPEN → HALF_OPEN → CLOSED.

Pure: every method takes the clock ``now`` and returns what changed; the client does the I/O
(metrics, logging). Defaults: open after 10 consecutive failures, or more than
50 % failures over a 1 min window holding at least 10 calls; stay open 5 s, doubling on
each failed trial up to 5 min; half-open lets 3 trial calls through and closes when all 3
succeed (any trial failure reopens).

What counts as a failure is :func:`verdict`'s rule: agent faults (no receipt, no responders,
timeout, 5xx errors, lost target) are failures; business rejects and other 4xx count as
successes (the agent answered); TARGET_BUSY, DRAINING and a closing client give no verdict,
they say nothing about the agent's health.
"""

from __future__ import annotations

from typing import Literal

from reach_agent.wire.errors import Draining, ReachError, StoreUnavailable, TargetBusy
from reach_agent.wire.retry import Outcome

from .config import BreakerConfig

BreakerState = Literal["closed", "open", "half_open"]
_BUCKETS = 12


class Breaker:
    """One breaker. ``allow(now)`` before a call, ``record(ok, now)`` after it."""

    __slots__ = (
        "_calls",
        "_epochs",
        "_fails",
        "cfg",
        "consecutive",
        "last_used",
        "open_for",
        "open_until",
        "state",
        "trials_ok",
        "trials_started",
    )

    def __init__(self, cfg: BreakerConfig, now: float = 0.0) -> None:
        self.cfg = cfg
        self.state: BreakerState = "closed"
        self.consecutive = 0
        self.open_for = cfg.open_s
        self.open_until = 0.0
        self.trials_started = 0
        self.trials_ok = 0
        self.last_used = now
        self._calls = [0] * _BUCKETS
        self._fails = [0] * _BUCKETS
        self._epochs = [-1] * _BUCKETS

    # --- queries ----------------------------------------------------------------------

    def available(self, now: float) -> bool:
        """Would ``allow`` let a call through now? (No state change: used to pick.)"""
        if self.state == "closed":
            return True
        if self.state == "open":
            return now >= self.open_until
        return self.trials_started < self.cfg.trial_calls

    def window(self, now: float) -> tuple[int, int]:
        """(calls, failures) recorded in the sliding window ending at ``now``."""
        width = self.cfg.window_s / _BUCKETS
        cur = int(now / width)
        calls = fails = 0
        for i in range(_BUCKETS):
            if self._epochs[i] > cur - _BUCKETS:
                calls += self._calls[i]
                fails += self._fails[i]
        return calls, fails

    # --- transitions ------------------------------------------------------------------

    def allow(self, now: float) -> tuple[bool, BreakerState | None]:
        """Take a call slot; returns (allowed, new state if it changed)."""
        self.last_used = now
        if self.state == "closed":
            return True, None
        if self.state == "open":
            if now < self.open_until:
                return False, None
            self.state = "half_open"
            self.trials_started = 1
            self.trials_ok = 0
            return True, "half_open"
        if self.trials_started < self.cfg.trial_calls:
            self.trials_started += 1
            return True, None
        return False, None

    def record(self, ok: bool, now: float) -> BreakerState | None:
        """The outcome of a call; returns the new state if it changed."""
        self.last_used = now
        if self.state == "open":
            return None  # a call that started before the breaker opened: no news
        if self.state == "half_open":
            if not ok:
                self.open_for = min(self.open_for * 2, self.cfg.open_max_s)
                return self._open(now)
            self.trials_ok += 1
            if self.trials_ok >= self.cfg.trial_calls:
                self._reset()
                return "closed"
            return None
        self._count(ok, now)
        if ok:
            self.consecutive = 0
            return None
        self.consecutive += 1
        if self.consecutive >= self.cfg.consecutive_failures:
            return self._open(now)
        calls, fails = self.window(now)
        if calls >= self.cfg.min_calls and fails > self.cfg.failure_ratio * calls:
            return self._open(now)
        return None

    def release(self, now: float) -> None:
        """A call that took a slot ended with no verdict (busy, draining, cancelled)."""
        self.last_used = now
        if self.state == "half_open" and self.trials_started > self.trials_ok:
            self.trials_started -= 1

    # --- internals --------------------------------------------------------------------

    def _count(self, ok: bool, now: float) -> None:
        width = self.cfg.window_s / _BUCKETS
        epoch = int(now / width)
        slot = epoch % _BUCKETS
        if self._epochs[slot] != epoch:
            self._epochs[slot] = epoch
            self._calls[slot] = 0
            self._fails[slot] = 0
        self._calls[slot] += 1
        if not ok:
            self._fails[slot] += 1

    def _open(self, now: float) -> BreakerState:
        self.state = "open"
        self.open_until = now + self.open_for
        self.trials_started = 0
        self.trials_ok = 0
        return "open"

    def _reset(self) -> None:
        self.state = "closed"
        self.consecutive = 0
        self.open_for = self.cfg.open_s
        self._calls = [0] * _BUCKETS
        self._fails = [0] * _BUCKETS
        self._epochs = [-1] * _BUCKETS


Key = tuple[str, str]
"""(agent_id, capability)"""


def verdict(outcome: Outcome, err: ReachError | None = None) -> bool | None:
    """What one attempt says about the agent's health: True (it works), False (a fault), or
    None (no verdict: busy, leaving, or the caller closed)."""
    if outcome == "ok":
        return True
    if outcome == "error":
        if err is None or isinstance(err, TargetBusy | Draining | StoreUnavailable):
            return None  # healthy but full or leaving, or the shared store is not there
        return err.status < 500  # a refused request is a responsive agent
    if outcome == "closed":
        return None
    return False


class Breakers:
    """All breakers of one client, keyed by (agent_id, capability).

    Only pairs that are not closed are kept in a side set, so finding the agents to exclude
    for a capability costs O(open breakers), not O(fleet).
    """

    def __init__(self, cfg: BreakerConfig) -> None:
        self.cfg = cfg
        self._by_key: dict[Key, Breaker] = {}
        self.not_closed: set[Key] = set()

    def __len__(self) -> int:
        """Breakers tracked (bounded by ``max_breakers``)."""
        return len(self._by_key)

    def get(self, agent_id: str, capability: str, now: float) -> Breaker:
        key = (agent_id, capability)
        b = self._by_key.get(key)
        if b is None:
            if len(self._by_key) >= self.cfg.max_breakers:
                self._prune(now)
            b = self._by_key[key] = Breaker(self.cfg, now)
        return b

    def available(self, agent_id: str, capability: str, now: float) -> bool:
        """Would a call to ``agent_id`` for ``capability`` be let through now? (No state
        change: used to pick a candidate.)"""
        b = self._by_key.get((agent_id, capability))
        return b is None or b.available(now)

    def blocked(self, capability: str, now: float) -> list[str]:
        """Agents whose breaker for ``capability`` would refuse a call now."""
        return [
            agent
            for (agent, cap) in self.not_closed
            if cap == capability and not self._by_key[(agent, cap)].available(now)
        ]

    def allow(self, agent_id: str, capability: str, now: float) -> tuple[bool, BreakerState | None]:
        key = (agent_id, capability)
        b = self._by_key.get(key)
        if b is None:
            return True, None
        allowed, change = b.allow(now)
        self._track(key, b)
        return allowed, change

    def record(self, agent_id: str, capability: str, ok: bool, now: float) -> BreakerState | None:
        key = (agent_id, capability)
        b = self.get(agent_id, capability, now)
        change = b.record(ok, now)
        self._track(key, b)
        return change

    def release(self, agent_id: str, capability: str, now: float) -> None:
        b = self._by_key.get((agent_id, capability))
        if b is not None:
            b.release(now)

    def state(self, agent_id: str, capability: str) -> BreakerState:
        b = self._by_key.get((agent_id, capability))
        return "closed" if b is None else b.state

    def _track(self, key: Key, b: Breaker) -> None:
        if b.state == "closed":
            self.not_closed.discard(key)
        else:
            self.not_closed.add(key)

    def _prune(self, now: float) -> None:
        """Drop the least recently used closed breakers (half of the table at most)."""
        by_key = self._by_key
        closed = sorted((b.last_used, key) for key, b in by_key.items() if b.state == "closed")
        for _, key in closed[: max(1, len(self._by_key) // 2)]:
            del self._by_key[key]
