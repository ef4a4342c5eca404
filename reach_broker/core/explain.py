"""Routing that explains itself: why each candidate, and why not each other agent.

With ``RouteRequest.explain`` the decision is still :meth:`Router.choose`'s (it is made by
it, with its randomness), and then explained: each candidate carries its score terms and its
place in the routing (:class:`~reach_agent.wire.schema.AgentExplain`), and the reply's
:class:`~reach_agent.wire.schema.RouteExplain` names every other agent of the capability with a
reason code (:mod:`reach_agent.routing.reasons`) and a sentence with the figures. Whether an agent
passes the filters is asked of the route walk itself, agent by agent
(:meth:`Router.filtered_by`), so the explanation and the walk cannot disagree.

An explained request costs O(agents of the capability): it is for people (``reach route
--explain``, the console), and the plain route path does not pass through here.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable
from typing import NamedTuple

import msgspec

from reach_agent.routing import filters
from reach_agent.routing import reasons as r
from reach_agent.routing.filters import Policy
from reach_agent.routing.index import CapabilityIndex
from reach_agent.routing.table import RouteTable
from reach_agent.wire.errors import NoReachableAgent, Overloaded
from reach_agent.wire.schema import (
    AgentExplain,
    Candidate,
    Exclusion,
    RouteExplain,
    RouteReply,
    RouteRequest,
    ScoreTerms,
    encoder,
)
from reach_broker.config import RoutingSection, ScoringSection

from .records import AgentRecord
from .routing import Router
from .scoring import Terms, terms, weakest

MAX_EXCLUDED = 100
"""Agents listed in ``RouteExplain.excluded`` (``counts`` has them all): a reply stays far
below NATS's payload limit however large the capability."""

DEFAULT_REQUEST = RouteRequest()


class Walk(NamedTuple):
    """The route walk of one request, agent by agent."""

    pool: list[AgentRecord]
    """What it gathered for the choice, best first."""
    state: str
    """The state it walked for: ``healthy``, or ``suspect`` when it fell back to suspects."""
    failed: dict[str, str | None]
    """Every agent it walked over: the code of the filter it failed, None if it passed."""
    policy: Policy
    """The capability's rule and the split arm it walked with."""


class Case(NamedTuple):
    """One agent left out, with what its sentence is made of."""

    rec: AgentRecord
    req: RouteRequest
    idx: CapabilityIndex[AgentRecord]
    cfg: RoutingSection
    now: float
    terms: Terms
    weakest: str | None
    rank: int
    walked: str
    """The state the walk wanted (``healthy``; ``suspect`` when it fell back to suspects)."""
    pool: int
    policy: Policy
    """The capability's rule and the split arm the walk was given."""


def _score(c: Case) -> str:
    idx, cfg = c.idx, c.cfg
    term = getattr(c.terms, c.weakest) if c.weakest else 1.0
    pulled = f"; {c.weakest} {term:.2f} pulled it down" if c.weakest else ""
    cap = int(cfg.max_eject_share * idx.healthy)
    return (f"score {c.rec.score:.1f} below the minimum {cfg.min_reach_score:g}{pulled} "
            f"({idx.ejected} of {idx.healthy} healthy ejected; the cap allows {cap})")  # fmt: skip


def _unranked(c: Case) -> str:
    age = max(c.now - c.rec.state_since, 0.0)
    return (f"healthy for {age:.1f}s, since the last ranking (rebuilt within "
            f"{c.cfg.rank_refresh_ms:g} ms)")  # fmt: skip


def _pool(c: Case) -> str:
    return (f"passed every filter; ranked {c.rank}, below the pool of the best {c.pool} "
            "the choice draws from")  # fmt: skip


def _draw(c: Case) -> str:
    req, choice = c.req, c.cfg.choice
    if req.sticky_key:
        return "in the pool; the sticky key's owner and better ranked agents filled the limit"
    if choice == "ranked":
        return f"in the pool; ranked {c.rank}, below the limit {req.limit}"
    if choice == "p2c":
        return f"in the pool of {c.pool}; power of two choices took another, the rest by score"
    return (f"in the pool of {c.pool}; not drawn (weighted draw of {req.limit}, "
            f"weight {c.rec.weight:.1f})")  # fmt: skip


