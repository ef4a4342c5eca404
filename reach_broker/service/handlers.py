"""The broker's inbound messages: one handler each, and one place their failures are answered.

A handler (:class:`Handlers`) is synchronous: it decodes, validates, asks the registry or
the router, hands transitions to the broker's pipeline and returns the reply body (or None), raising
a :class:`~reach_agent.wire.errors.ReachError` to refuse. :class:`Endpoint` runs it and sends the
reply after the decision; :meth:`Endpoint.failure` is the one place an exception becomes an
error reply (the NATS Services headers) and a count, as ``nats.micro``'s endpoint does.

Before any handler runs, :class:`Endpoint` drops (and counts in ``reach_dropped_total``) two
kinds of message the server's permissions cannot stop, because nats-server never checks a
message's reply subject against its sender's rights: a copy of a stored message (a
``Nats-Stream`` header: JetStream answered a direct get onto this subject), and a request
whose reply subject is not an inbox (answering it would publish with the broker's rights
wherever the requester chose: an agent's task subject, the JetStream API).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any

import msgspec
from nats.aio.msg import Msg
from nats.micro.request import Request

from jetstream.names import H_REQUEST_ID, H_STREAM
from reach_agent.wire import schema
from reach_agent.wire.errors import (
    Forbidden,
    InternalError,
    InvalidRequest,
    Overloaded,
    ReachError,
    to_reply,
)
from reach_agent.wire.schema import (
    H_TRACEPARENT,
    MAX_BODY_BYTES,
    AnnounceAck,
    Ok,
    check_agent_id,
    check_capability,
    decode,
)
from reach_agent.wire.subjects import is_inbox
from reach_broker.core.explain import Explainer
from reach_broker.core.quotas import Quotas, caller_of
from reach_broker.core.records import AgentRecord
from reach_broker.core.registry import Registry
from reach_broker.core.routing import Router

from .context import BrokerContext
from .metrics import HandlerMetrics

log = logging.getLogger(__name__)

DEFAULT_ROUTE_REQUEST = schema.RouteRequest()
"""An empty route body (``nats req reach.route.cap ''``) means every default."""

COMMON_ROUTE_BODIES = {
    b"": DEFAULT_ROUTE_REQUEST,
    b"{}": DEFAULT_ROUTE_REQUEST,
    schema.encoder.encode(schema.RouteRequest(peek=True)): schema.RouteRequest(peek=True),
}
"""Route bodies answered without a decode: every default, and a peek with every default."""

OK_REPLY = schema.encoder.encode(Ok())

Handle = Callable[..., bytes | None]
"""A handler: (subject, body) -> reply body, or None for no reply; raises to refuse. An
endpoint that names its callers (``caller_of``) calls it with (subject, body, caller)."""

Dropped = Callable[[str], Any]
"""The ``reach_dropped_total`` child of one endpoint, by reason."""


class NoToken(Forbidden):
    """A leave without the agent's token, refused while the server enforces identities."""

    drop_reason = "no_token"


def drop_reason(err: ReachError) -> str:
    """The ``reason`` label a refusal is counted under."""
    return getattr(err, "drop_reason", None) or (
        "forbidden" if err.code == "FORBIDDEN" else "invalid"
    )


ANSWER_IN_A_ROW = 32
"""Requests an endpoint answers before it lets the event loop run. nats-py runs a
subscription's callbacks back to back while messages are queued, and writes what they
published only when the loop turns (its flusher is a task): the first reply to a read of 64
route requests waited until all 64 were answered, and the requesters, who each wait for
theirs, sat idle meanwhile. The load test's short run at 10,000 agents (64 requesters),
alternated: route/echo 0.77-0.83 every 32 against 0.71-0.76 without (every 16: 0.70-0.79,
the loop's turns costing more than they give)."""


