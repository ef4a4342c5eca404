"""The client's routes: route requests to a broker, and the cache that answers when none does.

A client asks its routes (:class:`RouteSource`: handed in at construction, by default
:class:`Routes`) for the candidates of each attempt round, with the call's filters as one
:class:`~reach_agent.wire.schema.Filters`. :class:`RouteCache` is pure, with the clock
injected: the last broker answer per (capability, filters), refreshed in the background
while it is used (:meth:`~RouteCache.stale`), losing an agent as soon as an event reports
it unhealthy (:meth:`~RouteCache.drop_agent`), and answered in weighted-random order by
score so that callers falling back at the same moment do not herd onto one agent.
:class:`Routes` asks the broker and keeps the cache.
"""

from __future__ import annotations

import asyncio
import random
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from typing import Protocol

from nats.aio.client import Client as NATS
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError

from reach_agent import trace
from reach_agent.metrics import ClientMetrics
from reach_agent.wire import schema
from reach_agent.wire.errors import NoReachableAgent, Overloaded, ReachError, from_reply
from reach_agent.wire.schema import NO_FILTERS, Candidate, Filters
from reach_agent.wire.subjects import Subjects

from .config import ClientConfig

log = trace.logger(__name__)

RouteKey = tuple[object, ...]
"""(capability, then the value of every filter but the sticky key, which only orders: a dict
as its sorted items, a list as a tuple)"""

KEYED = tuple(name for name in Filters.__struct_fields__ if name != "sticky_key")
"""The filters a cached route is kept by (all of :class:`~reach_agent.wire.schema.Filters`'
fields, so a new filter is in the key without an edit here)."""


NO_BROKER_FIRST_S = 0.1
"""A call's first wait for a broker when none answered its route request and nothing is
cached (jittered ±50 %), doubled after each, up to :data:`NO_BROKER_MAX_S`."""
NO_BROKER_MAX_S = 1.0


class NoBrokerAnswered(NoReachableAgent):
    """No broker answered a route request and no cached route is left: the control plane
    is away (a broker restarting, a link cut), which a call waits out within its deadline."""


class RouteSource(Protocol):
    """Where a client's routes come from: a broker (:class:`Routes`), or, for a gateway
    inside the broker, its router in process."""

    async def route(
        self, capability: str, filters: Filters = NO_FILTERS, *, limit: int | None = None,
        exclude: Sequence[str] = (), peek: bool = False, deadline: float | None = None,
        headers: dict[str, str] | None = None,
    ) -> list[Candidate]:  # fmt: skip
        """Candidates for ``capability`` under ``filters``, best first, none of ``exclude``;
        ``peek``: a look, no task follows; ``deadline``: the call's (a wait for a full
        fleet ends there); ``headers``: the call's trace, for a route request."""
        ...

    def agent_gone(self, agent_id: str) -> None:
        """An event reported ``agent_id`` unhealthy or gone."""
        ...

    def sent(self, agent_id: str, attempt: object) -> None:
        """``attempt`` (any key, unique while it runs) is being sent to ``agent_id``."""
        ...

    def ended(self, attempt: object, busy: bool) -> None:
        """``attempt`` ended; ``busy``: its agent answered ``TARGET_BUSY``."""
        ...

    async def start(self) -> None: ...
    async def stop(self) -> None: ...


REFRESH_BATCH = 64
"""Most routes refreshed per round."""
IDLE_FACTOR = 30
"""A route unused for this many refresh periods is no longer refreshed."""


class Route:
    """One cached answer, and the filters it answered (asked again when it grows stale)."""

    __slots__ = ("candidates", "fetched_at", "filters", "limit", "used_at")

    def __init__(
        self, filters: Filters, candidates: list[Candidate], limit: int, now: float
    ) -> None:
        self.filters = filters
        self.candidates = candidates
        self.limit = limit
        self.fetched_at = now
        self.used_at = now


