"""The console's broker component: it remembers (history), follows the audit trail and the
ack records while they are watched, and pushes the fleet to the pages that watch, as
server-sent events.

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
would otherwise decode every transition of the whole fleet). The agents' ack records (the
call latency charts, :mod:`.capseries`) are followed the same way, while something needs the
charts (:meth:`Feed.needing_charts`: a page watching, ``/api/charts``) and for
``console.follow_idle_s`` after: a follow reads the records stored in the charts' window (at
most :data:`ACK_BACKFILL_MAX`, the newest, and none an earlier follow charted) and then each
one stored (a :class:`~jetstream.follow.Follower` on ``REACH_ACKS``; plain ``<prefix>.ack.>``
without JetStream, live only). One :class:`Demand` per follow starts and stops it. While at
least one page watches, it encodes the fleet once every ``console.push_s`` (and about 50 ms
after any transition) and hands the same bytes to every page; every 5 s it reads the
compensation queue's depth per capability and the age of each one's oldest entry, and asks
every partition's owner for its agent count (:mod:`.owners`). Nobody watching, it does no
more than the sampling: no consumer, no subscription, nothing of the fleet decoded.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any

import msgspec
from nats.aio.msg import Msg
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeout
from nats.js.errors import APIError, NotFoundError, ServiceUnavailableError

from jetstream import audit, compensation
from jetstream.follow import UNCOUNTED, Follower, FollowMetrics, Start
from jetstream.names import ACK_STREAM, AUDIT_STREAM, JS_NOT_ENABLED
from jetstream.tasks import raise_if_cancelled
from reach_agent.aio import stop_loops
from reach_agent.connection import flush_subscriptions
from reach_agent.wire import schema
from reach_broker import __version__
from reach_broker.config import ConsoleSection
from reach_broker.core.explain import Explainer
from reach_broker.core.records import AgentRecord, Transition
from reach_broker.core.registry import Registry
from reach_broker.service.context import BrokerContext

from .capseries import CapabilitySeries, window_start_ms
from .history import History
from .owners import OwnersView, owners
from .views import CompensationView, QueueDepth, Views, event_view

log = logging.getLogger(__name__)

COMPENSATION_EVERY_S = 5.0
HISTORY_QUIET_S = 2.0
"""When a follow starts, reading the stored events (or ack records) gives up when none came
for this long."""
ACK_BACKFILL_MAX = 20_000
"""Stored ack records a follow reads at most when it starts: the charts' window
(:func:`.capseries.window_start_ms`), or, when the window holds more, its newest this many
(about 10,000 calls; the older buckets of the window stay empty). The read is one burst on
the broker's event loop, handed over 32 records at a time between its other work as every
follow's is: 20,000 records took 0.23-0.30 s (11-15 µs a record, the loop's longest pause
12-39 ms, in nats-py's reading of the deliveries) on a 2-core machine with a loopback
server, whatever the fleet; the request that started the follow waits for it."""
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


class Demand:
    """One of the console's follows, run only while something needs it: started at the
    first need, needs answered once it has read its history, stopped ``idle_s`` after the
    last need ended and the last page left. One loop (:meth:`run`) starts and stops it, so
    needs that come together share one follow, and a need that comes while it stops waits
    for the next one."""

    def __init__(self, name: str, begin: Callable[[], Awaitable[None]],
                 end: Callable[[], Awaitable[None]], idle_s: float,
                 watched: Callable[[], bool]) -> None:  # fmt: skip
        """``begin``: start the follow, returning once its history is read (what it cannot
        read it says itself); ``end``: stop it, nobody needing it; ``watched``: whether a
        page watches (a need for as long as it does)."""
        self.name = name
        self._begin = begin
        self._end = end
        self.idle_s = idle_s
        self._watched = watched
        self.needs = 0
        """Requests waiting for the follow or being answered with it (pages connecting)."""
        self._ended = 0.0
        """Event loop time the last need ended (a page left, a request was answered)."""
        self._wanted = asyncio.Event()
        """Set when a need begins or ends: the loop looks again."""
        self._ready = asyncio.Event()
        """Set while the follow runs and has read its history (or the feed stopped)."""

    def reset(self) -> None:
        """At the feed's start: a need that ended before a stop wants no follow."""
        self._ready.clear()
        if not self.needs:
            self._wanted.clear()

    def release(self) -> None:
        """At the feed's stop: whoever still waits is answered (and ended)."""
        self._ready.set()

    @contextlib.asynccontextmanager
    async def need(self, *, wait: bool = True) -> AsyncIterator[None]:
        """The follow runs while the body does (``wait``: the body starts once it has read
        its history) and ``idle_s`` after."""
        self.needs += 1
        self._wanted.set()
        try:
            if wait:
                await self._ready.wait()
            yield
        finally:
            self.needs -= 1
            self.ended()

    def ended(self) -> None:
        """A need ended or a page left: the idle time counts from now."""
        self._ended = asyncio.get_running_loop().time()
        self._wanted.set()

    def _idle_left(self) -> float:
        """How long the follow may go on without a need: ``idle_s`` while one lasts (looked
        at again when it ends), else what is left of it since the last one ended."""
        if self.needs or self._watched():
            return self.idle_s
        return self.idle_s - (asyncio.get_running_loop().time() - self._ended)

    async def run(self) -> None:
        """From the first need to ``idle_s`` after the last, again and again."""
        while True:
            raise_if_cancelled()
            await self._wanted.wait()
            try:
                await self._begin()
            except Exception:  # noqa: BLE001 - the loop body never dies
                log.exception("console.follow_failed follow=%s", self.name)
            self._ready.set()  # followed or not, whoever waits is answered
            while (idle_s := self._idle_left()) > 0:
                self._wanted.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wanted.wait(), idle_s)
            # Decided with no await since the last look: a need from here on waits for the
            # next follow (the loop finds _wanted set again).
            self._ready.clear()
            self._wanted.clear()
            await self._end()


