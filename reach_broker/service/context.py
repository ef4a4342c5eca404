"""What a broker component is handed instead of the broker: :class:`BrokerContext`.

The probes, advisories, snapshot and replay each get one context (the connection, the
clocks, metrics, subjects, a task spawner and the one transitions fan-out) and, beside it,
exactly the collaborators they use (the registry, the router, the prober). None of them
sees the broker, so each can be built and tested on its own.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from nats.aio.client import Client as NATS

from reach_agent.wire import schema
from reach_agent.wire.schema import Event
from reach_agent.wire.subjects import Subjects
from reach_broker.config import Config
from reach_broker.core.records import AgentRecord, Transition

from .metrics import Metrics

log = logging.getLogger(__name__)

TransitionListener = Callable[[Transition, AgentRecord | None], None]
"""Told of every transition, with the agent's record (None once it is evicted)."""
AnnounceListener = Callable[[AgentRecord], None]
"""Told of every accepted announce, also one that changes no state."""


class Tasks:
    """Short background tasks the broker owns (event publishes, a reconcile): spawned
    without being awaited, waited for (then cancelled) at stop."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[Any]] = set()

    def spawn(self, coro: Awaitable[Any], name: str) -> None:
        task = asyncio.ensure_future(coro)
        task.set_name(name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def settle(self, grace_s: float) -> None:
        """Wait up to ``grace_s`` for the running tasks, then cancel what is left."""
        if not self._tasks:
            return
        await asyncio.wait(self._tasks, timeout=grace_s)
        for task in list(self._tasks):
            task.cancel()


class Link:
    """The broker's own link to NATS as its components see it (set by the observer from the
    connection's callbacks)."""

    __slots__ = ("connected", "epoch", "since")

    def __init__(self) -> None:
        self.connected = True
        """False from the connection's loss to its return."""
        self.epoch = 0
        """Outages so far: a measurement spanning a change of epoch spans an outage."""
        self.since = 0.0
        """Monotonic time of the last loss or return."""

    def lost(self, now: float) -> None:
        self.connected = False
        self.epoch += 1
        self.since = now

    def regained(self, now: float) -> None:
        self.connected = True
        self.epoch += 1
        self.since = now


