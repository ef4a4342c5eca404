"""The caller side: route by capability, call with receipts, retry, break circuits.

A call moves CREATED → SENT → ACKED → PROCESSING → FINISHED / TIMEOUT / FAILED:

* SENT: the task goes to the first candidate (the broker's weighted order) whose breaker is
  not open, with ``Reach-Receipt: 1`` and the same ``Reach-Request-Id`` on every attempt.
* ACKED: the agent's receipt arrived within ``ack_timeout_s``. No receipt (or no
  responders) means "not delivered": the next candidate is tried at once.
* PROCESSING: wait for the result up to the call's deadline. If the broker reports the
  agent ``offline``/``evicted``, or ``suspect`` and it does not answer our probe, the attempt
  is abandoned as lost and retried elsewhere instead of waiting out the deadline.
* Retries (at most ``retries``) follow :mod:`reach_agent.wire.retry`: error replies whose
  ``ReachError.retryable`` is set (TIMEOUT, TARGET_BUSY, DRAINING, OVERLOADED), not delivered
  and lost targets; never BIZ_REJECT or another error. A retry goes at once to a candidate
  not tried yet; when every candidate was tried it waits an exponential, jittered backoff
  that must fit inside the deadline.
* Full is not failed: when the broker answers OVERLOADED (every candidate is full) or every
  candidate answered TARGET_BUSY, the call waits the refusal's ``retry_after_ms`` (else
  ``busy_wait_s``), jittered, and asks again — until the deadline, without counting retries.

Every attempt of a call replies to its own subject under one client-wide inbox
subscription (:class:`~reach_agent.wire.subjects.ReplyInbox`), so the receipt and the result are
both received (``nc.request`` would keep only the first), and a late result of an earlier
attempt still finishes the call.

The parts: :mod:`~reach_agent.client.calls` (one call, and how an attempt ends),
:mod:`~reach_agent.client.attemptloop` (the attempts of one call, until the retry rule says stop),
:mod:`~reach_agent.client.attempts` (sending one attempt, and its bookkeeping),
:mod:`~reach_agent.client.holder` (waiting for the holder of a claim, on ``IN_PROGRESS``),
:mod:`~reach_agent.client.streaming` (streamed answers),
:mod:`~reach_agent.client.routes` (route requests and their cache),
:mod:`~reach_agent.client.liveness`
(the watch over agents running our calls), :mod:`~reach_agent.client.breaker` (circuit breakers and
what counts as a failure), :mod:`~reach_agent.wire.retry` (what is retried). This module wires
them to NATS.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from types import TracebackType
from typing import Any, NamedTuple, Unpack

import msgspec
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from jetstream import audit
from jetstream.names import H_REQUEST_ID
from reach_agent import otel, results, trace
from reach_agent.aio import TaskSet
from reach_agent.connection import (
    CredentialOptions,
    Credentials,
    NotConnected,
    connect,
    connect_options,
    drain_or_close,
    flush_subscriptions,
)
from reach_agent.metrics import ClientMetrics
from reach_agent.wire import schema, streams
from reach_agent.wire.errors import (
    Forbidden,
    InternalError,
    InvalidRequest,
    NoReachableAgent,
    ReachError,
    Timeout,
)
from reach_agent.wire.subjects import ReplyInbox, Subjects

from . import durable, streaming
from .attemptloop import AttemptLoop
from .attempts import Attempts
from .breaker import Breakers
from .calls import AckMode, Call, encode_payload
from .cancel import Cancels
from .config import ClientConfig
from .holder import Holders
from .liveness import Liveness
from .outcomes import OutcomeBook, OutcomeReporter
from .routes import Routes, RouteSource
from .tables import TableRoutes

log = trace.logger(__name__)

STORED_READ_S = 1.0
"""How long a timed-out call reads the final records its agents stored (together), at most:
never past its deadline by more than :data:`PAST_DEADLINE_S`."""
PAST_DEADLINE_S = 0.1
"""How far past its deadline a call's read of the stored records may run: a read at the
deadline that took its whole second (a slow store) ended calls 1 s late (nemesis seed 66:
two at 11.0 s of a 10 s deadline)."""
STORED_AUTHORS = 8
"""At most this many agents' records read (the taker first): one subject each."""


