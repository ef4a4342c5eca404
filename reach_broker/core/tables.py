"""The route tables a broker publishes: each capability's agents as callers route them.

A capability's table is the union of its shares, one per partition of the fleet
(:func:`reach_agent.routing.table.partition`). A broker publishes the shares of the
partitions it owns (``service/partitions.py``: a lease each) and only those.
:class:`TableBook` keeps, per share, the entries as last published and its version within the
owner's epoch. :meth:`TableBook.touch` takes in agents that changed (the registry's
``changed``), as many at a time as the caller likes, and :meth:`TableBook.cut` turns all it
took in since the last cut into one :class:`~reach_agent.wire.schema.TableDelta` per share
that moved: an agent whose load or score alone moved as a
:class:`~reach_agent.wire.schema.TableLoad`, any other change as its whole entry
(:meth:`TableBook.changes` is both at once). An agent is taken in at most once between two
cuts. Pure: the service publishes what it returns.

A share holds every member of the capability in its partition, whatever its state (the
ranking's panic rule counts them), as :func:`entry_of` makes it; an agent leaves a share when
it is evicted or stops announcing the capability. A share emptied stays (its version goes on,
so a caller's copy follows it).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import msgspec

from reach_agent.routing.table import partition
from reach_agent.wire.schema import (
    PROTOCOL_REACH,
    TableDelta,
    TableEntry,
    TableLoad,
    TableRouting,
    TableShare,
    with_load,
)
from reach_broker.config import RoutingSection

from .records import AgentRecord

Policy = tuple[bool, msgspec.Raw]
"""What a capability's shares say of it besides its agents: (callers may route it
themselves, its route rule's JSON, ``NO_RULE`` for none)."""


def routing_of(cfg: RoutingSection) -> TableRouting:
    """broker.toml's ``[routing]`` as the tables carry it."""
    return TableRouting(
        choice=cfg.choice, pool_factor=cfg.pool_factor, vnodes=cfg.vnodes,
        min_reach_score=cfg.min_reach_score, load_watermark=cfg.load_watermark,
        slow_start_share=cfg.slow_start_share, slow_start_s=cfg.slow_start_s,
        max_eject_share=cfg.max_eject_share, panic_threshold=cfg.panic_threshold,
        rank_refresh_ms=cfg.rank_refresh_ms,
    )  # fmt: skip


NO_PERMISSIONS: list[str] = []
"""The permissions of every entry whose agent announces none (one list, not one each)."""


def entry_of(rec: AgentRecord, now: float, slow_start_s: float) -> TableEntry:
    """``rec`` as a route-table entry at ``now``: its score to a tenth (a score that only
    drifts does not make a new entry at every heartbeat; the registry's score is rounded so
    already, and its float is shared)."""
    slow = None
    if rec.recovered_at is not None and now - rec.recovered_at < 2 * slow_start_s:
        slow = int((now - rec.recovered_at) * 1000)
    task_ms = rec.stats.task_ewma_ms
    return TableEntry(
        agent_id=rec.agent_id, state=rec.state, score=rec.score,
        max_concurrency=rec.max_concurrency, active=rec.active, queue_depth=rec.queue_depth,
        task_ms=None if task_ms is None else round(task_ms, 1),
        interval_ms=int(rec.interval_s * 1000), slow_start_ms=slow, region=rec.region,
        version=rec.version, tags=rec.tags,
        permissions=sorted(rec.permissions) if rec.permissions else NO_PERMISSIONS,
        context_window=rec.context_window, context_usage_pct=rec.context_usage_pct,
        timeout_hint_ms=rec.timeout_hint_ms,
        protocol=None if rec.protocol == PROTOCOL_REACH else rec.protocol, subject=rec.subject,
    )  # fmt: skip


def same_shape(entry: TableEntry, rec: AgentRecord, now: float, slow_start_s: float) -> bool:
    """Whether :func:`entry_of` would make ``entry`` again for ``rec`` but for its load
    figures (:func:`load_of`), given that ``rec``'s announce, and so every field that only an
    announce sets, is the one ``entry`` was made from: its state, and no slow start."""
    return (
        entry.state == rec.state
        and entry.slow_start_ms is None
        and (rec.recovered_at is None or now - rec.recovered_at >= 2 * slow_start_s)
    )


def load_of(rec: AgentRecord) -> TableLoad:
    """``rec``'s load figures as its entry carries them (task time to a tenth)."""
    task_ms = rec.stats.task_ewma_ms
    return TableLoad(rec.agent_id, rec.active, rec.queue_depth, rec.score,
                     None if task_ms is None else round(task_ms, 1),
                     rec.context_usage_pct)  # fmt: skip


