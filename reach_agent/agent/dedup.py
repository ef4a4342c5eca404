"""The agent's duplicate window: recent request ids and their reply.

A repeated ``Reach-Request-Id`` answers with the first result, or joins the run still going,
so a retry (the caller's, or the broker's replay) never runs a task twice. Bounded in size
(``dedup_size``) and time (``dedup_ttl`` after the run ends: 2 min by default, as
docs/protocol.md promises). It also holds the cancels of requests this process does not
run (:meth:`DedupCache.remember`): notes, never replies. Pure: the clock is an argument.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict

Reply = tuple[dict[str, str], bytes]
"""Headers and body of a task's reply."""


class Entry:
    """A request id seen recently: its running or finished reply, and the digest of the
    body it was run with (a repeat with another body is not that request)."""

    __slots__ = ("digest", "expires", "future", "remembered")

    def __init__(self, future: asyncio.Future[Reply], digest: str | None = None) -> None:
        self.future = future
        self.digest = digest
        self.expires = float("inf")  # set when the task finishes
        self.remembered: str | None = None
        """The reason of a cancel of a request this process does not run: a note, not an
        answer (it has no reply: a copy arriving later runs already cancelled)."""


class DedupCache:
    """Request id → :class:`Entry`, oldest first."""

    def __init__(self, size: int, ttl: float) -> None:
        self.size = size
        self.ttl = ttl
        self._seen: OrderedDict[str, Entry] = OrderedDict()

    def __len__(self) -> int:
        return len(self._seen)

    def lookup(self, request_id: str, now: float) -> Entry | None:
        """The entry of ``request_id`` if it is inside the window (an expired one is dropped)."""
        entry = self._seen.get(request_id)
        if entry is not None and entry.expires <= now:
            del self._seen[request_id]
            return None
        return entry

    def begin(self, request_id: str, now: float, running: int, digest: str | None = None) -> Entry:
        """Remember a task that starts now (its body's ``digest``); ``running`` tasks (this
        one included) are never dropped to make room."""
        entry = Entry(asyncio.get_running_loop().create_future(), digest)
        self._add(request_id, entry, now, running)
        return entry

    def remember(self, request_id: str, reason: str, now: float, running: int) -> Entry:
        """Note the cancel (``reason``) of ``request_id``, which this process does not run,
        until ``now + ttl``. Its future is cancelled: done (dropped to make room as a finished
        entry is), and never read — a note is no reply."""
        future: asyncio.Future[Reply] = asyncio.get_running_loop().create_future()
        future.cancel()
        entry = Entry(future)
        entry.remembered = reason
        entry.expires = now + self.ttl
        self._add(request_id, entry, now, running)
        return entry

    def _add(self, request_id: str, entry: Entry, now: float, running: int) -> None:
        seen = self._seen
        seen[request_id] = entry
        # Bounded: drop expired entries from the old end, then the oldest finished ones.
        # Running entries are never dropped; they go to the new end (at most `running` moves).
        moved = 0
        while seen:
            oldest_id, oldest = next(iter(seen.items()))
            if not oldest.future.done():
                if moved >= running:
                    break
                seen.move_to_end(oldest_id)
                moved += 1
            elif oldest.expires <= now or len(seen) > self.size:
                del seen[oldest_id]
            else:
                break

    def forget(self, request_id: str, entry: Entry) -> None:
        """Drop ``entry`` (an answer that may change, e.g. ``IN_PROGRESS``): the next
        duplicate asks again. Joiners already waiting still get its reply."""
        if self._seen.get(request_id) is entry:
            del self._seen[request_id]

    def finish(self, entry: Entry, reply: Reply, now: float) -> None:
        """The task ended with ``reply``: duplicates get it until ``now + ttl``."""
        entry.expires = now + self.ttl
        if not entry.future.done():
            entry.future.set_result(reply)
