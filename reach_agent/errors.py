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
    """The refusal says only that every slot is taken now (``OVERLOADED``, ``TARGET_BUSY``):
    a caller waits a moment and asks again, within its deadline, without counting a retry."""

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


class BizReject(RequestError):
    """The handler refused the task on business grounds: never retried."""

    code = "BIZ_REJECT"


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
        BizReject,
        NoReachableAgent,
        Overloaded,
        TargetBusy,
        Draining,
        Timeout,
        CompensationFull,
        InternalError,
    )
}
ERROR_CODES = frozenset(_BY_CODE)

H_SERVICE_ERROR = "Nats-Service-Error"
H_SERVICE_ERROR_CODE = "Nats-Service-Error-Code"


class _ErrorBody(msgspec.Struct):
    """An error body as read: lenient, a peer may leave fields out."""

    code: str = "INTERNAL"
    message: str = ""
    retry_after_ms: Any = None  # a hint of the wrong type is no hint


class _ErrorReply(msgspec.Struct):
    error: _ErrorBody


class _ErrorBodyOut(msgspec.Struct, omit_defaults=True):
    """An error body as written: code and message always, the hint only when given."""

    code: str
    message: str
    retry_after_ms: int | None = None


class _ErrorReplyOut(msgspec.Struct):
    error: _ErrorBodyOut


_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder(_ErrorReply)


def error_for(code: str, message: str, retry_after_ms: int | None = None) -> ReachError:
    """The exception of a wire ``code`` (unknown codes become :class:`ReachError`)."""
    cls = _BY_CODE.get(code)
    if cls is None:
        return ReachError(message, code=code, retry_after_ms=retry_after_ms)
    return cls(message, retry_after_ms=retry_after_ms)


def to_reply(err: ReachError) -> tuple[dict[str, str], bytes]:
    """Headers and body of an error reply (the NATS Services API convention)."""
    headers = {
        H_SERVICE_ERROR: err.message[:1024],
        H_SERVICE_ERROR_CODE: str(err.status),
    }
    body = _encoder.encode(_ErrorReplyOut(error=_ErrorBodyOut(
        code=err.code, message=err.message, retry_after_ms=err.retry_after_ms)))  # fmt: skip
    return headers, body


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
    hint = body.error.retry_after_ms
    ok = isinstance(hint, int | float) and not isinstance(hint, bool) and 0 <= hint < 3.6e6
    return error_for(body.error.code, body.error.message or message, int(hint) if ok else None)
