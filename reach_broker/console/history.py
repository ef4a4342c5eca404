"""What the console remembers, in bounded memory: per agent a ring of samples (score, task
time, load) and its last transitions; for the fleet the event timeline.

Pure (no I/O; times are arguments). Samples are taken for the whole fleet on one tick every
``sample_s`` (:meth:`History.sample`: O(fleet) per tick, nothing per heartbeat), so every
agent's ring lines up with the one ring of tick times. A ring is an ``array('f')`` of three
floats per sample: with its record about 0.9 KiB an agent for 60 samples (5 minutes at 5 s),
0.6 KiB more once it has had a transition.
"""

from __future__ import annotations

import math
from array import array
from collections import deque
from collections.abc import Iterable
from typing import NamedTuple

import msgspec

from reach_agent.wire.schema import Event
from reach_broker.core.records import AgentRecord

TRANSITIONS = 16
"""Transitions kept per agent."""
SAME_WITHIN_MS = 2000
"""An event equal to one just seen from another broker replica is that one, seen twice."""


class Entry(NamedTuple):
    """One event of the timeline, with every broker replica that reported it."""

    event: Event
    brokers: list[str]


class Series:
    """One agent's samples, on the fleet's ticks, and its last transitions."""

    __slots__ = ("first_tick", "transitions", "values")

    def __init__(self, capacity: int, first_tick: int) -> None:
        self.values = array("f", [math.nan]) * (3 * capacity)
        self.first_tick = first_tick
        self.transitions: deque[Entry] | None = None
        """Made at the first transition (an empty deque alone is 0.6 KiB)."""


class Samples(msgspec.Struct):
    """An agent's samples, oldest first (``None`` where nothing was measured)."""

    at_ms: list[int] = msgspec.field(default_factory=list)
    score: list[float | None] = msgspec.field(default_factory=list)
    task_ms: list[float | None] = msgspec.field(default_factory=list)
    load: list[float | None] = msgspec.field(default_factory=list)


class History:
    """The console's memory of the fleet."""

    def __init__(self, sample_s: float, history_s: float, events: int) -> None:
        self.capacity = max(2, math.ceil(history_s / sample_s))
        self.ticks = 0
        """Samples taken so far (the next tick's number)."""
        self._tick_ms = array("d", [0.0]) * self.capacity
        self.series: dict[str, Series] = {}
        self.events: deque[Entry] = deque(maxlen=events)

    # --- samples -------------------------------------------------------------------------------

    def sample(self, wall_ms: int, agents: Iterable[AgentRecord]) -> None:
        """One tick: every agent's score, task-time EWMA and load; agents gone are forgotten."""
        pos = self.ticks % self.capacity
        self._tick_ms[pos] = wall_ms
        seen = set()
        cap = self.capacity
        for rec in agents:
            s = self.series.get(rec.agent_id)
            if s is None:
                s = self.series[rec.agent_id] = Series(cap, self.ticks)
            elif s.first_tick < 0:
                s.first_tick = self.ticks  # made by an event before its first sample
            task = rec.stats.task_ewma_ms
            i = 3 * pos
            s.values[i] = rec.score
            s.values[i + 1] = math.nan if task is None else task
            s.values[i + 2] = rec.load
            seen.add(rec.agent_id)
        for agent_id in [a for a in self.series if a not in seen]:
            del self.series[agent_id]
        self.ticks += 1

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
            for j, column in enumerate((out.score, out.task_ms, out.load)):
                value = s.values[3 * pos + j]
                column.append(None if math.isnan(value) else round(value, 2))
        return out

    # --- events --------------------------------------------------------------------------------

    def event(self, event: Event) -> Entry | None:
        """Add ``event`` to the timeline and to its agent's transitions; None when it is one
        already there (the same transition reported by another broker replica)."""
        for entry in reversed(self.events):
            old = entry.event
            if event.at_ms - old.at_ms > SAME_WITHIN_MS:
                break
            if (old.kind, old.agent_id, old.from_, old.to, old.request_id) == (
                event.kind, event.agent_id, event.from_, event.to, event.request_id
            ) and event.broker_id not in entry.brokers:  # fmt: skip
                entry.brokers.append(event.broker_id)
                return None
        entry = Entry(event, [event.broker_id])
        self.events.append(entry)
        s = self.series.get(event.agent_id)
        if s is None and event.kind != "evicted":
            s = self.series[event.agent_id] = Series(self.capacity, -1)
        if s is not None:
            if s.transitions is None:
                s.transitions = deque(maxlen=TRANSITIONS)
            s.transitions.append(entry)
        return entry

    def transitions(self, agent_id: str) -> list[Entry]:
        s = self.series.get(agent_id)
        return list(s.transitions) if s is not None and s.transitions is not None else []