class AckFollow:
    """The ack records the latency charts read: the stored ones from a start, then each one
    stored (``follower``), or, without JetStream, those published from now on (``sub``)."""

    def __init__(self, stale: int) -> None:
        self.follower: Follower | None = None
        self.sub: Any = None
        self.caught_up = asyncio.Event()
        """Set once the records stored when it started are read (at once for live ones)."""
        self.read = 0
        """Records handed over so far."""
        self.unreadable = 0
        """Records that are not ack records (not decoded: not charted)."""
        self.stale_before = stale
        """:attr:`CapabilitySeries.stale` when it started."""

    async def until_caught_up(self, quiet_s: float) -> bool:
        """Wait until caught up; False when no record arrived for ``quiet_s`` before that."""
        while not self.caught_up.is_set():
            raise_if_cancelled()
            seen = self.read
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.caught_up.wait(), quiet_s)
            if self.read == seen and not self.caught_up.is_set():
                return False
        return True

    async def stop(self, *, delete: bool) -> None:
        """Stop the deliveries (``delete``: the consumer removed now, see
        :meth:`Follower.stop`)."""
        if self.follower is not None:
            follower, self.follower = self.follower, None
            await follower.stop(delete=delete)
        if self.sub is not None:
            sub, self.sub = self.sub, None
            with contextlib.suppress(Exception):  # a closed connection has nothing to undo
                await sub.unsubscribe()


def _unavailable(exc: BaseException) -> str | None:
    """Why ``REACH_ACKS`` cannot be read here, when the error says it cannot (else None:
    something else failed)."""
    if isinstance(exc, NotFoundError):
        return f"stream {ACK_STREAM} not found on this server"
    if isinstance(exc, (NoRespondersError, ServiceUnavailableError, NatsTimeout)):
        return "JetStream is not available on this server"
    if isinstance(exc, APIError) and exc.err_code == JS_NOT_ENABLED:
        return "JetStream is not enabled for this account"
    return None


