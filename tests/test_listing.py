"""The fleet's listing (reach_broker.core.listing): pages by partition, the cursor between them."""

from __future__ import annotations

import pytest

from reach_agent.routing.table import partition
from reach_agent.wire.errors import InvalidRequest
from reach_broker.core.listing import SCAN_LIMIT, Listing, cursor_of, parse_cursor


def walk(listing: Listing, limit: int, passes=None) -> tuple[list[str], int]:  # type: ignore[no-untyped-def]
    """Every id the cursor reaches from partition 0, and how many pages it took."""
    out: list[str] = []
    p, after, pages = 0, "", 0
    while True:
        ids, cursor = listing.page(p, after, limit, passes)
        out += ids
        pages += 1
        assert pages < 10_000
        if cursor is None:
            return out, pages
        p, after = parse_cursor(cursor, listing.partitions)


def test_a_walk_lists_every_agent_once_in_partition_then_id_order() -> None:
    listing = Listing(8)
    ids = [f"agent-{i:04d}" for i in range(1000)]
    for a in reversed(ids):
        listing.add(a)
    listing.add("agent-0007")  # an agent announcing again is not listed twice
    got, pages = walk(listing, 50)
    assert sorted(got) == ids
    assert got == sorted(ids, key=lambda a: (partition(a, 8), a))
    assert sum(listing.counts()) == 1000
    assert pages == sum(-(-n // 50) or 1 for n in listing.counts())


def test_a_page_is_bounded_and_its_cursor_goes_on_after_its_last_id() -> None:
    listing = Listing(1)
    for i in range(10):
        listing.add(f"a{i}")
    assert listing.page(0, "", 4) == (["a0", "a1", "a2", "a3"], "0.a3")
    assert listing.page(0, "a3", 4) == (["a4", "a5", "a6", "a7"], "0.a7")
    assert listing.page(0, "a7", 4) == (["a8", "a9"], None)
    listing.remove("a5")
    listing.remove("nobody")  # not listed: nothing to remove
    assert listing.page(0, "a3", 4) == (["a4", "a6", "a7", "a8"], "0.a8")
    assert listing.page(0, "a45", 1) == (["a6"], "0.a6")  # after an id that left: still in order


def test_the_cursor_moves_to_the_next_partition_even_when_one_is_empty() -> None:
    listing = Listing(3)
    assert listing.page(0, "", 10) == ([], "1.")
    assert listing.page(2, "", 10) == ([], None)


def test_a_filter_scans_a_bounded_number_of_ids_per_page() -> None:
    listing = Listing(1)
    n = SCAN_LIMIT + 10
    for i in range(n):
        listing.add(f"a{i:06d}")
    looked: list[str] = []

    def passes(agent_id: str) -> bool:
        looked.append(agent_id)
        return agent_id == f"a{n - 1:06d}"

    ids, cursor = listing.page(0, "", 5, passes)
    assert (ids, cursor, len(looked)) == ([], f"0.a{SCAN_LIMIT - 1:06d}", SCAN_LIMIT)
    ids, cursor = listing.page(0, f"a{SCAN_LIMIT - 1:06d}", 5, passes)
    assert (ids, cursor) == ([f"a{n - 1:06d}"], None)


def test_a_cursor_names_a_partition_of_the_fleet() -> None:
    assert parse_cursor(cursor_of(3, "x-1"), 4) == (3, "x-1")
    assert parse_cursor("0.", 4) == (0, "")
    for bad in ("4.x", "x.y", "3", "-1.a", ""):
        with pytest.raises(InvalidRequest, match="is not a cursor of this fleet"):
            parse_cursor(bad, 4)


def test_a_partitions_ids_are_a_copy_in_order() -> None:
    listing = Listing(2)
    for a in ("c", "a", "b", "d"):
        listing.add(a)
    both = listing.ids(0) + listing.ids(1)
    assert sorted(both) == ["a", "b", "c", "d"]
    assert all(listing.ids(p) == sorted(listing.ids(p)) for p in (0, 1))
    listing.ids(0).clear()  # the caller's copy
    assert sorted(listing.ids(0) + listing.ids(1)) == ["a", "b", "c", "d"]


def test_a_partition_dropped_is_no_longer_listed() -> None:
    listing = Listing(2)
    for a in ("a", "b", "c", "d"):
        listing.add(a)
    p = listing.partition_of("a")
    dropped = listing.drop(p)
    assert "a" in dropped and listing.ids(p) == [] and listing.count(p) == 0
    assert sorted(dropped + listing.ids(1 - p)) == ["a", "b", "c", "d"]