class RouteCache:
    """At most ``size`` routes, least recently stored dropped first."""

    def __init__(self, size: int, clock: Callable[[], float]) -> None:
        self.size = size
        self.clock = clock
        self._routes: OrderedDict[RouteKey, Route] = OrderedDict()

    @staticmethod
    def key(capability: str, filters: Filters) -> RouteKey:
        return (capability, *[_hashable(getattr(filters, name)) for name in KEYED])

    def routes(self) -> Iterator[Route]:
        return iter(self._routes.values())

    def store(
        self, key: RouteKey, filters: Filters, candidates: Sequence[Candidate], limit: int
    ) -> None:
        now = self.clock()
        entry = self._routes.get(key)
        if entry is None:
            own = Filters(**{name: getattr(filters, name) for name in Filters.__struct_fields__})
            self._routes[key] = Route(own, list(candidates), limit, now)
            while len(self._routes) > self.size:
                self._routes.popitem(last=False)
        else:
            entry.candidates, entry.limit, entry.fetched_at = list(candidates), limit, now
            self._routes.move_to_end(key)

    def forget(self, key: RouteKey) -> None:
        self._routes.pop(key, None)

    def fallback(
        self,
        key: RouteKey,
        limit: int,
        exclude: Sequence[str],
        rand: Callable[[], float] = random.random,
    ) -> list[Candidate]:
        """The cached candidates minus ``exclude``, at most ``limit``, in weighted-random
        order by score (Efraimidis-Spirakis keys); empty when nothing is left."""
        entry = self._routes.get(key)
        if entry is None:
            return []
        skip = set(exclude)
        pool = [c for c in entry.candidates if c.agent_id not in skip]
        if not pool:
            return []
        entry.used_at = self.clock()
        pool.sort(key=lambda c: rand() ** (1.0 / max(c.score, 1e-3)), reverse=True)
        return pool[:limit]

    def drop_agent(self, agent_id: str) -> None:
        """Forget ``agent_id`` in every route (an event reported it unhealthy or gone)."""
        for entry in self._routes.values():
            if any(c.agent_id == agent_id for c in entry.candidates):
                entry.candidates = [c for c in entry.candidates if c.agent_id != agent_id]

    def stale(self, refresh_s: float) -> list[tuple[RouteKey, Route]]:
        """Routes fetched ``refresh_s`` ago or more and used recently: to ask again."""
        now = self.clock()
        return [
            (key, e) for key, e in self._routes.items()
            if now - e.fetched_at >= refresh_s and now - e.used_at < IDLE_FACTOR * refresh_s
        ][:REFRESH_BATCH]  # fmt: skip


