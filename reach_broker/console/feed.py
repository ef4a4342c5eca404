"""The console's broker component: it remembers (history), follows the audit trail while
the events are watched, and pushes the fleet to the pages that watch, as server-sent events.

Given the broker context, its config section, the registry and the explainer (never the
broker), and started by the broker after its other components, when the HTTP port shows the
console. It is told of every transition (one of the broker's consumers). It samples the
fleet every ``console.sample_s`` for the per-agent charts. The audit trail is followed only
while something needs the events (:meth:`Feed.needing_events`: a page watching, a request
for the timeline or an agent's transitions) and for ``console.follow_idle_s`` after the last
need ended: a follow reads the last ``console.events`` events of ``REACH_AUDIT`` and then the
trail live (:class:`jetstream.follow.Follower`: no gap, no duplicate, also across a
reconnect; plain ``<prefix>.event.>`` when the server has no JetStream). Nobody watching,
no broker decodes the fleet's transitions for its console (with partitions every broker
would otherwise decode every transition of the whole fleet). While at least one page
watches, it encodes the fleet once every ``console.push_s`` (and about 50 ms after any
transition) and hands the same bytes to every page; every 5 s it reads the compensation
queue's depth per capability and the age of each one's oldest entry, and asks every
partition's owner for its agent count (:mod:`.owners`). Nobody watching, it does no more than
the sampling and the ack records (the latency charts).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Mapping
from typing import Any

import msgspec

from jetstream import audit, compensation
from jetstream.follow import UNCOUNTED, FollowMetrics
from jetstream.names import AUDIT_STREAM
from jetstream.tasks import raise_if_cancelled
from reach_agent.aio import stop_loops
from reach_agent.wire import schema
from reach_broker import __version__
from reach_broker.config import ConsoleSection
from reach_broker.core.explain import Explainer
from reach_broker.core.records import AgentRecord, Transition
from reach_broker.core.registry import Registry
from reach_broker.service.context import BrokerContext

from .capseries import CapabilitySeries
from .history import History
from .owners import OwnersView, owners
from .views import CompensationView, QueueDepth, Views, event_view

log = logging.getLogger(__name__)

COMPENSATION_EVERY_S = 5.0
HISTORY_QUIET_S = 2.0
"""When a follow starts, reading the audit history gives up when no event came for this
long."""
DEBOUNCE_S = 0.05
"""After a transition the fleet is pushed this much later, so a burst is one push."""
QUEUE_MAX = 256
"""Messages waiting for one page; a page that falls that far behind is dropped (its
EventSource reconnects and starts from a fresh fleet)."""
RECENT_EVENTS = 100
"""Events a page gets when it connects (the timeline keeps ``console.events``)."""

_json = msgspec.json.Encoder()


class _AckHead(msgspec.Struct):
    """What the latency charts read of an ack record (its result is skipped)."""

    request_id: str
    capability: str
    state: str
    at_ms: int
    received_ms: int | None = None


_ack_head = msgspec.json.Decoder(_AckHead)


def sse(kind: str, data: bytes) -> bytes:
    """One server-sent event (``data`` is one line of JSON)."""
    return b"event: " + kind.encode() + b"\ndata: " + data + b"\n\n"


class Watcher:
    """One page's stream: the messages waiting for it (None: end the stream)."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue[bytes | None] = asyncio.Queue(QUEUE_MAX + 1)
        self.dropped = False

    def offer(self, message: bytes) -> None:
        if self.dropped:
            return
        if self.queue.qsize() >= QUEUE_MAX:
            self.dropped = True
            self.queue.put_nowait(None)
            return
        self.queue.put_nowait(message)


