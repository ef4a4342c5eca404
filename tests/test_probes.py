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


def test_newcomers_get_rtt_samples_at_random_phases_spread_over_the_interval() -> None:
    prober, reg, clock = make(rtt_sample_interval_s=10.0)
    for i in range(1000):
        register(prober, reg, f"a{i}", clock.now)
    due = [prober.pending(f"a{i}") for i in range(1000)]
    assert all(d is not None and clock.now <= d < clock.now + 10.0 for d in due)
    buckets = [0] * 10
    for d in due:
        buckets[int(d - clock.now)] += 1  # type: ignore[operator]
    assert max(buckets) < 150 and min(buckets) > 50  # ~100 per second, never a burst


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


def test_healthy_answer_plans_the_next_rtt_sample_with_jitter() -> None:
    prober, reg, clock = make(rtt_sample_interval_s=10.0)
    register(prober, reg, "alpha", clock.now)
    prober.cancel("alpha")
    feed(prober, reg, reg.probe_result("alpha", True, 1.2, clock.now))
    prober._after_probe("alpha", ok=True)
    due = prober.pending("alpha")
    assert due is not None and clock.now + 8.0 <= due <= clock.now + 12.0


def test_rtt_sampling_off_and_draining_agents_are_not_probed() -> None:
    prober, reg, clock = make(rtt_sample_interval_s=0.0)
    register(prober, reg, "alpha", clock.now)
    assert prober.pending("alpha") is None
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
