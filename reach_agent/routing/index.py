"""The capability indexes: per capability, its agents and a cached ranking.

Its owner (the broker's registry, a caller's route tables) tells an index what changed
(:meth:`CapabilityIndex.add`, ``remove``, ``state_changed``, ``score_changed``); the router
asks it to :meth:`~CapabilityIndex.refresh` before a walk, which re-ranks only when something
changed and at most every ``rank_refresh_ms`` per :data:`RANK_MEMBERS` members (score-only
changes: every ``REORDER_FACTOR`` x ``rank_refresh_ms``, or that, whichever is longer).
Ranking applies the outlier and panic rules of :mod:`reach_agent.routing.choice`. Sticky
keys: each member carries its id's hash (:mod:`reach_agent.routing.hashing`) and each index
the heaviest members of the slots asked (at most :data:`~reach_agent.routing.hashing.SLOTS`
of them).
"""

from __future__ import annotations

import heapq
from operator import attrgetter
from typing import Any, Generic

from .hashing import (
    NEVER,
    SLOT_BITS,
    SLOT_HASHES,
    SLOT_LANES,
    SLOTS,
    Lanes,
    hash64,
    rendezvous,
)
from .member import M, Member
from .settings import Settings

REORDER_FACTOR = 20
"""Score-only changes (every heartbeat moves load) re-rank at most every 20 x rank_refresh_ms:
a sort per capability per heartbeat burst costs O(n log n) and the walk re-checks state and
load anyway, so a ranking a second old routes the same agents."""

RANK_MEMBERS = 500
"""A ranking is a sort of every member (O(n log n)): 0.9 ms at 1,000 members, 6.4 ms at
5,000, 44 ms at 20,000, 88 ms at 35,000 (in process, best of 5). Re-ranked every
``rank_refresh_ms`` whatever its size, a big capability that keeps changing took the loop
over: at 100,000 agents over 4 brokers (a capability of ~20,000 merged from the shares), a
capability's owner spent 65 % of its CPU re-ranking (py-spy) and left route requests
unanswered for seconds. So the wait between two rankings grows with the members:
``rank_refresh_ms`` for every ``RANK_MEMBERS`` of them (50 ms up to 500 members, 2 s at
20,000), which keeps a ranked capability's re-ranking to about 2 % of the loop at any size.
The walk reads every member's state and load as they are now, so a ranking that old routes
no agent that has left or stopped; an agent healthy since waits for it (``unranked``)."""

STICKY_DEPTH = 4
"""An index remembers, for each sticky-key slot asked (:data:`SLOTS` at most, so O(SLOTS x
STICKY_DEPTH) per capability whatever its size), its ``STICKY_DEPTH`` heaviest members: any
key of a slot asked before costs a lookup, also when its heaviest member is full for the
moment. A member joining or leaving is weighed for every slot at once (4,096 weights by a few
big-integer operations, :meth:`~reach_agent.routing.hashing.Lanes.at_least`, against each
slot's floor) and only the slots it enters or was listed in are walked; a slot that lost a
listed member is weighed again when next asked (every member once). A slot never asked is
weighed when first asked."""

RETRY_AFTER_MIN_MS = 10
RETRY_AFTER_MAX_MS = 1000
RETRY_AFTER_DEFAULT_MS = 100
"""The retry-after hint of an OVERLOADED reply: the capability's median task time (a slot
is likely free by then), within these bounds; the default when no task time is known. A
fleet over its in-flight ceiling answers the maximum."""


def _weight(pair: tuple[int, Any]) -> int:
    return pair[0]  # tuples of equal weight are never compared further (members are not)


def by_score(rec: Member) -> tuple[float, int, str]:
    """Best score first; among equal scores the larger context headroom (then the id)."""
    return (-rec.score, -rec.headroom, rec.agent_id)


_ID, _HEADROOM, _SCORE = attrgetter("agent_id"), attrgetter("headroom"), attrgetter("score")


