"""Sticky keys by rendezvous hashing of their slot (reach_agent.routing.hashing, index, choice),
pure: a key keeps its agent, only the keys of an agent that leaves move and only those a
newcomer outweighs go to it, keys spread evenly, a key whose agent cannot take it goes to its
next heaviest, and a key of a slot asked before costs no weighing whatever the members."""

from __future__ import annotations

from collections import Counter

from reach_agent.routing.choice import Chooser
from reach_agent.routing.hashing import (
    M64,
    NEVER,
    SLOT_HASHES,
    SLOTS,
    Lanes,
    hash64,
    rendezvous,
    slot_hash,
    slot_of,
)
from reach_agent.routing.index import STICKY_DEPTH, CapabilityIndex
from reach_agent.routing.member import Member, TaskStats
from reach_agent.wire.schema import RouteRequest
from reach_broker.config import RoutingSection

CFG = RoutingSection(rank_refresh_ms=0)
KEYS = [f"user-{i}" for i in range(5000)]


def index(n: int) -> CapabilityIndex[Member]:
    idx: CapabilityIndex[Member] = CapabilityIndex("cap")
    for i in range(n):
        idx.add(Member(f"agent-{i}", 10, TaskStats()))
    return idx


def owners(idx: CapabilityIndex[Member], keys: list[str] = KEYS) -> dict[str, str]:
    chooser: Chooser[Member] = Chooser(CFG)
    return {
        k: chooser.pick(idx, RouteRequest(sticky_key=k, limit=1), None, 1.0)[0].agent_id
        for k in keys
    }


def test_a_key_keeps_its_agent_and_it_is_the_heaviest() -> None:
    idx = index(50)
    first = owners(idx)
    assert owners(idx) == first  # asked again (remembered or not): the same agent
    idx.slots.clear()
    assert owners(idx) == first
    for k in KEYS[:200]:
        heaviest = max(
            idx.members.values(), key=lambda r: rendezvous(hash64(r.agent_id), slot_hash(k))
        )
        assert first[k] == heaviest.agent_id
        assert [r.agent_id for _, r in idx.heaviest(k)] == [
            r.agent_id for r in idx.by_weight(k)[:STICKY_DEPTH]
        ]


def brute_owner(members: list[str], key: str) -> str:
    """The key's owner by the protocol's definition, from the ids alone."""
    return max(members, key=lambda a: rendezvous(hash64(a), hash64(str(hash64(key) >> 52))))


def test_only_the_keys_of_an_agent_that_leaves_move_and_a_newcomer_only_takes_keys() -> None:
    idx = index(50)
    ids = [f"agent-{i}" for i in range(50)]
    before = owners(idx)
    assert before == {k: brute_owner(ids, k) for k in KEYS}
    idx.remove("agent-7")
    after = owners(idx)
    moved = {k for k in KEYS if before[k] != after[k]}
    assert moved == {k for k in KEYS if before[k] == "agent-7"}
    assert len(moved) == 115  # its share of 5000 keys (about 1/50): the slots it topped
    ids.remove("agent-7")
    assert after == {k: brute_owner(ids, k) for k in KEYS}
    idx.add(Member("agent-new", 10, TaskStats()))
    again = owners(idx)
    taken = {k for k in KEYS if after[k] != again[k]}
    assert all(again[k] == "agent-new" for k in taken)
    assert len(taken) == 94  # the keys of the slots it now tops, none other
    assert again == {k: brute_owner([*ids, "agent-new"], k) for k in KEYS}


def test_keys_spread_evenly_over_the_agents() -> None:
    counts = Counter(owners(index(20), [f"k{i}" for i in range(20_000)]).values())
    assert len(counts) == 20
    assert min(counts.values()) >= 800 and max(counts.values()) <= 1200  # 1000 each, ±20 %


def test_a_key_whose_agent_is_not_routable_goes_to_its_next_heaviest_and_comes_back() -> None:
    idx = index(10)
    key = "session-42"
    order = idx.by_weight(key)
    assert owners(idx, [key])[key] == order[0].agent_id
    order[0].state = "suspect"
    idx.state_changed()
    assert owners(idx, [key])[key] == order[1].agent_id
    order[1].busy = order[1].load = 1.0  # full: the next one
    order[1].active = 10
    assert owners(idx, [key])[key] == order[2].agent_id
    for rec in order[:STICKY_DEPTH]:
        rec.state = "suspect"
    idx.state_changed()
    assert owners(idx, [key])[key] == order[STICKY_DEPTH].agent_id  # beyond those remembered
    for rec in order[:STICKY_DEPTH]:
        rec.state = "healthy"
    order[1].busy = order[1].load = 0.0
    order[1].active = 0
    idx.state_changed()
    assert owners(idx, [key])[key] == order[0].agent_id


