"""Explained routing: every exclusion reason, every "kept" note, the score terms — pure, fake
clock (the registry and router take ``now``)."""

from __future__ import annotations

import random
from types import SimpleNamespace

import msgspec
import pytest

from reach_agent.routing import filters, reasons
from reach_agent.wire import schema
from reach_agent.wire.errors import NoReachableAgent, Overloaded, to_reply
from reach_agent.wire.schema import Announce, RouteReply, RouteRequest
from reach_broker.core.explain import DETAILS, MAX_EXCLUDED, Explainer
from reach_broker.core.routing import Router
from reach_broker.core.scoring import score, score_of, terms, weakest

from .test_routing import CAP, World, recover


def explained(w: World, now: float, **req: object) -> RouteReply:
    explainer = Explainer(w.router, w.cfg.scoring)
    body = explainer.route_reply(CAP, RouteRequest(explain=True, **req), now, 7)  # type: ignore[arg-type]
    reply: RouteReply = schema.route_reply_decoder.decode(body)
    return reply


def why(reply: RouteReply) -> dict[str, tuple[str, str]]:
    """agent id -> (reason, detail) of every agent left out."""
    assert reply.explain is not None
    return {e.agent_id: (e.reason, e.detail) for e in reply.explain.excluded}


def announce(w: World, agent_id: str, now: float, **fields: object) -> None:
    ann = Announce(agent_id=agent_id, capabilities=[CAP], max_concurrency=10,
                   heartbeat_interval_ms=1000, **fields)  # type: ignore[arg-type]  # fmt: skip
    w.tokens[agent_id] = w.reg.announce(ann, now, 0)[0].token


# --- each reason an agent is left out ----------------------------------------------------------


def test_state_suspect_offline_draining_recovering() -> None:
    w = World("abcde")
    w.reg.disconnected("b", 1.0)  # suspect
    w.reg.disconnected("c", 1.0)
    w.reg.probe_result("c", False, None, 1.5)  # offline
    w.reg.leave("d", 2.0)  # draining
    w.reg.disconnected("e", 1.0)
    w.reg.probe_result("e", False, None, 1.5)
    w.beat("e", 2.5)  # recovering
    reply = explained(w, 3.0, limit=1)
    assert [c.agent_id for c in reply.candidates] == ["a"]
    assert why(reply) == {
        "b": ("state", "suspect for 2.0s: routed only with allow_suspect"),
        "c": ("state", "offline for 1.5s"),
        "d": ("state", "draining for 1.0s"),
        "e": ("state", "recovering for 0.5s"),
    }


def test_suspects_with_allow_suspect_only_when_no_healthy_one_passes() -> None:
    w = World("ab")
    w.reg.disconnected("b", 1.0)
    reply = explained(w, 2.0, allow_suspect=True)
    assert why(reply) == {"b": ("state", "suspect for 1.0s: allow_suspect takes suspects "
                                         "only when no healthy one passes")}  # fmt: skip
    # With a as well gone, the suspects are the pool: b is routed and says why.
    w.reg.disconnected("a", 2.0)
    reply = explained(w, 3.0, allow_suspect=True)
    assert sorted(c.agent_id for c in reply.candidates) == ["a", "b"]
    assert {c.explain.kept for c in reply.candidates if c.explain} == {"allow_suspect"}
    assert why(reply) == {}


def test_load_at_or_above_the_watermark() -> None:
    w = World("ab")
    w.beat("b", 1.0, active=9)
    reply = explained(w, 1.0)
    assert why(reply) == {"b": ("load", "load 9/10 = 0.90, at or above the watermark 0.85")}


def test_region_and_tags_mismatch_and_exclude() -> None:
    w = World("")
    announce(w, "eu1", 0.0, region="eu", tags={"tier": "gold"})
    announce(w, "us1", 0.0, region="us", tags={"tier": "gold"})
    announce(w, "eu2", 0.0, region="eu", tags={"tier": "silver"})
    announce(w, "eu3", 0.0, region="eu")
    announce(w, "eu4", 0.0, region="eu", tags={"tier": "gold"})
    reply = explained(w, 1.0, region="eu", tags={"tier": "gold"}, exclude=["eu4"])
    assert [c.agent_id for c in reply.candidates] == ["eu1"]
    assert why(reply) == {
        "us1": ("region", "region 'us', the request asks 'eu'"),
        "eu2": ("tags", "tag tier is 'silver', the request asks 'gold'"),
        "eu3": ("tags", "tag tier is missing, the request asks 'gold'"),
        "eu4": ("exclude", "named in the request's exclude"),
    }
    assert reply.explain is not None
    assert reply.explain.counts == {"region": 1, "tags": 2, "exclude": 1}