class Share:
    """One share as last published: its entries by agent id and its version."""

    __slots__ = ("capability", "entries", "moved", "partition", "pending", "stored", "version")

    def __init__(self, capability: str, p: int) -> None:
        self.capability = capability
        self.partition = p
        self.entries: dict[str, TableEntry] = {}
        self.pending: _Touched | None = None
        """What its next delta says (None: nothing taken in since the last cut)."""
        self.version = 0
        self.stored = -1
        """The version last written to the store (KV ``reach_tables``)."""
        self.moved = True
        """Since it was last stored, an agent joined or left it, one's state moved, or the
        capability's policy did (not only load and score drift): store it soon."""


class Known(msgspec.Struct, gc=False):
    """What the book last said of one agent of a partition it owns: the partition, the
    capabilities (the shares it is in), its entry and the announce that entry was made from
    (one object an agent: its entry is shared by its shares, not copied). Not tracked by the
    garbage collector (16 B less an agent): it holds no container that could hold it."""

    partition: int
    caps: tuple[str, ...] = ()
    shares: tuple[Share, ...] = ()
    """The shares of ``caps`` (a heartbeat's load goes to each without looking them up)."""
    entry: TableEntry | None = None
    announce: object = None


class _Touched:
    """What one share's next delta says: entries upserted, agents removed, loads."""

    __slots__ = ("loads", "removed", "upserts")

    def __init__(self) -> None:
        self.upserts: list[TableEntry] = []
        self.removed: list[str] = []
        self.loads: list[TableLoad] = []


