"""Routing policy (issue 18), pure with a fake clock: route rules (splits, canaries, required
tags), the AI filters (requires, min_context_tokens) and the headroom tie-break, quotas, the
in-flight ceiling that scales with the fleet, and the delivery verdicts of callers' outcomes."""

from __future__ import annotations

import random

import msgspec
import pytest

from reach_agent.routing.rules import Rules, build, parse_split
from reach_agent.wire.errors import InvalidRequest, NoReachableAgent, Overloaded
from reach_agent.wire.schema import Announce, Heartbeat, OutcomeSummary, RouteRequest
from reach_broker.config import Config, ConfigError, OutcomesSection, QuotaLimit, RuleSection
from reach_broker.core.delivery import OUTLIER, UNANSWERED, DeliveryBook
from reach_broker.core.explain import Explainer
from reach_broker.core.quotas import ANONYMOUS, Quotas, caller_of
from reach_broker.core.registry import Registry
from reach_broker.core.routing import Router
from reach_broker.core.tokens import TokenSigner
from reach_broker.service.rulebook import from_config

CAP = "summarize"


class Fleet:
    """A registry and router over agents announced with the given fields."""

    def __init__(self, cfg: Config | None = None, seed: int = 1) -> None:
        cfg = cfg or Config()
        cfg.routing.rank_refresh_ms = 0
        self.cfg = cfg
        self.reg = Registry(
            cfg.detection,
            cfg.scoring,
            TokenSigner(b"k" * 32, 3600.0, wall=lambda: 1_000_000.0),
            interval_ms=cfg.broker.interval_ms,
        )
        reg = self.reg
        self.rules = Rules(from_config(cfg.rules))
        self.router = Router(cfg.routing, reg.indexes, lambda a, c: f"reach.task.{a}.{c}",
                             inflight=lambda: reg.inflight, capacity=lambda: reg.capacity,
                             rng=random.Random(seed), rules=self.rules)  # fmt: skip
        self.tokens: dict[str, str] = {}
        self.seq = 0

    def add(self, agent_id: str, **fields: object) -> None:
        fields.setdefault("max_concurrency", 10)
        ann = Announce(agent_id=agent_id, capabilities=[CAP], heartbeat_interval_ms=1000,
                       **fields)  # type: ignore[arg-type]  # fmt: skip
        rec, _ = self.reg.announce(ann, 0.0, 0)
        self.tokens[agent_id] = rec.token

    def beat(self, agent_id: str, now: float, **fields: object) -> None:
        self.seq += 1
        hb = Heartbeat(agent_id=agent_id, token=self.tokens[agent_id], seq=self.seq,
                       **fields)  # type: ignore[arg-type]  # fmt: skip
        assert self.reg.heartbeat(hb, now, 0)[0] == "accepted"

    def route(self, now: float = 1.0, **req: object) -> list[str]:
        got = self.router.route(CAP, RouteRequest(**req), now)  # type: ignore[arg-type]
        return [c.agent_id for c in got]

    def explain(self, **req: object) -> dict[str, str]:
        """agent_id → reason code of every agent left out of an explained route."""
        ex = Explainer(self.router, self.cfg.scoring)
        request = RouteRequest(explain=True, **req)  # type: ignore[arg-type]
        try:
            body = ex.route_reply(CAP, request, 1.0, 0)
        except NoReachableAgent as exc:
            assert exc.extra is not None
            explain = exc.extra["explain"]
        else:
            explain = msgspec.json.decode(body).get("explain")
            explain = msgspec.convert(explain, type=type(explain))
        excluded = explain["excluded"] if isinstance(explain, dict) else explain.excluded
        out = {}
        for e in excluded:
            e = e if isinstance(e, dict) else msgspec.to_builtins(e)
            out[e["agent_id"]] = e["reason"]
        return out


# --- splits and canaries --------------------------------------------------------------------


def test_a_95_5_version_split_over_10000_route_requests_lands_within_1_percent() -> None:
    f = Fleet()
    for i in range(6):
        f.add(f"v1-{i}", version="1")
    for i in range(2):
        f.add(f"v2-{i}", version="2")
    f.rules.put(CAP, build(split="version=1:95,2:5"))
    counts = {"1": 0, "2": 0}
    for _ in range(10_000):
        first = f.route(limit=1)[0]
        counts[first.split("-")[0][1:]] += 1
    assert abs(counts["1"] / 10_000 - 0.95) <= 0.01
    assert abs(counts["2"] / 10_000 - 0.05) <= 0.01
    # Smooth weighted round robin is exact over each cycle of 100 requests.
    assert counts == {"1": 9500, "2": 500}