class Endpoint:
    """One inbound subject: its handler, and how its failures are counted and answered."""

    __slots__ = (
        "_answered",
        "_dropped",
        "_failed",
        "_handle",
        "_log_refusal",
        "_nc",
        "_refused",
        "_replies",
        "_spans",
        "_timed",
        "caller_of",
        "name",
    )

    def __init__(
        self,
        name: str,
        handle: Handle,
        ctx: BrokerContext,
        *,
        refused: Callable[[ReachError], Any] | None,
        failed: Any | None,
        replies: bool = True,
        log_refusal: tuple[int, str] | None = None,
        timed: Any | None = None,
        dropped: Dropped | None = None,
        caller_of: Callable[[dict[str, str] | None, str | None], str] | None = None,
        spans: Any = None,
    ) -> None:
        self.name = name
        self.caller_of = caller_of
        """Who sent a request, from its headers and reply subject (the route endpoint)."""
        self._handle = handle
        self._nc = ctx.nc
        self._refused = refused
        """The counter of a refusal (a ReachError), chosen by the error."""
        self._failed = failed
        """The counter of any other exception (a bug: logged with its traceback)."""
        self._replies = replies
        """Whether failures are answered (heartbeats are not, even with a reply subject)."""
        self._log_refusal = log_refusal
        """(level, event) a refusal is logged at, if at all."""
        self._timed = timed
        """A histogram of the time to answer, if any."""
        self._dropped = dropped
        """``reach_dropped_total{kind=<this endpoint>}`` by reason, if it counts there."""
        self._spans = spans
        """The route endpoint's OpenTelemetry spans (:mod:`reach_agent.otel`; None: off)."""
        self._answered = 0
        """Requests answered (every :data:`ANSWER_IN_A_ROW`th lets the loop run)."""

    def drop(self, reason: str, subject: str) -> None:
        """A message refused before its handler: counted and logged (at the refusal level)."""
        if self._dropped is not None:
            self._dropped(reason).inc()
        level = self._log_refusal[0] if self._log_refusal else logging.INFO
        if log.isEnabledFor(level):
            log.log(level, "%s.dropped subject=%s reason=%s", self.name, subject, reason)

    def _admit(self, subject: str, headers: dict[str, str] | None, reply: str | None) -> bool:
        """Whether a message may reach the handler (see the module docstring)."""
        if headers is not None and H_STREAM in headers:
            self.drop("stored_copy", subject)
            return False
        if reply and self._replies and not is_inbox(reply):
            self.drop("reply_subject", subject)
            return False
        return True

    def failure(self, subject: str, exc: Exception) -> tuple[bytes, dict[str, str]] | None:
        """What a handler's exception answers — (body, error headers), or None when this
        endpoint does not answer failures — counted and logged. The one place an exception
        becomes an error reply: a ReachError is a refusal, anything else a bug (INTERNAL)."""
        if isinstance(exc, ReachError):
            err = exc
            if self._refused is not None:
                self._refused(err).inc()
            if self._dropped is not None:
                self._dropped(drop_reason(err)).inc()
            if self._log_refusal is not None and log.isEnabledFor(self._log_refusal[0]):
                log.log(self._log_refusal[0], "%s subject=%s error=%s", self._log_refusal[1],
                        subject, err.message)  # fmt: skip
        else:
            if self._failed is not None:
                self._failed.inc()
            if self._dropped is not None:
                self._dropped("error").inc()
            log.error("%s.failed subject=%s", self.name, subject, exc_info=exc)
            err = InternalError(f"{self.name} failed: {exc!r}")
        if not self._replies:
            return None
        headers, body = to_reply(err)
        return body, headers

    async def on_message(self, msg: Msg) -> None:
        """Callback of a plain subscription (announce, heartbeat, leave)."""
        if not self._admit(msg.subject, msg.headers, msg.reply):
            return
        try:
            body = self._handle(msg.subject, msg.data)
        except Exception as exc:  # noqa: BLE001 - answered by failure(), never kills the sub
            reply = self.failure(msg.subject, exc)
            if reply is not None and msg.reply:
                await self._nc.publish(msg.reply, reply[0], headers=reply[1])
            return
        if body is not None and msg.reply:
            await self._nc.publish(msg.reply, body)

    async def on_request(self, req: Request) -> None:
        """Handler of a NATS Services endpoint (route, agents)."""
        # nats.micro's Request keeps the message private (its properties read it again at
        # every use); its reply subject is what respond() publishes to.
        msg = req._msg
        subject, headers = msg.subject, msg.headers
        if not self._admit(subject, headers, msg.reply):
            return
        span = None
        if self._spans is not None and headers and H_TRACEPARENT in headers:
            span = self._span(subject, headers)
        t0 = time.perf_counter()
        try:
            if self.caller_of is not None:
                body = self._handle(subject, msg.data, self.caller_of(headers, msg.reply))
            else:
                body = self._handle(subject, msg.data)
        except Exception as exc:  # noqa: BLE001 - answered by failure(), never kills the sub
            reply = self.failure(subject, exc)
            if reply is not None:
                await req.respond(reply[0], headers=reply[1])
            if span is not None:
                self._end_span(span, None, exc)
        else:
            await req.respond(body or b"")
            if span is not None:
                self._end_span(span, body, None)
        if self._timed is not None:
            self._timed.observe(time.perf_counter() - t0)
        self._answered += 1
        if self._answered % ANSWER_IN_A_ROW == 0:
            await asyncio.sleep(0)  # the replies so far written now, not after the queue's

    def _span(self, subject: str, headers: dict[str, str]) -> Any:
        """The ``reach.route`` span of a traced call's route request (a child of the call's
        span, :mod:`reach_agent.otel`)."""
        assert self._spans is not None
        capability = subject.rpartition(".")[2]
        return self._spans.start(f"reach.route {capability}", headers[H_TRACEPARENT], "server",
                                 {"reach.capability": capability,
                                  "reach.request_id": headers.get(H_REQUEST_ID, "")})  # fmt: skip

    def _end_span(self, span: Any, body: bytes | None, exc: Exception | None) -> None:
        """End a route span, naming the first candidate of the reply (or the error)."""
        assert self._spans is not None
        agent = None
        if body:
            with contextlib.suppress(msgspec.DecodeError, msgspec.ValidationError, IndexError):
                agent = schema.route_reply_decoder.decode(body).candidates[0].agent_id
        self._spans.end(span, exc, agent_id=agent)


