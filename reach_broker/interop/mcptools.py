"""``reach mcp``: an MCP server whose tools let an LLM ask "which agents can do X right now?"
and call one, with reach's routing, receipts, retries and failover underneath.

Three tools over one :class:`reach_agent.Client` (the optional extra ``mcp``):

* ``list_capabilities`` — every capability the fleet has, with how many agents hold it and
  how many are healthy now (the fleet paged through ``<prefix>.agents.<partition>``);
* ``find_agents(capability, limit, region?, tags?)`` — the agents reach would route to now,
  best first, and every other agent with the capability with its live state, score, load
  and why it is left out: one explained route request (``RouteRequest.explain``, the
  broker's own decision and reasons) and the capability's agents paged through
  ``<prefix>.agents.<partition>`` (the last heartbeats);
* ``call_agent(capability, payload, timeout_s?)`` — one task, routed and retried by reach;
  the agent's result, or a tool error ``CODE: message`` saying why not.

:class:`Tools` is the logic (plain async methods returning JSON-ready dicts, no SDK);
:func:`reach_broker.interop.mcpserver.build_server` registers them with the SDK's ``MCPServer``
under descriptions written for the model that reads them.
"""

from __future__ import annotations

from typing import Any

import msgspec

from reach_agent.client.client import Client
from reach_agent.client.listing import agent_pages
from reach_agent.routing.reasons import EXCLUSIONS
from reach_agent.wire import schema
from reach_agent.wire.errors import InvalidRequest, NoReachableAgent, ReachError, from_reply

INSTRUCTIONS = """\
reach makes a fleet of AI agents reachable by capability (a name such as "summarize" or
"intent.recognition"). Use list_capabilities to see what the fleet can do, find_agents to
see which agents can do one thing right now (and why the others cannot), and call_agent to
have it done: reach picks the best reachable agent, retries elsewhere if one is busy or
dies, and returns that agent's result. You never address an agent yourself."""


PAGE = 1000
"""Agents asked per page of the fleet."""


class Tools:
    """The tools' logic over a started reach client."""

    def __init__(self, client: Client, *, call_timeout_s: float, request_timeout_s: float) -> None:
        self.client = client
        self.call_timeout_s = call_timeout_s
        self.request_timeout_s = request_timeout_s

    async def views(self, capability: str | None = None) -> list[schema.AgentView]:
        """The whole fleet (``<prefix>.agents.<partition>`` paged, each partition from its
        owner), filtered by capability."""
        subjects = self.client.subjects
        views: list[schema.AgentView] = []
        pages = agent_pages(self.client.nc, subjects, capability=capability, limit=PAGE,
                            timeout_s=self.request_timeout_s)  # fmt: skip
        try:
            async for page in pages:
                views += page.agents
        except ReachError:
            raise
        except Exception as exc:  # noqa: BLE001 - no responders, timeout: one tool error
            raise NoReachableAgent(f"no broker answered {subjects.prefix}.agents.<partition> "
                                   f"({type(exc).__name__})") from None  # fmt: skip
        views.sort(key=lambda v: v.agent_id)  # as the one-reply list was
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

    async def explained_route(
        self, capability: str, req: schema.RouteRequest
    ) -> tuple[list[schema.Candidate], schema.RouteExplain | None, str | None]:
        """One explained route request: the candidates, the explanation, and the reason
        when none can take it (its body still carries the explanation)."""
        subject = self.client.subjects.route(capability)
        try:
            msg = await self.client.nc.request(subject, schema.encoder.encode(req),
                                               timeout=self.request_timeout_s)  # fmt: skip
        except Exception as exc:  # noqa: BLE001 - no responders, timeout: one tool error
            raise NoReachableAgent(f"no broker answered {subject} "
                                   f"({type(exc).__name__})") from None  # fmt: skip
        err = from_reply(msg.headers, msg.data)
        if err is None:
            reply = schema.route_reply_decoder.decode(msg.data)
            return reply.candidates, reply.explain, None
        if not isinstance(err, NoReachableAgent):
            raise err
        try:
            explain = msgspec.convert(msgspec.json.decode(msg.data).get("explain"),
                                      schema.RouteExplain | None)  # fmt: skip
        except (msgspec.MsgspecError, AttributeError):
            explain = None
        return [], explain, err.message

    async def find_agents(
        self,
        capability: str,
        limit: int = 3,
        region: str | None = None,
        tags: dict[str, str] | None = None,
    ) -> dict[str, Any]:
        schema.check_capability(capability)
        if not 1 <= limit <= 100:
            raise InvalidRequest(f"limit {limit} is not within 1..100")
        req = schema.RouteRequest(limit=limit, region=region, tags=tags or {}, explain=True)
        views = await self.views(capability)
        candidates, explain, reason = await self.explained_route(capability, req)
        by_id = {v.agent_id: v for v in views}
        excluded = explain.excluded if explain is not None else []
        out: dict[str, Any] = {
            "capability": capability,
            "candidates": [
                {"agent_id": c.agent_id, "rank": i + 1,
                 **_figures(by_id.get(c.agent_id), c.state, c.score, c.load),
                 **_terms(c.explain), "region": c.region, "version": c.version}
                for i, c in enumerate(candidates)
            ],
            "others": [
                {"agent_id": x.agent_id, **_figures(by_id.get(x.agent_id), x.state, x.score,
                                                    x.load),
                 "reason": x.reason, "why": x.detail}
                for x in excluded
            ],
        }  # fmt: skip
        if explain is not None and explain.counts:
            out["left_out"] = explain.counts
            out["reasons"] = {code: EXCLUSIONS[code] for code in explain.counts
                              if code in EXCLUSIONS}  # fmt: skip
        if reason is not None:
            out["reason"] = reason
        return out

    async def call_agent(
        self, capability: str, payload: Any, timeout_s: float | None = None
    ) -> dict[str, Any]:
        if timeout_s is not None and timeout_s <= 0:
            raise InvalidRequest(f"timeout_s {timeout_s} must be above 0")
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


def _terms(explain: schema.AgentExplain | None) -> dict[str, Any]:
    """What a candidate's score is made of: its terms and the one that pulls it down."""
    if explain is None:
        return {}
    out: dict[str, Any] = {"score_terms": msgspec.structs.asdict(explain.terms),
                           "weakest": explain.weakest}  # fmt: skip
    if explain.kept is not None:
        out["kept"] = explain.kept
    return out
