"""``<p>.agents.<partition>``: pages of the fleet, each answered by its partition's owner.

Every broker subscribes to ``<p>.agents.*`` (no queue group) and answers only for the
partitions it owns (``owns``); the others stay silent, so a client pages through the whole
fleet by following the cursor from partition to partition, whichever broker owns each
(:mod:`reach_broker.core.listing`). A page stays within ``PAGE_BYTES`` however large its
agents' views are: the page ends early, its cursor goes on from there.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import msgspec

from reach_agent.wire import schema
from reach_agent.wire.errors import InvalidRequest
from reach_agent.wire.schema import check_capability, decode
from reach_broker.core.listing import DEFAULT_LIMIT, MAX_LIMIT, cursor_of, parse_cursor
from reach_broker.core.registry import Registry

from .context import BrokerContext
from .handlers import Dropped, Endpoint

PAGE_BYTES = 1 << 20
"""A page's views stop once they pass this many bytes (1 MiB; half the server's max_payload
when that is smaller)."""


class _Page(msgspec.Struct, kw_only=True, omit_defaults=True):
    """:class:`~reach_agent.wire.schema.AgentsPage` with each view already encoded."""

    agents: list[msgspec.Raw]
    partition: int
    partitions: int
    cursor: str | None = None
    count: int = 0
    broker_id: str | None = None


_encode = msgspec.json.Encoder().encode


class AgentPages:
    """The page endpoint over the registry's listing, answering for the partitions owned."""

    def __init__(
        self,
        ctx: BrokerContext,
        registry: Registry,
        owns: Callable[[int], bool],
        *,
        dropped: Dropped,
    ) -> None:
        self.ctx = ctx
        self.registry = registry
        self.owns = owns
        """Whether this broker owns a partition now (its lease)."""
        self.endpoint = Endpoint("agent_page", self.page, ctx, refused=None, failed=None,
                                 dropped=dropped)  # fmt: skip
        """What ``<p>.agents.*`` is answered by."""
        self._sub: Any = None

    async def start(self) -> None:
        """Answer on ``<p>.agents.*`` (every broker subscribes; only owners answer)."""
        if self._sub is None:
            ctx = self.ctx
            self._sub = await ctx.nc.subscribe(ctx.subjects.all_agent_pages,
                                               cb=self.endpoint.on_message)  # fmt: skip

    async def stop(self) -> None:
        sub, self._sub = self._sub, None
        if sub is not None:
            with contextlib.suppress(Exception):  # a closed connection has nothing to undo
                await sub.unsubscribe()

    def page(self, subject: str, data: bytes) -> bytes | None:
        """One page of the partition the subject names; None (no answer) from a broker that
        does not own it."""
        listing = self.registry.listing
        token = self.ctx.subjects.partition_of_agent_page(subject)
        if not token.isdigit() or int(token) >= listing.partitions:
            raise InvalidRequest(
                f"partition {token[:40]!r} of subject {subject[:200]!r} is not a partition of "
                f"this fleet (0 to {listing.partitions - 1})"
            )
        p = int(token)
        if not self.owns(p):
            return None
        req = decode(schema.agents_request_decoder, data, "agents request")
        if req.capability is not None:
            check_capability(req.capability)
        limit = DEFAULT_LIMIT if req.limit is None else req.limit
        if limit > MAX_LIMIT:
            raise InvalidRequest(f"limit {limit} is above the most a page holds ({MAX_LIMIT})")
        after = ""
        if req.cursor is not None:
            at, after = parse_cursor(req.cursor, listing.partitions)
            if at != p:
                raise InvalidRequest(
                    f"cursor {req.cursor!r} continues partition {at}: ask "
                    f"{self.ctx.subjects.agent_page(at)}, not {subject}"
                )
        agents = self.registry.agents
        passes: Callable[[str], bool] | None = None
        if req.capability is not None or req.state is not None:
            cap, state = req.capability, req.state

            def passes(agent_id: str) -> bool:
                rec = agents.get(agent_id)
                return (
                    rec is not None
                    and (state is None or rec.state == state)
                    and (cap is None or cap in rec.capabilities)
                )

        ids, cursor = listing.page(p, after, limit, passes)
        wall_ms, now = self.ctx.wall_ms(), self.ctx.clock()
        views: list[msgspec.Raw] = []
        size, budget = 0, min(PAGE_BYTES, self.ctx.nc.max_payload // 2)
        for n, agent_id in enumerate(ids):
            rec = agents.get(agent_id)
            if rec is None:
                continue  # listed, no longer held (never, while the two are kept together)
            view = schema.encoder.encode(rec.view(wall_ms, now))
            size += len(view) + 1
            if views and size > budget:
                cursor = cursor_of(p, ids[n - 1])  # full: the next page goes on from here
                break
            views.append(msgspec.Raw(view))
        page = _Page(
            agents=views,
            partition=p,
            partitions=listing.partitions,
            cursor=cursor,
            count=listing.count(p),
            broker_id=self.ctx.broker_id,
        )
        return _encode(page)
