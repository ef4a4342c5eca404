"""The route tables' shares of the partitions other brokers own, followed so that this broker's
route answers cover the whole fleet (docs/protocol.md, "One owner per capability").

A broker holds the agents of the partitions it owns in its registry; for the others it follows
their owners' shares with the caller's own follower
(:class:`reach_agent.client.tables.TableFollower`, skipping the partitions this broker owns;
its agents counting hand-outs as the registry's do,
:class:`~reach_agent.routing.table.SharedMember`),
from a capability's first route request on (that request waits for them: one round trip,
:meth:`Shares.waiting`) until it goes unrouted for ``table_idle_s``. When
the partitions this broker owns change, every table followed is asked for again. A table
fetched with partitions unseen (neither owned here, nor answered for by their owner, nor
stored in KV ``reach_tables``: their agents are not routed) is asked for again 1 s later,
doubling up to ``table_resync_s``, until none is: logged (``shares.unseen``,
``shares.seen``) and counted (``reach_tables_total{kind="unseen"}``). The router merges the
two (:meth:`reach_broker.core.routing.Router.route_reply`).

A broker that owns every partition (one broker alone, a server without JetStream) follows
nothing: its registry is the whole fleet.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Iterable, Mapping
from typing import Any

from jetstream.tasks import raise_if_cancelled
from reach_agent.aio import stop_loops
from reach_agent.client.config import ClientConfig
from reach_agent.client.tables import TableFollower
from reach_agent.routing.table import RouteTable, SharedMember, partition
from reach_broker.config import FleetSection

from .context import BrokerContext

log = logging.getLogger(__name__)

WAIT_S = 0.2
"""How long the other brokers' answers are waited for (twice that in all, the KV store read
included): well below ``[fleet] forward_timeout_s``, since a forwarded request may wait."""

OWNED_CHECK_S = 0.1
"""How often the partitions this broker owns are compared with those it followed under."""


class Shares:
    """The other owners' shares of the route tables, followed (a broker component)."""

    def __init__(self, ctx: BrokerContext, cfg: FleetSection, owned: Mapping[int, int], *,
                 counts: Any) -> None:  # fmt: skip
        self.ctx = ctx
        self.cfg = cfg
        self.owned = owned
        """The partitions this broker owns (its route tables' epochs): never followed."""
        self.asked_again = counts.labels("unseen")
        """``reach_tables_total{kind="unseen"}``: tables asked for again, partitions unseen."""
        self.follower = TableFollower(ctx.nc, ctx.subjects, ClientConfig(table_wait_s=WAIT_S),
                                      ctx.clock, skip=owned.__contains__, member=SharedMember,
                                      unseen=self._unseen,
                                      partitions=cfg.partitions)  # fmt: skip
        self._asking: set[str] = set()
        self._task: asyncio.Task[None] | None = None
        self._running = False

    async def start(self) -> None:
        if self._running or not self.cfg.tables:
            return
        self._running = True
        await self.follower.start()
        self._task = asyncio.create_task(self._watch(), name="reach-shares")

    async def stop(self) -> None:
        if not self._running:
            return
        self._running = False
        if self._task is not None:
            await stop_loops(self._task)
            self._task = None
        await self.follower.stop()

    def owns_all(self) -> bool:
        return len(self.owned) >= self.cfg.partitions

    def waiting(self, capability: str) -> Awaitable[None] | None:
        """What a route request of ``capability`` should wait for before it is answered:
        the other owners' shares, on the capability's first request (one round trip, at
        most twice ``table_wait_s``); None when they are held, or were asked for and some
        did not come (asked again in the background: :meth:`_unseen`), or this broker owns
        every partition."""
        if not self._running or self.owns_all():
            return None
        f = self.follower.followed.get(capability)
        if f is not None and (f.table.shares or f.fetching is None):
            return None
        return self._first(capability)

    async def _first(self, capability: str) -> None:
        try:
            await self.follower.table(capability)
        except Exception:  # noqa: BLE001 - the request is answered with what there is
            log.exception("shares.follow_failed capability=%s", capability)

    def table_of(self, capability: str) -> RouteTable | None:
        """The other owners' shares of ``capability`` as followed now; None when this broker
        owns every partition, or none is held yet (then it is asked for)."""
        if not self._running or self.owns_all():
            return None
        f = self.follower.followed.get(capability)
        if f is None:
            if capability not in self._asking:
                self._asking.add(capability)
                self.ctx.spawn(self._ask(capability), "shares")
            return None
        f.used_at = self.ctx.clock()
        return f.table if f.table.shares else None

    def coverage(self, capability: str, explained: Iterable[str]) -> tuple[int, list[int]]:
        """What an explanation of ``capability`` over ``explained`` (the registry's agents)
        leaves out: the agents of the other owners' shares followed, and the partitions
        neither owned by this broker, nor holding one of ``explained``, nor held as a share,
        nor answered for without one at the last fetch (their owner holds no agent of the
        capability). O(agents of the capability), as an explanation is. Nothing without
        leases (route tables off) or with every partition owned."""
        if not self._running or self.owns_all():
            return 0, []
        self.table_of(capability)  # followed from now on, if it was not
        f = self.follower.followed.get(capability)
        n = self.cfg.partitions
        seen = set(self.owned)
        seen.update(partition(agent_id, n) for agent_id in explained)
        if f is None:
            return 0, [p for p in range(n) if p not in seen]
        seen.update(f.covered)  # answered for with no agent of the capability: seen empty
        seen.update(f.table.shares)
        return len(f.table.where), [p for p in range(n) if p not in seen]

    def _unseen(self, capability: str, partitions: list[int], fetches: int) -> None:
        """The follower fetched ``capability``'s table ``fetches`` times in a row leaving
        ``partitions`` unseen, and asks again (none left: seen again)."""
        if not partitions:
            log.info("shares.seen capability=%s: every partition answered for again",
                     capability)  # fmt: skip
            return
        self.asked_again.inc()
        if fetches == 1:
            log.info("shares.unseen capability=%s partitions=%s: routed without their agents, "
                     "asked again", capability, partitions)  # fmt: skip
        else:
            log.debug("shares.unseen capability=%s partitions=%s fetches=%d", capability,
                      partitions, fetches)  # fmt: skip

    async def _ask(self, capability: str) -> None:
        try:
            await self.follower.table(capability)
        except Exception:  # noqa: BLE001 - the next route request asks again
            log.exception("shares.follow_failed capability=%s", capability)
        finally:
            self._asking.discard(capability)

    async def _watch(self) -> None:
        """Ask for every followed table again when the partitions this broker owns change."""
        last = frozenset(self.owned)
        while True:
            raise_if_cancelled()
            await asyncio.sleep(OWNED_CHECK_S)
            now = frozenset(self.owned)
            if now != last:
                last = now
                try:
                    self.follower.refetch()
                except Exception:  # noqa: BLE001 - the loop body never dies
                    log.exception("shares.refetch failed")
