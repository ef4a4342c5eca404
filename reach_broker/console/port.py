"""The broker's HTTP port as the process runs it: listening before the broker starts (so a
taken port fails the start at once, with ``/metrics`` served from the first moment), the
console attached once the broker runs, and stopped before the broker."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from reach_broker.config import Config
from reach_broker.core.explain import Explainer
from reach_broker.core.registry import Registry
from reach_broker.health import Readiness
from reach_broker.service.context import BrokerContext

from .app import Access, App
from .feed import Feed
from .httpd import HttpServer


class HttpPort:
    """``/metrics`` of ``registry`` on ``broker.metrics_host:metrics_port``, ``/healthz`` and
    ``/readyz`` (``not_ready``: the broker's), and the console."""

    def __init__(self, cfg: Config, registry: Any, not_ready: Readiness) -> None:
        b, c = cfg.broker, cfg.console
        self.cfg = cfg
        self.access = Access(b.metrics_host, c.token, c.enabled)
        self.app = App(registry, self.access, not_ready)
        self.server = HttpServer(b.metrics_host, b.metrics_port, self.app)
        self.feed: Feed | None = None

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

    async def attach(
        self,
        ctx: BrokerContext,
        registry: Registry,
        explainer: Explainer,
        route_counts: Mapping[str, int] | None = None,
    ) -> None:
        """The console's data, from a running broker's parts (``route_counts``: its
        handlers' route requests per capability, for the charts)."""
        if not self.access.enabled or self.feed is not None:
            return
        feed = Feed(ctx, registry, explainer, route_counts)
        await feed.start()
        self.feed = self.app.feed = feed

    async def stop(self) -> None:
        """Streams end, then the port closes, then the feed stops."""
        await self.server.stop()
        if self.feed is not None:
            await self.feed.stop()
            self.feed = self.app.feed = None