class RunAgain:
    """What a call waiting for its record learns when nobody runs its request (its claim
    released unfinished or not stored, or every agent refusing it late): try again
    (:meth:`Client._wait_record`)."""


RUN_AGAIN = RunAgain()


class Answered(NamedTuple):
    """A late reply to one of a call's attempts, read while it waited for its record: its
    answer (``outcome`` ``ok`` with the result, or ``error`` with the error)."""

    outcome: str
    value: Any


class Client:
    """``async with Client() as c: await c.call("cap", payload)``.

    ``servers`` defaults to ``NATS_URL`` or ``nats://127.0.0.1:4222``; pass ``nc`` to share
    a connection you own. ``metrics`` (a :class:`ClientMetrics`) is off by default.
    ``creds``, ``nkey_seed``, ``user``/``password``, ``token`` and ``tls_*`` are the
    credentials of the client's own connection (unset: ``NATS_CREDS``, ... from the
    environment; see :class:`~reach_agent.connection.Credentials`). ``routes``: where its
    routes come from (default: a broker's ``<prefix>.route.<capability>``).
    """

    def __init__(
        self,
        servers: str | Sequence[str] | None = None,
        config: ClientConfig | None = None,
        metrics: ClientMetrics | None = None,
        *,
        name: str | None = None,
        nc: NATS | None = None,
        clock: Callable[[], float] = time.monotonic,
        routes: RouteSource | None = None,
        **credentials: Unpack[CredentialOptions],
    ) -> None:
        self.credentials = Credentials(**credentials).check()
        if nc is not None and self.credentials != Credentials():
            raise ValueError("credentials apply to the client's own connection: not with nc=")
        self.config = config or ClientConfig()
        self.metrics = metrics
        self.clock = clock
        self.breakers = Breakers(self.config.breaker)
        self.nc: NATS = nc if nc is not None else NATS()
        self.subjects = Subjects(self.config.prefix)
        self._own_nc = nc is None
        self._servers = servers
        self._name = name or f"reach-client-{uuid.uuid4().hex[:8]}"
        if routes is None:
            broker = Routes(self.nc, self.subjects, self.config, metrics, clock,
                            caller=self._name)  # fmt: skip
            routes = TableRoutes(self.nc, self.subjects, self.config, broker, metrics, clock)
        self.routes: RouteSource = routes
        self._tasks = TaskSet()
        self.liveness = Liveness(self.nc, self.subjects, self.config, self._tasks)
        self.holders = Holders(self.nc, poll_s=self.config.claim_poll_s, subjects=self.subjects)
        """Calls waiting for the agent that holds their request id's claim."""
        self.attempts = Attempts(self.nc, self.config, self.breakers, self.liveness, metrics,
                                 clock, self.routes)  # fmt: skip
        self.loop = AttemptLoop(self.config, clock, self.breakers, self.routes, self.attempts,
                                self.holders)  # fmt: skip
        self.outcomes = OutcomeBook(self._name, clock())
        """What this client saw of each agent, sent to the brokers (:mod:`.outcomes`)."""
        self.attempts.outcomes = self.outcomes
        self._reporter = OutcomeReporter(self.nc, self.subjects, self.outcomes,
                                         self.config.outcome_interval_s, clock)  # fmt: skip
        self._inbox = ReplyInbox("")  # the connection's own inbox, from start()
        self._calls: dict[str, Call] = {}
        self._subs: list[Subscription] = []
        self._ids = itertools.count(1)
        self.takers = durable.Takers()
        """Who took each recent call (its receipt's or result's agent): :meth:`wait` trusts."""
        self.cancels = Cancels(self.nc, self.subjects, self._tasks)
        """Cancels sent to the agents running this client's requests (:mod:`.cancel`)."""
        self.spans = otel.spans("reach-client")
        """OpenTelemetry spans of the calls (:mod:`.otel`): None unless
        ``OTEL_EXPORTER_OTLP_ENDPOINT`` is set and the extra ``otel`` installed."""
        self._started = False

    # --- lifecycle ----------------------------------------------------------------------

    async def start(self, *, stop: asyncio.Event | None = None) -> None:
        """Connect (unless given a connection) and subscribe. Waits for a server at most
        ``config.connect_timeout_s`` (``ConnectionError``), logging each failed attempt
        (``client.connect_failed``); ``stop`` set meanwhile (a signal) ends the wait at once
        (:class:`~reach_agent.connection.NotConnected`)."""
        if self._started:
            return
        nc = self.nc
        # Built first: a bad credentials setting raises before anything started.
        options = (
            connect_options(self._name, self._servers, self.credentials) if self._own_nc else {}
        )
        self._started = True
        if self._own_nc:
            try:
                async with asyncio.timeout(self.config.connect_timeout_s):
                    await connect(nc, {**options, "error_cb": self._on_error},
                                  what=f"client {self._name!r}", role="client",
                                  stop=stop)  # fmt: skip
            except (Forbidden, NotConnected):
                self._started = False
                raise
            except TimeoutError:
                self._started = False
                await nc.close()
                raise ConnectionError(
                    f"no NATS server answered at {options['servers']} within "
                    f"{self.config.connect_timeout_s:g}s"
                ) from None
        self._inbox = ReplyInbox(nc.new_inbox())
        self._subs = [
            await nc.subscribe(self._inbox.wildcard, cb=self._on_reply,
                               pending_msgs_limit=1_000_000),
            await nc.subscribe(self.subjects.all_events, cb=self._on_event,
                               pending_msgs_limit=1_000_000),
        ]  # fmt: skip
        await flush_subscriptions(nc)
        self.liveness.start()
        self._reporter.start()
        await self.routes.start()

    async def stop(self) -> None:
        if not self._started:
            return
        self._started = False
        self.liveness.close()
        await self.routes.stop()
        for call in self._calls.values():
            call.close()
        await self._reporter.stop()
        self._tasks.cancel()
        for sub in self._subs:
            try:
                await sub.unsubscribe()
            except Exception:  # a closed connection must not block shutdown
                log.debug("client.unsubscribe_failed", exc_info=True)
        self._subs = []
        if self._own_nc:
            await drain_or_close(self.nc, 5.0)
        if self.spans is not None:
            await asyncio.to_thread(self.spans.flush)

    async def __aenter__(self) -> Client:
        await self.start()
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.stop()

    async def _on_error(self, exc: Exception) -> None:
        log.debug("client.nats_error error=%r", exc)

    # --- routing ------------------------------------------------------------------------

    async def route(
        self,
        capability: str,
        limit: int | None = None,
        *,
        filters: schema.Filters | None = None,
        exclude: Sequence[str] | None = None,
        region: str | None = None,
        tags: dict[str, str] | None = None,
        sticky_key: str | None = None,
        allow_suspect: bool = False,
        canary: str | None = None,
        requires: Sequence[str] | None = None,
        min_context_tokens: int | None = None,
    ) -> list[schema.Candidate]:
        """Ranked candidates for ``capability``, best first: a look (a ``peek``), so no task
        is counted as handed to the first; :meth:`call` routes for real. The filters come as
        one :class:`~reach_agent.wire.schema.Filters` or as its keywords (``canary``,
        ``requires``, ``min_context_tokens``: see docs/protocol.md, RouteRequest).

        When no broker answers, the last answer for the same capability and filters is used
        (minus agents that events since reported unhealthy, in weighted-random order);
        without one, :class:`NoReachableAgent` is raised.
        """
        chosen = filters_of(filters, region=region, tags=tags, sticky_key=sticky_key,
                            allow_suspect=allow_suspect, canary=canary, requires=requires,
                            min_context_tokens=min_context_tokens)  # fmt: skip
        return await self.routes.route(capability, chosen, limit=limit, exclude=exclude or (),
                                       peek=True)  # fmt: skip

    async def _on_event(self, msg: Msg) -> None:
        if audit.is_copy(msg, live=True):  # not an event a broker published
            return
        try:
            ev = schema.event_decoder.decode(msg.data)
        except msgspec.MsgspecError:
            log.debug("client.event_undecodable subject=%s", msg.subject)
            return
        if ev.kind == "released":
            if ev.request_id:
                self.holders.released(ev.request_id)
            return
        if ev.kind in ("left", "evicted") or (ev.kind == "state" and ev.to != "healthy"):
            self.routes.agent_gone(ev.agent_id)
        self.liveness.on_event(ev)

    # --- calls --------------------------------------------------------------------------

    async def _on_reply(self, msg: Msg) -> None:
        call_id, attempt = self._inbox.parse(msg.subject)
        call = self._calls.get(call_id)
        if call is not None:
            call.deliver(attempt, msg)

    async def call(
        self,
        capability: str,
        payload: Any = None,
        *,
        timeout: float | None = None,  # noqa: ASYNC109 - the call's deadline, sent as Reach-Timeout-Ms
        ack_mode: AckMode = "completed",
        request_id: str | None = None,
        headers: dict[str, str] | None = None,
        traceparent: str | None = None,
        filters: schema.Filters | None = None,
        sticky_key: str | None = None,
        region: str | None = None,
        tags: dict[str, str] | None = None,
        canary: str | None = None,
        requires: Sequence[str] | None = None,
        min_context_tokens: int | None = None,
    ) -> Any:
        """Run ``payload`` on an agent with ``capability`` and return its decoded result.

        The call waits ``clamp(max(timeout, hint), min_timeout_s, max_timeout_s)`` seconds,
        ``hint`` being the ``timeout_hint_ms`` the chosen agent announced. With
        ``ack_mode="received"`` the call returns the :class:`~reach_agent.wire.schema.Receipt`
        once an agent has accepted the task; the result goes to ``REACH_ACKS``. A streaming
        handler's answer comes joined (:func:`reach_agent.wire.streams.join`). Who may take
        it: ``filters`` (a :class:`~reach_agent.wire.schema.Filters`), or its keywords
        (``sticky_key``, ``region``, ``tags``, ``canary``, ``requires``,
        ``min_context_tokens``: docs/protocol.md, RouteRequest). Raises a
        :class:`~reach_agent.wire.errors.ReachError` subclass carrying the wire code.
        """
        chosen = filters_of(filters, sticky_key=sticky_key, region=region, tags=tags,
                            canary=canary, requires=requires,
                            min_context_tokens=min_context_tokens)  # fmt: skip
        call = self.open_call(capability, payload, timeout, ack_mode, request_id, headers,
                              traceparent, chosen)  # fmt: skip
        ok, error = False, None
        again = True  # one more round, once, if nobody runs it while it waits for a record
        try:
            while True:
                try:
                    value = await self._run(call)
                    ok = True
                    return value
                except ReachError as exc:
                    error = exc
                    # Timed out (at the deadline, or too close to it for another attempt),
                    # or refused NO_REACHABLE_AGENT for a request id the caller chose or an
                    # agent was sent: the answer may be stored all the same (nemesis seed
                    # 53: 86 repeats of requests finished 8-109 s before refused while no
                    # agent was reachable).
                    stored: schema.AckRecord | RunAgain | Answered | None = None
                    if isinstance(exc, Timeout) or (
                        isinstance(exc, NoReachableAgent)
                        and (request_id is not None or call.runners())
                    ):
                        stored = await self._stored(call, exc.code, again)
                    if isinstance(stored, RunAgain):
                        again = False
                        call.tried.clear()
                        call.retries = 0
                        continue
                    if isinstance(stored, Answered):
                        if stored.outcome == "ok":
                            ok = True
                            return stored.value
                        error = stored.value
                        raise error from None
                    if call.cancelled is not None:  # (Client.cancel while it waited)
                        error = call.cancelled
                        raise error from None
                    if stored is not None:
                        outcome, value = results.answer_of(stored)
                        if outcome == "ok":
                            ok = True
                            return value
                        error = value
                        raise error from None
                    if self.clock() >= call.deadline:
                        self.cancels.tell(call, "the caller's deadline passed")
                    raise
        except asyncio.CancelledError:
            self.cancels.tell(call, "the call was cancelled", everyone=True)
            raise
        finally:
            self.close_call(call, ok, error)

    async def _stored(
        self, call: Call, ended: str, again: bool = False
    ) -> schema.AckRecord | RunAgain | Answered | None:
        """A call that ended ``ended`` (``TIMEOUT``, or ``NO_REACHABLE_AGENT``): the final
        record an agent it reached stored meanwhile (the one that took it first, then the
        others its attempts went to), or else the one its request id's claim names
        (:meth:`_claim_answer`), read once, at most :data:`STORED_READ_S` each (and
        :data:`PAST_DEADLINE_S` past the deadline); none yet and
        time left before the deadline (its retries ran out first), the first final record
        an agent it reached stores by the deadline. Its reply was lost (nemesis seed 42: the
        caller's node killed as the agent answered; seed 43: an attempt given up for an
        agent whose node was stopped, which then finished) while ``REACH_ACKS`` holds the
        answer, or will. Not for ``ack_mode="received"`` (its answer is the receipt).

        That wait may end sooner (:meth:`_wait_record`): with a late result reply
        (:class:`Answered`), or, with ``again``, with :data:`RUN_AGAIN` when it learns that
        nobody runs the request and time is left for an attempt."""
        if call.ack_mode != "completed":
            return None
        authors = ([call.taker] if call.taker else []) + sorted(call.runners() - {call.taker})
        # The claim names the agent whose final record is the request's answer, reached by
        # this call or not: a repeat of a request another agent finished, whose attempts
        # went only to an agent that never answered (nemesis seed 48: two repeats told
        # TIMEOUT 44 s and 2 min after their result was stored). Read with the records.
        read_s = min(STORED_READ_S, max(call.deadline - self.clock(), 0.0) + PAST_DEADLINE_S)
        by_claim = asyncio.ensure_future(self._claim_answer(call.request_id, call.body, read_s))
        try:
            rec = None
            if authors:
                rec = await results.stored_final(self.nc, call.request_id,
                                                 authors[:STORED_AUTHORS], self.subjects,
                                                 read_s)  # fmt: skip
            if rec is None:
                rec = await by_claim
        finally:
            by_claim.cancel()
        left = call.deadline - self.clock()
        if rec is None and authors and left > 0:
            # Its retries ran out before its deadline (attempts not delivered, or a taker
            # lost): an agent it reached may still answer, and the deadline is the caller's
            # (nemesis seed 58: two calls told TIMEOUT "not delivered" 7 s before their
            # deadlines; their agent, SIGSTOPped with the copies in its buffer, stored both
            # results a second before them). Waited for until the deadline.
            log.info("call.waiting_for_record request_id=%s agents=%s left_s=%.1f: the call "
                     "ended %s", call.request_id, ",".join(authors[:STORED_AUTHORS]), left,
                     ended)  # fmt: skip
            waited = await self._wait_record(call, authors[:STORED_AUTHORS], left, again)
            if isinstance(waited, (RunAgain, Answered)):
                return waited
            rec = waited
        if rec is not None:
            log.info("call.result_from_store request_id=%s agent=%s state=%s: the call "
                     "ended %s, its answer stored", call.request_id, rec.agent_id, rec.state,
                     ended)  # fmt: skip
        return rec

    async def _wait_record(
        self, call: Call, authors: list[str], left: float, again: bool
    ) -> schema.AckRecord | RunAgain | Answered | None:
        """The first final record of ``call``'s request by one of ``authors``, or that ends
        its claim, within ``left`` seconds (:func:`~reach_agent.results.wait_final`), or a
        late result reply to one of its attempts (:class:`Answered`: an agent that stores
        no record answers only so); None at once when this client closes or cancels the
        call meanwhile. With ``again``, the call tries again (:data:`RUN_AGAIN`) instead of
        waiting out its deadline when, with time left for an attempt, it learns that nobody
        runs the request and nobody will store its answer:

        * the request id's claim is released unfinished (its holder declared offline before
          finishing, or giving up a claim the store did not confirm: nemesis seed 74, two
          calls whose retries ran out in a store outage waited 4.8 s for a dead holder,
          their claims released 0.04 s before; seed 75: one waited 5 s, its claim given up
          0.1 s after), or there is none (an agent running a claimed request holds its
          claim; one that takes it later finds the claim of whoever ran it again: seeds 76
          to 78, seven calls waited 4.7-6.9 s for agents that had refused them late, or
          had not heard of them, their nodes stopped, and ended TIMEOUT; Holders.until_free);
        * every agent its attempts went to refuses it late, before any receipt (one that
          could not confirm its claim refuses after its claim timeout, later than the
          call's receipt timeout), while the claim cannot be read."""
        waiting = asyncio.ensure_future(results.wait_final(
            self.nc, call.request_id, authors, self.subjects, left,
            schema.body_digest(call.body)))  # fmt: skip
        replies = asyncio.ensure_future(call.late_reply())
        watched: set[asyncio.Future[Any]] = {waiting, replies}
        room = left - self.config.ack_timeout_s
        if again and room > 0:
            watched.add(asyncio.ensure_future(self.holders.until_free(call.request_id, room)))
        why = None
        try:
            while why is None:
                done, _ = await asyncio.wait(watched, return_when=asyncio.FIRST_COMPLETED)
                if waiting in done:
                    return waiting.result()
                for task in done:
                    watched.discard(task)
                    if task.exception() is not None:
                        continue  # (a read failed: the others watch on)
                    if task is replies:
                        end, value = replies.result()
                        if end == "ok" or end == "error":
                            log.info("call.late_reply request_id=%s agent=%s: answered while "
                                     "the call waited for its record", call.request_id,
                                     call.taker)  # fmt: skip
                            return Answered(end, value)
                        if end == "closed":
                            return None  # this client closes, or cancelled the call
                        if not (again and self._room(call)):
                            return None  # nobody took it: no record will come
                        why = "every agent it went to refused it before any receipt"
                    elif (free := task.result()) is not None and self._room(call):
                        why = ("its claim was released unfinished" if free == "released"
                               else "no claim of it is stored")  # fmt: skip
            log.info("call.run_again request_id=%s left_s=%.1f: %s while the call waited for "
                     "its record; tried again", call.request_id, call.deadline - self.clock(),
                     why)  # fmt: skip
            return RUN_AGAIN
        finally:
            for task in watched:
                task.cancel()

    def _room(self, call: Call) -> bool:
        """Whether ``call``'s deadline leaves time for an attempt (its receipt timeout)."""
        return call.deadline - self.clock() > self.config.ack_timeout_s

    async def _claim_answer(
        self, request_id: str, body: bytes, read_s: float
    ) -> schema.AckRecord | None:
        """The final record the claim of ``request_id`` says is its answer, read once within
        ``read_s``: its holder's record that ends the claim whatever its state
        says, or an earlier holder's (``completed``: an SDK agent's claim stays ``running``;
        or ``failed`` with an error that is not retryable:
        :func:`~reach_agent.results.ended_by_record`), or the holder's ``failed`` record of
        a ``failed`` claim. None when unclaimed, claimed for another body (an agent answers
        that ``IDEMPOTENCY_MISMATCH``), not finished (a released claim nobody finished), or
        unreadable."""

        async def read() -> schema.AckRecord | None:
            claim = await durable.read_claim(self.nc, request_id, again=True)
            if claim is None:
                return None
            if claim.body_digest is not None and claim.body_digest != schema.body_digest(body):
                return None
            if claim.state == "failed":
                return await results.stored_final(self.nc, request_id, [claim.agent_id],
                                                  self.subjects, read_s)  # fmt: skip
            return await results.ended_by_record(self.nc, claim, self.subjects)

        try:
            async with asyncio.timeout(read_s):  # not wait_for: a cancel is never lost
                return await read()
        except Exception as exc:  # noqa: BLE001 - a timeout, no stream: the Timeout stands
            log.debug("call.claim_unread request_id=%s error=%r", request_id, exc)
            return None

    def stream(
        self,
        capability: str,
        payload: Any = None,
        *,
        timeout: float | None = None,
        window: int = streams.DEFAULT_WINDOW,
        request_id: str | None = None,
        headers: dict[str, str] | None = None,
        traceparent: str | None = None,
        filters: schema.Filters | None = None,
        **filter_keywords: Any,
    ) -> AsyncIterator[Any]:
        """``async for chunk in client.stream(capability, payload)``: a streamed answer,
        chunk by chunk, in order, at most ``window`` ahead of the reader; the other options
        as for :meth:`call` (``filters`` or ``sticky_key``, ``region``, ...). Implemented in
        :func:`reach_agent.client.streaming.stream`."""
        return streaming.stream(self, capability, payload, timeout=timeout, window=window,
                                request_id=request_id, headers=headers,
                                traceparent=traceparent,
                                filters=filters_of(filters, **filter_keywords))  # fmt: skip

    def open_call(
        self,
        capability: str,
        payload: Any,
        timeout: float | None,
        ack_mode: AckMode,
        request_id: str | None,
        headers: dict[str, str] | None,
        traceparent: str | None,
        filters: schema.Filters,
        stream: int = 0,
    ) -> Call:
        """A new call, checked and registered for its replies."""
        if not self._started:
            raise InternalError("client is not started: use `async with Client() as client`")
        schema.check_capability(capability)
        if ack_mode not in ("completed", "received"):
            raise InvalidRequest(f"ack_mode {ack_mode!r} is not 'completed' or 'received'")
        t0 = self.clock()
        call_id = format(next(self._ids), "x")
        span = None
        if self.spans is not None:
            span = self._call_span(capability, traceparent, headers)
            traceparent = self.spans.traceparent(span)
        call = Call(
            call_id, capability, encode_payload(payload), headers, request_id=request_id,
            traceparent=traceparent, ack_mode=ack_mode,
            deadline=t0 + self.config.clamp_timeout(timeout), filters=filters, started=t0,
            timeout=timeout, stream=stream,
        )  # fmt: skip
        if span is not None:
            span.set_attribute("reach.request_id", call.request_id)
            call.span = span
            call.span_headers = {schema.H_TRACEPARENT: traceparent or "",
                                 H_REQUEST_ID: call.request_id}  # fmt: skip
        self._calls[call_id] = call
        return call

    def _call_span(
        self, capability: str, traceparent: str | None, headers: dict[str, str] | None
    ) -> Any:
        """The ``reach.call`` span: a child of the caller's ``traceparent``, else of the
        task this call is made for (its run span), else of the current OpenTelemetry span."""
        assert self.spans is not None
        parent = traceparent or (headers or {}).get(schema.H_TRACEPARENT)
        task = trace.CURRENT.get()
        if not parent and task is not None:
            parent = task.parent or task.headers.get(schema.H_TRACEPARENT)
        return self.spans.start(f"reach.call {capability}", parent, otel.CLIENT,
                                {"reach.capability": capability})  # fmt: skip

    def close_call(self, call: Call, ok: bool, error: ReachError | None = None) -> None:
        del self._calls[call.call_id]
        if call.span is not None and self.spans is not None:
            if not ok:
                error = error or call.last_err or InternalError("the call did not complete")
            self.spans.end(call.span, error, agent_id=call.taker or call.agent_id)
        if call.taker is not None:
            self.takers.remember(call.request_id, call.taker)
        if self.metrics is not None:
            self.metrics.duration.observe(self.clock() - call.started)
        if log.isEnabledFor(logging.DEBUG):
            log.debug("call.done capability=%s request_id=%s result=%s", call.capability,
                      call.request_id, "ok" if ok else "error")  # fmt: skip

    async def _run(self, call: Call) -> Any:
        """Attempts until one succeeds or the retry rule says stop (:class:`AttemptLoop`)."""
        return await self.loop.run(call, self._inbox)

    # --- durable (JetStream) ------------------------------------------------------------

    async def submit(
        self, capability: str, payload: Any, *, deliver: str = "eventually", **kw: Any
    ) -> str:
        """Hand a task over for delivery now or later (compensation queue); returns its
        request id. Implemented in :mod:`reach_agent.client.durable`."""
        kw.setdefault("prefix", self.config.prefix)
        return await durable.submit(self, capability, payload, deliver=deliver, **kw)

    async def wait(self, request_id: str, timeout: float,  # noqa: ASYNC109
                   *, agent_id: str | None = None) -> schema.AckRecord:  # fmt: skip
        """The final ack record of ``request_id`` (``completed`` or ``failed``, its ``result``
        decoded) by the agent that took the task: ``agent_id``, this client's callee, or a
        broker's word; raises ``Timeout`` after ``timeout`` seconds without one
        (:func:`reach_agent.client.durable.wait`)."""
        return await durable.wait(self, request_id, timeout, agent_id=agent_id,
                                  prefix=self.config.prefix)  # fmt: skip

    # --- cancellation -------------------------------------------------------------------

    async def cancel(
        self,
        request_id: str,
        *,
        reason: str | None = None,
        timeout: float = 2.0,  # noqa: ASYNC109 - how long the brokers may take to answer
    ) -> schema.CancelReply:
        """Cancel ``request_id`` wherever it is: this client's calls of it end with
        ``CANCELLED`` at once; the agent running it is told (its handler sees
        ``asyncio.CancelledError``, its final ack record says ``CANCELLED``); a request no
        agent runs (queued, not yet sent, its agent ignoring cancels) is made final by a
        broker, so no retry or replay runs it. Returns who settled it and how
        (``cancelled``, or ``finished``: its result stands); raises ``Timeout`` when no
        broker answered (:mod:`reach_agent.client.cancel`)."""
        return await self.cancels.cancel(request_id, reason, timeout, self._calls.values())


def filters_of(given: schema.Filters | None, **keywords: Any) -> schema.Filters:
    """The call's filters: ``given``, or made of the filter keywords that are set (not
    both)."""
    chosen = {k: v for k, v in keywords.items() if v}
    if given is not None:
        if chosen:
            raise InvalidRequest(f"filters= and the filter keywords {sorted(chosen)} are given "
                                 "together: give one")  # fmt: skip
        return given
    if not chosen:
        return schema.NO_FILTERS
    if "requires" in chosen:
        chosen["requires"] = list(chosen["requires"])
    if "tags" in chosen:
        chosen["tags"] = dict(chosen["tags"])
    return schema.Filters(**chosen)