def test_score_below_the_minimum_names_the_term_that_pulled_it_down() -> None:
    w = World("abcd")
    for agent_id in "abc":
        w.beat(agent_id, 1.0, ok_total=1, task_ms_p50=100)
    w.beat("d", 1.0, ok_total=1, task_ms_p50=1600)  # 1600 ms against a tolerance of 250
    rec = w.reg.agents["d"]
    assert rec.score == 15.6
    reply = explained(w, 1.0, limit=3)
    detail = ("score 15.6 below the minimum 60; latency 0.16 pulled it down (1 of 4 healthy "
              "ejected; the cap allows 2)")  # fmt: skip
    assert why(reply) == {"d": ("score", detail)}
    assert reply.explain is not None
    (d,) = reply.explain.excluded
    assert d.explain is not None
    assert d.explain.weakest == "latency"
    assert d.explain.terms.latency == 0.1562
    assert d.explain.rank == 0


def test_unranked_healthy_since_the_last_ranking() -> None:
    w = World("ab", rank_refresh_ms=1000.0)
    w.route(1.0)  # ranked at 1.0: a and b
    announce(w, "c", 1.2)  # healthy, but the next ranking is due at 2.0
    reply = explained(w, 1.3, limit=2)
    assert why(reply) == {"c": ("unranked", "healthy for 0.1s, since the last ranking "
                                            "(rebuilt within 1000 ms)")}  # fmt: skip


def test_pool_and_draw() -> None:
    w = World("abcdefgh", seed=3, pool_factor=2)  # limit 1: a pool of the best 2
    for i, agent_id in enumerate("abcdefgh"):
        w.set_score(agent_id, 99.0 - i)
    reply = explained(w, 1.0, limit=1)
    (first,) = reply.candidates
    reasons_of = why(reply)
    assert first.agent_id in ("a", "b")
    other = "b" if first.agent_id == "a" else "a"
    assert reasons_of.pop(other)[0] == "draw"
    assert reasons_of.pop(other, None) is None
    assert reasons_of["c"] == ("pool", "passed every filter; ranked 3, below the pool of the "
                                       "best 2 the choice draws from")  # fmt: skip
    assert {code for code, _ in reasons_of.values()} == {"pool"}
    assert reply.explain is not None
    assert (reply.explain.pool, reply.explain.choice) == (2, "weighted")


def test_ranked_choice_says_below_the_limit() -> None:
    w = World("abc", choice="ranked")
    for i, agent_id in enumerate("abc"):
        w.set_score(agent_id, 99.0 - i)
    reply = explained(w, 1.0, limit=2)
    assert [c.agent_id for c in reply.candidates] == ["a", "b"]
    assert why(reply) == {"c": ("pool", "passed every filter; ranked 3, below the pool of the "
                                        "best 2 the choice draws from")}  # fmt: skip


# --- why an agent is routed although a rule would keep it out -----------------------------------


def test_kept_in_by_the_ejection_cap() -> None:
    w = World("abcd")  # at most 2 of 4 ejected for score
    for agent_id, value in (("b", 50.0), ("c", 30.0), ("d", 10.0)):
        w.set_score(agent_id, value)
    reply = explained(w, 1.0, limit=4)
    kept = {c.agent_id: c.explain.kept for c in reply.candidates if c.explain}
    assert kept == {"a": None, "b": "eject_cap"}
    assert why(reply) == {
        "c": ("score", "score 30.0 below the minimum 60 (2 of 4 healthy ejected; the cap "
                       "allows 2)"),
        "d": ("score", "score 10.0 below the minimum 60 (2 of 4 healthy ejected; the cap "
                       "allows 2)"),
    }  # fmt: skip


