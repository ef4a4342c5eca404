"""``reach mcp``: an MCP server whose tools let an LLM ask "which agents can do X right now?"
and call one, with reach's routing, receipts, retries and failover underneath.

Three tools over one :class:`reach_agent.Client` (the optional extra ``mcp``):

* ``list_capabilities`` — every capability the fleet has, with how many agents hold it and
  how many are healthy now (one ``<prefix>.agents`` request);
* ``find_agents(capability, limit, region?, tags?)`` — the agents reach would route to now,
  best first (a route request: the broker's own choice), and every other agent with the
  capability with its live state, score, load and why it is left out;
* ``call_agent(capability, payload, timeout_s?)`` — one task, routed and retried by reach;
  the agent's result, or a tool error ``CODE: message`` saying why not.

:class:`Tools` is the logic (plain async methods returning JSON-ready dicts, no SDK);
:func:`reach_broker.mcpserver.build_server` registers them with the SDK's ``MCPServer``
under descriptions written for the model that reads them.
"""

from __future__ import annotations

from typing import Any

from reach_agent import schema
from reach_agent.client import Client
from reach_agent.errors import NoReachableAgent, from_reply

INSTRUCTIONS = """\
reach makes a fleet of AI agents reachable by capability (a name such as "summarize" or
"intent.recognition"). Use list_capabilities to see what the fleet can do, find_agents to
see which agents can do one thing right now (and why the others cannot), and call_agent to
have it done: reach picks the best reachable agent, retries elsewhere if one is busy or
dies, and returns that agent's result. You never address an agent yourself."""


class Tools:
    """The tools' logic over a started reach client."""

    def __init__(self, client: Client, *, call_timeout_s: float, request_timeout_s: float) -> None:
        self.client = client
        self.call_timeout_s = call_timeout_s
        self.request_timeout_s = request_timeout_s

    async def views(self, capability: str | None = None) -> list[schema.AgentView]:
        """``<prefix>.agents`` (one broker's view of the fleet), filtered by capability."""
        body = schema.AgentsRequest(capability=capability)
        nc = self.client.nc
        try:
            msg = await nc.request(self.client.subjects.agents, schema.encoder.encode(body),
                                   timeout=self.request_timeout_s)  # fmt: skip
        except Exception as exc:  # noqa: BLE001 - no responders, timeout: one tool error
            raise NoReachableAgent(f"no broker answered {self.client.subjects.agents} "
                                   f"({type(exc).__name__})") from None  # fmt: skip
        err = from_reply(msg.headers, msg.data)
        if err is not None:
            raise err
        views: list[schema.AgentView] = schema.agent_views_decoder.decode(msg.data)
        return views

    async def list_capabilities(self) -> dict[str, Any]:
        caps: dict[str, dict[str, Any]] = {}
        views = await self.views()
        for view in views:
            for cap in view.capabilities:
                entry = caps.setdefault(cap, {"capability": cap, "agents": 0, "healthy": 0})
                entry["agents"] += 1
                entry["healthy"] += view.state == "healthy"
        return {"capabilities": [caps[c] for c in sorted(caps)], "agents": len(views)}

    async def find_agents(
        self,
        capability: str,
        limit: int = 3,
        region: str | None = None,
        tags: dict[str, str] | None = None,
    ) -> dict[str, Any]:
        schema.check_capability(capability)
        if not 1 <= limit <= 100:
            raise schema.InvalidRequest(f"limit {limit} is not within 1..100")
        views = await self.views(capability)
        try:
            candidates = await self.client.route(capability, limit, region=region, tags=tags)
            reason = None
        except NoReachableAgent as exc:
            candidates, reason = [], exc.message
        chosen = {c.agent_id: i for i, c in enumerate(candidates)}
        by_id = {v.agent_id: v for v in views}
        out: dict[str, Any] = {
            "capability": capability,
            "candidates": [
                {**_figures(by_id.get(c.agent_id), c.state, c.score, c.load),
                 "agent_id": c.agent_id, "rank": i + 1, "region": c.region,
                 "version": c.version}
                for i, c in enumerate(candidates)
            ],
            "others": [
                {"agent_id": v.agent_id, **_figures(v, v.state, v.score, v.load),
                 "why": _why(v, region, tags, len(candidates))}
                for v in views if v.agent_id not in chosen
            ],
        }  # fmt: skip
        if reason is not None:
            out["reason"] = reason
        return out

    async def call_agent(
        self, capability: str, payload: Any, timeout_s: float | None = None
    ) -> dict[str, Any]:
        if timeout_s is not None and timeout_s <= 0:
            raise schema.InvalidRequest(f"timeout_s {timeout_s} must be above 0")
        timeout = timeout_s or self.call_timeout_s
        result = await self.client.call(capability, payload, timeout=timeout)
        return {"capability": capability, "result": result}


def _figures(
    view: schema.AgentView | None, state: str, score: float, load: float
) -> dict[str, Any]:
    out: dict[str, Any] = {"state": state, "score": score, "load": load}
    if view is not None:
        out.update(active=view.active, max_concurrency=view.max_concurrency,
                   success_rate=view.success_rate, last_seen_ms=view.last_seen_ms)  # fmt: skip
    return out


def _why(view: schema.AgentView, region: str | None, tags: dict[str, str] | None, n: int) -> str:
    """Why an agent with the capability is not a candidate, from what the broker shows."""
    if view.state != "healthy":
        return f"it is {view.state}: reach routes only to healthy agents"
    if region is not None and view.region != region:
        return f"its region is {view.region!r}, not the {region!r} asked for"
    filtered = " or it lacks a tag asked for" if tags else ""
    return (
        f"healthy but not among the {n} candidates: it ranked lower (score, free capacity), "
        f"is at or above the load watermark or below the minimum score{filtered}"
    )
