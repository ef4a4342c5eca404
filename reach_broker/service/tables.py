"""The route tables on NATS: this broker publishes the shares of the partitions it owns.

What a share holds and how its versions go is :mod:`reach_broker.core.tables`; which
partitions this broker owns, :mod:`.partitions`. Here:

- **Deltas** on ``<prefix>.table.<partition>.<capability>`` (core NATS): the agents the
  registry changed (its ``changed`` set, taken whole at each flush: no O(fleet) work), at
  once when a transition comes through the fan-out (a state moved: an agent out of the routes
  reaches subscribed callers within milliseconds), else every ``[fleet] table_batch_ms``
  (load and score drift). A flush takes the agents in ``TOUCH_CHUNK`` at a time and
  encodes its deltas ``SEND_CHUNK`` at a time, letting the event loop run between (route
  requests are not held up behind a whole batch); a request for the tables meanwhile
  finishes the flush's work itself. Deltas go out one batch after another, in the order
  their versions were given.
- **Requests** on ``<prefix>.tables.<capability>`` (every broker answers, no queue group):
  the shares of the partitions this broker owns, with their epochs and versions (a newcomer's
  one request; a caller that saw a gap asks again).
- **Snapshots** in KV ``reach_tables`` (key ``<partition>.<capability>``), a share whose
  agents or their states changed at most every ``[fleet] table_store_s``, one whose load only
  drifted at most every ``DRIFT_STORE_FACTOR`` x that: what a caller reads when no broker
  answers.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import msgspec
from nats.errors import Error as NatsError

from jetstream.names import TABLES_BUCKET
from jetstream.tasks import raise_if_cancelled
from reach_agent.aio import stop_loops
from reach_agent.routing.rules import Rule, rule_encoder
from reach_agent.wire import schema
from reach_agent.wire.schema import NO_RULE, Table, TableDelta, check_capability
from reach_broker.config import FleetSection, RoutingSection
from reach_broker.core.quotas import Quotas
from reach_broker.core.records import AgentRecord, Transition
from reach_broker.core.registry import Registry
from reach_broker.core.routing import Router
from reach_broker.core.tables import Policy, TableBook

from .context import BrokerContext
from .handlers import Endpoint

log = logging.getLogger(__name__)

_KV_DELETE = {"KV-Operation": "DEL"}

COALESCE_S = 0.01
"""After a transition the flush waits this long for whatever else moves at the same time."""
TOUCH_CHUNK = 256
"""Agents a flush takes in between two turns of the event loop. At 10,000 agents
heartbeating every second, a flush every 250 ms took in 2,500 at once: 16 ms of the loop in
one callback, four times a second (py-spy, the load test's route rounds), during which every
route request waited. 256 is about 2 ms."""
SEND_CHUNK = 64
"""Deltas a flush encodes between two turns of the event loop."""
DRIFT_STORE_FACTOR = 10
"""A share whose agents' load or scores only drifted is written to KV at most every
``DRIFT_STORE_FACTOR`` x ``table_store_s`` (10 s by default): its agents report a new
``active`` at nearly every heartbeat, and each rewrite of the share is a JetStream write."""


class Tables:
    """This broker's share of the route tables, published (a broker component)."""

    def __init__(
        self, ctx: BrokerContext, registry: Registry, router: Router, quotas: Quotas,
        cfg: FleetSection, routing: RoutingSection, *, jetstream: Callable[[], bool],
        counts: Any, dropped: Any,
    ) -> None:  # fmt: skip
        self.ctx = ctx
        self.cfg = cfg
        self.registry = registry
        self.router = router
        self.quotas = quotas
        self.jetstream = jetstream
        """Whether the server has JetStream (known once the broker has provisioned)."""
        self.counts = counts
        """``reach_tables_total{kind}``: deltas, requests, shares stored or not."""
        self.book = TableBook(cfg.partitions, routing, self.policy)
        self.endpoint = Endpoint(
            "tables", self.answer, ctx, refused=None, failed=None,
            dropped=lambda reason: dropped.labels("tables", reason),
        )  # fmt: skip
        self._rules: dict[str, tuple[Rule, msgspec.Raw]] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._storer: asyncio.Task[None] | None = None
        self._to_store: list[tuple[int, str]] = []
        self._store_wake = asyncio.Event()
        self._sub: Any = None
        self._stored_at: dict[tuple[int, str], float] = {}
        self._storing: set[tuple[int, str]] = set()
        """Shares whose write to KV is out (the next waits for it: no pile-up on a slow
        server)."""
        self._jetstream = False
        self._pending: set[str] = set()
        """Agents a flush under way has yet to take in (:meth:`flush`)."""
        self._sending = asyncio.Lock()
        """Held while deltas are encoded and published: batches go out in the order cut."""

    # --- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        if self._task is not None or not self.cfg.tables:
            return
        self._jetstream = self.jetstream()
        nc, s = self.ctx.nc, self.ctx.subjects
        self._sub = await nc.subscribe(s.all_tables, cb=self.endpoint.on_message)
        self._task = asyncio.create_task(self._loop(), name="reach-tables")
        if self._jetstream:
            self._storer = asyncio.create_task(self._store_loop(), name="reach-tables-store")

    async def stop(self) -> None:
        if self._task is None:
            return
        await stop_loops(self._task)
        self._task = None
        if self._storer is not None:
            await stop_loops(self._storer)
            self._storer = None
        self._to_store.clear()
        self._storing.clear()
        if self._sub is not None:
            try:
                await self._sub.unsubscribe()
            except NatsError:
                pass
            self._sub = None

    # --- what it is told ---------------------------------------------------------------------

    def on_transition(self, t: Transition, rec: AgentRecord | None) -> None:
        """A consumer of the fan-out: an agent's state moved (or it left): publish now."""
        self._wake.set()

    def policy(self, capability: str) -> Policy:
        """Whether callers may route ``capability`` themselves (no quota applies to it:
        only a broker enforces one), and its route rule's JSON."""
        rule = self.router.rules.get(capability)
        raw = NO_RULE
        if rule is not None:
            known = self._rules.get(capability)
            if known is None or known[0] is not rule:
                known = self._rules[capability] = (rule, msgspec.Raw(rule_encoder.encode(
                    rule.stored)))  # fmt: skip
            raw = known[1]
        return not self.quotas.enforced(capability), raw

    def own(self, p: int, epoch: int) -> None:
        """Partition ``p`` is this broker's from now on (:mod:`.partitions` says): its shares
        are made from the registry and published."""
        log.debug("tables.own partition=%d epoch=%d", p, epoch)
        registry, book = self.registry, self.book
        listing = registry.listing
        ids = listing.ids(p) if listing.partitions == book.partitions else None  # O(partition)
        deltas = book.own(p, epoch, registry.agents, self.ctx.clock(), ids)
        if deltas:
            self.ctx.spawn(self._send(deltas), "table")

    def lose(self, p: int) -> None:
        """Partition ``p`` is no longer this broker's: its shares are forgotten."""
        log.debug("tables.lose partition=%d", p)
        self.book.disown(p)

    # --- publishing ----------------------------------------------------------------------------

    def collect(self) -> list[TableDelta]:
        """What changed since the last collect, as deltas (the shares' versions advanced),
        all of it now (also what a flush under way has yet to take in); changed shares
        written to KV when due."""
        deltas = self._take()
        pending = self._pending
        self.book.touch(pending, self.registry.agents.get, self.ctx.clock())
        pending.clear()
        return deltas + self._cut()

    async def flush(self) -> int:
        """Publish what changed since the last flush, taken in ``TOUCH_CHUNK`` agents at a
        time; the deltas published."""
        deltas = self._take()
        pending, touch, get = self._pending, self.book.touch, self.registry.agents.get
        while pending:
            touch([pending.pop() for _ in range(min(TOUCH_CHUNK, len(pending)))], get,
                  self.ctx.clock())  # fmt: skip
            if pending:
                await asyncio.sleep(0)  # a collect meanwhile empties ``pending``
        deltas += self._cut()
        await self._send(deltas)
        return len(deltas)

    def _take(self) -> list[TableDelta]:
        """Cut what was taken in so far (so an agent is taken in at most once between two
        cuts), then add the registry's ``changed`` to what is to be taken in."""
        deltas = self.book.cut()
        pending, changed = self._pending, self.registry.changed
        self.registry.changed = set()
        if pending:
            pending |= changed
        else:
            self._pending = changed
        return deltas

    def _cut(self) -> list[TableDelta]:
        """The deltas of what was taken in, and of the policies that moved; changed shares
        written to KV when due."""
        deltas = self.book.cut()
        deltas += self.book.policies_changed()
        if self._jetstream:
            self._store(self.ctx.clock())
        return deltas

    async def _send(self, deltas: list[TableDelta]) -> None:
        if not deltas:
            return
        async with self._sending:
            if not self.ctx.link.connected:
                return  # a caller that missed versions resyncs on the next delta it sees
            s, nc = self.ctx.subjects, self.ctx.nc
            encode = schema.encoder.encode
            for i, d in enumerate(deltas, 1):  # into the connection's buffer: one flush
                await nc.publish(s.table(d.partition, d.capability), encode(d))
                if i % SEND_CHUNK == 0 and i < len(deltas):
                    await asyncio.sleep(0)
            self.counts.labels("delta").inc(len(deltas))

    def _store(self, now: float) -> None:
        """Write changed shares to KV ``reach_tables``: one whose agents or their states
        moved at most every ``table_store_s``, one whose load or scores only drifted at most
        every ``DRIFT_STORE_FACTOR`` x that (a caller reading the store corrects load with its
        own count and the agents' answers), and never one whose last write is still out."""
        every = self.cfg.table_store_s
        drift = every * DRIFT_STORE_FACTOR
        storing = self._storing
        for key, share in self.book.shares.items():
            if share.stored == share.version or key in storing:
                continue
            if now - self._stored_at.get(key, -1e9) < (every if share.moved else drift):
                continue
            share.moved = False
            self._stored_at[key] = now
            storing.add(key)
            self._to_store.append(key)
        if self._to_store:
            self._store_wake.set()

    async def _store_loop(self) -> None:
        """Write the shares :meth:`_store` queued, one after another on this one task (no
        task a write: a flush of 320 changed shares is 320 requests in a row), each encoded
        as it is written (one share's body alive at a time, not the whole queue's: 4.4 MB
        at 10,000 agents)."""
        while True:
            raise_if_cancelled()
            await self._store_wake.wait()
            self._store_wake.clear()
            batch, self._to_store = self._to_store, []
            for key in batch:
                share = self.book.shares.get(key)
                if share is None:  # its partition was lost meanwhile
                    self._storing.discard(key)
                    continue
                share.stored = share.version
                body = schema.encoder.encode(self.book.share(*key, self.ctx.wall_ms()))
                try:
                    await self._put(key, body, not share.entries)
                except Exception:  # noqa: BLE001 - the loop body never dies
                    log.exception("tables.store failed")

    async def _put(self, key: tuple[int, str], body: bytes, empty: bool) -> None:
        subject = f"$KV.{TABLES_BUCKET}.{key[0]}.{key[1]}"
        try:
            if empty:
                await self.ctx.nc.request(subject, b"", headers=_KV_DELETE, timeout=2.0)
            else:
                await self.ctx.nc.request(subject, body, timeout=2.0)
            self.counts.labels("stored").inc()
        except NatsError as exc:
            self.counts.labels("store_failed").inc()
            log.debug("tables.store_failed subject=%s error=%s", subject, exc)
        finally:
            self._storing.discard(key)

    async def _loop(self) -> None:
        every = self.cfg.table_batch_ms / 1000.0
        while True:
            raise_if_cancelled()
            try:
                async with asyncio.timeout(every):
                    await self._wake.wait()
                # A transition: out within COALESCE_S, with whatever else moved meanwhile
                # (a storm of announces is a few flushes, not one per announce).
                await asyncio.sleep(COALESCE_S)
            except TimeoutError:
                pass
            self._wake.clear()
            try:
                await self.flush()
            except Exception:  # noqa: BLE001 - the loop body never dies
                log.exception("tables.flush failed")

    # --- answering -----------------------------------------------------------------------------

    def answer(self, subject: str, data: bytes) -> bytes:
        """``<prefix>.tables.<capability>``: the shares of the partitions this broker owns."""
        capability = self.ctx.subjects.capability_of_tables(subject)
        check_capability(capability)
        deltas = self.collect()  # the shares as the registry has them now, not as of the
        if deltas:  # last batch (the deltas go out behind this answer)
            self.ctx.spawn(self._send(deltas), "table")
        book, at_ms = self.book, self.ctx.wall_ms()
        owned = sorted(book.epochs)
        shares = [book.share(s.partition, capability, at_ms) for s in book.of(capability)]
        self.counts.labels("request").inc()
        return schema.encoder.encode(Table(capability=capability, partitions=book.partitions,
                                           owned=owned, shares=shares,
                                           broker_id=self.ctx.broker_id))  # fmt: skip
