"""The console's per-capability charts (:mod:`reach_broker.console.capseries`): pure, with the
wall clock given. Route rates from cumulative counts, latency quantiles from ack records,
15-minute rings that reuse their slots, and bounds on what is kept."""

from __future__ import annotations

import pytest

from reach_broker.console import capseries
from reach_broker.console.capseries import BUCKET_S, BUCKETS, CapabilitySeries, bin_ms, bin_of

T0 = 1_800_000_000_000 - 1_800_000_000_000 % (BUCKET_S * 1000)  # a bucket's start


def test_routes_per_second_come_from_the_counts_read_on_each_tick() -> None:
    s = CapabilitySeries()
    s.routes({"summarize": 100}, T0)  # before the console: not charted
    s.routes({"summarize": 130, "translate": 5}, T0 + 5000)
    s.routes({"summarize": 160, "translate": 5}, T0 + 10_000)
    s.routes({"summarize": 175}, T0 + 15_000)  # the next bucket
    chart = s.chart("summarize", T0 + 20_000)
    assert chart is not None and len(chart.at_ms) == BUCKETS
    assert chart.at_ms[-2:] == [T0, T0 + 15_000]
    # A whole bucket: 60 routes in 15 s; the current one: 15 routes in its first 5 s.
    assert chart.routes_per_s[-2:] == [4.0, 3.0]
    assert chart.routes_per_s[:-2] == [0.0] * (BUCKETS - 2)
    # A capability first counted after the console started: all of it is new.
    translate = s.chart("translate", T0 + 20_000)
    assert translate is not None and translate.routes_per_s[-2:] == [0.333, 0.0]
    assert s.index(T0 + 20_000).capabilities == [("summarize", 75), ("translate", 5)]


def test_latency_quantiles_from_received_to_final_ack_records() -> None:
    s = CapabilitySeries()
    for i in range(100):
        s.ack(f"r{i}", "summarize", "received", T0 + i)
    for i in range(99):
        s.ack(f"r{i}", "summarize", "completed", T0 + i + 20)  # 20 ms
    s.ack("r99", "summarize", "failed", T0 + 99 + 5000)  # 5 s: the 1 % tail
    s.ack("nobody", "summarize", "completed", T0 + 10)  # no received: not timed
    chart = s.chart("summarize", T0 + 6000)
    assert chart is not None
    assert chart.calls[-1] == 100
    assert chart.p50_ms[-1] == round(bin_ms(bin_of(20)), 1)
    assert chart.p99_ms[-1] == round(bin_ms(bin_of(20)), 1)  # the 99th of 100 is still 20 ms
    assert chart.p50_ms[:-1] == [None] * (BUCKETS - 1)
    assert bin_ms(bin_of(20)) / 20 < 1.25 and 20 / bin_ms(bin_of(20)) < 1.25


def test_a_slot_is_zeroed_when_its_time_comes_round_again() -> None:
    s = CapabilitySeries()
    s.routes({"c": 0}, T0)
    s.routes({"c": 15}, T0 + 1000)
    s.ack("a", "c", "received", T0)
    s.ack("a", "c", "completed", T0 + 3)
    later = T0 + BUCKETS * BUCKET_S * 1000  # the same slot, 15 minutes on
    s.routes({"c": 30}, later)
    chart = s.chart("c", later + 15_000 - 1)
    assert chart is not None
    assert chart.routes_per_s[-1] == 1.0 and chart.calls[-1] == 0  # 15 routes / 15 s, no call


def test_what_is_kept_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(capseries, "MAX_CAPABILITIES", 2)
    monkeypatch.setattr(capseries, "PENDING_MAX", 3)
    s = CapabilitySeries()
    s.routes({"a": 0, "b": 0, "c": 0}, T0)
    s.routes({"a": 1, "b": 1, "c": 1}, T0 + 1)
    assert sorted(s.rings) == ["a", "b"] and s.index(T0 + 1).untracked == 1
    for i in range(5):
        s.ack(f"r{i}", "a", "received", T0)
    assert len(s._pending) == 3  # the rest are not timed
    s.expire(T0 + BUCKETS * BUCKET_S * 1000 + 1)
    assert len(s._pending) == 0