class Feed:
    """History, the follows of the audit trail and the ack records, and the pushes to
    watching pages."""

    def __init__(self, ctx: BrokerContext, registry: Registry, explainer: Explainer,
                 cfg: ConsoleSection, route_counts: Mapping[str, int] | None = None,
                 follow: FollowMetrics = UNCOUNTED,
                 ack_follow: FollowMetrics = UNCOUNTED) -> None:  # fmt: skip
        """``follow``, ``ack_follow``: what the audit follow and the ack records' follow count
        into."""
        self.ctx = ctx
        self._follow_metrics = follow
        self._ack_metrics = ack_follow
        self.route_counts: Mapping[str, int] = {} if route_counts is None else route_counts
        """The broker's route requests per capability (``Handlers.route_counts``)."""
        self.capabilities = CapabilitySeries()
        """Per capability: routes/s and call latency, 15 minutes (:mod:`.capseries`)."""
        self._ack_follow: AckFollow | None = None
        self._ack_seq = 0
        """Stream sequence of the last stored ack record charted: a follow started again
        skips those already charted (read twice, a call would be timed twice)."""
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
        watched = functools.partial(bool, self.watchers)  # a page watching needs both
        self._event_demand = Demand("audit", self._follow_audit, self._idle_audit,
                                    cfg.follow_idle_s, watched)  # fmt: skip
        """The audit follow, while something needs the events."""
        self._chart_demand = Demand("acks", self._follow_acks, self._idle_acks,
                                    cfg.follow_idle_s, watched)  # fmt: skip
        """The ack records' follow, while something needs the latency charts."""
        self._tasks: list[asyncio.Task[None]] = []

    # --- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        if self._tasks:
            return
        self.history.sample(self.ctx.wall_ms(), self.registry.agents)
        self.capabilities.routes(self.route_counts, self.ctx.wall_ms())
        self._event_demand.reset()
        self._chart_demand.reset()
        self._tasks = [
            asyncio.create_task(self._sample_loop(), name="reach-console-sample"),
            asyncio.create_task(self._push_loop(), name="reach-console-push"),
            asyncio.create_task(self._event_demand.run(), name="reach-console-follow"),
            asyncio.create_task(self._chart_demand.run(), name="reach-console-acks"),
        ]

    async def stop(self) -> None:
        if not self._tasks:
            return
        await stop_loops(*self._tasks)
        self._tasks = []
        # The connection closes next: the server removes the consumers.
        await self._unfollow(delete=False)
        await self._unfollow_acks(delete=False)
        self._event_demand.release()
        self._chart_demand.release()
        for w in list(self.watchers):
            w.queue.put_nowait(None)

    def needing_events(self) -> contextlib.AbstractAsyncContextManager[None]:
        """While a request needs the events (a page connecting, the timeline, an agent's
        transitions): the audit follow is started if it was not, and the body runs once it
        has read the recent history; it is stopped ``follow_idle_s`` after the last need
        ended and the last page left. Any number of requests at once share one follow."""
        return self._event_demand.need()

    def needing_charts(self) -> contextlib.AbstractAsyncContextManager[None]:
        """While a request needs the latency charts (``/api/charts``): the ack records'
        follow is started if it was not, and the body runs once it has read the records
        stored in the charts' window; stopped as the audit follow is."""
        return self._chart_demand.need()

    async def _idle_audit(self) -> None:
        await self._unfollow(delete=True)
        log.info("console.unfollowed last_seq=%d: nobody watches", self._kept_seq)

    async def _unfollow(self, *, delete: bool) -> None:
        """Stop the audit follow; ``delete``: its consumer removed now, not when the server
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

    async def _follow_acks(self) -> None:
        """The ack records stored in the charts' window (:meth:`_ack_start`), then every one
        stored; without JetStream (or ``REACH_ACKS``), those published from now on.

        A :class:`Follower`, as for the audit trail: history then live with neither a gap
        nor a record twice between them, also across a reconnect or a lost consumer, so a
        ``received`` read in the history is paired with its final record read live."""
        nc, subjects = self.ctx.nc, self.ctx.subjects
        # Held before any await: a stop that comes meanwhile stops what was made.
        follow = self._ack_follow = AckFollow(self.capabilities.stale)
        try:
            start = await self._ack_start()
            follower = follow.follower = Follower(
                nc, functools.partial(self._on_stored_ack, follow), name="acks",
                stream=ACK_STREAM, subject=subjects.all_acks, start=start,
                metrics=self._ack_metrics,
            )  # fmt: skip
            info = await follower.start()
            delivered = info.delivered.consumer_seq if info.delivered is not None else 0
            if info.num_pending == 0 and delivered == 0:  # the window holds none
                follow.caught_up.set()
            # The window is in before the request that asked is answered (or nothing came
            # for HISTORY_QUIET_S).
            await follow.until_caught_up(HISTORY_QUIET_S)
            log.info("console.acks_following from=%s read=%d last_seq=%d: a page watches",
                     start.describe(), follow.read, self._ack_seq)  # fmt: skip
            return
        except Exception as exc:  # noqa: BLE001 - the console must not stop the broker
            await self._unfollow_acks(delete=True)
            why = _unavailable(exc)
            if why is not None:
                log.info("console.live_acks_only %s", why)
            else:
                log.warning("console.acks_unreadable error=%r: live ack records only", exc)
        follow = self._ack_follow = AckFollow(self.capabilities.stale)
        try:
            follow.sub = await nc.subscribe(subjects.all_acks,
                                            cb=functools.partial(self._on_ack, follow))  # fmt: skip
            await flush_subscriptions(nc)  # the server has the interest before the answer
            follow.caught_up.set()
        except Exception as exc:  # noqa: BLE001
            self._ack_follow = None
            log.warning("console.no_acks error=%r: no call latency charts", exc)

    async def _ack_start(self) -> Start:
        """Where a follow of the ack records starts: at the charts' window, but after the
        last record an earlier follow charted and at most :data:`ACK_BACKFILL_MAX` records
        before the last one stored, whichever is latest. Decided from the stream's state
        and, when a sequence might be the later start, the time of the record stored there
        (one message get)."""
        js = self.ctx.nc.jetstream(timeout=2.0)
        state = (await js.stream_info(ACK_STREAM)).state
        if state.last_seq < self._ack_seq:  # REACH_ACKS was made again: numbered anew
            self._ack_seq = 0
        window_ms = window_start_ms(self.ctx.wall_ms())
        window = Start.at_time(window_ms / 1000)
        capped_at = state.last_seq - ACK_BACKFILL_MAX + 1
        seq = max(capped_at, self._ack_seq + 1)
        if seq <= state.first_seq:  # nothing stored was charted, and the stream holds fewer
            return window
        try:
            there = await js.get_msg(ACK_STREAM, seq=seq, subject=self.ctx.subjects.all_acks,
                                     next=True)  # fmt: skip
        except NotFoundError:  # none stored from there on: what comes next
            return Start.at_seq(seq)
        if there.time is None or there.time.timestamp() * 1000 < window_ms:
            return window  # the window starts later
        if capped_at > self._ack_seq + 1:
            log.info("console.acks_backfill_capped from_seq=%d last_seq=%d: the charts' "
                     "window holds more than %d stored records; the older ones are not read",
                     seq, state.last_seq, ACK_BACKFILL_MAX)  # fmt: skip
        return Start.at_seq(seq)

    async def _idle_acks(self) -> None:
        follow = self._ack_follow
        await self._unfollow_acks(delete=True)
        if follow is not None:
            log.info("console.acks_unfollowed last_seq=%d read=%d unreadable=%d stale=%d: "
                     "nobody watches", self._ack_seq, follow.read, follow.unreadable,
                     self.capabilities.stale - follow.stale_before)  # fmt: skip

    async def _unfollow_acks(self, *, delete: bool) -> None:
        """Stop the ack records' follow (``delete``: as :meth:`_unfollow`)."""
        follow, self._ack_follow = self._ack_follow, None
        if follow is not None:
            await follow.stop(delete=delete)

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
        every event stored (the follow runs while it watches: no gap, none twice). The ack
        records' follow starts too (the page asks for the charts: that request waits for it)."""
        async with self._chart_demand.need(wait=False), self._event_demand.need():
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
        self._event_demand.ended()
        self._chart_demand.ended()

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

    async def _on_stored_ack(self, follow: AckFollow, msg: Msg) -> None:
        """A stored ack record: charted unless an earlier follow charted it."""
        md = msg.metadata
        seq = md.sequence.stream
        follow.read += 1
        if seq > self._ack_seq:
            self._ack_seq = seq
            self._chart_ack(follow, msg)
        if md.num_pending == 0:
            follow.caught_up.set()

    async def _on_ack(self, follow: AckFollow, msg: Msg) -> None:
        """An ack record as published (no JetStream)."""
        follow.read += 1
        self._chart_ack(follow, msg)

    def _chart_ack(self, follow: AckFollow, msg: Msg) -> None:
        try:
            head = _ack_head.decode(msg.data)
        except msgspec.MsgspecError:
            follow.unreadable += 1
            if log.isEnabledFor(logging.DEBUG):
                log.debug("console.bad_ack subject=%s", msg.subject)
            return
        self.capabilities.ack(head.request_id, head.capability, head.state, head.at_ms,
                              head.received_ms)  # fmt: skip

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