def test_panic_routes_every_healthy_agent_and_says_so() -> None:
    w = World("abcd")
    for agent_id in "bcd":
        w.reg.disconnected(agent_id, 1.0)
    w.set_score("a", 30.0)
    reply = explained(w, 1.0)
    assert reply.explain is not None
    assert reply.explain.panic is True
    ((a,),) = [reply.candidates]
    assert (a.agent_id, a.explain and a.explain.kept) == ("a", "panic")


# --- the reply as a whole --------------------------------------------------------------------


def test_no_reachable_agent_is_still_the_error_and_carries_the_explanation() -> None:
    w = World("ab")
    w.beat("a", 1.0, active=10)
    w.reg.leave("b", 1.0)
    explainer = Explainer(w.router, w.cfg.scoring)
    with pytest.raises(NoReachableAgent) as exc:
        explainer.route_reply(CAP, RouteRequest(explain=True, exclude=["a"]), 1.0, 7)
    headers, body = to_reply(exc.value)
    assert headers["Nats-Service-Error-Code"] == "503"
    data = msgspec.json.decode(body)
    assert data["error"]["code"] == "NO_REACHABLE_AGENT"
    assert data["error"]["message"] == exc.value.message
    explain = msgspec.convert(data["explain"], schema.RouteExplain)
    assert [(e.agent_id, e.reason) for e in explain.excluded] == [("a", "exclude"),
                                                                  ("b", "state")]  # fmt: skip
    # Merely full (a passes every other filter): OVERLOADED, explained the same way.
    with pytest.raises(Overloaded) as full:
        explainer.route_reply(CAP, RouteRequest(explain=True), 1.0, 7)
    headers, body = to_reply(full.value)
    assert headers["Nats-Service-Error-Code"] == "429"
    data = msgspec.json.decode(body)
    assert (data["error"]["code"], data["error"]["retry_after_ms"]) == ("OVERLOADED", 100)
    explain = msgspec.convert(data["explain"], schema.RouteExplain)
    assert [(e.agent_id, e.reason) for e in explain.excluded] == [("a", "load"), ("b", "state")]
    # Without explain the error body is what it always was.
    with pytest.raises(NoReachableAgent) as plain:
        w.router.route(CAP, RouteRequest(exclude=["a"]), 1.0)
    assert msgspec.json.decode(to_reply(plain.value)[1]) == {
        "error": {"code": "NO_REACHABLE_AGENT", "message": plain.value.message}
    }


def test_candidates_carry_their_terms_and_figures() -> None:
    w = World("a")
    w.reg.probe_result("a", True, 3.0, 1.1)
    recover(w, "a", 100.0)  # its probe took 1 ms: the RTT EWMA 3 + 0.3 x (1 - 3)
    w.beat("a", 101.0, active=2, ok_total=96, fail_total=4, task_ms_p50=120, oldest_task_ms=50)
    reply = explained(w, 110.0)
    (a,) = reply.candidates
    assert a.explain is not None
    e = a.explain
    rec = w.reg.agents["a"]
    assert (e.rank, e.kept, e.slow_start, e.rtt_ms) == (1, None, 0.2, 2.4)
    assert (e.ok_total, e.fail_total, e.max_concurrency, e.task_ms) == (96, 4, 10, 120.0)
    assert e.weight == round(rec.weight * 0.2, 2)
    assert e.success_rate == round(rec.stats.success_rate, 4)
    # Three of its last 20 signs missed (suspect, the failed probe, a late heartbeat).
    assert e.terms == schema.ScoreTerms(liveness=0.85, latency=1.0, load=0.8333,
                                        success=0.9619, stuck=1.0)  # fmt: skip
    assert (e.weakest, rec.score) == ("liveness", 73.1)  # 0.85 < 0.9619^2 < 0.8333^0.4


