"""The caller's side of cancellation: telling the agent that runs a request to stop.

A caller gives up on a request in one of four ways, and each tells the agent running it,
with a :class:`~reach_agent.wire.schema.Cancel` on ``<p>.cancel.<agent_id>``:

* ``Client.cancel(request_id)`` (and ``reach cancel``): :meth:`Cancels.cancel`. The client's
  own calls of that request id end at once with ``CANCELLED``, and their agents are told
  (fire and forget: the fast path). Then the request's holder is found — the claim in KV
  ``reach_claims``, else the request's ack records (their author took it) — and asked, as a
  request; when no agent answers that it stopped it (none runs it: queued, not yet sent; a
  holder that answers ``unknown``, as one that only remembers the cancel does; an agent that
  ignores cancels), the brokers are asked on ``<p>.cancel._broker``: they make the request
  id's claim final as cancelled and write its ``failed`` record with ``CANCELLED``, so no
  retry or replay ever runs it, and remove its queued entry;
* a ``call()`` or ``stream()`` whose asyncio task is cancelled (to every agent it was sent
  to), or whose deadline passes with an agent still on it, or a stream whose reader stops
  early (to the agent that took it): :meth:`Cancels.tell`, fire and forget.

The answer of :meth:`Cancels.cancel` is the :class:`~reach_agent.wire.schema.CancelReply` of
whoever settled it: ``cancelled`` (it ends as ``CANCELLED``), or ``finished`` (it had ended:
its result stands).
"""

from __future__ import annotations

from collections.abc import Iterable

import msgspec
from nats.aio.client import Client as NATS

from jetstream import acks
from jetstream.claims import ClaimStore, ClaimsUnavailable, claim_key
from reach_agent import trace
from reach_agent.aio import TaskSet
from reach_agent.wire import schema
from reach_agent.wire.errors import Cancelled, InvalidRequest, ReachError, Timeout, from_reply
from reach_agent.wire.schema import CLAIM_CANCELLED as CANCELLED
from reach_agent.wire.subjects import Subjects

from . import durable
from .calls import Call

log = trace.logger(__name__)

ASK_HOLDER_S = 0.5
"""How long the holder of a request has to answer a cancel before the brokers settle it."""