DETAILS: dict[str, Callable[[Case], str]] = {
    **filters.DETAILS,
    r.SCORE: _score,
    r.UNRANKED: _unranked,
    r.POOL: _pool,
    r.DRAW: _draw,
}
"""The sentence of each reason code (every code of ``reasons.EXCLUSIONS``)."""


def _score_terms(t: Terms) -> ScoreTerms:
    return ScoreTerms(liveness=round(t.liveness, 4), latency=round(t.latency, 4),
                      load=round(t.load, 4), success=round(t.success, 4),
                      stuck=t.stuck, delivery=round(t.delivery, 4))  # fmt: skip


Coverage = Callable[[str, Iterable[str]], tuple[int, list[int]]]
"""(capability, the agent ids explained) -> (agents of the capability in the other owners'
shares followed, the partitions neither owned nor seen in those agents), for
``RouteExplain.shared`` and ``unseen_partitions``."""


class Explainer:
    """Explained route replies and rankings over the router and the scoring settings."""

    def __init__(self, router: Router, scoring: ScoringSection, *,
                 coverage: Coverage | None = None) -> None:  # fmt: skip
        self.router = router
        self.scoring = scoring
        self.coverage = coverage
        """With several brokers: what an explanation does not cover (the other owners'
        shares followed, the partitions not seen); None: the registry is the whole fleet."""

    def route_reply(
        self, capability: str, req: RouteRequest, now: float, generated_at_ms: int
    ) -> bytes:
        """:meth:`Router.route_reply` with the explanation (a look: no hand-out counted).
        ``NO_REACHABLE_AGENT`` and ``OVERLOADED`` are still the errors they are, the body
        carrying the ``explain`` beside ``error``. With the other owners' shares followed
        the decision is the merged one (:meth:`Router.merged`): their agents among the
        candidates without an ``explain`` of their own, the registry's explained."""
        router = self.router
        table = router.foreign(capability) if router.foreign is not None else None
        if table is not None:
            return self._merged_reply(capability, req, now, generated_at_ms, table)
        try:
            idx, chosen = router.choose(capability, req, now)
        except (NoReachableAgent, Overloaded) as exc:
            found = router.indexes.get(capability)
            if found is not None and found.members:
                exc.extra = {"explain": self._covered(
                    capability, found, self.explanation(found, req, [], now, router.last_policy)
                )}  # fmt: skip
            raise
        ranks = {rec.agent_id: i for i, rec in enumerate(idx.ranked, 1)}
        subject_of = router.subject_of
        candidates = [
            self.candidate(rec, idx, now, subject_of(rec.agent_id, capability), ranks)
            for rec in chosen
        ]
        reply = RouteReply(capability=capability, candidates=candidates,
                           generated_at_ms=generated_at_ms,
                           explain=self._covered(capability, idx, self.explanation(
                               idx, req, chosen, now, router.last_policy)))  # fmt: skip
        return encoder.encode(reply)

    def _merged_reply(self, capability: str, req: RouteRequest, now: float,
                      generated_at_ms: int, table: RouteTable) -> bytes:  # fmt: skip
        router = self.router
        idx = router.indexes.get(capability)
        try:
            chosen = router.merged(capability, req, now, table)
        except (NoReachableAgent, Overloaded) as exc:
            exc.extra = {"explain": self._merged_explanation(capability, idx, req, [], now)}
            raise
        ranks = {rec.agent_id: i for i, rec in enumerate(idx.ranked, 1)} if idx else {}
        subject_of = router.subject_of
        candidates = [
            self.candidate(r, idx, now, subject_of(r.agent_id, capability), ranks)
            if idx is not None and isinstance(r, AgentRecord)
            else r.candidate(subject_of(r.agent_id, capability))
            for r in chosen
        ]  # fmt: skip
        own = [r for r in chosen if isinstance(r, AgentRecord)]
        explain = self._merged_explanation(capability, idx, req, own, now)
        reply = RouteReply(capability=capability, candidates=candidates,
                           generated_at_ms=generated_at_ms, explain=explain)  # fmt: skip
        return encoder.encode(reply)

    def _merged_explanation(self, capability: str, idx: CapabilityIndex[AgentRecord] | None,
                            req: RouteRequest, own: list[AgentRecord],
                            now: float) -> RouteExplain:  # fmt: skip
        """The registry's agents explained (none held: an empty explanation), saying what
        it leaves out."""
        if idx is not None:
            return self._covered(capability, idx, self.explanation(
                idx, req, own, now, self.router.last_policy))  # fmt: skip
        cfg = self.router.cfg
        empty = RouteExplain(members=0, healthy=0, ranked=0,
                             choice="sticky" if req.sticky_key else cfg.choice,
                             min_reach_score=cfg.min_reach_score,
                             load_watermark=cfg.load_watermark)  # fmt: skip
        if self.coverage is None:
            return empty
        shared, unseen = self.coverage(capability, ())
        return msgspec.structs.replace(empty, shared=shared, unseen_partitions=unseen)

    def _covered(self, capability: str, idx: CapabilityIndex[AgentRecord],
                 explain: RouteExplain) -> RouteExplain:  # fmt: skip
        """``explain`` saying what it does not cover (with several brokers)."""
        if self.coverage is None:
            return explain
        shared, unseen = self.coverage(capability, idx.members)
        if not shared and not unseen:
            return explain
        return msgspec.structs.replace(explain, shared=shared, unseen_partitions=unseen)

    def candidate(
        self, rec: AgentRecord, idx: CapabilityIndex[AgentRecord], now: float, subject: str,
        ranks: dict[str, int],
    ) -> Candidate:  # fmt: skip
        """``rec`` as a candidate of ``idx``, with its explanation."""
        explain = self.agent(rec, now, rank=ranks.get(rec.agent_id, 0), kept=self.kept(rec, idx))
        return msgspec.structs.replace(rec.candidate(subject), explain=explain)

    def kept(self, rec: AgentRecord, idx: CapabilityIndex[AgentRecord]) -> str | None:
        """Why a routed agent is routed although a rule would keep it out, if it is."""
        if rec.state == "suspect":
            return r.ALLOW_SUSPECT
        if rec.score < self.router.cfg.min_reach_score:
            return r.PANIC if idx.panic else r.EJECT_CAP
        return None

    def terms(self, rec: AgentRecord) -> Terms:
        """``rec``'s score terms as of now (the inputs the registry scored it from)."""
        peer = None
        if rec.stats.task_ewma_ms is not None:
            peer = self.router.indexes.peer_task_ms(rec)
        return terms(rec, self.scoring, peer)

    def brief(self, rec: AgentRecord) -> AgentExplain:
        """``rec``'s score terms and the weakest of them, nothing else (a list of agents)."""
        t = self.terms(rec)
        return AgentExplain(terms=_score_terms(t), weakest=weakest(t, self.scoring))

    def agent(
        self, rec: AgentRecord, now: float, *, rank: int = 0, kept: str | None = None,
        t: Terms | None = None, weak: str | None = None,
    ) -> AgentExplain:  # fmt: skip
        """What ``rec``'s score is made of and its weight in the draw (``t`` and ``weak``:
        its terms and weakest term when the caller has them already)."""
        if t is None:
            t = self.terms(rec)
            weak = weakest(t, self.scoring)
        stats = rec.stats
        router = self.router
        return AgentExplain(
            terms=_score_terms(t),
            weakest=weak,
            slow_start=round(router.slow_start_factor(rec, now), 4),
            weight=round(router.weight(rec, now), 2),
            rank=rank, kept=kept,
            task_ms=None if stats.task_ewma_ms is None else round(stats.task_ewma_ms, 1),
            rtt_ms=None if stats.rtt_ewma_ms is None else round(stats.rtt_ewma_ms, 2),
            success_rate=round(stats.success_rate, 4),
            ok_total=rec.ok_total, fail_total=rec.fail_total, active=rec.active,
            queue_depth=rec.queue_depth, max_concurrency=rec.max_concurrency,
            oldest_task_ms=rec.oldest_task_ms, timeout_hint_ms=rec.timeout_hint_ms,
            probe_failures=rec.probe_failures,
        )  # fmt: skip

    def walk(
        self,
        idx: CapabilityIndex[AgentRecord],
        req: RouteRequest,
        now: float,
        policy: Policy | None = None,
    ) -> Walk:
        """The walk of ``req`` over ``idx``, agent by agent: which filter each ranked agent
        (and each suspect, when the walk falls back to them) fails, and the pool it gathers
        for the choice. ``policy``: the rule and split arm the choice walked with (None: the
        capability's rule, no arm drawn — the console's view of every arm at once)."""
        if policy is None:
            policy = (self.router.rules.get(idx.name), req.canary)
        want = self.router.pool_size(req)
        failed, passed = self._failed(idx.ranked, "healthy", req, now, policy)
        if passed or not req.allow_suspect:
            return Walk(passed[:want], "healthy", failed, policy)
        failed_suspect, passed = self._failed(idx.suspects, "suspect", req, now, policy)
        return Walk(passed[:want], "suspect", {**failed_suspect, **failed}, policy)

    def _failed(
        self, recs: list[AgentRecord], state: str, req: RouteRequest, now: float, policy: Policy
    ) -> tuple[dict[str, str | None], list[AgentRecord]]:
        """The walk over ``recs`` in one pass, then each agent it left out asked why."""
        router = self.router
        passed = router.passing(recs, state, req, now, policy)
        failed: dict[str, str | None] = dict.fromkeys((rec.agent_id for rec in passed), None)
        for rec in recs:
            if rec.agent_id not in failed:
                failed[rec.agent_id] = router.filtered_by(rec, state, req, now, policy)
        return failed, passed

    def reason(
        self, rec: AgentRecord, idx: CapabilityIndex[AgentRecord], walk: Walk, pool: set[str]
    ) -> str:
        """The reason code of an agent of ``idx`` that is not a candidate after ``walk``."""
        if rec.agent_id in pool:
            return r.DRAW
        if rec.agent_id in walk.failed:  # walked over: the walk's own filters say why
            return walk.failed[rec.agent_id] or r.POOL
        if rec.state != "healthy":
            return r.STATE
        if rec.score < self.router.cfg.min_reach_score and not idx.panic:
            return r.SCORE
        return r.UNRANKED

    def left_out(
        self, idx: CapabilityIndex[AgentRecord], req: RouteRequest, chosen: list[AgentRecord],
        now: float, walk: Walk | None = None, limit: int = MAX_EXCLUDED,
    ) -> tuple[dict[str, int], list[Exclusion]]:  # fmt: skip
        """Every agent of ``idx`` not ``chosen`` for ``req``: how many for each reason, and
        the first ``limit`` (best ranked, then best scored) with why."""
        cfg = self.router.cfg
        walk = walk or self.walk(idx, req, now)
        in_pool = {rec.agent_id for rec in walk.pool}
        ranks = {rec.agent_id: i for i, rec in enumerate(idx.ranked, 1)}
        taken = {rec.agent_id for rec in chosen}
        left = [rec for rec in idx.members.values() if rec.agent_id not in taken]
        counts: dict[str, int] = {}
        codes = {}
        for rec in left:
            code = codes[rec.agent_id] = self.reason(rec, idx, walk, in_pool)
            counts[code] = counts.get(code, 0) + 1
        unranked = len(ranks) + 1
        listed = heapq.nsmallest(limit, left, key=lambda rec: (
            ranks.get(rec.agent_id, unranked), -rec.score, rec.agent_id))  # fmt: skip
        excluded: list[Exclusion] = []
        for rec in listed:
            code = codes[rec.agent_id]
            rank = ranks.get(rec.agent_id, 0)
            t = self.terms(rec)
            weak = weakest(t, self.scoring)
            case = Case(rec, req, idx, cfg, now, t, weak, rank, walk.state, len(walk.pool),
                        walk.policy)  # fmt: skip
            excluded.append(Exclusion(
                agent_id=rec.agent_id, reason=code, detail=DETAILS[code](case),
                state=rec.state, score=rec.score, load=round(rec.load, 3),
                explain=self.agent(rec, now, rank=rank, t=t, weak=weak),
            ))  # fmt: skip
        return counts, excluded

    def explanation(
        self, idx: CapabilityIndex[AgentRecord], req: RouteRequest, chosen: list[AgentRecord],
        now: float, policy: Policy | None = None,
    ) -> RouteExplain:  # fmt: skip
        """How ``req`` was decided over ``idx``: every agent not ``chosen``, with why."""
        cfg = self.router.cfg
        walk = self.walk(idx, req, now, policy)
        counts, excluded = self.left_out(idx, req, chosen, now, walk)
        return RouteExplain(
            members=len(idx.members), healthy=idx.healthy, ranked=len(idx.ranked),
            choice="sticky" if req.sticky_key else cfg.choice,
            min_reach_score=cfg.min_reach_score, load_watermark=cfg.load_watermark,
            ejected=idx.ejected, panic=idx.panic, pool=len(walk.pool), counts=counts,
            excluded=excluded,
        )  # fmt: skip
