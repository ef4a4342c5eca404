"""The MCP server of ``reach mcp``: :class:`~reach_broker.interop.mcptools.Tools` registered with
the official SDK's ``MCPServer`` (the optional extra ``mcp``), each tool with a description
written for the model that reads it. A reach error becomes a tool error ``CODE: message``.
"""

from __future__ import annotations

from typing import Annotated, Any

from mcp.server import MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from pydantic import Field
from starlette.requests import Request
from starlette.responses import Response as StarletteResponse

from reach_agent.wire.errors import ReachError
from reach_broker.console import health
from reach_broker.console.health import Readiness

from .mcptools import INSTRUCTIONS, Tools


def build_server(tools: Tools, version: str, *, not_ready: Readiness | None = None) -> Any:
    """The ``MCPServer`` with the three tools (needs the extra ``mcp``); served over HTTP,
    also ``/healthz`` and ``/readyz`` (``not_ready``: :mod:`reach_broker.console.health`)."""
    server = MCPServer("reach", version=version, instructions=INSTRUCTIONS, log_level="WARNING")
    ready: Readiness = not_ready or (lambda: None)

    for path in health.PATHS:

        @server.custom_route(path, methods=["GET", "HEAD"], include_in_schema=False)
        async def probe(request: Request) -> StarletteResponse:
            status, body = health.answer(request.url.path, ready)
            return StarletteResponse(body, status, media_type=health.JSON,
                                     headers=dict(health.NO_STORE))  # fmt: skip

    async def guarded(coro: Any) -> dict[str, Any]:
        try:
            result: dict[str, Any] = await coro
            return result
        except ReachError as err:  # the model reads the code and the reason
            raise ToolError(f"{err.code}: {err.message}") from None

    @server.tool()
    async def list_capabilities() -> dict[str, Any]:
        """List every capability the agent fleet offers right now.

        Returns {"capabilities": [{"capability", "agents", "healthy"}], "agents": N}:
        for each capability, how many agents registered it and how many are healthy (only
        healthy agents get work). Start here to learn what can be done; then use
        find_agents for details on one capability, or call_agent to have it done."""
        return await guarded(tools.list_capabilities())

    @server.tool()
    async def find_agents(
        capability: Annotated[str, Field(description="the capability, e.g. 'summarize'")],
        limit: Annotated[int, Field(ge=1, le=100, description="how many candidates")] = 3,
        region: Annotated[str | None, Field(description="only agents in this region")] = None,
        tags: Annotated[
            dict[str, str] | None, Field(description="only agents with these tags")
        ] = None,
    ) -> dict[str, Any]:
        """Which agents can do `capability` right now, and why the others cannot.

        "candidates": the agents reach would send a call to now, in the order it would try
        them, each with its live state, score (0-100, higher is better), load (0-1, share
        of its slots in use), rank, and what its score is made of ("score_terms", each 0-1,
        and the "weakest" one). "others": every other agent with the capability with the
        same figures, a "reason" code and "why" in words (for example reason "state", why
        "offline for 3.2s"); "left_out" counts them by reason and "reasons" says what each
        code means. "reason" at the top appears when no agent can take it. You do not need
        this before call_agent, which routes by itself; use it to explain or to check
        availability."""
        return await guarded(tools.find_agents(capability, limit, region, tags))

    @server.tool()
    async def call_agent(
        capability: Annotated[str, Field(description="the capability to run")],
        payload: Annotated[
            Any,
            Field(
                description="the task's input: any JSON value, "
                'usually an object such as {"text": "..."}'
            ),
        ],
        timeout_s: Annotated[
            float | None, Field(gt=0, description="seconds to wait at most (default 30)")
        ] = None,
    ) -> dict[str, Any]:
        """Have one agent with `capability` do a task and return its result.

        reach picks the best reachable agent, waits for its receipt, retries on another
        agent when one is busy, draining or dies, and never runs the task twice. Returns
        {"capability", "result"} with the agent's own result. On failure the error text
        starts with a code: NO_REACHABLE_AGENT (nobody can do it now; the text says why),
        BIZ_REJECT (the agent refused this input), TIMEOUT, OVERLOADED, INVALID_*."""
        return await guarded(tools.call_agent(capability, payload, timeout_s))  # fmt: skip

    return server
