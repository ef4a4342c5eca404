"""The gateway's HTTP surface: a Starlette app of the cards and the JSON-RPC endpoints.

====================================================  =========================================
``GET /agents[?capability=C][&state=S]``              every registered agent's card
``GET /agents/<agent_id>/.well-known/agent-card.json``  one agent's card (404 when unknown)
``GET /.well-known/agent-card.json``                  reach's own card (skills: reachable now)
``POST /a2a/<capability>``                            JSON-RPC: routed to the best agent with it
``POST /a2a``                                         JSON-RPC: the skill named in metadata
``POST /agents/<agent_id>/a2a``                       JSON-RPC: that agent only (pinned)
====================================================  =========================================

The JSON-RPC endpoints are the a2a-sdk's own dispatcher (A2A 1.0 methods such as
``SendMessage``, and 0.3's ``message/send`` beside them) over
:class:`~reach_broker.interop.a2a.handler.GatewayHandler`; the path's capability or agent id reaches
the handler in the call context. With a token every request needs ``Authorization: Bearer
<token>`` (compared in constant time), else 401; a body over 8 MiB is refused with 413.
Bound on loopback, a request must name a loopback ``Host`` (403: a page elsewhere cannot
reach the gateway by rebinding its DNS name); a POST must be ``Content-Type:
application/json`` (415: a page elsewhere cannot send one without a CORS preflight, which is
never answered, so it cannot make the gateway run a task).
"""

from __future__ import annotations

import hmac
from collections.abc import Callable
from typing import Any

from a2a.server.context import ServerCallContext
from a2a.server.routes import create_jsonrpc_routes
from a2a.server.routes.common import DefaultServerCallContextBuilder
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from reach_agent.wire.errors import Forbidden, InvalidRequest, ReachError, to_reply
from reach_agent.wire.schema import AGENT_STATES, check_capability
from reach_broker.core.registry import Registry
from reach_broker.core.routing import Router

from . import cards
from .binding import is_loopback, loopback_host
from .handler import GatewayHandler

JSON = "application/json"
MAX_BODY = 8 * 1024 * 1024
"""The largest request body taken (a task payload larger than NATS's ``max_payload`` of
configs/nats-server.conf could not be sent anyway); larger is answered 413."""


class PathContext(DefaultServerCallContextBuilder):
    """The call context of a JSON-RPC request, with its path's ``capability`` or
    ``agent_id`` in ``state``."""

    def build(self, request: Request) -> ServerCallContext:
        context = super().build(request)
        context.state.update(request.path_params)
        return context


def error_response(status: int, err: ReachError) -> Response:
    """reach's error body (``{"error": {"code", "message"}}``) with an HTTP status."""
    _, body = to_reply(err)
    return Response(body, status, media_type=JSON)


class BearerToken:
    """ASGI middleware: every HTTP request must carry ``Authorization: Bearer <token>``."""

    def __init__(self, app: ASGIApp, token: str) -> None:
        self.app = app
        self.expected = f"Bearer {token}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            given = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
            if not hmac.compare_digest(given, self.expected):
                body = error_response(
                    401,
                    Forbidden(
                        "this gateway needs Authorization: Bearer <token> "
                        "(its --a2a-token, else the console's)"
                    ),
                )
                body.headers["WWW-Authenticate"] = 'Bearer realm="reach"'
                await body(scope, receive, send)
                return
        await self.app(scope, receive, send)  # fmt: skip


class BodyLimit:
    """ASGI middleware: a request body over ``limit`` bytes is answered 413 (by its
    Content-Length before reading, or once the bytes read pass it)."""

    def __init__(self, app: ASGIApp, limit: int = MAX_BODY) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = next((v for k, v in scope["headers"] if k == b"content-length"), b"0")
        too_large = error_response(413, InvalidRequest(
            f"request body larger than {self.limit} bytes"))  # fmt: skip
        if not length.isdigit() or int(length) > self.limit:
            await too_large(scope, receive, send)
            return
        seen = 0

        async def counted() -> Any:
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.limit:
                raise HTTPException(413, f"request body larger than {self.limit} bytes")
            return message

        await self.app(scope, counted, send)


