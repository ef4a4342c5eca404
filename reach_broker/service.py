"""The broker process: NATS wiring around the pure registry and router.

Announce, heartbeat and leave are plain subscriptions on every replica (each derives the same
state); route and ``agents`` are NATS Services API endpoints in queue group ``reach-broker``,
so replicas share that load and ``nats micro ls`` lists the broker. Every transition the
registry returns is published as an ``Event`` on ``<prefix>.event.<kind>.<agent_id>`` and
handed to the registered listeners (snapshot, compensation replay, probes).
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import socket
import time
from collections.abc import Awaitable, Callable
from types import TracebackType
from typing import Any, Protocol

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.errors import SlowConsumerError
from nats.micro import add_service
from nats.micro.request import Request
from nats.micro.service import EndpointConfig, Service, ServiceConfig

from reach_agent import schema
from reach_agent._runtime import drain_or_close, flush_subscriptions
from reach_agent.errors import Forbidden, InternalError, ReachError, to_reply
from reach_agent.schema import (
    AnnounceAck,
    Event,
    Ok,
    RouteReply,
    check_agent_id,
    check_capability,
    decode,
)

from . import __version__
from .advisories import Advisories
from .config import Config
from .metrics import Metrics
from .probes import Prober
from .records import AgentRecord, Transition
from .registry import Registry
from .replay import Replayer
from .routing import Router
from .snapshot import Snapshot
from .tokens import TokenSigner

log = logging.getLogger(__name__)

QUEUE_GROUP = "reach-broker"
SERVICE_NAME = "reach-broker"
SERVICE_DESCRIPTION = "reach: routes tasks to reachable AI agents by capability"
SECRET_BUCKET = "reach_registry"
SECRET_KEY = "_broker.token_secret"

DEFAULT_ROUTE_REQUEST = schema.RouteRequest()
"""An empty route body (``nats req reach.route.cap ''``) means every default."""

TransitionListener = Callable[[Transition, AgentRecord | None], None]


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
        self.prefix = cfg.broker.prefix
        self.broker_id = cfg.broker.broker_id or default_broker_id()
        self.metrics = metrics or Metrics()
        self.clock = clock
        self.wall = wall
        self.nc: NATS = nc if nc is not None else NATS()
        self._own_nc = nc is None
        self.registry: Registry | None = None
        self.router: Router | None = None
        self.listeners: list[TransitionListener] = []
        self.announce_listeners: list[Callable[[AgentRecord], None]] = []
        """Told of every accepted announce, also one that changes no state (the snapshot)."""
        self.components: list[Component] = []
        # Failure detection (issue 5): probes first, then advisories (which reconcile with
        # the server's connection list at start, so registry restores must come before).
        self.probes = Prober(self)
        self.advisories = Advisories(self)
        self.components += [self.probes, self.advisories]
        # JetStream (issue 4): the snapshot restores the registry before probes and
        # advisories start; replay comes last. Both are no-ops without JetStream.
        self.jetstream_ok = False
        self.snapshot = Snapshot(self)
        self.replayer = Replayer(self)
        self.components.insert(0, self.snapshot)
        self.components.append(self.replayer)
        self._service: Service | None = None
        self._subs: list[Any] = []
        self._tasks: set[asyncio.Task[Any]] = set()
        self._loop_task: asyncio.Task[None] | None = None
        self._started = False
        p = self.prefix
        self._announce_cut = len(f"{p}.announce.")
        self._hb_cut = len(f"{p}.hb.")
        self._leave_cut = len(f"{p}.leave.")
        self._route_cut = len(f"{p}.route.")

    # --- lifecycle ----------------------------------------------------------------------

    async def start(self) -> None:
        if self._started:
            return
        self._started = True
        if self._own_nc:
            await self._connect()
        self.jetstream_ok = await self._provision()
        secret = await self._token_secret()
        registry = Registry(self.cfg, TokenSigner(secret, self.cfg.broker.token_max_age_s))
        self.registry = registry
        self.router = Router(
            self.cfg.routing, registry.indexes, self.task_subject,
            inflight=lambda: registry.inflight,
            on_panic=lambda cap, on: self.metrics.panic.labels(cap).set(int(on)),
        )  # fmt: skip
        self.metrics.watch_states(lambda: self.registry.counts if self.registry else {})
        for component in self.components:
            await component.start()
        p = self.prefix
        nc = self.nc
        msgs, size = 1_000_000, 512 * 1024 * 1024  # a storm of heartbeats must queue, not drop
        self._subs = [
            await nc.subscribe(f"{p}.hb.*", cb=self._on_heartbeat,
                               pending_msgs_limit=msgs, pending_bytes_limit=size),
            await nc.subscribe(f"{p}.announce.*", cb=self._on_announce,
                               pending_msgs_limit=msgs, pending_bytes_limit=size),
            await nc.subscribe(f"{p}.leave.*", cb=self._on_leave),
        ]
        self._service = await add_service(
            nc,
            ServiceConfig(
                name=SERVICE_NAME,
                version=__version__,
                description=SERVICE_DESCRIPTION,
                metadata={"broker_id": self.broker_id, "prefix": p},
                queue_group=QUEUE_GROUP,
            ),
        )
        await self._service.add_endpoint(
            EndpointConfig(name="route", subject=f"{p}.route.>", handler=self._on_route,
                           queue_group=QUEUE_GROUP)
        )  # fmt: skip
        await self._service.add_endpoint(
            EndpointConfig(name="agents", subject=f"{p}.agents", handler=self._on_agents,
                           queue_group=QUEUE_GROUP)
        )  # fmt: skip
        await flush_subscriptions(nc)  # a single flush() may overtake the SUBs (nats-py)
        self._loop_task = asyncio.create_task(self._tick_loop(), name="reach-broker-tick")
        url = nc.connected_url
        log.info("broker.started id=%s prefix=%s server=%s", self.broker_id, p,
                 url.geturl() if url else None)  # fmt: skip

    async def stop(self) -> None:
        """Stop taking work, drain subscriptions, let in-flight probes end, close."""
        if not self._started:
            return
        self._started = False
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
            self._loop_task.cancel()
            await asyncio.gather(self._loop_task, return_exceptions=True)
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=self.cfg.broker.shutdown_grace_s)
            for t in self._tasks:
                t.cancel()
        for component in reversed(self.components):
            try:
                await component.stop()
            except Exception:  # noqa: BLE001
                log.exception("broker.stop component=%s failed", type(component).__name__)
        if self._own_nc:
            await drain_or_close(self.nc, self.cfg.broker.shutdown_grace_s)
        log.info("broker.stopped id=%s", self.broker_id)

    async def __aenter__(self) -> Broker:
        await self.start()
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.stop()

    async def _connect(self) -> None:
        ncfg = self.cfg.nats
        servers = (ncfg.url or "nats://127.0.0.1:4222").split(",")
        await self.nc.connect(
            servers=servers,
            name=f"reach-broker-{self.broker_id}",
            user_credentials=ncfg.creds,
            ping_interval=ncfg.ping_interval_s,
            max_outstanding_pings=ncfg.max_outstanding_pings,
            max_reconnect_attempts=-1,
            reconnect_time_wait=0.5,  # type: ignore[arg-type]  # annotated int, used as seconds
            error_cb=self._on_nats_error,
            disconnected_cb=self._on_disconnected,
            reconnected_cb=self._on_reconnected,
        )

    async def _on_nats_error(self, exc: Exception) -> None:
        kind = "slow_consumer" if isinstance(exc, SlowConsumerError) else type(exc).__name__
        self.metrics.nats_errors.labels(kind).inc()
        log.warning("broker.nats_error kind=%s error=%s", kind, exc)

    async def _on_disconnected(self) -> None:
        if self._started:  # not during our own shutdown, where the drain closes it
            log.warning("broker.nats_disconnected")

    async def _on_reconnected(self) -> None:
        log.info("broker.nats_reconnected url=%s", self.nc.connected_url)
        self.advisories.on_reconnected()  # disconnects may have been missed meanwhile

    async def _provision(self) -> bool:
        """Create or update the JetStream assets (jetstream/definitions) before any use.

        No JetStream on the server: warn and run without snapshot and replay. A definition
        that would lose data if applied: raise (the broker refuses to start).
        """
        from jetstream.provision import JetStreamUnavailable, load_definitions, provision

        defs = load_definitions(
            self.prefix, {"REACH_COMPENSATION": {"max_msgs": self.cfg.compensation.max_entries}}
        )
        try:
            outcomes = await provision(self.nc, defs)
        except JetStreamUnavailable as exc:
            log.warning("broker.no_jetstream %s: running without registry snapshot, "
                        "compensation replay and durable acks", exc)  # fmt: skip
            return False
        for o in outcomes:
            if o.action != "unchanged":
                log.info("jetstream.%s stream=%s %s", o.action, o.name, "; ".join(o.changes))
        return True

    async def _token_secret(self) -> bytes:
        """The configured secret, else one shared through JetStream KV by all replicas."""
        if self.cfg.broker.token_secret:
            return self.cfg.broker.token_secret.encode()
        try:
            js = self.nc.jetstream(timeout=2.0)
            try:
                kv = await js.key_value(SECRET_BUCKET)
            except Exception:  # noqa: BLE001 - absent: create it (provisioning refines it)
                kv = await js.create_key_value(bucket=SECRET_BUCKET, history=1)
            fresh = secrets.token_hex(32).encode()
            try:
                await kv.create(SECRET_KEY, fresh)
                return fresh
            except Exception:  # noqa: BLE001 - another replica created it first
                entry = await kv.get(SECRET_KEY)
                assert entry.value
                return entry.value
        except Exception as exc:  # noqa: BLE001
            log.warning(
                "broker.token_secret no JetStream (%s): using a random secret; replicas will "
                "not accept each other's tokens. Set broker.token_secret or REACH_TOKEN_SECRET.",
                exc,
            )
            return secrets.token_bytes(32)

    # --- helpers ------------------------------------------------------------------------

    def task_subject(self, agent_id: str, capability: str) -> str:
        return f"{self.prefix}.task.{agent_id}.{capability}"

    def wall_ms(self) -> int:
        return int(self.wall() * 1000)

    def spawn(self, coro: Awaitable[Any], name: str) -> None:
        task = asyncio.ensure_future(coro)
        task.set_name(name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _reply_error(self, msg: Msg, err: ReachError) -> None:
        if not msg.reply:
            return
        headers, body = to_reply(err)
        await self.nc.publish(msg.reply, body, headers=headers)

    def emit(self, transitions: list[Transition]) -> None:
        """Publish events for transitions and notify listeners (the prober is one)."""
        assert self.registry is not None
        at_ms = self.wall_ms()
        for t in transitions:
            event = Event(
                kind=t.kind, agent_id=t.agent_id, reason=t.reason, at_ms=at_ms,
                broker_id=self.broker_id, to=t.to, from_=t.from_,
            )  # fmt: skip
            subject = f"{self.prefix}.event.{t.kind}.{t.agent_id}"
            self.spawn(self.nc.publish(subject, schema.encoder.encode(event)), "event")
            self.metrics.registry_changes.labels(t.kind).inc()
            if t.to is not None and t.kind != "registered":
                self.metrics.state_changes.labels(t.to).inc()
            log.info("agent.%s agent=%s from=%s to=%s reason=%s", t.kind, t.agent_id,
                     t.from_, t.to, t.reason)  # fmt: skip
            rec = self.registry.agents.get(t.agent_id)
            for listener in self.listeners:
                try:
                    listener(t, rec)
                except Exception:  # noqa: BLE001 - a listener never breaks the broker
                    log.exception("broker.listener failed transition=%s", t)

    # --- loops --------------------------------------------------------------------------

    async def _tick_loop(self) -> None:
        tick = self.cfg.detection.tick_s
        assert self.registry is not None
        while True:
            await asyncio.sleep(tick)
            try:
                changes = self.registry.expire(self.clock())
                if changes:
                    self.emit(changes)
            except Exception:  # noqa: BLE001 - the loop body never dies
                log.exception("broker.tick failed")

    # --- handlers -----------------------------------------------------------------------

    async def _on_announce(self, msg: Msg) -> None:
        assert self.registry is not None
        agent_id = msg.subject[self._announce_cut :]
        try:
            check_agent_id(agent_id, "subject agent_id")
            ann = schema.validate_announce(
                decode(schema.announce_decoder, msg.data, "announce"), agent_id
            )
            rec, transitions = self.registry.announce(ann, self.clock(), self.wall_ms())
        except ReachError as err:
            self.metrics.announce_result["invalid"].inc()
            log.info("announce.refused subject=%s error=%s", msg.subject, err.message)
            await self._reply_error(msg, err)
            return
        except Exception as exc:  # noqa: BLE001
            self.metrics.announce_result["error"].inc()
            log.exception("announce.failed subject=%s", msg.subject)
            await self._reply_error(msg, InternalError(f"announce failed: {exc!r}"))
            return
        self.metrics.announce_result["ok"].inc()
        for listener in self.announce_listeners:
            listener(rec)
        if msg.reply:
            ack = AnnounceAck(
                agent_id=agent_id, token=rec.token,
                heartbeat_interval_ms=int(rec.interval_s * 1000), broker_id=self.broker_id,
            )  # fmt: skip
            await self.nc.publish(msg.reply, schema.encoder.encode(ack))
        if transitions:
            self.emit(transitions)

    async def _on_heartbeat(self, msg: Msg) -> None:
        registry = self.registry
        assert registry is not None
        agent_id = msg.subject[self._hb_cut :]
        try:
            hb = schema.validate_heartbeat(
                decode(schema.heartbeat_decoder, msg.data, "heartbeat"), agent_id
            )
            result, transitions = registry.heartbeat(hb, self.clock(), self.wall_ms())
        except ReachError as err:
            self.metrics.heartbeat_result["invalid"].inc()
            if log.isEnabledFor(logging.DEBUG):
                log.debug("heartbeat.dropped subject=%s error=%s", msg.subject, err.message)
            return
        except Exception:  # noqa: BLE001
            self.metrics.heartbeat_result["invalid"].inc()
            log.exception("heartbeat.failed subject=%s", msg.subject)
            return
        self.metrics.heartbeat_result[result].inc()
        if transitions:
            self.emit(transitions)

    async def _on_leave(self, msg: Msg) -> None:
        assert self.registry is not None
        agent_id = msg.subject[self._leave_cut :]
        try:
            check_agent_id(agent_id, "subject agent_id")
            body = decode(schema.leave_decoder, msg.data, "leave")
            if body.agent_id is not None and body.agent_id != agent_id:
                raise schema.InvalidRequest(
                    f"agent_id {body.agent_id!r} in the body disagrees with the subject's "
                    f"{agent_id!r}"
                )
            if body.token is not None and not self.registry.signer.verify(agent_id, body.token):
                raise Forbidden(f"token does not verify for agent_id {agent_id!r}")
        except ReachError as err:
            self.metrics.leaves.labels("invalid").inc()
            await self._reply_error(msg, err)
            return
        transitions = self.registry.leave(agent_id, self.clock(), body.reason or "leave")
        self.metrics.leaves.labels("ok").inc()
        if msg.reply:
            await self.nc.publish(msg.reply, schema.encoder.encode(Ok()))
        if transitions:
            self.emit(transitions)

    async def _on_route(self, req: Request) -> None:
        t0 = time.perf_counter()
        m = self.metrics
        router = self.router
        assert router is not None and self.registry is not None
        capability = req.subject[self._route_cut :]
        try:
            if capability not in self.registry.indexes:
                check_capability(capability)
            data = req.data
            rreq = (
                schema.validate_route_request(
                    decode(schema.route_request_decoder, data, "route request")
                )
                if data and data != b"{}"
                else DEFAULT_ROUTE_REQUEST  # the common case: no decode, no validation
            )
            candidates = router.route(capability, rreq, self.clock())
        except ReachError as err:
            result = {"NO_REACHABLE_AGENT": "no_agent", "OVERLOADED": "overloaded"}.get(
                err.code, "invalid"
            )
            m.route_result[result].inc()
            headers, body = to_reply(err)
            await req.respond(body, headers=headers)
            m.route_duration.observe(time.perf_counter() - t0)
            return
        except Exception as exc:  # noqa: BLE001
            m.route_result["error"].inc()
            log.exception("route.failed capability=%s", capability)
            headers, body = to_reply(InternalError(f"route failed: {exc!r}"))
            await req.respond(body, headers=headers)
            return
        reply = RouteReply(
            capability=capability, candidates=candidates, generated_at_ms=self.wall_ms()
        )
        await req.respond(schema.encoder.encode(reply))
        m.route_result["ok"].inc()
        m.route_duration.observe(time.perf_counter() - t0)

    async def _on_agents(self, req: Request) -> None:
        assert self.registry is not None
        try:
            areq = decode(schema.agents_request_decoder, req.data, "agents request")
            if areq.capability is not None:
                check_capability(areq.capability)
        except ReachError as err:
            headers, body = to_reply(err)
            await req.respond(body, headers=headers)
            return
        views = self.registry.views(
            self.wall_ms(), self.clock(), capability=areq.capability, state=areq.state
        )
        await req.respond(schema.encoder.encode(views))

