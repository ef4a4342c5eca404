"""Trace context that follows a task into its sub-calls, and into the SDK's log lines.

An agent runs each task with the task's :class:`TraceContext` in a context variable
(:data:`CURRENT`, set by :class:`~reach_agent.agent.serving.TaskServer`; asyncio tasks the handler
spawns and its worker thread inherit it). A :class:`~reach_agent.client.client.Client` call made
there adds the context's child headers to its own — ``Reach-Hops`` with this agent
appended, the task's ``Reach-Trace-Id``, and a ``traceparent`` of the same W3C trace with a
new parent id — so loops are caught downstream without passing headers by hand (headers
passed by hand win). A call outside any task starts a trace: a fresh ``traceparent`` and
``Reach-Trace-Id`` = its trace id, so every hop of a chain shares one trace id.

:class:`LogContext` is a :class:`logging.Filter` that gives each record ``request_id`` and
``trace_id`` (``-`` outside a task); the SDK's own loggers (:func:`logger`) also append
``request_id=…`` to a message inside a task that does not name it. Add one to your handler
to use ``%(request_id)s`` in a format for your own loggers.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from contextvars import ContextVar
from random import getrandbits

from .wire import schema

_TRACEPARENT = re.compile(r"^([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})")
_TRACE_ID = re.compile(r"[0-9a-f]{32}")
_ZERO_TRACE = "0" * 32
_ZERO_SPAN = "0" * 16


class TraceContext:
    """The task being run: its request id, the agent running it and the headers it came
    with (the child headers of its sub-calls are computed from them, when there is one)."""

    __slots__ = ("agent_id", "headers", "parent", "request_id", "steps")

    def __init__(self, request_id: str, agent_id: str, headers: Mapping[str, str]) -> None:
        self.request_id = request_id
        self.agent_id = agent_id
        self.headers = headers
        self.parent: str | None = None
        """The ``traceparent`` of the task's run span when spans are on (:mod:`.otel`): its
        sub-calls' spans are its children."""
        self.steps = 0
        """Flow steps begun for this task (:mod:`~reach_agent.client.flow`): their ids' numbers."""

    @property
    def trace_id(self) -> str | None:
        return self.headers.get(schema.H_TRACE_ID) or trace_id_of(
            self.headers.get(schema.H_TRACEPARENT)
        )

    def child_into(self, hdrs: dict[str, str]) -> None:
        """Add a sub-call's trace headers to ``hdrs``, keeping any already there."""
        if schema.H_HOPS not in hdrs:
            hops = self.headers.get(schema.H_HOPS)
            hdrs[schema.H_HOPS] = f"{hops},{self.agent_id}" if hops else self.agent_id
        trace_id = self.headers.get(schema.H_TRACE_ID)
        if trace_id and schema.H_TRACE_ID not in hdrs:
            hdrs[schema.H_TRACE_ID] = trace_id
        if schema.H_TRACEPARENT not in hdrs:
            hdrs[schema.H_TRACEPARENT] = child_traceparent(
                self.headers.get(schema.H_TRACEPARENT), trace_id
            )


CURRENT: ContextVar[TraceContext | None] = ContextVar("reach_trace", default=None)
"""The task the current code runs for (None outside any task)."""


def current() -> TraceContext | None:
    return CURRENT.get()


def outgoing(hdrs: dict[str, str], traceparent: str | None) -> None:
    """Complete a call's headers in place: the current task's child headers, then a
    ``traceparent`` (the caller's, else generated) and ``Reach-Trace-Id`` (else its trace
    id)."""
    if traceparent:
        hdrs[schema.H_TRACEPARENT] = traceparent
    ctx = CURRENT.get()
    if ctx is not None:
        ctx.child_into(hdrs)
    tp = hdrs.get(schema.H_TRACEPARENT)
    if not tp:
        trace_id = hdrs.get(schema.H_TRACE_ID)
        if trace_id is None:  # a new trace (the common case: no regex, one random draw)
            ids = f"{getrandbits(192):048x}"
            hdrs[schema.H_TRACEPARENT] = f"00-{ids[:32]}-{ids[32:]}-01"
            hdrs[schema.H_TRACE_ID] = ids[:32]
            return
        hdrs[schema.H_TRACEPARENT] = new_traceparent(trace_id)
    elif schema.H_TRACE_ID not in hdrs:
        trace_id = trace_id_of(tp)
        if trace_id:
            hdrs[schema.H_TRACE_ID] = trace_id


def trace_id_of(traceparent: str | None) -> str | None:
    """The trace id of a valid W3C ``traceparent``, else None."""
    if not traceparent:
        return None
    m = _TRACEPARENT.match(traceparent)
    if m is None or m.group(1) == "ff" or m.group(2) == _ZERO_TRACE or m.group(3) == _ZERO_SPAN:
        return None
    return m.group(2)


def new_traceparent(trace_id: str | None = None) -> str:
    """A fresh ``traceparent`` (version 00, sampled); of trace ``trace_id`` when that is a
    valid W3C trace id (32 lowercase hex digits, not all zero), else of a new random one.
    Ids come from :mod:`random` (unique, not secret: they are on the wire anyway)."""
    raw = f"{getrandbits(192):048x}"
    if not (trace_id and trace_id != _ZERO_TRACE and _TRACE_ID.fullmatch(trace_id)):
        trace_id = raw[:32]
    return f"00-{trace_id}-{raw[32:]}-01"


def child_traceparent(parent: str | None, trace_id: str | None = None) -> str:
    """The ``traceparent`` of a sub-call: the parent's trace and flags with a new parent id;
    a fresh one when ``parent`` is absent or not valid."""
    if parent and trace_id_of(parent):
        return f"00-{parent[3:35]}-{getrandbits(64):016x}-{parent[53:55]}"
    return new_traceparent(trace_id)


class LogContext(logging.Filter):
    """Gives each record ``request_id`` and ``trace_id`` from :data:`CURRENT` (``-``
    outside a task); with ``annotate`` also appends ``request_id=…`` to a message inside a
    task that does not name one (the SDK's loggers)."""

    def __init__(self, annotate: bool = False) -> None:
        super().__init__()
        self.annotate = annotate

    def filter(self, record: logging.LogRecord) -> bool:
        ctx = CURRENT.get()
        if ctx is None:
            if not hasattr(record, "request_id"):
                record.request_id = "-"
                record.trace_id = "-"
            return True
        record.request_id = ctx.request_id
        record.trace_id = ctx.trace_id or "-"
        msg = record.msg
        if self.annotate and isinstance(msg, str) and "request_id=" not in msg:
            rid = ctx.request_id.replace("%", "%%") if record.args else ctx.request_id
            record.msg = f"{msg} request_id={rid}"
        return True


_SDK_FILTER = LogContext(annotate=True)


def logger(name: str) -> logging.Logger:
    """``logging.getLogger(name)`` with the SDK's :class:`LogContext` on it."""
    log = logging.getLogger(name)
    log.addFilter(_SDK_FILTER)
    return log
