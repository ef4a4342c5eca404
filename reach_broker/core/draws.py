"""How a route orders its pool once the walk has gathered it: the weighted draw (weight =
score * free capacity * slow start, without replacement), power of two choices on expected
completion time, and the slow-start factor of an agent just recovered. Pure: the caller
gives the routing config, the clock and the random source."""

from __future__ import annotations

import random as _random

from reach_broker.config import RoutingSection

from .records import AgentRecord


def weighted(
    pool: list[AgentRecord], limit: int, now: float, cfg: RoutingSection, rng: _random.Random
) -> list[AgentRecord]:
    """Weighted draw without replacement: weight = score * free capacity * slow start."""
    # Hot path (every route): the record keeps its weight; slow start only when recovered.
    random = rng.random
    pool = list(pool)
    weights = [
        r.weight if r.recovered_at is None else r.weight * slow_start_factor(r, now, cfg)
        for r in pool
    ]
    total = sum(weights)
    chosen: list[AgentRecord] = []
    while pool and len(chosen) < limit:
        x = random() * total
        last = len(pool) - 1
        for i, w in enumerate(weights):
            x -= w
            if x <= 0 or i == last:
                chosen.append(pool.pop(i))
                total -= weights.pop(i)
                break
    return chosen


def slow_start_factor(rec: AgentRecord, now: float, cfg: RoutingSection) -> float:
    """``slow_start_share`` for ``slow_start_s`` after recovery, then a linear ramp."""
    span = cfg.slow_start_s
    if rec.recovered_at is None or span <= 0:
        return 1.0
    age = now - rec.recovered_at
    if age >= 2 * span:
        return 1.0
    share = cfg.slow_start_share
    if age <= span:
        return share
    return share + (1.0 - share) * (age - span) / span


def p2c(
    pool: list[AgentRecord], limit: int, now: float, cfg: RoutingSection, rng: _random.Random
) -> list[AgentRecord]:
    """Power of two choices on expected completion time, then the rest by score.

    A slow-started agent's expected time is divided by its slow-start factor, so it wins its
    pairings about that much less often.
    """
    if len(pool) >= 2:
        a, b = rng.sample(pool, 2)
        ea = expected_ms(a) / slow_start_factor(a, now, cfg)
        eb = expected_ms(b) / slow_start_factor(b, now, cfg)
        first = a if ea <= eb else b
    else:
        first = pool[0]
    return [first, *[r for r in pool if r is not first][: limit - 1]]


def expected_ms(rec: AgentRecord) -> float:
    """The time ``rec`` would take to finish a task given now: its queue ahead, per slot."""
    per_task = rec.stats.task_ewma_ms or 1.0
    return (rec.active + rec.queue_depth + 1) * per_task / rec.max_concurrency
