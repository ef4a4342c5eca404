"""The broker process: what ``reach broker`` runs, assembled in one place.

Start, in order: an embedded ``nats-server`` when the config names no server (in a session
of its own, so a terminal Ctrl-C reaches the broker only, which stops its clients before
the server: the server dying first would leave them reconnecting), SIGINT/SIGTERM/SIGHUP
handlers (SIGHUP: the terminal closed), the Prometheus ``/metrics`` endpoint, the
:class:`~reach_broker.service.Broker`, then (``a2a.port``) the A2A gateway on the running
broker (:mod:`reach_broker.a2a`). Stop, the other way round: the gateway, the broker (drains,
leaves nothing in flight), then the embedded server. The metrics endpoint is a daemon thread that
ends with the process. Should the process die without stopping (``kill -9``), the embedded
server dies with it (:mod:`reach_broker.lifeline`).
"""

from __future__ import annotations

import asyncio
import os
import signal
from typing import Any

from .config import Config
from .logs import say
from .natsserver import NatsServer, NatsServerError, PortInUse

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
"""What stops the process in order: Ctrl-C, ``kill``, and the terminal going away."""


class StartError(Exception):
    """The process could not start; the message says what failed and how to fix it."""


def install_uvloop() -> None:
    """Run the process's event loops on uvloop when it is installed (not on Windows)."""
    try:
        import uvloop
    except ImportError:
        return
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())


def run(cfg: Config) -> None:
    """The whole process: :func:`serve` on uvloop (when installed) until a signal."""
    install_uvloop()
    asyncio.run(serve(cfg))


async def serve(cfg: Config, *, stop: asyncio.Event | None = None) -> None:
    """Run a broker for ``cfg`` until SIGINT/SIGTERM (or ``stop`` is set), then stop it in
    order. Without ``cfg.nats.url`` an embedded server is started and ``cfg.nats.url`` set to
    it. Raises :class:`StartError` when something cannot start."""
    check_a2a(cfg)
    server = await _embedded_server(cfg) if not cfg.nats.url else None
    try:
        if stop is None:
            stop = asyncio.Event()
            loop = asyncio.get_running_loop()
            for sig in STOP_SIGNALS:
                loop.add_signal_handler(sig, stop.set)
        await _run_broker(cfg, stop)
    finally:
        if server is not None:
            await asyncio.to_thread(server.stop)


def check_a2a(cfg: Config) -> None:
    """Refuse an A2A gateway that cannot start before anything else starts: its extra is
    missing, or it would listen beyond loopback without a token."""
    if not cfg.a2a.port:
        return
    from .a2a.binding import binding_error
    from .extras import MissingExtra, require

    try:
        require("a2a", "--a2a-port")
    except MissingExtra as exc:
        raise StartError(str(exc)) from None
    why = binding_error(cfg.a2a)
    if why is not None:
        raise StartError(why)


async def _embedded_server(cfg: Config) -> NatsServer:
    server = NatsServer(port=cfg.nats.embedded_port, store_dir=cfg.nats.embedded_store_dir,
                        new_session=True)  # fmt: skip
    try:
        await asyncio.to_thread(server.start)
    except PortInUse as exc:
        raise StartError(
            f"port {exc.port} is already in use (another `reach broker` or nats-server?): stop "
            "that one, choose another port with --port (0: any free port), or use the running "
            f"server with --server nats://{exc.host}:{exc.port}"
        ) from None
    except NatsServerError as exc:
        raise StartError(f"embedded nats-server: {exc}") from None
    cfg.nats.url = server.url
    say(f"reach: embedded nats-server listening on {server.url} "
        f"(pid {server.pid}, JetStream store {server.store_dir})")  # fmt: skip
    return server


async def _run_broker(cfg: Config, stop: asyncio.Event) -> None:
    from prometheus_client import start_http_server

    from .metrics import Metrics
    from .service import Broker

    metrics = Metrics()
    if cfg.broker.metrics_port:
        try:
            start_http_server(cfg.broker.metrics_port, cfg.broker.metrics_host,
                              registry=metrics.registry)  # fmt: skip
        except OSError as exc:
            raise StartError(
                f"metrics port {cfg.broker.metrics_port}: {exc.strerror} "
                "(choose another with --metrics-port, 0 turns it off)"
            ) from None
    broker = Broker(cfg, metrics=metrics)
    try:
        await broker.start()
    except Exception as exc:
        raise StartError(
            f"cannot start the broker on {cfg.nats.url}: {exc or type(exc).__name__}"
        ) from None
    where = (f"; metrics on http://{cfg.broker.metrics_host}:{cfg.broker.metrics_port}/metrics"
             if cfg.broker.metrics_port else "")  # fmt: skip
    say(f"reach: broker {broker.broker_id} serving on {cfg.nats.url}{where}")
    try:
        gateway = await _a2a_gateway(cfg, broker) if cfg.a2a.port else None
        try:
            await stop.wait()
        finally:
            say("reach: stopping")
            if gateway is not None:
                await gateway.stop()
    finally:
        await broker.stop()


async def _a2a_gateway(cfg: Config, broker: Any) -> Any:
    """The A2A gateway of the running ``broker``, started and announced."""
    from .a2a.gateway import A2AGateway

    gateway = A2AGateway(cfg.a2a, nc=broker.nc, subjects=broker.subjects,
                         registry=broker.registry, router=broker.router, clock=broker.clock,
                         wall=broker.wall)  # fmt: skip
    try:
        await gateway.start()
    except OSError as exc:
        why = os.strerror(exc.errno) if exc.errno else str(exc)
        raise StartError(f"A2A port {cfg.a2a.port} on {cfg.a2a.host}: {why} (choose another "
                         "with --a2a-port)") from None  # fmt: skip
    token = " (Authorization: Bearer token required)" if cfg.a2a.token else ""
    say(f"reach: A2A gateway on {gateway.url}/ (cards at /agents and "
        f"/.well-known/agent-card.json, JSON-RPC at /a2a/<capability>){token}")  # fmt: skip
    return gateway
