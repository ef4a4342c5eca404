"""The A2A registry and gateway as a broker component: :class:`A2AGateway`.

It is handed what it uses — the broker's connection, subjects, registry, router and clocks —
and runs in the broker process: the cards read the registry directly (live, no request), and
``message/send`` goes through a :class:`reach_agent.Client` on the broker's connection whose
routes are the broker's own router (:mod:`.local`). HTTP is uvicorn's, started on a socket
bound here (so a taken port is an ``OSError`` the process reports, and uvicorn installs no
signal handlers of its own); the app is :mod:`.app`.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections.abc import Callable
from typing import Any

from nats.aio.client import Client as NATS

from reach_agent.client.client import Client
from reach_agent.client.config import ClientConfig
from reach_agent.wire.subjects import Subjects
from reach_broker import __version__
from reach_broker.config import A2ASection
from reach_broker.core.registry import Registry
from reach_broker.core.routing import Router

from .app import Views, build_app
from .binding import bind
from .handler import GatewayHandler
from .local import LocalRoutes
from .tasks import Tasks, owner_of

log = logging.getLogger(__name__)

SHUTDOWN_GRACE_S = 5
"""How long stop() lets open requests finish before cancelling them."""


class A2AGateway:
    """Agent Cards and A2A JSON-RPC on ``a2a.host:a2a.port``, for one broker."""

    def __init__(
        self,
        cfg: A2ASection,
        *,
        nc: NATS,
        subjects: Subjects,
        registry: Registry,
        router: Router,
        clock: Callable[[], float],
        replicas: int | None,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.cfg = cfg
        self.replicas = replicas
        """The broker's JetStream replica count (its task bucket's), None without JetStream."""
        config = ClientConfig(prefix=subjects.prefix)
        routes = LocalRoutes(registry, router, clock, subjects.task, config.route_limit)
        self.client = Client(nc=nc, config=config, clock=clock, routes=routes)
        agents = registry.agents

        def wall_ms() -> int:
            return int(wall() * 1000)

        def hint_of(capability: str, agent_id: str | None) -> int | None:
            if agent_id is not None:
                rec = agents.get(agent_id)
            else:
                idx = registry.indexes.get(capability)
                rec = idx.ranked[0] if idx is not None and idx.ranked else None
            return rec.timeout_hint_ms if rec is not None else None

        self.tasks = Tasks(nc, subjects, owner_of(cfg.token), wall_ms)
        self.handler = GatewayHandler(
            self.client, self.tasks,
            lambda a: rec.capabilities if (rec := agents.get(a)) else None, hint_of,
            default_timeout=cfg.call_timeout_s, long_task_hint_s=cfg.long_task_hint_s,
            wall_ms=wall_ms,
        )  # fmt: skip
        self.views = Views(registry, router, clock, wall_ms, version=__version__,
                           public_url=cfg.public_url, token=cfg.token is not None,
                           root_skill=cfg.root_skill)  # fmt: skip
        self.port = cfg.port
        """The port listened on (the actual one once started, also when asked for 0)."""
        self._sock: socket.socket | None = None
        self._server: Any = None
        self._ticks: asyncio.Task[None] | None = None

    @property
    def url(self) -> str:
        host = self.cfg.host
        return f"http://{f'[{host}]' if ':' in host else host}:{self.port}"

    async def start(self) -> None:
        """Listen and serve (raises OSError when the address is taken or not ours)."""
        if self._server is not None:
            return
        import uvicorn

        sock = bind(self.cfg.host, self.cfg.port)
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(
            build_app(self.views, self.handler, self.cfg.token, self.cfg.host,
                      self.cfg.root_skill), log_config=None,
            log_level="warning", access_log=False, lifespan="off", server_header=False,
            timeout_graceful_shutdown=SHUTDOWN_GRACE_S,
        )  # fmt: skip
        config.load()
        server = uvicorn.Server(config)
        server.lifespan = config.lifespan_class(config)
        await self.client.start()
        try:
            await self.tasks.open(self.replicas)
            await server.startup(sockets=[sock])
        except BaseException:
            sock.close()
            await self.client.stop()
            raise
        self._sock, self._server = sock, server
        self._ticks = asyncio.create_task(server.main_loop(), name="reach-a2a-ticks")
        log.info("a2a.started url=%s token=%s", self.url, self.cfg.token is not None)

    async def stop(self) -> None:
        """Stop listening, let open requests finish (up to a grace), stop the client."""
        server, self._server = self._server, None
        if server is None:
            return
        server.should_exit = True
        if self._ticks is not None:
            await asyncio.gather(self._ticks, return_exceptions=True)
        await server.shutdown(sockets=[self._sock] if self._sock else None)
        await self.client.stop()
        log.info("a2a.stopped")

    async def __aenter__(self) -> A2AGateway:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()