class Cancels:
    """One client's cancels: the fire-and-forget notices and :meth:`cancel`."""

    def __init__(self, nc: NATS, subjects: Subjects, tasks: TaskSet) -> None:
        self.nc = nc
        self.subjects = subjects
        self._tasks = tasks

    def tell(self, call: Call, reason: str, *, everyone: bool = False) -> None:
        """Tell the agent that took ``call``'s request (its receipt, or the claim's holder)
        to stop — with ``everyone``, every agent the call was sent to (its task was
        cancelled: the request itself is given up, also by an agent whose receipt is still
        on its way) —; no answer awaited, so nothing here says the request ended: the agent
        ends a run of it ``CANCELLED`` (its claim and record say so); one that does not run
        it only remembers the cancel, and a copy of the request reaching it later runs
        already cancelled — it ends ``CANCELLED`` through its claim, never answered from
        memory. A deadline tells the taker only: an agent that never took the request would
        remember it too, and a later call with the same request id reaching it (after a
        timeout while every agent was busy, say) be ended ``CANCELLED`` instead of run."""
        if call.cancelled is not None:
            return  # Client.cancel told them already
        agents = call.runners() if everyone else {call.taker} if call.taker else set()
        if agents:
            self._notify(agents, call.request_id, reason)

    def _notify(self, agents: Iterable[str], request_id: str, reason: str) -> None:
        body = schema.encoder.encode(schema.Cancel(request_id=request_id, reason=reason))
        for agent_id in agents:
            self._tasks.spawn(self._publish(self.subjects.cancel(agent_id), body, request_id),
                              "reach-cancel")  # fmt: skip

    async def _publish(self, subject: str, body: bytes, request_id: str) -> None:
        try:
            await self.nc.publish(subject, body)
        except Exception as exc:  # the connection is gone: the deadline stops the agent
            log.info("cancel.unsent request_id=%s subject=%s error=%r", request_id, subject, exc)

    async def cancel(
        self, request_id: str, reason: str | None, wait_s: float, calls: Iterable[Call]
    ) -> schema.CancelReply:
        """Cancel ``request_id`` (see the module). ``calls`` are the client's calls in
        flight; raises ``Timeout`` when neither an agent nor a broker settled it in time."""
        request_id = str(request_id)  # (a Submitted is a str subclass msgspec refuses)
        try:
            acks.check_request_id(request_id)
        except acks.InvalidRequestId as exc:
            raise InvalidRequest(str(exc)) from None
        why = reason or "cancelled by its caller"
        told: set[str] = set()
        mine = [c for c in calls if c.request_id == request_id]
        for call in mine:
            told |= call.runners()
            call.cancel(Cancelled(f"request_id {request_id!r} was cancelled: {why}"))
        self._notify(told, request_id, why)
        capability = mine[0].capability if mine else None
        holder, state = await self._holder(request_id)
        if state in ("completed", "failed", CANCELLED) and holder is not None:
            done: schema.CancelState = "cancelled" if state == CANCELLED else "finished"
            return schema.CancelReply(request_id=request_id, state=done, agent_id=holder,
                                      detail=f"its claim is {state}")  # fmt: skip
        req = schema.Cancel(request_id=request_id, reason=why, capability=capability)
        if holder is not None and state == "running":
            answer = await self._ask(self.subjects.cancel(holder), req, ASK_HOLDER_S)
            if answer is not None and answer.state in ("cancelled", "finished"):
                return answer
            req = msgspec.structs.replace(req, holder=holder)
        answer = await self._ask(self.subjects.cancel_broker, req, wait_s)
        if answer is None:
            raise Timeout(f"no broker answered the cancel of request_id {request_id!r} within "
                          f"{wait_s:g}s: it is not recorded (a later run is not prevented); "
                          "try again")  # fmt: skip
        return answer

    async def _holder(self, request_id: str) -> tuple[str | None, str | None]:
        """Who runs (or ran) the request, and how far (a claim's state, or ``cancelled``):
        its claim; without one, the author of its latest ack record (an idempotent
        capability, or claims off)."""
        try:
            stored = await ClaimStore(self.nc).get(claim_key(request_id))
            if stored is not None:
                claim = schema.claim_decoder.decode(stored.data)
                if claim.state == "failed" and claim.reason == CANCELLED:
                    return claim.agent_id, CANCELLED
                if claim.state != "released":
                    return claim.agent_id, claim.state
                return None, None
        except (ClaimsUnavailable, msgspec.MsgspecError) as exc:
            log.debug("cancel.claim_unreadable request_id=%s error=%s", request_id, exc)
        try:
            rec = await durable.last(self.nc, request_id, prefix=self.subjects.prefix)
        except Exception as exc:  # noqa: BLE001 - no ack store: the brokers settle it
            log.debug("cancel.acks_unreadable request_id=%s error=%r", request_id, exc)
            return None, None
        if rec is None:
            return None, None
        if rec.state == "received":
            return rec.agent_id, "running"  # (a broker's received names the taker)
        return rec.agent_id, rec.state

    async def _ask(
        self, subject: str, req: schema.Cancel, wait_s: float
    ) -> schema.CancelReply | None:
        """Send ``req`` as a request; its answer, or None (no answer in time, no responder)."""
        try:
            msg = await self.nc.request(subject, schema.encoder.encode(req), timeout=wait_s)
        except Exception as exc:  # noqa: BLE001 - timeout, no responders: nobody settled it
            log.debug("cancel.unanswered subject=%s error=%r", subject, exc)
            return None
        err = from_reply(msg.headers, msg.data)
        if err is not None:
            if isinstance(err, ReachError) and err.code == "TIMEOUT":
                return None
            raise err
        try:
            return schema.cancel_reply_decoder.decode(msg.data)
        except msgspec.MsgspecError as exc:
            log.warning("cancel.bad_answer subject=%s error=%s", subject, exc)
            return None
