"""One compensation entry delivered: its claim looked up, its expiry, its dispatch marker,
the route, the agent's receipt (or refusal), then held until the taker's final record.

Its own module because sending one entry needs the router, the claims, the dispatch
markers and the taken entries but nothing of the replay rounds (:mod:`reach_broker.replay.replay`:
which capability, when, how many at once).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections.abc import Awaitable, Callable
from typing import Any, Literal, NamedTuple

from nats.errors import NoRespondersError

from jetstream.compensation import Entry, give_back
from jetstream.names import H_REQUEST_ID
from reach_agent.routing.index import RETRY_AFTER_DEFAULT_MS
from reach_agent.wire import schema
from reach_agent.wire.errors import Overloaded, ReachError
from reach_agent.wire.retry import retryable
from reach_agent.wire.schema import RouteRequest
from reach_agent.wire.subjects import BROKER_ACK_AUTHOR
from reach_broker.config import CompensationSection
from reach_broker.core.records import AgentRecord
from reach_broker.core.routing import Router
from reach_broker.service.brokeracks import BrokerAcks
from reach_broker.service.context import BrokerContext
from reach_broker.service.releases import ClaimView

from .ackwatch import AckWatch
from .dispatch import MARKER_TTL_S, Dispatches
from .synadiareplay import Prompts
from .taken import Taken

log = logging.getLogger(__name__)

Outcome = Literal[
    "replayed", "expired", "failed", "stalled", "full", "claimed", "held", "deferred", "mismatch"
]
RELEASE_WAIT_S = 0.5
"""Redelivery delay of an entry whose claim's holder is offline but not yet released."""
STALL_WAIT_S = 1.0
"""Redelivery delay of an entry whose delivery stalled (a JetStream asset electing a leader):
given back at once, each one came back about three times a second while the election lasted
(nemesis seed 31), on a JetStream already struggling."""