def test_a_split_by_tag_and_every_candidate_of_a_reply_is_of_its_arm() -> None:
    f = Fleet()
    for i in range(3):
        f.add(f"a{i}", tags={"model": "a"})
        f.add(f"b{i}", tags={"model": "b"})
    f.add("c0", tags={"model": "c"})  # in no arm: never routed while the rule is set
    f.rules.put(CAP, build(split="model=a:90,b:10"))
    arms = {"a": 0, "b": 0}
    for _ in range(1000):
        got = f.route(limit=3)
        assert "c0" not in got
        assert len({g[0] for g in got}) == 1  # one arm per request
        arms[got[0][0]] += 1
    assert arms == {"a": 900, "b": 100}
    assert f.explain(canary="a")["c0"] == "split"


def test_a_canary_names_its_arm_and_an_empty_drawn_arm_falls_back() -> None:
    f = Fleet()
    f.add("old", version="1")
    f.add("new", version="2")
    f.rules.put(CAP, build(split="version=1:50,2:50"))
    assert {f.route(canary="2", limit=2)[0] for _ in range(20)} == {"new"}
    assert f.route(canary="2", limit=2) == ["new"]
    f.reg.leave("new", 2.0)
    assert {f.route(2.0, limit=1)[0] for _ in range(10)} == {"old"}  # the drawn arm 2: empty
    with pytest.raises(NoReachableAgent):
        f.route(2.0, canary="2")  # named: no fallback
    # Without a rule, a canary is a version.
    f2 = Fleet()
    f2.add("x", version="1")
    f2.add("y", version="7")
    assert f2.route(canary="7") == ["y"]


def test_a_sticky_key_keeps_its_arm() -> None:
    f = Fleet()
    f.add("old", version="1")
    f.add("new", version="2")
    f.rules.put(CAP, build(split="version=1:50,2:50"))
    arms = {f.route(sticky_key=f"user-{i}", limit=1)[0] for i in range(1)}
    for _ in range(20):
        assert {f.route(sticky_key="user-0", limit=1)[0]} == arms


def test_required_tags_keep_untagged_agents_out_unless_the_request_asks() -> None:
    f = Fleet()
    f.add("prod", tags={"env": "prod"})
    f.add("staging", tags={"env": "staging"})
    f.add("untagged")
    f.rules.put(CAP, build(require=["env=prod"]))
    for _ in range(50):
        assert f.route(limit=3) == ["prod"]
    assert f.route(tags={"env": "staging"}) == ["staging"]  # asked for by name
    why = f.explain(limit=3)
    assert why == {"staging": "required", "untagged": "required"}


def test_rule_words_are_checked_and_name_what_is_wrong() -> None:
    assert parse_split("version=1:95,2:5") == ("version", {"1": 95, "2": 5})
    for text, words in (("version", "KEY=VALUE:WEIGHT"), ("version=1:x", "is not an integer"),
                        ("version=1:0,2:0", "add up to 0"), ("version=1:5,1:5", "twice"),
                        ("Env=a:1", "lowercase")):  # fmt: skip
        with pytest.raises(InvalidRequest) as exc:
            parse_split(text)
        assert words in exc.value.message
    with pytest.raises(ConfigError) as cfg_exc:
        from_config({CAP: RuleSection(split="version=1")})
    assert cfg_exc.value.args[0].startswith("rules.summarize: split arm '1' is not VALUE:WEIGHT")


def test_clearing_the_bucket_rule_brings_back_broker_toml_s() -> None:
    rules = Rules(from_config({CAP: RuleSection(require={"env": "prod"})}))
    assert rules[CAP].source == "config"
    rules.put(CAP, build(split="version=1:1"))
    assert (rules[CAP].source, rules[CAP].require) == ("kv", ())
    assert rules.unset(CAP) is not None
    assert (rules[CAP].source, rules[CAP].require) == ("config", (("env", "prod"),))
    rules.unset("other")
    assert "other" not in rules


# --- requires, min_context_tokens, headroom -------------------------------------------------


def test_requires_and_min_context_tokens_filter_as_documented() -> None:
    f = Fleet()
    f.add("reader", permissions=["read"])
    f.add("writer", permissions=["read", "write"], context_window=200_000)
    f.add("small", permissions=["read", "write"], context_window=8_000)
    assert sorted(f.route(requires=["write"])) == ["small", "writer"]
    assert f.route(requires=["write"], min_context_tokens=100_000) == ["writer"]
    # Headroom is context_window x (1 - context_usage_pct / 100), from heartbeats.
    f.beat("writer", 1.0, context_usage_pct=60.0)  # 80,000 left
    with pytest.raises(NoReachableAgent) as exc:
        f.route(requires=["write"], min_context_tokens=100_000)
    assert "filtered by requires" in exc.value.message
    assert "filtered by context" in exc.value.message
    why = f.explain(requires=["write"], min_context_tokens=50_000)
    assert why == {"reader": "requires", "small": "context"}


