"""The live route rules: KV ``reach_rules`` followed, applied at once, every change audited.

Every replica follows the bucket (:func:`jetstream.rules.follow`: each key's last value at
start, then every change as JetStream stores it, through a follow that rebuilds its consumer
after a node loss or a reconnect without missing a change), so a ``reach rules set`` reaches all of
them within the time a stored message takes to be delivered (milliseconds, well under the
second promised). Each change is applied to the router's :class:`~reach_agent.routing.rules.Rules`
and the quotas, and published as an ``Event`` of kind ``rule`` on
``<prefix>.event.rule._rules`` — the audit trail ``REACH_AUDIT`` keeps it. Every replica
publishes it with the same ``Nats-Msg-Id`` (``rule.<capability>.<revision>``), so the trail
stores it once. A value that does not decode is refused (logged, counted), and the rule in
force stays.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from jetstream import rules as bucket
from jetstream.follow import UNCOUNTED, Follower, FollowMetrics
from jetstream.names import H_MSG_ID
from reach_agent.routing.rules import RouteRule, Rules, build, decode_rule, describe
from reach_agent.wire import schema
from reach_agent.wire.errors import InvalidRequest
from reach_agent.wire.schema import Event, check_capability
from reach_agent.wire.subjects import RULES_AUTHOR
from reach_broker.config import ConfigError, RuleSection
from reach_broker.core.quotas import Quotas

from .context import BrokerContext

log = logging.getLogger(__name__)

CATCH_UP_S = 2.0
"""At start the broker waits this long at most for the stored rules before it serves."""

AUDIT_CATCH_UP_S = 120.0
"""Changes stored this long before the broker started are audited again at start (the audit
stream's duplicate window drops the copy if another replica did): a change made while no
broker ran is still audited, one seen already is not stored twice."""


def from_config(sections: dict[str, RuleSection]) -> dict[str, RouteRule]:
    """broker.toml's ``[rules."<capability>"]`` as rules (the bucket's take their place
    while set); ConfigError naming the key."""
    out = {}
    for cap, sec in sections.items():
        try:
            check_capability(cap, "rules key")
            out[cap] = build(sec.split, sec.require, sec.quota)
        except InvalidRequest as exc:
            raise ConfigError(f"rules.{cap}: {exc.message}") from None
    return out


class Rulebook:
    """Broker component: follows ``reach_rules`` into the router's rules. Started only when
    the server has JetStream (``broker.toml``'s rules apply either way)."""

    def __init__(self, ctx: BrokerContext, rules: Rules, quotas: Quotas, *, changes: Any,
                 follow: FollowMetrics = UNCOUNTED) -> None:  # fmt: skip
        """``changes``: ``reach_rule_changes_total``; ``follow``: what the rules follow
        counts into."""
        self.ctx = ctx
        self._follow = follow
        self.rules = rules
        self.quotas = quotas
        self._changes = changes
        """``reach_rule_changes_total`` by action."""
        self.applied = 0
        """Changes applied so far."""
        self.changed = asyncio.Event()
        """Set at every applied change (tests wait on it)."""
        self.seen = 0
        """Stored changes delivered so far (valid or not)."""
        self._expected = 0
        self._caught_up = asyncio.Event()
        self.follower: Follower | None = None
        """The follow of ``reach_rules`` (None: not started)."""
        self._since = 0.0

    async def start(self) -> None:
        if self.follower is not None:
            return
        self._since = self.ctx.wall() - AUDIT_CATCH_UP_S
        try:
            expected = await bucket.stored(self.ctx.nc)
        except Exception:  # noqa: BLE001 - no bucket info: follow anyway, without waiting
            log.warning("rules.count_failed", exc_info=True)
            expected = 0
        self._expected = expected
        self.follower = await bucket.follow(self.ctx.nc, self._on_change,
                                            metrics=self._follow)  # fmt: skip
        # The stored rules are in force before the broker answers its first route.
        if self.seen < expected:
            try:
                await asyncio.wait_for(self._caught_up.wait(), CATCH_UP_S)
            except TimeoutError:
                log.warning("rules.catch_up_slow seen=%d of %d after %.0fs", self.seen,
                            expected, CATCH_UP_S)  # fmt: skip

    async def stop(self) -> None:
        if self.follower is None:
            return
        follower, self.follower = self.follower, None
        await follower.stop()

    async def _on_change(
        self, capability: str, revision: int, data: bytes | None, stored_at: float
    ) -> None:
        self.seen += 1
        if self.seen >= self._expected:
            self._caught_up.set()
        try:
            self.apply(capability, revision, data, audit=stored_at >= self._since)
        except Exception:  # noqa: BLE001 - the follow never dies
            log.exception("rules.apply_failed capability=%s revision=%d", capability, revision)

    def apply(self, capability: str, revision: int, data: bytes | None,
              audit: bool = True) -> str:  # fmt: skip
        """Apply one stored change; returns how it ended (``set``, ``cleared``, ``invalid``)."""
        if data is None:
            in_force = self.rules.unset(capability)
            action = "cleared"
            reason = f"{capability}: cleared" + (
                f"; broker.toml's applies: {describe(in_force)}" if in_force is not None else ""
            )
        else:
            try:
                rule = decode_rule(capability, data)
            except InvalidRequest as exc:
                self._changes.labels("invalid").inc()
                log.warning("rules.invalid capability=%s revision=%d error=%s", capability,
                            revision, exc.message)  # fmt: skip
                return "invalid"
            self.rules.put(capability, rule)
            action = "set"
            by = f" by {rule.updated_by}" if rule.updated_by else ""
            reason = f"{capability}: set {describe(rule)}{by}"
        self.quotas.changed(capability)
        self._changes.labels(action).inc()
        self.applied += 1
        self.changed.set()
        log.info("rules.%s capability=%s revision=%d %s", action, capability, revision, reason)
        if audit:
            self._audit(capability, revision, reason)
        return action

    def _audit(self, capability: str, revision: int, reason: str) -> None:
        ctx = self.ctx
        event = Event(kind="rule", agent_id=RULES_AUTHOR, reason=reason,
                      at_ms=int(ctx.wall() * 1000), broker_id=ctx.broker_id,
                      capability=capability)  # fmt: skip
        headers = {H_MSG_ID: f"rule.{capability}.{revision}"}
        ctx.spawn(ctx.nc.publish(ctx.subjects.rule_event, schema.encoder.encode(event),
                                 headers=headers), "reach-rule-audit")  # fmt: skip
