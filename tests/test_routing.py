"""Routing: eject cap, panic mode, slow start after recovery, p2c — pure, fake clock."""

from __future__ import annotations

import logging
import random

import pytest

from reach_agent.routing.index import RANK_MEMBERS, CapabilityIndex, by_score, rank
from reach_agent.routing.member import Member, TaskStats
from reach_agent.wire import schema
from reach_agent.wire.errors import NoReachableAgent, Overloaded
from reach_agent.wire.schema import Announce, Heartbeat, RouteReply, RouteRequest
from reach_broker.config import Config, RoutingSection
from reach_broker.core.registry import Registry
from reach_broker.core.routing import Router
from reach_broker.core.tokens import TokenSigner

CAP = "summarize"


class World:
    def __init__(self, agents: str = "abcd", seed: int = 1, **routing: object) -> None:
        cfg = Config()
        cfg.routing.rank_refresh_ms = 0
        for key, value in routing.items():
            setattr(cfg.routing, key, value)
        self.cfg = cfg
        self.reg = Registry(
            cfg.detection,
            cfg.scoring,
            TokenSigner(b"k" * 32, 3600.0, wall=lambda: 1_000_000.0),
            interval_ms=cfg.broker.interval_ms,
        )
        self.panics: list[tuple[str, bool]] = []
        reg = self.reg
        self.router = Router(cfg.routing, reg.indexes, lambda a, c: f"reach.task.{a}.{c}",
                             inflight=lambda: reg.inflight, capacity=lambda: reg.capacity,
                             on_panic=lambda cap, on: self.panics.append((cap, on)),
                             rng=random.Random(seed))  # fmt: skip
        self.seq = 0
        self.tokens: dict[str, str] = {}
        for agent_id in agents:
            ann = Announce(agent_id=agent_id, capabilities=[CAP], max_concurrency=10,
                           heartbeat_interval_ms=1000)  # fmt: skip
            rec, _ = self.reg.announce(ann, 0.0, 0)
            self.tokens[agent_id] = rec.token

    def beat(self, agent_id: str, now: float, **fields: int) -> None:
        self.seq += 1
        hb = Heartbeat(agent_id=agent_id, token=self.tokens[agent_id], seq=self.seq, **fields)
        assert self.reg.heartbeat(hb, now, 0)[0] == "accepted"

    def set_score(self, agent_id: str, value: float) -> None:
        rec = self.reg.agents[agent_id]
        rec.set_score(value)  # as the registry's rescore would
        self.reg.indexes.state_changed(rec)

    def route(self, now: float, **req: object) -> list[str]:
        got = self.router.route(CAP, RouteRequest(**req), now)  # type: ignore[arg-type]
        return [c.agent_id for c in got]

    def picks(self, now: float, n: int) -> dict[str, int]:
        counts: dict[str, int] = {}
        for _ in range(n):
            first = self.route(now, limit=1)[0]
            counts[first] = counts.get(first, 0) + 1
        return counts


# --- eject cap ---------------------------------------------------------------------------


def test_low_scorers_are_ejected_up_to_the_cap() -> None:
    w = World("abcd")
    w.set_score("d", 40.0)
    assert sorted(w.route(1.0, limit=4)) == ["a", "b", "c"]
    assert w.reg.indexes[CAP].ejected == 1


def test_never_more_than_max_eject_share_ejected_at_once() -> None:
    w = World("abcd")  # max_eject_share 0.5 → at most 2 of 4 out for score
    for agent_id, value in (("b", 50.0), ("c", 30.0), ("d", 10.0)):
        w.set_score(agent_id, value)
    got = w.route(1.0, limit=4)
    assert sorted(got) == ["a", "b"]  # the best of the low scorers stays in
    idx = w.reg.indexes[CAP]
    assert (idx.ejected, [r.agent_id for r in idx.ranked]) == (2, ["a", "b"])


def test_eject_share_zero_keeps_everyone() -> None:
    w = World("ab", max_eject_share=0.0)
    w.set_score("b", 5.0)
    assert sorted(w.route(1.0, limit=2)) == ["a", "b"]


def test_all_below_min_score_is_explained() -> None:
    w = World("a", max_eject_share=1.0)
    w.set_score("a", 10.0)
    with pytest.raises(NoReachableAgent) as exc:
        w.route(1.0)
    assert "score below the minimum 60.0" in exc.value.message