def test_context_headroom_breaks_ties_in_the_ranking() -> None:
    cfg = Config()
    cfg.routing.choice = "ranked"
    f = Fleet(cfg)
    f.add("a", context_window=10_000)
    f.add("b", context_window=100_000)
    f.add("c", context_window=50_000)
    assert f.route(limit=3) == ["b", "c", "a"]
    f.beat("b", 1.0, context_usage_pct=95.0)  # 5,000 left
    f.beat("a", 1.0)
    f.beat("c", 1.0)
    assert f.route(1.5, limit=3) == ["c", "a", "b"]


# --- quotas and the ceiling -------------------------------------------------------------------


def test_a_caller_over_its_quota_is_refused_with_retry_after_while_another_is_served() -> None:
    cfg = Config()
    cfg.quotas.rate = 8.0
    cfg.quotas.burst = 5
    quotas = Quotas(cfg.quotas, Rules())
    now = 100.0
    assert [quotas.admit("batch", CAP, now) for _ in range(5)] == [None] * 5
    assert quotas.admit("batch", CAP, now) == 125  # one token back in 1/8 s
    assert quotas.admit("web", CAP, now) is None  # another caller: its own bucket
    assert quotas.admit("batch", "other.cap", now) is None  # another capability too
    assert quotas.admit("batch", CAP, now + 0.125) is None
    assert quotas.admit("batch", CAP, now + 0.125) == 125
    assert quotas.refused == 2


def test_quota_precedence_caller_then_rule_then_default() -> None:
    cfg = Config()
    cfg.quotas.rate = 100.0
    cfg.quotas.per_caller = {"vip": QuotaLimit(rate=1000.0, burst=1000)}
    rules = Rules()
    rules.put(CAP, build(quota="2:2"))
    quotas = Quotas(cfg.quotas, rules)
    assert quotas.limit("vip", CAP) == QuotaLimit(rate=1000.0, burst=1000)
    assert quotas.limit("anyone", CAP) == QuotaLimit(rate=2.0, burst=2)
    assert quotas.limit("anyone", "other") == QuotaLimit(rate=100.0, burst=None)
    assert Quotas(Config().quotas, Rules()).active is False


def test_the_caller_is_the_private_inbox_when_secured_else_the_header() -> None:
    inbox = "_INBOX.caller.billing.ab12.call.1"
    assert caller_of({"Reach-Caller": "spoof"}, inbox, secured=True) == "billing"
    assert caller_of({"Reach-Caller": "web-1"}, inbox, secured=False) == "web-1"
    assert caller_of(None, "_INBOX.x", secured=False) == ANONYMOUS


def test_the_default_inflight_ceiling_scales_with_the_fleet() -> None:
    f = Fleet()
    for a in "ab":
        f.add(a, max_concurrency=10)
    assert f.router.ceiling() == 18  # 0.9 x 20 slots
    f.beat("a", 1.0, active=8)
    f.beat("b", 1.0, active=8)
    assert len(f.route(1.0, limit=2)) == 2  # 16 in flight, under 18
    f.beat("a", 1.1, active=9)
    f.beat("b", 1.1, active=10)
    with pytest.raises(Overloaded) as exc:
        f.route(1.1)
    assert exc.value.message == "fleet in-flight tasks 19 exceed the ceiling 18"
    assert exc.value.retry_after_ms == 250
    f.add("c", max_concurrency=10)  # the fleet grows: so does the ceiling
    assert f.router.ceiling() == 27
    assert f.route(1.2, limit=1) == ["c"]
    f.reg.evict("c", "gone", 1.3)  # and shrinks
    assert (f.reg.capacity, f.router.ceiling()) == (20, 18)


# --- outcomes: the delivery verdicts ----------------------------------------------------------


def _summary(caller: str, attempts: int, **counts: int) -> OutcomeSummary:
    return OutcomeSummary(caller=caller, attempts=attempts, **counts)


def test_one_noisy_caller_alone_cannot_move_the_delivery_term() -> None:
    book = DeliveryBook(OutcomesSection())
    v = book.add("a", _summary("noisy", 100, not_delivered=60, ok=40), 1.0, finished=0, busy=True)
    assert (v.delivery, v.rule) == (1.0, None)
    v = book.add("a", _summary("calm", 100, ok=100), 2.0, finished=0, busy=True)
    assert (v.delivery, v.rule) == (1.0, None)  # the second worst caller saw 0 %
    v = book.add("a", _summary("second", 50, timeouts=5, ok=45), 3.0, finished=100, busy=True)
    assert (v.delivery, v.rule, v.share) == (0.0, OUTLIER, 0.1)  # two callers above 5 %


