"""The probe scheduler's decisions (no NATS needed): when each agent is probed next."""

from __future__ import annotations

import random
from typing import Any

from nats.aio.client import Client as NATS

from reach_agent.wire.schema import Announce
from reach_agent.wire.subjects import Subjects
from reach_broker.config import Config
from reach_broker.core.records import Transition
from reach_broker.core.registry import Registry
from reach_broker.core.tokens import TokenSigner
from reach_broker.service.context import BrokerContext, Link
from reach_broker.service.metrics import Metrics
from reach_broker.service.probes import Prober


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def make(**detection: Any) -> tuple[Prober, Registry, Clock]:
    cfg = Config()
    for key, value in detection.items():
        setattr(cfg.detection, key, value)
    clock = Clock()
    reg = Registry(
        cfg.detection,
        cfg.scoring,
        TokenSigner(b"k" * 32, 3600.0, wall=lambda: 1_000_000.0),
        interval_ms=cfg.broker.interval_ms,
    )
    metrics = Metrics()

    def spawn(coro: Any, name: str) -> None:
        raise AssertionError(f"nothing is spawned here ({name})")

    def emit(transitions: list[Transition]) -> None:
        if transitions:
            raise AssertionError(f"no transition is made here ({transitions})")

    ctx = BrokerContext(nc=NATS(), subjects=Subjects(), broker_id="b1", clock=clock,
                        wall=lambda: 1_000_000.0, spawn=spawn, emit=emit,
                        link=Link())  # fmt: skip  # never connected: nothing is sent
    prober = Prober(ctx, reg, cfg.detection, results=metrics.probes, rtt=metrics.probe_rtt,
                    rng=random.Random(4))  # fmt: skip
    return prober, reg, clock


def register(prober: Prober, reg: Registry, agent_id: str, now: float) -> None:
    ann = Announce(agent_id=agent_id, capabilities=["summarize"], max_concurrency=4,
                   heartbeat_interval_ms=1000)  # fmt: skip
    rec, out = reg.announce(ann, now, 0)
    for t in out:
        prober.on_transition(t, rec)


def feed(prober: Prober, reg: Registry, out: list[Transition]) -> None:
    for t in out:
        prober.on_transition(t, reg.agents.get(t.agent_id))


def sample_for(prober: Prober, reg: Registry, clock: Clock, seconds: float) -> list[str]:
    """The RTT samples the prober's loop would send over ``seconds`` (ticks of 10 ms, no
    probe in flight, every one answered at once)."""
    sent: list[str] = []
    for _ in range(round(seconds / 0.01)):
        clock.now += 0.01
        sent += prober.sampler.due(clock.now, reg.counts["healthy"], 64, prober._busy)
    return sent


def test_a_small_fleet_is_sampled_in_turn_every_interval_newcomers_first() -> None:
    prober, reg, clock = make(rtt_sample_interval_s=10.0)
    for i in range(50):
        register(prober, reg, f"a{i:02d}", clock.now)
    assert [prober.pending(f"a{i:02d}") for i in range(50)] == [None] * 50  # nothing planned
    assert prober.sampler.every(50) == 10.0  # reach_rtt_sample_interval_seconds
    first = sample_for(prober, reg, clock, 10.0)
    # The newcomers as they came, the first at once, then 5 a second (50 / 10 s).
    assert first == [f"a{i:02d}" for i in range(50)]
    register(prober, reg, "late", clock.now)
    again = sample_for(prober, reg, clock, 10.5)  # 51 agents at 5.1 a second, and the newcomer
    assert again[0] == "late"  # a newcomer before the rotation goes on
    turn = again[1:52]  # then one turn of the rotation: every agent once, "late" too
    assert len(again) >= 52 and sorted(turn) == sorted([f"a{i:02d}" for i in range(50)] + ["late"])


def test_a_large_fleet_is_sampled_within_the_budget_and_every_agent_in_turn() -> None:
    prober, reg, clock = make(rtt_sample_interval_s=10.0, probe_budget_per_s=200.0)
    for i in range(5000):
        register(prober, reg, f"a{i:04d}", clock.now)
    prober.sampler.newcomers.clear()  # (as if sampled): the rotation alone
    assert prober.sampler.every(5000) == 25.0  # 5000 / 200 a second, not the 10 s interval
    first = sample_for(prober, reg, clock, 1.0)
    assert 199 <= len(first) <= 200  # 5000 / 10 s would be 500 a second: the budget says 200
    rest = sample_for(prober, reg, clock, 24.1)
    turn = (first + rest)[:5000]  # 5000 / 200 = 25 s: every agent once
    assert len(first + rest) >= 5000 and len(set(turn)) == 5000


