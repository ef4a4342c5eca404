"""The whole fleet, page by page: follow the cursor of ``<p>.agents.<partition>`` from
partition 0 to the last, each page answered by its partition's owner (docs/protocol.md,
"reach.agents"). What ``reach agents`` and the console list with.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from nats.errors import TimeoutError as NatsTimeout

from reach_agent.wire import schema
from reach_agent.wire.errors import from_reply
from reach_agent.wire.subjects import Subjects

ATTEMPTS = 3
"""Tries of one page before giving up: a partition changing owners answers nothing for a
moment (its lease lapses, another broker takes it)."""


async def agent_pages(
    nc: Any,
    subjects: Subjects,
    *,
    capability: str | None = None,
    state: schema.AgentState | None = None,
    limit: int | None = None,
    timeout_s: float = 2.0,
) -> AsyncIterator[schema.AgentsPage]:
    """Every page of the fleet in order (partition, then agent id). Raises the ReachError of
    an error reply, nats' NoRespondersError when no broker listens, and nats' TimeoutError
    when a partition's owner does not answer ``ATTEMPTS`` times running."""
    p, cursor = 0, None
    while True:
        body = schema.encoder.encode(
            schema.AgentsRequest(capability=capability, state=state, limit=limit, cursor=cursor)
        )
        for attempt in range(ATTEMPTS):
            try:
                msg = await nc.request(subjects.agent_page(p), body, timeout=timeout_s)
                break
            except NatsTimeout:
                if attempt == ATTEMPTS - 1:
                    raise
        err = from_reply(msg.headers, msg.data)
        if err is not None:
            raise err
        page = schema.agents_page_decoder.decode(msg.data)
        yield page
        if page.cursor is None:
            return
        if page.cursor == cursor:
            raise ValueError(f"the owner of partition {p} answered the cursor {cursor!r} again")
        cursor = page.cursor
        head = cursor.partition(".")[0]
        p = int(head) if head.isdigit() else p
