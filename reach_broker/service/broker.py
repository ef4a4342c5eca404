"""The broker process: its lifecycle, and the NATS wiring of the handlers.

Announce, heartbeat and leave are plain subscriptions on every replica (each derives the same
state); route and ``agents`` are NATS Services API endpoints in queue group ``reach-broker``,
so replicas share that load and ``nats micro ls`` lists the broker. What the messages do is
:mod:`reach_broker.service.handlers`; every transition goes to the one fan-out
(:class:`~reach_broker.service.context.Fanout`): an ``Event`` on
``<prefix>.event.<kind>.<agent_id>``
and the listeners (snapshot, compensation replay, probes).

The registry, router and components are built with the broker, so none is optional; what
:meth:`Broker.start` adds is the connection, the JetStream assets and the token secret.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import socket
import time
from collections.abc import Callable
from types import TracebackType
from typing import Any, Protocol

from nats.aio.client import Client as NATS
from nats.errors import SlowConsumerError
from nats.micro import add_service
from nats.micro.service import EndpointConfig, Service, ServiceConfig

from jetstream.tasks import raise_if_cancelled
from reach_agent import otel
from reach_agent.aio import stop_loops
from reach_agent.connection import (
    Credentials,
    connect,
    connect_options,
    drain_or_close,
    flush_subscriptions,
)
from reach_agent.routing.rules import Rules
from reach_agent.wire.subjects import Subjects
from reach_broker import __version__
from reach_broker.config import Config
from reach_broker.core.quotas import Quotas
from reach_broker.core.registry import Registry
from reach_broker.core.routing import Router
from reach_broker.core.tokens import TokenSigner
from reach_broker.interop.synadia import SynadiaAgents
from reach_broker.replay.replay import Replayer

from .advisories import Advisories
from .assets import START_RETRY_S, jetstream_not_ready, provision_assets, token_secret
from .canceller import Canceller
from .context import BrokerContext, Fanout, Link, Tasks, TransitionListener
from .handlers import Handlers
from .identity import Identity
from .metrics import Metrics
from .observer import Observer
from .outcomes import Outcomes
from .partitions import Partitions
from .probes import Prober
from .releases import Releaser
from .rulebook import Rulebook, from_config
from .snapshot import Snapshot
from .tables import Tables

log = logging.getLogger(__name__)

QUEUE_GROUP = "reach-broker"
SERVICE_NAME = "reach-broker"
SERVICE_DESCRIPTION = "reach: routes tasks to reachable AI agents by capability"

HEARTBEAT_PENDING = 1_000_000, 512 * 1024 * 1024
"""Pending limits (messages, bytes) of the announce and heartbeat subscriptions: a storm of
heartbeats must queue, not drop."""


class Component(Protocol):
    """A long-lived part of the broker (probes, snapshot, replay, advisories)."""

    async def start(self) -> None: ...
    async def stop(self) -> None: ...


def default_broker_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(2)}"


class Broker:
    """One broker replica. ``async with Broker(cfg) as b:`` runs it until the block ends."""

    def __init__(
        self,
        cfg: Config,
        *,
        metrics: Metrics | None = None,
        nc: NATS | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.cfg = cfg
        self.broker_id = cfg.broker.broker_id or default_broker_id()
        self.metrics = metrics or Metrics()
        self.clock = clock
        self.wall = wall
        self.nc: NATS = nc if nc is not None else NATS()
        self._own_nc = nc is None
        self.subjects = Subjects(cfg.broker.prefix)
        self.jetstream_ok = False
        self.replicas: int | None = None
        """Replicas of the JetStream assets (None: the server has no JetStream)."""
        # The pure core first: the signer is keyed at start (the secret may live in KV).
        self.registry = Registry(cfg, TokenSigner(b"", cfg.broker.token_max_age_s))
        registry = self.registry
        self.rules = Rules(from_config(cfg.rules))
        """Each capability's route rule in force: broker.toml's, then KV reach_rules'."""
        self.quotas = Quotas(cfg.quotas, self.rules)
        self.router = Router(
            cfg.routing, registry.indexes, self.subjects.task,
            inflight=lambda: registry.inflight, capacity=lambda: registry.capacity,
            on_panic=lambda cap, on: self.metrics.panic.labels(cap).set(int(on)),
            rules=self.rules,
        )  # fmt: skip
        self._tasks = Tasks()
        self.link = Link()
        """The broker's own link to NATS (the observer keeps it)."""
        self.fanout = Fanout(self.nc, self.subjects, self.metrics, self.broker_id, wall,
                             self._tasks.spawn, registry.agents.get, self.link)  # fmt: skip
        self.listeners: list[TransitionListener] = self.fanout.listeners
        """Told of every transition (``listeners.append(fn)``): fn(transition, record)."""
        ctx = BrokerContext(
            cfg=cfg, nc=self.nc, subjects=self.subjects, metrics=self.metrics,
            broker_id=self.broker_id, clock=clock, wall=wall, spawn=self._tasks.spawn,
            fanout=self.fanout, link=self.link, spans=otel.spans("reach-broker"),
        )  # fmt: skip
        self.ctx = ctx
        """What a component is handed (the console's feed is one, started by the process)."""
        self.handlers = Handlers(ctx, registry, self.router, self.quotas)
        self.identity = Identity(ctx, registry, self.handlers)
        # The snapshot restores the registry before probes and advisories start (advisories
        # reconcile with the server's connection list); claim releases and replay come last.
        # Snapshot, releases and replay need JetStream and start only with it.
        self.snapshot = Snapshot(ctx, registry)
        self.probes = Prober(ctx, registry)
        self.advisories = Advisories(ctx, registry, self.probes)
        self.observer = Observer(ctx, registry, self.advisories)
        self.synadia = SynadiaAgents(ctx, registry, self.handlers, self.probes, self.advisories)
        """Synadia Agent Protocol agents, discovered and followed (after the advisories: it
        asks the server's CONNZ of the account they found)."""
        agents = registry.agents
        self.releaser = Releaser(
            ctx, lambda a: rec.state if (rec := agents.get(a)) is not None else None
        )
        self.replayer = Replayer(ctx, self.router, self.releaser.claim_of, agents.get)
        self.canceller = Canceller(ctx, queue=QUEUE_GROUP)
        """``<p>.cancel._broker``: a cancelled request's claim made final, its entry unqueued."""
        self.rulebook = Rulebook(ctx, self.rules, self.quotas)
        self.outcomes = Outcomes(ctx, registry)
        m = self.metrics
        self.tables = Tables(
            ctx, registry, self.router, self.quotas, cfg.fleet, cfg.routing,
            jetstream=lambda: self.jetstream_ok, counts=m.tables, dropped=m.dropped,
        )  # fmt: skip
        """The route tables of the partitions this broker owns (callers route from them)."""
        self.partitions = Partitions(
            ctx, cfg.fleet, self.tables.own, self.tables.lose,
            jetstream=lambda: self.jetstream_ok, owned=m.partitions_owned,
        )  # fmt: skip
        """The leases of the partitions this broker owns, told to the tables."""
        self.fanout.listeners.append(self.tables.on_transition)
        self._running: list[Component] = []
        self._service: Service | None = None
        self._subs: list[Any] = []
        self._loop_task: asyncio.Task[None] | None = None
        self._started = False
        self._connected = False
        self._watching = False
        self._with_creds = bool(cfg.nats.creds)
        self.auth_enabled = False
        """Whether the server enforces identities (see :meth:`_secure`)."""
        self.serving = False
        """Started: assets provisioned, rules loaded, handlers subscribed (until :meth:`stop`)."""

    # --- lifecycle ----------------------------------------------------------------------

    async def start(self, *, stop: asyncio.Event | None = None) -> None:
        """Connect (waiting for a server as long as it takes, each failed attempt logged as
        ``broker.connect_failed``; ``stop`` set meanwhile ends the wait with
        :class:`~reach_agent.connection.NotConnected`), provision, start the components."""
        if self._started:
            return
        self._started = True
        if self._own_nc:
            options = self._connect_options()
            self._with_creds = bool(options.get("user_credentials"))
            try:
                await connect(self.nc, options, what=f"broker {self.broker_id!r}", role="broker",
                              stop=stop)  # fmt: skip
            except BaseException:
                self._started = False
                raise
        self._connected = True
        self._secure()
        if not self._watching:
            self._watching = True
            self.metrics.watch_states(lambda: self.registry.counts)
        await self._start_components(stop)
        await self._serve()
        # Restored agents are judged on silence from here on, when the broker can hear them.
        regranted = self.registry.listening(self.clock())
        self._loop_task = asyncio.create_task(self._tick_loop(), name="reach-broker-tick")
        self.serving = True
        url = self.nc.connected_url
        log.info("broker.started id=%s prefix=%s server=%s restored_unheard=%d", self.broker_id,
                 self.subjects.prefix, url.geturl() if url else None, regranted)  # fmt: skip

    async def _start_components(self, stop: asyncio.Event | None) -> None:
        """Provision the JetStream assets, key the token signer, start the components;
        while JetStream is not ready (:func:`~reach_broker.service.assets.jetstream_not_ready`:
        a server just restarted, a cluster electing) each attempt is undone and tried again
        after the next wait of ``START_RETRY_S``, logged as ``broker.jetstream_not_ready``.
        The last error is raised when JetStream is still not ready, or ``stop`` is set."""
        fanout = self.fanout
        for attempt, wait in enumerate((*START_RETRY_S, None), start=1):
            listeners = list(fanout.listeners), list(fanout.announce_listeners)
            try:
                await self._start_components_once()
                return
            except Exception as exc:
                if wait is None or not jetstream_not_ready(exc):
                    raise
                log.warning("broker.jetstream_not_ready attempt=%d retry_in=%gs error=%s: %s",
                            attempt, wait, type(exc).__name__, exc)  # fmt: skip
                for component in reversed(self._running):
                    try:
                        await component.stop()
                    except Exception:  # noqa: BLE001 - undone as far as it goes
                        log.exception("broker.stop component=%s failed", type(component).__name__)
                self._running = []
                # A component that failed half-way may have left its listener behind.
                fanout.listeners[:], fanout.announce_listeners[:] = listeners
                if stop is None:
                    await asyncio.sleep(wait)
                else:
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(stop.wait(), wait)
                    if stop.is_set():
                        raise

    async def _start_components_once(self) -> None:
        self.replicas = await provision_assets(self.nc, self.cfg, self.subjects)
        self.jetstream_ok = self.replicas is not None
        secret = await token_secret(self.nc, self.cfg, jetstream=self.jetstream_ok)
        self.registry.signer.set_secret(secret)
        # The route tables after the snapshot and the rules (their first shares are made from
        # both), then the partitions' leases (each partition taken: its shares published).
        tables: list[Component] = [self.tables, self.partitions] if self.cfg.fleet.tables else []
        components: list[Component] = (
            [self.snapshot, self.rulebook, *tables, self.probes, self.advisories, self.synadia,
             self.outcomes, self.releaser, self.replayer, self.canceller]
            if self.jetstream_ok
            else [*tables, self.probes, self.advisories, self.synadia, self.outcomes]
        )  # fmt: skip
        self._running = []
        for component in components:
            self._running.append(component)  # stopped (idempotent) should its start fail
            await component.start()

    async def _serve(self) -> None:
        """Subscribe the handlers: plain subscriptions, then the Services endpoints."""
        nc, s, ep = self.nc, self.subjects, self.handlers.endpoints
        msgs, size = HEARTBEAT_PENDING
        self._subs = [
            await nc.subscribe(s.all_heartbeats, cb=ep["heartbeat"].on_message,
                               pending_msgs_limit=msgs, pending_bytes_limit=size),
            await nc.subscribe(s.all_announces, cb=self.identity.on_message,
                               pending_msgs_limit=msgs, pending_bytes_limit=size),
            await nc.subscribe(s.all_leaves, cb=ep["leave"].on_message),
        ]  # fmt: skip
        self._service = await add_service(
            nc,
            ServiceConfig(
                name=SERVICE_NAME,
                version=__version__,
                description=SERVICE_DESCRIPTION,
                metadata={"broker_id": self.broker_id, "prefix": s.prefix},
                queue_group=QUEUE_GROUP,
            ),
        )
        for name, subject in (("route", s.all_routes), ("agents", s.agents)):
            await self._service.add_endpoint(
                EndpointConfig(name=name, subject=subject, handler=ep[name].on_request,
                               queue_group=QUEUE_GROUP)
            )  # fmt: skip
        await flush_subscriptions(nc)  # a single flush() may overtake the SUBs (nats-py)

    async def stop(self) -> None:
        """Stop taking work, drain subscriptions, let in-flight probes end, close."""
        if not self._started:
            return
        self._started = False
        self.serving = False
        if self._service is not None:
            try:
                await self._service.stop()
            except Exception:  # noqa: BLE001 - a closed connection must not block shutdown
                log.debug("broker.stop service already closed", exc_info=True)
        for sub in self._subs:
            try:
                await sub.unsubscribe()
            except Exception:  # noqa: BLE001
                log.debug("broker.stop unsubscribe failed", exc_info=True)
        self._subs = []
        if self._loop_task is not None:
            await stop_loops(self._loop_task)
        await self._tasks.settle(self.cfg.broker.shutdown_grace_s)
        for component in reversed(self._running):
            try:
                await component.stop()
            except Exception:  # noqa: BLE001
                log.exception("broker.stop component=%s failed", type(component).__name__)
        if self._own_nc:
            await drain_or_close(self.nc, self.cfg.broker.shutdown_grace_s)
        if self.ctx.spans is not None:
            await asyncio.to_thread(self.ctx.spans.flush)
        log.info("broker.stopped id=%s", self.broker_id)

    def not_ready(self) -> str | None:
        """Why ``/readyz`` says 503 (:mod:`reach_broker.health`), or None: connected to NATS,
        the JetStream assets provisioned, the rules loaded and the handlers subscribed."""
        servers = self.cfg.nats.url or "NATS_URL / nats://127.0.0.1:4222"
        if not self._started:
            return "the broker is not running"
        if not self.nc.is_connected:
            if self.serving:
                return f"disconnected from NATS (reconnecting to {servers})"
            return f"not connected to NATS yet (connecting to {servers})"
        if not self.serving:
            return "starting: provisioning the JetStream assets and loading the route rules"
        if not self.jetstream_ok:
            return ("the NATS server has no JetStream: no claims, durable acks or compensation "
                    "replay (start nats-server with -js)")  # fmt: skip
        return None

    async def __aenter__(self) -> Broker:
        await self.start()
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.stop()

    def _secure(self) -> None:
        """Secured mode: the server requires every connection to authenticate and this broker
        authenticated with a user JWT (``--auth DIR``, ``--creds``): reach's roles are then the
        server's permissions. Otherwise say once, loudly, what open mode means."""
        # nats-py keeps the server's INFO private; `auth_required` is the server's own word.
        info = getattr(self.nc, "_server_info", None) or {}
        self.auth_enabled = bool(info.get("auth_required")) and self._with_creds
        self.metrics.auth_enabled.set(int(self.auth_enabled))
        self.handlers.require_leave_token = self.auth_enabled
        if not self.auth_enabled:
            log.warning(
                "broker.open_mode: this NATS server lets anyone who can connect act for any "
                "agent (announce or leave as it, publish its events, read every task). For "
                "anything beyond local development run `reach auth init DIR` and `reach broker "
                "--auth DIR` (docs/operations.md, Securing reach)"
            )

    def _connect_options(self) -> dict[str, Any]:
        """The broker's connection: ``nats.url`` (comma-separated; unset: ``NATS_URL`` or
        localhost), ``nats.creds``, pings from the config, reconnecting forever every 0.5 s."""
        n = self.cfg.nats
        return connect_options(
            f"reach-broker-{self.broker_id}", n.url,
            Credentials(creds=n.creds, tls_ca=n.tls_ca, context=n.context),
            ping_interval=n.ping_interval_s, max_outstanding_pings=n.max_outstanding_pings,
            max_reconnect_attempts=-1, reconnect_time_wait=0.5,
            reconnect_to_server_handler=None,  # nats-py's own: a steady 0.5 s between tries
            error_cb=self._on_nats_error, disconnected_cb=self._on_disconnected,
            reconnected_cb=self._on_reconnected,
        )  # fmt: skip

    async def _on_nats_error(self, exc: Exception) -> None:
        kind = "slow_consumer" if isinstance(exc, SlowConsumerError) else type(exc).__name__
        self.metrics.nats_errors.labels(kind).inc()
        if self._connected:  # before, the first connect's failures are said (rate-limited)
            log.warning("broker.nats_error kind=%s error=%s", kind, exc)

    async def _on_disconnected(self) -> None:
        if self._started and self._connected:  # not at our own shutdown (the drain closes
            # it), nor when a first connect that never succeeded is called off
            log.warning("broker.nats_disconnected")
            self.observer.lost(self.clock())

    async def _on_reconnected(self) -> None:
        log.info("broker.nats_reconnected url=%s", self.nc.connected_url)
        # Clocks rebased over the outage; disconnects missed meanwhile reconciled.
        self.observer.regained(self.clock())

    # --- loops --------------------------------------------------------------------------

    async def _tick_loop(self) -> None:
        tick = self.cfg.detection.tick_s
        while True:
            raise_if_cancelled()
            due = self.clock() + tick
            await asyncio.sleep(tick)
            try:
                changes = self.observer.tick(self.clock(), due)
                if changes:
                    self.fanout.emit(changes)
            except Exception:  # noqa: BLE001 - the loop body never dies
                log.exception("broker.tick failed")