def _step(exc: BaseException) -> str:
    """The call an error came out of into :class:`EntrySender`'s own methods (its qualified
    name, e.g. ``Dispatches.mark``), so a stalled delivery's line says which store did not
    answer."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_name != "_send":
        tb = tb.tb_next
    if tb is None:
        return "?"
    while tb.tb_next is not None:
        name = tb.tb_next.tb_frame.f_code.co_qualname
        if not name.startswith("EntrySender."):
            return name
        tb = tb.tb_next
    return tb.tb_frame.f_code.co_name


def retry_after_s(refusal: Overloaded) -> float:
    """When asking a router that answered ``OVERLOADED`` again may get a route."""
    return (refusal.retry_after_ms or RETRY_AFTER_DEFAULT_MS) / 1000.0


class Target(NamedTuple):
    """Where an entry goes (a route candidate's two fields the replayer reads)."""

    agent_id: str
    subject: str
    protocol: str | None = None


class EntrySender:
    """Delivers the replay's entries one by one (:meth:`deliver`), and counts how each
    ended."""

    def __init__(self, ctx: BrokerContext, router: Router,
                 claim_of: Callable[[str], Awaitable[ClaimView | None]],
                 record_of: Callable[[str], AgentRecord | None], taken: Taken, acks: AckWatch,
                 records: BrokerAcks, cfg: CompensationSection,
                 results: dict[str, Any], whole_fleet: Callable[[], bool]) -> None:  # fmt: skip
        """``records``: the broker's own ack records; ``results``: ``reach_compensation_total``
        by result; ``whole_fleet``: whether this broker's agents are all of the fleet (it owns
        every partition), so a full router means every agent is full."""
        self.whole_fleet = whole_fleet
        self.ctx, self.cfg, self._results, self.records = ctx, cfg, results, records
        self.router = router
        self.claim_of = claim_of
        """A request id's claim: (holder, state), None when unclaimed; raises
        ``ClaimsUnavailable`` when the bucket cannot say (the entry is given back: stalled)."""
        self.record_of = record_of
        self.taken = taken
        self.acks = acks
        self.subjects = ctx.subjects
        self.dispatches = Dispatches(ctx.nc, ctx.subjects, ctx.broker_id, record_of)
        """Where each entry was sent: exactly once across a leader change (dispatch.py)."""
        self.prompts = Prompts(ctx, cfg, taken.done, records)
        """Entries for Synadia agents (they write no ack records: the broker does)."""
        self.replayed = 0
        self.expired = 0
        self.failed = 0
        self.claimed = 0  # entries an agent had claimed: removed, not sent
        self._route_req = RouteRequest(limit=3)
        self._turns: dict[str, asyncio.Lock] = {}
        """Per capability: the entry waiting for a slot, the others behind it."""

    async def deliver(self, e: Entry) -> Outcome:
        """Deliver one entry; a JetStream asset electing a leader (a marker or ack that
        times out, no responders) stalls the round: the entry comes back after
        :data:`STALL_WAIT_S`, and its marker and ack records decide what its redelivery
        does."""
        try:
            return await self._send(e)
        except asyncio.CancelledError:
            # Its round cancelled (a broker stopping) before an agent took it: given back for
            # the next round or replica, not left to come back after ack_wait_s (nemesis
            # seeds 35, 36: tasks ran 30 s after their submit). One taken is held for its
            # taker's final record; one settled ignores the nak.
            if not self.taken.holds(e.request_id):
                with contextlib.suppress(Exception):
                    assert e.msg is not None
                    await give_back(e.msg, within_s=1.0)  # (the broker is stopping)
            raise
        except Exception as exc:  # noqa: BLE001 - retried by the next round or the sweep
            log.info("replay.stalled request_id=%s step=%s error=%r", e.request_id,
                     _step(exc), exc)  # fmt: skip
            with contextlib.suppress(Exception):
                assert e.msg is not None
                await give_back(e.msg, delay_s=STALL_WAIT_S)
            return "stalled"

    async def _send(self, e: Entry) -> Outcome:
        ctx, router = self.ctx, self.router
        assert e.msg is not None  # fetched entries carry their message
        claim = await self.claim_of(e.request_id)  # first: a running task is not expired
        if claim is not None and _reused(e, claim.body_digest):
            return await self._mismatch(e, claim.holder)
        if claim is not None and claim.state != "released":
            return await self._claimed(e, claim.holder, claim.state)
        if e.expired(ctx.wall_ms()):
            await self.record_expired(e)
            await e.msg.ack_sync()
            return "expired"
        headers = _headers(e)
        only: str | None = None
        if e.msg.metadata.num_delivered > 1 and claim is None:  # sent before? (a leader
            # change, a dead replica; a released claim means its run did not finish)
            done, only = await self.dispatches.redelivery(e.request_id)
            if done:
                await e.msg.ack_sync()
                log.info("replay.already_delivered request_id=%s", e.request_id)
                return "replayed"
        give_up = ctx.clock() + self.cfg.ack_wait_s / 2
        backoff = 0.05
        ttl_s = self._marker_ttl_s(e)
        while True:
            try:
                candidates = (
                    router.route(e.capability, self._route_req, ctx.clock())
                    if only is None
                    else [self._target(only, e.capability)]
                )
            except Overloaded as exc:
                if not self.whole_fleet() or ctx.clock() > give_up:
                    # This broker routes to the agents of its own partitions only: another
                    # broker's may have a slot, so the entry is given back for any replica's
                    # round (held here, it waited while another broker's agents sat idle:
                    # nemesis seed 35); this one's is kicked again later (replay.py).
                    log.debug("replay.overloaded request_id=%s capability=%s: given back",
                              e.request_id, e.capability)  # fmt: skip
                    await give_back(e.msg)
                    return "full"
                # This broker's agents are the whole fleet, all full: one should have a slot
                # about a task time later (the refusal's hint). Waited for here, in the
                # round's order; a round ended here waited for the 5 s sweep while the
                # agents sat idle (nemesis seed 34).
                await self._slot(e, exc, give_up)
                continue
            except ReachError as exc:
                # The round ends here; the next starts at a submit, an agent turning healthy
                # or the sweep (said, so a backlog waiting on the sweep shows why: seed 34).
                log.info("replay.unroutable request_id=%s capability=%s error=%s: the round "
                         "ends", e.request_id, e.capability, exc.code)  # fmt: skip
                await give_back(e.msg)
                return "stalled"
            for c in candidates:
                handed = await self._hand(e, c, headers, ttl_s)
                if handed is None:  # no receipt: another agent
                    continue
                if not isinstance(handed, ReachError):
                    return handed
                err = handed
                if err.code == "IDEMPOTENCY_MISMATCH":
                    return await self._mismatch(e, c.agent_id)
                if err.code == "IN_PROGRESS":
                    return await self._claimed(e, getattr(err, "holder", ""), "running")
                if retryable("error", err):  # not taken here, now: another agent, or later
                    only = None  # a refusal (busy, draining) means it did not take it
                    continue
                # The agent refused the task itself (BIZ_REJECT, LOOP_DETECTED, ...): final.
                return await self._refused(e, c.agent_id, err)
            if ctx.clock() > give_up:
                await give_back(e.msg)
                return "stalled"
            await asyncio.sleep(backoff * (0.5 + random.random()))
            backoff = min(backoff * 2, self.cfg.busy_retry_max_s)

    async def _hand(
        self, e: Entry, c: Any, headers: dict[str, str], ttl_s: float
    ) -> Outcome | ReachError | None:
        """Send ``e`` to ``c`` (a candidate or :class:`Target`): ``replayed`` when it took the
        task (held until its final record), ``claimed`` when it answered the stored result or
        error of the request's holder instead (the entry removed), its refusal, or None when
        no receipt came."""
        ctx = self.ctx
        rec = self.record_of(c.agent_id)
        if rec is not None:  # counted as a route's pick is, until its next report:
            # uncounted, a round's concurrent entries all went to an agent that looked
            # idle, and it refused all but its free slots' worth (TARGET_BUSY)
            rec.handed_out(ctx.clock())
        sent_ms = ctx.wall_ms()
        await self.dispatches.mark(e.request_id, c.agent_id, sent_ms, ttl_s)
        # Before the send: a claimed run's final record reaches the ack watch ahead
        # of its receipt's processing here (it is the claim's end, sent before the
        # reply). A send that is not taken is overwritten by the next one.
        self.acks.sent(e.request_id, sent_ms)
        try:  # a reach agent's receipt, or a Synadia agent's ack (its answer later)
            err, collect, holder = await self.prompts.deliver(c, e, headers)
        except (TimeoutError, NoRespondersError):
            log.info("replay.no_receipt request_id=%s agent=%s", e.request_id, c.agent_id)
            return None
        if holder is not None:
            # No receipt: the agent found the request claimed and finished (a claim stored
            # after this entry's was read) and answered its holder's stored result or error,
            # naming the holder. Taken as a receipt, the broker named this agent the taker
            # in its `received` record, and a caller's wait waited for this agent's record,
            # which it never writes (nemesis seed 52: c3-000092, TIMEOUT after 30 s).
            return await self._claimed(e, holder, "completed" if err is None else "failed",
                                       via=c.agent_id)  # fmt: skip
        if err is not None:
            return err
        await self.records.record_taker(e, c.agent_id)
        await self.taken.hold(e, c.agent_id)  # removed at its final record
        if collect is not None:  # a Synadia agent: the broker records its answer
            ctx.spawn(collect(), f"synadia-replay-{e.request_id}")
        self.replayed += 1
        self._results["replayed"].inc()
        log.info("replay.delivered request_id=%s capability=%s agent=%s priority=%d "
                 "queued_ms=%d", e.request_id, e.capability, c.agent_id, e.priority,
                 sent_ms - e.enqueued_ms)  # fmt: skip
        return "replayed"

    async def _refused(self, e: Entry, agent_id: str, err: ReachError) -> Outcome:
        """``agent_id`` refused the task itself (``BIZ_REJECT``, ``LOOP_DETECTED``, ...): its
        final answer, recorded; the entry is removed."""
        assert e.msg is not None
        await self.records.record_failed(e, agent_id, err.code, err.code.lower(), err.message)
        await e.msg.ack_sync()
        self.failed += 1
        return "failed"

    def _marker_ttl_s(self, e: Entry) -> float:
        """How long a dispatch marker of ``e`` is kept: until the entry expires."""
        return (e.expires_at_ms - self.ctx.wall_ms()) / 1000.0 if e.expires_at_ms else MARKER_TTL_S

    async def _slot(self, e: Entry, refusal: Overloaded, give_up: float) -> None:
        """Wait until the router has a slot for ``e``'s capability (or ``give_up``), asking
        again after each refusal's ``retry_after_ms``. One entry of a capability waits at a
        time, the others queued behind it in the order they were refused (each on a timer of
        its own, they took the slot in any order)."""
        turn = self._turns.get(e.capability)
        if turn is None:
            turn = self._turns[e.capability] = asyncio.Lock()
        async with turn:
            while self.ctx.clock() <= give_up:
                await asyncio.sleep(retry_after_s(refusal) * (0.5 + random.random()))
                try:
                    self.router.choose(e.capability, self._route_req, self.ctx.clock())
                except Overloaded as exc:
                    refusal = exc
                    continue
                except ReachError:
                    pass  # not full but unroutable now: the route says why
                return

    def _target(self, agent_id: str, capability: str) -> Target:
        """Where a redelivered entry goes: the agent it went to before."""
        rec = self.record_of(agent_id)
        if rec is not None and rec.subject is not None:
            return Target(agent_id, rec.subject, rec.protocol)
        return Target(agent_id, self.subjects.task(agent_id, capability))

    async def _claimed(self, e: Entry, holder: str, state: str, *, via: str = "") -> Outcome:
        """The request id is ``holder``'s already: not sent (``via``: the agent whose reply
        named the holder, when it was sent). A finished run's entry is removed; a live
        holder's held until it finishes; an offline holder's given back a moment, for its
        claim to be released."""
        assert e.msg is not None
        if state == "running":
            if self.taken.alive(holder):
                return await self._ask_holder(e, holder)
            await give_back(e.msg, delay_s=RELEASE_WAIT_S)
            self._results["deferred"].inc()
            return "deferred"
        await e.msg.ack_sync()
        self.claimed += 1
        # A claim the broker holds is a cancel's (reach_broker.service.canceller).
        result = "cancelled" if holder == BROKER_ACK_AUTHOR else "claimed"
        self._results[result].inc()
        said = f"{via} answered the holder's result" if via else "not sent again"
        log.info("replay.%s request_id=%s capability=%s holder=%s (%s): %s", result,
                 e.request_id, e.capability, holder, state, said)  # fmt: skip
        return "claimed"

    async def _ask_holder(self, e: Entry, holder: str) -> Outcome:
        """``e``'s claim is ``running`` on the live agent ``holder``: the entry is sent to the
        holder itself, as a caller told ``IN_PROGRESS`` does. A holder running the request
        answers the copy from its duplicate window; a new process of the holder takes over
        the claim its predecessor left running and runs it — the only way that claim ends
        when no broker released it (a broker restarted between the new process's announce
        and its learning of the claim remembers no replacement: nemesis seed 46, an entry
        held 60 s). Taken: held until the holder's final record. No receipt: held all the
        same (the holder's going ``offline`` gives it back). Refused for now (busy,
        draining, claimed elsewhere meanwhile): given back a moment, its claim read again."""
        assert e.msg is not None
        log.info("replay.ask_holder request_id=%s holder=%s: its claim is running there",
                 e.request_id, holder)  # fmt: skip
        handed = await self._hand(e, self._target(holder, e.capability), _headers(e),
                                  self._marker_ttl_s(e))  # fmt: skip
        if handed is None:
            if await self.taken.hold(e, holder):  # (not when its release or result came first)
                log.info("replay.held request_id=%s holder=%s: running there",
                         e.request_id, holder)  # fmt: skip
            return "held"
        if not isinstance(handed, ReachError):
            return handed
        if handed.code == "IDEMPOTENCY_MISMATCH":
            return await self._mismatch(e, holder)
        if handed.code == "IN_PROGRESS" or retryable("error", handed):
            log.info("replay.holder_refused request_id=%s holder=%s error=%s: given back",
                     e.request_id, holder, handed.code)  # fmt: skip
            await give_back(e.msg, delay_s=STALL_WAIT_S)
            self._results["deferred"].inc()
            return "deferred"
        return await self._refused(e, holder, handed)

    async def _mismatch(self, e: Entry, holder: str) -> Outcome:
        """The request id was claimed for another body: the entry is another request under a
        used id. Removed without a run, counted and logged; no record is written (a
        ``failed`` of the broker's would be final for whoever waits on the request id's
        first body too)."""
        assert e.msg is not None
        await e.msg.ack_sync()
        self._results["mismatch"].inc()
        log.warning("replay.mismatch request_id=%s capability=%s holder=%s: the request id was "
                    "already claimed for another body; the entry is removed, not run",
                    e.request_id, e.capability, holder)  # fmt: skip
        return "mismatch"

    async def record_expired(self, e: Entry) -> None:
        ctx = self.ctx
        waited_s = (ctx.wall_ms() - e.enqueued_ms) / 1000.0 if e.enqueued_ms else 0.0
        await self.records.record_failed(
            e, ctx.broker_id, "TIMEOUT", "expired",
            f"queued for {waited_s:.1f}s on {self.subjects.comp(e.capability)}; expired before "
            "an agent was reachable",
        )  # fmt: skip
        self.expired += 1
        self._results["expired"].inc()
        log.info("replay.expired request_id=%s capability=%s", e.request_id, e.capability)


def _headers(e: Entry) -> dict[str, str]:
    """The headers ``e`` is sent with: its own, its request id, and a receipt asked for."""
    headers = e.task_headers()
    headers[H_REQUEST_ID] = e.request_id
    headers[schema.H_RECEIPT] = "1"
    return headers


def _reused(e: Entry, claimed_for: str | None) -> bool:
    """Whether ``e``'s body is another than the one its request id was claimed for (an
    entry or a claim without a digest is given the benefit of the doubt)."""
    return e.body_digest is not None and claimed_for is not None and e.body_digest != claimed_for
