"""The ack records a broker writes as itself (author ``_broker``, on
``<p>.ack._broker.<request_id>``): a replayed task's ``received`` naming its taker, the
``failed`` of an entry that expired or that an agent finally refused, the answer of a
Synadia agent (which writes none: :mod:`reach_broker.replay.synadiareplay`) and a cancel's
``CANCELLED`` (:mod:`reach_broker.service.canceller`). One :class:`BrokerAcks`, built with the
broker and handed to the replay and the canceller."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from jetstream import acks
from jetstream.compensation import Entry
from reach_agent.wire import schema
from reach_agent.wire.schema import AckRecord
from reach_agent.wire.subjects import BROKER_ACK_AUTHOR

from .context import BrokerContext

log = logging.getLogger(__name__)

RETRY_FIRST_S = 0.1
RETRY_MAX_S = 5.0
"""First and longest pause between two tries of a broker record JetStream did not take."""


class BrokerAcks:
    """Writes the broker's own ack records; ``store_errors``: ``reach_store_errors_total``."""

    def __init__(self, ctx: BrokerContext, *, store_errors: Any) -> None:
        self.ctx = ctx
        self._store_errors = store_errors

    async def record_failed(
        self, e: Entry, agent_id: str, code: str, reason: str, message: str
    ) -> None:
        rec = AckRecord(
            request_id=e.request_id, agent_id=agent_id, capability=e.capability,
            state="failed", at_ms=self.ctx.wall_ms(),
            error={"code": code, "reason": reason, "message": message},
        )  # fmt: skip
        await self.publish(rec)

    async def record_taker(self, e: Entry, agent_id: str) -> None:
        """``received`` by the broker: it handed the task to ``agent_id`` (whose own records
        ``Client.wait`` then trusts). Tried once now; should JetStream not take it, again in
        the background until it does (the entry is held meanwhile: the task was delivered)."""
        rec = AckRecord(request_id=e.request_id, agent_id=agent_id, capability=e.capability,
                        state="received", at_ms=self.ctx.wall_ms())  # fmt: skip
        msg_id = acks.ack_msg_id(BROKER_ACK_AUTHOR, rec.request_id, rec.state)
        try:
            await self.publish(rec, msg_id)
        except Exception as exc:  # noqa: BLE001 - tried again below, never dropped
            self._store_errors.labels("acks", "taker").inc()
            log.warning("replay.taker_unrecorded request_id=%s agent=%s error=%r: trying again",
                        e.request_id, agent_id, exc)  # fmt: skip
            self.ctx.spawn(self.store(rec, "taker", msg_id, first_pause_s=RETRY_FIRST_S),
                           "ack-retry")  # fmt: skip

    async def store(
        self, rec: AckRecord, op: str, msg_id: str | None = None, *, first_pause_s: float = 0.0
    ) -> None:
        """Store one record of the broker's own, trying again until JetStream confirms it
        (each failure counted as ``reach_store_errors_total{store="acks",op}``). Every try
        carries the same message id, so a try whose answer was lost is not stored twice."""
        msg_id = msg_id or acks.ack_msg_id(BROKER_ACK_AUTHOR, rec.request_id, rec.state)
        pause = first_pause_s
        while True:
            if pause:
                await asyncio.sleep(pause)
            try:
                await self.publish(rec, msg_id)
                if pause:
                    log.info("acks.stored request_id=%s state=%s after a retry", rec.request_id,
                             rec.state)  # fmt: skip
                return
            except Exception as exc:  # noqa: BLE001 - tried again until stored
                self._store_errors.labels("acks", op).inc()
                log.warning("acks.store_failed request_id=%s state=%s error=%r: trying again",
                            rec.request_id, rec.state, exc)  # fmt: skip
            pause = min(max(pause * 2, RETRY_FIRST_S), RETRY_MAX_S)

    async def publish(self, rec: AckRecord, msg_id: str | None = None) -> None:
        """One record of the broker's own (author ``_broker``), tried once: raises what the
        publish raises."""
        ctx = self.ctx
        js = ctx.nc.jetstream(timeout=2.0)
        rid = rec.request_id
        await acks.publish_record(
            js,
            ctx.subjects.ack(BROKER_ACK_AUTHOR, rid),
            msg_id or acks.ack_msg_id(BROKER_ACK_AUTHOR, rid, rec.state),
            schema.encoder.encode(rec),
        )
