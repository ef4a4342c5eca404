"""OpenTelemetry spans out of callers, agents and brokers (the optional extra ``otel``).

With ``OTEL_EXPORTER_OTLP_ENDPOINT`` (or ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``) set and the
extra installed, :func:`spans` gives a :class:`Spans` that exports over OTLP/HTTP (the
exporter reads the ``OTEL_EXPORTER_OTLP_*`` variables itself; ``OTEL_SERVICE_NAME`` names the
service, else ``reach-client``, ``reach-agent`` or ``reach-broker``); otherwise None, and
nothing of OpenTelemetry is imported. A :class:`~reach_agent.client.Client`, an
:class:`~reach_agent.agent.Agent` and a broker each take theirs at construction; their hooks
are an ``is not None`` test when it is None.

The spans of one call share a trace, linked through the ``traceparent`` the SDK already
propagates (:mod:`reach_agent.trace`): ``reach.call <capability>`` on the caller (kind
CLIENT; its ``traceparent`` is the one the call sends, on its task messages and its route
requests), ``reach.route <capability>`` on the broker that answered a route request (a child
of the call), ``reach.run <capability>`` on the agent (kind SERVER, a child of the call; the
handler's own sub-calls are its children) and ``reach.claim`` (the claim of the request id
before the handler runs, a child of the run). Attributes: ``reach.request_id``,
``reach.capability``, ``reach.agent_id`` (the agent that took the call, was picked first, or
runs it), and on failure ``reach.error.code`` with the span's status ERROR. A call with no
task and no ``traceparent`` of its own is a child of the application's current
OpenTelemetry span, if any.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any

log = logging.getLogger(__name__)

ENDPOINT_VARS = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")

CLIENT, SERVER, INTERNAL = "client", "server", "internal"
"""Span kinds, by name (OpenTelemetry's ``SpanKind`` is imported only when spans are on)."""

_BY_SERVICE: dict[str, Spans | None] = {}
"""One exporting provider per service name in a process, made on first use."""
_SAID: set[str] = set()
"""Warnings given once a process ("missing": the extra is not installed)."""


def wanted(env: Mapping[str, str] | None = None) -> bool:
    """Whether the environment asks for spans: an OTLP endpoint is set and the SDK is not
    disabled (``OTEL_SDK_DISABLED=true``)."""
    env = os.environ if env is None else env
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    return any(env.get(var) for var in ENDPOINT_VARS)


def spans(service: str) -> Spans | None:
    """The process's :class:`Spans` for ``service`` (``OTEL_SERVICE_NAME`` wins), or None
    when the environment asks for none, or the extra ``otel`` is missing (said once)."""
    if not wanted():
        return None
    name = os.environ.get("OTEL_SERVICE_NAME") or service
    if name not in _BY_SERVICE:
        _BY_SERVICE[name] = _make(name)
    return _BY_SERVICE[name]


def _make(service: str) -> Spans | None:
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError as exc:
        if any(_BY_SERVICE.values()) or "missing" in _SAID:
            return None
        _SAID.add("missing")
        log.warning("otel.unavailable %s is set but the OpenTelemetry SDK is not installed "
                    "(%s): no spans are exported; pip install 'nats-reach[otel]'",
                    next(v for v in ENDPOINT_VARS if os.environ.get(v)), exc.name)  # fmt: skip
        return None
    provider = TracerProvider(resource=Resource.create({"service.name": service}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    log.info("otel.exporting service=%s", service)
    return Spans(provider)


class Spans:
    """Starts and ends reach's spans on one OpenTelemetry tracer provider."""

    def __init__(self, provider: Any) -> None:
        from opentelemetry import trace as api
        from opentelemetry.trace import SpanKind, Status, StatusCode

        self.provider = provider
        self.tracer = provider.get_tracer("reach")
        self._api = api
        self._kinds = {CLIENT: SpanKind.CLIENT, SERVER: SpanKind.SERVER,
                       INTERNAL: SpanKind.INTERNAL}  # fmt: skip
        self._error = lambda message: Status(StatusCode.ERROR, message)

    def start(
        self, name: str, traceparent: str | None, kind: str, attributes: dict[str, str]
    ) -> Any:
        """A started span, a child of ``traceparent`` (a W3C header), else of the current
        OpenTelemetry context."""
        api = self._api
        parent = None
        if traceparent:
            parts = traceparent.split("-")
            if len(parts) == 4 and len(parts[1]) == 32 and len(parts[2]) == 16:
                try:
                    flags = api.TraceFlags(int(parts[3][:2], 16))
                    ctx = api.SpanContext(int(parts[1], 16), int(parts[2], 16), is_remote=True,
                                          trace_flags=flags)  # fmt: skip
                except ValueError:
                    ctx = None
                if ctx is not None and ctx.is_valid:
                    parent = api.set_span_in_context(api.NonRecordingSpan(ctx))
        return self.tracer.start_span(name, context=parent, kind=self._kinds[kind],
                                      attributes=attributes)  # fmt: skip

    @staticmethod
    def traceparent(span: Any) -> str:
        """The W3C ``traceparent`` naming ``span`` as the parent."""
        ctx = span.get_span_context()
        return f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{int(ctx.trace_flags):02x}"

    def end(self, span: Any, error: Any = None, **attributes: str | None) -> None:
        """End ``span``, with ``attributes`` (None values left out) and, for a
        :class:`~reach_agent.errors.ReachError` ``error``, its code and the ERROR status."""
        for key, value in attributes.items():
            if value is not None:
                span.set_attribute(f"reach.{key}", value)
        if error is not None:
            span.set_attribute("reach.error.code", getattr(error, "code", type(error).__name__))
            span.set_status(self._error(getattr(error, "message", str(error))))
        span.end()

    def flush(self, timeout_s: float = 5.0) -> None:
        """Export what is buffered (blocking: call it from a thread in async code)."""
        self.provider.force_flush(int(timeout_s * 1000))
