"""A caller's copy of a capability's route table, and the partition an agent's share is in.

Brokers publish each capability's table as shares, one per partition of the fleet
(:func:`partition`: the agent id's FNV-1a 32 hash modulo the partition count, the hash
nats-server's ``partition()`` subject mapping uses), each versioned by its owner: a snapshot
(:class:`~reach_agent.wire.schema.TableShare`) then deltas
(:class:`~reach_agent.wire.schema.TableDelta`, ``prev`` → ``version`` within an ``epoch``).
:class:`RouteTable` applies them and says when one does not follow (a gap: ask for the share
again). Its agents are :class:`TableMember`s, routed with the same code the broker uses
(:class:`reach_agent.routing.choice.Chooser`).

A caller counts its own hand-outs exactly, since it sees its calls end
(:meth:`TableMember.handed_out`, :meth:`TableMember.handed_back`): the agent's last reported
``active`` (fading with its task time, as at a broker; less the caller's calls it counted that
ended since) plus the caller's calls sent since that report and still running. An agent's own
``TARGET_BUSY`` marks it full for about one task time (:meth:`TableMember.refused`).
"""

from __future__ import annotations

import math

import msgspec

from reach_agent.wire.errors import InvalidRequest
from reach_agent.wire.schema import PROTOCOL_REACH, TableDelta, TableEntry, TableShare, with_load

from .index import CapabilityIndex
from .member import NO_PERMISSIONS, Member, TaskStats, faded, weight
from .rules import Rule, decode_rule
from .settings import Settings

REFUSED_HOLD_MS = 100.0
"""How long an agent that answered TARGET_BUSY counts as full when its task time is unknown."""

_FNV_OFFSET = 0x811C9DC5
_FNV_PRIME = 0x01000193


def partition(agent_id: str, partitions: int) -> int:
    """The partition of ``agent_id``'s share: FNV-1a 32 of its bytes modulo ``partitions``
    (nats-server's ``partition(n, 1)`` of a subject whose first wildcard is the agent id)."""
    h = _FNV_OFFSET
    for byte in agent_id.encode():
        h = ((h ^ byte) * _FNV_PRIME) & 0xFFFFFFFF
    return h % partitions


class TableMember(Member):
    """One agent of a caller's route tables (shared by every table it is in)."""

    __slots__ = ("ended", "entry", "report", "sent")

    stats: TaskStats

    def __init__(self, entry: TableEntry, now: float) -> None:
        super().__init__(entry.agent_id, entry.max_concurrency, TaskStats())
        self.sent = 0
        """This caller's calls sent to it since its last report, still running."""
        self.report = 0
        """Reports applied so far: a call remembers the one it was sent under."""
        self.ended = 0
        """This caller's calls sent before the last report that ended since: the report's
        ``active`` counted them, they run no more."""
        self.entry = entry
        self.apply(entry, now)

    def apply(self, entry: TableEntry, now: float) -> int:
        """The agent as ``entry`` reports it, applied at ``now``: 2 when its state moved, 1
        when only its score did (how soon its tables re-rank), else 0."""
        moved = 2 if entry.state != self.state else 1 if entry.score != self.score else 0
        if moved == 2:
            self.state_since = now
        self.entry = entry
        self.state = entry.state
        self.max_concurrency = entry.max_concurrency
        self.stats.task_ewma_ms = entry.task_ms
        self.interval_s = entry.interval_ms / 1000.0
        self.region = entry.region
        self.version = entry.version
        self.tags = entry.tags
        perms = entry.permissions
        self.permissions = frozenset(perms) if perms else NO_PERMISSIONS
        self.context_window = entry.context_window
        self.set_context(entry.context_usage_pct)
        self.timeout_hint_ms = entry.timeout_hint_ms
        self.protocol = entry.protocol or PROTOCOL_REACH
        self.subject = entry.subject
        slow = entry.slow_start_ms
        self.recovered_at = None if slow is None else now - slow / 1000.0
        # A report replaces the hand-outs counted before it (as the heartbeat does at a
        # broker); calls still running from before are in its ``active``.
        self.last_seen = now
        self.report += 1
        self.sent = 0
        self.ended = 0
        self.full_until = -math.inf
        self.set_load(entry.active, entry.queue_depth)
        self.set_score(entry.score)
        return moved

    def in_flight(self, now: float) -> float:
        """Its last reported ``active`` (less this caller's calls it counted that ended
        since), fading with its task time from its last heartbeat (as at a broker:
        :meth:`heard_at`), plus this caller's calls sent since that report and still
        running."""
        base = float(self.active - self.ended if self.active > self.ended else 0)
        task_ms = self.stats.task_ewma_ms
        if base > 0.0 and task_ms is not None:
            base = faded(base, now - self.heard_at(now), task_ms)
        return base + self.sent

    def heard_at(self, now: float) -> float:
        """When its owner last heard it report its load, as far as the tables tell: the last
        report applied, or the last whole heartbeat interval since. An owner publishes a
        report only when it moved what the share says, so an agent heard saying the same
        load again is not published, and a routable one is heard every interval (silent,
        its owner would publish its move to ``suspect``). Counted from the last report
        instead, the ``active`` of an agent whose load never moved faded towards idle in
        every copy, though its owner heard it at every heartbeat (a broker's registry fades
        it from the last heartbeat)."""
        since = self.last_seen
        interval = self.interval_s
        if interval > 0.0 and now - since >= interval:
            since += (now - since) // interval * interval
        return since

    def handed_out(self, now: float) -> None:
        """This caller is sending it a task."""
        self.sent += 1
        self._set_busy(self.in_flight(now))

    def handed_back(self, now: float, report: int) -> None:
        """A call sent under report ``report`` ended: room again, whether it was counted by
        this caller (sent since the last report) or by the report."""
        if report == self.report:
            if self.sent > 0:
                self.sent -= 1
        else:
            self.ended += 1
        self.full_until = -math.inf
        self._set_busy(self.in_flight(now))

    def refused(self, now: float) -> None:
        """It answered ``TARGET_BUSY``: full for about one of its task times (100 ms without
        one; at most its heartbeat interval), when a slot is likely free again and the load
        filter looks again. Not an agent that reports no ``active`` (a Synadia agent)."""
        if self.protocol != PROTOCOL_REACH:
            return
        task_ms = self.stats.task_ewma_ms
        hold = (task_ms if task_ms is not None else REFUSED_HOLD_MS) / 1000.0
        self.full_until = now + min(max(hold, 0.01), self.interval_s)
        self.busy = 1.0
        self.weight = weight(self.score, 1.0)


