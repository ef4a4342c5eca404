"""One attempt of a call: which candidate is next, sending it, and its bookkeeping.

The client's retry loop (:meth:`reach_agent.client.attemptloop.AttemptLoop.run`) asks
:meth:`Attempts.next` for the first candidate not tried and not behind an open breaker,
sends the attempt with
:meth:`Attempts.send` — which waits longer for an agent announcing a longer
``timeout_hint_ms`` (``clamp(max(timeout, hint), min_timeout_s, max_timeout_s)``) but never
longer for its receipt — and gets back how it ended; the breakers and the per-attempt
metric are told here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from nats.aio.client import Client as NATS

from reach_agent import trace
from reach_agent.metrics import ClientMetrics
from reach_agent.wire import schema
from reach_agent.wire.errors import InternalError
from reach_agent.wire.retry import Outcome
from reach_agent.wire.subjects import ReplyInbox

from . import prompting
from .breaker import Breakers, BreakerState, verdict
from .calls import Call
from .config import ClientConfig
from .liveness import Liveness
from .outcomes import OutcomeBook
from .routes import RouteSource

log = trace.logger(__name__)


class Attempts:
    """Sends attempts for one client and keeps its breakers and metrics told."""

    def __init__(
        self,
        nc: NATS,
        config: ClientConfig,
        breakers: Breakers,
        liveness: Liveness,
        metrics: ClientMetrics | None,
        clock: Callable[[], float],
        routes: RouteSource,
    ) -> None:
        self.nc = nc
        self.routes = routes
        """Told of each attempt sent and ended (a caller routing itself counts its load)."""
        self.config = config
        self.breakers = breakers
        self.liveness = liveness
        self.metrics = metrics
        self.clock = clock
        self.outcomes: OutcomeBook | None = None
        """Told of every attempt's end: what this client saw, for the brokers."""

    def next(
        self, candidates: list[schema.Candidate], tried: Sequence[str], capability: str
    ) -> schema.Candidate | None:
        """The first candidate (broker's weighted order) not tried and not breaker-blocked."""
        now = self.clock()
        for cand in candidates:
            if cand.agent_id not in tried and self.breakers.available(
                cand.agent_id, capability, now
            ):
                return cand
        return None

    async def send(
        self, call: Call, target: schema.Candidate, inbox: ReplyInbox
    ) -> tuple[Outcome, Any]:
        """Send the call's current attempt to ``target`` and wait for how it ends: (outcome,
        result or error)."""
        agent = target.agent_id
        now = self.clock()
        if target.timeout_hint_ms:
            hint_s = target.timeout_hint_ms / 1000.0
            call.fit_hint(call.started + self.config.clamp_timeout(call.timeout, hint_s))
        hdrs = call.attempt_headers(now)
        call.agent_id = agent
        call.agents[call.attempt] = agent
        call.protocol = target.protocol
        call.subject = target.subject
        # A Synadia agent gets their prompt envelope; it answers no reach probe, so the
        # broker's events alone tell that it died.
        synadia = target.protocol == schema.PROTOCOL_SYNADIA
        body = prompting.envelope(call.body) if synadia else call.body
        self.liveness.track(agent, call, probe=not synadia)
        outcome: Outcome = "closed"
        value: Any = InternalError("client closed")
        key = (call.call_id, call.attempt)
        self.routes.sent(agent, key)
        try:
            await self.nc.publish(target.subject, body, headers=hdrs,
                                  reply=inbox.reply(call.call_id, call.attempt))  # fmt: skip
            outcome, value = await call.outcome(now, self.config.ack_timeout_s, self.clock)
            return outcome, value
        finally:
            self.routes.ended(key, outcome == "error" and value.code == "TARGET_BUSY")
            self.liveness.untrack(agent, call)
            self.account(agent, call.capability, outcome, value)

    def account(self, agent: str, capability: str, outcome: Outcome, value: Any) -> None:
        """Breaker, metrics and outcome bookkeeping of one attempt."""
        if self.outcomes is not None:
            self.outcomes.record(agent, outcome, value)
        now = self.clock()
        ok = verdict(outcome, value if outcome == "error" else None)
        if ok is None:
            self.breakers.release(agent, capability, now)
        else:
            self.breaker_changed(agent, capability, self.breakers.record(agent, capability, ok,
                                                                         now))  # fmt: skip
        if self.metrics is not None:
            label = "ok" if outcome == "ok" else value.code if outcome == "error" else outcome
            self.metrics.requests.labels(agent, label).inc()

    def breaker_changed(self, agent: str, capability: str, change: BreakerState | None) -> None:
        if change is None:
            return
        log.info("breaker.%s agent=%s capability=%s", change, agent, capability)
        if self.metrics is not None:
            self.metrics.breaker_open.labels(agent, capability).set(0 if change == "closed" else 1)
