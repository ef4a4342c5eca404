"""What this client saw of each agent, summarised for the brokers every few seconds.

Each attempt's end (:meth:`OutcomeBook.record`, told by :mod:`reach_agent.client.attempts`) is
counted per agent: attempts, answers, not delivered, lost, timeouts, business rejections.
Every ``ClientConfig.outcome_interval_s`` the counts go out as one
:class:`~reach_agent.wire.schema.OutcomeSummary` per agent on ``<prefix>.outcome.<agent_id>``
(nothing is sent for an agent not called since) and start again. The brokers fold them into
the agent's delivery term (docs/protocol.md, "OutcomeSummary"), so an agent whose results
never reach its callers drops out of the routes for everyone, not only for the caller whose
breaker saw it. Cost on the call path: one dict lookup and an increment per attempt.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from nats.aio.client import Client as NATS

from reach_agent.aio import stop_loops
from reach_agent.wire import schema
from reach_agent.wire.errors import BizReject
from reach_agent.wire.retry import Outcome
from reach_agent.wire.subjects import Subjects

log = logging.getLogger(__name__)

ATTEMPTS, OK, NOT_DELIVERED, LOST, TIMEOUTS, REJECTED = range(6)
_SLOT: dict[str, int] = {"ok": OK, "not_delivered": NOT_DELIVERED, "no_responders": NOT_DELIVERED,
                         "lost": LOST, "timeout": TIMEOUTS}  # fmt: skip


class OutcomeBook:
    """Counts per agent since the last summary (pure; the clock is an argument)."""

    def __init__(self, caller: str, now: float) -> None:
        self.caller = caller
        self.counts: dict[str, list[int]] = {}
        self.since = now

    def record(self, agent_id: str, outcome: Outcome, value: Any) -> None:
        """One attempt to ``agent_id`` ended in ``outcome`` (``value``: its error, if any)."""
        if outcome == "closed":
            return  # the caller itself stopped: nothing learnt about the agent
        c = self.counts.get(agent_id)
        if c is None:
            c = self.counts[agent_id] = [0, 0, 0, 0, 0, 0]
        c[ATTEMPTS] += 1
        if outcome == "error":
            c[REJECTED if isinstance(value, BizReject) else OK] += 1  # an answer either way
        else:
            c[_SLOT[outcome]] += 1

    def take(self, now: float) -> list[tuple[str, schema.OutcomeSummary]]:
        """The summaries since the last take, and a fresh start."""
        span = max(0, int((now - self.since) * 1000))
        out = [
            (agent_id, schema.OutcomeSummary(
                caller=self.caller, attempts=c[ATTEMPTS], ok=c[OK], not_delivered=c[NOT_DELIVERED],
                lost=c[LOST], timeouts=c[TIMEOUTS], rejected=c[REJECTED], interval_ms=span))
            for agent_id, c in self.counts.items()
        ]  # fmt: skip
        self.counts = {}
        self.since = now
        return out


class OutcomeReporter:
    """Publishes the book's summaries every ``interval_s`` while the client runs."""

    def __init__(self, nc: NATS, subjects: Subjects, book: OutcomeBook, interval_s: float,
                 clock: Callable[[], float]) -> None:  # fmt: skip
        self.nc = nc
        self.subjects = subjects
        self.book = book
        self.interval_s = interval_s
        self.clock = clock
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self._task is None and self.interval_s > 0:
            self._task = asyncio.create_task(self._loop(), name="reach-outcomes")

    async def stop(self) -> None:
        """Stop the loop and send what is left."""
        if self._task is None:
            return
        await stop_loops(self._task)
        self._task = None
        await self.flush()

    async def flush(self) -> None:
        """Publish every pending summary now."""
        for agent_id, summary in self.book.take(self.clock()):
            try:
                await self.nc.publish(self.subjects.outcome(agent_id),
                                      schema.encoder.encode(summary))  # fmt: skip
            except Exception:  # noqa: BLE001 - a closed connection loses a summary, no more
                log.debug("outcomes.publish_failed agent=%s", agent_id, exc_info=True)
                return

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            await self.flush()
