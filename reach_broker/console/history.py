"""What the console remembers, in bounded memory: per agent a ring of samples (score, task
time, load) and its last transitions; for the fleet the event timeline.

Pure (no I/O; times are arguments). Samples are taken on one tick every ``sample_s``
(:meth:`History.sample`, nothing per heartbeat), so every agent's ring lines up with the one
ring of tick times. A ring holds 8 bytes a sample (:data:`SAMPLE`: the score and the load
in hundredths and ten-thousandths, as exact as the page shows them, the task time a
float32): with its record about 0.55 KiB an agent for 60 samples (5 minutes at 5 s), plus
its last transitions (a list of at most :data:`TRANSITIONS` timeline entries). At most
``chart_agents`` agents have a ring (1,000 by default): a tick costs O(min(fleet,
chart_agents)) and the rings' memory is bounded whatever the fleet. Beyond that bound the
charts are a sample: the first agents seen, then whoever a viewer asks for
(:meth:`History.watch`: the ring asked for least recently goes to it), and an agent without
a ring shows its transitions still in the timeline.

An event costs O(1): a replica's copy of a transition is found by the transition's key in a
dict of the timeline's entries (kept exactly as long as the entry is in the timeline), not
by a scan, so a burst of n transitions costs n look-ups whatever its length.
"""

from __future__ import annotations

import math
import struct
from array import array
from collections import deque
from collections.abc import Iterable, Mapping
from sys import intern
from typing import NamedTuple

import msgspec

from reach_agent.wire.schema import Event
from reach_broker.core.records import AgentRecord

TRANSITIONS = 16
"""Transitions kept per agent."""
SAME_WITHIN_MS = 2000
"""An event equal to one just seen from another broker replica is that one, seen twice."""

SAMPLE = struct.Struct("<HfH")
"""One sample: score x 100, task time (ms, float32), load x 10,000; NONE / NaN: unmeasured."""
NONE = 0xFFFF
_UNMEASURED = SAMPLE.pack(NONE, math.nan, NONE)

Key = tuple[str, str, str | None, str | None, str | None]
"""What makes two events the same transition: kind, agent, from, to, request id."""


def key_of(event: Event) -> Key:
    return (event.kind, event.agent_id, event.from_, event.to, event.request_id)


class Entry(NamedTuple):
    """One event of the timeline, with every broker replica that reported it."""

    event: Event
    brokers: list[str]


class Series:
    """One agent's samples, on the fleet's ticks, and its last transitions."""

    __slots__ = ("first_tick", "transitions", "values")

    def __init__(self, capacity: int, first_tick: int) -> None:
        self.values = bytearray(_UNMEASURED * capacity)
        self.first_tick = first_tick
        self.transitions: list[Entry] | None = None
        """Made at the first transition: a list (a deque, even empty, is 0.6 KiB), the
        oldest dropped past :data:`TRANSITIONS` (O(TRANSITIONS), at most once an event)."""


class Samples(msgspec.Struct):
    """An agent's samples, oldest first (``None`` where nothing was measured)."""

    at_ms: list[int] = msgspec.field(default_factory=list)
    score: list[float | None] = msgspec.field(default_factory=list)
    task_ms: list[float | None] = msgspec.field(default_factory=list)
    load: list[float | None] = msgspec.field(default_factory=list)


