"""The gateway's HTTP surface: a Starlette app of the cards and the JSON-RPC endpoints.

========================================================  =====================================
``GET /agents[?capability=C][&state=S]``                  every registered agent's card
``GET /agents/<agent_id>/.well-known/agent-card.json``    one agent's card (404 when unknown)
``GET /a2a/<capability>/.well-known/agent-card.json``     one capability's card
``GET /.well-known/agent-card.json``                      reach's own card (skills: reachable
                                                          now); with ``a2a.root_skill``, that
                                                          capability's card
``POST /a2a/<capability>``                                JSON-RPC: routed to the best agent
``POST /a2a``                                             JSON-RPC: the skill named in metadata
``POST /agents/<agent_id>/a2a``                           JSON-RPC: that agent only (pinned)
``POST /``                                                with ``a2a.root_skill``: JSON-RPC of
                                                          that capability
========================================================  =====================================

The JSON-RPC endpoints are the a2a-sdk's own dispatcher (A2A 1.0 methods such as
``SendMessage``, and 0.3's ``message/send`` beside them) over
:class:`~reach_broker.interop.a2a.handler.GatewayHandler`, behind :class:`Edge`, which
answers the requests the SDK's layer would answer with the wrong code; the path's
capability or agent id reaches the handler in the call context. With a token every request
needs ``Authorization: Bearer <token>`` (compared in constant time), else 401; a body over
8 MiB is refused with 413. Bound on loopback, a request must name a loopback ``Host`` (403:
a page elsewhere cannot reach the gateway by rebinding its DNS name); a POST must be
``Content-Type: application/json`` (415: a page elsewhere cannot send one without a CORS
preflight, which is never answered, so it cannot make the gateway run a task).
"""

from __future__ import annotations

import hmac
import json
from collections.abc import Callable
from typing import Any

from a2a.server.context import ServerCallContext
from a2a.server.routes.common import DefaultServerCallContextBuilder
from a2a.server.routes.jsonrpc_dispatcher import (  # (the 0.3 adapter from here: imported
    JSONRPC03Adapter,  # first on its own, the SDK's modules import each other in a circle)
    JsonRpcDispatcher,
)
from a2a.types import a2a_pb2 as pb
from pydantic import ValidationError
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
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
INVALID_PARAMS = -32602
MAX_BODY = 8 * 1024 * 1024
"""The largest request body taken (a task payload larger than NATS's ``max_payload`` of
configs/nats-server.conf could not be sent anyway); larger is answered 413."""


class PathContext(DefaultServerCallContextBuilder):
    """The call context of a JSON-RPC request, with its path's ``capability`` or
    ``agent_id`` in ``state`` (or a fixed one: the origin's ``a2a.root_skill``)."""

    def __init__(self, fixed: dict[str, str] | None = None) -> None:
        self.fixed = fixed or {}

    def build(self, request: Request) -> ServerCallContext:
        context = super().build(request)
        context.state.update(request.path_params or self.fixed)
        return context


TASK_STATES = frozenset(pb.TaskState.keys()) - {"TASK_STATE_UNSPECIFIED"}
STREAMING_METHODS = frozenset(("SendStreamingMessage", "SubscribeToTask", "message/stream",
                               "tasks/resubscribe"))  # fmt: skip
V03_METHODS: dict[str, Any] = dict(JSONRPC03Adapter.METHOD_TO_MODEL)
"""The 0.3 methods and their request models (pydantic), as the SDK's 0.3 layer reads them."""


def invalid_params(body: dict[str, Any]) -> str | None:
    """Why a JSON-RPC request's params are invalid where the a2a-sdk's layer says otherwise
    (None: let it answer). Its 1.0 parser reads an unknown enum value as unset, so a
    ``ListTasks`` ``status`` that names no state would list every task; its 0.3 layer
    answers any invalid params with ``-32600`` (invalid request) instead of ``-32602``."""
    if not well_formed(body):
        return None  # the SDK's own first check: -32600
    method, params = body.get("method"), body.get("params")
    if method == "ListTasks" and isinstance(params, dict) and "status" in params:
        status = params["status"]
        if not (status in TASK_STATES or (isinstance(status, int) and not isinstance(status, bool)
                and status in pb.TaskState.values() and status != 0)):  # fmt: skip
            return (f"params.status {status!r} is not a task state (one of "
                    f"{', '.join(sorted(TASK_STATES))})")  # fmt: skip
    model = V03_METHODS.get(method) if isinstance(method, str) else None
    if model is not None:
        try:
            model.model_validate(body)
        except ValidationError as exc:
            first, more = exc.errors()[0], exc.error_count() - 1
            where = ".".join(str(p) for p in first["loc"])
            return f"{where}: {first['msg']}" + (f" (and {more} more)" if more else "")
    return None


