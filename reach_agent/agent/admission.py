"""What an agent does with a task message, decided before any I/O.

Pure (the clock is an argument), in the spirit of httpcore's connection pool: the task
subscription's callback asks :func:`admit` and then acts on the :class:`Admission` it gets —
reply, refuse or start the run. The order of the checks is the contract::

    duplicate Reach-Request-Id → the first result (or join the running one); with another
                                 body than the first: IDEMPOTENCY_MISMATCH
    draining                   → DRAINING
    Reach-Hops visits us > 3   → LOOP_DETECTED
    active == max_concurrency  → TARGET_BUSY
    bad Reach-Timeout-Ms / Reach-Ack-Mode / Reach-Parent-Id → INVALID_REQUEST
    otherwise                  → run (receipt first, if asked)
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Literal

from jetstream.acks import REQUEST_ID_PATTERN
from jetstream.names import H_REQUEST_ID
from reach_agent.wire import schema
from reach_agent.wire.errors import (
    Draining,
    IdempotencyMismatch,
    InvalidRequest,
    LoopDetected,
    ReachError,
    TargetBusy,
)

from .task import LOOP_LIMIT

Verdict = Literal["duplicate", "refuse", "run"]

_REQUEST_ID = re.compile(REQUEST_ID_PATTERN)


class Admission:
    """The decision about one task message."""

    __slots__ = ("ack_mode", "deadline", "error", "label", "receipt", "verdict")

    def __init__(
        self,
        verdict: Verdict,
        label: str,
        ack_mode: str,
        receipt: bool,
        error: ReachError | None = None,
        deadline: float | None = None,
    ) -> None:
        self.verdict = verdict
        self.label = label
        """The ``reach_agent_tasks_total`` result of a duplicate or a refusal."""
        self.ack_mode = ack_mode
        """``completed`` (reply with the result) or ``received`` (the receipt is the reply)."""
        self.receipt = receipt
        """Send a receipt (asked with ``Reach-Receipt: 1``, or implied by ack mode
        ``received``), when the message has a reply subject."""
        self.error = error
        """The error reply of a refusal."""
        self.deadline = deadline
        """The caller's deadline (``time.monotonic()``) of a run, if it sent one."""


def admit(
    headers: Mapping[str, str],
    *,
    agent_id: str,
    duplicate: bool,
    draining: bool,
    active: int,
    max_concurrency: int,
    now: float,
    mismatch: tuple[str, str] | None = None,
) -> Admission:
    """Decide what to do with a task carrying ``headers``; ``duplicate`` says whether its
    request id is in the duplicate window (``mismatch``: it is, with a body of another
    digest: (the first's, this one's)), ``active`` how many tasks run now."""
    ack_mode = headers.get(schema.H_ACK_MODE, "completed")
    receipt = headers.get(schema.H_RECEIPT) == "1" or ack_mode == "received"
    if duplicate and mismatch is not None:
        rid = headers.get(H_REQUEST_ID, "")
        err: ReachError = IdempotencyMismatch.reused(
            rid, *mismatch, seen=f"agent {agent_id!r}'s recent tasks"
        )
        return Admission("refuse", "mismatch", ack_mode, receipt, err)
    if duplicate:
        return Admission("duplicate", "duplicate", ack_mode, receipt)
    if draining:
        err = Draining(f"agent {agent_id!r} is draining: send elsewhere")
        return Admission("refuse", "draining", ack_mode, receipt, err)
    hops = headers.get(schema.H_HOPS)
    if hops and hops.split(",").count(agent_id) >= LOOP_LIMIT:
        err = LoopDetected(
            f"Reach-Hops {hops[:200]!r} already visits agent {agent_id!r} "
            f"{LOOP_LIMIT} times (limit {LOOP_LIMIT} per trace)"
        )
        return Admission("refuse", "loop", ack_mode, receipt, err)
    if active >= max_concurrency:
        err = TargetBusy(f"agent {agent_id!r} runs {active} tasks, its max_concurrency")
        return Admission("refuse", "busy", ack_mode, receipt, err)
    try:
        deadline = deadline_of(headers, now)
        if ack_mode not in ("completed", "received"):
            raise InvalidRequest(
                f"header Reach-Ack-Mode {ack_mode[:40]!r} is not 'completed' or 'received'"
            )
        parent = headers.get(schema.H_PARENT_ID)
        if parent is not None and _REQUEST_ID.match(parent) is None:
            raise InvalidRequest(f"header Reach-Parent-Id {parent[:40]!r} is not a request id "
                                 "(1-128 chars of [A-Za-z0-9_-])")  # fmt: skip
    except InvalidRequest as invalid:
        return Admission("refuse", "invalid", ack_mode, receipt, invalid)
    return Admission("run", "", ack_mode, receipt, deadline=deadline)


def deadline_of(headers: Mapping[str, str], now: float) -> float | None:
    """``now`` + ``Reach-Timeout-Ms``, or None without the header."""
    raw = headers.get(schema.H_TIMEOUT_MS)
    if raw is None:
        return None
    try:
        ms = int(raw)
    except ValueError:
        ms = -1
    if ms < 0:
        raise InvalidRequest(f"header Reach-Timeout-Ms {raw[:40]!r} is not a non-negative integer")
    return now + ms / 1000.0
