"""One broker replica, built and wired in this one place: :class:`Broker`.

Everything the broker is made of is built here, in order, each part handed its own config
section, its own metrics and exactly the collaborators it uses: the pure core (registry,
rules, quotas, router, explainer), the message handlers, the components on NATS
(:mod:`reach_broker.service`), the compensation replay (:mod:`reach_broker.replay`), the
Synadia Agent Protocol agents (:mod:`reach_broker.interop.synadia`) and, when the HTTP port
shows it, the console's feed (:mod:`reach_broker.console.feed`). Nothing registers itself and
nothing is patched onto a built part: who is told of the registry's transitions, in which
order, is the one list given to the :class:`~reach_broker.service.fanout.Fanout` below, and
the order parts start in (and stop in, reversed) is the one list after it.

Announce, heartbeat and leave are heard by the owner of the agent's partition alone (the
server maps them into partitions: :mod:`reach_broker.service.ingest`, ``.takeover``,
``.partitions``); route and ``agents`` are NATS Services API endpoints in queue group
``reach-broker``, so replicas share that load and ``nats micro ls`` lists the broker. What the
messages do is :mod:`reach_broker.service.handlers`. Building does no I/O; :meth:`Broker.start`
adds the connection, the JetStream assets and the token secret, then starts the parts.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import socket
import time
from collections.abc import Callable, Sequence
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
    drain_subscription,
    flush_subscriptions,
)
from reach_agent.routing.rules import Rules
from reach_agent.wire.subjects import Subjects
from reach_broker import __version__
from reach_broker.config import Config
from reach_broker.console.feed import Feed
from reach_broker.core.explain import Explainer
from reach_broker.core.quotas import Quotas
from reach_broker.core.records import Transition
from reach_broker.core.registry import Registry
from reach_broker.core.routing import Router
from reach_broker.core.tokens import TokenSigner
from reach_broker.interop.synadia import StatusProbes, SynadiaAgents
from reach_broker.replay.replay import Replayer
from reach_broker.service.advisories import Advisories
from reach_broker.service.assets import (
    START_RETRY_S,
    Provisioning,
    ReplicaKeeper,
    jetstream_not_ready,
    provision_assets,
    token_secret,
)
from reach_broker.service.brokeracks import BrokerAcks
from reach_broker.service.canceller import Canceller
from reach_broker.service.clusterinfo import Account
from reach_broker.service.context import BrokerContext, Link, Tasks
from reach_broker.service.fanout import Consumer, Fanout
from reach_broker.service.forwarding import Forwarder
from reach_broker.service.handlers import Handlers
from reach_broker.service.identity import Identity, Reannouncer
from reach_broker.service.ingest import Ingest
from reach_broker.service.listing import AgentPages
from reach_broker.service.metrics import HandlerMetrics, Metrics, ReplayMetrics
from reach_broker.service.observer import Observer
from reach_broker.service.outcomes import Outcomes
from reach_broker.service.owners import Owners
from reach_broker.service.partitions import Partitions
from reach_broker.service.probes import Prober
from reach_broker.service.releases import Releaser
from reach_broker.service.rulebook import Rulebook, from_config
from reach_broker.service.shares import Shares
from reach_broker.service.snapshot import Snapshot
from reach_broker.service.tables import Tables
from reach_broker.service.takeover import Takeover

log = logging.getLogger(__name__)

QUEUE_GROUP = "reach-broker"
SERVICE_NAME = "reach-broker"
SERVICE_DESCRIPTION = "reach: routes tasks to reachable AI agents by capability"


class Component(Protocol):
    """A long-lived part of the broker (probes, snapshot, replay, advisories)."""

    async def start(self) -> None: ...
    async def stop(self) -> None: ...


def default_broker_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(2)}"


class Broker:
    """One broker replica. ``async with Broker(cfg) as b:`` runs it until the block ends.

    ``console``: build the console's feed (the process does when its HTTP port shows the
    console). ``watchers``: told of every transition after the broker's own consumers (tests,
    the chaos run)."""

    def __init__(
        self,
        cfg: Config,
        *,
        metrics: Metrics | None = None,
        nc: NATS | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
        console: bool = False,
        watchers: Sequence[Consumer] = (),
    ) -> None:
        self.cfg = cfg
        self.broker_id = cfg.broker.broker_id or default_broker_id()
        self.metrics = m = metrics or Metrics()
        self.clock = clock
        self.wall = wall
        self.nc: NATS = nc if nc is not None else NATS()
        self._own_nc = nc is None
        self.subjects = Subjects(cfg.broker.prefix)
        self.jetstream_ok = False
        self.replicas: int | None = None
        """Replicas of the JetStream assets (None: the server has no JetStream)."""

        self.provisioning = Provisioning(
            replicas=cfg.jetstream.replicas, advisory_account=cfg.detection.advisory_account,
            max_entries=cfg.compensation.max_entries, lease_ttl_s=cfg.fleet.lease_ttl_s,
            token_secret=cfg.broker.token_secret,
        )  # fmt: skip
        """What the start provisions the JetStream assets and keys the token signer with."""
        self.keeper = ReplicaKeeper(self.nc, self.provisioning, m.replicas_short,
                                    m.replica_checks)  # fmt: skip
        """Raises a stream left with fewer replicas than counted, once the cluster can place
        them (started with the parts)."""

        # The pure core: the signer is keyed at start (the secret may live in KV).
        self.registry = registry = Registry(
            cfg.detection, cfg.scoring, TokenSigner(b"", cfg.broker.token_max_age_s),
            interval_ms=cfg.broker.interval_ms, partitions=cfg.fleet.partitions,
        )  # fmt: skip
        agents = registry.agents
        self.rules = Rules(from_config(cfg.rules))
        """Each capability's route rule in force: broker.toml's, then KV reach_rules'."""
        self.quotas = Quotas(cfg.quotas, self.rules)
        self.router = Router(
            cfg.routing, registry.indexes, self.subjects.task,
            inflight=lambda: registry.inflight, capacity=lambda: registry.capacity,
            on_panic=lambda cap, on: m.panic.labels(cap).set(int(on)), rules=self.rules,
            foreign=lambda cap: self.shares.table_of(cap),  # built with the route tables
        )  # fmt: skip
        self.explainer = Explainer(
            self.router, cfg.scoring, coverage=lambda cap, seen: self.shares.coverage(cap, seen)
        )

        # What every component shares. Transitions go to the pipeline (self.fanout, built
        # last: its consumers are the components below).
        self._tasks = Tasks()
        self.link = Link()
        """The broker's own link to NATS (the observer keeps it)."""
        ctx = BrokerContext(
            nc=self.nc, subjects=self.subjects, broker_id=self.broker_id, clock=clock,
            wall=wall, spawn=self._tasks.spawn, emit=self._emit, link=self.link,
        )  # fmt: skip
        self.spans = otel.spans("reach-broker")
        """OpenTelemetry spans of route requests (:mod:`reach_agent.otel`; None: off)."""

        # The parts on NATS, each before those that use it.
        self.snapshot = Snapshot(ctx, registry, reads=m.snapshot_reads)
        self.reannouncer = Reannouncer(ctx, asked=m.reannounce_requests)
        self.handlers = Handlers(
            ctx, registry, self.router, self.quotas, self.explainer, HandlerMetrics.of(m),
            on_unknown=self.reannouncer.unknown,  # a heartbeat it cannot place
            announced=self.snapshot.on_announce,  # an accepted announce, moved or not
            spans=self.spans,
        )  # fmt: skip
        self.identity = Identity(
            ctx, registry, self.handlers, conflict=m.announce_result["conflict"],
            # a restarted agent's old instance is gone: its claims released (built below)
            replaced=lambda agent, new, old: self.releaser.replaced(agent, new, old),
            claiming=lambda agent: self.releaser.claiming(agent),
        )  # fmt: skip
        self.probes = Prober(ctx, registry, cfg.detection, results=m.probes, rtt=m.probe_rtt,
                             sampled_every=m.rtt_sample_every,
                             probe_via=StatusProbes(self.nc, clock),
                             other_instance=self.identity.unseen)  # fmt: skip
        self.account = Account()
        """The application account (the advisories learn it; the Synadia locate asks it)."""
        self.outcomes = Outcomes(ctx, registry, cfg.outcomes, summaries=m.outcomes,
                                 ejected=m.delivery_ejected)  # fmt: skip
        """The callers' outcome summaries of the agents this broker owns (heard by the
        ingest), judged into their delivery term."""
        ep = self.handlers.endpoints
        self.ingest = Ingest(
            ctx, cfg.fleet.partitions, heartbeat=ep["heartbeat"].on_message,
            announce=self.identity.on_message, leave=ep["leave"].on_message,
            mapping=m.partition_mapping,
            outcome=self.outcomes.on_message if cfg.outcomes.enabled else None,
        )  # fmt: skip
        """The announces, heartbeats, leaves and outcome summaries of the partitions this
        broker owns."""
        self.synadia = SynadiaAgents(
            ctx, registry, self.handlers, self.probes, self.account, cfg.synadia,
            owns=self.ingest.hears,  # their subjects are not partitioned: each broker holds
            # the instances of the partitions it hears, from their restore until handed over
            instances=m.synadia_agents, heartbeats=m.heartbeat_result, dropped=m.dropped,
        )  # fmt: skip
        """Synadia Agent Protocol agents, discovered and followed (those of the partitions
        this broker owns held)."""
        self.advisories = Advisories(
            ctx, registry, self.probes, self.account, cfg.detection, unnamed=self.synadia,
            # as long as a partition may go unowned: a gone owner's lease, and a round more
            closed_kept_s=max(60.0, 2 * cfg.fleet.lease_ttl_s),
            seen=m.advisories, dropped=m.dropped, refused=m.refused,
        )  # fmt: skip
        self.observer = Observer(ctx, registry, self.advisories, cfg.detection,
                                 inbound=lambda: ctx.nc.stats["in_msgs"],
                                 suspect=m.observer_suspect, gaps=m.observer_gaps)  # fmt: skip
        self.releaser = Releaser(
            ctx, lambda a: rec.state if (rec := agents.get(a)) is not None else None,
            cfg.claims, released=m.claims_released, store_errors=m.store_errors,
            follow=m.follow("claims"),
            # an entry held for a released claim given back at once (built below)
            on_released=lambda rid, agent: self.replayer.claim_released(rid, agent),
            instance_of=lambda a: rec.announce.instance_id if (rec := agents.get(a)) else None,
            unseen=self.identity.unseen,
            offline_at_ms=lambda a: registry.offline_at_ms(a, ctx.clock(), ctx.wall_ms()),
        )  # fmt: skip
        self.records = BrokerAcks(ctx, store_errors=m.store_errors)
        """The ack records the broker writes as itself (replay, Synadia answers, cancels)."""
        self.canceller = Canceller(ctx, self.records, queue=QUEUE_GROUP,
                                   cancelled=m.compensation_result["cancelled"])  # fmt: skip
        """``<p>.cancel._broker``: a cancelled request's claim made final, its entry unqueued."""
        self.rulebook = Rulebook(ctx, self.rules, self.quotas, changes=m.rule_changes,
                                 follow=m.follow("rules"))  # fmt: skip
        self.feed = (Feed(ctx, registry, self.explainer, cfg.console, self.handlers.route_counts,
                          follow=m.follow("audit"), ack_follow=m.follow("acks"))
                     if console else None)  # fmt: skip
        """The console's data (built when the HTTP port shows the console)."""
        self.tables = Tables(
            ctx, registry, self.router, self.quotas, cfg.fleet, cfg.routing,
            jetstream=lambda: self.jetstream_ok, counts=m.tables, dropped=m.dropped,
        )  # fmt: skip
        """The route tables of the partitions this broker owns (callers route from them)."""
        tables = cfg.fleet.tables
        self.takeover = Takeover(
            ctx, registry, self.snapshot, self.ingest,
            shares_own=self.tables.own if tables else lambda p, epoch: None,
            shares_lose=self.tables.lose if tables else lambda p: None,
            restored=self.advisories.restored, took=m.takeovers,
            restores=m.partition_restores,
        )  # fmt: skip
        """What the broker holds per partition: restored, heard, published; or dropped."""
        self.partitions = Partitions(
            ctx, cfg.fleet, self.takeover.own, self.takeover.lose,
            jetstream=lambda: self.jetstream_ok, owned=m.partitions_owned,
            follow=m.follow("presence"),
        )  # fmt: skip
        """The leases of the partitions this broker owns, each taken over and handed over."""
        self.pages = AgentPages(
            ctx, registry, lambda p: p in self.partitions.held,
            dropped=lambda reason: m.refused.labels("agents", reason),
        )  # fmt: skip
        """``<p>.agents.<partition>``: pages of the partitions this broker owns."""
        epochs = self.tables.book.epochs
        self.shares = Shares(ctx, cfg.fleet, epochs, counts=m.tables)
        """The other owners' shares of the route tables, followed (routes merge them)."""
        self.replayer = Replayer(
            ctx, self.router, self.releaser.claim_of, agents.get, self.records,
            cfg.compensation, ReplayMetrics.of(m), whole_fleet=self.shares.owns_all,
            owns_agent=lambda a: registry.listing.partition_of(a) in self.partitions.held,
            finished=self.releaser.finished,
        )  # fmt: skip
        self.forwarder = Forwarder(
            ctx, cfg.fleet, self.handlers.endpoints["route"], self.handlers.route,
            owned=epochs.__contains__, owns_all=self.shares.owns_all,
            follow=self.shares.waiting, jetstream=lambda: self.jetstream_ok,
            forwards=m.route_forwards,
            owners=Owners(ctx, cfg.fleet, owns_all=self.shares.owns_all,
                          store=self.partitions.store),
        )  # fmt: skip
        """Route requests for a capability another broker owns, forwarded to it (quotas and
        hand-outs counted once)."""

        # The pipeline: every transition is published as an event, counted, logged, then
        # handed to these consumers, in this order (a consumer whose part is not running
        # ignores it).
        self.fanout = Fanout(
            ctx, agents.get,
            consumers=(
                self.snapshot.on_transition,  # the stored registry follows the change
                self.probes.on_transition,  # suspect and recovering probed now, newcomers sampled
                self.synadia.on_transition,  # an offline Synadia instance forgotten in time
                self.releaser.on_transition,  # an offline holder's claims released
                self.replayer.on_transition,  # healthy: its queue replayed; offline: held back
                self.tables.on_transition,  # a state move in the route tables at once
                *([self.feed.on_transition] if self.feed is not None else []),  # pushed to pages
                *watchers,
            ),
            changes=m.registry_changes, states=m.state_changes,
            withheld=m.dropped.labels("event", "link_down"),
            unsent=m.dropped.labels("event", "error"),
        )  # fmt: skip

        # The start order (stopped in reverse), and which parts need JetStream. The replica
        # keeper only raises the assets' replicas on a timer, after the start provisioned
        # them. The snapshot restores the registry before probes and advisories start
        # (advisories reconcile with the server's connection list); the Synadia agents come
        # after the advisories (their locate asks the CONNZ of the account the advisories
        # learnt); claim releases, replay and cancels come last. The route tables start after
        # the snapshot and the rules (their first shares are made from both), then the
        # partitions' leases (each partition taken: its shares published), then the forwarder
        # (route requests for a capability another broker owns go there) and the other owners'
        # shares followed. The console's feed starts once the handlers are subscribed (it only
        # shows; its audit catch-up must not hold up serving), and stops first.
        self.parts: tuple[tuple[Component, bool], ...] = (
            (self.keeper, True),
            (self.snapshot, True),
            (self.rulebook, True),
            *(((self.tables, False),) if cfg.fleet.tables else ()),
            (self.ingest, False),
            (self.partitions, False),
            *(((self.forwarder, True), (self.shares, False)) if cfg.fleet.tables else ()),
            (self.probes, False),
            (self.pages, False),  # answers <p>.agents.<partition> for the partitions it owns
            (self.advisories, False),
            (self.synadia, False),
            (self.outcomes, False),
            (self.releaser, True),
            (self.replayer, True),
            (self.canceller, True),
        )
        """(part, needs JetStream), in start order, before the handlers subscribe."""
        self._running: list[Component] = []
        self._service: Service | None = None
        self._loop_task: asyncio.Task[None] | None = None
        self._started = False
        self._connected = False
        self._failed_tries = 0
        """Reconnect tries that failed since the link was lost (said once reconnected)."""
        self._watching = False
        self._with_creds = bool(cfg.nats.creds)
        self.serving = False
        """Started: assets provisioned, rules loaded, handlers subscribed (until :meth:`stop`)."""

    def _emit(self, transitions: list[Transition]) -> None:
        """Where a part hands the transitions it made: the pipeline (built after the parts,
        since they are its consumers)."""
        self.fanout.emit(transitions)

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
            self.metrics.watch_partition_beats(self.ingest.beats)
        await self._start_components(stop)
        await self._serve()
        if self.feed is not None:
            self._running.append(self.feed)
            await self.feed.start()
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
        for attempt, wait in enumerate((*START_RETRY_S, None), start=1):
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
                self._running = []  # (consumers of parts not running ignore transitions)
                if stop is None:
                    await asyncio.sleep(wait)
                else:
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(stop.wait(), wait)
                    if stop.is_set():
                        raise

    async def _start_components_once(self) -> None:
        self.replicas = await provision_assets(self.nc, self.provisioning, self.subjects,
                                               self.keeper)  # fmt: skip
        self.jetstream_ok = self.replicas is not None
        secret = await token_secret(self.nc, self.provisioning, jetstream=self.jetstream_ok)
        self.registry.signer.set_secret(secret)
        self._running = []
        for component, needs_js in self.parts:
            if self.jetstream_ok or not needs_js:
                self._running.append(component)  # stopped (idempotent) should its start fail
                await component.start()

    async def _serve(self) -> None:
        """Serve the Services endpoints (the agent subjects are the ingest's, per partition)."""
        nc, s, ep = self.nc, self.subjects, self.handlers.endpoints
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
        for name, subject, handler in (
            ("route", s.all_routes, self.forwarder.on_request),
            ("agents", s.agents, ep["agents"].on_request),
        ):
            await self._service.add_endpoint(
                EndpointConfig(name=name, subject=subject, handler=handler,
                               queue_group=QUEUE_GROUP)
            )  # fmt: skip
        await flush_subscriptions(nc)  # a single flush() may overtake the SUBs (nats-py)

    async def _stop_serving(self) -> None:
        """Stop the Services endpoints, answering every request the server already sent
        them. nats.micro's ``Service.stop()`` unsubscribes its endpoints, discarding the
        requests queued for them (a route request sent as the broker stopped went
        unanswered): they are drained first, then the service stopped without them."""
        service = self._service
        if service is None:
            return
        endpoints = service._endpoints  # nats.micro keeps its endpoints private
        grace = self.cfg.broker.shutdown_grace_s
        await asyncio.gather(*(drain_subscription(self.nc, ep._subscription, grace)
                               for ep in endpoints if ep._subscription is not None))  # fmt: skip
        service._endpoints = []  # drained: its stop() would unsubscribe them again
        try:
            await service.stop()
        except Exception:  # noqa: BLE001 - a closed connection must not block shutdown
            log.debug("broker.stop service already closed", exc_info=True)

    async def stop(self) -> None:
        """Stop taking work (every request already delivered answered), let in-flight
        work end, stop the parts, close."""
        if not self._started:
            return
        self._started = False
        self.serving = False
        await self._stop_serving()
        # The forwards sent to this broker answered while it still owns its partitions, and
        # its own forwards answered by their owners or refused (issue 24: a stopping owner
        # leaves no route request unanswered).
        await self.forwarder.drain()
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
        if self.spans is not None:
            await asyncio.to_thread(self.spans.flush)
        log.info("broker.stopped id=%s", self.broker_id)

    def not_ready(self) -> str | None:
        """Why ``/readyz`` says 503 (:mod:`reach_broker.console.health`), or None: connected to
        NATS, the JetStream assets provisioned, the rules loaded and the handlers subscribed."""
        servers = self.cfg.nats.url or "NATS_URL / nats://127.0.0.1:4222"
        if not self._started:
            return "the broker is not running"
        if not self.nc.is_connected:
            if self.serving:
                return f"disconnected from NATS (reconnecting to {servers})"
            return f"not connected to NATS yet (connecting to {servers})"
        if not self.serving:
            return "starting: provisioning the JetStream assets and loading the route rules"
        mismatch = self.ingest.not_ready()
        if mismatch is not None:
            return mismatch
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
        server's permissions (``link.secured``). Otherwise say once, loudly, what open mode
        means."""
        # nats-py keeps the server's INFO private; `auth_required` is the server's own word.
        info = getattr(self.nc, "_server_info", None) or {}
        self.link.opened(secured=bool(info.get("auth_required")) and self._with_creds)
        self.metrics.auth_enabled.set(int(self.link.secured))
        if not self.link.secured:
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
        if not self._connected:
            return  # before, the first connect's failures are said (rate-limited)
        if self.nc.is_reconnecting:  # each failed try, every 0.5 s a server: counted, said
            self._failed_tries += 1  # once reconnected (nemesis seed 34: 6 lines a second)
            log.debug("broker.nats_error kind=%s error=%s (reconnecting)", kind, exc)
            return
        log.warning("broker.nats_error kind=%s error=%s", kind, exc)

    async def _on_disconnected(self) -> None:
        if self._started and self._connected:  # not at our own shutdown (the drain closes
            # it), nor when a first connect that never succeeded is called off
            log.warning("broker.nats_disconnected")
            self.observer.lost(self.clock())

    async def _on_reconnected(self) -> None:
        url = self.nc.connected_url
        log.info("broker.nats_reconnected url=%s failed_tries=%d",
                 url.netloc if url is not None else None, self._failed_tries)  # fmt: skip
        self._failed_tries = 0
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
