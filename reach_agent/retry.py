"""The one retry rule: after an attempt ends, may the task go to another agent (or later)?

Pure: shared by :class:`reach_agent.Client` and the broker's compensation replay, driven by
:attr:`ReachError.retryable` for error replies. An attempt ends in one :data:`Outcome`:

- ``ok``: a result (or, with ``ack_mode="received"``, the receipt);
- ``error``: the agent (or broker) answered an error reply — retried only when the error
  is :attr:`~reach_agent.errors.ReachError.retryable` (``TARGET_BUSY``, ``DRAINING``,
  ``OVERLOADED``, ``TIMEOUT``), never ``BIZ_REJECT``, ``LOOP_DETECTED``, ``INVALID_*``;
- ``not_delivered``: no receipt in time, ``no_responders``: nobody subscribed, ``lost``: the
  agent died while running it, ``timeout``: accepted but no result by the deadline — all
  retryable (the same request id keeps a late original and its retry from both running);
- ``closed``: the caller itself is shutting down — never retried.
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


def should_retry(
    outcome: Outcome,
    err: ReachError | None,
    *,
    retries_done: int,
    max_retries: int,
    time_left_s: float,
    min_attempt_s: float,
) -> bool:
    """The whole decision: retryable, retries left, and time for one more attempt."""
    return retryable(outcome, err) and retries_done < max_retries and time_left_s > min_attempt_s