class SameMachine:
    """ASGI middleware: on a loopback address, only a loopback ``Host``; every POST JSON."""

    def __init__(self, app: ASGIApp, listen: str) -> None:
        self.app = app
        self.listen = listen
        self.loopback = is_loopback(listen)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            headers = dict(scope["headers"])
            refused = None
            if self.loopback and not loopback_host(
                headers.get(b"host", b"").decode("latin-1"), self.listen
            ):
                refused = error_response(403, Forbidden(
                    "this gateway answers only under a loopback Host name"))  # fmt: skip
            elif scope["method"] == "POST":
                kind = headers.get(b"content-type", b"").partition(b";")[0].strip().lower()
                if kind != b"application/json":
                    refused = error_response(415, InvalidRequest(
                        "a JSON-RPC request needs Content-Type: application/json"))  # fmt: skip
            if refused is not None:
                await refused(scope, receive, send)
                return
        await self.app(scope, receive, send)


class Views:
    """The card endpoints, over the broker's registry and router."""

    def __init__(
        self,
        registry: Registry,
        router: Router,
        clock: Callable[[], float],
        wall_ms: Callable[[], int],
        *,
        version: str,
        public_url: str | None,
        token: bool,
    ) -> None:
        self.registry = registry
        self.router = router
        self.clock = clock
        self.wall_ms = wall_ms
        self.version = version
        self.public_url = public_url.rstrip("/") if public_url else None
        self.token = token

    def where(self, request: Request) -> cards.Where:
        base = self.public_url or str(request.base_url).rstrip("/")
        return cards.Where(base_url=base, token=self.token)

    async def agents(self, request: Request) -> Response:
        query = request.query_params
        capability, state = query.get("capability"), query.get("state")
        try:
            if capability is not None:
                check_capability(capability, "capability")
            if state is not None and state not in AGENT_STATES:
                raise InvalidRequest(f"state {state!r} is not one of {', '.join(AGENT_STATES)}")
        except ReachError as err:
            return error_response(400, err)
        body = cards.agent_cards(self.registry, self.where(request), self.wall_ms(),
                                 capability=capability, state=state)  # fmt: skip
        return Response(cards.encoder.encode(body), media_type=JSON)

    async def agent(self, request: Request) -> Response:
        agent_id = request.path_params["agent_id"]
        rec = self.registry.agents.get(agent_id)
        if rec is None:
            return error_response(404, InvalidRequest(f"agent {agent_id!r} is not registered"))
        card = cards.agent_card(rec, self.where(request), cards.iso_utc(self.wall_ms()))
        return Response(cards.encoder.encode(card), media_type=JSON)

    async def reach(self, request: Request) -> Response:
        card = cards.reach_card(self.registry, self.router, self.where(request), self.version,
                                self.clock(), self.wall_ms())  # fmt: skip
        return Response(cards.encoder.encode(card), media_type=JSON)


def build_app(views: Views, handler: GatewayHandler, token: str | None, listen: str) -> Any:
    """The Starlette app for a gateway listening on ``listen``, behind its guards
    (:class:`BearerToken` when there is a token, :class:`BodyLimit`, :class:`SameMachine`)."""
    rpc: list[Any] = []
    for path in ("/a2a", "/a2a/{capability}", "/agents/{agent_id}/a2a"):
        rpc += create_jsonrpc_routes(handler, path, context_builder=PathContext(),
                                     enable_v0_3_compat=True)  # fmt: skip
    app: Any = Starlette(routes=[
        Route("/.well-known/agent-card.json", views.reach, methods=["GET"]),
        Route("/agents", views.agents, methods=["GET"]),
        Route("/agents/{agent_id}/.well-known/agent-card.json", views.agent, methods=["GET"]),
        *rpc,
    ])  # fmt: skip
    app = BodyLimit(SameMachine(app, listen))
    return BearerToken(app, token) if token else app