def test_samples_pass_over_agents_not_healthy_or_being_probed() -> None:
    prober, reg, clock = make(rtt_sample_interval_s=1.0)
    for i in range(4):
        register(prober, reg, f"a{i}", clock.now)
    prober.sampler.newcomers.clear()
    feed(prober, reg, reg.disconnected("a1", clock.now))  # suspect: probed from the heap
    prober._inflight.add("a2")
    got = sample_for(prober, reg, clock, 2.0)
    assert set(got) == {"a0", "a3"}


def test_suspects_and_recoverers_are_probed_now_offline_ones_with_backoff() -> None:
    prober, reg, clock = make()
    register(prober, reg, "alpha", clock.now)
    feed(prober, reg, reg.disconnected("alpha", clock.now))
    assert prober.pending("alpha") == clock.now
    feed(prober, reg, reg.probe_result("alpha", False, None, clock.now))
    assert reg.agents["alpha"].state == "offline"
    first = prober.pending("alpha")
    assert first is not None and clock.now + 0.5 <= first <= clock.now + 1.0


def test_failing_agent_backs_off_exponentially_to_the_cap() -> None:
    prober, reg, clock = make(probe_backoff_max_s=8.0)
    register(prober, reg, "alpha", clock.now)
    feed(prober, reg, reg.disconnected("alpha", clock.now))
    delays = []
    for _ in range(7):
        prober.cancel("alpha")  # the loop pops the entry before probing
        feed(prober, reg, reg.probe_result("alpha", False, None, clock.now))
        prober._after_probe("alpha", ok=False)
        due = prober.pending("alpha")
        assert due is not None
        delays.append(due - clock.now)
    bounds = [(0.5, 1.0), (1.0, 2.0), (2.0, 4.0), (4.0, 8.0), (4.0, 8.0), (4.0, 8.0), (4.0, 8.0)]
    for delay, (lo, hi) in zip(delays, bounds, strict=True):
        assert lo <= delay <= hi, delays
    assert len(set(delays)) == 7  # jittered: no two agents would line up


def test_a_healthy_answer_plans_nothing_the_rotation_samples_it_again() -> None:
    prober, reg, clock = make(rtt_sample_interval_s=10.0)
    register(prober, reg, "alpha", clock.now)
    feed(prober, reg, reg.probe_result("alpha", True, 1.2, clock.now))
    prober._after_probe("alpha", ok=True)
    assert prober.pending("alpha") is None


def test_rtt_sampling_off_and_draining_agents_are_not_probed() -> None:
    prober, reg, clock = make(rtt_sample_interval_s=0.0)
    register(prober, reg, "alpha", clock.now)
    assert prober.pending("alpha") is None
    assert sample_for(prober, reg, clock, 1.0) == []
    assert prober.sampler.every(1) == 0.0
    register(prober, reg, "beta", clock.now)
    feed(prober, reg, reg.disconnected("beta", clock.now))
    assert prober.pending("beta") == clock.now
    out = reg.leave("beta", clock.now)
    feed(prober, reg, out)
    assert prober.pending("beta") is None


def test_evicted_agents_are_forgotten() -> None:
    prober, reg, clock = make()
    register(prober, reg, "alpha", clock.now)
    feed(prober, reg, reg.disconnected("alpha", clock.now))
    feed(prober, reg, reg.evict("alpha", "test"))
    assert prober.pending("alpha") is None


def test_probe_asked_for_while_one_runs_is_sent_right_after() -> None:
    prober, reg, clock = make()
    register(prober, reg, "alpha", clock.now)
    prober.cancel("alpha")
    prober._inflight.add("alpha")
    prober._again.add("alpha")  # the loop saw it due while the RTT sample was in flight
    prober._inflight.discard("alpha")
    prober._after_probe("alpha", ok=True)
    assert prober.pending("alpha") == clock.now


def test_only_a_healthy_agents_answer_is_an_rtt_sample() -> None:
    """A suspect's answer (a freeze that just ended: late by the whole stall) says it lives;
    it is no latency sample."""
    prober, reg, clock = make(rtt_sample_interval_s=10.0)
    register(prober, reg, "alpha", clock.now)
    assert prober._settle("alpha", True, "ok", True, 2.0, clock.now) is True
    assert reg.agents["alpha"].stats.rtt_ewma_ms == 2.0
    assert prober._settle("alpha", True, "ok", False, 1600.0, clock.now) is True
    assert reg.agents["alpha"].stats.rtt_ewma_ms == 2.0