class SharedMember(TableMember):
    """An agent of another owner's share as a broker counts it (a broker's route service
    follows the other owners' shares): its hand-outs counted as the broker counts its own
    agents' (:meth:`Member.handed_out`: fading with the task time, replaced by the next
    report), since a broker does not see the calls it routes end.

    The agent's next report is only seen when it changed what the share says (the owner
    publishes nothing else): a report that did not, said the load the share holds. So
    without a task time (nothing fades) a hand-out counts for one to two of the agent's
    heartbeat intervals (:meth:`_roll`), by when the agent has reported it, running (a
    changed ``active``, which the owner publishes and which replaces the count) or ended.
    Counted until the next published report instead, the hand-outs of an agent whose load
    never moved added up until it looked full for good (the owner of a capability routed
    every 12 ms lost each of the other owner's agents from its routes after about 14 picks
    of it)."""

    __slots__ = ("_before", "_window", "_window_at")

    def apply(self, entry: TableEntry, now: float) -> int:
        moved = super().apply(entry, now)
        # A report: no hand-out counted beyond it. Without a task time, the hand-outs of the
        # current window (begun at _window_at) and of the window before it count.
        self._window_at = now
        self._window = 0
        self._before = 0
        return moved

    def handed_out(self, now: float) -> None:
        Member.handed_out(self, now)
        if self.stats.task_ewma_ms is None and self.protocol == PROTOCOL_REACH:
            self._window += 1

    def in_flight(self, now: float) -> float:
        """With a task time, the last report's ``active`` fading from the agent's last
        heartbeat (:meth:`TableMember.heard_at`: a report that did not move the share is not
        published), or, when this broker handed it tasks since that report, the count at the
        last hand-out fading from then (:meth:`Member.in_flight`) if that is more; without
        one, the ``active`` the share says plus the hand-outs of the current window and the
        one before."""
        task_ms = self.stats.task_ewma_ms
        if task_ms is not None:
            active = self.active
            heard = faded(float(active), now - self.heard_at(now), task_ms) if active > 0 else 0.0
            if self.handed_at > self.last_seen:
                handed = Member.in_flight(self, now)
                return handed if handed > heard else heard
            return heard
        self._roll(now)
        return float(self.active + self._window + self._before)

    def _roll(self, now: float) -> None:
        """A heartbeat interval after the current window began, a new one begins: the
        window before is forgotten (its hand-outs at least one interval old), the current
        one becomes it (both forgotten after two intervals)."""
        elapsed = now - self._window_at
        interval = self.interval_s
        if elapsed >= interval:
            self._before = self._window if elapsed < 2 * interval else 0
            self._window = 0
            self._window_at = now


