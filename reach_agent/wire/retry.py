"""The one retry rule: after an attempt ends, may the task go to another agent (or later)?

Pure: shared by :class:`reach_agent.Client` and the broker's compensation replay, driven by
:attr:`ReachError.retryable` for error replies. An attempt ends in one :data:`Outcome`:

- ``ok``: a result (or, with ``ack_mode="received"``, the receipt);
- ``error``: the agent (or broker) answered an error reply — retried only when the error
  is :attr:`~reach_agent.wire.errors.ReachError.retryable` (``TARGET_BUSY``, ``DRAINING``,
  ``OVERLOADED``, ``TIMEOUT``), never ``BIZ_REJECT``, ``LOOP_DETECTED``, ``INVALID_*``;
- ``not_delivered``: no receipt in time, ``no_responders``: nobody subscribed, ``lost``: the
  agent died while running it, ``timeout``: accepted but no result by the deadline — all
  retryable (the same request id keeps a late original and its retry from both running);
- ``closed``: the caller itself is shutting down — never retried.

Being full is not a failure: a refusal that says only that every slot is taken
(:attr:`~reach_agent.wire.errors.ReachError.full`: ``OVERLOADED`` from the broker, ``TARGET_BUSY``
from an agent) is waited out — the refusal's ``retry_after_ms``, else a short default,
jittered (:func:`full_wait`) — and asked again within the caller's deadline, without
counting against the retries (:func:`merely_full`).
"""

from __future__ import annotations

from typing import Literal

from .errors import ReachError

Outcome = Literal["ok", "error", "not_delivered", "no_responders", "timeout", "lost", "closed"]

RETRYABLE_OUTCOMES: frozenset[Outcome] = frozenset(
    {"not_delivered", "no_responders", "timeout", "lost"}
)
"""Outcomes without an error reply after which another agent may take the task."""


def retryable(outcome: Outcome, err: ReachError | None = None) -> bool:
    """Whether an attempt that ended in ``outcome`` (with ``err`` for ``error``) may be
    tried again elsewhere or later."""
    if outcome == "error":
        return err is not None and err.retryable
    return outcome in RETRYABLE_OUTCOMES


def merely_full(outcome: Outcome, err: ReachError | None) -> bool:
    """Whether the refusal (an attempt's error reply, or a route's) says only that every
    slot is taken: wait and ask again, no retry counted."""
    return outcome == "error" and err is not None and err.full


def full_wait(err: ReachError, default_s: float, cap_s: float, rand: float) -> float:
    """Seconds to wait after a :func:`merely_full` refusal: its ``retry_after_ms`` (else
    ``default_s``) times ``0.5 + rand`` (``rand`` in [0, 1): callers refused together do not
    come back together), at most ``cap_s``."""
    base = err.retry_after_ms / 1000.0 if err.retry_after_ms is not None else default_s
    return min(base * (0.5 + rand), cap_s)


def should_retry(
    outcome: Outcome,
    err: ReachError | None,
    *,
    retries_done: int,
    max_retries: int,
    time_left_s: float,
    min_attempt_s: float,
) -> bool:
    """The whole decision: retryable, retries left (a merely-full refusal needs none), and
    time for one more attempt."""
    return (
        retryable(outcome, err)
        and (retries_done < max_retries or merely_full(outcome, err))
        and time_left_s > min_attempt_s
    )
