"""Cancels of requests no agent answered for: ``<p>.cancel._broker`` (queue group).

A caller that cancels a request (``Client.cancel``, ``reach cancel``) first tells the agent
running it (``<p>.cancel.<agent_id>``, found through the claim). When no agent settles it —
nobody runs it yet (queued in ``REACH_COMPENSATION``, a task still on its way), its holder
does not answer (gone, or an agent that ignores cancels) — the caller asks the brokers, and
one of them, the :class:`Canceller`, makes the cancel stick:

* the request id's **claim** is made final: created, or taken over from a holder that did
  not answer (or a released one), as ``{"agent_id": "_broker", "state": "failed",
  "reason": "cancelled"}`` — so an agent given the request later (a retry, a replay, the
  task still on its way) answers the stored result instead of running it;
* that result is the broker's own ``failed`` record with ``CANCELLED``
  (``<p>.ack._broker.<request_id>``): what ``Client.wait`` and ``reach ack`` show, and what
  the claim points at;
* a **queued entry** of the request id is removed from ``REACH_COMPENSATION``
  (``reach_compensation_total{result="cancelled"}``); one a replay round holds is dropped
  when the round reads the claim.

A running claim whose holder was not yet asked is asked first (the broker forwards the
cancel); a finished one is left alone (``finished``: its result stands). Without the claims
bucket the record is still written, but nothing stops a later run: the reply says so.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

import msgspec
from nats.aio.msg import Msg

from jetstream import audit, compensation
from jetstream.claims import ClaimStore, ClaimsUnavailable, NoClaimsBucket, claim_key
from reach_agent.results import ended_by_record
from reach_agent.wire import schema
from reach_agent.wire.errors import Cancelled, InvalidRequest, ReachError, Timeout, to_reply
from reach_agent.wire.schema import CLAIM_CANCELLED as CANCELLED
from reach_agent.wire.schema import AckRecord, Claim
from reach_agent.wire.subjects import BROKER_ACK_AUTHOR, is_inbox

from .brokeracks import BrokerAcks
from .context import BrokerContext

log = logging.getLogger(__name__)

FORWARD_TIMEOUT_S = 0.5
"""How long a holder the caller did not ask has to answer the forwarded cancel."""
SCAN_LIMIT = 100_000
"""Queued entries looked through for the request id (the queue's bound is far below)."""


class Canceller:
    """Broker component answering ``<p>.cancel._broker``."""

    def __init__(self, ctx: BrokerContext, records: BrokerAcks, *, queue: str,
                 cancelled: Any) -> None:  # fmt: skip
        """``records``: the broker's own ack records; ``cancelled``:
        ``reach_compensation_total{result="cancelled"}``."""
        self.ctx = ctx
        self.records = records
        self.queue = queue
        self._cancelled = cancelled
        self.store = ClaimStore(ctx.nc)
        self._sub: Any = None

    async def start(self) -> None:
        if self._sub is None:
            self._sub = await self.ctx.nc.subscribe(self.ctx.subjects.cancel_broker,
                                                    queue=self.queue, cb=self._on_msg)  # fmt: skip

    async def stop(self) -> None:
        if self._sub is not None:
            with contextlib.suppress(Exception):
                await self._sub.unsubscribe()
            self._sub = None

    async def _on_msg(self, msg: Msg) -> None:
        if not msg.reply or not is_inbox(msg.reply) or audit.is_copy(msg, live=False):
            log.warning("cancel.dropped reason=no inbox to answer (reply %r)",
                        (msg.reply or "")[:128])  # fmt: skip
            return
        try:
            req = schema.decode(schema.cancel_decoder, msg.data, "cancel")
        except InvalidRequest as err:
            await self._answer(msg.reply, *to_reply(err))
            return
        self.ctx.spawn(self._settle(req, msg.reply), "cancel")

    async def _settle(self, req: schema.Cancel, reply: str) -> None:
        try:
            answer = await self.cancel(req)
        except ReachError as err:
            await self._answer(reply, *to_reply(err))
            return
        except Exception as exc:  # noqa: BLE001 - answered, logged, never the broker's end
            log.exception("cancel.failed request_id=%s", req.request_id)
            await self._answer(reply, *to_reply(Timeout(f"cancel not recorded: {exc!r}")))
            return
        await self._answer(reply, {}, schema.encoder.encode(answer))

    async def _answer(self, reply: str, headers: dict[str, str], body: bytes) -> None:
        try:
            await self.ctx.nc.publish(reply, body, headers=headers or None)
        except Exception as exc:  # noqa: BLE001 - the caller times out and asks again
            log.info("cancel.reply_failed error=%r", exc)

    async def cancel(self, req: schema.Cancel) -> schema.CancelReply:
        """Settle the cancel of ``req.request_id`` (see the module)."""
        rid = req.request_id
        key = claim_key(rid)
        mine = schema.encoder.encode(Claim(
            request_id=rid, agent_id=BROKER_ACK_AUTHOR, instance=self.ctx.broker_id,
            capability=req.capability or "", state="failed", at_ms=self.ctx.wall_ms(),
            ack_subject=self.ctx.subjects.ack(BROKER_ACK_AUTHOR, rid), reason=CANCELLED,
        ))  # fmt: skip
        guarded = True
        try:
            for _ in range(4):
                stored = await self.store.get(key)
                if stored is None:
                    created, _ = await self.store.create(key, mine)
                    if created:
                        break
                    continue  # an agent claimed it just now: look at its claim
                claim = _decode(stored.data)
                if claim.state in ("completed", "failed"):
                    state: schema.CancelState = (
                        "cancelled" if claim.reason == CANCELLED else "finished"
                    )
                    return schema.CancelReply(request_id=rid, state=state,
                                              agent_id=claim.agent_id,
                                              detail=f"its claim is {claim.state}")  # fmt: skip
                ended = None
                if claim.state in ("running", "released"):
                    ended = await ended_by_record(self.ctx.nc, claim, self.ctx.subjects)
                if ended is not None:
                    return schema.CancelReply(request_id=rid, state=_cancel_state(ended),
                                              agent_id=ended.agent_id,
                                              detail=f"{ended.agent_id}'s {ended.state} "
                                              "record is stored")  # fmt: skip
                if claim.state == "running" and claim.agent_id != req.holder:
                    answer = await self._forward(claim.agent_id, req)
                    if answer is not None and answer.state in ("cancelled", "finished"):
                        return answer
                # A holder that does not answer (or a released claim): the cancel takes it.
                if await self.store.swap(key, mine, stored.revision) is not None:
                    log.info("cancel.claim_taken request_id=%s from=%s state=%s", rid,
                             claim.agent_id, claim.state)  # fmt: skip
                    break
            else:
                raise Timeout(f"the claim of request_id {rid!r} kept changing: try again")
        except NoClaimsBucket:
            guarded = False
        except ClaimsUnavailable as exc:
            raise Timeout(f"the claims bucket did not answer ({exc}): cancel not recorded, "
                          "try again") from None  # fmt: skip
        error = Cancelled(f"request_id {rid!r} was cancelled: {req.reason or 'by its caller'}")
        await self.records.publish(AckRecord(
            request_id=rid, agent_id=self.ctx.broker_id, capability=req.capability or "",
            state="failed", at_ms=self.ctx.wall_ms(),
            error={"code": error.code, "reason": CANCELLED, "message": error.message},
        ))  # fmt: skip
        removed = await self._unqueue(rid, req.capability)
        detail = f"removed {removed} queued entr{'y' if removed == 1 else 'ies'}" if removed else ""
        if not guarded:
            detail = "no claims bucket: recorded, but a later run is not prevented"
        log.info("cancel.recorded request_id=%s queued=%d guarded=%s", rid, removed, guarded)
        return schema.CancelReply(request_id=rid, state="cancelled", agent_id=BROKER_ACK_AUTHOR,
                                  detail=detail or None)  # fmt: skip

    async def _forward(self, holder: str, req: schema.Cancel) -> schema.CancelReply | None:
        """Ask the holder to stop; its answer, or None when it gives none in time."""
        try:
            msg = await self.ctx.nc.request(self.ctx.subjects.cancel(holder),
                                            schema.encoder.encode(req),
                                            timeout=FORWARD_TIMEOUT_S)  # fmt: skip
            return schema.cancel_reply_decoder.decode(msg.data)
        except Exception as exc:  # noqa: BLE001 - no answer: the broker settles it
            log.info("cancel.holder_silent request_id=%s holder=%s error=%r", req.request_id,
                     holder, exc)  # fmt: skip
            return None

    async def _unqueue(self, request_id: str, capability: str | None) -> int:
        """Remove the request id's entries from the compensation queue; how many."""
        ctx = self.ctx
        removed = 0
        try:
            entries = await compensation.scan(ctx.nc, capability, subjects=ctx.subjects,
                                              limit=SCAN_LIMIT)  # fmt: skip
            for e in entries:
                if e.request_id == request_id and await compensation.remove(ctx.nc, e.seq):
                    removed += 1
                    self._cancelled.inc()
        except Exception as exc:  # noqa: BLE001 - a replay round drops it by its claim
            log.info("cancel.unqueue_failed request_id=%s error=%r", request_id, exc)
        return removed


def _decode(data: bytes) -> Claim:
    try:
        return schema.claim_decoder.decode(data)
    except msgspec.MsgspecError as exc:
        raise ClaimsUnavailable(f"stored claim is not a Claim ({exc})") from None


def _cancel_state(ended: schema.AckRecord) -> schema.CancelState:
    """What a cancel reports of a request its holder's final record ended: ``cancelled``
    when that record is its ``CANCELLED`` failure (a cancel ran first), else ``finished``."""
    failure = ended.error or {}
    return "cancelled" if failure.get("code") == "CANCELLED" else "finished"
