"""Hand-out accounting, pure with a fake clock: the routes a broker answered count as tasks
until the next heartbeat reports them, fading with the agent's task time; a fleet that is
merely full answers OVERLOADED with a retry-after hint."""

from __future__ import annotations

import math
import random

import pytest

from reach_agent.wire import schema
from reach_agent.wire.errors import NoReachableAgent, Overloaded
from reach_agent.wire.schema import Announce, Heartbeat, RouteRequest
from reach_broker.config import Config
from reach_broker.core.registry import Registry
from reach_broker.core.routing import Router
from reach_broker.core.tokens import TokenSigner

CAP = "summarize"
DEFAULT = RouteRequest()


class Fleet:
    def __init__(self, agents: str, max_concurrency: int = 4) -> None:
        cfg = Config()
        cfg.routing.rank_refresh_ms = 0
        # The fleet's in-flight ceiling (0.9 x the slots by default) is tested with the routing
        # policy; here the agents' own load decides.
        cfg.routing.inflight_share = 10.0
        self.reg = Registry(
            cfg.detection,
            cfg.scoring,
            TokenSigner(b"k" * 32, 3600.0, wall=lambda: 1_000_000.0),
            interval_ms=cfg.broker.interval_ms,
        )
        reg = self.reg
        self.router = Router(cfg.routing, reg.indexes, lambda a, c: f"reach.task.{a}.{c}",
                             inflight=lambda: reg.inflight, capacity=lambda: reg.capacity,
                             rng=random.Random(3))  # fmt: skip
        self.seq = 0
        self.tokens: dict[str, str] = {}
        for agent_id in agents:
            ann = Announce(agent_id=agent_id, capabilities=[CAP], max_concurrency=max_concurrency,
                           heartbeat_interval_ms=1000)  # fmt: skip
            self.tokens[agent_id] = self.reg.announce(ann, 0.0, 0)[0].token

    def beat(self, agent_id: str, now: float, **fields: int) -> None:
        self.seq += 1
        hb = Heartbeat(agent_id=agent_id, token=self.tokens[agent_id], seq=self.seq, **fields)
        assert self.reg.heartbeat(hb, now, 0)[0] == "accepted"

    def pick(self, now: float, req: RouteRequest = DEFAULT) -> str:
        """The first candidate of the reply the broker would send (a hand-out)."""
        reply = schema.route_reply_decoder.decode(self.router.route_reply(CAP, req, now, 0))
        return reply.candidates[0].agent_id


def test_routes_answered_count_until_the_agent_is_full_then_overloaded_with_a_hint() -> None:
    f = Fleet("a")
    assert [f.pick(1.0) for _ in range(4)] == ["a"] * 4  # 3 of 4 < 0.85 * 4 <= 4 of 4
    rec = f.reg.agents["a"]
    assert (rec.active, rec.load, rec.busy, rec.handed) == (0, 0.0, 1.0, 4.0)
    with pytest.raises(Overloaded) as exc:
        f.pick(1.0)
    err = exc.value
    assert (err.code, err.status, err.retryable, err.retry_after_ms) == (
        "OVERLOADED", 429, True, 100)  # fmt: skip  # no task time known yet: the default
    assert err.message == (
        "no reachable agent for 'summarize' among 1: 1 at or above the load watermark 0.85"
    )


def test_hand_outs_fade_with_the_task_time_and_the_hint_is_the_median() -> None:
    f = Fleet("a")
    f.beat("a", 0.5, ok_total=5, task_ms_p50=20)  # 20 ms tasks
    assert [f.pick(1.0) for _ in range(4)] == ["a"] * 4
    with pytest.raises(Overloaded) as exc:
        f.pick(1.0)
    assert exc.value.retry_after_ms == 20
    # 4 believed running, fading as exp(-t / 20 ms): below 3.4 after 20 ms * ln(4 / 3.4).
    free_after = 0.020 * math.log(4 / 3.4)
    rec = f.reg.agents["a"]
    assert rec.full_until == pytest.approx(1.0 + free_after)
    with pytest.raises(Overloaded):
        f.pick(1.0 + free_after - 1e-4)
    assert f.pick(1.0 + free_after + 1e-4) == "a"
    assert rec.handed == pytest.approx(3.4 * math.exp(-1e-4 / 0.020) + 1.0)


