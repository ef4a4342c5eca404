"""Client-side settings: call timeouts, retries, receipts, route cache and circuit breakers.

Defaults are the ones from the field reports (docs/sdk.md lists them). Both Structs refuse
unknown fields, so a typo is a clear error (``ClientConfig(retires=3)`` raises), and
validate ranges on construction.
"""

from __future__ import annotations

from typing import Annotated

import msgspec
from msgspec import Meta

from reach_agent.wire.subjects import DEFAULT_PREFIX

Seconds = Annotated[float, Meta(gt=0)]


_checking = False


class _Config(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    def __post_init__(self) -> None:
        # msgspec checks ``Meta`` constraints only when decoding; re-validate so that
        # ``ClientConfig(retries=-1)`` fails at once, naming the field.
        global _checking
        if _checking:
            return
        _checking = True
        try:
            msgspec.convert(msgspec.to_builtins(self), type(self))
        except msgspec.ValidationError as exc:
            raise ValueError(f"{type(self).__name__}: {exc}") from None
        finally:
            _checking = False


class BreakerConfig(_Config):
    """Per-(agent, capability) circuit breaker (docs/sdk.md, "Circuit breakers")."""

    consecutive_failures: Annotated[int, Meta(ge=1)] = 10
    """Open after this many failures in a row."""
    failure_ratio: Annotated[float, Meta(gt=0, le=1)] = 0.5
    """Open when the share of failures over ``window_s`` is above this ..."""
    min_calls: Annotated[int, Meta(ge=1)] = 10
    """... and at least this many calls ended in the window."""
    window_s: Seconds = 60.0
    """Length of the sliding failure-rate window."""
    open_s: Seconds = 5.0
    """First open period; it doubles each time a half-open trial fails."""
    open_max_s: Seconds = 300.0
    """Ceiling of the doubling open period."""
    trial_calls: Annotated[int, Meta(ge=1)] = 3
    """Half-open: this many trial calls must succeed to close again."""
    max_breakers: Annotated[int, Meta(ge=16)] = 10_000
    """Bound on tracked (agent, capability) pairs; idle closed ones are dropped first."""


class ClientConfig(_Config):
    """How :class:`reach_agent.Client` routes, sends, waits and retries."""

    prefix: str = DEFAULT_PREFIX
    """Subject prefix shared with the broker and agents."""
    default_timeout_s: Seconds = 30.0
    """Call timeout when the caller gives none (then clamped like any other)."""
    min_timeout_s: Seconds = 5.0
    """Lower clamp of a call's timeout: ``clamp(max(timeout, timeout_hint), min, max)``."""
    max_timeout_s: Seconds = 3600.0
    """Upper clamp of a call's timeout, also of one raised by an agent's ``timeout_hint_ms``
    (long agent tasks of ten minutes and more are normal)."""
    retries: Annotated[int, Meta(ge=0, le=20)] = 2
    """Retries after the first attempt (TIMEOUT, DRAINING, not delivered, lost); a merely
    full refusal (TARGET_BUSY, OVERLOADED) is waited out instead (``busy_wait_s``)."""
    backoff_s: Annotated[float, Meta(ge=0)] = 1.0
    """First backoff before a retry; multiplied by ``backoff_factor`` each time, jittered."""
    backoff_factor: Annotated[float, Meta(ge=1)] = 2.0
    backoff_max_s: Annotated[float, Meta(ge=0)] = 10.0
    busy_wait_s: Seconds = 0.05
    """When every candidate is merely full (``OVERLOADED``, ``TARGET_BUSY``) and the refusal
    carries no ``retry_after_ms``, wait this long (±50 %) before asking again; such waits
    last until the deadline and do not count against ``retries``."""
    ack_timeout_s: Seconds = 1.0
    """No receipt within this time means "not delivered": the next candidate is tried at
    once. 1 s rather than less: a receipt is sent before the handler runs, but a loaded
    event loop can lag, and a false "not delivered" runs the task on a second agent."""
    route_timeout_s: Seconds = 1.0
    """How long a route request waits for a broker before falling back to the cache."""
    route_limit: Annotated[int, Meta(ge=1, le=100)] = 3
    """Candidates asked for per call."""
    route_refresh_s: Seconds = 10.0
    """Cached routes older than this are refreshed in the background."""
    route_cache_size: Annotated[int, Meta(ge=1)] = 1024
    """Distinct (capability, filters) routes kept for fallback."""
    local_routing: bool = True
    """Route calls from the capabilities' route tables the brokers publish (the broker's own
    decision, made here: no route request per call); a capability whose table says a quota
    applies is still asked of a broker. Off: every call asks a broker."""
    table_wait_s: Seconds = 0.5
    """How long a table is waited for when a capability is first used (the brokers' answers,
    then KV reach_tables); none by then: the call asks a broker."""
    table_idle_s: Seconds = 60.0
    """A table not used for this long is no longer followed."""
    table_resync_s: Seconds = 30.0
    """A followed table is asked for whole again this often (deltas lost to a reconnect)."""
    connect_timeout_s: Seconds = 10.0
    """How long ``Client.start`` waits for a NATS server before raising ``ConnectionError``
    (an agent, by contrast, waits for its server indefinitely)."""
    liveness_check: bool = True
    """On a `suspect` event for an agent running our calls, probe it; no answer aborts those
    attempts so they are retried elsewhere at once instead of waiting for the deadline."""
    liveness_probe_s: Annotated[float, Meta(ge=0)] = 2.0
    """While calls wait on an agent, probe it this often ourselves (0: never); no answer
    abandons them as lost. Covers agent deaths when no broker event arrives."""
    claim_poll_s: Seconds = 2.0
    """While a call waits for the agent holding its request id's claim (``IN_PROGRESS``),
    read the claim this often: released (its holder went offline) means try again."""
    outcome_interval_s: Annotated[float, Meta(ge=0)] = 2.0
    """How often what this client saw of each agent goes to the brokers (``reach.outcome.<id>``:
    the delivery term of the score); 0: never."""
    max_retry_after_s: Annotated[float, Meta(ge=0)] = 5.0
    """An ``OVERLOADED`` route answer's ``retry_after_ms`` is waited out and the route asked
    again, up to this long in all per route (and never past a call's deadline)."""
    breaker: BreakerConfig = msgspec.field(default_factory=BreakerConfig)

    def clamp_timeout(self, timeout: float | None, timeout_hint: float | None = None) -> float:
        """``clamp(max(timeout, timeout_hint), min_timeout_s, max_timeout_s)``."""
        t = self.default_timeout_s if timeout is None else float(timeout)
        if timeout_hint is not None:
            t = max(t, timeout_hint)
        return min(max(t, self.min_timeout_s), self.max_timeout_s)

    def backoff(self, retry: int, rand: float) -> float:
        """Delay before retry number ``retry`` (1-based), ``rand`` in [0, 1) for jitter."""
        base = min(self.backoff_s * self.backoff_factor ** (retry - 1), self.backoff_max_s)
        return base * (0.5 + rand)  # ±50 % so synchronized callers spread out
