"""Broker component: callers' outcome summaries in, each agent's delivery term out.

Hears the summaries of the agents this broker owns (``<prefix>.outcome.<agent_id>``, mapped
into the agent's partition by the server as its heartbeats are: :mod:`.ingest` subscribes for
the partitions owned and hands each to :meth:`Outcomes.on_message`), decodes and checks each
summary, hands it to the :class:`~reach_broker.core.delivery.DeliveryBook` and sets the
agent's ``delivery`` — rescoring it, and re-ranking its capabilities at once when the verdict
crosses 0 either way. Once a second the agents whose reports left the window since (and those
with unanswered calls) are judged again, so reports older than the window stop counting. A
partition taken over starts with an empty book for its agents (its previous owner's reports
are not handed over): what the callers report from then on counts.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from nats.aio.msg import Msg

from reach_agent.aio import stop_loops
from reach_agent.wire.errors import ReachError
from reach_agent.wire.schema import decode, is_agent_id, outcome_decoder, validate_outcome
from reach_broker.config import OutcomesSection
from reach_broker.core.delivery import OUTLIER, UNANSWERED, DeliveryBook, Verdict
from reach_broker.core.registry import Registry

from .context import BrokerContext

log = logging.getLogger(__name__)

JUDGE_EVERY_S = 1.0
"""How often every agent with reports is judged again (the window slides)."""


class Outcomes:
    """Follows the callers' summaries into the registry's records."""

    def __init__(self, ctx: BrokerContext, registry: Registry, cfg: OutcomesSection, *,
                 summaries: Any, ejected: Any) -> None:  # fmt: skip
        """``summaries``, ``ejected``: ``reach_outcomes_total``, ``reach_delivery_ejected``."""
        self.ctx, self.registry, self.cfg = ctx, registry, cfg
        self.book = DeliveryBook(cfg)
        self._result = {k: summaries.labels(k) for k in ("accepted", "invalid", "unknown")}
        self._ejected = {rule: ejected.labels(rule) for rule in (OUTLIER, UNANSWERED)}
        self._loop: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """The judging once a second (the summaries come through the ingest)."""
        if self._loop is not None or not self.cfg.enabled:
            return
        self._loop = asyncio.create_task(self._judge_loop(), name="reach-outcomes-judge")

    async def stop(self) -> None:
        if self._loop is not None:
            await stop_loops(self._loop)
            self._loop = None

    async def on_message(self, msg: Msg) -> None:
        agent_id = self.ctx.subjects.agent_of_outcome(msg.subject)
        try:
            summary = validate_outcome(decode(outcome_decoder, msg.data, "outcome"))
        except ReachError as exc:
            self._result["invalid"].inc()
            log.debug("outcome.invalid subject=%s error=%s", msg.subject, exc.message)
            return
        self.fold(agent_id, summary)

    def fold(self, agent_id: str, summary: Any) -> Verdict | None:
        """One summary about ``agent_id``: its verdict, or None for an agent not known."""
        rec = self.registry.agents.get(agent_id) if is_agent_id(agent_id) else None
        if rec is None:
            self._result["unknown"].inc()
            return None
        self._result["accepted"].inc()
        now = self.ctx.clock()
        verdict = self.book.add(agent_id, summary, now, rec.ok_total + rec.fail_total,
                                rec.active > 0)  # fmt: skip
        self._set(agent_id, verdict, now)
        self._count()
        return verdict

    def judge_all(self, now: float) -> None:
        """Every agent whose verdict may have moved since it was last judged: some of its
        reports left the window, or it has unanswered calls (whose rule also reads its
        heartbeats). Not the whole book: O(1) amortised a summary."""
        agents = self.registry.agents
        for agent_id in self.book.due(now):
            rec = agents.get(agent_id)
            if rec is None:
                self.book.forget(agent_id)
                continue
            finished = rec.ok_total + rec.fail_total
            self._set(agent_id, self.book.judge(agent_id, now, finished, rec.active > 0), now)
        self._count()

    def _set(self, agent_id: str, verdict: Verdict, now: float) -> None:
        rec = self.registry.agents.get(agent_id)
        if rec is None or rec.delivery == verdict.delivery:
            return
        was_out = rec.delivery == 0.0
        rec.delivery = verdict.delivery
        self.registry.rescore(rec, now)
        if was_out != (verdict.delivery == 0.0):
            self.registry.indexes.state_changed(rec)  # in or out of the routes: re-rank now
            if verdict.rule is not None:
                log.warning("delivery.ejected agent=%s rule=%s share=%.3f callers=%d", agent_id,
                            verdict.rule, verdict.share, verdict.callers)  # fmt: skip
            else:
                log.info("delivery.restored agent=%s", agent_id)

    def _count(self) -> None:
        for rule, n in self.book.ejected.items():
            self._ejected[rule].set(n)

    async def _judge_loop(self) -> None:
        while True:
            await asyncio.sleep(JUDGE_EVERY_S)
            try:
                self.judge_all(self.ctx.clock())
            except Exception:  # noqa: BLE001 - the loop body never dies
                log.exception("outcomes.judge failed")