def test_a_heartbeat_replaces_the_hand_outs_with_what_the_agent_reports() -> None:
    f = Fleet("a")
    for _ in range(4):
        f.pick(1.0)
    f.beat("a", 1.2, active=1)
    rec = f.reg.agents["a"]
    assert (rec.load, rec.busy) == (0.25, 0.25)
    assert f.pick(1.2) == "a"
    assert rec.handed == 2.0  # the reported one, and this hand-out


def test_a_reported_full_agent_is_routable_again_as_its_tasks_finish() -> None:
    """The stale-heartbeat case: full at its last report, but 20 ms tasks end long before the
    next heartbeat. Before, it was out of the routes for the whole interval."""
    f = Fleet("a")
    f.beat("a", 1.0, active=4, ok_total=5, task_ms_p50=20)
    with pytest.raises(Overloaded):
        f.pick(1.0)
    assert f.pick(1.0 + 0.020 * math.log(4 / 3.4) + 1e-4) == "a"


def test_two_agents_share_the_load_and_nobody_gets_more_than_its_slots() -> None:
    f = Fleet("ab")
    picks = [f.pick(1.0) for _ in range(8)]
    assert (picks.count("a"), picks.count("b")) == (4, 4)
    with pytest.raises(Overloaded):
        f.pick(1.0)


def test_peeks_and_looks_do_not_count() -> None:
    f = Fleet("a")
    peek = RouteRequest(peek=True)
    assert [f.pick(1.0, peek) for _ in range(10)] == ["a"] * 10
    assert [c.agent_id for c in f.router.route(CAP, DEFAULT, 1.0)] == ["a"]
    rec = f.reg.agents["a"]
    assert (rec.busy, rec.handed, rec.handed_at) == (0.0, 0.0, -math.inf)


def test_only_the_pick_is_touched() -> None:
    """No O(fleet) work per route: one record changes, whatever the fleet's size."""
    f = Fleet("abcdefghijklmnopqrstuvwxyz")
    first = f.pick(1.0)
    touched = [a for a, r in f.reg.agents.items() if r.handed_at == 1.0]
    assert touched == [first]


def test_full_with_other_filters_is_overloaded_only_if_some_passed_them() -> None:
    f = Fleet("a")
    for _ in range(4):
        f.pick(1.0)
    with pytest.raises(NoReachableAgent) as exc:  # excluded anyway: nobody to wait for
        f.pick(1.0, RouteRequest(exclude=["a"]))
    assert exc.value.message == "no reachable agent for 'summarize' among 1: 1 filtered by exclude"
    with pytest.raises(Overloaded):  # passes the exclude filter, only full: wait for it
        f.pick(1.0, RouteRequest(exclude=["zeta"]))


def test_the_inflight_ceiling_answers_overloaded_with_its_configured_hint() -> None:
    f = Fleet("a")
    f.router.cfg.inflight_ceiling = 1
    f.beat("a", 1.0, active=2)
    with pytest.raises(Overloaded) as exc:
        f.pick(1.0)
    assert exc.value.retry_after_ms == 250  # routing.overloaded_retry_after_ms


def test_without_a_task_time_nothing_fades_until_the_next_heartbeat() -> None:
    """A first task may take any time: the hand-outs (and a full report) hold until the
    agent's next heartbeat says what runs, and a full agent is not looked at again before."""
    f = Fleet("a")
    for _ in range(4):
        f.pick(1.0)
    rec = f.reg.agents["a"]
    with pytest.raises(Overloaded):
        f.pick(30.0)
    assert (rec.busy, rec.full_until) == (1.0, 30.0)  # its heartbeat is overdue: look each time
    f.beat("a", 31.0, active=4)
    with pytest.raises(Overloaded):
        f.pick(31.5)
    assert (rec.busy, rec.full_until) == (1.0, 32.0)  # announced interval 1 s
    f.beat("a", 32.0, active=3)
    assert f.pick(32.0) == "a"
    assert rec.handed == 4.0