def test_the_refusal_names_every_agent_of_the_capability() -> None:
    """The parts of a refusal add up to its total: the agents the walk never looked at (below
    the minimum score, not healthy) are named too, not only the ones a filter kept out."""
    w = World("abcd")
    w.set_score("b", 10.0)  # ejected
    for agent_id in "cd":
        w.reg.disconnected(agent_id, 1.0)
    with pytest.raises(NoReachableAgent) as exc:
        w.route(1.0, exclude=["a"])
    assert exc.value.message == (
        "no reachable agent for 'summarize' among 4: 1 filtered by exclude; 1 healthy below "
        "the minimum score 60.0; 2 not healthy")  # fmt: skip
    with pytest.raises(NoReachableAgent) as exc:  # the suspects walked too
        w.route(1.0, exclude=["a", "c", "d"], allow_suspect=True)
    assert exc.value.message == (
        "no reachable agent for 'summarize' among 4: 3 filtered by exclude; 1 healthy below "
        "the minimum score 60.0")  # fmt: skip


# --- panic ---------------------------------------------------------------------------------


def test_panic_is_said_once_and_suspends_ejection(caplog: pytest.LogCaptureFixture) -> None:
    w = World("abcd")
    for agent_id in "bcd":
        w.reg.disconnected(agent_id, 1.0)
    w.set_score("a", 30.0)  # alone and poor: still routed rather than nothing
    with caplog.at_level(logging.WARNING, logger="reach_broker.core.routing"):
        for i in range(5):
            w.set_score("a", 30.0 + i)  # keep the index dirty: rebuilt every time
            assert w.route(1.0 + i) == ["a"]
    assert w.panics == [(CAP, True)]
    said = [r.getMessage() for r in caplog.records if "route.panic " in r.getMessage()]
    assert said == ["route.panic capability=summarize healthy=1 of 4 (threshold 50%): "
                    "score ejection suspended, routing to every healthy agent left"]  # fmt: skip
    assert w.reg.indexes[CAP].panic is True
    # Two come back: 3 of 4 healthy, panic over (said once), ejection applies again.
    w.beat("b", 2.0)
    w.beat("c", 2.0)
    assert sorted(w.route(10.0, limit=4)) == ["b", "c"]
    assert w.panics == [(CAP, True), (CAP, False)]


def test_panic_with_no_healthy_agent_says_so(caplog: pytest.LogCaptureFixture) -> None:
    w = World("ab")
    for agent_id in "ab":
        w.reg.disconnected(agent_id, 1.0)
    with caplog.at_level(logging.WARNING, logger="reach_broker.core.routing"):
        with pytest.raises(NoReachableAgent) as exc:
            w.route(1.0)
    assert exc.value.message == "none of the 2 agents with 'summarize' is healthy (2 suspect)"
    said = [r.getMessage() for r in caplog.records if "route.panic " in r.getMessage()]
    assert said == ["route.panic capability=summarize healthy=0 of 2 (threshold 50%): "
                    "no healthy agent left to route to"]  # fmt: skip


def test_agents_healthy_since_the_last_ranking_are_named_as_such() -> None:
    """Refused before the capability is ranked again, agents that are healthy by now are
    not said to be "none healthy (2 healthy)" (a nemesis run's message): the refusal says
    they were not healthy when it was last ranked, and when they will be routed."""
    w = World("ab", rank_refresh_ms=1000)
    for agent_id in "ab":
        w.reg.disconnected(agent_id, 1.0)
    with pytest.raises(NoReachableAgent) as exc:
        w.route(2.0)  # ranked now: none healthy
    assert exc.value.message == "none of the 2 agents with 'summarize' is healthy (2 suspect)"
    w.beat("a", 2.1)
    w.beat("b", 2.1)
    with pytest.raises(NoReachableAgent) as exc:
        w.route(2.2)  # 0.2 s after the ranking: not due again
    assert exc.value.message == (
        "none of the 2 agents with 'summarize' was healthy when it was last ranked (now 2 "
        "healthy: routed once it is ranked again, [routing] rank_refresh_ms)")  # fmt: skip
    assert sorted(w.route(3.1, limit=2)) == ["a", "b"]  # ranked again


def test_draining_agents_do_not_count_towards_panic() -> None:
    w = World("abcd")
    for agent_id in "bcd":
        w.reg.leave(agent_id, 1.0)
    assert w.route(1.0) == ["a"]
    assert w.reg.indexes[CAP].panic is False
    assert w.panics == []


# --- slow start ----------------------------------------------------------------------------