class TableBook:
    """Every share this broker publishes, and what changed since it last said."""

    def __init__(
        self,
        partitions: int,
        routing: RoutingSection,
        policy: Callable[[str], Policy],
    ) -> None:
        self.partitions = partitions
        self.routing = routing
        self.settings = routing_of(routing)
        self.policy = policy
        """A capability's (local, rule) now (quotas and rules are the broker's)."""
        self.epochs: dict[int, int] = {}
        """The partitions owned, each with its epoch (its lease's)."""
        self.shares: dict[tuple[int, str], Share] = {}
        self.known: dict[str, Known] = {}
        """Each agent of an owned partition, as last published."""
        self._policies: dict[str, Policy] = {}
        self._touched: list[Share] = []
        """The shares that moved since the last cut, in the order they first did (each holds
        what its delta says: ``Share.pending``)."""

    def partition_of(self, agent_id: str) -> int:
        known = self.known.get(agent_id)
        return known.partition if known is not None else partition(agent_id, self.partitions)

    # --- ownership ---------------------------------------------------------------------------

    def own(
        self,
        p: int,
        epoch: int,
        agents: dict[str, AgentRecord],
        now: float,
        ids: list[str] | None = None,
    ) -> list[TableDelta]:
        """Partition ``p`` is this broker's from now on, in ``epoch``: its shares start
        afresh from the registry's ``agents`` — those of ``ids`` (the partition's, from the
        registry's listing: O(partition)), or every agent found in ``p`` (O(fleet))."""
        self.disown(p)
        self.epochs[p] = epoch
        mine = ids if ids is not None else [a for a in agents if self.partition_of(a) == p]
        return self.changes(mine, agents.get, now)

    def disown(self, p: int) -> None:
        """Partition ``p`` is no longer this broker's: its shares are forgotten."""
        self.epochs.pop(p, None)
        for key in [k for k in self.shares if k[0] == p]:
            del self.shares[key]
        # Taken in for the old epoch: not said in the new.
        self._touched = [share for share in self._touched if share.partition != p]
        for agent_id in [a for a, k in self.known.items() if k.partition == p]:
            del self.known[agent_id]

    # --- changes ------------------------------------------------------------------------------

    def changes(
        self, changed: Iterable[str], record: Callable[[str], AgentRecord | None], now: float
    ) -> list[TableDelta]:
        """:meth:`touch` then :meth:`cut`: the deltas that take every share from what was
        last published to the agents ``changed`` (and any taken in before) as they are now."""
        self.touch(changed, record, now)
        return self.cut()

    def cut(self) -> list[TableDelta]:
        """The deltas of everything taken in since the last cut: one per share that moved,
        its version advanced."""
        touched, self._touched = self._touched, []
        deltas = []
        for share in touched:
            t = share.pending
            assert t is not None
            share.pending = None
            deltas.append(self._delta(share.partition, share.capability, t.upserts, t.removed,
                                      t.loads))  # fmt: skip
        return deltas

    def touch(
        self, changed: Iterable[str], record: Callable[[str], AgentRecord | None], now: float
    ) -> None:
        """Take in the agents ``changed`` as ``record`` knows them now (None: evicted), for
        the next :meth:`cut`; agents of partitions not owned are skipped. An agent whose load
        or score alone moved (its announce, capabilities, state and slow start as published)
        goes out as a :class:`~reach_agent.wire.schema.TableLoad`, not its whole entry. Each
        share's entries move at once (a request for the share reads them); its version at
        the cut."""
        slow_s = self.routing.slow_start_s
        touched = self._touched
        epochs, known, partitions, shares = self.epochs, self.known, self.partitions, self.shares
        for agent_id in changed:
            k = known.get(agent_id)
            p = k.partition if k is not None else partition(agent_id, partitions)
            if p not in epochs:
                continue
            rec = record(agent_id)
            if k is None:
                if rec is None:
                    continue  # never published
                k = known[agent_id] = Known(p)
            old_caps = k.caps
            caps = rec.capabilities if rec is not None else ()
            entry = None
            if rec is not None:
                last = k.entry
                if (
                    last is not None
                    and k.announce is rec.announce
                    and same_shape(last, rec, now, slow_s)
                ):
                    load = load_of(rec)
                    entry = with_load(last, load)
                    if caps == old_caps:  # most heartbeats: at most the load moved
                        if entry is last:
                            continue  # nothing the tables say moved
                        k.entry = entry
                        # _pending(), inline: through the method the touch of 10,000 agents
                        # (3 capabilities each) took 2.98-4.36 µs an agent against 2.68-3.35
                        # (medians, alternated 4x).
                        for share in k.shares:
                            share.entries[agent_id] = entry
                            t = share.pending
                            if t is None:
                                t = share.pending = _Touched()
                                touched.append(share)
                            t.loads.append(load)
                        continue
                    k.entry = entry  # its capabilities moved: whole entries below
                else:
                    entry = k.entry = entry_of(rec, now, slow_s)
                    k.announce = rec.announce
            held = tuple(self._share(p, cap) for cap in caps)
            for share in held:
                old = share.entries.get(agent_id)
                if old is not entry:
                    assert entry is not None
                    share.entries[agent_id] = entry
                    if old is None or old.state != entry.state:
                        share.moved = True
                    self._pending(share).upserts.append(entry)
            for cap in old_caps:
                if cap not in caps:
                    gone = shares.get((p, cap))
                    if gone is not None and gone.entries.pop(agent_id, None) is not None:
                        gone.moved = True
                        self._pending(gone).removed.append(agent_id)
            if rec is None:
                del known[agent_id]
            else:
                k.caps = caps
                k.shares = held

    def policies_changed(self) -> list[TableDelta]:
        """A delta for every share of each capability whose policy (local, rule) moved since
        it was last said (a rule set or cleared, a quota)."""
        deltas = []
        for cap in {c for _, c in self.shares}:
            now = self.policy(cap)
            if self._policies.get(cap) != now:
                for key, share in self.shares.items():
                    if key[1] == cap:
                        share.moved = True
                        deltas.append(self._delta(key[0], cap, [], []))
        return deltas

    def _delta(
        self, p: int, cap: str, upserts: list[TableEntry], removed: list[str],
        loads: list[TableLoad] | None = None,
    ) -> TableDelta:  # fmt: skip
        share = self._share(p, cap)  # an emptied share stays: its version goes on
        prev = share.version
        share.version = version = prev + 1
        local, rule = self._policies[cap] = self.policy(cap)
        return TableDelta(capability=cap, partition=p, epoch=self.epochs[p], version=version,
                          prev=prev, upserts=upserts, removed=removed, local=local,
                          rule=rule, loads=loads or [])  # fmt: skip

    def _pending(self, share: Share) -> _Touched:
        """What ``share``'s next delta says (started, and the share listed, at its first)."""
        t = share.pending
        if t is None:
            t = share.pending = _Touched()
            self._touched.append(share)
        return t

    def _share(self, p: int, cap: str) -> Share:
        share = self.shares.get((p, cap))
        if share is None:
            share = self.shares[(p, cap)] = Share(cap, p)
        return share

    # --- whole shares ---------------------------------------------------------------------------

    def share(self, p: int, cap: str, at_ms: int) -> TableShare:
        """The share of ``cap`` in partition ``p`` as last published (empty if none)."""
        share = self.shares.get((p, cap))
        local, rule = self.policy(cap)
        return TableShare(
            capability=cap, partition=p, epoch=self.epochs.get(p, 0),
            version=share.version if share is not None else 0,
            entries=list(share.entries.values()) if share is not None else [], local=local,
            rule=rule, routing=self.settings, at_ms=at_ms,
        )  # fmt: skip

    def of(self, cap: str) -> list[Share]:
        """The shares of ``cap`` this broker holds."""
        return [s for (_, c), s in self.shares.items() if c == cap]
