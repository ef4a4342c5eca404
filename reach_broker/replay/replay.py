"""Compensation replay: queued tasks go to an agent as soon as one is reachable.

A capability is replayed when an agent with it becomes ``healthy`` (a registry transition),
when an entry is enqueued while one already is, and on every sweep while entries wait; when
every agent of it is full (the router answers ``OVERLOADED``), again after the refusal's
``retry_after_ms``. A broker that owns every partition (its router sees the whole fleet)
waits in the round for a slot, one entry at a time in the round's order, for at most half of
``ack_wait_s``; one that owns some routes only to its own agents, so it gives the entries
back for any replica at once and is kicked again later. A replay round takes every available
entry of the capability through its shared durable consumer (so two replicas never hold the
same entry), orders them by priority then age, and sends each as a task with its original
``Reach-Request-Id`` and ``Reach-Receipt: 1`` to an agent the broker's Router picks, at most
``replay_concurrency`` at once (scaled down by the slow-start share of a just-recovered
agent; one entry's delivery is :mod:`reach_broker.replay.replaysend`'s). After the agent's
receipt the entry is held (:mod:`reach_broker.replay.taken`) until the agent's final ack
record, and given back to run elsewhere should the agent go offline first; if the broker
dies, JetStream redelivers it after ``ack_wait_s``. An entry whose request id an agent has
claimed (KV ``reach_claims``) as completed or failed is removed without being sent
(``claimed``); one a live agent is running (its claim, or an ``IN_PROGRESS`` answer) is held
as that agent's; one whose holder is offline waits a moment for the claim's release. The
agents' own claims keep the handler from running twice regardless. A redelivered entry is
also looked up in the dispatch markers (:mod:`reach_broker.replay.dispatch`): acked at once
when its ack record is stored, else sent to the agent it went to.

Expired entries (``Reach-Expires-Ms`` passed) are recorded on ``REACH_ACKS`` as ``failed``
with ``error.reason = "expired"`` and removed: at replay, and by the periodic sweep for
capabilities no agent serves. Every record the broker writes is its own
(``reach.ack._broker.<request_id>``): besides those ``failed`` ones, a ``received`` naming the
agent whose receipt it got, written before the entry is acked, so that ``Client.wait`` knows
whose ack records to believe for a submitted task. The broker also watches ``reach.ack.>``
for the ack metrics (:mod:`reach_broker.replay.ackwatch`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from nats.aio.msg import Msg
from nats.errors import Error as NatsError

from jetstream import compensation
from jetstream.claims import ClaimsUnavailable
from jetstream.compensation import Entry, give_back
from jetstream.names import H_EXPIRES_MS
from jetstream.tasks import raise_if_cancelled
from reach_agent.aio import stop_loops
from reach_agent.wire.errors import Overloaded, ReachError
from reach_agent.wire.schema import RouteRequest
from reach_broker.config import CompensationSection
from reach_broker.core.records import AgentRecord, Transition
from reach_broker.core.routing import Router
from reach_broker.service.brokeracks import BrokerAcks
from reach_broker.service.context import BrokerContext
from reach_broker.service.metrics import ReplayMetrics
from reach_broker.service.releases import ClaimView

from .ackwatch import AckWatch
from .replaysend import EntrySender, Outcome, retry_after_s
from .taken import Taken

log = logging.getLogger(__name__)

_ENDS = ("full", "stalled")
"""The outcomes of an entry that end its round."""

FAILED_SAY_S = 30.0
"""How often a failed round is warned of (the others at debug, counted in the next)."""

AGAIN_MIN_S = 0.25
"""The soonest a full capability is kicked again (a refusal's hint may be 10 ms): a round
that finds its agents full at once fetches every waiting entry and gives them back."""


class Replayer:
    """Broker component replaying ``REACH_COMPENSATION`` entries to reachable agents.
    Started only when the server has JetStream."""

    def __init__(self, ctx: BrokerContext, router: Router,
                 claim_of: Callable[[str], Awaitable[ClaimView | None]],
                 record_of: Callable[[str], AgentRecord | None], records: BrokerAcks,
                 cfg: CompensationSection, metrics: ReplayMetrics,
                 whole_fleet: Callable[[], bool], owns_agent: Callable[[str], bool],
                 finished: Callable[[str, str], None] | None = None) -> None:  # fmt: skip
        """``whole_fleet``: whether this broker owns every partition (its router then sees
        every agent: an entry refused for load waits in the round for a slot, else it is
        given back for any replica); ``owns_agent``: whether it owns an agent's partition (an
        agent it does not know there is gone; elsewhere, another broker's); ``finished``:
        told of each completed record (the claims' releaser)."""
        self.ctx, self.cfg, self.metrics = ctx, cfg, metrics
        self.router = router
        self.claim_of = claim_of
        """A request id's claim: (holder, state), None when unclaimed; raises
        ``ClaimsUnavailable`` when the bucket cannot say."""
        self.subjects = ctx.subjects
        self._running: dict[str, asyncio.Task[None]] = {}
        self._again: set[str] = set()
        self._known: dict[str, int] = {}
        self._consumers: dict[str, Any] = {}
        self._next_expiry_ms = 0
        self.taken = Taken(
            cfg.ack_wait_s, claim_of, record_of, ctx.clock,
            on_returned=metrics.results["requeued"].inc, owns_agent=owns_agent,
            again=self._again_for,
        )  # fmt: skip
        """Entries delivered and held until their taker's final record."""
        self.acks = AckWatch(ctx, metrics, on_final=self.taken.done, on_completed=finished)
        """The ack metrics, fed by this component's ``<p>.ack.>`` subscription; it tells
        ``finished`` (the claims' releaser) of each completed record."""
        self.sender = EntrySender(ctx, router, claim_of, record_of, self.taken, self.acks,
                                  records, cfg, metrics.results, whole_fleet)  # fmt: skip
        """Sends one entry (replaysend.py) and counts how each ended (``replayed``,
        ``expired``, ``failed``, ``claimed``); its ``dispatches`` (dispatch.py) say where each
        entry was sent, exactly once across a leader change."""
        self._subs: list[Any] = []
        self._sweeper: asyncio.Task[None] | None = None
        self._stopping = False
        """Set as :meth:`stop` begins: no round starts after it (one started while stop()
        waited for the running ones outlived it and held what it fetched until
        ``ack_wait_s``: nemesis seed 42)."""
        self._failed_rounds = 0
        self._failed_said_at = -FAILED_SAY_S
        self._later: dict[str, asyncio.TimerHandle] = {}
        """Kicks set for when a full capability should have a slot again."""
        self._route_req = RouteRequest(limit=3)

    # --- lifecycle ----------------------------------------------------------------------

    async def start(self) -> None:
        if self._sweeper is not None:
            return
        self._stopping = False
        limits = 1_000_000, 256 * 1024 * 1024
        self._subs = [
            await self.ctx.nc.subscribe(subject, cb=cb, pending_msgs_limit=limits[0],
                                 pending_bytes_limit=limits[1])
            for subject, cb in ((self.subjects.all_comp, self._on_enqueued),
                                (self.subjects.all_acks, self.acks.on_ack))
        ]  # fmt: skip
        self._sweeper = asyncio.create_task(self._sweep_loop(), name="reach-replay-sweep")
        self.taken.start()

    async def stop(self) -> None:
        if self._sweeper is None:
            return
        self._stopping = True
        for sub in self._subs:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
        await stop_loops(self._sweeper, *self._running.values())
        for later in self._later.values():  # after the rounds, which may set one
            later.cancel()
        self._later.clear()
        await self.taken.stop()
        self._sweeper = None
        for psub in self._consumers.values():
            with contextlib.suppress(Exception):
                await psub.unsubscribe()
        self._consumers.clear()

    # --- triggers -----------------------------------------------------------------------

    def on_transition(self, t: Transition, rec: AgentRecord | None) -> None:
        """Consumer: an agent turned healthy has its capabilities replayed, an offline one's
        held entries are given back (ignored while not running)."""
        if self._sweeper is None:
            return
        if t.to == "healthy" and rec is not None:
            for cap in rec.capabilities:
                if self._known.get(cap):
                    self.kick(cap)
        elif (t.to == "offline" or t.kind == "evicted") and self.taken.held_by(t.agent_id):
            # A task only for an agent that holds entries: 1,000 agents going offline
            # together are 1,000 look-ups, not 1,000 tasks.
            self.ctx.spawn(self._taker_gone(t.agent_id), "replay-taker-gone")

    def claim_released(self, request_id: str, agent_id: str) -> None:
        """The claims bucket says ``agent_id``'s claim of ``request_id`` was released: an
        entry held for it is given back at once (:meth:`Taken.released`)."""
        if self._sweeper is None:
            return
        if not self.taken.holds(request_id):
            self.taken.released_before(request_id, agent_id)
            return
        self.ctx.spawn(self._released(request_id, agent_id), "replay-claim-released")

    async def _released(self, request_id: str, agent_id: str) -> None:
        cap = await self.taken.released(request_id, agent_id)
        if cap is not None:
            self._again_for(cap)

    async def _taker_gone(self, agent_id: str) -> None:
        for cap in await self.taken.taker_gone(agent_id):
            self._again_for(cap)

    def _again_for(self, capability: str) -> None:
        """An entry of ``capability`` was given back to run elsewhere: replayed again."""
        self._known[capability] = self._known.get(capability, 0) + 1
        self.kick(capability)

    async def _claimed_now(self, request_id: str) -> bool | None:
        """Whether an agent holds ``request_id``'s claim; None when the bucket cannot say
        now (counted): the entry is then not expired on a guess, and looked at again."""
        try:
            claim = await self.claim_of(request_id)
        except ClaimsUnavailable:
            return None
        return claim is not None and claim[1] != "released"

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
        if self._sweeper is None or self._stopping:
            return
        if capability in self._running:
            self._again.add(capability)
            return
        if not self._routable(capability):
            return
        task = asyncio.create_task(self._replay(capability), name=f"replay-{capability}")
        self._running[capability] = task

    def _routable(self, capability: str) -> bool:
        """Whether the router routes ``capability`` now. When only load stops it, the
        capability is kicked again when a slot should be free (the refusal's hint): no sign
        comes of a slot freed, and the sweep is seconds away (nemesis seed 34)."""
        try:
            self.router.choose(capability, self._route_req, self.ctx.clock())
        except Overloaded as exc:
            self._kick_later(capability, retry_after_s(exc))
            return False
        except ReachError:
            return False
        return True

    def _kick_later(self, capability: str, delay_s: float) -> None:
        """One pending kick per capability (a sooner one is not moved), at least
        :data:`AGAIN_MIN_S` away."""
        if capability not in self._later:
            self._later[capability] = asyncio.get_running_loop().call_later(
                max(delay_s, AGAIN_MIN_S), self._kick_now, capability
            )

    def _kick_now(self, capability: str) -> None:
        del self._later[capability]
        if self._known.get(capability):  # else drained meanwhile (the sweep counts them)
            self.kick(capability)

    def _limit(self, capability: str) -> int:
        """Replay concurrency, scaled by the best slow-start share among healthy agents."""
        share = self.router.slow_start_share(capability, self.ctx.clock())
        return max(1, round(self.cfg.replay_concurrency * share))

    # --- a replay round -----------------------------------------------------------------

    async def _replay(self, capability: str) -> None:
        try:
            while True:
                raise_if_cancelled()
                self._again.discard(capability)
                if not self._routable(capability):
                    return
                entries = await self._fetch(capability)
                ended = await self._dispatch(capability, entries) if entries else None
                if ended == "full":  # given back for load: looked at again after the
                    # refusal's hint, or soon when a slot freed meanwhile (else nothing but
                    # a submit or the sweep did: nemesis seed 36)
                    if self._routable(capability):
                        self._kick_later(capability, AGAIN_MIN_S)
                    return
                if ended == "stalled" or capability not in self._again:  # (else enqueued
                    return  # during the round: taken at once)
        except asyncio.CancelledError:
            raise
        except (NatsError, TimeoutError) as exc:  # JetStream slow or away: a fault, not a bug
            self._round_failed(capability, exc)
        except Exception:  # noqa: BLE001 - a failed round is retried by the next sweep
            log.exception("replay.failed capability=%s", capability)
        finally:
            self._running.pop(capability, None)

    def _round_failed(self, capability: str, exc: Exception) -> None:
        """Warned at most every :data:`FAILED_SAY_S`, naming the rounds failed since: each
        submit starts a round, and while JetStream could not answer that was a warning a
        submit (12 a second in nemesis seed 36)."""
        self._failed_rounds += 1
        now = self.ctx.clock()
        if now - self._failed_said_at < FAILED_SAY_S:
            log.debug("replay.round_failed capability=%s error=%s", capability, exc)
            return
        self._failed_said_at = now
        log.warning("replay.round_failed capability=%s error=%s rounds_failed=%d: tried "
                    "again at the next submit or sweep", capability, exc,
                    self._failed_rounds)  # fmt: skip
        self._failed_rounds = 0

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
        entries = await compensation.take(await self._consumer(capability), self.subjects)
        if entries is None:
            self._known[capability] = 0
            return []
        return entries

    async def _dispatch(self, capability: str, entries: list[Entry]) -> Outcome | None:
        """Deliver ``entries`` in order, bounded; give back (nak) what was not started. How
        the round ended: ``full`` (entries given back for load), ``stalled`` (JetStream), or
        None (every entry went its way)."""
        held = {e.seq: e for e in entries}
        keepalive = asyncio.create_task(self._keepalive(held))
        inflight: set[asyncio.Task[Outcome]] = set()
        ended: list[Outcome] = []
        try:
            for e in entries:
                while len(inflight) >= self._limit(capability):
                    done, inflight = await asyncio.wait(
                        inflight, return_when=asyncio.FIRST_COMPLETED
                    )
                    ended += [r for t in done if (r := t.result()) in _ENDS]
                if ended:
                    break
                held.pop(e.seq, None)
                inflight.add(asyncio.create_task(self.sender.deliver(e)))
            if inflight:
                ended += [r for r in await asyncio.gather(*inflight) if r in _ENDS]
        except asyncio.CancelledError:
            # asyncio.wait leaves what it waits on running: cancelled here, so that each
            # gives its entry back before the broker's connection closes (a stopped
            # broker's deliveries outlived it, their entries back after ack_wait_s).
            for task in inflight:
                task.cancel()
            await asyncio.gather(*inflight, return_exceptions=True)
            raise
        finally:
            keepalive.cancel()
            # Not started: free for the next round or replica.
            await asyncio.gather(*(give_back(e.msg) for e in held.values() if e.msg),
                                 return_exceptions=True)  # fmt: skip
        if "full" in ended:  # said once a round (a line an entry came 40 a second)
            log.info("replay.full capability=%s given_back=%d: this broker's agents of it are "
                     "full; looked at again soon, another broker's may take them",
                     capability, ended.count("full") + len(held))  # fmt: skip
            return "full"
        return "stalled" if ended else None

    async def _keepalive(self, held: dict[int, Entry]) -> None:
        """Tell JetStream the entries still waiting for a slot are being worked on."""
        while True:
            raise_if_cancelled()
            await asyncio.sleep(self.cfg.ack_wait_s / 3)
            for e in list(held.values()):
                with contextlib.suppress(Exception):
                    assert e.msg is not None
                    await e.msg.in_progress()

    # --- the sweep ----------------------------------------------------------------------

    async def _sweep_loop(self) -> None:
        while True:
            raise_if_cancelled()
            try:
                await self.sweep()
            except asyncio.CancelledError:
                raise
            except TimeoutError:  # nats' too: a busy server or broker, not a bug
                log.warning("replay.sweep_failed JetStream did not answer in time: swept "
                            "again in %g s", self.cfg.sweep_interval_s)  # fmt: skip
            except compensation.QueueError as exc:  # the store's own refusal, not a bug
                # (nemesis seed 65: "JetStream system temporarily unavailable" during an
                # election was logged with a traceback)
                log.warning("replay.sweep_failed %s: swept again in %g s", exc,
                            self.cfg.sweep_interval_s)  # fmt: skip
            except Exception:  # noqa: BLE001 - the loop never dies
                log.exception("replay.sweep_failed")
            await asyncio.sleep(self.cfg.sweep_interval_s)

    async def sweep(self) -> None:
        """Depth gauge; expired entries recorded and removed; waiting capabilities kicked."""
        ctx = self.ctx
        total, per = await compensation.depths(ctx.nc, self.subjects)
        self.metrics.depth.set(total)
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
                if self.taken.holds(e.request_id):
                    continue  # delivered and running (this replica holds it): not expired
                claimed = await self._claimed_now(e.request_id)
                if claimed is None:
                    soonest = now_ms  # unknown now: the next sweep looks again
                if claimed is not False:
                    continue  # delivered and running (a replica holds it): not expired
                await self.sender.record_expired(e)
                await compensation.remove(nc, e.seq)
            elif e.expires_at_ms and (not soonest or e.expires_at_ms < soonest):
                soonest = e.expires_at_ms
        self._next_expiry_ms = soonest or now_ms + int(self.cfg.default_ttl_s * 1000)
