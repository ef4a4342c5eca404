"""The registry snapshot in KV ``reach_registry``: written as agents change, read at start.

One key per agent (``<partitions>.<partition>.<agent_id>``: a partition taken over reads its
own keys alone; broker-private keys start with ``_``, which no key of an agent does) holding
the agent's last announce, state and task-time history (its task EWMA). Announces and
transitions mark an agent dirty, and so does a task EWMA that moved by more than ``DRIFT``
since it was written (looked at every ``STATS_S``); a flush loop writes dirty agents at most
every ``FLUSH_S`` and only when the stored value would change, so a steady fleet costs next
to no writes. An evicted agent's key is deleted.

Writes go out in batches of at most :data:`BATCH`: a batch's publishes are pipelined on the
connection and their acknowledgements awaited together (one round trip a batch, so N changed
agents cost ceil(N / BATCH) round trips, and never more than a batch in flight). A write not
acknowledged within :data:`ACK_TIMEOUT_S` (or refused) leaves its agent dirty, as it leaves
every agent of the later batches: the next round, a second later, writes them.

When the broker takes a partition (at start, or over from another broker), before it hears
the partition's subjects, every stored agent of it the broker has not heard from is restored
with its task EWMA: known to ``reach agents`` at once, and scored against the capability's
usual task time rather than from nothing. A **warm** takeover (the partition held by a live
broker until moments ago: taken while other brokers are present or by a broker holding
partitions of its own, or handed back) keeps the
state the bucket holds, routed as it says; the agent's first heartbeat then confirms it: the
bucket already holds it, so a takeover of N agents that all heartbeat on costs no write and no
event (only an agent whose state truly moves afterwards, e.g. one silent through its window,
is written and announced). A **cold** one (alone, holding no partition: the broker's own
start, or every lease lost while its link was down; perhaps after a long outage, in which
any agent may have died) restores each as ``suspect`` (``offline``/
``draining`` stay so), routable only once its next heartbeat (or a probe answer) confirms it.
A broker taking a partition over therefore holds its agents without any of them
re-announcing. A partition handed over is forgotten (:meth:`Snapshot.forget`): its keys are
the new owner's to write.

The partition's keys are read by JetStream's batched direct get (:mod:`jetstream.directget`:
a page of :data:`~jetstream.directget.BATCH` keys a round trip, no consumer), or, where the
stream does not answer one (no ``allow_direct``, a server before 2.11), by a consumer of the
keys' last values (:mod:`jetstream.lastvalues`, what a KV watch reads, ending where the server
says nothing is left; its read takes longer). Either read hands over every key stored or
raises: a takeover never holds a partition read short (the takeover says so, and its agents
are asked to announce again as they are heard). A direct get may be answered by any
replica of the bucket's stream, one a few writes behind its leader; the keys a takeover reads
were written before the partition was handed back or its lease lapsed (as a rule a lease
round earlier), and an agent missing from them is asked to announce again when it is heard.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

import msgspec

from jetstream import directget, lastvalues
from jetstream.names import H_KV_OPERATION, REGISTRY_BUCKET, REGISTRY_STREAM
from jetstream.tasks import raise_if_cancelled
from reach_agent.aio import stop_loops
from reach_agent.routing.table import partition
from reach_agent.wire import schema
from reach_agent.wire.errors import InvalidRequest
from reach_agent.wire.schema import AgentState, Announce
from reach_broker.core.records import AgentRecord, Transition
from reach_broker.core.registry import Registry

from .context import BrokerContext

log = logging.getLogger(__name__)

FLUSH_S = 0.2
BATCH = 256
"""Writes in flight at once (one batch: published together, acknowledged together)."""
ACK_TIMEOUT_S = 5.0
"""A batch's acknowledgements are awaited this long."""
RETRY_S = 1.0
"""After a failed round, the next one waits this long."""
STATS_S = 10.0
"""How often the task EWMAs are compared with what the bucket holds."""
DRIFT = 0.2
"""A task EWMA is written again when it moved by more than this share."""


