"""The broker's answer to a route request: the fleet's in-flight ceiling, then the routing
decision every router makes (:class:`reach_agent.routing.choice.Chooser`) over the
registry's capability indexes, then the encoded reply with its pick counted as handed a task.

A capability that enters panic is logged once on entering (and on leaving), and
``on_panic`` is told (the broker sets ``reach_capability_panic{capability}``).

With several brokers each holds the agents of the partitions it owns, and ``foreign`` gives
the other owners' shares of a capability's table (:mod:`reach_broker.service.shares`):
:meth:`Router.route_reply` then chooses from both (:meth:`Router.merged`): the pools each
would draw from (the registry's index, the table's), an agent in both taken from the registry
(a broker that ingests an agent has its own word on it, as fresh as its owner's, and counts
its hand-outs there; a share of an owner that just died stops moving), ranked together, then
one draw (at most twice the pool: no work that grows with the fleet). Without ``foreign``,
or while it has nothing, a route is what it always was.
:meth:`Router.choose` is the decision; :meth:`Router.route` turns it into ``Candidate``s and
:meth:`Router.route_reply` into the encoded reply the broker sends.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable
from typing import Any

import msgspec

from reach_agent.routing.choice import Chooser
from reach_agent.routing.hashing import rendezvous, slot_hash
from reach_agent.routing.index import CapabilityIndex, CapabilityIndexes, by_score
from reach_agent.routing.member import Member
from reach_agent.routing.rules import Rules
from reach_agent.routing.table import RouteTable, TableMember
from reach_agent.wire.errors import NoReachableAgent, Overloaded
from reach_agent.wire.schema import (
    AgentState,
    Announce,
    Candidate,
    RouteReply,
    RouteRequest,
    encoder,
)
from reach_broker.config import RoutingSection

from .records import AgentRecord

log = logging.getLogger(__name__)

Encoded = tuple[float, float, AgentState, Announce, msgspec.Raw]
"""A member's encoded candidate and the (score, load, state, announce) it was encoded from."""


