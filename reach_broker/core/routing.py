"""Route = filter → score → choose, over per-capability candidate structures.

Each capability keeps its members and a ranking (healthy members by score) that is rebuilt
only when something changed and at most every ``rank_refresh_ms`` (:mod:`reach_broker.core.index`,
which also applies the outlier and panic rules below); a route request walks the
ranking from the top and stops once it has enough candidates, so its cost does not grow with
the fleet. State is re-checked during the walk, so an agent that just went `suspect` is
skipped at once even before the next rebuild. Sticky keys use a consistent-hash ring over all
members (rebuilt only when membership changes) and walk past members that are not routable.

Outliers: healthy agents scoring below ``min_reach_score`` are ejected, but never more than
``max_eject_share`` of a capability's healthy agents at once (the best low scorers stay in).
Panic: when fewer than ``panic_threshold`` of a capability's non-draining agents are healthy,
the capability is in panic — logged once on entering, ``reach_capability_panic{capability}``
set to 1 — and nothing is ejected for its score: every healthy agent left is routed rather
than none. Suspects stay opt-in (``allow_suspect``). Slow start: a recovered agent's weight
is multiplied by ``slow_start_share`` for ``slow_start_s``, then ramps linearly to 1 over
another ``slow_start_s`` (weighted choice; p2c divides its expected completion time by it).

:meth:`Router.choose` is the decision; :meth:`Router.route` turns it into ``Candidate``s and
:meth:`Router.route_reply` into the encoded reply the broker sends.
"""

from __future__ import annotations

import bisect
import logging
import random
from collections.abc import Callable, Iterable
from typing import cast

from reach_agent.wire.errors import NoReachableAgent, Overloaded
from reach_agent.wire.schema import Candidate, RouteReply, RouteRequest, encoder
from reach_broker.config import RoutingSection

from . import draws
from .index import CapabilityIndex, CapabilityIndexes, candidate, hash64
from .records import AgentRecord
from .rules import Rule, Rules

log = logging.getLogger(__name__)

Policy = tuple[Rule | None, str | None]
"""What a capability's route rule asks of one request: (the rule, the split arm it got)."""
NO_POLICY: Policy = (None, None)
_NO_PAIRS: frozenset[tuple[str, str]] = frozenset()
_NO_VALUES: frozenset[str] = frozenset()