class Feed:
    """History, audit follow and the pushes to watching pages."""

    def __init__(self, ctx: BrokerContext, registry: Registry, explainer: Explainer,
                 cfg: ConsoleSection, route_counts: Mapping[str, int] | None = None,
                 follow: FollowMetrics = UNCOUNTED) -> None:  # fmt: skip
        """``follow``: what the audit follow counts into."""
        self.ctx = ctx
        self._follow_metrics = follow
        self.route_counts: Mapping[str, int] = {} if route_counts is None else route_counts
        """The broker's route requests per capability (``Handlers.route_counts``)."""
        self.capabilities = CapabilitySeries()
        """Per capability: routes/s and call latency, 15 minutes (:mod:`.capseries`)."""
        self._acks: Any = None
        self.registry = registry
        self.cfg = cfg
        self.history = History(self.cfg.sample_s, self.cfg.history_s, self.cfg.events,
                               self.cfg.chart_agents)  # fmt: skip
        self.views = Views(registry, explainer, ctx.broker_id)
        self.watchers: set[Watcher] = set()
        self.compensation = CompensationView(at_ms=0, available=False)
        self.owners = OwnersView(at_ms=0, partitions=0, rows=[], brokers={})
        """Each partition's owner and agent count, as last asked (with the compensation)."""
        self._dirty = asyncio.Event()
        self._follow: audit.Follow | None = None
        self._kept_seq = 0
        """Stream sequence of the last stored event kept: a follow started again skips those
        the timeline already has (a sequence names one event exactly; the key of
        :meth:`History.event` only merges replicas' copies)."""
        self._needs = 0
        """Requests waiting for the events or being answered with them (pages connecting)."""
        self._need_ended = 0.0
        """Event loop time the last need ended (a page left, a request was answered)."""
        self._wanted = asyncio.Event()
        """Set when a need begins or ends: the follow loop looks again."""
        self._ready = asyncio.Event()
        """Set while the follow runs and has read the recent history (or the feed stopped)."""
        self._tasks: list[asyncio.Task[None]] = []

    # --- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        if self._tasks:
            return
        self.history.sample(self.ctx.wall_ms(), self.registry.agents)
        self.capabilities.routes(self.route_counts, self.ctx.wall_ms())
        await self._follow_acks()
        self._ready.clear()
        if not self._needs:
            self._wanted.clear()  # a need ended before a stop: nobody waits for a follow
        self._tasks = [
            asyncio.create_task(self._sample_loop(), name="reach-console-sample"),
            asyncio.create_task(self._push_loop(), name="reach-console-push"),
            asyncio.create_task(self._follow_loop(), name="reach-console-follow"),
        ]

    async def stop(self) -> None:
        if not self._tasks:
            return
        await stop_loops(*self._tasks)
        self._tasks = []
        if self._acks is not None:
            with contextlib.suppress(Exception):
                await self._acks.unsubscribe()
            self._acks = None
        await self._unfollow(delete=False)  # the connection closes next: the server cleans up
        self._ready.set()  # whoever still waits for the events is answered (and ended)
        for w in list(self.watchers):
            w.queue.put_nowait(None)

    async def _follow_acks(self) -> None:
        """The agents' ack records (``<p>.ack.>``), for the call latency charts."""
        try:
            self._acks = await self.ctx.nc.subscribe(self.ctx.subjects.all_acks,
                                                     cb=self._on_ack)  # fmt: skip
        except Exception as exc:  # noqa: BLE001 - the console must not stop the broker
            log.warning("console.no_acks error=%r: no call latency charts", exc)

    async def _on_ack(self, msg: Any) -> None:
        try:
            head = _ack_head.decode(msg.data)
        except msgspec.MsgspecError:
            return
        self.capabilities.ack(head.request_id, head.capability, head.state, head.at_ms,
                              head.received_ms)  # fmt: skip

    @contextlib.asynccontextmanager
    async def needing_events(self) -> AsyncIterator[None]:
        """While a request needs the events (a page connecting, the timeline, an agent's
        transitions): the audit follow is started if it was not, and the body runs once it
        has read the recent history; it is stopped ``follow_idle_s`` after the last need
        ended and the last page left. Any number of requests at once share one follow."""
        self._needs += 1
        self._wanted.set()
        try:
            await self._ready.wait()
            yield
        finally:
            self._needs -= 1
            self._need_ended = asyncio.get_running_loop().time()
            self._wanted.set()

    def _idle_left(self) -> float:
        """How long the follow may go on without a need: ``follow_idle_s`` while one lasts
        (looked at again when it ends), else what is left of it since the last one ended."""
        idle_s = self.cfg.follow_idle_s
        if self._needs or self.watchers:
            return idle_s
        return idle_s - (asyncio.get_running_loop().time() - self._need_ended)

    async def _follow_loop(self) -> None:
        """The audit follow, from the first need to ``follow_idle_s`` after the last. One
        loop starts and stops it, so needs that come together share one follow, and a need
        that comes while it stops gets the next one."""
        while True:
            raise_if_cancelled()
            await self._wanted.wait()
            try:
                await self._follow_audit()
            except Exception:  # noqa: BLE001 - the loop body never dies
                log.exception("console.follow_failed")
            self._ready.set()  # followed or not, whoever waits is answered
            while (idle_s := self._idle_left()) > 0:
                self._wanted.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wanted.wait(), idle_s)
            # Decided with no await since the last look: a need from here on waits for the
            # next follow (the loop finds _wanted set again).
            self._ready.clear()
            self._wanted.clear()
            await self._unfollow(delete=True)
            log.info("console.unfollowed last_seq=%d: nobody watches", self._kept_seq)

    async def _unfollow(self, *, delete: bool) -> None:
        """Stop the follow; ``delete``: its consumer removed now, not when the server
        notices that nobody listens."""
        follow, self._follow = self._follow, None
        if follow is not None:
            await follow.stop(delete=delete)

    async def _follow_audit(self) -> None:
        """The last ``console.events`` events (those not kept yet), then every one live."""
        nc, subjects = self.ctx.nc, self.ctx.subjects
        with contextlib.suppress(Exception):  # no JetStream, no trail: said just below
            info = await nc.jetstream(timeout=2.0).stream_info(AUDIT_STREAM)
            if info.state.last_seq < self._kept_seq:  # the trail was made again: numbered anew
                self._kept_seq = 0
        try:
            self._follow = await audit.follow_events(
                nc, self._on_stored, subjects=subjects, last=self.cfg.events,
                metrics=self._follow_metrics,
            )  # fmt: skip
            # The history is in before the page that asked is answered (or the trail went
            # quiet).
            await self._follow.until_caught_up(HISTORY_QUIET_S)
            log.info("console.following last_seq=%d delivered=%d: a page watches",
                     self._kept_seq, self._follow.delivered)  # fmt: skip
            return
        except audit.AuditUnavailable as exc:
            log.info("console.live_events_only %s", exc)
        except Exception as exc:  # noqa: BLE001 - the console must not stop the broker
            log.warning("console.audit_unreadable error=%r: live events only", exc)
            await self._unfollow(delete=True)
        try:
            self._follow = await audit.live_events(nc, self._on_stored, subjects=subjects)
        except Exception as exc:  # noqa: BLE001
            log.warning("console.no_events error=%r: the timeline stays empty", exc)

    # --- what the page is sent -----------------------------------------------------------------

    def fleet_json(self) -> bytes:
        ctx = self.ctx
        return _json.encode(self.views.fleet(ctx.clock(), ctx.wall_ms(), self.cfg.max_agents))

    def agent_json(self, agent_id: str) -> bytes | None:
        """The agent in detail (its transitions from the events: asked within
        :meth:`needing_events`)."""
        ctx = self.ctx
        detail = self.views.agent(agent_id, self.history, self.cfg.sample_s, ctx.clock(),
                                  ctx.wall_ms())  # fmt: skip
        if detail is None:
            return None
        self.history.watch(agent_id)  # a viewer looks: charted from the next tick, if not yet
        return _json.encode(detail)

    def events_json(self, n: int = RECENT_EVENTS) -> bytes:
        """The last ``n`` events of the timeline (asked within :meth:`needing_events`)."""
        entries = list(self.history.events)[-n:]
        return _json.encode([event_view(e) for e in entries])

    def hello_json(self) -> bytes:
        cfg = self.cfg
        return _json.encode({"broker_id": self.ctx.broker_id, "version": __version__,
                             "prefix": self.ctx.subjects.prefix, "sample_s": cfg.sample_s,
                             "history_s": cfg.history_s})  # fmt: skip

    async def watch(self) -> Watcher:
        """A new page: it gets who we are, the fleet, the recent events and the queue, then
        every event stored (the follow runs while it watches: no gap, none twice)."""
        async with self.needing_events():
            w = Watcher()
            if not self.running:  # stopped while it waited
                w.queue.put_nowait(None)
                return w
            self._greet(w)
            self.watchers.add(w)
        self._dirty.set()  # the compensation poll runs soon for a first watcher
        return w

    def _greet(self, w: Watcher) -> None:
        for kind, data in (("hello", self.hello_json()), ("fleet", self.fleet_json()),
                           ("events", self.events_json()),
                           ("compensation", _json.encode(self.compensation)),
                           ("owners", _json.encode(self.owners))):  # fmt: skip
            w.offer(sse(kind, data))

    def unwatch(self, w: Watcher) -> None:
        """The page is gone (or was dropped): the follow stops ``follow_idle_s`` after the
        last one."""
        self.watchers.discard(w)
        self._need_ended = asyncio.get_running_loop().time()
        self._wanted.set()

    def _send(self, message: bytes) -> None:
        for w in list(self.watchers):
            w.offer(message)
            if w.dropped:
                self.watchers.discard(w)

    # --- inputs --------------------------------------------------------------------------------

    @property
    def running(self) -> bool:
        """Started and not stopped: the pages may be served."""
        return bool(self._tasks)

    def on_transition(self, t: Transition, rec: AgentRecord | None) -> None:
        """Consumer: the fleet is pushed soon (O(1): the push loop does the work, and only
        when watched)."""
        self._dirty.set()

    async def _on_stored(self, stored: audit.StoredEvent) -> None:
        if stored.seq:  # 0: a live event (no JetStream)
            if stored.seq <= self._kept_seq:
                return  # kept by an earlier follow
            self._kept_seq = stored.seq
        try:
            event = schema.event_decoder.decode(stored.data)
        except msgspec.MsgspecError:
            log.debug("console.bad_event subject=%s", stored.subject)
            return
        entry = self.history.event(event)
        if entry is not None and self.watchers:
            self._send(sse("event", _json.encode(event_view(entry))))

    # --- loops ---------------------------------------------------------------------------------

    async def _sample_loop(self) -> None:
        while True:
            raise_if_cancelled()
            await asyncio.sleep(self.cfg.sample_s)
            try:
                wall_ms = self.ctx.wall_ms()
                self.history.sample(wall_ms, self.registry.agents)
                self.capabilities.routes(self.route_counts, wall_ms)
                self.capabilities.expire(wall_ms)
            except Exception:  # noqa: BLE001 - the loop body never dies
                log.exception("console.sample_failed")

    async def _push_loop(self) -> None:
        next_comp = 0.0
        while True:
            raise_if_cancelled()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._dirty.wait(), self.cfg.push_s)
                await asyncio.sleep(DEBOUNCE_S)
            self._dirty.clear()
            if not self.watchers:
                continue
            try:
                self._send(sse("fleet", self.fleet_json()))
                now = self.ctx.clock()
                if now >= next_comp:
                    next_comp = now + COMPENSATION_EVERY_S
                    self.compensation = await self._compensation()
                    self._send(sse("compensation", _json.encode(self.compensation)))
                    self.owners = await owners(self.ctx.nc, self.ctx.subjects, self.ctx.wall_ms())
                    self._send(sse("owners", _json.encode(self.owners)))
            except Exception:  # noqa: BLE001 - the loop body never dies
                log.exception("console.push_failed")

    async def _compensation(self) -> CompensationView:
        """Depth per capability and the enqueue time of each one's oldest entry."""
        nc, subjects, at_ms = self.ctx.nc, self.ctx.subjects, self.ctx.wall_ms()
        try:
            total, per = await compensation.depths(nc, subjects)
            rows = []
            for cap, depth in sorted(per.items()):
                first = await compensation.oldest(nc, cap, subjects=subjects) if depth else None
                rows.append(QueueDepth(capability=cap, depth=depth,
                                       oldest_ms=first.enqueued_ms if first else None))  # fmt: skip
        except Exception as exc:  # noqa: BLE001 - no JetStream, no stream: the page says so
            return CompensationView(at_ms=at_ms, available=False, error=str(exc) or repr(exc))
        return CompensationView(at_ms=at_ms, available=True, total=total, capabilities=rows)
