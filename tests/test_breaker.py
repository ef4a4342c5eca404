"""The circuit breaker state machine, pure, with a fake clock (the default settings)."""

from __future__ import annotations

from reach_agent.client.breaker import Breaker, Breakers, verdict
from reach_agent.client.config import BreakerConfig, ClientConfig
from reach_agent.wire.errors import (
    BizReject,
    Draining,
    InternalError,
    Overloaded,
    TargetBusy,
    Timeout,
)

CFG = BreakerConfig()


def fail(b: Breaker, n: int, now: float) -> list[str | None]:
    return [b.record(False, now) for _ in range(n)]


def test_ten_consecutive_failures_open_the_breaker() -> None:
    b = Breaker(CFG)
    assert fail(b, 9, 1.0) == [None] * 9
    assert b.state == "closed"
    assert b.record(False, 1.0) == "open"
    assert (b.state, b.open_until) == ("open", 6.0)
    assert b.allow(5.9) == (False, None)
    assert not b.available(5.9)


def test_a_success_resets_the_consecutive_count() -> None:
    b = Breaker(CFG)
    fail(b, 9, 1.0)
    assert b.record(True, 1.0) is None
    # 9 fails + 1 ok + 1 fail = 10/11 > 50% over the window with >= 10 calls: opens.
    assert b.record(False, 1.0) == "open"


def test_failure_ratio_over_the_window_opens_only_with_ten_calls() -> None:
    b = Breaker(CFG)
    # Alternate: never 10 in a row; 5 fails of 9 calls is below min_calls.
    for i in range(9):
        b.record(i % 2 == 1, 1.0)  # F T F T F T F T F
    assert b.window(1.0) == (9, 5)
    assert b.state == "closed"
    assert b.record(True, 1.0) is None  # 5/10: not above 50%
    assert b.record(False, 1.0) == "open"  # 6/11 > 50%


def test_old_calls_leave_the_window() -> None:
    b = Breaker(CFG)
    for _ in range(5):
        b.record(False, 0.0)
        b.record(True, 0.0)
        b.record(True, 0.0)
    assert b.window(0.0) == (15, 5)
    assert b.window(61.0) == (0, 0)  # a minute later the window is empty
    for _ in range(4):
        b.record(True, 61.0)
    fail(b, 5, 61.0)
    assert b.state == "closed"  # 5/9 but fewer than 10 calls in the window


def test_half_open_lets_three_trials_through_and_closes_after_three_successes() -> None:
    b = Breaker(CFG)
    fail(b, 10, 0.0)
    assert b.allow(5.0) == (True, "half_open")
    assert b.allow(5.0) == (True, None)
    assert b.allow(5.0) == (True, None)
    assert b.allow(5.0) == (False, None)  # only 3 trial calls
    assert not b.available(5.0)
    assert b.record(True, 5.1) is None
    assert b.record(True, 5.2) is None
    assert b.record(True, 5.3) == "closed"
    assert (b.state, b.open_for, b.consecutive) == ("closed", 5.0, 0)
    assert b.window(5.3) == (0, 0)


def test_failed_trial_reopens_with_doubled_period_capped_at_five_minutes() -> None:
    b = Breaker(CFG)
    fail(b, 10, 0.0)
    now, periods = 0.0, []
    for _ in range(8):
        now = b.open_until
        assert b.allow(now) == (True, "half_open")
        assert b.record(False, now) == "open"
        periods.append(b.open_until - now)
    assert periods == [10.0, 20.0, 40.0, 80.0, 160.0, 300.0, 300.0, 300.0]
    # Recovery resets the period to 5 s.
    now = b.open_until
    b.allow(now)
    for _ in range(3):
        b.record(True, now)
    assert b.state == "closed"
    fail(b, 10, now)
    assert b.open_until - now == 5.0


def test_release_frees_a_trial_slot_without_a_verdict() -> None:
    b = Breaker(CFG)
    fail(b, 10, 0.0)
    for _ in range(3):
        assert b.allow(5.0)[0]
    b.release(5.0)  # e.g. TARGET_BUSY: no verdict on health
    assert b.allow(5.0) == (True, None)
    assert b.state == "half_open"


def test_results_of_calls_started_before_opening_are_ignored_while_open() -> None:
    b = Breaker(CFG)
    fail(b, 10, 0.0)
    assert b.record(True, 1.0) is None
    assert b.state == "open"


def test_breakers_track_open_pairs_per_capability() -> None:
    bs = Breakers(BreakerConfig(consecutive_failures=2))
    for _ in range(2):
        bs.record("a1", "cap.x", False, 0.0)
    bs.record("a2", "cap.x", True, 0.0)
    bs.record("a1", "cap.y", False, 0.0)
    assert bs.blocked("cap.x", 1.0) == ["a1"]
    assert bs.blocked("cap.y", 1.0) == []
    assert bs.state("a1", "cap.x") == "open"
    assert bs.state("zz", "cap.x") == "closed"
    assert [bs.available(a, "cap.x", 1.0) for a in ("a1", "a2", "zz")] == [False, True, True]
    assert bs.blocked("cap.x", 5.0) == []  # open period over: trials allowed
    assert bs.allow("a1", "cap.x", 5.0) == (True, "half_open")
    assert bs.allow("unknown", "cap.x", 5.0) == (True, None)


def test_verdict_of_each_outcome() -> None:
    assert verdict("ok") is True
    assert [verdict(o) for o in ("not_delivered", "no_responders", "timeout", "lost")] == [
        False, False, False, False,
    ]  # fmt: skip
    assert verdict("closed") is None
    assert verdict("error", TargetBusy("full")) is None
    assert verdict("error", Draining("leaving")) is None
    assert verdict("error", Overloaded("shedding")) is True  # 429: it answered
    assert verdict("error", BizReject("no")) is True
    assert verdict("error", InternalError("boom")) is False
    assert verdict("error", Timeout("late")) is False


def test_breakers_table_is_bounded() -> None:
    bs = Breakers(BreakerConfig(max_breakers=16, consecutive_failures=1))
    bs.record("keep", "c", False, 0.0)  # open: never pruned
    for i in range(100):
        bs.record(f"a{i}", "c", True, float(i))
    assert len(bs) <= 16
    assert bs.state("keep", "c") == "open"


def test_client_config_clamps_timeouts_and_jitters_backoff() -> None:
    cfg = ClientConfig()
    assert cfg.clamp_timeout(None) == 30.0
    assert cfg.clamp_timeout(1) == 5.0
    assert cfg.clamp_timeout(1, timeout_hint=8) == 8.0
    assert cfg.clamp_timeout(1000) == 1000.0
    assert cfg.clamp_timeout(5, timeout_hint=20 * 60) == 1200.0  # a 20 min hint is waited for
    assert cfg.clamp_timeout(99_999) == 3600.0
    assert ClientConfig(max_timeout_s=120).clamp_timeout(5, timeout_hint=600) == 120.0
    assert [cfg.backoff(n, 0.5) for n in (1, 2, 3, 5)] == [1.0, 2.0, 4.0, 10.0]
    assert cfg.backoff(1, 0.0) == 0.5 and cfg.backoff(1, 0.999) < 1.5