def recover(w: World, agent_id: str, at: float) -> None:
    """offline → heartbeat → recovering → probe answered → healthy (slow start from ``at``)."""
    rec = w.reg.agents[agent_id]
    w.reg.disconnected(agent_id, at - 2.0)
    w.reg.probe_result(agent_id, False, None, at - 2.0)
    assert rec.state == "offline"
    w.beat(agent_id, at - 0.5)
    assert rec.state == "recovering"
    w.reg.probe_result(agent_id, True, 1.0, at)
    assert (rec.state, rec.recovered_at) == ("healthy", at)


def test_slow_start_factor_is_20_percent_for_30s_then_ramps() -> None:
    w = World("ab")
    recover(w, "b", 100.0)
    rec = w.reg.agents["b"]
    factor = w.router.slow_start_factor
    assert [factor(rec, 100.0 + s) for s in (0, 15, 30, 45, 60, 90)] == pytest.approx(
        [0.2, 0.2, 0.2, 0.6, 1.0, 1.0]
    )
    assert factor(w.reg.agents["a"], 100.0) == 1.0  # never recovered: no slow start


def test_recovered_agent_gets_a_capped_share_then_its_full_share() -> None:
    w = World("ab", seed=7)
    recover(w, "b", 100.0)
    for agent_id in "ab":
        w.set_score(agent_id, 90.0)
    # Weighted draw: b's weight is 0.2 of a's → about 1/6 of the picks at first.
    early = w.picks(110.0, 3000)
    assert 0.13 < early["b"] / 3000 < 0.20
    late = w.picks(170.0, 3000)
    assert 0.45 < late["b"] / 3000 < 0.55


def test_slow_start_off_with_zero_span() -> None:
    w = World("ab", slow_start_s=0.0)
    recover(w, "b", 100.0)
    assert w.router.slow_start_factor(w.reg.agents["b"], 100.0) == 1.0


# --- p2c -------------------------------------------------------------------------------------


def test_p2c_picks_the_lower_expected_completion_time() -> None:
    w = World("ab", choice="p2c")
    # a: 5 in flight + 2 queued, 200 ms each over 10 slots; b: 1 in flight, 300 ms.
    w.beat("a", 1.0, active=5, queue_depth=2, ok_total=1, task_ms_p50=200)
    w.beat("b", 1.0, active=1, ok_total=1, task_ms_p50=300)
    assert {w.route(1.0, limit=2)[0] for _ in range(50)} == {"b"}
    assert w.route(1.0, limit=2) == ["b", "a"]


def test_p2c_discounts_a_slow_started_agent() -> None:
    w = World("ab", choice="p2c")
    recover(w, "b", 100.0)
    w.beat("a", 101.0, active=2, ok_total=1, task_ms_p50=100)  # (2+1)x100/10 = 30 ms
    w.beat("b", 101.0, active=0, ok_total=1, task_ms_p50=100)  # 10 ms / 0.2 = 50 ms
    assert {w.route(101.0)[0] for _ in range(50)} == {"a"}
    assert {w.route(170.0)[0] for _ in range(50)} == {"b"}  # ramp done: b is faster


def test_peer_median_is_the_lower_median() -> None:
    w = World("ab")
    w.beat("a", 1.0, ok_total=1, task_ms_p50=100)
    w.beat("b", 1.0, ok_total=1, task_ms_p50=1600)
    w.route(1.0)
    assert w.reg.indexes[CAP].median_task_ms == 100.0


# --- the encoded reply ----------------------------------------------------------------------


def test_route_reply_is_the_encoded_route_of_the_same_draw() -> None:
    """route_reply() keeps each candidate's JSON until its score, load, state or announce
    changes: byte for byte what encoding route()'s Candidates gives, through all of those."""
    rng = random.Random(3)
    w = World("abcdefgh", seed=11)
    twin = Router(w.cfg.routing, w.reg.indexes, w.router.subject_of,
                  inflight=lambda: w.reg.inflight, capacity=lambda: w.reg.capacity,
                  rng=random.Random(11))  # fmt: skip
    now = 1.0
    for step in range(400):
        now += 0.05
        agent_id = rng.choice("abcdefgh")
        roll = rng.random()
        if roll < 0.6:
            w.beat(agent_id, now, active=rng.randrange(0, 10), ok_total=step,
                   task_ms_p50=rng.randrange(50, 500))  # fmt: skip
        elif roll < 0.7:
            w.reg.disconnected(agent_id, now)
        elif roll < 0.8:
            ann = Announce(agent_id=agent_id, capabilities=[CAP], max_concurrency=10,
                           heartbeat_interval_ms=1000, region=rng.choice(("eu", "us")),
                           version=f"1.{step}")  # fmt: skip
            w.tokens[agent_id] = w.reg.announce(ann, now, 0)[0].token
        req = RouteRequest(limit=rng.randrange(1, 4), allow_suspect=rng.random() < 0.3)
        try:
            expected = schema.encoder.encode(RouteReply(
                capability=CAP, candidates=w.router.route(CAP, req, now), generated_at_ms=step
            ))  # fmt: skip
        except NoReachableAgent:
            with pytest.raises(NoReachableAgent):
                twin.route_reply(CAP, req, now, step)
            continue
        assert twin.route_reply(CAP, req, now, step) == expected


