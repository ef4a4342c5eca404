"""The ack records a broker writes as itself (author ``_broker``, on
``<p>.ack._broker.<request_id>``): a replayed task's ``received`` naming its taker, and the
``failed`` of an entry that expired or that an agent finally refused (and, through
:mod:`reach_broker.replay.synadiareplay`, the answer of a Synadia agent, which writes none)."""

from __future__ import annotations

import logging

from jetstream import acks
from jetstream.compensation import Entry
from reach_agent.wire import schema
from reach_agent.wire.schema import AckRecord
from reach_agent.wire.subjects import BROKER_ACK_AUTHOR
from reach_broker.service.context import BrokerContext

log = logging.getLogger(__name__)


async def record_failed(
    ctx: BrokerContext, e: Entry, agent_id: str, code: str, reason: str, message: str
) -> None:
    rec = AckRecord(
        request_id=e.request_id, agent_id=agent_id, capability=e.capability,
        state="failed", at_ms=ctx.wall_ms(),
        error={"code": code, "reason": reason, "message": message},
    )  # fmt: skip
    await publish(ctx, rec)


async def record_taker(ctx: BrokerContext, e: Entry, agent_id: str) -> None:
    """``received`` by the broker: it handed the task to ``agent_id`` (whose own records
    ``Client.wait`` then trusts). A failure is logged: the task was delivered anyway."""
    rec = AckRecord(request_id=e.request_id, agent_id=agent_id, capability=e.capability,
                    state="received", at_ms=ctx.wall_ms())  # fmt: skip
    try:
        await publish(ctx, rec)
    except Exception as exc:  # noqa: BLE001 - the entry is held regardless
        log.warning("replay.taker_unrecorded request_id=%s agent=%s error=%r: wait() "
                    "needs agent_id= for it", e.request_id, agent_id, exc)  # fmt: skip


async def publish(ctx: BrokerContext, rec: AckRecord) -> None:
    """One record of the broker's own (author ``_broker``)."""
    js = ctx.nc.jetstream(timeout=2.0)
    rid = rec.request_id
    await acks.publish_record(
        js,
        ctx.subjects.ack(BROKER_ACK_AUTHOR, rid),
        acks.ack_msg_id(BROKER_ACK_AUTHOR, rid, rec.state),
        schema.encoder.encode(rec),
    )