class Routes:
    """Route requests of one client (``<prefix>.route.<capability>``) and their cache, kept
    fresh in the background while it is used."""

    def __init__(
        self,
        nc: NATS,
        subjects: Subjects,
        config: ClientConfig,
        metrics: ClientMetrics | None,
        clock: Callable[[], float],
        caller: str = "",
    ) -> None:
        self.nc = nc
        self.subjects = subjects
        self.config = config
        self.metrics = metrics
        self.cache = RouteCache(config.route_cache_size, clock)
        self.running = False
        """Set while the client runs; the refresh loop ends when it is cleared."""
        self.caller = caller
        """This client's caller name (``Reach-Caller``: brokers keep quotas per caller)."""
        self.clock = clock
        self._refresher: asyncio.Task[None] | None = None

    async def start(self) -> None:
        if self.running:
            return
        self.running = True
        self._refresher = asyncio.create_task(self.refresh_loop(), name="reach-route-refresh")

    async def stop(self) -> None:
        self.running = False
        if self._refresher is not None:
            self._refresher.cancel()
            # Bounded: a cancel can be lost inside nc.request (3.11 wait_for race); the
            # loop also ends by itself once the client is stopped.
            await asyncio.wait({self._refresher}, timeout=2.0)
            self._refresher = None

    def agent_gone(self, agent_id: str) -> None:
        self.cache.drop_agent(agent_id)

    def sent(self, agent_id: str, attempt: object) -> None:
        """Nothing to count: the broker counted its pick as handed a task."""

    def ended(self, attempt: object, busy: bool) -> None:
        """Nothing counted."""

    async def route(
        self, capability: str, filters: Filters = NO_FILTERS, *, limit: int | None = None,
        exclude: Sequence[str] = (), peek: bool = False, deadline: float | None = None,
        headers: dict[str, str] | None = None,
    ) -> list[Candidate]:  # fmt: skip
        """:meth:`reach_agent.Client.route` (a ``peek``; ``Client.call``'s own routes are
        not peeks: the broker counts the first candidate as handed the task; ``headers``: a
        call's trace, when spans are on). An ``OVERLOADED`` answer carrying ``retry_after_ms``
        is waited out and asked again, up to ``max_retry_after_s`` in all and never past
        ``deadline`` (a call's)."""
        schema.check_capability(capability)
        if filters.tags:
            schema.check_tags(filters.tags)
        req = schema.route_request(filters, limit or self.config.route_limit, list(exclude),
                                   peek=peek)  # fmt: skip
        start = self.clock()
        budget = start + self.config.max_retry_after_s
        if deadline is not None:
            budget = min(budget, deadline)
        backoff, waits = NO_BROKER_FIRST_S, 0
        while True:
            try:
                return await self.ask(capability, req, headers)
            except NoBrokerAnswered as exc:
                # A call (it has a deadline) waits for a broker, backing off, as long as an
                # attempt still fits: 706 calls of nemesis seed 44 were refused within 2 s
                # while one broker's link was cut and the other's node stopped. A look
                # (Client.route) is answered at once.
                wait = backoff * (0.5 + random.random())
                if deadline is None or self.clock() + wait + self.config.ack_timeout_s > deadline:
                    if not waits:
                        raise
                    raise NoReachableAgent(f"{exc.message}; no broker answered in "
                                           f"{self.clock() - start:.1f}s") from None  # fmt: skip
                if self.metrics is not None:
                    self.metrics.route_broker_waits.inc()
                if not waits:
                    log.info("route.no_broker capability=%s: waiting for one within the call's "
                             "deadline", capability)  # fmt: skip
                waits += 1
                await asyncio.sleep(wait)
                backoff = min(backoff * 2, NO_BROKER_MAX_S)
            except Overloaded as exc:
                wait = (exc.retry_after_ms or 0) / 1000.0
                if not exc.retry_after_ms or self.clock() + wait > budget:
                    raise
                log.info("route.overloaded capability=%s retry_after_ms=%d", capability,
                         exc.retry_after_ms)  # fmt: skip
                await asyncio.sleep(wait)

    async def ask(
        self, capability: str, req: schema.RouteRequest, headers: dict[str, str] | None = None
    ) -> list[Candidate]:
        """One route request to a broker; when none answers, the cache's candidates."""
        key = RouteCache.key(capability, req)
        hdrs = {schema.H_CALLER: self.caller} if self.caller else None
        if headers:
            hdrs = {**(hdrs or {}), **headers}
        try:
            reply = await self.nc.request(
                self.subjects.route(capability),
                schema.encoder.encode(req),
                timeout=self.config.route_timeout_s,
                headers=hdrs,
            )
        except (NatsTimeoutError, NoRespondersError) as exc:
            why = "no broker responded" if isinstance(exc, NoRespondersError) else "timed out"
            pool = self.cache.fallback(key, req.limit, req.exclude)
            if not pool:
                raise NoBrokerAnswered(
                    f"route request for capability {capability!r} {why} and no cached route is left"
                ) from None
            if self.metrics is not None:
                self.metrics.route_fallbacks.inc()
            log.info("route.cache_fallback capability=%s reason=%s", capability, why)
            return pool
        err = from_reply(reply.headers, reply.data)
        if err is not None:
            if isinstance(err, NoReachableAgent) and not req.exclude:
                self.cache.forget(key)
            raise err
        candidates = schema.decode(schema.route_reply_decoder, reply.data, "route reply").candidates
        if not req.exclude:
            self.cache.store(key, req, candidates, req.limit)
        return candidates

    async def refresh_loop(self) -> None:
        """Re-ask the broker for cached routes older than ``route_refresh_s`` that were
        used recently, so the fallback stays fresh."""
        every = self.config.route_refresh_s
        while self.running:
            await asyncio.sleep(every / 2)
            for key, e in self.cache.stale(every):
                cap = str(key[0])
                try:
                    await self.route(cap, e.filters, limit=e.limit, peek=True)
                except ReachError:
                    pass  # no broker or no agent: route() already updated or kept the cache
                except Exception:  # the loop never dies
                    log.exception("route.refresh_failed capability=%s", cap)


def _hashable(value: object) -> object:
    """A filter's value as part of a key: a dict as its sorted items, a list as a tuple."""
    if isinstance(value, dict):
        return tuple(sorted(value.items()))
    if isinstance(value, list):
        return tuple(value)
    return value