def test_the_outlier_rule_forgets_after_the_window() -> None:
    book = DeliveryBook(OutcomesSection(window_s=60.0))
    book.add("a", _summary("x", 20, not_delivered=4, ok=16), 0.0, finished=0, busy=True)
    assert (
        book.add("a", _summary("y", 20, lost=2, ok=18), 0.0, finished=0, busy=True).rule == OUTLIER
    )
    assert book.judge("a", 30.0, finished=0, busy=True).rule == OUTLIER
    assert book.judge("a", 61.0, finished=0, busy=True).delivery == 1.0
    assert "a" not in book.agents


def test_only_agents_whose_reports_left_the_window_are_judged_again() -> None:
    """Judging the book as time passes touches the agents some of whose reports just left
    the window, and those with unanswered calls, not every agent with reports."""
    book = DeliveryBook(OutcomesSection(window_s=60.0))
    for i in range(1000):
        for caller in ("x", "y"):
            book.add(f"a{i}", _summary(caller, 20, not_delivered=i % 3, ok=20 - i % 3),
                     i / 100, finished=0, busy=True)  # fmt: skip
    book.add("late", _summary("x", 20, timeouts=1, ok=19), 5.0, finished=3, busy=True)
    assert book.ejected == {OUTLIER: 333, UNANSWERED: 0}  # 2 in 20 failed (10 % > 5 %)
    assert book.due(59.0) == {"late"}  # nothing has left yet; "late" has an unanswered call
    assert book.due(60.005) == {"a0", "late"}  # a0's two reports came at 0.0
    assert book.due(65.0) == {f"a{i}" for i in range(1, 500)} | {"late"}
    for agent_id in book.due(80.0) | {f"a{i}" for i in range(500)} | {"late"}:
        book.judge(agent_id, 80.0, finished=0, busy=True)
    assert (book.agents, book.ejected) == ({}, {OUTLIER: 0, UNANSWERED: 0})
    assert book.due(80.0) == set()


def test_receipts_without_results_eject_after_n_calls_unless_the_agent_finishes_tasks() -> None:
    cfg = OutcomesSection(unanswered_after=3)
    book = DeliveryBook(cfg)
    assert book.add("a", _summary("first", 2, timeouts=2), 1.0, finished=7, busy=True).rule is None
    assert (
        book.add("a", _summary("first", 1, timeouts=1), 2.0, finished=7, busy=True).rule
        == UNANSWERED
    )
    # The same reports of a slow agent that does finish its tasks (the caller gave up early).
    slow = DeliveryBook(cfg)
    slow.add("b", _summary("hasty", 2, timeouts=2), 1.0, finished=7, busy=True)
    assert slow.add("b", _summary("hasty", 1, timeouts=1), 2.0, finished=9, busy=True).rule is None
    # ... or that answers another caller.
    other = DeliveryBook(cfg)
    other.add("c", _summary("hasty", 3, timeouts=3), 1.0, finished=7, busy=True)
    assert other.add("c", _summary("patient", 1, ok=1), 2.0, finished=7, busy=True).rule is None
    # ... or that runs nothing at all: the reports are not its (a caller making them up).
    idle = DeliveryBook(cfg)
    assert (
        idle.add("d", _summary("liar", 50, timeouts=50), 1.0, finished=0, busy=False).rule is None
    )
    assert idle.judge("d", 2.0, finished=0, busy=True).rule == UNANSWERED


def test_tasks_seen_running_count_even_after_their_deadlines_cancelled_them() -> None:
    """The third unanswered call is reported after its deadline cancelled it on the agent
    (whose heartbeats then report nothing running): the calls were in its hands while they
    went unanswered, which the heartbeats showed at the first two reports."""
    book = DeliveryBook(OutcomesSection(unanswered_after=3))
    assert book.add("a", _summary("first", 1, timeouts=1), 1.0, finished=7, busy=True).rule is None
    assert book.add("a", _summary("first", 1, timeouts=1), 2.0, finished=7, busy=True).rule is None
    late = book.add("a", _summary("first", 1, timeouts=1), 3.0, finished=7, busy=False)
    assert late.rule == UNANSWERED
    # Reports of an agent never seen running anything are not enough (a caller lying).
    never = DeliveryBook(OutcomesSection(unanswered_after=3))
    for t in (1.0, 2.0, 3.0):
        assert (
            never.add("b", _summary("liar", 1, timeouts=1), t, finished=0, busy=False).rule is None
        )