class Handlers:
    """The broker's handlers over its registry and router."""

    def __init__(self, ctx: BrokerContext, registry: Registry, router: Router, quotas: Quotas,
                 explainer: Explainer, metrics: HandlerMetrics, *,
                 on_unknown: Callable[[str], None], announced: Callable[[AgentRecord], None],
                 spans: Any = None) -> None:  # fmt: skip
        self.ctx, self.registry, self.router = ctx, registry, router
        self.quotas, self.explainer = quotas, explainer
        self.metrics = m = metrics
        self.on_unknown = on_unknown
        """Told of a heartbeat from an agent this broker does not know (or whose token it
        cannot verify): the re-announce request (:mod:`reach_broker.service.identity`)."""
        self.announced = announced
        """Told of every accepted announce, also one that moves no state (the snapshot
        stores what was announced)."""
        self._route_refused = {
            "NO_REACHABLE_AGENT": m.route_result["no_agent"],
            "OVERLOADED": m.route_result["overloaded"],
        }
        self._route_invalid = m.route_result["invalid"]
        self._route_ok = m.route_result["ok"]
        self._hb_decode = schema.heartbeat_decoder.decode
        self._heartbeat = registry.heartbeat
        self._hb_result = m.heartbeat_result
        # A heartbeat the registry does not accept is also a refusal (bound once: a forged
        # storm must not cost a label lookup per message).
        self._hb_dropped = {r: m.refused.labels("heartbeat", r)
                            for r in ("forged", "stale", "unknown")}  # fmt: skip
        self._clock, self._wall, self._emit = ctx.clock, ctx.wall, ctx.emit
        self.route_counts: dict[str, int] = {}
        """Route requests answered per capability since start (the console's charts read
        them on their tick; a capability is counted only once it has had agents)."""
        link = ctx.link
        # While the server enforces identities (link.secured) a leave must carry the agent's
        # token, since the server lets anyone's reply land on ``reach.leave.<id>``
        # (JetStream's acknowledgement of a publish decodes as a leave), and a caller is
        # named by its inbox.
        self._link = link
        invalid_hb = m.heartbeat_result["invalid"]

        def dropped(kind: str) -> Dropped:
            return lambda reason: m.refused.labels(kind, reason)

        self.endpoints = {
            "announce": Endpoint(
                "announce", self.announce, ctx, refused=lambda _: m.announce_result["invalid"],
                failed=m.announce_result["error"], log_refusal=(logging.INFO, "announce.refused"),
                dropped=dropped("announce"),
            ),
            "heartbeat": Endpoint(
                "heartbeat", self.heartbeat, ctx, refused=lambda _: invalid_hb, failed=invalid_hb,
                replies=False, log_refusal=(logging.DEBUG, "heartbeat.dropped"),
                dropped=dropped("heartbeat"),
            ),
            "leave": Endpoint(
                "leave", self.leave, ctx, refused=lambda _: m.leaves.labels("invalid"),
                failed=m.leaves.labels("error"), log_refusal=(logging.INFO, "leave.refused"),
                dropped=dropped("leave"),
            ),
            "route": Endpoint(
                "route", self.route, ctx, refused=self._route_counter,
                failed=m.route_result["error"], timed=m.route_duration, dropped=dropped("route"),
                caller_of=lambda headers, reply: caller_of(headers, reply, link.secured),
                spans=spans,
            ),
            "agents": Endpoint("agents", self.agents, ctx, refused=None, failed=None,
                               dropped=dropped("agents")),
        }  # fmt: skip
        """Every inbound subject's endpoint, by name."""

    def _route_counter(self, err: ReachError) -> Any:
        return self._route_refused.get(err.code, self._route_invalid)

    def announce(self, subject: str, data: bytes) -> bytes:
        return self.apply_announce(self.parse_announce(subject, data))

    def parse_announce(self, subject: str, data: bytes) -> schema.Announce:
        agent_id = self.ctx.subjects.agent_of_announce(subject)
        check_agent_id(agent_id, "subject agent_id")
        ann = schema.validate_announce(decode(schema.announce_decoder, data, "announce"), agent_id)
        if ann.agent_type == schema.PROTOCOL_SYNADIA:
            raise InvalidRequest(
                f"agent_type {ann.agent_type!r} is reserved for Synadia Agent Protocol agents "
                "the broker discovers itself (on $SRV.INFO.agents)"
            )
        return ann

    def apply_announce(self, ann: schema.Announce) -> bytes:
        """Register ``ann`` (already validated); the ``AnnounceAck`` body."""
        ctx = self.ctx
        agent_id = ann.agent_id
        rec, transitions = self.registry.announce(ann, ctx.clock(), ctx.wall_ms())
        self.metrics.announce_result["ok"].inc()
        self.announced(rec)
        if transitions:
            ctx.emit(transitions)
        ack = AnnounceAck(
            agent_id=agent_id, token=rec.token,
            heartbeat_interval_ms=int(rec.interval_s * 1000), broker_id=ctx.broker_id,
        )  # fmt: skip
        return schema.encoder.encode(ack)

    def heartbeat(self, subject: str, data: bytes) -> None:
        # The hottest path (every agent, every interval): collaborators bound in __init__,
        # and schema.decode / validate_heartbeat called only to word a refusal.
        try:
            if not data or len(data) > MAX_BODY_BYTES:
                raise msgspec.DecodeError
            hb = self._hb_decode(data)
        except msgspec.MsgspecError:
            hb = decode(schema.heartbeat_decoder, data, "heartbeat")  # raises, naming why
        agent_id = subject[subject.rfind(".") + 1 :]  # plain or mapped: the last token
        if hb.agent_id != agent_id:
            schema.validate_heartbeat(hb, agent_id)  # raises, naming both
        result, transitions = self._heartbeat(hb, self._clock(), int(self._wall() * 1000))
        self._hb_result[result].inc()
        if result != "accepted":
            self._hb_dropped[result].inc()
            if result == "unknown" or result == "forged":
                self.on_unknown(hb.agent_id)
        if transitions:
            self._emit(transitions)

    def leave(self, subject: str, data: bytes) -> bytes:
        ctx = self.ctx
        agent_id = ctx.subjects.agent_of_leave(subject)
        check_agent_id(agent_id, "subject agent_id")
        body = decode(schema.leave_decoder, data, "leave")
        if body.agent_id is not None and body.agent_id != agent_id:
            raise InvalidRequest(
                f"agent_id {body.agent_id!r} in the body disagrees with the subject's {agent_id!r}"
            )
        if body.token is None and self._link.secured:
            raise NoToken(f"leave for agent_id {agent_id!r} carries no token (required while "
                          "the server enforces identities)")  # fmt: skip
        if body.token is not None and not self.registry.signer.verify(agent_id, body.token):
            raise Forbidden(f"token does not verify for agent_id {agent_id!r}")
        transitions = self.registry.leave(agent_id, ctx.clock(), body.reason or "leave")
        self.metrics.leaves.labels("ok").inc()
        if transitions:
            ctx.emit(transitions)
        return OK_REPLY

    def route(self, subject: str, data: bytes, caller: str = "") -> bytes:
        ctx = self.ctx
        capability = ctx.subjects.capability_of_route(subject)
        if capability not in self.registry.indexes:
            check_capability(capability)
        quotas = self.quotas
        if quotas.active:
            retry_after_ms = quotas.admit(caller, capability, ctx.clock())
            if retry_after_ms is not None:
                self.metrics.quota_refused.labels(capability, quotas.label(caller)).inc()
                raise Overloaded(
                    f"caller {caller!r} is over its quota for {capability!r}; retry in "
                    f"{retry_after_ms} ms", retry_after_ms=retry_after_ms,
                )  # fmt: skip
        rreq = COMMON_ROUTE_BODIES.get(data)  # the common cases: no decode, no validation
        if rreq is None:
            rreq = schema.validate_route_request(
                decode(schema.route_request_decoder, data, "route request")
            )
            if rreq.explain:
                body = self.explainer.route_reply(capability, rreq, ctx.clock(), ctx.wall_ms())
                self._route_ok.inc()
                return body
        body = self.router.route_reply(capability, rreq, ctx.clock(), ctx.wall_ms())
        self._route_ok.inc()
        counts = self.route_counts
        counts[capability] = counts.get(capability, 0) + 1
        return body

    def agents(self, subject: str, data: bytes) -> bytes:
        areq = decode(schema.agents_request_decoder, data, "agents request")
        if areq.capability is not None:
            check_capability(areq.capability)
        ctx = self.ctx
        if areq.limit is not None or areq.cursor is not None:
            raise InvalidRequest(
                f"reach.agents lists the answering broker's agents in one reply: page with "
                f"limit and cursor on {ctx.subjects.agent_page(0)} (see docs/protocol.md)"
            )
        views = self.registry.views(
            ctx.wall_ms(), ctx.clock(), capability=areq.capability, state=areq.state
        )
        body = schema.encoder.encode(views)
        if len(body) > ctx.nc.max_payload:
            # Past ~37,000 agents the list outgrows NATS' max payload: say so, not time out.
            raise InvalidRequest(
                f"{len(views)} agents make a {len(body)}-byte reply, above the server's "
                f"max_payload {ctx.nc.max_payload}: page through "
                f"{ctx.subjects.agent_page(0)} (see docs/protocol.md)"
            )
        return body
