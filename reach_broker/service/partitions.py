"""Which partitions of the fleet this broker owns: a lease each, in KV ``reach_partitions``.

A partition's owner is whoever holds its key (``<partition>``, value: the owner's broker id).
A free key is taken with a create (``Nats-Expected-Last-Subject-Sequence: 0``: one broker
wins); the owner renews it by compare-and-set on the revision it holds every third of the
lease's time to live (``[fleet] lease_ttl_s``, the bucket's ``max_age``), so a broker that
dies stops renewing and its keys age out: another broker takes them at its next round. A
broker that stops hands its leases back (a value naming no owner, which any broker may take
at once). The revision a lease was taken at is its **epoch**: everything the owner publishes
for the partition carries it, so a reader can tell one owner's versions from the next's.

Without JetStream there is nothing to lease: the broker owns every partition (a deployment
without JetStream runs one broker).

The owner is told (``on_own(partition, epoch)``, ``on_lose(partition)``); the route tables
(:mod:`reach_broker.service.tables`) publish the shares of what it owns. Issue 24's
partitioned ingest will follow the same leases.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
from collections.abc import Callable
from typing import Any

import msgspec

from jetstream.claims import ClaimStore, ClaimsUnavailable
from jetstream.names import PARTITIONS_BUCKET
from jetstream.tasks import raise_if_cancelled
from reach_agent.aio import stop_loops
from reach_broker.config import FleetSection

from .context import BrokerContext

log = logging.getLogger(__name__)


class Lease(msgspec.Struct, kw_only=True, omit_defaults=True):
    """A lease's value: who owns the partition (None: handed back, free to take)."""

    broker_id: str | None = None
    at_ms: int = 0


HAND_BACK_S = 1.0
"""How long a stopping broker spends handing its leases back (they lapse anyway)."""

_lease = msgspec.json.Decoder(Lease)
_encode = msgspec.json.Encoder().encode


class Partitions:
    """This broker's leases: taken, renewed, handed back; the owner told of each change."""

    def __init__(
        self,
        ctx: BrokerContext,
        cfg: FleetSection,
        on_own: Callable[[int, int], None],
        on_lose: Callable[[int], None],
        *,
        jetstream: Callable[[], bool],
        owned: Any,
    ) -> None:
        self.ctx = ctx
        self.cfg = cfg
        self.on_own = on_own
        self.on_lose = on_lose
        self.jetstream = jetstream
        """Whether the server has JetStream (known once the broker has provisioned)."""
        self.owned = owned
        """``reach_partitions_owned``: the partitions this broker holds."""
        self.store = ClaimStore(ctx.nc, bucket=PARTITIONS_BUCKET,
                                timeout_s=min(2.0, cfg.lease_ttl_s / 3))  # fmt: skip
        self.held: dict[int, tuple[int, int, float]] = {}
        """Each partition owned: (its epoch, the revision last written, when)."""
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Take what is free (every partition, without JetStream), then keep the leases."""
        if self._task is not None:
            return
        if not self.jetstream():
            epoch = secrets.randbits(31)
            for p in range(self.cfg.partitions):
                self._own(p, epoch, 0)
            return
        await self.round()
        log.info("partitions.owned count=%d of %d", len(self.held), self.cfg.partitions)
        self._task = asyncio.create_task(self._loop(), name="reach-partitions")

    async def stop(self) -> None:
        """Stop renewing and hand every lease back (so another broker takes them at once),
        within a second in all: a lease not handed back lapses by itself."""
        if self._task is not None:
            await stop_loops(self._task)
            self._task = None
            free = _encode(Lease(at_ms=self.ctx.wall_ms()))
            backs = [self.store.swap(str(p), free, rev) for p, (_, rev, _at) in self.held.items()]
            if backs and self.ctx.link.connected:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(HAND_BACK_S):
                        await asyncio.gather(*backs, return_exceptions=True)
            for back in backs:
                back.close()  # those never awaited (the link was down)
        for p in list(self.held):
            self._lose(p)

    async def round(self) -> None:
        """Renew every lease held, take every partition that is free: all at once (one
        round trip for the lot, so a busy broker still renews well within the time to live)."""
        mine = _encode(Lease(broker_id=self.ctx.broker_id, at_ms=self.ctx.wall_ms()))
        await asyncio.gather(*(self._keep(p, mine) for p in range(self.cfg.partitions)))

    async def _keep(self, p: int, mine: bytes) -> None:
        """Renew partition ``p``'s lease if held, else take it if free."""
        key = str(p)
        held = self.held.get(p)
        now = self.ctx.clock()
        try:
            if held is not None:
                revision = await self.store.swap(key, mine, held[1])
                if p not in self.held:
                    return  # handed back meanwhile (stop)
                if revision is None:  # it lapsed and someone took it
                    log.warning("partitions.lost partition=%d", p)
                    self._lose(p)
                else:
                    self.held[p] = (held[0], revision, now)
                return
            ours, stored = await self.store.create(key, mine)
            if ours:
                self._own(p, stored.revision, stored.revision)
            elif _lease.decode(stored.data).broker_id is None:  # handed back: take it
                revision = await self.store.swap(key, mine, stored.revision)
                if revision is not None:
                    self._own(p, revision, revision)
        except (ClaimsUnavailable, msgspec.MsgspecError) as exc:
            log.debug("partitions.round_failed partition=%d error=%s", p, exc)
            if held is not None and p in self.held and now - held[2] >= self.cfg.lease_ttl_s:
                # Not renewed within its time: it may be someone else's by now.
                log.warning("partitions.lapsed partition=%d", p)
                self._lose(p)

    def _own(self, p: int, epoch: int, revision: int) -> None:
        self.held[p] = (epoch, revision, self.ctx.clock())
        self.owned.set(len(self.held))
        self.on_own(p, epoch)

    def _lose(self, p: int) -> None:
        del self.held[p]
        self.owned.set(len(self.held))
        self.on_lose(p)

    async def _loop(self) -> None:
        every = self.cfg.lease_ttl_s / 3
        while True:
            raise_if_cancelled()
            await asyncio.sleep(every)
            try:
                await self.round()
            except Exception:  # noqa: BLE001 - the loop body never dies
                log.exception("partitions.round failed")
