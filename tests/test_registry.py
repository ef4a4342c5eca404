"""The registry's disconnect, probe, reconcile and recovery paths, pure, fake clock."""

from __future__ import annotations

import random

from reach_agent.wire.schema import AGENT_STATES, Announce, Heartbeat
from reach_broker.config import Config
from reach_broker.core.records import Transition
from reach_broker.core.registry import Registry
from reach_broker.core.states import EVICTED, MOVES
from reach_broker.core.tokens import TokenSigner
from reach_broker.service.probes import backoff_delay


def make(*agents: str) -> tuple[Registry, dict[str, str]]:
    cfg = Config()  # probe_timeout_s 3.0, heartbeat interval 1 s below
    reg = Registry(
        cfg.detection,
        cfg.scoring,
        TokenSigner(b"k" * 32, 3600.0, wall=lambda: 1_000_000.0),
        interval_ms=cfg.broker.interval_ms,
    )
    tokens = {}
    for agent_id in agents:
        ann = Announce(agent_id=agent_id, capabilities=["summarize"], max_concurrency=4,
                       heartbeat_interval_ms=1000)  # fmt: skip
        rec, _ = reg.announce(ann, 0.0, 0)
        tokens[agent_id] = rec.token
    return reg, tokens


def moves(ts: list[Transition]) -> list[tuple[str, str | None, str | None, str]]:
    return [(t.agent_id, t.from_, t.to, t.reason) for t in ts]


def test_disconnect_makes_suspect_and_an_unanswered_probe_offline() -> None:
    reg, _ = make("alpha")
    assert moves(reg.disconnected("alpha", 0.5)) == [
        ("alpha", "healthy", "suspect", "connection closed")
    ]
    assert reg.agents["alpha"].disconnected is True
    assert moves(reg.probe_result("alpha", False, None, 0.51)) == [
        ("alpha", "suspect", "offline", "disconnected and probe unanswered")
    ]
    assert reg.counts["offline"] == 1


def test_disconnect_without_probe_answer_is_offline_after_probe_timeout() -> None:
    reg, _ = make("alpha")
    reg.disconnected("alpha", 0.5)
    assert reg.expire(3.49) == []
    assert moves(reg.expire(3.5)) == [
        ("alpha", "suspect", "offline", "disconnected and no probe answer for 3.50s")
    ]


def test_disconnect_then_probe_answered_is_healthy_again() -> None:
    reg, _ = make("alpha")
    reg.disconnected("alpha", 0.5)
    assert moves(reg.probe_result("alpha", True, 2.0, 0.6)) == [
        ("alpha", "suspect", "healthy", "probe answered")
    ]
    assert reg.agents["alpha"].stats.rtt_ewma_ms == 2.0
    assert reg.agents["alpha"].disconnected is False


def test_disconnect_of_unknown_or_offline_agent_changes_nothing() -> None:
    reg, _ = make("alpha")
    assert reg.disconnected("reach-broker-x", 0.1) == []
    reg.disconnected("alpha", 0.1)
    reg.probe_result("alpha", False, None, 0.2)
    assert reg.disconnected("alpha", 0.3) == []


def test_disconnect_of_a_draining_agent_evicts_it() -> None:
    reg, _ = make("alpha")
    reg.leave("alpha", 0.1)
    out = reg.disconnected("alpha", 0.2)
    assert [(t.kind, t.from_, t.to, t.reason) for t in out] == [
        ("evicted", "draining", None, "left and disconnected")
    ]
    assert "alpha" not in reg.agents


def test_reconcile_suspects_agents_without_a_connection() -> None:
    reg, _ = make("alpha", "beta", "gamma")
    out = reg.reconcile({"beta", "reach-broker-1", "caller"}, 5.0)
    assert moves(out) == [
        ("alpha", "healthy", "suspect", "no connection at reconcile"),
        ("gamma", "healthy", "suspect", "no connection at reconcile"),
    ]
    assert reg.reconcile({"beta"}, 5.1) == []  # idempotent: suspects stay suspect
    assert reg.agents["beta"].state == "healthy"


def test_offline_agent_recovers_through_recovering_with_slow_start() -> None:
    reg, tokens = make("alpha")
    reg.disconnected("alpha", 1.0)
    reg.probe_result("alpha", False, None, 1.0)
    hb = Heartbeat(agent_id="alpha", token=tokens["alpha"], seq=1)
    result, out = reg.heartbeat(hb, 5.0, 0)
    assert (result, moves(out)) == ("accepted", [("alpha", "offline", "recovering",
                                                   "heartbeat resumed")])  # fmt: skip
    assert reg.agents["alpha"].recovered_at is None
    assert moves(reg.probe_result("alpha", True, 1.5, 5.01)) == [
        ("alpha", "recovering", "healthy", "probe answered")
    ]
    assert reg.agents["alpha"].recovered_at == 5.01


