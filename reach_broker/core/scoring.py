"""The reach score of an agent, in [0, 100]: will a task handed to it now come back in time?

    score = 100 * L^w_live * T^w_lat * F^w_load * S^w_succ * D^w_deliv
                * (stuck_penalty if stuck else 1)

a weighted geometric product, so one bad term pulls the whole score down (a weighted mean
let an agent 1.5 s slower than its peers keep ~85). The ``weight_*`` settings are exponents.

- L, liveness: share of on-time outcomes among the last ``liveness_window`` heartbeats and
  probes (outcomes not yet seen count as on time);
- T, latency: ``min(1, tol_task / task_ewma) * min(1, rtt_tolerance / rtt_ewma)``, with
  ``tol_task = max(task_tolerance_floor, task_tolerance_ratio * capability median)``: no
  penalty up to the tolerance, then in proportion (an agent 4x slower than the tolerance
  keeps 1/4). ``task_ewma`` follows the ``task_ms_p50`` of heartbeats that report finished
  tasks; a heartbeat of an idle agent (nothing finished, nothing running) moves it towards
  the peers' median instead, so an agent ejected for slowness is tried again;
- F, load: ``1 / (1 + (active + queue_depth) / max_concurrency)``: 1 idle, 0.5 at full
  concurrency, 1/3 with a queue as deep again (the load watermark filters full agents
  anyway; F only orders them);
- S, success: ``(ok + success_prior) / (ok + fail + success_prior)`` over about the last
  ``success_window`` results (the prior keeps one early failure from sinking a new agent);
- D, delivery: what callers saw (:mod:`reach_broker.service.outcomes`): 1 minus the failure share
  at least ``outcomes.min_callers`` distinct callers report over the last minute; 0 when the
  outlier rule (more than ``outcomes.max_failure_share``) or the unanswered rule ejects it;
- stuck: the oldest running task is older than ``stuck_factor * timeout_hint_ms``.

Defaults w_live = 1, w_lat = 1, w_load = 0.4, w_succ = 2. Worked example (agent ``beta``,
capability median task 200 ms): 19 of its last 20 heartbeats on time (L = 0.95); task EWMA
500 ms against tol_task = max(250, 2 * 200) = 400 ms (T = 400/500 = 0.8; probe RTT 3 ms
is under the 100 ms tolerance); 2 of 8 slots busy, no queue (F = 1/1.25 = 0.8); 96 ok and
4 failed of the last 100 (S = 101/105 = 0.962)::

    score = 100 * 0.95 * 0.8 * 0.8^0.4 * 0.962^2 = 100 * 0.95 * 0.8 * 0.915 * 0.925 = 64.3

routable (>= min_reach_score 60). Slower still, at 1600 ms (+1500 ms on every task): T = 0.25
and the score is 20.1: out of the routes. The same agent healthy but at full load, no queue
and nothing failed: 100 * 0.5^0.4 = 75.8, still in. Failing: with S = 0.7, 100 * 0.49 = 49.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Protocol

from reach_broker.config import ScoringSection


class Stats:
    """Per-agent inputs of the score, updated in O(1) per heartbeat or probe."""

    __slots__ = (
        "fail_w",
        "live_bits",
        "live_n",
        "live_ok",
        "live_window",
        "ok_w",
        "rtt_ewma_ms",
        "task_ewma_ms",
    )

    def __init__(self) -> None:
        self.live_bits = 0  # ring of outcomes, newest in bit 0
        self.live_n = 0
        self.live_ok = 0
        self.live_window = 0
        self.ok_w = 0.0
        self.fail_w = 0.0
        self.rtt_ewma_ms: float | None = None
        self.task_ewma_ms: float | None = None

    def outcome(self, ok: bool, window: int) -> None:
        """Record one heartbeat/probe outcome (on time or not) in the liveness ring."""
        self.live_window = window
        if self.live_n == window:
            oldest = (self.live_bits >> (window - 1)) & 1
            self.live_ok -= oldest
        else:
            self.live_n += 1
        self.live_bits = ((self.live_bits << 1) | int(ok)) & ((1 << window) - 1)
        self.live_ok += int(ok)

    def results(self, ok: int, fail: int, window: int) -> None:
        """Add task results, keeping about the last ``window`` of them."""
        self.ok_w += ok
        self.fail_w += fail
        total = self.ok_w + self.fail_w
        if total > window:
            scale = window / total
            self.ok_w *= scale
            self.fail_w *= scale

    def rtt(self, ms: float, alpha: float) -> None:
        prev = self.rtt_ewma_ms
        self.rtt_ewma_ms = ms if prev is None else prev + alpha * (ms - prev)

    def task(self, ms: float, alpha: float) -> None:
        prev = self.task_ewma_ms
        self.task_ewma_ms = ms if prev is None else prev + alpha * (ms - prev)

    def idle(self, toward_ms: float | None, alpha: float) -> None:
        """No task finished since the last heartbeat: drift down towards ``toward_ms``
        (the peers' median), so old slowness is forgiven and the agent gets a new trial."""
        prev = self.task_ewma_ms
        if prev is not None and toward_ms is not None and prev > toward_ms:
            self.task_ewma_ms = prev + alpha * (toward_ms - prev)

    @property
    def liveness(self) -> float:
        """On-time share of the last ``window`` outcomes; a new agent starts with a clean
        record, so its first late heartbeat costs 1/window, not half its score."""
        n = self.live_window
        return (self.live_ok + n - self.live_n) / n if n else 1.0

    @property
    def success_rate(self) -> float:
        total = self.ok_w + self.fail_w
        return self.ok_w / total if total > 0 else 1.0


def latency_term(stats: Stats, cfg: ScoringSection, peer_task_ms: float | None) -> float:
    """T: 1.0 within the tolerances, then tolerance / measured (task and probe RTT)."""
    term = 1.0
    rtt = stats.rtt_ewma_ms
    if rtt is not None and rtt > cfg.rtt_tolerance_ms:
        term *= cfg.rtt_tolerance_ms / rtt
    task = stats.task_ewma_ms
    if task is not None:
        tolerance = cfg.task_tolerance_floor_ms
        if peer_task_ms is not None:
            tolerance = max(tolerance, cfg.task_tolerance_ratio * peer_task_ms)
        if task > tolerance:
            term *= tolerance / task
    return term


def load_term(active: int, queue_depth: int, max_concurrency: int) -> float:
    """F: 1 idle, 0.5 at full concurrency, lower with a queue."""
    return 1.0 / (1.0 + (active + queue_depth) / max(max_concurrency, 1))


def success_term(stats: Stats, prior: float) -> float:
    """S: success rate over the recent window, smoothed by ``prior`` virtual successes."""
    if prior <= 0:
        return stats.success_rate
    return (stats.ok_w + prior) / (stats.ok_w + stats.fail_w + prior)


class Scored(Protocol):
    """What an agent's score is made of, as its record holds it."""

    @property
    def stats(self) -> Stats: ...
    @property
    def active(self) -> int: ...
    @property
    def queue_depth(self) -> int: ...
    @property
    def max_concurrency(self) -> int: ...
    @property
    def stuck(self) -> bool:
        """Its oldest running task is older than ``stuck_factor * timeout_hint_ms``."""

    @property
    def delivery(self) -> float:
        """D: what callers saw (1 when nothing is held against the agent)."""


def score(rec: Scored, cfg: ScoringSection, peer_task_ms: float | None = None) -> float:
    """The score in [0, 100], rounded to 0.1 (formula in the module docstring).

    The heartbeat's own copy of :func:`weighted` and :func:`score_of`: computed through
    :func:`terms` the heartbeat handler took 73,344 instructions instead of 64,277 (+14 %,
    callgrind, 1,000 agents)."""
    stats = rec.stats
    value = (
        stats.liveness**cfg.weight_liveness
        * latency_term(stats, cfg, peer_task_ms) ** cfg.weight_latency
        * load_term(rec.active, rec.queue_depth, rec.max_concurrency) ** cfg.weight_load
        * success_term(stats, cfg.success_prior) ** cfg.weight_success
    )
    delivery = rec.delivery
    if delivery < 1.0:
        value *= delivery**cfg.weight_delivery
    if rec.stuck:
        value *= cfg.stuck_penalty
    return round(100.0 * value, 1)


class Terms(NamedTuple):
    """The factors of :func:`score`, each in [0, 1], for explaining a score to people."""

    liveness: float
    latency: float
    load: float
    success: float
    stuck: float
    """1, or ``stuck_penalty`` while a task is stuck."""
    delivery: float = 1.0
    """D: what callers saw (1 when nothing is held against the agent)."""


def terms(rec: Scored, cfg: ScoringSection, peer_task_ms: float | None = None) -> Terms:
    """What :func:`score` multiplies (before the weights): the same inputs, the same terms."""
    stats = rec.stats
    return Terms(
        liveness=stats.liveness,
        latency=latency_term(stats, cfg, peer_task_ms),
        load=load_term(rec.active, rec.queue_depth, rec.max_concurrency),
        success=success_term(stats, cfg.success_prior),
        stuck=cfg.stuck_penalty if rec.stuck else 1.0,
        delivery=rec.delivery,
    )


def weighted(t: Terms, cfg: ScoringSection) -> tuple[float, ...]:
    """Each term raised to its weight, in :class:`Terms`' order: what a score multiplies."""
    return (t.liveness**cfg.weight_liveness, t.latency**cfg.weight_latency,
            t.load**cfg.weight_load, t.success**cfg.weight_success, t.stuck,
            t.delivery**cfg.weight_delivery)  # fmt: skip


def weakest(t: Terms, cfg: ScoringSection) -> str | None:
    """The term that pulls the score down most (the smallest term raised to its weight);
    None when no term is below 1."""
    factors = weighted(t, cfg)
    low = min(factors)
    return Terms._fields[factors.index(low)] if low < 1.0 else None


def score_of(t: Terms, cfg: ScoringSection) -> float:
    """:func:`score` from its terms (rounded alike): what the explanation multiplies out."""
    return round(100.0 * math.prod(weighted(t, cfg)), 1)