class RouteTable:
    """A caller's copy of one capability's route table: the union of its shares, each at its
    owner's ``(epoch, version)``; the members indexed and ranked as a broker ranks them."""

    __slots__ = ("capability", "index", "local", "member", "rule", "rule_raw", "settings",
                 "shares", "where")  # fmt: skip

    def __init__(self, capability: str, settings: Settings,
                 member: type[TableMember] = TableMember) -> None:  # fmt: skip
        self.capability = capability
        self.member = member
        """What its agents are made as (a caller's :class:`TableMember`, a broker's
        :class:`SharedMember`)."""
        self.index: CapabilityIndex[TableMember] = CapabilityIndex(capability)
        self.shares: dict[int, tuple[int, int]] = {}
        """Each share held: partition → (epoch, version)."""
        self.where: dict[str, int] = {}
        """Each member's partition."""
        self.local = False
        """Whether this caller may route the capability itself (no share yet: ask a broker)."""
        self.rule: Rule | None = None
        self.rule_raw = b""
        """The rule as last read (compiled again only when it changes: its split's round
        robin keeps its place)."""
        self.settings = settings

    def load(self, share: TableShare, members: dict[str, TableMember], now: float) -> None:
        """``share`` replaces what the table held of its partition."""
        p = share.partition
        keep = {e.agent_id for e in share.entries}
        for agent_id, q in list(self.where.items()):
            if q == p and agent_id not in keep:
                self._remove(agent_id, members)
        for entry in share.entries:
            self._upsert(entry, p, members, now)
        self.shares[p] = (share.epoch, share.version)
        self.settings = share.routing
        self._policy(share.local, share.rule)

    def apply(self, delta: TableDelta, members: dict[str, TableMember], now: float) -> bool:
        """Apply ``delta`` if it follows what the table holds of its share; False when it
        does not (a gap, another epoch, a share not held yet, or a load for an agent the
        table lacks): ask for the share."""
        held = self.shares.get(delta.partition)
        if held is None:
            return False
        if held[0] == delta.epoch and delta.version <= held[1]:
            return True  # already applied (a share fetched after this delta was made)
        if held != (delta.epoch, delta.prev):
            return False
        for agent_id in delta.removed:
            self._remove(agent_id, members)
        for entry in delta.upserts:
            self._upsert(entry, delta.partition, members, now)
        for load in delta.loads:
            m = members.get(load.agent_id)
            if m is None or load.agent_id not in self.where:
                return False  # a load for an agent this copy lacks: it missed something
            entry = with_load(m.entry, load)
            if entry is not m.entry:  # else: applied from another capability's delta
                self._upsert(entry, delta.partition, members, now)
        self.shares[delta.partition] = (delta.epoch, delta.version)
        self._policy(delta.local, delta.rule)
        return True

    def clear(self, p: int, members: dict[str, TableMember]) -> None:
        """Partition ``p`` has no agent of the capability (its owner holds no share of it)."""
        for agent_id, q in list(self.where.items()):
            if q == p:
                self._remove(agent_id, members)
        self.shares.pop(p, None)

    def drop(self, members: dict[str, TableMember]) -> None:
        """The caller stops following the capability: its members leave the shared map
        when no other table holds them."""
        for agent_id in list(self.where):
            self._remove(agent_id, members)
        self.shares.clear()

    def _upsert(self, entry: TableEntry, p: int, members: dict[str, TableMember],
                now: float) -> None:  # fmt: skip
        m = members.get(entry.agent_id)
        if m is None:
            m = members[entry.agent_id] = self.member(entry, now)
            moved = 0
        else:
            moved = 0 if m.entry is entry else m.apply(entry, now)
        if entry.agent_id not in self.where:
            self.where[entry.agent_id] = p
            m.capabilities = (*m.capabilities, self.capability)
            self.index.add(m)
        elif moved == 2:
            self.index.state_changed()
        elif moved == 1:
            self.index.score_changed()

    def _remove(self, agent_id: str, members: dict[str, TableMember]) -> None:
        if self.where.pop(agent_id, None) is None:
            return
        self.index.remove(agent_id)
        m = members.get(agent_id)
        if m is not None:
            m.capabilities = tuple(c for c in m.capabilities if c != self.capability)
            if not m.capabilities:
                del members[agent_id]

    def _policy(self, local: bool, rule: msgspec.Raw) -> None:
        """The capability's policy as its last share or delta says: a rule this caller
        cannot read (a newer broker's) makes it ask a broker instead."""
        self.local = local
        raw = bytes(rule)  # type: ignore[call-overload]
        if raw == b"null":
            raw = b""
        if raw == self.rule_raw:
            if self.rule is None and raw:
                self.local = False  # still unreadable
            return
        self.rule_raw = raw
        if not raw:
            self.rule = None
            return
        try:
            self.rule = Rule(decode_rule(self.capability, raw), "table")
        except InvalidRequest:
            self.rule, self.local = None, False