def test_a_burst_of_queued_heartbeats_does_not_complete_a_recovery() -> None:
    """Beats queued while the broker stalled arrive together, each "on time": the first
    moves an offline agent to recovering, the others do not complete the recovery (the agent
    may have died after sending them); a beat half an interval or more later does."""
    reg, tokens = make("alpha")
    reg.disconnected("alpha", 1.0)
    reg.probe_result("alpha", False, None, 1.0)
    burst = []
    for seq in (1, 2, 3):
        hb = Heartbeat(agent_id="alpha", token=tokens["alpha"], seq=seq)
        burst += reg.heartbeat(hb, 5.0 + seq * 0.0001, 0)[1]
    assert moves(burst) == [("alpha", "offline", "recovering", "heartbeat resumed")]
    assert reg.agents["alpha"].recover_hbs == 2
    hb = Heartbeat(agent_id="alpha", token=tokens["alpha"], seq=4)
    assert moves(reg.heartbeat(hb, 5.4, 0)[1]) == []  # 0.4 intervals into its recovery
    hb = Heartbeat(agent_id="alpha", token=tokens["alpha"], seq=5)
    assert moves(reg.heartbeat(hb, 5.6, 0)[1]) == [
        ("alpha", "recovering", "healthy", "heartbeats on time")
    ]


def test_failed_probes_count_up_and_reset_on_an_answer() -> None:
    reg, _ = make("alpha")
    reg.disconnected("alpha", 1.0)
    for i in range(3):
        reg.probe_result("alpha", False, None, 2.0 + i)
    assert reg.agents["alpha"].probe_failures == 3
    reg.probe_result("alpha", True, 1.0, 9.0)
    assert reg.agents["alpha"].probe_failures == 0


class Top:
    """A stand-in rng whose uniform() returns the top of the range."""

    def uniform(self, lo: float, hi: float) -> float:
        return hi


class Bottom:
    def uniform(self, lo: float, hi: float) -> float:
        return lo


def test_probe_backoff_doubles_with_jitter_up_to_the_cap() -> None:
    top = [backoff_delay(n, 60.0, Top()) for n in range(1, 10)]  # type: ignore[arg-type]
    assert top == [1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 60.0, 60.0, 60.0]
    bottom = [backoff_delay(n, 60.0, Bottom()) for n in (1, 4, 9)]  # type: ignore[arg-type]
    assert bottom == [0.5, 4.0, 30.0]
    rng = random.Random(3)
    assert all(15.0 <= backoff_delay(100, 30.0, rng) <= 30.0 for _ in range(100))


def test_offline_by_probe_is_kept_until_forget_after() -> None:
    reg, _ = make("alpha")
    reg.disconnected("alpha", 1.0)
    reg.probe_result("alpha", False, None, 1.0)
    assert reg.expire(1.0 + 24 * 3600 - 0.01) == []
    assert [(t.kind, t.reason) for t in reg.expire(1.0 + 24 * 3600)] == [
        ("evicted", "offline for 86400s")
    ]


def test_the_transition_table_is_well_formed() -> None:
    assert set(MOVES) == set(AGENT_STATES)
    for state, moves in MOVES.items():
        assert moves["evict"].to == EVICTED  # removal by hand works from anywhere
        for event, m in moves.items():
            assert m.to != state, (state, event)  # a move moves
            assert m.to == EVICTED or m.to in AGENT_STATES
            assert (m.kind == "evicted") == (m.to == EVICTED), (state, event)
            assert (m.kind == "left") == (event == "leave"), (state, event)


def test_every_state_but_draining_can_leave_and_draining_ignores_heartbeats() -> None:
    reg, tokens = make("alpha", "beta")
    reg.disconnected("beta", 1.0)
    reg.probe_result("beta", False, None, 1.0)
    assert [(t.kind, t.from_, t.to, t.reason) for t in reg.leave("beta", 2.0, "bye")] == [
        ("left", "offline", "draining", "bye")
    ]
    reg.leave("alpha", 2.0)
    assert reg.leave("alpha", 2.1) == []
    hb = Heartbeat(agent_id="alpha", token=tokens["alpha"], seq=1)
    assert reg.heartbeat(hb, 2.2, 0) == ("accepted", [])
    assert reg.agents["alpha"].state == "draining"
