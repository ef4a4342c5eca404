"""The broker's HTTP port as the process runs it: listening before the broker starts (so a
taken port fails the start at once, with ``/metrics`` served from the first moment), the
console's pages served once the broker runs its feed, and stopped before the broker."""

from __future__ import annotations

from typing import Any

from reach_broker.config import Config

from .app import Access, App
from .feed import Feed
from .health import Readiness
from .httpd import HttpServer


def access_of(cfg: Config) -> Access:
    """Who may see the console on the port ``cfg`` describes (off: see :attr:`Access.why_off`)."""
    return Access(cfg.broker.metrics_host, cfg.console.token, cfg.console.enabled)


class HttpPort:
    """``/metrics`` of ``registry`` on ``broker.metrics_host:metrics_port``, ``/healthz`` and
    ``/readyz`` (``not_ready``: the broker's), and the console over ``feed`` (the broker's,
    which it starts and stops)."""

    def __init__(
        self, cfg: Config, registry: Any, not_ready: Readiness, feed: Feed | None = None
    ) -> None:
        b = cfg.broker
        self.cfg = cfg
        self.access = access_of(cfg)
        self.feed = feed
        self.app = App(registry, self.access, not_ready, feed)
        self.server = HttpServer(b.metrics_host, b.metrics_port, self.app)

    @property
    def base_url(self) -> str:
        host = self.server.host
        return f"http://{f'[{host}]' if ':' in host else host}:{self.server.port}"

    def describe(self) -> str:
        """The start line's words for this port: where the console and the metrics are."""
        metrics = f"metrics on {self.base_url}/metrics"
        if not self.access.enabled:
            return f"{metrics} (console off: {self.access.why_off.split(': ', 1)[-1]})"
        token = " (token required)" if self.access.token else ""
        return f"console on {self.base_url}/{token}, {metrics}"

    async def start(self) -> None:
        await self.server.start()

    async def stop(self) -> None:
        """The open pages' streams end and the port closes (the broker stops the feed)."""
        await self.server.stop()
