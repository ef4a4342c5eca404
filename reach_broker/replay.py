"""Compensation replay: queued tasks go to an agent as soon as one is reachable.

A capability is replayed when an agent with it becomes ``healthy`` (a registry transition),
when an entry is enqueued while one already is, and on every sweep while entries wait. A
replay round takes every available entry of the capability through its shared durable
consumer (so two replicas never hold the same entry), orders them by priority then age, and
sends each as a task with its original ``Reach-Request-Id`` and ``Reach-Receipt: 1`` to an
agent the broker's Router picks, at most ``replay_concurrency`` at once (scaled down by the
slow-start share of a just-recovered agent). An entry is acked (removed) only after the
agent's receipt; if the broker dies first, or the ack is lost in a leader change, JetStream
redelivers it after ``ack_wait_s``. An entry whose request id an agent has claimed (KV
``reach_claims``: running, completed or failed), or that an agent answers ``IN_PROGRESS``,
is removed without being sent (``claimed``); the agents' own claims keep the handler from
running twice regardless. A redelivered entry is also looked up in the dispatch markers
(:mod:`reach_broker.dispatch`): acked at once when its ack record is stored, else sent to
the agent it went to.

Expired entries (``Reach-Expires-Ms`` passed) are recorded on ``REACH_ACKS`` as ``failed``
with ``error.reason = "expired"`` and removed: at replay, and by the periodic sweep for
capabilities no agent serves. Every record the broker writes is its own
(``reach.ack._broker.<request_id>``): besides those ``failed`` ones, a ``received`` naming the
agent whose receipt it got, written before the entry is acked, so that ``Client.wait`` knows
whose ack records to believe for a submitted task. The broker also watches ``reach.ack.>``
for the ack metrics (:mod:`reach_broker.ackwatch`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections.abc import Awaitable, Callable
from typing import Any, Literal, NamedTuple

from nats.aio.msg import Msg
from nats.errors import NoRespondersError

from jetstream import acks, compensation
from jetstream.compensation import Entry
from jetstream.names import H_EXPIRES_MS
from reach_agent import schema
from reach_agent.errors import ReachError, from_reply
from reach_agent.retry import retryable
from reach_agent.schema import AckRecord, RouteRequest
from reach_agent.subjects import BROKER_ACK_AUTHOR

from .ackwatch import AckWatch
from .context import BrokerContext
from .dispatch import MARKER_TTL_S, Dispatches
from .records import AgentRecord, Transition
from .routing import Router

log = logging.getLogger(__name__)

Outcome = Literal["replayed", "expired", "failed", "stalled", "claimed"]
FETCH_BATCH = 256


class Target(NamedTuple):
    """Where an entry goes (a route candidate's two fields the replayer reads)."""

    agent_id: str
    subject: str


class Replayer:
    """Broker component replaying ``REACH_COMPENSATION`` entries to reachable agents.
    Started only when the server has JetStream."""

    def __init__(
        self,
        ctx: BrokerContext,
        router: Router,
        holder_of: Callable[[str], Awaitable[str | None]],
        record_of: Callable[[str], AgentRecord | None] = lambda _: None,
    ) -> None:
        self.ctx = ctx
        self.router = router
        self.holder_of = holder_of
        """The agent holding a request id's claim (None: unclaimed or released)."""
        self.dispatches = Dispatches(ctx.nc, ctx.subjects, ctx.broker_id, record_of)
        """Where each entry was sent: exactly once across a leader change (dispatch.py)."""
        self.subjects = ctx.subjects
        self.cfg = ctx.cfg.compensation
        self.replayed = 0
        self.expired = 0
        self.failed = 0
        self.claimed = 0  # entries an agent had claimed: removed, not sent
        self._running: dict[str, asyncio.Task[None]] = {}
        self._again: set[str] = set()
        self._known: dict[str, int] = {}
        self._consumers: dict[str, Any] = {}
        self._next_expiry_ms = 0
        self.acks = AckWatch(ctx)
        """The ack metrics, fed by this component's ``<p>.ack.>`` subscription."""
        self._subs: list[Any] = []
        self._sweeper: asyncio.Task[None] | None = None
        self._route_req = RouteRequest(limit=3)

    # --- lifecycle ----------------------------------------------------------------------

    async def start(self) -> None:
        if self._sweeper is not None:
            return
        self.ctx.fanout.listeners.append(self._on_transition)
        limits = 1_000_000, 256 * 1024 * 1024
        self._subs = [
            await self.ctx.nc.subscribe(subject, cb=cb, pending_msgs_limit=limits[0],
                                 pending_bytes_limit=limits[1])
            for subject, cb in ((self.subjects.all_comp, self._on_enqueued),
                                (self.subjects.all_acks, self.acks.on_ack))
        ]  # fmt: skip
        self._sweeper = asyncio.create_task(self._sweep_loop(), name="reach-replay-sweep")

    async def stop(self) -> None:
        if self._sweeper is None:
            return
        with contextlib.suppress(ValueError):
            self.ctx.fanout.listeners.remove(self._on_transition)
        for sub in self._subs:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
        self._sweeper.cancel()
        tasks = [self._sweeper, *self._running.values()]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._sweeper = None
        for psub in self._consumers.values():
            with contextlib.suppress(Exception):
                await psub.unsubscribe()
        self._consumers.clear()

    # --- triggers -----------------------------------------------------------------------

    def _on_transition(self, t: Transition, rec: AgentRecord | None) -> None:
        if t.to == "healthy" and rec is not None:
            for cap in rec.capabilities:
                if self._known.get(cap):
                    self.kick(cap)

    async def _on_enqueued(self, msg: Msg) -> None:
        cap = self.subjects.capability_of_comp(msg.subject)
        self._known[cap] = self._known.get(cap, 0) + 1
        expires = compensation.header_int(msg.headers or {}, H_EXPIRES_MS)
        if expires and (not self._next_expiry_ms or expires < self._next_expiry_ms):
            self._next_expiry_ms = expires
        # The stream stores the entry about when this copy arrives: look a moment later.
        asyncio.get_running_loop().call_later(0.05, self.kick, cap)

    def kick(self, capability: str) -> None:
        """Replay ``capability`` now (or once more after the running round)."""
        if self._sweeper is None:
            return
        if capability in self._running:
            self._again.add(capability)
            return
        if not self._routable(capability):
            return
        task = asyncio.create_task(self._replay(capability), name=f"replay-{capability}")
        self._running[capability] = task

    def _routable(self, capability: str) -> bool:
        try:
            self.router.choose(capability, self._route_req, self.ctx.clock())
        except ReachError:
            return False
        return True

    def _limit(self, capability: str) -> int:
        """Replay concurrency, scaled by the best slow-start share among healthy agents."""
        share = self.router.slow_start_share(capability, self.ctx.clock())
        return max(1, round(self.cfg.replay_concurrency * share))

    # --- a replay round -----------------------------------------------------------------

    async def _replay(self, capability: str) -> None:
        try:
            while True:
                self._again.discard(capability)
                if not self._routable(capability):
                    return
                entries = await self._fetch(capability)
                if not entries:
                    if capability in self._again:
                        continue
                    return
                if await self._dispatch(capability, entries) == "stalled":
                    return
        except asyncio.CancelledError:
            raise
        except Exception:  # noqa: BLE001 - a failed round is retried by the next sweep
            log.exception("replay.failed capability=%s", capability)
        finally:
            self._running.pop(capability, None)

    async def _consumer(self, capability: str) -> Any:
        psub = self._consumers.get(capability)
        if psub is None:
            psub = await compensation.ensure_consumer(
                self.ctx.nc, capability, ack_wait_s=self.cfg.ack_wait_s,
                max_ack_pending=self.cfg.max_entries, subjects=self.subjects,
            )  # fmt: skip
            self._consumers[capability] = psub
        return psub

    async def _fetch(self, capability: str) -> list[Entry]:
        """Every entry of ``capability`` this replica can take now, by priority then age."""
        psub = await self._consumer(capability)
        info = await psub.consumer_info()
        waiting = int(info.num_pending or 0) + int(info.num_ack_pending or 0)
        if waiting == 0:
            self._known[capability] = 0
            return []
        msgs: list[Msg] = []
        while len(msgs) < waiting:
            try:
                got = await psub.fetch(batch=min(waiting - len(msgs), FETCH_BATCH), timeout=0.3)
            except TimeoutError:
                break
            msgs += got
            if len(got) < FETCH_BATCH:
                break
        entries = [compensation.entry_of(m, self.subjects) for m in msgs]
        entries.sort(key=lambda e: (-e.priority, e.enqueued_ms, e.seq))
        return entries

    async def _dispatch(self, capability: str, entries: list[Entry]) -> Outcome | None:
        """Deliver ``entries`` in order, bounded; give back (nak) what was not started."""
        held = {e.seq: e for e in entries}
        keepalive = asyncio.create_task(self._keepalive(held))
        inflight: set[asyncio.Task[Outcome]] = set()
        stalled = False
        try:
            for e in entries:
                while len(inflight) >= self._limit(capability):
                    done, inflight = await asyncio.wait(
                        inflight, return_when=asyncio.FIRST_COMPLETED
                    )
                    stalled = stalled or any(t.result() == "stalled" for t in done)
                if stalled:
                    break
                held.pop(e.seq, None)
                inflight.add(asyncio.create_task(self._deliver(e)))
            if inflight:
                results = await asyncio.gather(*inflight)
                stalled = stalled or "stalled" in results
        finally:
            keepalive.cancel()
            for e in held.values():  # not started: free for the next round or replica
                with contextlib.suppress(Exception):
                    assert e.msg is not None
                    await e.msg.nak()
        return "stalled" if stalled else None

    async def _keepalive(self, held: dict[int, Entry]) -> None:
        """Tell JetStream the entries still waiting for a slot are being worked on."""
        while True:
            await asyncio.sleep(self.cfg.ack_wait_s / 3)
            for e in list(held.values()):
                with contextlib.suppress(Exception):
                    assert e.msg is not None
                    await e.msg.in_progress()

    async def _deliver(self, e: Entry) -> Outcome:
        """Deliver one entry; a JetStream asset electing a leader (a marker or ack that
        times out, no responders) stalls the round: the entry comes back, and its marker
        and ack records decide what its redelivery does."""
        try:
            return await self._send(e)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - retried by the next round or the sweep
            log.info("replay.stalled request_id=%s error=%r", e.request_id, exc)
            with contextlib.suppress(Exception):
                assert e.msg is not None
                await e.msg.nak()
            return "stalled"

    async def _send(self, e: Entry) -> Outcome:
        ctx, router = self.ctx, self.router
        assert e.msg is not None  # fetched entries carry their message
        if e.expired(ctx.wall_ms()):
            await self.record_expired(e)
            await e.msg.ack_sync()
            return "expired"
        holder = await self.holder_of(e.request_id)
        if holder is not None:
            return await self._skip(e, holder, "claimed")
        headers = e.task_headers()
        headers[schema.H_REQUEST_ID] = e.request_id
        headers[schema.H_RECEIPT] = "1"
        only: str | None = None
        if e.msg.metadata.num_delivered > 1:  # sent before? (a leader change, a dead replica)
            done, only = await self.dispatches.redelivery(e.request_id)
            if done:
                await e.msg.ack_sync()
                log.info("replay.already_delivered request_id=%s", e.request_id)
                return "replayed"
        give_up = ctx.clock() + self.cfg.ack_wait_s / 2
        backoff = 0.05
        ttl_s = (e.expires_at_ms - ctx.wall_ms()) / 1000.0 if e.expires_at_ms else MARKER_TTL_S
        while True:
            try:
                candidates = (
                    router.route(e.capability, self._route_req, ctx.clock())
                    if only is None
                    else [Target(only, self.subjects.task(only, e.capability))]
                )
            except ReachError:
                await e.msg.nak()
                return "stalled"
            for c in candidates:
                sent_ms = ctx.wall_ms()
                await self.dispatches.mark(e.request_id, c.agent_id, sent_ms, ttl_s)
                try:
                    reply = await ctx.nc.request(
                        c.subject, e.data, timeout=self.cfg.receipt_timeout_s, headers=headers
                    )
                except (TimeoutError, NoRespondersError):
                    log.info("replay.no_receipt request_id=%s agent=%s", e.request_id, c.agent_id)
                    continue
                err = from_reply(reply.headers, reply.data)
                if err is not None and err.code == "IN_PROGRESS":
                    return await self._skip(e, getattr(err, "holder", ""), "in progress")
                if err is None:
                    self.acks.sent(e.request_id, sent_ms)
                    await self._record_taker(e, c.agent_id)
                    await e.msg.ack_sync()
                    self.replayed += 1
                    ctx.metrics.compensation_result["replayed"].inc()
                    log.info("replay.delivered request_id=%s capability=%s agent=%s priority=%d",
                             e.request_id, e.capability, c.agent_id, e.priority)  # fmt: skip
                    return "replayed"
                if retryable("error", err):  # not taken here, now: another agent, or later
                    only = None  # a refusal (busy, draining) means it did not take it
                    continue
                # The agent refused the task itself (BIZ_REJECT, LOOP_DETECTED, ...): final.
                await self._record_failed(e, c.agent_id, err.code, err.code.lower(), err.message)
                await e.msg.ack_sync()
                self.failed += 1
                return "failed"
            if ctx.clock() > give_up:
                await e.msg.nak()
                return "stalled"
            await asyncio.sleep(backoff * (0.5 + random.random()))
            backoff = min(backoff * 2, self.cfg.busy_retry_max_s)

    async def _skip(self, e: Entry, holder: str, why: str) -> Outcome:
        """The request id is an agent's already: remove the entry without running it."""
        assert e.msg is not None
        await e.msg.ack_sync()
        self.claimed += 1
        self.ctx.metrics.compensation_result["claimed"].inc()
        log.info("replay.claimed request_id=%s capability=%s holder=%s (%s): not sent again",
                 e.request_id, e.capability, holder, why)  # fmt: skip
        return "claimed"

    # --- failed / expired records -------------------------------------------------------

    async def record_expired(self, e: Entry) -> None:
        ctx = self.ctx
        waited_s = (ctx.wall_ms() - e.enqueued_ms) / 1000.0 if e.enqueued_ms else 0.0
        await self._record_failed(
            e, ctx.broker_id, "TIMEOUT", "expired",
            f"queued for {waited_s:.1f}s on {self.subjects.comp(e.capability)}; expired before "
            "an agent was reachable",
        )  # fmt: skip
        self.expired += 1
        ctx.metrics.compensation_result["expired"].inc()
        log.info("replay.expired request_id=%s capability=%s", e.request_id, e.capability)

    async def _record_failed(
        self, e: Entry, agent_id: str, code: str, reason: str, message: str
    ) -> None:
        rec = AckRecord(
            request_id=e.request_id, agent_id=agent_id, capability=e.capability,
            state="failed", at_ms=self.ctx.wall_ms(),
            error={"code": code, "reason": reason, "message": message},
        )  # fmt: skip
        await self._publish(rec)

    async def _record_taker(self, e: Entry, agent_id: str) -> None:
        """``received`` by the broker: it handed the task to ``agent_id`` (whose own records
        ``Client.wait`` then trusts). A failure is logged: the task was delivered anyway."""
        rec = AckRecord(request_id=e.request_id, agent_id=agent_id, capability=e.capability,
                        state="received", at_ms=self.ctx.wall_ms())  # fmt: skip
        try:
            await self._publish(rec)
        except Exception as exc:  # noqa: BLE001 - the entry is acked regardless
            log.warning("replay.taker_unrecorded request_id=%s agent=%s error=%r: wait() "
                        "needs agent_id= for it", e.request_id, agent_id, exc)  # fmt: skip

    async def _publish(self, rec: AckRecord) -> None:
        """One record of the broker's own (author ``_broker``)."""
        js = self.ctx.nc.jetstream(timeout=2.0)
        rid = rec.request_id
        await acks.publish_record(
            js,
            self.subjects.ack(BROKER_ACK_AUTHOR, rid),
            acks.ack_msg_id(BROKER_ACK_AUTHOR, rid, rec.state),
            schema.encoder.encode(rec),
        )

    # --- the sweep ----------------------------------------------------------------------

    async def _sweep_loop(self) -> None:
        while True:
            try:
                await self.sweep()
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - the loop never dies
                log.exception("replay.sweep_failed")
            await asyncio.sleep(self.cfg.sweep_interval_s)

    async def sweep(self) -> None:
        """Depth gauge; expired entries recorded and removed; waiting capabilities kicked."""
        ctx = self.ctx
        total, per = await compensation.depths(ctx.nc, self.subjects)
        ctx.metrics.compensation_depth.set(total)
        self._known = per
        if total and self._next_expiry_ms <= ctx.wall_ms():
            await self._expire_all()
        for cap, n in per.items():
            if n:
                self.kick(cap)

    async def _expire_all(self) -> None:
        nc = self.ctx.nc
        now_ms = self.ctx.wall_ms()
        soonest = 0
        limit = self.cfg.max_entries * 2
        for e in await compensation.scan(nc, subjects=self.subjects, limit=limit):
            if e.expired(now_ms):
                await self.record_expired(e)
                await compensation.remove(nc, e.seq)
            elif e.expires_at_ms and (not soonest or e.expires_at_ms < soonest):
                soonest = e.expires_at_ms
        self._next_expiry_ms = soonest or now_ms + int(self.cfg.default_ttl_s * 1000)