def test_terms_multiply_out_to_the_score() -> None:
    w = World("abcd")
    rng = random.Random(5)
    for step in range(200):
        agent_id = rng.choice("abcd")
        w.beat(agent_id, 1.0 + step * 0.5, active=rng.randrange(0, 10),
               ok_total=step * 3, fail_total=rng.randrange(0, 3) + step,
               task_ms_p50=rng.randrange(50, 2000))  # fmt: skip
        rec = w.reg.agents[agent_id]
        explainer = Explainer(w.router, w.cfg.scoring)
        t = explainer.terms(rec)
        assert score_of(t, w.cfg.scoring) == rec.score
        assert (weakest(t, w.cfg.scoring) is None) == (rec.score == 100.0)
    a = w.reg.agents["a"]
    rec = SimpleNamespace(stats=a.stats, active=3, queue_depth=1, max_concurrency=4, stuck=True,
                          delivery=0.5)  # fmt: skip
    assert score_of(terms(rec, w.cfg.scoring), w.cfg.scoring) == score(rec, w.cfg.scoring)


def test_the_explanation_agrees_with_the_walk() -> None:
    """Over random fleets and requests: the candidates are exactly what the plain route gives
    (two routers, one seed: the same draw), and every other member is explained exactly once
    with a known code."""
    rng = random.Random(9)
    w = World("abcdefghij", seed=4)
    twin = Router(w.cfg.routing, w.reg.indexes, w.router.subject_of,
                  inflight=lambda: w.reg.inflight, capacity=lambda: w.reg.capacity,
                  rng=random.Random(4))  # fmt: skip
    explainer = Explainer(twin, w.cfg.scoring)
    seen: set[str] = set()
    for step in range(400):
        now = 1.0 + step * 0.1
        agent_id = rng.choice("abcdefghij")
        roll = rng.random()
        if roll < 0.5:
            w.beat(agent_id, now, active=rng.randrange(0, 10), ok_total=step,
                   task_ms_p50=rng.choice((100, 100, 3000)))  # fmt: skip
        elif roll < 0.6:
            w.reg.disconnected(agent_id, now)
        elif roll < 0.7:
            announce(w, agent_id, now, region=rng.choice(("eu", "us")),
                     tags={"tier": rng.choice(("gold", "silver"))})  # fmt: skip
        req = RouteRequest(
            limit=rng.randrange(1, 4), allow_suspect=rng.random() < 0.3, explain=True,
            region=rng.choice((None, "eu")), exclude=rng.sample("abcdefghij", 2),
            tags=rng.choice(({}, {"tier": "gold"})),
        )  # fmt: skip
        try:
            plain = [c.agent_id for c in w.router.route(CAP, req, now)]
        except NoReachableAgent:
            with pytest.raises(NoReachableAgent):
                explainer.route_reply(CAP, req, now, step)
            continue
        reply = schema.route_reply_decoder.decode(explainer.route_reply(CAP, req, now, step))
        assert [c.agent_id for c in reply.candidates] == plain
        assert reply.explain is not None
        left = {e.agent_id for e in reply.explain.excluded}
        assert left | set(plain) == set(w.reg.agents)
        assert left.isdisjoint(plain)
        assert sum(reply.explain.counts.values()) == len(left)
        seen |= set(reply.explain.counts)
    assert seen <= set(reasons.EXCLUSIONS)
    assert seen >= {"state", "load", "region", "tags", "exclude", "draw"}


def test_every_reason_has_its_sentence_and_the_walk_uses_only_known_codes() -> None:
    assert set(DETAILS) == set(reasons.EXCLUSIONS)
    assert [f.code for f in filters.FILTERS] == list(reasons.EXCLUSIONS)[: len(filters.FILTERS)]
    assert set(reasons.KEPT).isdisjoint(reasons.EXCLUSIONS)


def test_a_large_capability_lists_the_first_hundred_and_counts_all() -> None:
    w = World("")
    for i in range(150):
        announce(w, f"a{i:03d}", 0.0)
    reply = explained(w, 1.0, limit=1)
    assert reply.explain is not None
    assert len(reply.explain.excluded) == MAX_EXCLUDED
    assert sum(reply.explain.counts.values()) == 149


def test_without_explain_the_reply_is_unchanged() -> None:
    w = World("abc", seed=2)
    twin = World("abc", seed=2)
    body = w.router.route_reply(CAP, RouteRequest(), 1.0, 5)
    assert b"explain" not in body
    assert body == schema.encoder.encode(RouteReply(
        capability=CAP, candidates=twin.router.route(CAP, RouteRequest(), 1.0), generated_at_ms=5
    ))  # fmt: skip
