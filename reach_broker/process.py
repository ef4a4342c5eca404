"""The broker process: what ``reach broker`` runs, assembled in one place.

Start, in order: an embedded ``nats-server`` when the config names no server (its
JetStream store kept across restarts in ``./reach-data`` unless ``--store-dir`` or
``--ephemeral`` say otherwise; with ``nats.auth_dir``: the DIR's ``server.conf`` and store,
operator mode; in a session of its own, so a terminal Ctrl-C reaches the broker only, which
stops its clients before the server: the server dying first would leave them reconnecting),
SIGINT/SIGTERM/SIGHUP handlers (SIGHUP: the terminal closed) and the frozen heap
(:mod:`reach_broker.heap`: full garbage collections walk only what came since the last), the
HTTP port (Prometheus
``/metrics``, the probes ``/healthz`` and ``/readyz`` of :mod:`reach_broker.console.health` and the
web console, :mod:`reach_broker.console`), the :class:`~reach_broker.broker.Broker` (built
with the console's feed when the port shows the console, which it starts last), then
(``a2a.port``) the A2A gateway (:mod:`reach_broker.interop.a2a`). Stop, the other way round:
the gateway, the HTTP port (open pages are told goodbye), the broker (the feed first;
drains, leaves nothing in flight), then the embedded server. Should the process die without
stopping (``kill -9``), the embedded server dies with it (:mod:`reach_broker.cluster.lifeline`).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from pathlib import Path
from typing import Any

from reach_agent.connection import NotConnected
from reach_broker.cluster.natsserver import (
    NatsServer,
    NatsServerError,
    PortInUse,
    StoreInUse,
)

from .config import Config
from .heap import FrozenHeap
from .logs import say

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
    if cfg.nats.auth_dir:
        _use_auth_dir(cfg)
    if not cfg.nats.url:
        _use_context(cfg)
    server = await _embedded_server(cfg) if not cfg.nats.url else None
    try:
        with contextlib.ExitStack() as whole:
            if stop is None:  # the process is this broker's: its signals, its heap
                stop = asyncio.Event()
                loop = asyncio.get_running_loop()
                for sig in STOP_SIGNALS:
                    loop.add_signal_handler(sig, stop.set)
                whole.enter_context(FrozenHeap(loop).installed())
            await _run_broker(cfg, stop)
    finally:
        if server is not None:
            await asyncio.to_thread(server.stop)


def check_a2a(cfg: Config) -> None:
    """Refuse an A2A gateway that cannot start before anything else starts: its extra is
    missing, or it would listen beyond loopback without a token. Without a token of its own
    the gateway takes the console's: one token for the broker's HTTP surfaces."""
    if not cfg.a2a.port:
        return
    if cfg.a2a.token is None:
        cfg.a2a.token = cfg.console.token
    from reach_broker.interop.a2a.binding import binding_error

    from .extras import MissingExtra, require

    try:
        require("a2a", "--a2a-port")
    except MissingExtra as exc:
        raise StartError(str(exc)) from None
    why = binding_error(cfg.a2a)
    if why is not None:
        raise StartError(why)


def _use_context(cfg: Config) -> None:
    """A NATS context named by ``nats.context`` (``--context``) or ``NATS_CONTEXT`` that names
    a server: the broker connects there instead of starting an embedded server. Otherwise the
    embedded server's connection uses no context, not even the one selected in the ``nats``
    CLI (its server is this process's own)."""
    from reach_agent.connection import load_context

    name = cfg.nats.context if cfg.nats.context is not None else os.environ.get("NATS_CONTEXT")
    if name:
        try:
            ctx = load_context(name)
        except ValueError as exc:
            raise StartError(str(exc)) from None
        if ctx.url:
            cfg.nats.url, cfg.nats.context = ctx.url, name
            return
    cfg.nats.context = ""


def _use_auth_dir(cfg: Config) -> None:
    """The broker's credential (and CA) from the auth DIR, unless set explicitly."""
    from .auth import AuthDir, AuthError

    try:
        d = AuthDir.open(cfg.nats.auth_dir or "")
        meta = d.meta()
    except AuthError as exc:
        raise StartError(f"--auth: {exc}") from None
    cfg.nats.creds = cfg.nats.creds or str(d.broker_creds)
    if meta.tls:
        cfg.nats.tls_ca = cfg.nats.tls_ca or str(d.ca)


async def _embedded_server(cfg: Config) -> NatsServer:
    if cfg.nats.auth_dir:
        from .auth import AuthDir

        d = AuthDir.open(cfg.nats.auth_dir)
        server = NatsServer(port=cfg.nats.embedded_port, config=d.server_conf,
                            store_dir=d.store_dir, config_store=True, tls=d.meta().tls,
                            new_session=True)  # fmt: skip
    else:
        server = NatsServer(port=cfg.nats.embedded_port, store_dir=store_dir(cfg),
                            new_session=True)  # fmt: skip
    try:
        await asyncio.to_thread(server.start)
    except PortInUse as exc:
        raise StartError(
            f"port {exc.port} is already in use (another `reach broker` or nats-server?): stop "
            "that one, choose another port with --port (0: any free port), or use the running "
            f"server with --server nats://{exc.host}:{exc.port}"
        ) from None
    except StoreInUse as exc:
        raise StartError(f"{exc}: stop that broker, or give this one another store with "
                         "--store-dir DIR (or --ephemeral)") from None  # fmt: skip
    except NatsServerError as exc:
        raise StartError(f"embedded nats-server: {exc}") from None
    cfg.nats.url = server.url
    mode = f"; operator mode from {cfg.nats.auth_dir}" if cfg.nats.auth_dir else ""
    kept = ("a throwaway temp dir, removed at exit" if cfg.nats.embedded_ephemeral and
            not cfg.nats.auth_dir else "kept across restarts")  # fmt: skip
    say(f"reach: embedded nats-server listening on {server.url} "
        f"(pid {server.pid}, JetStream store {server.store_dir}: {kept}{mode})")  # fmt: skip
    return server


DEFAULT_STORE_DIR = "reach-data"
"""Where ``reach broker``'s embedded server keeps its JetStream store unless told otherwise:
acks, claims, the compensation queue, the audit trail and the registry snapshot."""


def store_dir(cfg: Config) -> Path | None:
    """The embedded server's store: ``[nats] embedded_store_dir`` (``--store-dir``), else
    ``./reach-data``, made absolute now (so the line printed at start names it); None, a
    temp dir removed at exit, with ``embedded_ephemeral`` (``--ephemeral``)."""
    if cfg.nats.embedded_ephemeral:
        return None
    return Path(cfg.nats.embedded_store_dir or DEFAULT_STORE_DIR).expanduser().resolve()


async def _run_broker(cfg: Config, stop: asyncio.Event) -> None:
    from reach_broker.broker import Broker
    from reach_broker.console.port import HttpPort, access_of
    from reach_broker.service.metrics import Metrics

    metrics = Metrics()
    access = access_of(cfg.broker.metrics_host, cfg.console)
    shown = bool(cfg.broker.metrics_port) and access.enabled
    broker = Broker(cfg, metrics=metrics, console=shown)
    port = (HttpPort(access, cfg.broker.metrics_port, metrics.registry, broker.not_ready,
                     broker.feed)
            if cfg.broker.metrics_port else None)  # fmt: skip
    if port is not None:
        try:
            await port.start()
        except OSError as exc:
            why = os.strerror(exc.errno) if exc.errno else str(exc)
            raise StartError(
                f"metrics port {cfg.broker.metrics_port}: {why} "
                "(choose another with --metrics-port, 0 turns it off)"
            ) from None
    try:
        await _serve_broker(cfg, stop, broker, port)
    finally:
        if port is not None:
            await port.stop()


async def _serve_broker(cfg: Config, stop: asyncio.Event, broker: Any, port: Any) -> None:
    try:
        await broker.start(stop=stop)
    except NotConnected as exc:  # a signal while no server had answered yet
        raise StartError(str(exc)) from None
    except Exception as exc:
        raise StartError(
            f"cannot start the broker on {cfg.nats.url}: {exc or type(exc).__name__}"
        ) from None
    gateway = None
    try:
        where = f"; {port.describe()}" if port is not None else ""
        say(f"reach: broker {broker.broker_id} serving on {cfg.nats.url}{where}")
        gateway = await _a2a_gateway(cfg, broker) if cfg.a2a.port else None
        await stop.wait()
    finally:
        say("reach: stopping")
        if gateway is not None:
            await gateway.stop()
        if port is not None:
            await port.stop()  # the pages first: their streams end
        await broker.stop()


async def _a2a_gateway(cfg: Config, broker: Any) -> Any:
    """The A2A gateway of the running ``broker``, started and announced."""
    from reach_broker.interop.a2a.gateway import A2AGateway

    gateway = A2AGateway(cfg.a2a, nc=broker.nc, subjects=broker.subjects,
                         registry=broker.registry, router=broker.router, clock=broker.clock,
                         replicas=broker.replicas, wall=broker.wall)  # fmt: skip
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
