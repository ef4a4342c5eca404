"""Who owns each partition of the fleet, as the leases in KV ``reach_partitions`` say: read,
not held (holding them is :mod:`.partitions`).

A broker that owns every partition (one broker alone, or no JetStream) reads nothing. Else
every key is read every third of the lease's time to live (the rate at which owners renew
them), and again at once when a forward finds the owner gone (:meth:`Owners.stale`): P small
reads a round, whatever the size of the fleet. A key that is missing (lapsed) or handed back
names no owner; a lapsed one's last holder is remembered (:attr:`Owners.lapsed`) until a
lease names an owner again.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import msgspec

from jetstream.claims import ClaimStore, ClaimsUnavailable
from jetstream.tasks import raise_if_cancelled
from reach_agent.aio import stop_loops
from reach_agent.wire.subjects import broker_token
from reach_broker.config import FleetSection

from .context import BrokerContext
from .partitions import Lease

log = logging.getLogger(__name__)

_lease = msgspec.json.Decoder(Lease)


class Owners:
    """Each partition's owner (its broker's subject token), read from the leases."""

    def __init__(self, ctx: BrokerContext, cfg: FleetSection, *,
                 owns_all: Callable[[], bool], store: ClaimStore) -> None:  # fmt: skip
        self.ctx = ctx
        self.cfg = cfg
        self.owns_all = owns_all
        """Whether this broker holds every lease (then nobody else's is read)."""
        self.store = store
        """The leases' bucket (the one :class:`~.partitions.Partitions` keeps them in)."""
        self.of: list[str | None] = [None] * cfg.partitions
        """Each partition's owner as last read (None: nobody, or not read yet)."""
        self.lapsed: list[str | None] = [None] * cfg.partitions
        """Each partition's last holder as read before its lease lapsed (its key missing),
        until a lease names an owner again or is handed back (None: not lapsed, or nobody
        was read holding it). A gone owner's leases lapse one by one, as they were renewed:
        its partitions read since still name it here."""
        self.freed: set[int] = set()
        """The partitions whose lease was handed back at the last read (a value naming no
        owner: the brokers take it within moments, rebalancing at once), not lapsed."""
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._loop(), name="reach-owners")

    async def stop(self) -> None:
        if self._task is not None:
            await stop_loops(self._task)
            self._task = None

    def alone(self, token: str) -> bool:
        """Whether no broker but ``token`` held a lease at the last read (O(P): asked only
        when a partition has no known owner)."""
        return all(o is None or o == token for o in self.of)

    def stale(self) -> None:
        """An owner read did not answer a forward: read the leases again now."""
        self._wake.set()

    async def read(self) -> None:
        """Every partition's lease, read at once."""
        await asyncio.gather(*(self._read(p) for p in range(self.cfg.partitions)))

    async def _read(self, p: int) -> None:
        try:
            stored = await self.store.get(str(p))
            owner = None if stored is None else _lease.decode(stored.data).broker_id
        except (ClaimsUnavailable, msgspec.MsgspecError) as exc:
            log.debug("owners.read_failed partition=%d error=%s", p, exc)
            return  # the last read stands
        last = self.of[p]
        self.of[p] = None if owner is None else broker_token(owner)
        if stored is not None:
            self.lapsed[p] = None
        elif last is not None:
            self.lapsed[p] = last
        if stored is not None and owner is None:
            self.freed.add(p)
        else:
            self.freed.discard(p)

    async def _loop(self) -> None:
        every = self.cfg.lease_ttl_s / 3
        while True:
            raise_if_cancelled()
            try:
                if not self.owns_all():
                    await self.read()
            except Exception:  # noqa: BLE001 - the loop body never dies
                log.exception("owners.read failed")
            try:
                async with asyncio.timeout(every):
                    await self._wake.wait()
            except TimeoutError:
                pass
            self._wake.clear()
