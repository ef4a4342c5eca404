"""Where every registry change goes, in the order the broker names: :class:`Fanout`.

A transition — made by a handler, a probe's answer, an advisory, the tick — is published as
an ``Event`` on ``<prefix>.event.<kind>.<agent_id>`` (never while the broker's link is down:
nats-py would buffer it and send it after the fact), counted, logged, and handed to each
consumer in turn. The consumers are given at construction, in order, by the one place the
broker is built (:class:`reach_broker.broker.Broker`); nothing registers itself.

O(1) a transition: the event is encoded and queued, and one background task (spawned when
the queue was empty) publishes what is queued, in order, so a burst of n transitions is one
task and n publishes, not n tasks.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

from reach_agent.wire import schema
from reach_agent.wire.schema import Event
from reach_broker.core.records import AgentRecord, Transition

from .context import BrokerContext

log = logging.getLogger(__name__)

Consumer = Callable[[Transition, AgentRecord | None], None]
"""Told of every transition, with the agent's record (None once it is evicted). A consumer
whose component is not running ignores it."""


class Fanout:
    """The broker's pipeline: events published, counted, logged, then the consumers told."""

    def __init__(
        self,
        ctx: BrokerContext,
        record_of: Callable[[str], AgentRecord | None],
        *,
        consumers: Sequence[Consumer],
        changes: Any,
        states: Any,
        withheld: Any,
        unsent: Any,
    ) -> None:
        self._ctx = ctx
        self._record_of = record_of
        self.consumers = tuple(consumers)
        """Told of every transition, in this order."""
        self._changes = changes
        """``reach_registry_change_total`` by kind."""
        self._states = states
        """``reach_state_transitions_total`` by target state."""
        self._withheld = withheld
        """``reach_dropped_messages_total{kind="event",reason="link_down"}``."""
        self._unsent = unsent
        """``reach_dropped_messages_total{kind="event",reason="error"}``."""
        self.withheld = 0
        """Events not published because the broker's link was down when they were made."""
        self._outbox: list[tuple[str, bytes]] = []
        """Events made and not yet handed to the connection, oldest first."""
        self._draining = False
        """Whether a task publishing the outbox is under way."""
        self._children: dict[str, Any] = {}
        """The counters' children, by label (a label look-up is a lock and a tuple: once per
        label, not per event)."""

    def emit(self, transitions: list[Transition]) -> None:
        """Publish events for ``transitions`` and tell the consumers."""
        ctx = self._ctx
        at_ms = ctx.wall_ms()
        logs = log.isEnabledFor(logging.INFO)
        for t in transitions:
            event = Event(
                kind=t.kind, agent_id=t.agent_id, reason=t.reason, at_ms=at_ms,
                broker_id=ctx.broker_id, to=t.to, from_=t.from_,
            )  # fmt: skip
            if ctx.link.connected:
                if not self._draining:
                    self._draining = True
                    ctx.spawn(self._drain(), "event")
                self._outbox.append(
                    (ctx.subjects.event(t.kind, t.agent_id), schema.encoder.encode(event))
                )
            else:  # nats-py would buffer it and send it after the fact: never
                self._withhold(1)
            self._count(t)
            if logs:
                log.info("agent.%s agent=%s%s%s reason=%s", t.kind, t.agent_id,
                         "" if t.from_ is None else f" from={t.from_}",
                         "" if t.to is None else f" to={t.to}", t.reason)  # fmt: skip
            rec = self._record_of(t.agent_id)
            for consumer in self.consumers:
                try:
                    consumer(t, rec)
                except Exception:  # noqa: BLE001 - a consumer never breaks the broker
                    log.exception("broker.consumer failed transition=%s", t)

    def _count(self, t: Transition) -> None:
        children = self._children
        kind = children.get(t.kind)
        if kind is None:
            kind = children[t.kind] = self._changes.labels(t.kind)
        kind.inc()
        if t.to is not None and t.kind != "registered":
            state = children.get("to:" + t.to)
            if state is None:
                state = children["to:" + t.to] = self._states.labels(t.to)
            state.inc()

    def _withhold(self, n: int) -> None:
        self.withheld += n
        self._withheld.inc(n)

    async def _drain(self) -> None:
        """Publish the outbox, oldest first, until it is empty."""
        try:
            while self._outbox:
                batch, self._outbox = self._outbox, []
                for i, (subject, body) in enumerate(batch):
                    if not self._ctx.link.connected:  # dropped since the emit: withheld
                        self._withhold(len(batch) - i)
                        break
                    try:
                        await self._ctx.nc.publish(subject, body)
                    except Exception as exc:  # noqa: BLE001 - closed: counted, not raised
                        lost = len(batch) - i + len(self._outbox)
                        self._outbox = []
                        self._unsent.inc(lost)
                        log.warning("broker.events_not_published count=%d error=%r", lost, exc)
                        return
        finally:
            self._draining = False