class History:
    """The console's memory of the fleet."""

    def __init__(
        self, sample_s: float, history_s: float, events: int, chart_agents: int = 1_000
    ) -> None:
        self.capacity = max(2, math.ceil(history_s / sample_s))
        self.chart_agents = chart_agents
        """Agents with a ring at most."""
        self.ticks = 0
        """Samples taken so far (the next tick's number)."""
        self._tick_ms = array("d", [0.0]) * self.capacity
        self.series: dict[str, Series] = {}
        """The rings, the one a viewer asked for least recently (or charted first) first."""
        self.events: deque[Entry] = deque(maxlen=events)
        self._latest: dict[Key, Entry] = {}
        """The newest timeline entry of each transition key (only entries still in the
        timeline: bounded by ``events``)."""
        self.compared = 0
        """Entries an event was compared with to find whether it is a copy: at most one an
        event (what a test counts: a burst stays linear)."""

    # --- samples -------------------------------------------------------------------------------

    def sample(self, wall_ms: int, agents: Mapping[str, AgentRecord]) -> None:
        """One tick: each charted agent's score, task-time EWMA and load; agents gone are
        forgotten. While there is room (fewer rings than ``chart_agents``) every agent of
        ``agents`` is looked at, newcomers charted; once full, only the charted ones
        (O(chart_agents) whatever the fleet)."""
        pos = self.ticks % self.capacity
        self._tick_ms[pos] = wall_ms
        series, cap, tick, offset = self.series, self.capacity, self.ticks, SAMPLE.size * pos
        pack = SAMPLE.pack_into
        room = self.chart_agents - len(series)
        if room > 0:
            pairs: Iterable[tuple[str, AgentRecord | None]] = agents.items()
        else:
            pairs = [(agent_id, agents.get(agent_id)) for agent_id in series]
        seen = 0
        for agent_id, rec in pairs:
            if rec is None:
                continue  # gone: forgotten below
            s = series.get(agent_id)
            if s is None:
                if room <= 0:
                    continue  # beyond chart_agents: no ring
                room -= 1
                s = series[agent_id] = Series(cap, tick)
            elif s.first_tick < 0:
                s.first_tick = tick  # made by an event before its first sample
            task = rec.stats.task_ewma_ms
            score = min(round(rec.score * 100), NONE - 1)
            load = min(round(rec.load * 10_000), NONE - 1)
            pack(s.values, offset, score, math.nan if task is None else task, load)
            seen += 1
        if len(series) > seen:  # rings of agents no longer in the registry
            for agent_id in [a for a in series if a not in agents]:
                del series[agent_id]
        self.ticks += 1

    def watch(self, agent_id: str) -> None:
        """A viewer asks for ``agent_id``'s chart: its ring, if it has one, is the last to be
        given away; if not, it gets one from the next tick on, taken from the agent asked for
        least recently when all ``chart_agents`` are in use (that agent's samples are lost:
        the charts beyond the bound are a sample). O(1)."""
        series = self.series
        s = series.pop(agent_id, None)
        if s is None:
            if self.chart_agents <= 0:
                return
            if len(series) >= self.chart_agents:
                del series[next(iter(series))]
            s = Series(self.capacity, -1)
            s.transitions = self.transitions(agent_id) or None
        series[agent_id] = s

    def samples(self, agent_id: str) -> Samples:
        """``agent_id``'s samples over the kept window, oldest first (empty when unknown)."""
        s = self.series.get(agent_id)
        out = Samples()
        if s is None or s.first_tick < 0:
            return out
        start = max(s.first_tick, self.ticks - self.capacity)
        for tick in range(start, self.ticks):
            pos = tick % self.capacity
            out.at_ms.append(int(self._tick_ms[pos]))
            score, task, load = SAMPLE.unpack_from(s.values, SAMPLE.size * pos)
            out.score.append(None if score == NONE else score / 100)
            out.task_ms.append(None if math.isnan(task) else round(task, 2))
            out.load.append(None if load == NONE else round(load / 10_000, 2))
        return out

    # --- events --------------------------------------------------------------------------------

    def event(self, event: Event) -> Entry | None:
        """Add ``event`` to the timeline and to its agent's transitions; None when it is one
        already there (the same transition reported by another broker replica within
        :data:`SAME_WITHIN_MS`). O(1): one look-up of the transition's key."""
        key = key_of(event)
        latest = self._latest.get(key)
        if latest is not None:
            self.compared += 1
            if (
                event.at_ms - latest.event.at_ms <= SAME_WITHIN_MS
                and event.broker_id not in latest.brokers
            ):
                latest.brokers.append(event.broker_id)
                return None
        events = self.events
        if len(events) == events.maxlen:  # the oldest leaves the timeline: and its key
            oldest = events[0]
            old_key = key_of(oldest.event)
            if self._latest.get(old_key) is oldest:
                del self._latest[old_key]
        # Kept for a while (the timeline, the agent's transitions): its repeated strings
        # shared (one broker id, reason and agent id for all of them, not one each).
        event = msgspec.structs.replace(event, agent_id=intern(event.agent_id),
                                        broker_id=intern(event.broker_id),
                                        reason=intern(event.reason))  # fmt: skip
        entry = Entry(event, [event.broker_id])
        events.append(entry)
        self._latest[key] = entry
        s = self.series.get(event.agent_id)
        if s is None and event.kind != "evicted" and len(self.series) < self.chart_agents:
            s = self.series[event.agent_id] = Series(self.capacity, -1)
        if s is not None:
            if s.transitions is None:
                s.transitions = [entry]
            else:
                s.transitions.append(entry)
                if len(s.transitions) > TRANSITIONS:
                    del s.transitions[0]
        return entry

    def transitions(self, agent_id: str) -> list[Entry]:
        """``agent_id``'s last transitions: its own list while it has a ring, else those still
        in the timeline (O(events), asked by a viewer only)."""
        s = self.series.get(agent_id)
        if s is not None and s.transitions is not None:
            return list(s.transitions)
        return [e for e in self.events if e.event.agent_id == agent_id][-TRANSITIONS:]
