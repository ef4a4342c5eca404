"""The gateway's routes: its :class:`reach_agent.Client` asks the broker's own router in
process instead of sending ``<prefix>.route.<capability>`` requests.

The gateway runs inside the broker, so the routing decision is at hand: no round trip, no
route cache to keep fresh, and no right to publish route requests needed for the broker's
credential. A call made for one agent's card (``POST /agents/<id>/a2a``) is *pinned*: while
:data:`PINNED` names an agent, a route is that agent alone, or ``NO_REACHABLE_AGENT`` saying
why not (the client still retries it on ``TARGET_BUSY`` after its backoff).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextvars import ContextVar

from reach_agent.client.client import Client
from reach_agent.client.routes import Routes
from reach_agent.wire.errors import NoReachableAgent
from reach_agent.wire.schema import Candidate, RouteRequest, check_capability, check_tags
from reach_broker.core.index import candidate
from reach_broker.core.registry import Registry
from reach_broker.core.routing import Router

PINNED: ContextVar[str | None] = ContextVar("reach_a2a_pinned", default=None)
"""The agent the current call must go to (set around one call, or one stream's first chunk)."""


class LocalRoutes(Routes):
    """``client.routes`` of the gateway's client: the broker's :class:`Router` answers."""

    def __init__(
        self, client: Client, registry: Registry, router: Router, clock: Callable[[], float]
    ) -> None:
        super().__init__(client.nc, client.subjects, client.config, None, clock)
        self.registry = registry
        self.router = router
        self.clock = clock
        self._task = client.subjects.task

    async def route(
        self,
        capability: str,
        limit: int | None = None,
        *,
        region: str | None = None,
        tags: dict[str, str] | None = None,
        sticky_key: str | None = None,
        exclude: Sequence[str] | None = None,
        allow_suspect: bool = False,
        peek: bool = False,
        deadline: float | None = None,
        canary: str | None = None,
        requires: Sequence[str] | None = None,
        min_context_tokens: int | None = None,
        headers: dict[str, str] | None = None,
    ) -> list[Candidate]:
        """The broker's router, in process (``headers``, a call's trace, have no use here)."""
        check_capability(capability)
        pinned = PINNED.get()
        if pinned is not None:
            return [self._pinned(pinned, capability)]
        if tags:
            check_tags(tags)
        req = RouteRequest(limit=limit or self.config.route_limit, region=region,
                           tags=dict(tags or {}), sticky_key=sticky_key,
                           exclude=list(exclude or ()), allow_suspect=allow_suspect,
                           peek=peek, canary=canary, requires=list(requires or ()),
                           min_context_tokens=min_context_tokens)  # fmt: skip
        now = self.clock()
        got = self.router.route(capability, req, now)
        if not peek:  # the gateway's call follows: count its pick, as a route reply does
            rec = self.registry.agents.get(got[0].agent_id)
            if rec is not None:
                rec.handed_out(now)
        return got

    def _pinned(self, agent_id: str, capability: str) -> Candidate:
        rec = self.registry.agents.get(agent_id)
        if rec is None:
            raise NoReachableAgent(f"agent {agent_id!r} is not registered")
        if capability not in rec.capabilities:
            raise NoReachableAgent(f"agent {agent_id!r} has no capability {capability!r} "
                                   f"(it has {', '.join(rec.capabilities)})")  # fmt: skip
        if rec.state != "healthy":
            raise NoReachableAgent(f"agent {agent_id!r} is {rec.state}")
        return candidate(rec, self._task(agent_id, capability))

    async def refresh_loop(self) -> None:
        """Nothing to refresh: every route is asked of the router."""
