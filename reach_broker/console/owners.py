"""Who owns what, as the console shows it: each partition of the fleet, the broker that owns
it and how many agents it holds, and the fleet's agents page by page.

Asked on the wire as any client would (``<p>.agents.<partition>``, whose owner answers with
its ``broker_id`` and the partition's ``count``), so the page shows every owner, not only
this broker: one small request per partition, all at once, every few seconds while a page
watches.
"""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec

from reach_agent.wire import schema
from reach_agent.wire.errors import from_reply
from reach_agent.wire.subjects import Subjects

from .views import View

TIMEOUT_S = 1.0
"""How long a partition's owner has to answer (unanswered: shown without an owner)."""

_ONE = schema.encoder.encode(schema.AgentsRequest(limit=1))


class PartitionView(View):
    partition: int
    owner: str | None
    """The broker that answered for it (None: nobody did within a second)."""
    agents: int | None
    """Agents it holds, as its owner counts them."""


class OwnersView(View):
    at_ms: int
    partitions: int
    """How many partitions the fleet has (0: nobody answered)."""
    rows: list[PartitionView]
    brokers: dict[str, int]
    """Partitions owned per broker."""


async def _ask(nc: Any, subjects: Subjects, p: int, body: bytes) -> schema.AgentsPage | None:
    """Partition ``p``'s page for ``body`` from its owner, or None (no answer, an error)."""
    try:
        msg = await nc.request(subjects.agent_page(p), body, timeout=TIMEOUT_S)
    except Exception:  # noqa: BLE001 - no owner now, no responders: shown as unowned
        return None
    if from_reply(msg.headers, msg.data) is not None:
        return None
    try:
        return schema.agents_page_decoder.decode(msg.data)
    except msgspec.MsgspecError:
        return None


async def owners(nc: Any, subjects: Subjects, at_ms: int) -> OwnersView:
    """Every partition's owner and agent count now."""
    first = await _ask(nc, subjects, 0, _ONE)
    if first is None:
        return OwnersView(at_ms=at_ms, partitions=0, rows=[], brokers={})
    rest = await asyncio.gather(*(_ask(nc, subjects, p, _ONE) for p in range(1, first.partitions)))
    rows: list[PartitionView] = []
    brokers: dict[str, int] = {}
    for p, page in enumerate([first, *rest]):
        owner = None if page is None else page.broker_id
        rows.append(PartitionView(partition=p, owner=owner,
                                  agents=None if page is None else page.count))  # fmt: skip
        if owner is not None:
            brokers[owner] = brokers.get(owner, 0) + 1
    return OwnersView(at_ms=at_ms, partitions=first.partitions, rows=rows, brokers=brokers)


async def page(nc: Any, subjects: Subjects, cursor: str | None, limit: int) -> bytes:
    """One page of the fleet as its owner answers it (``AgentsPage`` JSON), or the error."""
    p = 0
    if cursor:
        head = cursor.partition(".")[0]
        p = int(head) if head.isdigit() else 0
    body = schema.encoder.encode(schema.AgentsRequest(limit=limit, cursor=cursor or None))
    try:
        msg = await nc.request(subjects.agent_page(p), body, timeout=TIMEOUT_S * 2)
    except Exception as exc:  # noqa: BLE001 - said to the page as it is
        return schema.encoder.encode({"error": f"partition {p}: no answer ({exc!r})"})
    err = from_reply(msg.headers, msg.data)
    if err is not None:
        return schema.encoder.encode({"error": f"{err.code}: {err.message}"})
    return bytes(msg.data)
