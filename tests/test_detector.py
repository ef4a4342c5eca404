"""Phi-accrual deadlines and missed-heartbeat detection, pure, on an injected clock."""

from __future__ import annotations

import random

import pytest

from reach_agent.wire.schema import Announce, Heartbeat
from reach_broker.config import Config, DetectionSection
from reach_broker.core.detector import ArrivalWindow, Detector, phi, z_for_phi
from reach_broker.core.records import Transition
from reach_broker.core.registry import Registry
from reach_broker.core.tokens import TokenSigner


def registry(**detection: object) -> Registry:
    cfg = Config()
    cfg.broker.min_heartbeat_interval_ms = 50
    for key, value in detection.items():
        setattr(cfg.detection, key, value)
    return Registry(
        cfg.detection,
        cfg.scoring,
        TokenSigner(b"k" * 32, 3600.0, wall=lambda: 1_000_000.0),
        interval_ms=cfg.broker.interval_ms,
    )


class Agent:
    """Drives one agent's heartbeats into a registry on a fake clock."""

    def __init__(self, reg: Registry, agent_id: str = "alpha", interval_ms: int = 1000) -> None:
        self.reg = reg
        self.agent_id = agent_id
        ann = Announce(agent_id=agent_id, capabilities=["text_processing"], max_concurrency=4,
                       heartbeat_interval_ms=interval_ms)  # fmt: skip
        rec, _ = reg.announce(ann, 0.0, 0)
        self.token = rec.token
        self.seq = 0
        self.transitions: list[Transition] = []

    def beat(self, now: float) -> None:
        self.seq += 1
        hb = Heartbeat(agent_id=self.agent_id, token=self.token, seq=self.seq)
        result, out = self.reg.heartbeat(hb, now, int(now * 1000))
        assert result == "accepted"
        self.transitions += out

    def run_until(self, now: float, step: float = 0.01) -> float:
        """Advance the clock to ``now`` in ticks, collecting expiries; returns ``now``."""
        t = self.reg.next_deadline()
        while t is not None and t <= now:
            self.transitions += self.reg.expire(t)
            t = self.reg.next_deadline()
        self.transitions += self.reg.expire(now)
        return now

    def states(self) -> list[str | None]:
        return [t.to for t in self.transitions if t.kind == "state"]


def test_phi_and_its_inverse_agree() -> None:
    z = z_for_phi(8.0)
    assert z == pytest.approx(5.612, abs=1e-3)
    assert phi(1.0 + z * 0.25, 1.0, 0.25) == pytest.approx(8.0, rel=1e-6)
    assert phi(1.0, 1.0, 0.25) == pytest.approx(0.30103, rel=1e-4)  # -log10(0.5)


def test_arrival_window_keeps_the_last_n_samples() -> None:
    w = ArrivalWindow(3)
    for gap in (10.0, 1.0, 2.0, 3.0):
        w.add(gap)
    assert len(w) == 3
    assert w.mean == pytest.approx(2.0)
    assert w.std == pytest.approx(1.0)
    w.clear()
    assert (len(w), w.mean, w.std) == (0, 0.0, 0.0)


def test_fixed_thresholds_until_enough_samples() -> None:
    det = Detector(DetectionSection(phi_prior_samples=0))
    w = det.new_window()
    for _ in range(4):
        w.add(1.0)
    assert det.deadlines(w, 1.0) == (3.0, 6.0)


def test_prior_fills_in_for_missing_samples_and_fades() -> None:
    w = ArrivalWindow(100)
    assert w.moments(5, 1.0) == (5, 1.0, 0.0)  # no history: the prior alone
    w.add(3.0)
    n, mean, std = w.moments(5, 1.0)  # four pseudo-samples of 1.0 and one real 3.0
    assert (n, mean) == (5, pytest.approx(1.4))
    assert std == pytest.approx((0.8 / 1.0) ** 0.5)  # sum of squares 4*0.16 + 2.56 = 3.2 / 4
    for _ in range(4):
        w.add(3.0)
    assert w.moments(5, 1.0) == (5, 3.0, 0.0)  # five real samples: the prior is gone
    assert w.moments(0, 1.0) == w.moments()


def test_new_agent_gets_phi_deadlines_from_the_prior() -> None:
    det = Detector(DetectionSection())
    w = det.new_window()
    suspect, offline = det.deadlines(w, 1.0)
    assert suspect == pytest.approx(1.0 + z_for_phi(8.0) * 0.25)  # as an old regular agent
    assert offline == pytest.approx(1.0 + z_for_phi(16.0) * 0.25)
    assert det.deadlines(w, 2.0) == (pytest.approx(2 * suspect), pytest.approx(2 * offline))