class SnapshotEntry(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """The value of one agent's key."""

    announce: Announce
    state: AgentState
    last_seen_ms: int = 0
    broker_id: str = ""
    task_ms: float | None = None
    """The agent's task EWMA (ms), the history its latency score is judged on."""


_Written = tuple[Announce, AgentState, float | None]
"""What the bucket holds of an agent: (announce, state, task EWMA)."""


def drifted(written: float | None, now: float | None) -> bool:
    """Whether a task EWMA moved enough since it was written to be written again."""
    if now is None:
        return False
    return written is None or abs(now - written) > DRIFT * written


_entry_decoder = msgspec.json.Decoder(SnapshotEntry)
_SUBJECT = f"$KV.{REGISTRY_BUCKET}."
_DELETE = {H_KV_OPERATION: "DEL"}
"""The headers of a KV delete (what nats-py's ``KeyValue.delete`` publishes)."""


class WritesFailed(Exception):
    """Some writes of a batch were refused or not acknowledged in time (their agents stay
    dirty)."""


class Snapshot:
    """Broker component keeping KV ``reach_registry`` in step with the registry. Started
    only when the server has JetStream."""

    def __init__(self, ctx: BrokerContext, registry: Registry, *, reads: Any) -> None:
        """``reads``: ``reach_snapshot_reads_total{by}``."""
        self.ctx = ctx
        self.registry = registry
        self.kv: Any = None
        self.js: Any = None
        self.restored = 0
        self.writes = 0
        """Writes (puts and deletes) acknowledged."""
        self.rounds = 0
        """Batches sent, each one round trip (its acknowledgements awaited together)."""
        self.stats_every_s = STATS_S
        self.direct_batch = directget.BATCH
        """Keys a page of a partition's direct read asks for."""
        self._reads = {by: reads.labels(by) for by in ("direct", "watch")}
        """Partitions read by batched direct get, and by watch (a consumer of the keys' last
        values: the stream answers no direct get)."""
        self._dirty: set[str] = set()
        # What the bucket holds per agent: the registry's own objects, so remembering costs
        # a tuple and "unchanged" is decided before any encoding.
        self._written: dict[str, _Written] = {}
        self._wake = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []

    async def start(self) -> None:
        """Open the bucket and start writing; each partition is restored when it is taken
        (:meth:`restore_partition`)."""
        if self._tasks:
            return
        self.js = self.ctx.nc.jetstream(timeout=ACK_TIMEOUT_S)
        self.kv = await self.js.key_value(REGISTRY_BUCKET)
        self._tasks = [
            asyncio.create_task(self._flusher(), name="reach-snapshot"),
            asyncio.create_task(self._stats_loop(), name="reach-snapshot-stats"),
        ]

    async def stop(self) -> None:
        if not self._tasks:
            return
        await stop_loops(*self._tasks)
        self._tasks = []
        with contextlib.suppress(Exception):
            await self._flush()

    def key(self, agent_id: str) -> str:
        """The key of ``agent_id``: ``<partitions>.<partition>.<agent_id>`` (a partition is
        read alone; another partition count reads nothing written under this one)."""
        count = self.registry.partitions
        return f"{count}.{partition(agent_id, count)}.{agent_id}"

    # --- restore ------------------------------------------------------------------------

    async def restore_partition(self, p: int, *, warm: bool) -> list[str]:
        """Load partition ``p``'s stored agents into the registry as not-yet-heard-from
        (O(partition): its keys alone are read), each in its stored state when ``warm``,
        else ``suspect`` (:meth:`~reach_broker.core.registry.Registry.restore`); returns the
        ids restored. Nothing without JetStream (the snapshot not running)."""
        if not self._tasks:
            return []
        keys = f"{self.registry.partitions}.{p}.*"
        try:
            stored = await directget.values(self.ctx.nc, REGISTRY_STREAM, _SUBJECT + keys,
                                            batch=self.direct_batch,
                                            timeout_s=ACK_TIMEOUT_S)  # fmt: skip
        except directget.DirectGetUnavailable as exc:
            log.debug("snapshot.read partition=%d by=watch: no direct get (%s)", p, exc)
            self._reads["watch"].inc()
            stored = await lastvalues.values(self.ctx.nc, REGISTRY_STREAM, _SUBJECT + keys,
                                             name="snapshot", timeout_s=ACK_TIMEOUT_S)  # fmt: skip
        else:
            log.debug("snapshot.read partition=%d by=direct values=%d", p, len(stored))
            self._reads["direct"].inc()
        latest: dict[str, SnapshotEntry] = {}
        for value in stored:
            snap = self._entry(value, p)
            if snap is not None:  # a key read twice (written again meanwhile): its later value
                latest[snap.announce.agent_id] = snap
        now, wall_ms = self.ctx.clock(), self.ctx.wall_ms()
        recs: list[AgentRecord] = []
        for agent_id, snap in latest.items():
            self._written[agent_id] = (snap.announce, snap.state, snap.task_ms)
            rec = self.registry.restore(snap.announce, snap.state, now, wall_ms, snap.task_ms,
                                        warm=warm)  # fmt: skip
            if rec is not None:
                recs.append(rec)
        self.registry.restored(now, recs)
        self.restored += len(recs)
        log.debug("snapshot.restored partition=%d agents=%d", p, len(recs))
        return [rec.agent_id for rec in recs]

    def _entry(self, value: bytes, p: int) -> SnapshotEntry | None:
        """A stored value of partition ``p``, decoded and checked (None: a bad entry, logged).
        The agent is the one its announce names (a direct read hands out no keys), which must
        be of partition ``p``."""
        try:
            snap = _entry_decoder.decode(value)
            agent_id = snap.announce.agent_id
            schema.validate_announce(snap.announce, agent_id)
            count = self.registry.partitions
            if partition(agent_id, count) != p:
                raise InvalidRequest(f"agent {agent_id!r} is of partition "
                                     f"{partition(agent_id, count)}, not {p}")  # fmt: skip
        except (msgspec.MsgspecError, InvalidRequest) as exc:
            log.warning("snapshot.bad_entry partition=%d value=%.80r error=%s", p, value, exc)
            return None
        return snap

    async def flush_now(self, timeout_s: float) -> bool:
        """Write what is dirty now (a partition is about to be handed over); whether it all
        went out within ``timeout_s`` (True when the snapshot is not running)."""
        if not self._tasks:
            return True
        try:
            async with asyncio.timeout(timeout_s):
                await self._flush()
        except Exception:  # noqa: BLE001 - the dirty keys stay dirty
            return False
        return True

    def forget(self, agent_ids: list[str]) -> None:
        """These agents are another broker's now (their partition was handed over): no
        longer written, nor deleted, by this one."""
        for agent_id in agent_ids:
            self._written.pop(agent_id, None)
            self._dirty.discard(agent_id)

    # --- writing ------------------------------------------------------------------------

    def on_transition(self, t: Transition, rec: AgentRecord | None) -> None:
        """Consumer: the agent's key is written again (ignored while not running)."""
        if self._tasks:
            self._dirty.add(t.agent_id)
            self._wake.set()

    def on_announce(self, rec: AgentRecord) -> None:
        """An accepted announce, also one that moved no state: what it says is stored."""
        if self._tasks:
            self._dirty.add(rec.agent_id)
            self._wake.set()

    def sweep_stats(self) -> int:
        """Mark dirty every agent whose task EWMA drifted from the stored one; returns how
        many (O(fleet), every ``stats_every_s``, never per message)."""
        written = self._written
        marked = 0
        for agent_id, rec in self.registry.agents.items():
            old = written.get(agent_id)
            if old is not None and drifted(old[2], rec.stats.task_ewma_ms):
                self._dirty.add(agent_id)
                marked += 1
        if marked:
            self._wake.set()
        return marked

    async def _stats_loop(self) -> None:
        while True:
            await asyncio.sleep(self.stats_every_s)
            try:
                self.sweep_stats()
            except Exception:  # noqa: BLE001 - the loop never dies
                log.exception("snapshot.sweep_failed")

    async def _flusher(self) -> None:
        while True:
            raise_if_cancelled()
            await self._wake.wait()
            await asyncio.sleep(FLUSH_S)  # coalesce a burst (and let the broker apply it)
            self._wake.clear()
            try:
                await self._flush()
            except WritesFailed as exc:  # dirty keys are retried
                log.warning("snapshot.flush_failed %s: retried in %.0f s", exc, RETRY_S)
            except Exception:  # noqa: BLE001 - the loop never dies; dirty keys are retried
                log.exception("snapshot.flush_failed")
            else:
                continue
            self._wake.set()
            await asyncio.sleep(RETRY_S)

    async def _flush(self) -> None:
        """Write every dirty agent whose stored value would change, :data:`BATCH` at a time
        (each batch encoded just before it is sent, so a burst never holds the loop for more
        than a batch); on a failed batch its agents and every later one stay dirty."""
        if not self._dirty:
            return
        dirty, self._dirty = list(self._dirty), set()
        batch: list[tuple[str, _Written | None, bytes]] = []
        for i, agent_id in enumerate(dirty):
            write = self._write_of(agent_id)
            if write is not None:
                batch.append(write)
            if len(batch) == BATCH or (batch and i == len(dirty) - 1):
                try:
                    await self._write(batch)
                except BaseException:
                    # This batch's and the later ones' agents are written next round (the
                    # ones this batch did write are then unchanged: skipped).
                    self._dirty.update(w[0] for w in batch)
                    self._dirty.update(dirty[i + 1 :])
                    raise
                batch = []

    def _write_of(self, agent_id: str) -> tuple[str, _Written | None, bytes] | None:
        """What to write for ``agent_id``: (agent, what the bucket will hold or None for a
        delete, value); None when the bucket already holds it."""
        rec = self.registry.agents.get(agent_id)
        if rec is None:
            return (agent_id, None, b"") if agent_id in self._written else None
        # last_seen_ms and broker_id alone are not worth a write, nor a small drift.
        task_ms = rec.stats.task_ewma_ms
        old = self._written.get(agent_id)
        if old is not None and old[:2] == (rec.announce, rec.state):
            if not drifted(old[2], task_ms):
                return None
        task_ms = None if task_ms is None else round(task_ms, 1)
        value = schema.encoder.encode(
            SnapshotEntry(announce=rec.announce, state=rec.state,
                          last_seen_ms=rec.last_seen_wall_ms, broker_id=self.ctx.broker_id,
                          task_ms=task_ms)
        )  # fmt: skip
        return agent_id, (rec.announce, rec.state, task_ms), value

    async def _write(self, batch: list[tuple[str, _Written | None, bytes]]) -> None:
        """One round trip: the batch's publishes pipelined, their acks awaited together."""
        js, futures = self.js, []
        try:
            for agent_id, written, value in batch:
                if written is None:
                    futures.append(await js.publish_async(_SUBJECT + self.key(agent_id),
                                                          headers=_DELETE))  # fmt: skip
                else:
                    futures.append(await js.publish_async(_SUBJECT + self.key(agent_id), value))
            self.rounds += 1
            if futures:
                await asyncio.wait(futures, timeout=ACK_TIMEOUT_S)
        finally:
            for fut in futures:
                fut.cancel()  # unacknowledged (or interrupted): no longer waited for
        failed: list[str] = []
        error: BaseException | None = None
        for (agent_id, written, _), fut in zip(batch, futures, strict=True):
            if fut.cancelled() or fut.exception() is not None:
                failed.append(agent_id)
                error = error or (None if fut.cancelled() else fut.exception())
            elif written is None:
                self._written.pop(agent_id, None)
                self.writes += 1
            else:
                self._written[agent_id] = written
                self.writes += 1
        if failed:
            why = "not acknowledged in time" if error is None else repr(error)
            raise WritesFailed(f"{len(failed)} of {len(batch)} writes failed ({why})")
