"""The route filters' one table (reach_agent/routing/filters.py): every set of filters a
request can use compiles into a walk, and the walk keeps an agent out under exactly the first
row whose test it fails, as the rows say."""

from __future__ import annotations

import random

from reach_agent.routing import filters
from reach_agent.routing.filters import FILTERS, VALUES, Walk, walk_source
from reach_agent.routing.member import Member, TaskStats
from reach_agent.routing.rules import Rule, build
from reach_agent.wire.schema import RouteRequest


def member(rng: random.Random, i: int) -> Member:
    m = Member(f"a{i}", rng.choice((1, 2, 4)), TaskStats(rng.choice((None, 50.0))))
    m.state = rng.choice(("healthy", "healthy", "suspect"))
    m.region = rng.choice((None, "eu", "us"))
    m.version = rng.choice(("1", "2", None))
    m.tags = rng.choice(({}, {"env": "prod"}, {"env": "prod", "tier": "gold"}, {"tier": "gold"}))
    m.permissions = frozenset(rng.sample(["pii", "pay", "x"], rng.randrange(0, 3)))
    m.context_window = rng.choice((None, 1000, 100_000))
    m.set_context(rng.choice((None, 50.0)))
    m.set_load(rng.randrange(0, m.max_concurrency + 1), 0)
    return m


def request(rng: random.Random) -> RouteRequest:
    return RouteRequest(
        region=rng.choice((None, "eu")), tags=rng.choice(({}, {"tier": "gold"})),
        requires=rng.choice(([], ["pii"])), min_context_tokens=rng.choice((None, 10_000)),
        exclude=rng.choice(([], ["a1", "a2"])), canary=rng.choice((None, None, "2")),
    )  # fmt: skip


def first_row_failed(walk: Walk, rec: Member, state: str, now: float, watermark: float) -> str:
    """The spec: the rows in order, those the request uses, each test evaluated alone."""
    values = {name: getattr(walk, name) for name in VALUES}
    scope = {**values, "rec": rec, "state": state, "now": now, "watermark": watermark}
    for f in FILTERS:
        if eval(f.applies, {}, values) and not eval(f.keeps, {}, scope):
            return f.code
    return ""


def test_every_set_of_filters_compiles_both_ways() -> None:
    for shape in range(1 << len(FILTERS)):
        for count in (False, True):
            assert callable(filters.walk_of(shape, count))


def test_the_walk_fails_an_agent_on_the_first_row_it_fails() -> None:
    rng = random.Random(23)
    rule = Rule(build(split="version=1:50,2:50", require=["env=prod"]), "config")
    seen: set[str] = set()
    for step in range(300):
        recs = [member(rng, i) for i in range(8)]
        req = request(rng)
        policy = rng.choice(((None, req.canary), (rule, rng.choice(("1", "2", None)))))
        walk = Walk(req, policy)
        state = rng.choice(("healthy", "suspect"))
        why: dict[str, int] = {}
        passed = walk.counting(recs, state, len(recs), why, float(step), 0.85)
        expected = {r.agent_id: first_row_failed(walk, r, state, float(step), 0.85) for r in recs}
        assert [r.agent_id for r in passed] == [a for a, code in expected.items() if not code]
        counts: dict[str, int] = {}
        for code in expected.values():
            if code:
                counts[code] = counts.get(code, 0) + 1
        assert why == counts
        for rec in recs:
            assert (walk.first_failed(rec, state, float(step), 0.85) or "") == expected[
                rec.agent_id
            ]
        assert walk.passing(walk, recs, state, len(recs), float(step), 0.85) == passed
        seen |= set(counts)
    assert seen == {f.code for f in FILTERS}


def test_a_request_without_filters_walks_state_and_load_only() -> None:
    source = walk_source(Walk(RouteRequest()).shape)
    assert source.count("if not (") == 2
    assert "rec.state == state" in source and "rec.busy < watermark" in source
