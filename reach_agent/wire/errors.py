"""The error tree of reach, and its mapping to and from the NATS Services error headers.

One root, :class:`ReachError`; subclasses grouped by cause, each with a wire ``code`` and the
HTTP-like status that goes in ``Nats-Service-Error-Code``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import msgspec


class ReachError(Exception):
    """Root of every error reach raises; ``code`` is the wire code."""

    code = "INTERNAL"
    status = 500
    retryable = False
    full = False
    """The refusal says only "not now": every slot is taken (``OVERLOADED``,
    ``TARGET_BUSY``), or a store the guarantee needs is not there yet
    (``STORE_UNAVAILABLE``): a caller waits a moment and asks again, within its deadline,
    without counting a retry."""
    extra: dict[str, Any] | None = None
    """Members the error reply's body carries beside ``error`` (with ``explain``, a route's
    ``NO_REACHABLE_AGENT`` carries its ``explain``)."""

    def __init__(
        self, message: str = "", *, code: str | None = None, retry_after_ms: int | None = None
    ) -> None:
        super().__init__(message or self.code)
        self.message = message or self.code
        if code is not None:
            self.code = code
        self.retry_after_ms = retry_after_ms
        """How long the refusing side suggests waiting before asking again (``OVERLOADED``:
        about a task's time), when it says; carried in the error body."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}(code={self.code!r}, message={self.message!r})"


# --- the request was wrong (caller's fault, never retried) -------------------------------


class RequestError(ReachError):
    """The request itself is at fault; retrying it unchanged fails again."""

    status = 400


class InvalidRequest(RequestError):
    code = "INVALID_REQUEST"


class InvalidCapability(RequestError):
    code = "INVALID_CAPABILITY"


class Forbidden(RequestError):
    code = "FORBIDDEN"
    status = 403


class LoopDetected(RequestError):
    code = "LOOP_DETECTED"
    status = 409


class Conflict(RequestError):
    """Another live process holds this agent_id: the announce is refused."""

    code = "CONFLICT"
    status = 409


class BizReject(RequestError):
    """The handler refused the task on business grounds: never retried."""

    code = "BIZ_REJECT"


class IdempotencyMismatch(RequestError):
    """The request id was used before with another task body (its digest is stored with the
    claim, the ack records and the queued entry): a request id names one request, so this
    one is refused rather than answered with the other body's result. Never retried."""

    code = "IDEMPOTENCY_MISMATCH"
    status = 422

    @classmethod
    def reused(cls, request_id: str, first: str, this: str, seen: str) -> IdempotencyMismatch:
        """The refusal of ``request_id`` sent with a body of digest ``this``, where ``seen``
        (the claim, the duplicate window, the queue) holds it with a body of digest
        ``first``."""
        return cls(
            f"request_id {request_id!r} was already used with another body (body digest "
            f"{first[:12]}..., this body {this[:12]}..., per {seen}): a request id names one "
            "request; send a new body with a new request id"
        )


class InputRequired(RequestError):
    """The agent needs more from the caller to go on (an A2A agent's ``input-required``):
    the message carries its question. reach has no second turn: send a new request."""

    code = "INPUT_REQUIRED"
    status = 422


class InProgress(ReachError):
    """Another agent holds the request id's claim and is running it: wait for its result
    (the holder's ack record) instead of running it again."""

    code = "IN_PROGRESS"
    status = 409

    def __init__(self, message: str = "", *, holder: str = "") -> None:
        super().__init__(message)
        self.holder = holder
        """The agent id holding the claim (``holder`` in the error body)."""


# --- nobody could take the task now (retryable elsewhere or later) -----------------------


class Unavailable(ReachError):
    status = 503
    retryable = True


class NoReachableAgent(Unavailable):
    code = "NO_REACHABLE_AGENT"
    retryable = False


class Overloaded(Unavailable):
    """Every agent that passes the route's filters is full (or the fleet is over the broker's
    in-flight ceiling); ``retry_after_ms`` says when to ask again."""

    code = "OVERLOADED"
    status = 429
    full = True

    def __init__(self, message: str = "", *, retry_after_ms: int | None = None) -> None:
        super().__init__(message)
        self.retry_after_ms = retry_after_ms
        """When asking again may succeed (``retry_after_ms`` in the error body), if known."""


class TargetBusy(Unavailable):
    code = "TARGET_BUSY"
    status = 429
    full = True


class Draining(Unavailable):
    code = "DRAINING"


class Timeout(Unavailable):
    code = "TIMEOUT"


class CompensationFull(Unavailable):
    code = "COMPENSATION_FULL"
    retryable = False


class StoreUnavailable(Unavailable):
    """A JetStream store a guarantee depends on is missing or not answering (the claims
    bucket ``reach_claims``, the compensation queue): nothing ran and nothing was stored.
    The message names the store and what to do; asked again after ``retry_after_ms``
    within the caller's deadline, without counting a retry (like a full agent), because
    the store usually comes back (a broker provisions it, a cluster elects a leader)."""

    code = "STORE_UNAVAILABLE"
    full = True

    def __init__(self, message: str = "", *, retry_after_ms: int | None = None) -> None:
        super().__init__(message, retry_after_ms=retry_after_ms)


class Cancelled(ReachError):
    """The request was cancelled (``Client.cancel``, ``reach cancel``, a cancelled call, its
    caller's deadline) before it finished; a cancelled request id never runs again."""

    code = "CANCELLED"
    status = 499  # the "client closed request" of nginx and gRPC's HTTP mapping


class StreamBroken(ReachError):
    """A streamed answer ended before its ``completed``: the agent died, or a chunk went
    missing. ``delivered`` chunks reached the reader; it is never re-run silently."""

    code = "STREAM_BROKEN"
    status = 502

    def __init__(self, message: str = "", *, delivered: int = 0) -> None:
        super().__init__(message)
        self.delivered = delivered
        """Chunks the reader got before the stream broke (``delivered`` in the error body)."""


class FlowFailed(ReachError):
    """A flow (:mod:`reach_agent.client.flow`) could not go on: a critical step failed (``step``,
    its error ``cause``), or a fan-out got fewer successes than its ``partial`` share
    (``fan_out``). On the wire only the code and the message travel."""

    code = "FLOW_FAILED"
    status = 424

    def __init__(
        self, message: str = "", *, step: Any = None, cause: ReachError | None = None,
        fan_out: Any = None,
    ) -> None:  # fmt: skip
        super().__init__(message)
        self.step = step
        """The :class:`~reach_agent.client.flow.Step` that failed (None for a fan-out)."""
        self.cause = cause
        self.fan_out = fan_out
        """The :class:`~reach_agent.client.flow.FanOut`, with its successes and failures."""


# --- our own fault ----------------------------------------------------------------------


class InternalError(ReachError):
    code = "INTERNAL"
    status = 500


_BY_CODE: dict[str, type[ReachError]] = {
    cls.code: cls
    for cls in (
        InvalidRequest,
        InvalidCapability,
        Forbidden,
        LoopDetected,
        Conflict,
        BizReject,
        IdempotencyMismatch,
        InputRequired,
        InProgress,
        NoReachableAgent,
        Overloaded,
        TargetBusy,
        Draining,
        Timeout,
        CompensationFull,
        StoreUnavailable,
        Cancelled,
        StreamBroken,
        FlowFailed,
        InternalError,
    )
}
ERROR_CODES = frozenset(_BY_CODE)

H_SERVICE_ERROR = "Nats-Service-Error"
H_SERVICE_ERROR_CODE = "Nats-Service-Error-Code"


class _ErrorBody(msgspec.Struct):
    """An error body, read and written: a peer may leave fields out."""

    code: str = "INTERNAL"
    message: str = ""
    # Written only by the codes that carry them (absent, not null, otherwise).
    holder: str | msgspec.UnsetType = msgspec.UNSET
    """``IN_PROGRESS``: the agent holding the claim."""
    delivered: int | msgspec.UnsetType = msgspec.UNSET
    """``STREAM_BROKEN``: chunks delivered before the break."""
    retry_after_ms: Any = msgspec.UNSET
    """``OVERLOADED`` (and any refusal that has a hint): when to ask again. Read leniently:
    a hint of the wrong type is no hint."""


class _ErrorReply(msgspec.Struct):
    error: _ErrorBody


_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder(_ErrorReply)


def error_for(
    code: str,
    message: str,
    *,
    holder: str | None = None,
    delivered: int | None = None,
    retry_after_ms: int | None = None,
) -> ReachError:
    """The exception of a wire ``code`` (unknown codes become :class:`ReachError`)."""
    cls = _BY_CODE.get(code)
    err: ReachError
    if cls is None:
        err = ReachError(message, code=code)
    elif cls is InProgress:
        err = InProgress(message, holder=holder or "")
    elif cls is StreamBroken:
        err = StreamBroken(message, delivered=delivered or 0)
    else:
        err = cls(message)
    err.retry_after_ms = retry_after_ms
    return err


def to_reply(err: ReachError) -> tuple[dict[str, str], bytes]:
    """Headers and body of an error reply (the NATS Services API convention)."""
    headers = {
        H_SERVICE_ERROR: err.message[:1024],
        H_SERVICE_ERROR_CODE: str(err.status),
    }
    error = _ErrorBody(
        code=err.code, message=err.message,
        holder=err.holder if isinstance(err, InProgress) else msgspec.UNSET,
        delivered=err.delivered if isinstance(err, StreamBroken) else msgspec.UNSET,
        retry_after_ms=msgspec.UNSET if err.retry_after_ms is None else err.retry_after_ms,
    )  # fmt: skip
    if err.extra:
        return headers, _encoder.encode({"error": error, **err.extra})
    return headers, _encoder.encode(_ErrorReply(error=error))


def from_status(status: int, message: str) -> ReachError:
    """The reach error of an HTTP-like status from a peer that does not speak reach (a
    Synadia agent's error frame): 429/503 → ``TARGET_BUSY``, 401/403 → ``FORBIDDEN``,
    408/504 → ``TIMEOUT``, other 4xx → ``BIZ_REJECT``, anything else ``INTERNAL``."""
    text = message or f"status {status}"
    if status in (429, 503):
        return TargetBusy(text)
    if status in (401, 403):
        return Forbidden(text)
    if status in (408, 504):
        return Timeout(text)
    if 400 <= status < 500:
        return BizReject(text)
    return InternalError(text)


def from_reply(headers: Mapping[str, str] | None, data: bytes) -> ReachError | None:
    """The error carried by a reply, or ``None`` when the reply is a success."""
    if not headers or H_SERVICE_ERROR_CODE not in headers:
        return None
    message = headers.get(H_SERVICE_ERROR, "")
    try:
        body = _decoder.decode(data)
    except msgspec.MsgspecError:
        status = headers.get(H_SERVICE_ERROR_CODE, "500")
        return ReachError(message or f"service error {status}", code="INTERNAL")
    e = body.error
    hint = e.retry_after_ms
    ok = isinstance(hint, int | float) and not isinstance(hint, bool) and 0 <= hint < 3.6e6
    return error_for(
        e.code, e.message or message,
        holder=e.holder if isinstance(e.holder, str) else None,
        delivered=e.delivered if isinstance(e.delivered, int) else None,
        retry_after_ms=int(hint) if ok else None,
    )  # fmt: skip
