"""Where every registry change goes, in the order the broker names: :class:`Fanout`.

A transition — made by a handler, a probe's answer, an advisory, the tick — is published as
an ``Event`` on ``<prefix>.event.<kind>.<agent_id>`` (never while the broker's link is down:
nats-py would buffer it and send it after the fact), counted, logged, and handed to each
consumer in turn. The consumers are given at construction, in order, by the one place the
broker is built (:class:`reach_broker.broker.Broker`); nothing registers itself.
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
        self.withheld = 0
        """Events not published because the broker's link was down when they were made."""

    def emit(self, transitions: list[Transition]) -> None:
        """Publish events for ``transitions`` and tell the consumers."""
        ctx = self._ctx
        at_ms = ctx.wall_ms()
        for t in transitions:
            event = Event(
                kind=t.kind, agent_id=t.agent_id, reason=t.reason, at_ms=at_ms,
                broker_id=ctx.broker_id, to=t.to, from_=t.from_,
            )  # fmt: skip
            subject = ctx.subjects.event(t.kind, t.agent_id)
            if ctx.link.connected:
                ctx.spawn(self._publish(subject, schema.encoder.encode(event)), "event")
            else:  # nats-py would buffer it and send it after the fact: never
                self._withhold()
            self._changes.labels(t.kind).inc()
            if t.to is not None and t.kind != "registered":
                self._states.labels(t.to).inc()
            log.info("agent.%s agent=%s%s%s reason=%s", t.kind, t.agent_id,
                     "" if t.from_ is None else f" from={t.from_}",
                     "" if t.to is None else f" to={t.to}", t.reason)  # fmt: skip
            rec = self._record_of(t.agent_id)
            for consumer in self.consumers:
                try:
                    consumer(t, rec)
                except Exception:  # noqa: BLE001 - a consumer never breaks the broker
                    log.exception("broker.consumer failed transition=%s", t)

    def _withhold(self) -> None:
        self.withheld += 1
        self._withheld.inc()

    async def _publish(self, subject: str, body: bytes) -> None:
        if self._ctx.link.connected:  # still: the link may have dropped since the emit
            await self._ctx.nc.publish(subject, body)
        else:
            self._withhold()
