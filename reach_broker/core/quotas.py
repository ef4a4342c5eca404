"""Per-caller quotas: a token bucket per (caller, capability) on route requests.

A caller's limit for a capability is, first found: its own (``[quotas.per_caller.<name>]``),
the capability's route rule (``quota_rate``/``quota_burst``, :mod:`reach_agent.routing.rules`), the
default (``[quotas] rate``; 0 is none). A request over it is answered ``OVERLOADED`` (429)
with ``retry_after_ms``: when the bucket holds a token again. Every other caller's buckets
are untouched, so one caller swamping a capability does not starve the rest. Pure: the
clock is an argument.

Who the caller is (:func:`caller_of`): with the server enforcing identities, the name in the
request's private reply inbox (``_INBOX.<role>.<name>.…``; the server lets nobody else
receive there, so a request naming another's inbox loses its own answer); in open mode the
``Reach-Caller`` header the SDK sets (its connection name), else ``anonymous``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from reach_agent.routing.rules import Rules
from reach_agent.wire.schema import H_CALLER
from reach_agent.wire.subjects import INBOX_ROOT
from reach_broker.config import QuotaLimit, QuotasSection

ANONYMOUS = "anonymous"
"""The caller of a request that names none (open mode, no ``Reach-Caller`` header)."""
OTHER = "other"
"""The ``caller`` label of every caller not listed in ``quotas.callers``."""
MAX_CALLER_LEN = 128

_INBOX_DOT = INBOX_ROOT + "."


def caller_of(headers: Mapping[str, str] | None, reply: str | None, secured: bool) -> str:
    """Who sent a route request (see the module docstring)."""
    if secured and reply and reply.startswith(_INBOX_DOT):
        parts = reply.split(".", 3)
        if len(parts) >= 3 and parts[2]:
            return parts[2]
    if headers:
        name = headers.get(H_CALLER)
        if name:
            return name[:MAX_CALLER_LEN]
    return ANONYMOUS


class Bucket:
    """``burst`` tokens, refilled at ``rate`` a second."""

    __slots__ = ("at", "burst", "rate", "tokens")

    def __init__(self, rate: float, burst: int, now: float) -> None:
        self.rate = rate
        self.burst = burst
        self.tokens = float(burst)
        self.at = now

    def take(self, now: float) -> float:
        """Take one token: 0.0 when granted, else the seconds until one is there."""
        tokens = min(self.burst, self.tokens + (now - self.at) * self.rate)
        self.at = now
        if tokens >= 1.0:
            self.tokens = tokens - 1.0
            return 0.0
        self.tokens = tokens
        return (1.0 - tokens) / self.rate


class Quotas:
    """Every (caller, capability) bucket, and the limits they follow."""

    def __init__(self, cfg: QuotasSection, rules: Rules) -> None:
        self.cfg = cfg
        self.rules = rules
        self.buckets: dict[tuple[str, str], Bucket] = {}
        self._named = frozenset(cfg.callers)
        self.refused = 0
        self.active = False
        """Whether any quota can apply (else the route path skips :meth:`admit`)."""
        self._activity()

    def _activity(self) -> None:
        cfg = self.cfg
        self.active = bool(cfg.rate > 0 or cfg.per_caller or any(
            r.stored.quota_rate is not None for r in self.rules.values()))  # fmt: skip

    def limit(self, caller: str, capability: str) -> QuotaLimit | None:
        """The limit of ``caller`` for ``capability`` (None: unlimited)."""
        own = self.cfg.per_caller.get(caller)
        if own is not None:
            return own
        rule = self.rules.get(capability)
        if rule is not None and rule.stored.quota_rate is not None:
            return QuotaLimit(rate=rule.stored.quota_rate, burst=rule.stored.quota_burst)
        if self.cfg.rate > 0:
            return QuotaLimit(rate=self.cfg.rate, burst=self.cfg.burst)
        return None

    def enforced(self, capability: str) -> bool:
        """Whether a quota may apply to some caller of ``capability`` (a default, a
        caller's own limit, or the capability's rule): then only brokers route it."""
        if self.cfg.rate > 0 or self.cfg.per_caller:
            return True
        rule = self.rules.get(capability)
        return rule is not None and rule.stored.quota_rate is not None

    def admit(self, caller: str, capability: str, now: float) -> int | None:
        """None when ``caller`` may route ``capability`` now; else the ``retry_after_ms``."""
        key = (caller, capability)
        bucket = self.buckets.get(key)
        if bucket is None:
            limit = self.limit(caller, capability)
            if limit is None:
                return None
            burst = limit.burst or max(1, int(limit.rate))
            bucket = self.buckets[key] = Bucket(limit.rate, burst, now)
            if len(self.buckets) > self.cfg.max_buckets:
                del self.buckets[next(iter(self.buckets))]  # the oldest comes back full
        wait = bucket.take(now)
        if wait <= 0.0:
            return None
        self.refused += 1
        return max(1, math.ceil(wait * 1000))

    def changed(self, capability: str) -> None:
        """The capability's rule changed: its buckets follow the new limit from now."""
        for key in [k for k in self.buckets if k[1] == capability]:
            del self.buckets[key]
        self._activity()

    def label(self, caller: str) -> str:
        """``caller`` as a metric label: itself when listed in ``quotas.callers``."""
        return caller if caller in self._named else OTHER
