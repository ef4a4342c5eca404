"""The ack metrics: every ack record on ``<p>.ack.>`` counted by state, and the time from a
replayed task's send (or an agent's ``received`` record) to its final record. Only
attributed records count (:func:`jetstream.ackreads.attribute`): a copy of a stored message
or a message id that names another author is dropped and counted in
``reach_dropped_total{kind="ack"}``; the broker's own ``received`` (naming a taker) is not an
ack.

Fed by the replayer's subscription to ``<p>.ack.>`` (:meth:`AckWatch.on_ack`) and told of
each replayed send (:meth:`AckWatch.sent`). At most :data:`TRACK_MAX` request ids are
remembered for the latency histogram (oldest forgotten first).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import msgspec
from nats.aio.msg import Msg

from jetstream import ackreads
from reach_agent.wire.subjects import BROKER_ACK_AUTHOR
from reach_broker.service.context import BrokerContext
from reach_broker.service.metrics import ReplayMetrics

TRACK_MAX = 50_000
"""Request ids remembered for the ack latency histogram (oldest forgotten first)."""


class _AckTimes(msgspec.Struct):
    at_ms: int = 0
    received_ms: int | None = None
    """A final record's folded ``received`` (the agent stored one record, not two)."""


_ack_times = msgspec.json.Decoder(_AckTimes)


class AckWatch:
    """``reach_ack_records_total{state}`` and ``reach_ack_latency_seconds``."""

    def __init__(self, ctx: BrokerContext, metrics: ReplayMetrics,
                 on_final: Callable[[str, str], Awaitable[object]],
                 on_completed: Callable[[str, str], None] | None = None) -> None:  # fmt: skip
        self.ctx, self.metrics = ctx, metrics
        self.on_completed = on_completed
        """Told of each attributed ``completed`` record: (request id, author) — the claims'
        releaser (the record ends a claim that stays ``running``)."""
        self._sent_ms: dict[str, int] = {}
        self._received_ms: dict[str, int] = {}
        self.on_final = on_final
        """Told of each attributed ``completed``/``failed`` record: (request id, author)."""

    def sent(self, request_id: str, at_ms: int) -> None:
        """A replayed task is being sent, at ``at_ms`` (a send not taken is overwritten by the
        next)."""
        _remember(self._sent_ms, request_id, at_ms)

    async def on_ack(self, msg: Msg) -> None:
        stored = ackreads.attribute(msg.subject, msg.headers, msg.data, None, self.ctx.subjects)
        if isinstance(stored, str):
            reason = "stored_copy" if "copy" in stored else "invalid"
            self.metrics.refused.labels("ack", reason).inc()
            return
        state = stored.state
        if stored.author == BROKER_ACK_AUTHOR and state == "received":
            return  # the broker naming a task's taker: not an ack
        counter = self.metrics.ack_states.get(state)
        if counter is None:
            return
        counter.inc()
        rid = stored.request_id
        if state == "completed" and self.on_completed is not None:
            self.on_completed(rid, stored.author)
        if state != "received":
            await self.on_final(rid, stored.author)
        try:
            times = _ack_times.decode(msg.data)
        except msgspec.MsgspecError:
            return
        at_ms = times.at_ms
        if state == "received":
            _remember(self._received_ms, rid, at_ms)
            return
        start = self._sent_ms.pop(rid, None)
        received = self._received_ms.pop(rid, times.received_ms)
        t0 = start if start is not None else received
        if t0 is not None and at_ms >= t0:
            self.metrics.ack_latency.observe((at_ms - t0) / 1000.0)


def _remember(d: dict[str, int], key: str, value: int) -> None:
    if key not in d and len(d) >= TRACK_MAX:
        d.pop(next(iter(d)))
    d[key] = value