def right(idx: CapabilityIndex[Member]) -> None:
    """Every slot remembered lists the heaviest members of the slot, heaviest first (all of
    them, or the first ones when some left since it was weighed)."""
    for slot, held in idx.slots.items():
        order = sorted(
            idx.members.values(), key=lambda r: rendezvous(r.hrw, SLOT_HASHES[slot]), reverse=True
        )
        assert 0 < len(held) <= STICKY_DEPTH
        assert [r for _, r in held] == order[: len(held)]
        assert [w for w, _ in held] == [rendezvous(r.hrw, SLOT_HASHES[slot]) for _, r in held]


def test_an_index_remembers_a_bounded_number_of_slots_and_keeps_them_right_on_a_change() -> None:
    idx = index(30)
    keys = [f"k{i}" for i in range(60_000)]
    owners(idx, keys)
    assert len(idx.slots) == SLOTS  # 60,000 keys: every slot asked, none more kept
    assert all(len(held) == STICKY_DEPTH for held in idx.slots.values())
    right(idx)
    idx.add(Member("agent-x", 10, TaskStats()))  # weighed against every slot remembered
    assert len(idx.slots) == SLOTS
    right(idx)
    listed = sum(any(r.agent_id == "agent-3" for _, r in held) for held in idx.slots.values())
    idx.remove("agent-3")
    short = [s for s, held in idx.slots.items() if len(held) < STICKY_DEPTH]
    assert len(short) == listed  # only the slots it was among the heaviest of
    right(idx)
    assert owners(idx, keys) == owners(index_without_3_with_x(), keys)
    right(idx)
    assert all(len(held) == STICKY_DEPTH for held in idx.slots.values())  # weighed again


def index_without_3_with_x() -> CapabilityIndex[Member]:
    idx = index(30)
    idx.remove("agent-3")
    idx.add(Member("agent-x", 10, TaskStats()))
    return idx


def test_a_key_of_a_slot_asked_before_costs_no_weighing_whatever_the_members() -> None:
    keys = [f"k{i}" for i in range(60_000)]
    assert len({slot_of(k) for k in keys}) == SLOTS
    fresh = [f"fresh-{i}" for i in range(2000)]
    for n in (40, 400):
        idx = index(n)
        owners(idx, keys[:1])
        assert idx.weighed == n  # a slot never asked: every member weighed once
        owners(idx, keys)
        assert idx.weighed == SLOTS * n  # each slot once, however many of its keys
        owners(idx, fresh)  # keys never asked, of slots asked
        assert idx.weighed == SLOTS * n
        idx.add(Member("agent-x", 10, TaskStats()))
        assert idx.weighed == SLOTS * n + SLOTS  # a join: one weight per slot remembered
        listed = sum(any(r.agent_id == "agent-1" for _, r in held) for held in idx.slots.values())
        idx.remove("agent-1")
        assert idx.weighed == SLOTS * n + SLOTS  # a leave weighs nothing at once
        owners(idx, keys)  # the slots it was among the heaviest of: weighed again
        assert idx.weighed == SLOTS * n + SLOTS + listed * n
        owners(idx, fresh)
        assert idx.weighed == SLOTS * n + SLOTS + listed * n


def test_lanes_weigh_every_agent_as_rendezvous_does() -> None:
    hashes = [hash64(f"agent-{i}") for i in range(300)] + [0, M64, 1]
    for key in ("", "user-1", "ключ"):
        k = hash64(key)
        assert Lanes(hashes).weights(k) == [rendezvous(h, k) for h in hashes]
    assert Lanes([]).weights(5) == []


def test_lanes_find_the_lanes_at_or_above_their_floor_as_a_loop_does() -> None:
    hashes = [hash64(f"slot-{i}") for i in range(500)] + [0, M64]
    for key in ("a", "b", "ключ"):
        h = hash64(key)
        weights = [rendezvous(x, h) for x in hashes]
        floors = [(0, weights[i], weights[i] + 1, NEVER, M64)[i % 5] for i in range(len(hashes))]
        packed = int.from_bytes(b"".join(f.to_bytes(16, "little") for f in floors), "little")
        found = Lanes(hashes).at_least(h, packed)
        assert found == [i for i, w in enumerate(weights) if w >= floors[i]]
        assert len(found) == sum(1 for i in range(len(hashes)) if i % 5 in (0, 1))


def test_members_of_equal_weight_are_told_apart_as_the_slow_way_does() -> None:
    idx = index(6)
    twins = list(idx.members.values())[:2]
    for rec in twins:
        rec.hrw = 12345  # the same hash: the same weight for every key
    idx._lanes = None
    for key in KEYS[:50]:
        assert [r for _, r in idx.heaviest(key)] == idx.by_weight(key)[:STICKY_DEPTH]
