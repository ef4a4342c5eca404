"""The reach score of an agent, in [0, 100]: will a task handed to it now come back in time?

    score = 100 × (w_live·liveness + w_lat·latency + w_load·free + w_succ·success) / Σw
            × (stuck_penalty if a task is stuck else 1)

- liveness: share of on-time outcomes among the last ``liveness_window`` heartbeats/probes;
- latency: mean of an RTT term ``1 / (1 + rtt_ewma / rtt_tolerance)`` rescaled so 0 ms → 1,
  and a task term that halves each time the agent's task-duration EWMA doubles past
  ``task_tolerance_ratio`` × the capability's median (never below ``task_tolerance_floor``);
- free: ``1 - active / max_concurrency``, further reduced by a queue;
- success: ok / (ok + fail) over roughly the last ``success_window`` results;
- stuck: the oldest running task is older than ``stuck_factor`` × ``timeout_hint_ms``.

The README walks through a worked example.
"""

from __future__ import annotations

from .config import ScoringSection


class Stats:
    """Per-agent inputs of the score, updated in O(1) per heartbeat or probe."""

    __slots__ = (
        "fail_w",
        "live_bits",
        "live_n",
        "live_ok",
        "ok_w",
        "rtt_ewma_ms",
        "task_ewma_ms",
    )

    def __init__(self) -> None:
        self.live_bits = 0  # ring of outcomes, newest in bit 0
        self.live_n = 0
        self.live_ok = 0
        self.ok_w = 0.0
        self.fail_w = 0.0
        self.rtt_ewma_ms: float | None = None
        self.task_ewma_ms: float | None = None

    def outcome(self, ok: bool, window: int) -> None:
        """Record one heartbeat/probe outcome (on time or not) in the liveness ring."""
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

    @property
    def liveness(self) -> float:
        return self.live_ok / self.live_n if self.live_n else 1.0

    @property
    def success_rate(self) -> float:
        total = self.ok_w + self.fail_w
        return self.ok_w / total if total > 0 else 1.0


def latency_term(
    stats: Stats, cfg: ScoringSection, peer_task_ms: float | None
) -> float:
    """1.0 for a fast agent, towards 0 for one much slower than its tolerance."""
    terms = 0.0
    n = 0
    if stats.rtt_ewma_ms is not None:
        terms += 1.0 / (1.0 + stats.rtt_ewma_ms / cfg.rtt_tolerance_ms)
        n += 1
    if stats.task_ewma_ms is not None:
        tolerance = cfg.task_tolerance_floor_ms
        if peer_task_ms is not None:
            tolerance = max(tolerance, cfg.task_tolerance_ratio * peer_task_ms)
        ratio = stats.task_ewma_ms / tolerance
        terms += 1.0 if ratio <= 1.0 else 1.0 / (ratio * ratio)
        n += 1
    return terms / n if n else 1.0


def load_term(active: int, queue_depth: int, max_concurrency: int) -> float:
    free = 1.0 - min(active, max_concurrency) / max_concurrency
    if queue_depth:
        free /= 1.0 + queue_depth / max_concurrency
    return free


def score(
    stats: Stats,
    cfg: ScoringSection,
    *,
    active: int,
    queue_depth: int,
    max_concurrency: int,
    stuck: bool,
    peer_task_ms: float | None = None,
) -> float:
    """The score in [0, 100], rounded to 0.1."""
    w_total = cfg.weight_liveness + cfg.weight_latency + cfg.weight_load + cfg.weight_success
    if w_total <= 0:
        return 100.0
    value = (
        cfg.weight_liveness * stats.liveness
        + cfg.weight_latency * latency_term(stats, cfg, peer_task_ms)
        + cfg.weight_load * load_term(active, queue_depth, max_concurrency)
        + cfg.weight_success * stats.success_rate
    ) / w_total
    if stuck:
        value *= cfg.stuck_penalty
    return round(100.0 * value, 1)