def rank(recs: list[M]) -> None:
    """Sort ``recs`` in place as ``key=by_score`` does, by three stable sorts (the id, then
    the headroom, then the score, each keeping the order of the one before among equals):
    no key tuple made per member. 20,000 members: 6.7 ms against 9.3 ms (best of 5, in
    process); a ranking is a sort of every healthy member of the capability."""
    recs.sort(key=_ID)
    recs.sort(key=_HEADROOM, reverse=True)
    recs.sort(key=_SCORE, reverse=True)


class CapabilityIndex(Generic[M]):
    """The agents of one capability, with a cached ranking."""

    __slots__ = (
        "_built_at",
        "_dirty",
        "_floors",
        "_floors_packed",
        "_lanes",
        "_reorder",
        "ejected",
        "healthy",
        "median_task_ms",
        "members",
        "name",
        "panic",
        "ranked",
        "replies",
        "slots",
        "suspects",
        "weighed",
    )

    def __init__(self, name: str) -> None:
        self.name = name
        self.members: dict[str, M] = {}
        self.ranked: list[M] = []  # eligible healthy, best first
        self.suspects: list[M] = []
        self.healthy = 0
        self.ejected = 0
        self.panic = False
        self.median_task_ms: float | None = None
        self._dirty = True  # membership or a state changed: re-rank within rank_refresh_ms
        self._reorder = False  # only scores changed: re-rank within REORDER_FACTOR x that
        self._built_at = float("-inf")
        self._lanes: tuple[Lanes, list[M]] | None = None
        """Every member's hash packed for weighing them all at once (None: pack again)."""
        self.slots: dict[int, list[tuple[int, M]]] = {}
        """Sticky-key slots asked (:data:`SLOTS` at most): the slot's heaviest members with
        their weights, heaviest first; :data:`STICKY_DEPTH` of them, or every member when
        there are fewer, or fewer when some left (the heaviest remaining, weighed again
        when next asked)."""
        self._floors: bytearray | None = None
        """Per slot (16 bytes, little-endian, as :class:`Lanes` packs), the least weight a
        member listed in it can have: the lightest listed's, 0 when every member is listed,
        :data:`NEVER` for a slot not remembered (None: no slot remembered yet)."""
        self._floors_packed: int | None = None  # _floors as one integer (None: pack again)
        self.weighed = 0
        """Weights computed for sticky keys so far (what a lookup, a join, a refill cost)."""
        self.replies: dict[str, Any] = {}
        """Kept by whoever answers routes from this index (the broker: each member's encoded
        candidate); a member that leaves leaves it too."""

    # --- what the registry tells it ----------------------------------------------------------

    def add(self, rec: M) -> None:
        listed_all = len(self.members)  # a slot listing that many lists every member
        self.members[rec.agent_id] = rec
        self._dirty = True
        self._lanes = None
        if not self.slots:
            return
        # The slots remembered stay right: the newcomer joins those it outweighs (found among
        # every slot at once: only those are walked).
        h = rec.hrw
        for slot in SLOT_LANES.at_least(h, self._packed_floors()):
            owners = self.slots[slot]
            w = rendezvous(h, SLOT_HASHES[slot])
            if w > owners[-1][0] or len(owners) == listed_all:
                i = len(owners)
                while i and owners[i - 1][0] < w:  # after those weighing as much (by_weight)
                    i -= 1
                owners.insert(i, (w, rec))
                del owners[STICKY_DEPTH:]
            self._floor(slot, owners)
        self.weighed += SLOTS

    def remove(self, agent_id: str) -> None:
        rec = self.members.pop(agent_id, None)
        if rec is not None:
            self._dirty = True
            self._lanes = None
            self.replies.pop(agent_id, None)
            if not self.slots:
                return
            # Struck from the slots it was among the heaviest of (those it weighs at least
            # their floor for: found at once); the others stay right.
            for slot in SLOT_LANES.at_least(rec.hrw, self._packed_floors()):
                owners = self.slots[slot]
                for i, (_, r) in enumerate(owners):
                    if r is rec:
                        del owners[i]
                        break
                if owners:
                    self._floor(slot, owners)
                else:
                    del self.slots[slot]
                    self._floor(slot, None)

    def _floor(self, slot: int, owners: list[tuple[int, M]] | None) -> None:
        """Set ``slot``'s floor from its listing (None: not remembered)."""
        if self._floors is None:
            self._floors = bytearray(NEVER.to_bytes(16, "little") * SLOTS)
        if owners is None:
            floor = NEVER
        else:
            floor = 0 if len(owners) == len(self.members) else owners[-1][0]
        self._floors[16 * slot : 16 * slot + 16] = floor.to_bytes(16, "little")
        self._floors_packed = None

    def _packed_floors(self) -> int:
        packed = self._floors_packed
        if packed is None:
            packed = self._floors_packed = int.from_bytes(self._floors or b"", "little")
        return packed

    def state_changed(self) -> None:
        """A member's state (or announce) changed: re-rank soon."""
        self._dirty = True

    def heaviest(self, key: str) -> list[tuple[int, M]]:
        """The :data:`STICKY_DEPTH` members weighing most for the sticky ``key`` (rendezvous
        hashing of its slot), heaviest first, with their weights: a lookup in its slot, kept
        right as members come and go; the slot is weighed (every member once) only when
        first asked or after one of its heaviest left."""
        slot = hash64(key) >> (64 - SLOT_BITS)
        owners = self.slots.get(slot)
        if owners is not None and len(owners) >= min(STICKY_DEPTH, len(self.members)):
            return owners
        k = SLOT_HASHES[slot]
        if self._lanes is None:  # once per membership change that a slot's weighing follows
            members = list(self.members.values())
            self._lanes = (Lanes([r.hrw for r in members]), members)
        lanes, members = self._lanes
        weights = lanes.weights(k)
        self.weighed += len(weights)
        top = heapq.nlargest(STICKY_DEPTH, weights)
        if len(set(top)) == len(top):
            owners = [(w, members[weights.index(w)]) for w in top]
        else:  # two members weigh the same (1 in 2^64): the slow way, the same answer
            order = sorted(range(len(members)), key=weights.__getitem__, reverse=True)
            owners = [(weights[i], members[i]) for i in order[:STICKY_DEPTH]]
        if owners:
            self.slots[slot] = owners
            self._floor(slot, owners)
        return owners

    def by_weight(self, key: str) -> list[M]:
        """Every member, heaviest first for the sticky ``key`` (its slot's hash)."""
        k = SLOT_HASHES[hash64(key) >> (64 - SLOT_BITS)]
        return sorted(self.members.values(), key=lambda r: rendezvous(r.hrw, k), reverse=True)

    def score_changed(self) -> None:
        """Only a member's score moved: re-rank on the slower cadence."""
        self._reorder = True

    # --- what the router asks ----------------------------------------------------------------

    def refresh(self, cfg: Settings, now: float) -> bool:
        """Re-rank if due; True when that moved the capability into or out of panic."""
        age = now - self._built_at
        refresh = cfg.rank_refresh_ms / 1000.0
        n = len(self.members)
        every = refresh if n <= RANK_MEMBERS else refresh * n / RANK_MEMBERS
        if (self._dirty and age >= every) or (
            self._reorder and age >= max(REORDER_FACTOR * refresh, every)
        ):
            was_panic = self.panic
            self.rebuild(cfg, now)
            return self.panic != was_panic
        return False

    def rebuild(self, cfg: Settings, now: float) -> None:
        """Re-rank members; keep at most ``max_eject_share`` of healthy ones out for score."""
        healthy = [r for r in self.members.values() if r.state == "healthy"]
        rank(healthy)
        active = sum(1 for r in self.members.values() if r.state != "draining")
        self.healthy = len(healthy)
        # Panic: too few healthy among the agents that are meant to serve (draining ones
        # have said goodbye). Then nothing is ejected for its score: route to what is left.
        self.panic = active > 0 and self.healthy < cfg.panic_threshold * active
        min_score = cfg.min_reach_score
        eligible = [r for r in healthy if r.score >= min_score]
        cap = 0 if self.panic else int(cfg.max_eject_share * len(healthy))
        if len(healthy) - len(eligible) > cap:
            # Too many would be ejected at once: keep the best of the low scorers in.
            eligible = healthy[: len(healthy) - cap]
        self.ranked = eligible
        self.ejected = len(healthy) - len(eligible)
        suspects = [r for r in self.members.values() if r.state == "suspect"]
        rank(suspects)
        self.suspects = suspects
        self.median_task_ms = self.median(healthy)
        self._dirty = False
        self._reorder = False
        self._built_at = now

    def median(self, healthy: list[M] | None = None) -> float | None:
        """The capability's median task time: the lower median of the healthy members' task
        EWMAs (with two agents the fast one sets the bar for the slow one). When none of them
        has one, the suspects' instead: agents restored from the snapshot at a cold start (a
        broker's own, alone) and not yet heard from carry their history there, so the first
        heartbeats after such a restart are judged against the fleet's usual time, not
        against the bare tolerance floor."""
        if healthy is None:
            healthy = [r for r in self.members.values() if r.state == "healthy"]
        durations = sorted(
            r.stats.task_ewma_ms for r in healthy if r.stats.task_ewma_ms is not None
        )
        if not durations:
            durations = sorted(
                r.stats.task_ewma_ms
                for r in self.members.values()
                if r.state == "suspect" and r.stats.task_ewma_ms is not None
            )
        return durations[(len(durations) - 1) // 2] if durations else None

    def retry_after_ms(self) -> int:
        """How long a caller refused because every candidate is full should wait before
        asking again (``retry_after_ms`` of OVERLOADED): the median task time, bounded."""
        ms = self.median_task_ms
        if ms is None:
            return RETRY_AFTER_DEFAULT_MS
        return min(max(round(ms), RETRY_AFTER_MIN_MS), RETRY_AFTER_MAX_MS)


class CapabilityIndexes(dict[str, CapabilityIndex[M]]):
    """Every capability's index, by name: kept by its owner (the registry, a caller's
    tables), read by the router.

    A ``dict`` so the route path's lookups stay plain dict lookups; the owner changes it
    only through the methods below, which keep empty capabilities out.
    """

    def add(self, rec: M) -> None:
        """``rec`` joins the index of each of its capabilities."""
        for cap in rec.capabilities:
            self._index(cap).add(rec)

    def discard(self, rec: M) -> None:
        """``rec`` leaves every index it is in."""
        for cap in rec.capabilities:
            self._unindex(cap, rec.agent_id)

    def recapability(self, rec: M, old: tuple[str, ...]) -> None:
        """``rec`` re-announced: it had the capabilities ``old``, now ``rec.capabilities``."""
        new = set(rec.capabilities)
        for cap in set(old) - new:
            self._unindex(cap, rec.agent_id)
        for cap in new - set(old):
            self._index(cap).add(rec)

    def state_changed(self, rec: M) -> None:
        """``rec``'s state (or announce) changed: each of its indexes re-ranks soon."""
        for cap in rec.capabilities:
            idx = self.get(cap)
            if idx is not None:
                idx._dirty = True  # CapabilityIndex.state_changed, inline (same module)

    def score_changed(self, rec: M) -> None:
        """Only ``rec``'s score moved (most heartbeats): re-rank on the slower cadence."""
        for cap in rec.capabilities:
            idx = self.get(cap)
            if idx is not None:
                idx._reorder = True  # CapabilityIndex.score_changed, inline (same module)

    def update_medians(self) -> None:
        """Every capability's median task time now, without re-ranking (after a restore)."""
        for idx in self.values():
            idx.median_task_ms = idx.median()

    def peer_task_ms(self, rec: M) -> float | None:
        """Median task duration of the agent's (first) capability, as of the last ranking."""
        if not rec.capabilities:
            return None
        idx = self.get(rec.capabilities[0])
        return idx.median_task_ms if idx else None

    def _index(self, cap: str) -> CapabilityIndex[M]:
        idx = self.get(cap)
        if idx is None:
            idx = CapabilityIndex(cap)
            self[cap] = idx
        return idx

    def _unindex(self, cap: str, agent_id: str) -> None:
        idx = self.get(cap)
        if idx is not None:
            idx.remove(agent_id)
            if not idx.members:
                del self[cap]
