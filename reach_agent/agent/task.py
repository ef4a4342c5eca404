"""What a handler receives (:class:`Task`) and how it refuses work (:class:`Reject`)."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from reach_agent.wire import schema
from reach_agent.wire.errors import BizReject

LOOP_LIMIT = 3
"""Visits of one agent allowed per trace (docs/protocol.md); the 4th is ``LOOP_DETECTED``."""


class Reject(BizReject):
    """Raise from a handler to refuse a task on business grounds: ``BIZ_REJECT``, never
    retried by callers."""


class Task:
    """One task handed to a handler.

    ``payload`` is the decoded JSON body (``None`` for an empty body); ``headers`` the
    request's headers as sent; ``deadline`` the ``time.monotonic()`` by which the caller
    stops waiting (``None`` when the caller gave no ``Reach-Timeout-Ms``).
    """

    __slots__ = ("agent_id", "capability", "deadline", "headers", "payload", "request_id")

    def __init__(
        self,
        payload: Any,
        request_id: str,
        capability: str,
        headers: Mapping[str, str],
        deadline: float | None,
        agent_id: str,
    ) -> None:
        self.payload = payload
        self.request_id = request_id
        self.capability = capability
        self.headers = headers
        self.deadline = deadline
        self.agent_id = agent_id

    @property
    def time_left(self) -> float | None:
        """Seconds until the caller's deadline (may be negative), or ``None`` if unknown."""
        if self.deadline is None:
            return None
        return self.deadline - time.monotonic()

    @property
    def hops(self) -> list[str]:
        """Agent ids this task's trace visited before reaching us (``Reach-Hops``)."""
        raw = self.headers.get(schema.H_HOPS)
        return [h for h in raw.split(",") if h] if raw else []

    @property
    def trace_id(self) -> str | None:
        return self.headers.get(schema.H_TRACE_ID)

    def child_headers(self) -> dict[str, str]:
        """Headers for a sub-task this handler sends on: the trace id, ``traceparent`` and
        ``Reach-Hops`` with this agent appended, so loops are detected downstream."""
        out = {schema.H_HOPS: ",".join([*self.hops, self.agent_id])}
        for name in (schema.H_TRACE_ID, schema.H_TRACEPARENT):
            value = self.headers.get(name)
            if value:
                out[name] = value
        return out

    def __repr__(self) -> str:
        return f"Task(capability={self.capability!r}, request_id={self.request_id!r})"
