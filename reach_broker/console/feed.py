"""The console's broker component: it remembers (history), follows the audit trail, and
pushes the fleet to the pages that watch, as server-sent events.

Given the broker context, its config section, the registry and the explainer (never the
broker), and started by the broker after its other components, when the HTTP port shows the
console. It is told of every transition (one of the broker's consumers). At start it
reads the last ``console.events`` events of ``REACH_AUDIT`` and then follows it live
(:class:`jetstream.follow.Follower`: no gap, no duplicate, also across a reconnect; plain
``<prefix>.event.>`` when the server has no JetStream). It samples the fleet every
``console.sample_s`` for the per-agent charts. While at least one page watches, it encodes
the fleet once every ``console.push_s`` (and about 50 ms after any transition) and hands the
same bytes to every page; every 5 s it reads the compensation queue's depth per capability
and the age of each one's oldest entry, and asks every partition's owner for its agent count
(:mod:`.owners`). Nobody watching, it does no more than the sampling
and the audit follow.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Mapping
from typing import Any

import msgspec

from jetstream import audit, compensation
from jetstream.follow import UNCOUNTED, FollowMetrics
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
"""At start, reading the audit history gives up when no event came for this long."""
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
        self._tasks: list[asyncio.Task[None]] = []

    # --- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        if self._tasks:
            return
        self.history.sample(self.ctx.wall_ms(), self.registry.agents)
        self.capabilities.routes(self.route_counts, self.ctx.wall_ms())
        await self._follow_acks()
        await self._follow_audit()
        self._tasks = [
            asyncio.create_task(self._sample_loop(), name="reach-console-sample"),
            asyncio.create_task(self._push_loop(), name="reach-console-push"),
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
        if self._follow is not None:
            await self._follow.stop()
            self._follow = None
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

    async def _follow_audit(self) -> None:
        nc, subjects = self.ctx.nc, self.ctx.subjects
        try:
            self._follow = await audit.follow_events(
                nc, self._on_stored, subjects=subjects, last=self.cfg.events,
                metrics=self._follow_metrics,
            )  # fmt: skip
            # The history is in before the first page can ask (or the trail went quiet).
            await self._follow.until_caught_up(HISTORY_QUIET_S)
            return
        except audit.AuditUnavailable as exc:
            log.info("console.live_events_only %s", exc)
        except Exception as exc:  # noqa: BLE001 - the console must not stop the broker
            log.warning("console.audit_unreadable error=%r: live events only", exc)
        try:
            self._follow = await audit.live_events(nc, self._on_stored, subjects=subjects)
        except Exception as exc:  # noqa: BLE001
            log.warning("console.no_events error=%r: the timeline stays empty", exc)

    # --- what the page is sent -----------------------------------------------------------------

    def fleet_json(self) -> bytes:
        ctx = self.ctx
        return _json.encode(self.views.fleet(ctx.clock(), ctx.wall_ms(), self.cfg.max_agents))

    def agent_json(self, agent_id: str) -> bytes | None:
        ctx = self.ctx
        detail = self.views.agent(agent_id, self.history, self.cfg.sample_s, ctx.clock(),
                                  ctx.wall_ms())  # fmt: skip
        if detail is None:
            return None
        self.history.watch(agent_id)  # a viewer looks: charted from the next tick, if not yet
        return _json.encode(detail)

    def events_json(self, n: int = RECENT_EVENTS) -> bytes:
        entries = list(self.history.events)[-n:]
        return _json.encode([event_view(e) for e in entries])

    def hello_json(self) -> bytes:
        cfg = self.cfg
        return _json.encode({"broker_id": self.ctx.broker_id, "version": __version__,
                             "prefix": self.ctx.subjects.prefix, "sample_s": cfg.sample_s,
                             "history_s": cfg.history_s})  # fmt: skip

    def watch(self) -> Watcher:
        """A new page: it gets who we are, the fleet, the recent events and the queue."""
        w = Watcher()
        for kind, data in (("hello", self.hello_json()), ("fleet", self.fleet_json()),
                           ("events", self.events_json()),
                           ("compensation", _json.encode(self.compensation)),
                           ("owners", _json.encode(self.owners))):  # fmt: skip
            w.offer(sse(kind, data))
        self.watchers.add(w)
        self._dirty.set()  # the compensation poll runs soon for a first watcher
        return w

    def unwatch(self, w: Watcher) -> None:
        self.watchers.discard(w)

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
