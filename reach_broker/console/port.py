"""The broker's HTTP port as the process runs it: listening before the broker starts (so a
taken port fails the start at once, with ``/metrics`` served from the first moment), the
console's pages served once the broker runs its feed, and stopped before the broker."""

from __future__ import annotations

from typing import Any

from reach_broker.config import ConsoleSection

from .app import Access, App
from .feed import Feed
from .health import Readiness
from .httpd import HttpServer


def access_of(host: str, console: ConsoleSection) -> Access:
    """Who may see the console on a port bound to ``host`` (``broker.metrics_host``) with the
    ``[console]`` section ``console`` (off: see :attr:`Access.why_off`)."""
    return Access(host, console.token, console.enabled)


class HttpPort:
    """``/metrics`` of ``registry`` on ``access.host:port`` (``broker.metrics_host`` and
    ``metrics_port``), ``/healthz`` and ``/readyz`` (``not_ready``: the broker's), and the
    console over ``feed`` (the broker's, which it starts and stops) to those ``access`` lets
    in."""

    def __init__(
        self, access: Access, port: int, registry: Any, not_ready: Readiness,
        feed: Feed | None = None,
    ) -> None:  # fmt: skip
        self.access = access
        self.feed = feed
        self.app = App(registry, access, not_ready, feed)
        self.server = HttpServer(access.host, port, self.app)

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