class Router(Chooser[AgentRecord]):
    """Answers route requests from the capability indexes a registry maintains."""

    def __init__(
        self,
        cfg: RoutingSection,
        indexes: CapabilityIndexes[AgentRecord],
        subject_of: Callable[[str, str], str],
        *,
        inflight: Callable[[], int],
        capacity: Callable[[], int],
        on_panic: Callable[[str, bool], None] | None = None,
        rng: random.Random | None = None,
        rules: Rules | None = None,
        foreign: Callable[[str], RouteTable | None] | None = None,
    ) -> None:
        super().__init__(cfg, rng=rng, on_panic=self._panic_changed)
        self.foreign = foreign
        """The other owners' shares of a capability's table (None: this broker's registry
        is the whole fleet)."""
        self.shares_chooser: Chooser[TableMember] = Chooser(cfg, rng=self.rng)
        """The decision over a followed table (its own walk cache)."""
        self.cfg: RoutingSection = cfg
        self.indexes = indexes
        self.subject_of = subject_of
        """The task subject of (agent_id, capability)."""
        self.inflight = inflight
        """The fleet's reported in-flight tasks (kept by the registry)."""
        self.panic_changed = on_panic
        """Called with (capability, in_panic) when a capability enters or leaves panic."""
        self.capacity = capacity
        """The fleet's slots: Σ max_concurrency of the agents not offline (the registry's)."""
        self.rules = rules if rules is not None else Rules()
        """Each capability's route rule in force (:mod:`reach_agent.routing.rules`)."""

    def ceiling(self) -> int:
        """The fleet-wide in-flight ceiling: ``routing.inflight_ceiling`` when set, else
        ``inflight_share`` of the fleet's slots, so it grows and shrinks with the fleet."""
        fixed = self.cfg.inflight_ceiling
        return fixed if fixed is not None else int(self.cfg.inflight_share * self.capacity())

    def route(self, capability: str, req: RouteRequest, now: float) -> list[Candidate]:
        """Candidates for ``capability``, best first; raises NoReachableAgent with why."""
        _, chosen = self.choose(capability, req, now)
        subject_of = self.subject_of
        return [r.candidate(subject_of(r.agent_id, capability)) for r in chosen]

    def route_reply(
        self, capability: str, req: RouteRequest, now: float, generated_at_ms: int
    ) -> bytes:
        """:meth:`route` as the encoded ``RouteReply``: each candidate's JSON is kept with
        its index (encoded when its score, load or state last changed), so a request encodes
        only the envelope. The same bytes as encoding ``RouteReply`` of :meth:`route`. The
        reply is the broker's answer, so its first candidate is counted as handed a task
        (``AgentRecord.handed_out``) unless the request is a ``peek``; :meth:`route` and
        :meth:`choose` only look."""
        table = self.foreign(capability) if self.foreign is not None else None
        if table is not None:
            return self._merged_reply(capability, req, now, generated_at_ms, table)
        idx, chosen = self.choose(capability, req, now)
        if not req.peek:  # the pick gets the task: count it until a heartbeat does
            chosen[0].handed_out(now)
        raws: Any = [self.encoded(idx, r) for r in chosen]
        # msgspec writes a Raw as it is: the wire type, with candidates encoded beforehand.
        reply = RouteReply(capability=capability, candidates=raws,
                           generated_at_ms=generated_at_ms)  # fmt: skip
        return encoder.encode(reply)

    def _merged_reply(self, capability: str, req: RouteRequest, now: float,
                      generated_at_ms: int, table: RouteTable) -> bytes:  # fmt: skip
        """:meth:`route_reply` over this broker's agents and the other owners' shares."""
        chosen = self.merged(capability, req, now, table)
        if not req.peek:
            chosen[0].handed_out(now)
        idx = self.indexes.get(capability)
        raws: Any = [
            self.encoded(idx, r) if idx is not None and isinstance(r, AgentRecord)
            else self._shared_encoded(table.index, r)
            for r in chosen
        ]  # fmt: skip
        reply = RouteReply(capability=capability, candidates=raws,
                           generated_at_ms=generated_at_ms)  # fmt: skip
        return encoder.encode(reply)

    def _shared_encoded(self, idx: CapabilityIndex[TableMember], m: Member) -> msgspec.Raw:
        """A followed share's member as its JSON ``Candidate``, encoded again only when its
        score, load, state or entry changed (as :meth:`encoded` for the registry's)."""
        entry = m.entry if isinstance(m, TableMember) else None
        hit = idx.replies.get(m.agent_id)
        if hit is not None and hit[0] == m.score and hit[1] == m.load and hit[2] == m.state \
                and hit[3] is entry:  # fmt: skip
            raw: msgspec.Raw = hit[4]
            return raw
        raw = msgspec.Raw(encoder.encode(m.candidate(self.subject_of(m.agent_id, idx.name))))
        idx.replies[m.agent_id] = (m.score, m.load, m.state, entry, raw)
        return raw

    def merged(
        self, capability: str, req: RouteRequest, now: float, table: RouteTable
    ) -> list[Member]:
        """The routing decision over this broker's agents and ``table`` (the other owners'
        shares): the pools each would draw from (an agent in both taken from the registry,
        which ingests it), ranked together, then one draw over the union (a sticky key: each
        side's owner, the highest random weight of the two first). Raises Overloaded or
        NoReachableAgent when neither has an agent to give (their reasons joined)."""
        self._check_ceiling()
        rule = self.rules.get(capability) if self.rules else None
        failures: list[tuple[str, NoReachableAgent | Overloaded]] = []
        sticky = bool(req.sticky_key)
        shares = self.shares_chooser
        own: list[AgentRecord] = []
        idx = self.indexes.get(capability)
        if idx is not None:
            try:
                own = self.pick(idx, req, rule, now) if sticky else self.gather(
                    idx, req, rule, now)[0]  # fmt: skip
            except (NoReachableAgent, Overloaded) as exc:
                failures.append(("this broker's partitions", exc))
        theirs: list[TableMember] = []
        try:
            theirs = (shares.pick(table.index, req, rule, now) if sticky
                      else shares.gather(table.index, req, rule, now)[0])  # fmt: skip
            if idx is not None:  # an agent this broker ingests itself: its own record
                held = idx.members
                theirs = [m for m in theirs if m.agent_id not in held]
        except (NoReachableAgent, Overloaded) as exc:
            failures.append(("the other owners' partitions", exc))
        if not own and not theirs:
            full = [e for _, e in failures if isinstance(e, Overloaded)]
            if full:
                raise full[0]
            reasons = "; ".join(f"{where}: {e.message}" for where, e in failures)
            raise NoReachableAgent(reasons or f"no agent has the capability {capability!r}")
        limit = req.limit
        pool: list[Member] = [*own, *theirs]
        if sticky:
            if own and theirs:  # the heavier of the two sides' owners: the key's owner
                k = slot_hash(req.sticky_key or "")
                first = max((own[0], theirs[0]), key=lambda m: rendezvous(m.hrw, k))
            else:
                first = pool[0]
            rest = sorted((m for m in pool if m is not first), key=by_score)
            return [first, *rest[: limit - 1]]
        if own and theirs:
            pool.sort(key=by_score)
            del pool[self.pool_size(req) :]
        return self.draw(pool, limit, now)

    def _check_ceiling(self) -> None:
        inflight = self.inflight()
        ceiling = self.ceiling()
        if inflight > ceiling:
            raise Overloaded(
                f"fleet in-flight tasks {inflight} exceed the ceiling {ceiling}",
                retry_after_ms=self.cfg.overloaded_retry_after_ms,
            )

    def choose(
        self, capability: str, req: RouteRequest, now: float
    ) -> tuple[CapabilityIndex[AgentRecord], list[AgentRecord]]:
        """The routing decision: the index of ``capability`` and the agents chosen, best
        first. Raises Overloaded (over the in-flight ceiling, or all full) or
        NoReachableAgent (saying why)."""
        self._check_ceiling()
        idx = self.indexes.get(capability)
        if idx is None:
            raise NoReachableAgent(f"no agent has the capability {capability!r}")
        rule = self.rules.get(capability) if self.rules else None
        return idx, self.pick(idx, req, rule, now)

    def encoded(self, idx: CapabilityIndex[AgentRecord], rec: AgentRecord) -> msgspec.Raw:
        """``rec`` as ``idx``'s JSON ``Candidate``, encoded again only when its score, load,
        state or announce changed since the last time it was routed."""
        hit: Encoded | None = idx.replies.get(rec.agent_id)
        if (
            hit is not None
            and hit[0] == rec.score
            and hit[1] == rec.load
            and hit[2] == rec.state
            and hit[3] is rec.announce
        ):
            return hit[4]
        raw = msgspec.Raw(encoder.encode(rec.candidate(self.subject_of(rec.agent_id, idx.name))))
        idx.replies[rec.agent_id] = (rec.score, rec.load, rec.state, rec.announce, raw)
        return raw

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

    def _panic_changed(self, idx: CapabilityIndex[AgentRecord]) -> None:
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
        if self.panic_changed is not None:
            self.panic_changed(idx.name, idx.panic)