class Router:
    """Answers route requests from the capability indexes a registry maintains."""

    def __init__(
        self,
        cfg: RoutingSection,
        indexes: CapabilityIndexes,
        subject_of: Callable[[str, str], str],
        *,
        inflight: Callable[[], int],
        capacity: Callable[[], int],
        on_panic: Callable[[str, bool], None] | None = None,
        rng: random.Random | None = None,
        rules: Rules | None = None,
    ) -> None:
        self.cfg = cfg
        self.indexes = indexes
        self.subject_of = subject_of
        """The task subject of (agent_id, capability)."""
        self.inflight = inflight
        """The fleet's reported in-flight tasks (kept by the registry)."""
        self.on_panic = on_panic
        """Called with (capability, in_panic) when a capability enters or leaves panic."""
        self.rng = rng or random.Random()
        self.capacity = capacity
        """The fleet's slots: Σ max_concurrency of the agents not offline (the registry's)."""
        self.rules = rules if rules is not None else Rules()
        """Each capability's route rule in force (:mod:`reach_broker.core.rules`)."""
        self.last_policy: Policy = NO_POLICY
        """The policy the last :meth:`choose` walked with (the explanation walks it again)."""

    def ceiling(self) -> int:
        """The fleet-wide in-flight ceiling: ``routing.inflight_ceiling`` when set, else
        ``inflight_share`` of the fleet's slots, so it grows and shrinks with the fleet."""
        fixed = self.cfg.inflight_ceiling
        return fixed if fixed is not None else int(self.cfg.inflight_share * self.capacity())

    def route(self, capability: str, req: RouteRequest, now: float) -> list[Candidate]:
        """Candidates for ``capability``, best first; raises NoReachableAgent with why."""
        _, chosen = self.choose(capability, req, now)
        subject_of = self.subject_of
        return [candidate(r, subject_of(r.agent_id, capability)) for r in chosen]

    def route_reply(
        self, capability: str, req: RouteRequest, now: float, generated_at_ms: int
    ) -> bytes:
        """:meth:`route` as the encoded ``RouteReply``: each candidate's JSON comes from its
        index (encoded when its score, load or state last changed), so a request encodes
        only the envelope. The same bytes as encoding ``RouteReply`` of :meth:`route`. The
        reply is the broker's answer, so its first candidate is counted as handed a task
        (``AgentRecord.handed_out``) unless the request is a ``peek``; :meth:`route` and
        :meth:`choose` only look."""
        idx, chosen = self.choose(capability, req, now)
        if not req.peek:  # the pick gets the task: count it until a heartbeat does
            chosen[0].handed_out(now)
        subject_of = self.subject_of
        raws = [idx.encoded(r, subject_of) for r in chosen]
        # msgspec writes a Raw as it is: the wire type, with candidates encoded beforehand.
        reply = RouteReply(capability=capability, candidates=cast(list[Candidate], raws),
                           generated_at_ms=generated_at_ms)  # fmt: skip
        return encoder.encode(reply)

    def choose(
        self, capability: str, req: RouteRequest, now: float
    ) -> tuple[CapabilityIndex, list[AgentRecord]]:
        """The routing decision: the index of ``capability`` and the agents chosen, best
        first. Raises Overloaded or NoReachableAgent (saying why)."""
        cfg = self.cfg
        inflight = self.inflight()
        ceiling = cfg.inflight_ceiling
        if ceiling is None:
            ceiling = int(cfg.inflight_share * self.capacity())
        if inflight > ceiling:
            raise Overloaded(
                f"fleet in-flight tasks {inflight} exceed the ceiling {ceiling}",
                retry_after_ms=cfg.overloaded_retry_after_ms,
            )
        idx = self.indexes.get(capability)
        if idx is None or not idx.members:
            raise NoReachableAgent(f"no agent has the capability {capability!r}")
        if idx.refresh(cfg, now):
            self._panic_changed(idx)
        limit = req.limit
        # pool_size(req), inline: the route path saves the call.
        want = limit if cfg.choice == "ranked" and not req.sticky_key else limit * cfg.pool_factor
        why: dict[str, int] = {}
        rule = self.rules.get(capability) if self.rules else None
        if rule is not None:
            arm, fallback = rule.arm(req)
        else:
            arm, fallback = req.canary, False
        pool = self._walk(idx.ranked, "healthy", req, want, why, now, rule, arm)
        if not pool and arm is not None and fallback:
            arm = None  # the arm drawn has no agent left: the split's other arms serve
            pool = self._walk(idx.ranked, "healthy", req, want, why, now, rule, arm)
        if not pool and req.allow_suspect:
            pool = self._walk(idx.suspects, "suspect", req, want, why, now, rule, arm)
        self.last_policy = NO_POLICY if rule is None and arm is None else (rule, arm)
        if not pool:
            if why.get("load"):  # some pass every filter but are full: wait, not elsewhere
                raise Overloaded(self._explain(capability, idx, why),
                                 retry_after_ms=idx.retry_after_ms())  # fmt: skip
            raise NoReachableAgent(self._explain(capability, idx, why))
        if req.sticky_key:
            first = self._sticky(idx, req, pool, now, (rule, arm))
            rest = [r for r in pool if r is not first]
            return idx, [first, *rest[: limit - 1]]
        if cfg.choice == "weighted":
            return idx, draws.weighted(pool, limit, now, self.cfg, self.rng)
        if cfg.choice == "p2c":
            return idx, draws.p2c(pool, limit, now, self.cfg, self.rng)
        return idx, pool[:limit]

    def refresh(self, idx: CapabilityIndex, now: float) -> None:
        """Re-rank ``idx`` if due, as a route request does (a panic change said, counted)."""
        if idx.refresh(self.cfg, now):
            self._panic_changed(idx)

    def pool_size(self, req: RouteRequest) -> int:
        """How many agents that pass the filters the walk gathers for the choice."""
        cfg = self.cfg
        if cfg.choice == "ranked" and not req.sticky_key:
            return req.limit
        return req.limit * cfg.pool_factor

    def passing(
        self,
        recs: list[AgentRecord],
        state: str,
        req: RouteRequest,
        now: float,
        policy: Policy = NO_POLICY,
    ) -> list[AgentRecord]:
        """Every agent of ``recs`` that passes the walk's filters (the walk without a limit)."""
        return self._walk(recs, state, req, len(recs), {}, now, *policy) if recs else []

    def filtered_by(
        self,
        rec: AgentRecord,
        state: str,
        req: RouteRequest,
        now: float,
        policy: Policy = NO_POLICY,
    ) -> str | None:
        """The reason code (:mod:`reach_broker.core.reasons`) of the first filter of the walk
        ``rec`` fails when the walk wants ``state``; None when it passes them all."""
        why: dict[str, int] = {}
        if self._walk((rec,), state, req, 1, why, now, *policy):
            return None
        return next(iter(why))

    def slow_start_share(self, capability: str, now: float) -> float:
        """The largest slow-start factor among the healthy agents of ``capability`` (1.0
        when none is ramping up, or none is known): how much of its usual load it may take."""
        idx = self.indexes.get(capability)
        if idx is None:
            return 1.0
        return max(
            (self.slow_start_factor(r, now) for r in idx.members.values() if r.state == "healthy"),
            default=1.0,
        )

    def _panic_changed(self, idx: CapabilityIndex) -> None:
        if idx.panic:
            log.warning(
                "route.panic capability=%s healthy=%d of %d (threshold %.0f%%): %s",
                idx.name, idx.healthy, len(idx.members), 100 * self.cfg.panic_threshold,
                "score ejection suspended, routing to every healthy agent left" if idx.healthy
                else "no healthy agent left to route to",
            )  # fmt: skip
        else:
            log.info("route.panic_over capability=%s healthy=%d of %d", idx.name,
                     idx.healthy, len(idx.members))  # fmt: skip
        if self.on_panic is not None:
            self.on_panic(idx.name, idx.panic)

    def _walk(
        self,
        ranked: Iterable[AgentRecord],
        state: str,
        req: RouteRequest,
        want: int,
        why: dict[str, int],
        now: float,
        rule: Rule | None = None,
        arm: str | None = None,
    ) -> list[AgentRecord]:
        # Load is what the broker believes now (AgentRecord.busy: the last report plus its
        # own hand-outs since); one that looks full gets a second look as of now, unless
        # that look already said how long it stays full (full_until).
        watermark = self.cfg.load_watermark
        exclude = req.exclude
        requires = req.requires
        min_context = req.min_context_tokens
        out: list[AgentRecord] = []
        # The policy of the capability's rule, prepared once per walk: the required tags
        # (as pairs: one C-level subset test per agent), the split's key, arm and values.
        required = _NO_PAIRS
        splitting = arm is not None
        tag: str | None = None  # None: the split is by version
        listed = _NO_VALUES
        if rule is not None:
            required = rule.required_for(req.tags)
            if rule.listed:
                splitting, tag, listed = True, rule.tag, rule.listed
        if (
            req.region is None
            and not req.tags
            and not exclude
            and not requires
            and (min_context is None)
        ):
            # The common request (no filters of its own): state, load and the rule only, no
            # bookkeeping. Should nothing pass, the full walk below runs to count why.
            if not required and not splitting:
                for rec in ranked:
                    if rec.state == state and (
                        rec.busy < watermark
                        or (rec.full_until <= now and rec.busy_at(now, watermark) < watermark)
                    ):
                        out.append(rec)
                        if len(out) >= want:
                            break
            else:
                for rec in ranked:
                    if rec.state != state:
                        continue
                    if required and not rec.tags.items() >= required:
                        continue
                    if splitting:
                        value = rec.version if tag is None else rec.tags.get(tag)
                        if (value != arm) if arm is not None else (value not in listed):
                            continue
                    if rec.busy >= watermark and (
                        rec.full_until > now or rec.busy_at(now, watermark) >= watermark
                    ):
                        continue
                    out.append(rec)
                    if len(out) >= want:
                        break
            if out:
                return out
        # Each filter counts the agents it keeps out under its reason code (the literals are
        # reasons.WALK_FILTERS, in that order: constants, not globals, on the route path).
        # The explanation asks this walk agent by agent (filtered_by), so a filter added
        # here is explained too once its code and sentence are registered.
        for rec in ranked:
            if rec.state != state:
                why["state"] = why.get("state", 0) + 1
                continue
            if req.region is not None and rec.region != req.region:
                why["region"] = why.get("region", 0) + 1
                continue
            if req.tags and any(rec.tags.get(k) != v for k, v in req.tags.items()):
                why["tags"] = why.get("tags", 0) + 1
                continue
            if required and not rec.tags.items() >= required:
                why["required"] = why.get("required", 0) + 1
                continue
            if splitting:
                value = rec.version if tag is None else rec.tags.get(tag)
                if (value != arm) if arm is not None else (value not in listed):
                    why["split"] = why.get("split", 0) + 1
                    continue
            if requires and not rec.permissions.issuperset(requires):
                why["requires"] = why.get("requires", 0) + 1
                continue
            if min_context is not None and rec.headroom < min_context:
                why["context"] = why.get("context", 0) + 1
                continue
            if exclude and rec.agent_id in exclude:
                why["exclude"] = why.get("exclude", 0) + 1
                continue
            if rec.busy >= watermark and (  # checked last: why["load"] means "only full"
                rec.full_until > now or rec.busy_at(now, watermark) >= watermark
            ):
                why["load"] = why.get("load", 0) + 1
                continue
            out.append(rec)
            if len(out) >= want:
                break
        return out

    def _explain(self, capability: str, idx: CapabilityIndex, why: dict[str, int]) -> str:
        total = len(idx.members)
        if idx.healthy == 0:
            states: dict[str, int] = {}
            for rec in idx.members.values():
                states[rec.state] = states.get(rec.state, 0) + 1
            detail = ", ".join(f"{n} {s}" for s, n in sorted(states.items()))
            return f"none of the {total} agents with {capability!r} is healthy ({detail})"
        if not idx.ranked:
            return (
                f"all {idx.healthy} healthy agents with {capability!r} score below the "
                f"minimum {self.cfg.min_reach_score}"
            )
        parts = []
        if why.get("load"):
            parts.append(f"{why['load']} at or above the load watermark {self.cfg.load_watermark}")
        for key in ("region", "tags", "required", "split", "requires", "context", "exclude",
                    "state"):  # fmt: skip
            if why.get(key):
                parts.append(f"{why[key]} filtered by {key}")
        detail = "; ".join(parts) or "none passed the filter"
        return f"no reachable agent for {capability!r} among {total}: {detail}"

    def weight(self, rec: AgentRecord, now: float) -> float:
        """``rec``'s weight in the draw (AgentRecord.set_score) times its slow-start factor."""
        return rec.weight * draws.slow_start_factor(rec, now, self.cfg)

    def slow_start_factor(self, rec: AgentRecord, now: float) -> float:
        """``slow_start_share`` for ``slow_start_s`` after recovery, then a linear ramp."""
        return draws.slow_start_factor(rec, now, self.cfg)

    def _sticky(
        self,
        idx: CapabilityIndex,
        req: RouteRequest,
        pool: list[AgentRecord],
        now: float,
        policy: Policy,
    ) -> AgentRecord:
        keys, owners = idx.ring(self.cfg.vnodes)
        assert req.sticky_key is not None
        start = bisect.bisect(keys, hash64(req.sticky_key))
        eligible = {r.agent_id for r in pool}
        n = len(keys)
        for step in range(n):
            owner = owners[(start + step) % n]
            if owner.agent_id in eligible:
                return owner
            # A routable owner beyond the pool's size still wins: walk it through filters.
            if (
                owner.state == "healthy"
                and owner.score >= self.cfg.min_reach_score
                and self._walk([owner], "healthy", req, 1, {}, now, *policy)
            ):
                return owner
        return pool[0]
