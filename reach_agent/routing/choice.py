"""The routing decision: filter → rank → choose, over one capability's index.

A capability's index keeps its members and a ranking (healthy members by score) that is
rebuilt only when something changed and at most every ``rank_refresh_ms``
(:mod:`reach_agent.routing.index`, which also applies the outlier and panic rules below); a
route walks the ranking from the top (:mod:`reach_agent.routing.filters`) and stops once it
has enough candidates, so its cost does not grow with the fleet. State is re-checked during
the walk, so an agent that just went ``suspect`` is skipped at once even before the next
rebuild. A sticky key goes to its heaviest member by rendezvous (highest random weight)
hashing of the key's slot over all members (:mod:`reach_agent.routing.hashing`), walking
down the weights past members that are not routable.

Outliers: healthy agents scoring below ``min_reach_score`` are ejected, but never more than
``max_eject_share`` of a capability's healthy agents at once (the best low scorers stay in).
Panic: when fewer than ``panic_threshold`` of a capability's non-draining agents are healthy,
the capability is in panic and nothing is ejected for its score: every healthy agent left is
routed rather than none. Suspects stay opt-in (``allow_suspect``). Slow start: a recovered
agent's weight is multiplied by ``slow_start_share`` for ``slow_start_s``, then ramps
linearly to 1 over another ``slow_start_s`` (weighted choice; p2c divides its expected
completion time by it).

:meth:`Chooser.pick` is the decision, the same for the broker (``reach_broker.core.routing``
answers ``<prefix>.route.<capability>`` with it) and for a caller routing from its route
tables.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Generic, TypeVar

from reach_agent.wire.errors import NoReachableAgent, Overloaded
from reach_agent.wire.schema import RouteRequest

from . import draws
from .filters import FILTERS, LOAD, NO_POLICY, Policy, Walk
from .index import CapabilityIndex
from .member import M, Member
from .rules import Rule
from .settings import Settings

D = TypeVar("D", bound=Member)

HEALTHY = "healthy"
SUSPECT = "suspect"


class Chooser(Generic[M]):
    """Chooses the agents of a route request from a capability's index."""

    def __init__(
        self,
        cfg: Settings,
        *,
        rng: random.Random | None = None,
        on_panic: Callable[[CapabilityIndex[M]], None] | None = None,
    ) -> None:
        self.cfg = cfg
        self.rng = rng or random.Random()
        self.on_panic = on_panic
        """Told of a capability whose index entered or left panic (``idx.panic`` says which)."""
        self.last_policy: Policy = NO_POLICY
        """The policy the last :meth:`pick` walked with (the explanation walks it again)."""
        self._last: tuple[RouteRequest | None, Rule | None, str | None, Walk] = (
            None, None, None, Walk(RouteRequest()))  # fmt: skip

    def pool_size(self, req: RouteRequest) -> int:
        """How many agents that pass the filters the walk gathers for the choice."""
        if self.cfg.choice == "ranked" and not req.sticky_key:
            return req.limit
        return req.limit * self.cfg.pool_factor

    def refresh(self, idx: CapabilityIndex[M], now: float) -> None:
        """Re-rank ``idx`` if due, as a route does (a panic change told)."""
        if idx.refresh(self.cfg, now) and self.on_panic is not None:
            self.on_panic(idx)

    def pick(
        self, idx: CapabilityIndex[M], req: RouteRequest, rule: Rule | None, now: float
    ) -> list[M]:
        """The agents chosen for ``req`` among ``idx``'s, best first, under the capability's
        route ``rule``. Raises Overloaded or NoReachableAgent (saying why)."""
        pool, walk = self.gather(idx, req, rule, now)
        if req.sticky_key:
            first = self._sticky(idx, req.sticky_key, pool, walk, now)
            rest = [r for r in pool if r is not first]
            return [first, *rest[: req.limit - 1]]
        return self.draw(pool, req.limit, now)

    def draw(self, pool: list[D], limit: int, now: float) -> list[D]:
        """``limit`` agents of ``pool`` (best ranked first) as ``choice`` says (any members:
        a broker draws once over its own agents and the other owners' shares together)."""
        cfg = self.cfg
        if cfg.choice == "weighted":
            return draws.weighted(pool, limit, now, cfg, self.rng)
        if cfg.choice == "p2c":
            return draws.p2c(pool, limit, now, cfg, self.rng)
        return pool[:limit]

    def gather(
        self, idx: CapabilityIndex[M], req: RouteRequest, rule: Rule | None, now: float
    ) -> tuple[list[M], Walk]:
        """The pool :meth:`pick` chooses from (the agents that pass the filters, best ranked
        first, up to :meth:`pool_size`) and the walk that gathered it. Raises Overloaded or
        NoReachableAgent (saying why) when nobody passes."""
        if not idx.members:
            raise NoReachableAgent(f"no agent has the capability {idx.name!r}")
        cfg = self.cfg
        if idx.refresh(cfg, now) and self.on_panic is not None:
            self.on_panic(idx)
        want = self.pool_size(req)
        watermark = cfg.load_watermark
        if rule is not None:
            arm, fallback = rule.arm(req)
        else:
            arm, fallback = req.canary, False
        # The last request's walk again when it is the same request object under the same
        # rule and arm (a broker's empty-body requests share one; a caller's retries do).
        last = self._last
        if last[0] is req and last[1] is rule and last[2] == arm:
            walk = walked = last[3]
        else:
            walk = walked = Walk(req, (rule, arm))
            self._last = (req, rule, arm, walk)
        pool: list[M] = walk.passing(walk, idx.ranked, HEALTHY, want, now, watermark)
        if not pool and arm is not None and fallback:
            arm = None  # the arm drawn has no agent left: the split's other arms serve
            walk = Walk(req, (rule, arm))
            pool = walk.passing(walk, idx.ranked, HEALTHY, want, now, watermark)
        if not pool and req.allow_suspect:
            pool = walk.passing(walk, idx.suspects, SUSPECT, want, now, watermark)
        self.last_policy = NO_POLICY if rule is None and arm is None else (rule, arm)
        if not pool:
            # Nothing passed: the same walks again, counting what kept each agent out.
            why: dict[str, int] = {}
            walked.counting(idx.ranked, HEALTHY, want, why, now, watermark)
            if walk is not walked:
                walk.counting(idx.ranked, HEALTHY, want, why, now, watermark)
            if req.allow_suspect:
                walk.counting(idx.suspects, SUSPECT, want, why, now, watermark)
            walked_n = len(idx.ranked) + (len(idx.suspects) if req.allow_suspect else 0)
            if why.get(LOAD):  # some pass every filter but are full: wait, not elsewhere
                raise Overloaded(self._nothing(idx, why, walked_n),
                                 retry_after_ms=idx.retry_after_ms())  # fmt: skip
            raise NoReachableAgent(self._nothing(idx, why, walked_n))
        return pool, walk

    def passing(
        self, recs: list[M], state: str, req: RouteRequest, now: float, policy: Policy = NO_POLICY
    ) -> list[M]:
        """Every agent of ``recs`` that passes the filters (the walk without a limit)."""
        walk = Walk(req, policy)
        passed: list[M] = walk.passing(walk, recs, state, len(recs), now, self.cfg.load_watermark)
        return passed

    def filtered_by(
        self, rec: M, state: str, req: RouteRequest, now: float, policy: Policy = NO_POLICY
    ) -> str | None:
        """The reason code of the first filter ``rec`` fails when the walk wants ``state``;
        None when it passes them all."""
        return Walk(req, policy).first_failed(rec, state, now, self.cfg.load_watermark)

    def weight(self, rec: M, now: float) -> float:
        """``rec``'s weight in the draw: score x free capacity x slow start."""
        return draws.weight(rec, now, self.cfg)

    def slow_start_factor(self, rec: M, now: float) -> float:
        """``slow_start_share`` for ``slow_start_s`` after recovery, then a linear ramp."""
        return draws.slow_start_factor(rec, now, self.cfg)

    def _nothing(self, idx: CapabilityIndex[M], why: dict[str, int], walked: int = 0) -> str:
        """Why nothing passed: the message of the refusal. ``walked``: the agents the walks
        looked at (the ranked healthy ones, and the suspects when allowed); the others of
        the capability are named by the last ranking's counts (below the minimum score, not
        healthy), so the parts add up to the total without a pass over the members."""
        capability, total = idx.name, len(idx.members)
        if idx.healthy == 0:
            states: dict[str, int] = {}
            for rec in idx.members.values():
                states[rec.state] = states.get(rec.state, 0) + 1
            detail = ", ".join(f"{n} {s}" for s, n in sorted(states.items()))
            if states.get("healthy"):  # healthy since the capability was last ranked
                return (f"none of the {total} agents with {capability!r} was healthy when it "
                        f"was last ranked (now {detail}: routed once it is ranked again, "
                        "[routing] rank_refresh_ms)")  # fmt: skip
            return f"none of the {total} agents with {capability!r} is healthy ({detail})"
        if not idx.ranked:
            return (
                f"all {idx.healthy} healthy agents with {capability!r} score below the "
                f"minimum {self.cfg.min_reach_score}"
            )
        parts = []
        if why.get(LOAD):
            parts.append(f"{why[LOAD]} at or above the load watermark {self.cfg.load_watermark}")
        # The filters' own codes, the state last (as it always said).
        for code in [f.code for f in FILTERS[1:] if f.code != LOAD] + [FILTERS[0].code]:
            if why.get(code):
                parts.append(f"{why[code]} filtered by {code}")
        if idx.ejected:
            parts.append(
                f"{idx.ejected} healthy below the minimum score {self.cfg.min_reach_score}"
            )
        unwalked = total - walked - idx.ejected
        if unwalked > 0:
            parts.append(f"{unwalked} not healthy")
        detail = "; ".join(parts) or "none passed the filter"
        return f"no reachable agent for {capability!r} among {total}: {detail}"

    def _sticky(
        self, idx: CapabilityIndex[M], key: str, pool: list[M], walk: Walk, now: float
    ) -> M:
        """The owner of ``key``: the member weighing most for it (rendezvous hashing) that is
        in the pool, or routable beyond it; the next heaviest when it is neither. A key the
        index's slot remembers costs a lookup (any key of a slot asked before)."""
        heaviest = idx.heaviest(key)
        for _, rec in heaviest:
            if self._owns(rec, pool, walk, now):
                return rec
        for rec in idx.by_weight(key)[len(heaviest) :]:
            if self._owns(rec, pool, walk, now):
                return rec
        return pool[0]

    def _owns(self, rec: M, pool: list[M], walk: Walk, now: float) -> bool:
        """Whether ``rec`` may take a sticky key: in the pool, or routable beyond its size
        (walked through the filters)."""
        if rec in pool:
            return True
        cfg = self.cfg
        return (
            rec.state == HEALTHY
            and rec.score >= cfg.min_reach_score
            and walk.first_failed(rec, HEALTHY, now, cfg.load_watermark) is None
        )
