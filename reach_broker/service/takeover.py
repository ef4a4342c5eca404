"""Taking a partition, and handing it over: what this broker holds follows its leases.

The registry holds the agents of the partitions this broker owns, and nothing else. When a
lease is taken (:mod:`.partitions` says ``own``), the partition is taken in this order:

1. its agents are restored from its own snapshot keys (O(partition):
   :meth:`~reach_broker.service.snapshot.Snapshot.restore_partition`), not yet heard from:
   at a **warm** takeover (``warm``, as :mod:`.partitions` tells it: the partition was held
   by a live broker until moments ago) each in the state its key holds (its owner changed,
   not the agent: its first heartbeat confirms that state without a transition, an event or
   a snapshot write); at a **cold** take (alone, holding no partition: this broker's start, or
   every lease lost while its link was down; nobody heard the agents meanwhile) each
   ``suspect``, routable once heard (``offline``/``draining`` stay so);
2. its subjects are heard (:meth:`~reach_broker.service.ingest.Ingest.own`: on return the
   subscriptions are live at the server);
3. every restored agent gets its whole silence window again, counted from that moment
   (:meth:`~reach_broker.core.registry.Registry.listening`): a silence that began before this
   broker could hear the agent is not the agent's, so no agent goes offline (nor, warm,
   suspect) because its owner changed (the observer's self-doubt, extended to a takeover);
   but one whose connection the server closed meanwhile, while no broker here held it, is
   disconnected now (:meth:`~reach_broker.service.advisories.Advisories.restored`);
4. its route-table shares are published (:mod:`.tables`).

When a lease is lost (``lose``), in reverse: shares forgotten, subjects no longer heard, the
partition's agents dropped from the registry *without a transition* (they are not gone, only
owned elsewhere: no ``offline``, no ``left``), and their snapshot keys left to the new owner.
Probes, snapshots and events then concern owned partitions only, since they all start from
the registry.

One partition's steps never interleave (its own and lose run in the order told); different
partitions are taken concurrently.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from reach_broker.core.registry import Registry

from .context import BrokerContext
from .ingest import Ingest
from .snapshot import Snapshot

log = logging.getLogger(__name__)

FLUSH_BEFORE_HANDOVER_S = 1.0
"""How long a partition handed over waits for the snapshot's pending writes."""
RESTORE_TRIES = 2
"""A partition's restore is tried this many times before it is taken without its agents."""
RESTORE_RETRY_S = 0.5
"""The pause before a failed restore is tried again (a JetStream leader election, a read
that stalled: both pass)."""
RESTORE_RESULTS = ("ok", "retried", "failed")
"""``result`` of ``reach_partition_restores_total``: restored at the first try (``ok``), at a
later one (``retried``), or not at all (``failed``: taken without its agents, who are asked to
announce again as they are heard)."""


class Takeover:
    """What the broker holds per partition, taken and handed over as its leases say."""

    def __init__(
        self, ctx: BrokerContext, registry: Registry, snapshot: Snapshot, ingest: Ingest, *,
        shares_own: Callable[[int, int], None], shares_lose: Callable[[int], None],
        restored: Callable[[list[str]], None], took: Any, restores: Any,
        retry_after_s: float = RESTORE_RETRY_S,
    ) -> None:  # fmt: skip
        self.ctx = ctx
        self.registry = registry
        self.snapshot = snapshot
        self.ingest = ingest
        self.shares_own = shares_own
        """Told once partition ``p`` is held and heard: its route-table shares are published."""
        self.shares_lose = shares_lose
        self.restored = restored
        """Told the agents restored, once heard: those whose connections the server closed
        while no broker here held them are judged (the advisories)."""
        self.took = took
        """``reach_partition_takeover_seconds``."""
        self.restores = {result: restores.labels(result) for result in RESTORE_RESULTS}
        """``reach_partition_restores_total`` by result."""
        self.retry_after_s = retry_after_s
        self._last: dict[int, Awaitable[None]] = {}

    async def own(self, p: int, epoch: int, warm: bool) -> None:
        """Take partition ``p`` (the module docstring's steps; ``warm``: its agents keep their
        stored states); returns once it is heard."""
        await self._after(p, self._own(p, epoch, warm))

    async def lose(self, p: int) -> None:
        """Hand partition ``p`` over: dropped without a transition."""
        await self._after(p, self._lose(p))

    async def _after(self, p: int, step: Awaitable[None]) -> None:
        """Run ``step`` once partition ``p``'s previous step is done."""
        before = self._last.get(p)
        task = asyncio.ensure_future(self._chain(before, step))
        self._last[p] = task
        try:
            await asyncio.shield(task)
        finally:
            if self._last.get(p) is task and task.done():
                del self._last[p]

    @staticmethod
    async def _chain(before: Awaitable[None] | None, step: Awaitable[None]) -> None:
        if before is not None:
            try:
                await before
            except Exception:  # noqa: BLE001 - its own caller saw it
                pass
        await step

    async def _own(self, p: int, epoch: int, warm: bool) -> None:
        clock = self.ctx.clock
        t0 = clock()
        restored = await self._restore(p, warm)
        await self.ingest.own(p)
        now = clock()
        regranted = self.registry.listening(now, restored)
        self.restored(restored)
        self.shares_own(p, epoch)
        self.took.observe(now - t0)
        log.debug("takeover.owned partition=%d epoch=%d warm=%s restored=%d regranted=%d "
                  "seconds=%.3f", p, epoch, warm, len(restored), regranted,
                  now - t0)  # fmt: skip

    async def _restore(self, p: int, warm: bool) -> list[str]:
        """Partition ``p``'s agents restored (their ids), tried ``RESTORE_TRIES`` times; none
        when every try failed: the partition is then taken without them, and they are asked to
        announce again as they are heard (their stored states and task times lost), counted
        ``failed``. A read that fails restores nothing (it raises before any agent is
        restored), so a second try starts clean."""
        attempt = 1
        while True:
            try:
                restored = await self.snapshot.restore_partition(p, warm=warm)
            except Exception as exc:  # noqa: BLE001 - tried again, then announced again
                if attempt == RESTORE_TRIES:
                    log.error("takeover.restore_failed partition=%d try=%d error=%r: taken "
                              "without its agents, who are asked to announce again as they "
                              "are heard", p, attempt, exc)  # fmt: skip
                    self.restores["failed"].inc()
                    return []
                log.warning("takeover.restore_failed partition=%d try=%d error=%r: tried again "
                            "in %.1fs", p, attempt, exc, self.retry_after_s)  # fmt: skip
                await asyncio.sleep(self.retry_after_s)
                attempt += 1
                continue
            self.restores["ok" if attempt == 1 else "retried"].inc()
            return restored

    async def _lose(self, p: int) -> None:
        self.shares_lose(p)
        await self.ingest.lose(p)
        agents = self.registry.listing.ids(p)
        # What changed last is written before the keys are left to the next owner.
        if not await self.snapshot.flush_now(FLUSH_BEFORE_HANDOVER_S):
            log.warning("takeover.flush_failed partition=%d: the next owner may restore an "
                        "older state of its agents", p)  # fmt: skip
        self.snapshot.forget(agents)
        dropped = self.registry.drop(p)
        log.debug("takeover.handed_over partition=%d dropped=%d", p, dropped)
