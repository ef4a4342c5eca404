"""The client's routes: route requests to a broker, and the cache that answers when none does.

:class:`RouteCache` is pure, with the clock injected: the last broker answer per
(capability, filters), refreshed in the background while it is used (:meth:`~RouteCache.stale`),
losing an agent as soon as an event reports it unhealthy (:meth:`~RouteCache.drop_agent`),
and answered in weighted-random order by score so that callers falling back at the same
moment do not herd onto one agent. :class:`Routes` asks the broker and keeps the cache.
"""

from __future__ import annotations

import asyncio
import random
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence

from nats.aio.client import Client as NATS
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError

from reach_agent import trace
from reach_agent.metrics import ClientMetrics
from reach_agent.wire import schema
from reach_agent.wire.errors import NoReachableAgent, Overloaded, ReachError, from_reply
from reach_agent.wire.schema import Candidate
from reach_agent.wire.subjects import Subjects

from .config import ClientConfig

log = trace.logger(__name__)

RouteKey = tuple[str, str | None, tuple[tuple[str, str], ...], bool]
"""(capability, region, sorted tags, allow_suspect)"""

REFRESH_BATCH = 64
"""Most routes refreshed per round."""
IDLE_FACTOR = 30
"""A route unused for this many refresh periods is no longer refreshed."""


class Route:
    """One cached answer."""

    __slots__ = ("candidates", "fetched_at", "limit", "used_at")

    def __init__(self, candidates: list[Candidate], limit: int, now: float) -> None:
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
    def key(
        capability: str, region: str | None, tags: dict[str, str] | None, allow_suspect: bool
    ) -> RouteKey:
        return (capability, region, tuple(sorted((tags or {}).items())), allow_suspect)

    def routes(self) -> Iterator[Route]:
        return iter(self._routes.values())

    def store(self, key: RouteKey, candidates: Sequence[Candidate], limit: int) -> None:
        now = self.clock()
        entry = self._routes.get(key)
        if entry is None:
            self._routes[key] = Route(list(candidates), limit, now)
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
    """Route requests of one client (``<prefix>.route.<capability>``) and their cache."""

    def __init__(
        self,
        nc: NATS,
        subjects: Subjects,
        config: ClientConfig,
        metrics: ClientMetrics | None,
        clock: Callable[[], float],
    ) -> None:
        self.nc = nc
        self.subjects = subjects
        self.config = config
        self.metrics = metrics
        self.cache = RouteCache(config.route_cache_size, clock)
        self.running = False
        """Set while the client runs; the refresh loop ends when it is cleared."""
        self.caller = ""
        """This client's caller name (``Reach-Caller``: brokers keep quotas per caller)."""
        self.clock = clock

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
        """:meth:`reach_agent.Client.route` (a ``peek``; ``Client.call``'s own routes are
        not peeks: the broker counts the first candidate as handed the task; ``headers``: a
        call's trace, when spans are on). An
        ``OVERLOADED`` answer carrying ``retry_after_ms`` is waited out and asked again, up to
        ``max_retry_after_s`` in all and never past ``deadline`` (a call's)."""
        budget = self.clock() + self.config.max_retry_after_s
        if deadline is not None:
            budget = min(budget, deadline)
        while True:
            try:
                return await self._route(capability, limit, region, tags, sticky_key, exclude,
                                         allow_suspect, peek, canary,
                                         requires, min_context_tokens, headers)  # fmt: skip
            except Overloaded as exc:
                wait = (exc.retry_after_ms or 0) / 1000.0
                if not exc.retry_after_ms or self.clock() + wait > budget:
                    raise
                log.info("route.overloaded capability=%s retry_after_ms=%d", capability,
                         exc.retry_after_ms)  # fmt: skip
                await asyncio.sleep(wait)

    async def _route(
        self,
        capability: str,
        limit: int | None,
        region: str | None,
        tags: dict[str, str] | None,
        sticky_key: str | None,
        exclude: Sequence[str] | None,
        allow_suspect: bool,
        peek: bool,
        canary: str | None,
        requires: Sequence[str] | None,
        min_context_tokens: int | None,
        headers: dict[str, str] | None = None,
    ) -> list[Candidate]:
        schema.check_capability(capability)
        if tags:
            schema.check_tags(tags)
        limit = limit or self.config.route_limit
        key = RouteCache.key(capability, region, tags, allow_suspect)
        excluded = list(exclude or ())
        req = schema.RouteRequest(limit=limit, region=region, tags=dict(tags or {}),
                                  sticky_key=sticky_key, exclude=excluded,
                                  allow_suspect=allow_suspect, peek=peek, canary=canary,
                                  requires=list(requires or ()),
                                  min_context_tokens=min_context_tokens)  # fmt: skip
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
            pool = self.cache.fallback(key, limit, excluded)
            if not pool:
                raise NoReachableAgent(
                    f"route request for capability {capability!r} {why} and no cached route is left"
                ) from None
            if self.metrics is not None:
                self.metrics.route_fallbacks.inc()
            log.info("route.cache_fallback capability=%s reason=%s", capability, why)
            return pool
        err = from_reply(reply.headers, reply.data)
        if err is not None:
            if isinstance(err, NoReachableAgent) and not excluded:
                self.cache.forget(key)
            raise err
        candidates = schema.decode(schema.route_reply_decoder, reply.data, "route reply").candidates
        if not excluded:
            self.cache.store(key, candidates, limit)
        return candidates

    async def refresh_loop(self) -> None:
        """Re-ask the broker for cached routes older than ``route_refresh_s`` that were
        used recently, so the fallback stays fresh."""
        every = self.config.route_refresh_s
        while self.running:
            await asyncio.sleep(every / 2)
            for (cap, region, tags, allow_suspect), e in self.cache.stale(every):
                try:
                    await self.route(cap, e.limit, region=region, tags=dict(tags),
                                     allow_suspect=allow_suspect, peek=True)  # fmt: skip
                except ReachError:
                    pass  # no broker or no agent: route() already updated or kept the cache
                except Exception:  # the loop never dies
                    log.exception("route.refresh_failed capability=%s", cap)
