"""The fleet listed page by page (``<p>.agents.<partition>``): each partition's agent ids in
order, and the cursor that walks the partitions.

The registry tells the listing of each agent that joins or leaves (:meth:`Listing.add`,
:meth:`Listing.remove`); each partition keeps its ids sorted (an insert moves pointers, it
sorts nothing), so a page is a bisect and a slice: O(log n + page), whatever the size of the
fleet. A cursor is ``"<partition>.<after>"``: the partition the next page comes from (its
owner answers it) and the last agent id listed there (empty: from its first). Pure: the
service (:mod:`reach_broker.service.listing`) answers with what :meth:`Listing.page` returns.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterator

from reach_agent.routing.table import partition
from reach_agent.wire.errors import InvalidRequest
from reach_broker.config import FleetSection

DEFAULT_PARTITIONS = FleetSection().partitions
"""``[fleet] partitions`` unless told (a registry built without the fleet's section)."""

DEFAULT_LIMIT = 500
"""Agents in a page when the request does not say."""
MAX_LIMIT = 5000
"""The most agents a page holds (``limit`` above it is refused)."""
SCAN_LIMIT = 20_000
"""The most ids one page looks at when a filter (capability, state) passes few of them: the
page ends there, short or empty, with a cursor to go on (its cost stays bounded)."""


def cursor_of(p: int, after: str = "") -> str:
    """The cursor of partition ``p`` after the agent id ``after`` (empty: from its first)."""
    return f"{p}.{after}"


def parse_cursor(cursor: str, partitions: int) -> tuple[int, str]:
    """``(partition, after)`` of a cursor; InvalidRequest naming it when it is not one."""
    head, dot, after = cursor.partition(".")
    if not dot or not head.isdigit() or int(head) >= partitions:
        raise InvalidRequest(
            f"cursor {cursor[:160]!r} is not a cursor of this fleet "
            f"('<partition>.<after>', partition below {partitions})"
        )
    return int(head), after


class Listing:
    """Every agent id the registry holds, sorted within its partition."""

    __slots__ = ("_ids", "partitions")

    def __init__(self, partitions: int) -> None:
        self.partitions = partitions
        self._ids: list[list[str]] = [[] for _ in range(partitions)]

    def partition_of(self, agent_id: str) -> int:
        return partition(agent_id, self.partitions)

    def add(self, agent_id: str) -> None:
        ids = self._ids[partition(agent_id, self.partitions)]
        i = bisect.bisect_left(ids, agent_id)
        if i == len(ids) or ids[i] != agent_id:
            ids.insert(i, agent_id)

    def remove(self, agent_id: str) -> None:
        ids = self._ids[partition(agent_id, self.partitions)]
        i = bisect.bisect_left(ids, agent_id)
        if i < len(ids) and ids[i] == agent_id:
            del ids[i]

    def drop(self, p: int) -> list[str]:
        """Forget partition ``p``'s ids (another broker owns it now); the ids it held."""
        ids, self._ids[p] = self._ids[p], []
        return ids

    def ids(self, p: int) -> list[str]:
        """Partition ``p``'s agent ids, in order (a copy: O(partition))."""
        return list(self._ids[p])

    def count(self, p: int) -> int:
        """How many agents partition ``p`` holds."""
        return len(self._ids[p])

    def counts(self) -> list[int]:
        """How many agents each partition holds."""
        return [len(ids) for ids in self._ids]

    def page(
        self, p: int, after: str, limit: int, passes: Callable[[str], bool] | None = None
    ) -> tuple[list[str], str | None]:
        """Up to ``limit`` ids of partition ``p`` after ``after`` that ``passes`` (all when
        None), and the cursor that follows them: the same partition after the last id looked
        at, the next partition from its first, or None after the last partition."""
        ids = self._ids[p]
        i = bisect.bisect_right(ids, after) if after else 0
        out: list[str] = []
        end = min(len(ids), i + SCAN_LIMIT) if passes is not None else min(len(ids), i + limit)
        j = i
        while j < end and len(out) < limit:
            if passes is None or passes(ids[j]):
                out.append(ids[j])
            j += 1
        if j < len(ids):
            return out, cursor_of(p, ids[j - 1]) if j > 0 else cursor_of(p)
        return out, cursor_of(p + 1) if p + 1 < self.partitions else None

    def __iter__(self) -> Iterator[str]:
        for ids in self._ids:
            yield from ids
