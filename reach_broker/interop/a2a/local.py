"""The gateway's routes: its :class:`reach_agent.Client` is handed routes that ask the broker's
own router in process instead of sending ``<prefix>.route.<capability>`` requests.

The gateway runs inside the broker, so the routing decision is at hand: no round trip, no
route cache to keep fresh, and no right to publish route requests needed for the broker's
credential. A call made for one agent's card (``POST /agents/<id>/a2a``) is *pinned*: while
:data:`PINNED` names an agent, a route is that agent alone, or ``NO_REACHABLE_AGENT`` saying
why not (the client still retries it on ``TARGET_BUSY`` after its backoff).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextvars import ContextVar

from reach_agent.wire.errors import NoReachableAgent
from reach_agent.wire.schema import NO_FILTERS, Candidate, Filters, check_capability, check_tags
from reach_agent.wire.schema import route_request as make_request
from reach_broker.core.registry import Registry
from reach_broker.core.routing import Router

PINNED: ContextVar[str | None] = ContextVar("reach_a2a_pinned", default=None)
"""The agent the current call must go to (set around one call, or one stream's first chunk)."""


class LocalRoutes:
    """The gateway client's routes (a ``RouteSource``, handed to its ``Client``): the
    broker's :class:`Router` answers, in process."""

    def __init__(
        self,
        registry: Registry,
        router: Router,
        clock: Callable[[], float],
        task_subject: Callable[[str, str], str],
        route_limit: int,
    ) -> None:
        self.registry = registry
        self.router = router
        self.clock = clock
        self.task_subject = task_subject
        """The task subject of (agent_id, capability)."""
        self.route_limit = route_limit

    async def start(self) -> None:
        """Nothing to start: every route is asked of the router."""

    async def stop(self) -> None:
        """Nothing to stop."""

    def agent_gone(self, agent_id: str) -> None:
        """Nothing kept: the router knows before the event is out."""

    def sent(self, agent_id: str, attempt: object) -> None:
        """Counted already: :meth:`route` hands the pick its task, as a route reply does."""

    def ended(self, attempt: object, busy: bool) -> None:
        """The agent's next heartbeat says."""

    async def route(
        self, capability: str, filters: Filters = NO_FILTERS, *, limit: int | None = None,
        exclude: Sequence[str] = (), peek: bool = False, deadline: float | None = None,
        headers: dict[str, str] | None = None,
    ) -> list[Candidate]:  # fmt: skip
        """The broker's router, in process (``headers``, a call's trace, have no use here)."""
        check_capability(capability)
        pinned = PINNED.get()
        if pinned is not None:
            return [self._pinned(pinned, capability)]
        if filters.tags:
            check_tags(filters.tags)
        req = make_request(filters, limit or self.route_limit, list(exclude), peek=peek)
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
        return rec.candidate(self.task_subject(agent_id, capability))