class Fanout:
    """Where every registry change goes: published as an ``Event`` on
    ``<prefix>.event.<kind>.<agent_id>``, counted, logged, and handed to every listener
    (probes, snapshot, replay; tests and the chaos run add their own).

    O(1) a transition: the event is encoded and queued, and one background task (spawned
    when the queue was empty) publishes what is queued, in order, so a burst of n
    transitions is one task and n publishes, not n tasks."""

    def __init__(
        self,
        nc: NATS,
        subjects: Subjects,
        metrics: Metrics,
        broker_id: str,
        wall: Callable[[], float],
        spawn: Callable[[Awaitable[Any], str], None],
        record_of: Callable[[str], AgentRecord | None],
        link: Link | None = None,
    ) -> None:
        self._nc = nc
        self.link = link or Link()
        self.withheld = 0
        """Events not published because the broker's link was down when they were made."""
        self._subjects = subjects
        self._metrics = metrics
        self._broker_id = broker_id
        self._wall = wall
        self._spawn = spawn
        self._record_of = record_of
        self.listeners: list[TransitionListener] = []
        self.announce_listeners: list[AnnounceListener] = []
        self._outbox: list[tuple[str, bytes]] = []
        """Events made and not yet handed to the connection, oldest first."""
        self._draining = False
        """Whether a task publishing the outbox is under way."""
        self._changes: dict[str, Any] = {}
        """``reach_registry_changes_total`` and ``reach_state_changes_total`` children, by
        label (a label look-up is a lock and a tuple: once per label, not per event)."""

    def emit(self, transitions: list[Transition]) -> None:
        """Publish events for ``transitions`` and tell the listeners."""
        at_ms = int(self._wall() * 1000)
        m = self._metrics
        logs = log.isEnabledFor(logging.INFO)
        for t in transitions:
            event = Event(
                kind=t.kind, agent_id=t.agent_id, reason=t.reason, at_ms=at_ms,
                broker_id=self._broker_id, to=t.to, from_=t.from_,
            )  # fmt: skip
            if self.link.connected:
                if not self._draining:
                    self._draining = True
                    self._spawn(self._drain(), "event")
                self._outbox.append(
                    (self._subjects.event(t.kind, t.agent_id), schema.encoder.encode(event))
                )
            else:  # nats-py would buffer it and send it after the fact: never
                self.withheld += 1
                m.dropped.labels("event", "link_down").inc()
            self._count(t)
            if logs:
                log.info("agent.%s agent=%s%s%s reason=%s", t.kind, t.agent_id,
                         "" if t.from_ is None else f" from={t.from_}",
                         "" if t.to is None else f" to={t.to}", t.reason)  # fmt: skip
            rec = self._record_of(t.agent_id)
            for listener in self.listeners:
                try:
                    listener(t, rec)
                except Exception:  # noqa: BLE001 - a listener never breaks the broker
                    log.exception("broker.listener failed transition=%s", t)

    def _count(self, t: Transition) -> None:
        changes = self._changes
        kind = changes.get(t.kind)
        if kind is None:
            kind = changes[t.kind] = self._metrics.registry_changes.labels(t.kind)
        kind.inc()
        if t.to is not None and t.kind != "registered":
            state = changes.get("to:" + t.to)
            if state is None:
                state = changes["to:" + t.to] = self._metrics.state_changes.labels(t.to)
            state.inc()

    async def _drain(self) -> None:
        """Publish the outbox, oldest first, until it is empty."""
        try:
            while self._outbox:
                batch, self._outbox = self._outbox, []
                for i, (subject, body) in enumerate(batch):
                    if not self.link.connected:  # dropped since the emit: withheld
                        self.withheld += len(batch) - i
                        self._metrics.dropped.labels("event", "link_down").inc(len(batch) - i)
                        break
                    try:
                        await self._nc.publish(subject, body)
                    except Exception as exc:  # noqa: BLE001 - closed: counted, not raised
                        lost = len(batch) - i + len(self._outbox)
                        self._outbox = []
                        self._metrics.dropped.labels("event", "error").inc(lost)
                        log.warning("broker.events_not_published count=%d error=%r", lost, exc)
                        return
        finally:
            self._draining = False

    def announced(self, rec: AgentRecord) -> None:
        """An announce was accepted (whether or not it moved a state)."""
        for listener in self.announce_listeners:
            try:
                listener(rec)
            except Exception:  # noqa: BLE001 - a listener never breaks the broker
                log.exception("broker.announce_listener failed agent=%s", rec.agent_id)


@dataclass(frozen=True, kw_only=True, slots=True)
class BrokerContext:
    """The broker's shared parts, as one component sees them."""

    cfg: Config
    """The whole configuration (each component reads its own section)."""
    nc: NATS
    """The broker's connection (connected before any component starts)."""
    subjects: Subjects
    metrics: Metrics
    broker_id: str
    clock: Callable[[], float]
    """Monotonic seconds: every deadline and duration."""
    wall: Callable[[], float]
    """Unix seconds: timestamps that leave the process."""
    spawn: Callable[[Awaitable[Any], str], None]
    """Run a short task in the background; the broker waits for it at stop."""
    fanout: Fanout
    """Where transitions go (:meth:`Fanout.emit`) and where to listen for them."""
    link: Link = field(default_factory=Link)
    """The broker's own link: a measurement across its outage is not the agent's."""
    spans: Any = None
    """OpenTelemetry spans of route requests (:mod:`reach_agent.otel`; None: off)."""

    def wall_ms(self) -> int:
        return int(self.wall() * 1000)
