"""What orchestrators probe: ``/healthz`` and ``/readyz``, answered alike by the broker's HTTP
port, ``reach adapt http --health-port`` and ``reach mcp --http``.

``/healthz``: the process lives and its event loop turns (the answer comes from the loop
itself), ``200 {"status": "ok"}``; a liveness probe restarts the process when it fails.
``/readyz``: the process serves; each one says what that takes (the broker: connected to
NATS, its JetStream assets provisioned, its route rules loaded, its handlers subscribed) as a
:data:`Readiness`, a callable that returns None when ready, else the reason in words:
``200 {"ready": true}`` or ``503 {"ready": false, "reason": "..."}``. Neither needs the
console's token: they say nothing about the fleet. Both answer GET and HEAD, never cached.
"""

from __future__ import annotations

from collections.abc import Callable

import orjson

from .httpd import HttpServer, Request, Response, Stream, text

HEALTHZ = "/healthz"
READYZ = "/readyz"
PATHS = (HEALTHZ, READYZ)

Readiness = Callable[[], str | None]
"""None when the process serves, else why it does not (one line a person reads)."""

JSON = "application/json"
NO_STORE = (("Cache-Control", "no-store"),)


def answer(path: str, not_ready: Readiness) -> tuple[int, bytes]:
    """(status, JSON body) of ``/healthz`` or ``/readyz``."""
    if path == HEALTHZ:
        return 200, b'{"status":"ok"}'
    why = not_ready()
    if why is None:
        return 200, b'{"ready":true}'
    return 503, orjson.dumps({"ready": False, "reason": why})


def response(path: str, not_ready: Readiness) -> Response:
    """:func:`answer` as a response of :mod:`reach_broker.console.httpd`."""
    status, body = answer(path, not_ready)
    return Response(status, body, JSON, NO_STORE)


class ProbePort:
    """``/healthz`` and ``/readyz`` alone on ``host:port``: a sidecar's probe endpoints."""

    def __init__(self, host: str, port: int, not_ready: Readiness) -> None:
        self.not_ready = not_ready
        self.server = HttpServer(host, port, self._handle)

    @property
    def url(self) -> str:
        host = self.server.host
        return f"http://{f'[{host}]' if ':' in host else host}:{self.server.port}"

    async def _handle(self, req: Request) -> Response | Stream:
        if req.path in PATHS:
            return response(req.path, self.not_ready)
        return text(404, f"no such page: {req.path} (this port serves {HEALTHZ} and {READYZ})")

    async def start(self) -> None:
        """Listen (raises OSError when the address is taken or not ours)."""
        await self.server.start()

    async def stop(self) -> None:
        await self.server.stop()