def test_regular_agent_is_bounded_by_the_min_std_ratio() -> None:
    det = Detector(DetectionSection())
    w = det.new_window()
    for _ in range(20):
        w.add(1.0)
    suspect, offline = det.deadlines(w, 1.0)
    # std = 0 is raised to 0.25 x interval: suspect at mean + z(8) x 0.25.
    assert suspect == pytest.approx(1.0 + z_for_phi(8.0) * 0.25)
    assert offline == pytest.approx(1.0 + z_for_phi(16.0) * 0.25)
    assert suspect < 2.5  # the freeze target: out within 2.5 intervals
    assert 2.0 < suspect  # a single heartbeat lost (gap 2 intervals) is not suspicion


def test_irregular_agent_never_past_the_fixed_ceiling() -> None:
    det = Detector(DetectionSection())
    w = det.new_window()
    for gap in (0.2, 2.8) * 10:
        w.add(gap)
    assert det.deadlines(w, 1.0) == (3.0, 6.0)


def test_phi_disabled_uses_fixed_multiples() -> None:
    det = Detector(DetectionSection(phi_enabled=False))
    w = det.new_window()
    for _ in range(20):
        w.add(1.0)
    assert det.deadlines(w, 1.0) == (3.0, 6.0)


def test_frozen_agent_is_suspect_within_2_5_intervals_and_offline_after() -> None:
    reg = registry()
    a = Agent(reg)
    for i in range(1, 21):
        a.beat(float(i))
    last = 20.0
    # Freeze right after the last heartbeat; tick every 10 ms like the broker.
    t = last
    while "suspect" not in a.states():
        t = round(t + 0.01, 2)
        a.run_until(t)
    suspect_at = t
    assert suspect_at - last == pytest.approx(2.41, abs=0.011)
    while "offline" not in a.states():
        t = round(t + 0.01, 2)
        a.run_until(t)
        assert t < last + 7.0
    assert t - last == pytest.approx(1.0 + z_for_phi(16.0) * 0.25, abs=0.011)
    assert a.states() == ["suspect", "offline"]
    assert reg.agents["alpha"].state == "offline"


@pytest.mark.parametrize("prior", [5, 0])
def test_young_frozen_agent_is_suspect_as_fast_as_an_old_one(prior: int) -> None:
    """Registered at 0, one heartbeat at 1 s, then frozen: with the prior phi decides at
    2.41 intervals like for an old agent; without it the fixed ceiling of 3 applies."""
    reg = registry(phi_prior_samples=prior)
    a = Agent(reg)
    a.beat(1.0)
    t = 1.0
    while "suspect" not in a.states():
        t = round(t + 0.01, 2)
        a.run_until(t)
    assert t - 1.0 == pytest.approx(2.41 if prior else 3.0, abs=0.011)


def test_young_agent_that_missed_three_beats_is_routable_again_within_seconds() -> None:
    reg = registry()
    a = Agent(reg)
    a.beat(1.0)
    a.beat(2.0)
    a.run_until(5.5)  # beats at 3, 4 and 5 missed: suspect, then offline
    assert a.states() == ["suspect", "offline"]
    a.beat(5.5)
    a.beat(6.5)
    a.beat(7.5)
    assert a.states() == ["suspect", "offline", "recovering", "healthy"]
    rec = reg.agents["alpha"]
    assert rec.state == "healthy"
    # Liveness: the unfilled slots of the ring count as on time (the prior), so the missed
    # sign at suspect and the one late beat cost 2/liveness_window, not most of the score.
    assert rec.stats.liveness == pytest.approx(18 / 20)


@pytest.mark.parametrize("catch_up", [False, True], ids=["fixed-delay", "fixed-rate"])
def test_no_flapping_with_jitter_and_occasional_one_second_pauses(catch_up: bool) -> None:
    """1 s interval, ±10% jitter, and one heartbeat in 25 held back by a full second."""
    rng = random.Random(5)
    reg = registry()
    a = Agent(reg)
    t = 0.0
    pauses = 0
    for i in range(1, 3001):
        gap = 1.0 + rng.uniform(-0.1, 0.1)
        if i % 25 == 0:
            gap += 1.0
            pauses += 1
        elif catch_up and i % 25 == 1:
            gap = max(gap - 1.0, 0.0)  # the sender's fixed schedule: the next one is early
        t += gap
        a.run_until(t - 1e-6)
        a.beat(t)
    assert pauses == 120
    assert a.states() == []
    assert reg.agents["alpha"].state == "healthy"


def test_one_lost_heartbeat_is_not_suspicion() -> None:
    reg = registry()
    a = Agent(reg)
    for i in range(1, 21):
        a.beat(float(i))
    a.run_until(22.0)  # heartbeat 21 was lost
    a.beat(22.0)
    assert a.states() == []


def test_suspect_agent_that_heartbeats_again_is_healthy_at_once() -> None:
    reg = registry()
    a = Agent(reg)
    for i in range(1, 21):
        a.beat(float(i))
    a.run_until(23.0)
    assert a.states() == ["suspect"]
    a.beat(23.5)
    assert a.states() == ["suspect", "healthy"]
    assert a.transitions[-1].reason == "heartbeat resumed"