def test_the_inflight_ceiling_reads_the_fleet_as_it_is_now() -> None:
    w = World("ab", inflight_ceiling=15)
    w.beat("a", 1.0, active=8)
    assert len(w.route(1.0, limit=2)) == 2  # 8 in flight: under the ceiling
    w.beat("b", 1.1, active=8)
    with pytest.raises(Overloaded) as exc:
        w.route(1.1)
    assert exc.value.message == "fleet in-flight tasks 16 exceed the ceiling 15"


def ranked_index(n: int) -> CapabilityIndex[Member]:
    idx: CapabilityIndex[Member] = CapabilityIndex(CAP)
    for i in range(n):
        m = Member(f"agent-{i:05d}", 10, TaskStats())
        m.set_score(50.0)
        idx.add(m)
    return idx


def ranked_at(idx: CapabilityIndex[Member], cfg: RoutingSection, times: list[float]) -> list[bool]:
    """Whether each refresh at ``times`` ranked the capability again (a rebuild names the
    time it ranked at)."""
    out = []
    for now in times:
        before = idx._built_at
        idx.refresh(cfg, now)
        out.append(idx._built_at != before)
    return out


def test_a_big_capability_is_ranked_again_less_often() -> None:
    # rank_refresh_ms per RANK_MEMBERS members: a ranking sorts them all, so a big capability
    # that keeps changing is not sorted every 50 ms (it took a broker's loop over).
    cfg = RoutingSection(rank_refresh_ms=50.0)
    small, big = ranked_index(RANK_MEMBERS - 1), ranked_index(4 * RANK_MEMBERS - 1)
    for idx in (small, big):
        idx.refresh(cfg, 0.0)
        newcomer = Member("newcomer", 10, TaskStats())
        newcomer.set_score(90.0)
        idx.add(newcomer)  # membership moved: ranked again once the wait is over
    assert ranked_at(small, cfg, [0.05]) == [True]  # 500 members: 50 ms
    assert small.ranked[0].agent_id == "newcomer"
    assert ranked_at(big, cfg, [0.05, 0.15, 0.19]) == [False, False, False]  # 2,000: 200 ms
    assert "newcomer" not in [m.agent_id for m in big.ranked]  # unranked until then
    assert ranked_at(big, cfg, [0.21]) == [True]
    assert big.ranked[0].agent_id == "newcomer"
    # Scores alone: every REORDER_FACTOR x rank_refresh_ms, or the size's wait if longer.
    huge = ranked_index(24 * RANK_MEMBERS)  # 1.2 s a ranking
    huge.refresh(cfg, 0.0)
    for idx in (big, huge):
        idx.score_changed()
    assert ranked_at(big, cfg, [1.2, 1.22]) == [False, True]  # 0.21 + REORDER_FACTOR x 50 ms
    assert ranked_at(huge, cfg, [1.0, 1.19, 1.21]) == [False, False, True]


def test_rank_orders_as_by_score_does_ties_included() -> None:
    """The ranking's three stable sorts give exactly ``sorted(key=by_score)``'s order: best
    score first, then the larger context headroom, then the id — with many equal scores and
    headrooms, in any starting order."""
    rng = random.Random(5)
    members = []
    for i in range(2000):
        m = Member(f"agent-{i:04d}", 4, TaskStats())
        m.context_window = rng.choice([None, 1000, 8000])
        m.set_context(rng.choice([None, 10.0, 50.0]))
        m.set_score(rng.choice([40.0, 60.5, 60.5, 80.0, 99.9]))
        members.append(m)
    for _ in range(3):
        rng.shuffle(members)
        ranked = list(members)
        rank(ranked)
        assert [m.agent_id for m in ranked] == [m.agent_id for m in sorted(members, key=by_score)]
    # 2,000 members over 28 (score, headroom) pairs: ties everywhere, decided by the next key
    assert len({(m.score, m.headroom) for m in members}) == 28
