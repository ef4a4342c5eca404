"""What the broker's HTTP port answers: ``/metrics`` (Prometheus, as before), the probes
``/healthz`` and ``/readyz`` (:mod:`reach_broker.console.health`; like ``/metrics``, no
token) and the console —
the page (``/``, ``/static/…``, shipped in the package: no CDN, no network), its JSON
(``/api/…``) and its live stream (``/events``, server-sent events). Read-only: GET and HEAD.

Who may look (:class:`Access`): on a loopback address anyone on this machine, as with
``/metrics``, but only under a loopback ``Host`` (a web page elsewhere cannot reach it
through DNS rebinding); bound beyond loopback the console requires ``console.token``
(``--console-token``, ``REACH_CONSOLE_TOKEN``), compared in constant time, and without one
it is off there (``/metrics`` stays open). The token is given once as ``?token=…`` (it then
lives in an HttpOnly, SameSite=Strict cookie) or as ``Authorization: Bearer …``.
"""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import hmac
import ipaddress
import mimetypes
from importlib import resources
from typing import Any

import msgspec

from jetstream.tasks import raise_if_cancelled

from . import health
from .feed import Feed, Watcher
from .health import Readiness
from .httpd import Request, Response, Stream, text
from .owners import owners, page

_json = msgspec.json.Encoder()
COOKIE = "reach_console"
PING_S = 15.0
"""A comment line on an idle event stream this often, so proxies and the browser keep it."""

SECURITY = (
    ("Content-Security-Policy", "default-src 'self'; img-src 'self' data:; "
     "frame-ancestors 'none'; base-uri 'none'; form-action 'none'"),
    ("X-Content-Type-Options", "nosniff"),
    ("Referrer-Policy", "no-referrer"),
    ("X-Frame-Options", "DENY"),
)  # fmt: skip
NO_STORE = (("Cache-Control", "no-store"),)
JSON = "application/json"


def is_loopback(host: str) -> bool:
    """Whether ``host`` (the listen address) only accepts connections from this machine."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def host_name(header: str) -> str:
    """The name of a ``Host`` header, without port or brackets."""
    if header.startswith("["):
        return header[1:].partition("]")[0]
    name, sep, port = header.rpartition(":")
    return name if sep and port.isdigit() else header


class Access:
    """Whether a request may see the console."""

    def __init__(self, host: str, token: str | None, enabled: bool = True) -> None:
        self.loopback = is_loopback(host)
        self.token = token or None
        self.host = host
        self.enabled = enabled and (self.loopback or self.token is not None)
        """False: the console is off here (beyond loopback without a token, or disabled)."""

    @property
    def why_off(self) -> str:
        if self.loopback or self.token:
            return "the console is disabled (console.enabled = false)"
        return (f"the console is off on {self.host}: bound beyond loopback it needs a token "
                "(--console-token or REACH_CONSOLE_TOKEN)")  # fmt: skip

    def given(self, req: Request) -> str | None:
        """The token the request carries: ``?token=``, a Bearer header or the cookie."""
        if "token" in req.query:
            return req.query["token"]
        auth = req.headers.get("authorization", "")
        if auth.lower().startswith("bearer "):
            return auth[7:].strip()
        for part in req.headers.get("cookie", "").split(";"):
            name, _, value = part.strip().partition("=")
            if name == COOKIE:
                return value
        return None

    def refusal(self, req: Request) -> Response | None:
        """None when ``req`` may see the console, else the answer that says why not."""
        if not self.enabled:
            return text(403, self.why_off, SECURITY)
        if self.loopback and host_name(req.headers.get("host", "")) not in (
            "127.0.0.1", "localhost", "::1", self.host
        ):  # fmt: skip
            return text(403, "this console answers only under a loopback Host name", SECURITY)
        if self.token is None:
            return None
        given = self.given(req)
        if given is None or not hmac.compare_digest(given.encode(), self.token.encode()):
            return text(401, "the console needs its token: open /?token=… once, or send "
                             "Authorization: Bearer …", SECURITY)  # fmt: skip
        return None


def _static() -> dict[str, tuple[bytes, str]]:
    """The page's files, shipped in the package (reach_broker/console/static)."""
    out = {}
    for item in (resources.files(__package__) / "static").iterdir():
        if item.is_file():
            kind = mimetypes.guess_type(item.name)[0] or "application/octet-stream"
            if kind.startswith("text/") or kind in ("application/javascript", "image/svg+xml"):
                kind += "; charset=utf-8"
            out[item.name] = (item.read_bytes(), kind)
    return out


class EventStream:
    """``/events``: the feed's messages for one page, until it goes away or falls behind."""

    status: int = 200
    content_type: str = "text/event-stream; charset=utf-8"
    headers: tuple[tuple[str, str], ...] = (*SECURITY, *NO_STORE)

    def __init__(self, feed: Feed) -> None:
        self.feed = feed

    async def run(self, writer: asyncio.StreamWriter, closed: asyncio.Event) -> None:
        writer.write(b"retry: 1000\n\n")
        watcher = await self.feed.watch()  # once the audit follow has the recent events
        ended = asyncio.ensure_future(self._end_on(closed, watcher))
        try:
            while True:
                raise_if_cancelled()
                try:
                    message = await asyncio.wait_for(watcher.queue.get(), PING_S)
                except TimeoutError:
                    message = b": ping\n\n"
                if message is None:
                    return
                writer.write(message)
                await asyncio.wait_for(writer.drain(), PING_S)
        finally:
            ended.cancel()
            self.feed.unwatch(watcher)

    @staticmethod
    async def _end_on(closed: asyncio.Event, watcher: Watcher) -> None:
        await closed.wait()
        with contextlib.suppress(asyncio.QueueFull):
            watcher.queue.put_nowait(None)