def well_formed(body: dict[str, Any]) -> bool:
    """A JSON-RPC 2.0 request object as far as the envelope goes (the SDK's own first
    check, whose failures are rightly ``-32600``)."""
    rid = body.get("id")
    return (
        body.get("jsonrpc") == "2.0"
        and isinstance(body.get("method"), str)
        and (rid is None or (isinstance(rid, str | int) and not isinstance(rid, bool)))
        and isinstance(body.get("params", {}), dict)
    )


class Edge:
    """One JSON-RPC endpoint: the a2a-sdk's dispatcher, with what its layer answers wrongly
    answered here: invalid params as ``-32602`` (:func:`invalid_params`), and an error of a
    streaming method as a stream (one ``event: error``) to a client that asks for
    ``text/event-stream``, where the SDK answers plain JSON."""

    def __init__(self, dispatcher: JsonRpcDispatcher) -> None:
        self.dispatcher = dispatcher

    async def handle(self, request: Request) -> Response:
        try:
            body = json.loads(await request.body())
        except ValueError:
            body = None  # the dispatcher answers a parse error
        if not isinstance(body, dict):
            return await self.dispatcher.handle_requests(request)
        method = body.get("method")
        why = invalid_params(body)
        response: Response
        if why is not None:
            error = {"code": INVALID_PARAMS, "message": why}
            response = JSONResponse({"jsonrpc": "2.0", "id": body.get("id"), "error": error})
        else:
            response = await self.dispatcher.handle_requests(request)
        if (isinstance(method, str) and method in STREAMING_METHODS
                and isinstance(response, JSONResponse)
                and "text/event-stream" in request.headers.get("accept", "")):  # fmt: skip
            return Response(b"event: error\r\ndata: " + bytes(response.body) + b"\r\n\r\n",
                            media_type="text/event-stream")  # fmt: skip
        return response


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
        root_skill: str | None = None,
    ) -> None:
        self.root_skill = root_skill
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
        """The origin's card: reach's own, or ``a2a.root_skill``'s (its endpoint ``/``)."""
        if self.root_skill is not None:
            return self._capability(request, self.root_skill, "/")
        card = cards.reach_card(self.registry, self.router, self.where(request), self.version,
                                self.clock(), self.wall_ms())  # fmt: skip
        return Response(cards.encoder.encode(card), media_type=JSON)

    async def capability(self, request: Request) -> Response:
        capability = request.path_params["capability"]
        try:
            check_capability(capability, "capability")
        except ReachError as err:
            return error_response(400, err)
        return self._capability(request, capability, f"/a2a/{capability}")

    def _capability(self, request: Request, capability: str, path: str) -> Response:
        card = cards.capability_card(self.registry, self.router, self.where(request), capability,
                                     path, self.version, self.clock(), self.wall_ms())  # fmt: skip
        return Response(cards.encoder.encode(card), media_type=JSON)


def build_app(
    views: Views, handler: GatewayHandler, token: str | None, listen: str,
    root_skill: str | None = None,
) -> Any:  # fmt: skip
    """The Starlette app for a gateway listening on ``listen``, behind its guards
    (:class:`BearerToken` when there is a token, :class:`BodyLimit`, :class:`SameMachine`)."""
    rpc_paths = [("/a2a", PathContext()), ("/a2a/{capability}", PathContext()),
                 ("/agents/{agent_id}/a2a", PathContext())]  # fmt: skip
    if root_skill is not None:
        rpc_paths.append(("/", PathContext({"capability": root_skill})))
    rpc = [
        Route(path, Edge(JsonRpcDispatcher(handler, context_builder=builder,
                                           enable_v0_3_compat=True)).handle, methods=["POST"])
        for path, builder in rpc_paths
    ]  # fmt: skip
    app: Any = Starlette(routes=[
        Route("/.well-known/agent-card.json", views.reach, methods=["GET"]),
        Route("/agents", views.agents, methods=["GET"]),
        Route("/agents/{agent_id}/.well-known/agent-card.json", views.agent, methods=["GET"]),
        Route("/a2a/{capability}/.well-known/agent-card.json", views.capability,
              methods=["GET"]),
        *rpc,
    ])  # fmt: skip
    app = BodyLimit(SameMachine(app, listen))
    return BearerToken(app, token) if token else app
