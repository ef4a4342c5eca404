"""The reach score: the formula's terms, the worked example, and slow/failing agents on a
fake clock (heartbeats carrying task p50 and results, as the SDK sends them)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from reach_agent.wire.schema import Announce, Heartbeat, RouteRequest
from reach_broker.config import Config, ScoringSection
from reach_broker.core.registry import Registry
from reach_broker.core.routing import Router
from reach_broker.core.scoring import Stats, latency_term, load_term, score, success_term
from reach_broker.core.tokens import TokenSigner

CFG = ScoringSection()


def stats(*, live: tuple[int, int] = (0, 0), ok: float = 0, fail: float = 0,
          task_ms: float | None = None, rtt_ms: float | None = None) -> Stats:  # fmt: skip
    s = Stats()
    on_time, late = live
    for _ in range(late):
        s.outcome(False, CFG.liveness_window)
    for _ in range(on_time):
        s.outcome(True, CFG.liveness_window)
    s.ok_w, s.fail_w = ok, fail
    s.task_ewma_ms = task_ms
    s.rtt_ewma_ms = rtt_ms
    return s


def scored(stats: Stats, peer_task_ms: float | None = None, **inputs: Any) -> float:
    """The score of an agent with ``stats`` and ``inputs`` (active, queue_depth,
    max_concurrency, stuck; delivery 1 unless given)."""
    rec = SimpleNamespace(stats=stats, delivery=1.0, **inputs)
    return score(rec, CFG, peer_task_ms)


def test_fresh_idle_agent_scores_100() -> None:
    assert scored(Stats(), active=0, queue_depth=0, max_concurrency=8, stuck=False) == 100.0


def test_worked_example_of_the_docstring() -> None:
    s = stats(live=(19, 1), ok=96, fail=4, task_ms=500.0, rtt_ms=3.0)
    assert s.liveness == 0.95
    assert latency_term(s, CFG, peer_task_ms=200.0) == 0.8
    assert load_term(2, 0, 8) == 0.8
    assert success_term(s, CFG.success_prior) == pytest.approx(101 / 105)
    got = scored(s, active=2, queue_depth=0, max_concurrency=8, stuck=False,
                peer_task_ms=200.0)  # fmt: skip
    assert got == 64.3
    slow = stats(live=(19, 1), ok=96, fail=4, task_ms=1600.0, rtt_ms=3.0)
    assert scored(slow, active=2, queue_depth=0, max_concurrency=8, stuck=False,
                 peer_task_ms=200.0) == 20.1  # fmt: skip


def test_full_load_alone_keeps_an_agent_routable() -> None:
    s = stats(live=(20, 0), ok=100, task_ms=200.0, rtt_ms=2.0)
    full = scored(s, active=8, queue_depth=0, max_concurrency=8, stuck=False,
                 peer_task_ms=200.0)  # fmt: skip
    assert full == 75.8
    assert full >= Config().routing.min_reach_score
    queued = scored(s, active=8, queue_depth=8, max_concurrency=8, stuck=False,
                   peer_task_ms=200.0)  # fmt: skip
    assert queued == 64.4  # 100 x (1/3)^0.4


def test_latency_within_tolerance_costs_nothing() -> None:
    # Tolerance = max(250 ms floor, 2 x peer median): 2x slower than peers is fine.
    assert latency_term(stats(task_ms=400.0), CFG, peer_task_ms=200.0) == 1.0
    assert latency_term(stats(task_ms=240.0), CFG, peer_task_ms=10.0) == 1.0
    assert latency_term(stats(task_ms=500.0), CFG, peer_task_ms=10.0) == 0.5
    assert latency_term(stats(rtt_ms=99.0), CFG, None) == 1.0
    assert latency_term(stats(rtt_ms=400.0), CFG, None) == 0.25


def test_success_prior_keeps_one_early_failure_from_ejecting() -> None:
    one_of_two = stats(ok=1, fail=1)
    assert success_term(one_of_two, 5.0) == 6 / 7
    assert scored(one_of_two, active=0, queue_depth=0, max_concurrency=4, stuck=False) == 73.5
    assert success_term(one_of_two, 0.0) == 0.5


def test_stuck_task_halves_the_score() -> None:
    assert scored(Stats(), active=1, queue_depth=0, max_concurrency=1, stuck=True) == 37.9


# --- over time, through the registry -------------------------------------------------------


class Fleet:
    """Three agents of one capability heartbeating every second on a fake clock."""

    def __init__(self, max_concurrency: int = 8) -> None:
        cfg = Config()
        cfg.routing.rank_refresh_ms = 0
        self.cfg = cfg
        self.reg = Registry(
            cfg.detection,
            cfg.scoring,
            TokenSigner(b"k" * 32, 3600.0, wall=lambda: 1_000_000.0),
            interval_ms=cfg.broker.interval_ms,
        )
        reg = self.reg
        self.router = Router(cfg.routing, reg.indexes, lambda a, c: f"reach.task.{a}.{c}",
                             inflight=lambda: reg.inflight,
                             capacity=lambda: reg.capacity)  # fmt: skip
        self.seq = 0
        self.tokens: dict[str, str] = {}
        self.totals: dict[str, tuple[int, int]] = {}
        for agent_id in ("a", "b", "c"):
            ann = Announce(agent_id=agent_id, capabilities=["summarize"],
                           max_concurrency=max_concurrency, heartbeat_interval_ms=1000)  # fmt: skip
            rec, _ = self.reg.announce(ann, 0.0, 0)
            self.tokens[agent_id] = rec.token
            self.totals[agent_id] = (0, 0)

    def beat(self, agent_id: str, now: float, *, ok: int = 10, fail: int = 0, p50: int = 100,
             active: int = 1) -> None:  # fmt: skip
        self.seq += 1
        ok_total, fail_total = self.totals[agent_id]
        ok_total, fail_total = ok_total + ok, fail_total + fail
        self.totals[agent_id] = (ok_total, fail_total)
        hb = Heartbeat(agent_id=agent_id, token=self.tokens[agent_id], seq=self.seq,
                       active=active, ok_total=ok_total, fail_total=fail_total,
                       task_ms_p50=p50)  # fmt: skip
        assert self.reg.heartbeat(hb, now, 0)[0] == "accepted"

    def routable(self, now: float) -> set[str]:
        self.router.route("summarize", RouteRequest(limit=3), now)  # rebuilds the ranking
        return {r.agent_id for r in self.reg.indexes["summarize"].ranked}

    def score(self, agent_id: str) -> float:
        return self.reg.agents[agent_id].score


def test_agent_1500ms_slower_than_its_peers_drops_below_60_within_5s() -> None:
    fleet = Fleet()
    for t in range(1, 11):
        for agent_id in "abc":
            fleet.beat(agent_id, float(t))
        fleet.routable(float(t))
    assert fleet.routable(10.0) == {"a", "b", "c"}
    assert [fleet.score(x) for x in "abc"] == [95.4, 95.4, 95.4]  # 1 of 8 busy
    # From t=10 on, every task of c takes +1500 ms; its p50 reflects them from t=12 (the
    # first slow tasks complete) and it gets fewer tasks done.
    scores = []
    for t in range(11, 16):
        fleet.beat("a", float(t))
        fleet.beat("b", float(t))
        slow = t >= 12
        fleet.beat("c", float(t), ok=2 if slow else 10, p50=1600 if slow else 100, active=3)
        fleet.routable(float(t))
        scores.append(fleet.score("c"))
    assert scores == [88.0, 40.0, 25.4, 20.3, 17.8]
    assert fleet.score("c") < 60
    assert fleet.routable(15.0) == {"a", "b"}
    assert (fleet.score("a"), fleet.score("b")) == (95.4, 95.4)


def test_failing_agent_drops_below_60_within_5s() -> None:
    fleet = Fleet()
    for t in range(1, 11):
        for agent_id in "abc":
            fleet.beat(agent_id, float(t))
    scores = []
    for t in range(11, 16):
        fleet.beat("a", float(t))
        fleet.beat("b", float(t))
        fleet.beat("c", float(t), ok=0, fail=10)
        scores.append(fleet.score("c"))
    assert scores == [79.6, 66.5, 55.6, 46.5, 38.9]
    assert fleet.routable(15.0) == {"a", "b"}


def test_every_agent_at_full_load_stays_above_60() -> None:
    fleet = Fleet(max_concurrency=4)
    for t in range(1, 11):
        for agent_id in "abc":
            fleet.beat(agent_id, float(t), active=4)
    assert [fleet.score(x) for x in "abc"] == [75.8, 75.8, 75.8]
    # Full agents are not routed (load watermark), but they are not ejected for score.
    idx = fleet.reg.indexes["summarize"]
    idx.rebuild(fleet.cfg.routing, 10.0)
    assert (idx.ejected, [r.agent_id for r in idx.ranked]) == (0, ["a", "b", "c"])


def test_agent_ejected_for_slowness_is_tried_again_once_idle() -> None:
    fleet = Fleet()
    for t in range(1, 11):
        for agent_id in "abc":
            fleet.beat(agent_id, float(t))
        fleet.routable(float(t))
    fleet.beat("c", 11.0, ok=2, p50=1600, active=2)
    fleet.beat("c", 12.0, ok=2, p50=1600, active=0)
    assert fleet.routable(12.0) == {"a", "b"}
    # Ejected: no tasks, nothing running, no p50. Its task EWMA drifts to the peers' 100 ms.
    scores = []
    for t in range(13, 19):
        fleet.beat("a", float(t))
        fleet.beat("b", float(t))
        fleet.beat("c", float(t), ok=0, active=0)
        scores.append(fleet.score("c"))
    assert scores == [39.3, 52.6, 69.0, 88.1, 100.0, 100.0]
    assert fleet.routable(18.0) == {"a", "b", "c"}


def test_slow_agent_with_tasks_still_running_is_not_forgiven() -> None:
    fleet = Fleet()
    for t in range(1, 11):
        for agent_id in "abc":
            fleet.beat(agent_id, float(t))
        fleet.routable(float(t))
    fleet.beat("c", 11.0, ok=2, p50=1600, active=2)
    before = fleet.reg.agents["c"].stats.task_ewma_ms
    fleet.beat("c", 12.0, ok=0, active=2)  # nothing finished, two still running
    assert fleet.reg.agents["c"].stats.task_ewma_ms == before