class App:
    """The HTTP port's handler: metrics always, the console when :class:`Access` allows."""

    def __init__(
        self, registry: Any, access: Access, not_ready: Readiness, feed: Feed | None = None
    ) -> None:
        self.registry = registry
        """The Prometheus CollectorRegistry of /metrics."""
        self.access = access
        self.not_ready = not_ready
        """The broker's readiness, for /readyz (:mod:`reach_broker.console.health`)."""
        self.feed = feed
        """The console's data (none: 503, as until the broker runs it)."""
        self.files = _static()

    async def __call__(self, req: Request) -> Response | Stream:
        if req.path == "/metrics":
            return self.metrics(req)
        if req.path in health.PATHS:
            return health.response(req.path, self.not_ready)
        refused = self.access.refusal(req)
        if refused is not None:
            return refused
        if self.access.token and "token" in req.query and req.path in ("/", "/index.html"):
            # Keep the token in a cookie and out of the address bar (and its history).
            cookie = f"{COOKIE}={req.query['token']}; Path=/; HttpOnly; SameSite=Strict"
            return Response(303, b"", headers=(("Location", "/"), ("Set-Cookie", cookie),
                                               *SECURITY))  # fmt: skip
        if req.path in ("/", "/index.html"):
            return self.file("index.html")
        if req.path.startswith("/static/"):
            return self.file(req.path.removeprefix("/static/"))
        feed = self.feed
        if req.path.startswith("/api/") or req.path == "/events":
            if feed is None or not feed.running:
                return text(503, "the broker is starting", (*SECURITY, *NO_STORE))
            if req.path == "/api/agents":
                return await self.agents_page(feed, req)
            if req.path == "/api/owners":  # asked now: who owns each partition, its agents
                ctx = feed.ctx
                return self.json(_json.encode(await owners(ctx.nc, ctx.subjects, ctx.wall_ms())))
            return await self.api(feed, req)
        return text(404, f"no such page: {req.path}", SECURITY)

    def file(self, name: str) -> Response:
        found = self.files.get(name)
        if found is None:
            return text(404, f"no such file: {name}", SECURITY)
        body, kind = found
        return Response(200, body, kind, (*SECURITY, ("Cache-Control", "no-cache")))

    async def api(self, feed: Feed, req: Request) -> Response | Stream:
        """The feed's data; the timeline and an agent's transitions are the audit trail's
        events, read while a request needs them (:meth:`Feed.needing_events`), and the
        charts' latencies the ack records, likewise (:meth:`Feed.needing_charts`)."""
        path = req.path
        if path == "/events":
            return EventStream(feed)
        if path == "/api/fleet":
            return self.json(feed.fleet_json())
        if path == "/api/events":
            async with feed.needing_events():
                return self.json(feed.events_json(feed.cfg.events))
        if path == "/api/charts":  # a capability may be known from its ack records alone
            async with feed.needing_charts():
                return self.json(_json.encode(feed.capabilities.index(feed.ctx.wall_ms())))
        if path.startswith("/api/charts/"):
            cap = path.removeprefix("/api/charts/")
            async with feed.needing_charts():
                chart = feed.capabilities.chart(cap, feed.ctx.wall_ms())
            if chart is None:
                return text(404, f"no chart of capability {cap!r}", SECURITY)
            return self.json(_json.encode(chart))
        if path.startswith("/api/agents/"):
            async with feed.needing_events():
                body = feed.agent_json(path.removeprefix("/api/agents/"))
            if body is None:
                return text(404, f"no agent {path.removeprefix('/api/agents/')!r}", SECURITY)
            return self.json(body)
        return text(404, f"no such page: {path}", SECURITY)

    async def agents_page(self, feed: Feed, req: Request) -> Response:
        """``/api/agents?cursor=C&limit=N``: one page of the whole fleet, from the owner of
        the cursor's partition (``<p>.agents.<partition>``; no cursor: the first page)."""
        raw = req.query.get("limit", "100")
        if not raw.isdigit() or not 1 <= int(raw) <= 5000:
            return text(400, f"limit {raw[:20]!r} is not a number from 1 to 5000", SECURITY)
        ctx = feed.ctx
        return self.json(await page(ctx.nc, ctx.subjects, req.query.get("cursor"), int(raw)))

    @staticmethod
    def json(body: bytes) -> Response:
        return Response(200, body, JSON, (*SECURITY, *NO_STORE))

    def metrics(self, req: Request) -> Response:
        """What prometheus_client's own server answers: the format the scraper accepts,
        gzipped when it says it takes gzip."""
        from prometheus_client.exposition import choose_encoder

        encoder, kind = choose_encoder(req.headers.get("accept", ""))
        body = encoder(self.registry)
        if "gzip" in req.headers.get("accept-encoding", ""):
            return Response(200, gzip.compress(body), kind, (("Content-Encoding", "gzip"),))
        return Response(200, body, kind)
