"""The agent's task side: admit each task, claim it, run its handler, reply, record its acks.

Every task subscription callback only decides (:func:`~reach_agent.agent.admission.admit`) and
acts on the decision — a cached reply, an error reply, or a run handed to an asyncio task —
so the callback returns at once and the next message is read. The run first claims the
request id fleet-wide (:mod:`~reach_agent.agent.claiming`; not for capabilities marked
idempotent, nor with ``claims=False``), and only a claim of its own makes it send the
receipt and run the handler; otherwise it answers ``IN_PROGRESS``, the stored result, or —
the store could not decide — ``STORE_UNAVAILABLE``. The holder ends its claim before it
replies. Handlers are ``async def`` (run on the loop), async generators (streamed,
:mod:`~reach_agent.client.streaming`) or plain functions (run in a worker thread).

A cancel (``<p>.cancel.<agent_id>``, :meth:`TaskServer.on_cancel`) of a request running here
cancels its handler's asyncio task: the handler sees ``asyncio.CancelledError`` and may
clean up; after ``cancel_grace`` seconds it is cancelled again. The run then ends as
``CANCELLED`` whatever the handler did after the cancel: the claim ended ``failed`` (reason
``cancelled``, so no retry or replay runs it again), the final ack record ``failed`` with
``CANCELLED``, the slot free. A cancel that comes before the handler started (the claim's
round trip) ends the run before it. One for a request not running here is only remembered
in the duplicate window, as a note — never an answer (answered ``unknown``, then and when
asked again: the asker has the brokers settle it): a copy of the task arriving later starts
a run that is already cancelled, which claims the request as any run does and, with the
claim its own, ends it ``CANCELLED`` without its handler (claim ``failed``/``cancelled``,
records ``received`` and ``failed``), so every ``CANCELLED`` has the claim and the record
behind it; a claim another runs, or that finished, answers as for any copy (``IN_PROGRESS``;
the stored result, which stands), and one the store cannot decide ``STORE_UNAVAILABLE`` —
then the note stays for the next copy.
A plain function handler runs in a worker thread, which cannot be interrupted: its run
ends at once, the thread finishes on its own and its result is dropped.

The durable-ack hook (``ack_sink``) gets state ``received`` when a task is accepted (before
the handler runs) and ``completed`` (``result`` = the reply body as ``msgspec.Raw``) or
``failed`` (``error`` = ``{"code", "message"}``) when it ends, before the reply goes out.
A sink that raises on ``received`` refuses the task (``STORE_UNAVAILABLE``, retryable; the
handler does not run: its result could not be made durable); one that raises on the final
record is logged as an error and counted, and the reply still goes out (the handler ran).
With ``Reach-Ack-Mode: received`` the caller gets only the receipt; the result exists only
through the sink (without a sink it is logged and dropped).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, cast

import msgspec
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from jetstream.names import H_REQUEST_ID
from reach_agent import otel, trace
from reach_agent.aio import TaskSet, wait_event
from reach_agent.metrics import AgentMetrics
from reach_agent.otel import Spans
from reach_agent.wire import schema
from reach_agent.wire.errors import (
    H_SERVICE_ERROR_CODE,
    Cancelled,
    Draining,
    InternalError,
    InvalidRequest,
    ReachError,
    StoreUnavailable,
    to_reply,
)
from reach_agent.wire.subjects import Subjects, is_inbox

from .admission import Admission, admit
from .claiming import Claimer, Held
from .dedup import DedupCache, Entry, Reply
from .handling import Handler, HandlerKind, HandlerRunner
from .task import Task

log = trace.logger(__name__)


_payload_decoder = msgspec.json.Decoder()


class AckSink(Protocol):
    """Receives an :class:`~reach_agent.wire.schema.AckRecord` per task state change."""

    async def record(self, rec: schema.AckRecord) -> None: ...


class AheadAckSink(AckSink, Protocol):
    """An ack sink that can also publish a record at once over the agent's own connection
    (``js``: its JetStream context), ahead of the reply (``jetstream.acks.AckWriter``): a
    claimed run's ``completed`` record is then its claim's end. Returns the PubAck check to
    await after the reply (True: stored; False: the sink stores it later), or None when it
    did not take the record."""

    async def record_ahead(
        self, rec: schema.AckRecord, js: Any
    ) -> Callable[[], Awaitable[bool]] | None: ...


CANCEL_GRACE_S = 5.0
"""How long a cancelled handler may clean up before it is cancelled again."""


def _holder_named(entry: Entry) -> str | None:
    """The holder a finished duplicate-window entry's reply names (``Reach-Holder``: it was
    answered from another agent's claim), if any."""
    if not entry.future.done() or entry.future.cancelled():
        return None
    headers, _ = entry.future.result()
    return headers.get(schema.H_HOLDER)


@dataclass(slots=True, eq=False)
class Run:
    """A request running on this agent: what it came with (its message, capability, request
    id, headers and body digest; its admission, its duplicate-window entry, whether it is
    claimed fleet-wide before the handler runs), its asyncio task, how far it is
    (``claiming``, ``handling`` — only then does a cancel interrupt it —, ``ending``: the
    handler is done), and why it was cancelled."""

    msg: Msg
    capability: str
    request_id: str
    headers: dict[str, str]
    digest: str
    admission: Admission
    entry: Entry
    claim: bool
    task: asyncio.Task[None] | None = None
    phase: str = "claiming"
    claimed: asyncio.Event = field(default_factory=asyncio.Event)
    """Set once the fleet-wide claim is this run's: a copy's receipt may leave from then."""
    cancelled: str | None = None
    """The cancel's reason, once cancelled."""
    grace: asyncio.TimerHandle | None = None


class TaskServer:
    """The tasks of one agent: admission, execution, replies, ack records and load figures."""

    def __init__(
        self,
        agent_id: str,
        max_concurrency: int,
        subjects: Subjects,
        *,
        dedup: DedupCache,
        metrics: AgentMetrics | None,
        spans: Spans | None = None,
        cancel_grace: float = CANCEL_GRACE_S,
    ) -> None:
        self.agent_id = agent_id
        self.spans = spans
        """OpenTelemetry spans of each run and claim (:mod:`.otel`; None: off)."""
        self.max_concurrency = max_concurrency
        self.subjects = subjects
        self.dedup = dedup
        self.metrics = metrics
        self.ack_sink: AckSink | None = None
        """Where ack records go (None: none are written), from :meth:`subscribe`."""
        self.handlers: dict[str, tuple[Handler, HandlerKind]] = {}
        """capability → (handler, how it runs)."""
        self.idempotent: set[str] = set()
        """Capabilities whose duplicates are harmless: run without a fleet-wide claim."""
        self.claimer: Claimer | None = None
        """The fleet-wide claims (None: ``Agent(claims=False)``, the duplicate window alone
        applies), from :meth:`subscribe`."""
        self.nc = NATS()  # the agent's connection, from subscribe()
        self._js: Any = None
        """The agent connection's JetStream context (records sent ahead of replies)."""
        self.runner = HandlerRunner(agent_id, max_concurrency)
        self.draining = False
        self.unready = False
        """The service behind an adapter does not answer (:mod:`~reach_agent.agent.presence`'s
        readiness check): reported ``draining``, tasks refused with ``DRAINING``."""
        self.active = 0
        self.ok_total = 0
        self.fail_total = 0
        self._subs: list[Subscription] = []
        self._tasks = TaskSet()
        self.cancel_grace = cancel_grace
        self._runs: dict[str, Run] = {}
        """request id → its run on this agent (what a cancel finds)."""
        self._running: dict[str, float] = {}
        # Durations of tasks finished since the last heartbeat: the broker smooths them
        # (EWMA), so the freshest p50 lets it see a slowdown within a heartbeat or two.
        self._durations: deque[float] = deque(maxlen=1024)
        self._last_p50: int | None = None
        self._idle = asyncio.Event()
        self._idle.set()

    # --- lifecycle --------------------------------------------------------------------

    async def subscribe(
        self,
        nc: NATS,
        capabilities: Sequence[str],
        *,
        claimer: Claimer | None,
        ack_sink: AckSink | None,
        cancels: bool = True,
    ) -> None:
        """One subscription per capability (``<p>.task.<agent_id>.<capability>``), and one
        for cancels (``<p>.cancel.<agent_id>``, never behind task messages) unless
        ``cancels`` is False (a credential issued before cancellation existed); served on
        ``nc`` with the fleet-wide ``claimer`` and the ``ack_sink`` the agent started."""
        self.nc = nc
        self._js = None
        self.claimer = claimer
        self.ack_sink = ack_sink
        for cap in capabilities:
            sub = await nc.subscribe(
                self.subjects.task(self.agent_id, cap), cb=self.on_task, pending_msgs_limit=100_000
            )
            self._subs.append(sub)
        if cancels:
            await nc.subscribe(self.subjects.cancel(self.agent_id), cb=self.on_cancel)
        await self.runner.subscribe(nc, self.handlers.values())

    def forget_subscriptions(self) -> None:
        """The connection is closed (or never served): its subscriptions are gone."""
        self._subs = []
        self.runner.forget()

    async def drain(self, grace: float) -> None:
        """Let in-flight tasks finish within ``grace`` seconds, then cancel the rest (they
        answer DRAINING: retryable elsewhere with the same request id)."""
        if self.active:
            log.info("agent.draining agent=%s in_flight=%d grace=%.1fs", self.agent_id,
                     self.active, grace)  # fmt: skip
            await wait_event(self._idle, grace)
            if self.active:
                log.warning("agent.grace_expired agent=%s cancelling=%d", self.agent_id,
                            self.active)  # fmt: skip
        self._tasks.cancel()
        await self._tasks.wait(1.0)

    def close(self) -> None:
        """After the connection closed: drop the subscriptions, end the worker threads."""
        self._subs = []
        self.runner.close()

    # --- load figures (heartbeats and probe replies) ----------------------------------

    def status(self) -> schema.AgentStatus:
        if self.draining or self.unready:
            return "draining"
        return "busy" if self.active else "idle"

    def queue_depth(self) -> int:
        """Task messages received by the connection but not yet looked at."""
        return sum(s.pending_msgs for s in self._subs)

    def load_figures(self) -> tuple[int | None, int | None]:
        """(median task duration ms of the tasks finished since the last heartbeat — else
        the previous heartbeat's —, age ms of the oldest running task)."""
        p50 = self._last_p50
        if self._durations:
            ordered = sorted(self._durations)
            p50 = int(ordered[len(ordered) // 2])
        oldest = None
        if self._running:
            oldest = int((time.monotonic() - min(self._running.values())) * 1000)
        return p50, oldest

    def take_load_figures(self) -> tuple[int | None, int | None]:
        """:meth:`load_figures`, and start the next heartbeat's duration sample."""
        p50, oldest = self.load_figures()
        self._durations.clear()
        self._last_p50 = p50
        return p50, oldest

    # --- a task arrives ---------------------------------------------------------------

    async def on_task(self, msg: Msg) -> None:
        """Decide at once and hand the work to a task: this callback must never block."""
        capability = self.subjects.capability_of_task(msg.subject, self.agent_id)
        reply = msg.reply
        if reply and not is_inbox(reply):
            # The server lets us answer any reply subject a caller names: answering one that
            # is not an inbox would publish our receipt or result, with our rights, wherever
            # the caller chose (another agent's subjects, the JetStream API).
            self._count(capability, "bad_reply")
            log.warning("agent.task_refused agent=%s capability=%s reason=reply subject %r is "
                        "not an inbox", self.agent_id, capability, reply[:128])  # fmt: skip
            return
        hdrs = msg.headers or {}
        request_id = hdrs.get(H_REQUEST_ID) or str(uuid.uuid4())
        digest = schema.body_digest(msg.data)
        now = time.monotonic()
        entry = self.dedup.lookup(request_id, now)
        mismatch = None
        if entry is not None and entry.digest is not None and entry.digest != digest:
            mismatch = entry.digest, digest
        d = admit(hdrs, agent_id=self.agent_id, duplicate=entry is not None,
                  draining=self.draining or self.unready, active=self.active,
                  max_concurrency=self.max_concurrency, now=now, mismatch=mismatch)  # fmt: skip
        noted = entry.remembered if entry is not None and d.verdict == "duplicate" else None
        if d.verdict == "run" or noted is not None:
            # A copy of a request whose cancel was remembered (noted) runs already cancelled:
            # no handler, but its claim and records make the CANCELLED durable. Counted in
            # `active` (in flight: a drain waits for it), yet admitted however full the agent
            # is, as a duplicate is: it takes no handler's slot, and a TARGET_BUSY would only
            # send the copy on to run elsewhere.
            if noted is not None:
                log.info("task.cancelled_copy agent=%s request_id=%s: its cancel was remembered; "
                         "run already cancelled", self.agent_id, request_id)  # fmt: skip
            self.active += 1
            self._idle.clear()
            self._running[request_id] = now
            entry = self.dedup.begin(request_id, now, self.active, digest)
            claim = self.claimer is not None and capability not in self.idempotent
            if reply and d.receipt and not claim:
                await self._send_receipt(reply, request_id)  # at once: nothing to claim
            run = self._runs[request_id] = Run(msg, capability, request_id, hdrs, digest, d,
                                               entry, claim, cancelled=noted)  # fmt: skip
            run.task = self._tasks.spawn(self._run(run), "reach-task")
            return
        self._count(capability, d.label)
        if d.verdict == "refuse":
            assert d.error is not None
            if reply:
                headers, body = to_reply(d.error)
                headers[H_REQUEST_ID] = request_id
                await self._publish(reply, body, headers)
            return
        assert entry is not None  # a duplicate
        first = self._runs.get(request_id)
        if reply and first is not None and first.claim and not first.claimed.is_set():
            # Its run is still claiming: a receipt now would say this agent holds a request
            # whose claim may yet be refused (a replay held such a copy as taken, and
            # removed it unrun: found by loadtest.nemesis).
            self._tasks.spawn(self._copy_once_claimed(first, reply, d), "reach-dup")
            return
        if reply and d.receipt:
            # A copy of a request answered from another agent's claim: its receipt names
            # that holder too, or a replay (or caller) takes this agent for the taker
            await self._send_receipt(reply, request_id, holder=_holder_named(entry))
        if reply and d.ack_mode != "received":
            if entry.future.done():
                headers, body = entry.future.result()
                await self._publish(reply, body, headers)
            else:
                self._tasks.spawn(self._reply_when_done(entry, reply), "reach-dup")

    async def _copy_once_claimed(self, run: Run, reply: str, d: Admission) -> None:
        """A copy of a request whose run is still claiming it: its receipt once the claim is
        the run's, then (unless it asked for the receipt alone) the run's reply; or, when the
        run does not claim it (refused, or another agent's), that answer alone."""
        claimed: asyncio.Future[object] = asyncio.ensure_future(run.claimed.wait())
        done: asyncio.Future[object] = asyncio.shield(run.entry.future)
        try:
            await asyncio.wait({claimed, done}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            claimed.cancel()
        if run.claimed.is_set():
            if d.receipt:
                await self._send_receipt(reply, run.request_id)
            if d.ack_mode == "received":
                return
        await self._reply_when_done(run.entry, reply)

    async def _reply_when_done(self, entry: Entry, reply: str) -> None:
        headers, body = await asyncio.shield(entry.future)
        await self._publish(reply, body, headers)

    async def _publish(self, subject: str, body: bytes, headers: dict[str, str]) -> None:
        try:
            await self.nc.publish(subject, body, headers=headers)
        except Exception as exc:  # a reply that cannot go out is logged
            log.warning("agent.reply_failed agent=%s subject=%s error=%r", self.agent_id,
                        subject, exc)  # fmt: skip

    async def _send_receipt(self, reply: str, request_id: str, holder: str | None = None) -> None:
        """A receipt; ``holder``: the agent whose finished run answers the request (this
        agent answered from that agent's claim), named with ``Reach-Holder``."""
        body = schema.encoder.encode(schema.Receipt(request_id=request_id))
        headers = {H_REQUEST_ID: request_id, schema.H_STATUS: "received"}
        if holder:
            headers[schema.H_HOLDER] = holder
        await self._publish(reply, body, headers)

    def _count(self, capability: str, result: str) -> None:
        if self.metrics is not None:
            self.metrics.tasks.labels(capability, result).inc()

    # --- a cancel arrives -------------------------------------------------------------

    async def on_cancel(self, msg: Msg) -> None:
        """``<p>.cancel.<agent_id>``: cancel the request (:meth:`cancel`); answer with a
        :class:`~reach_agent.wire.schema.CancelReply` when asked (to an inbox only)."""
        reply = msg.reply
        if reply and not is_inbox(reply):  # see on_task: answer inboxes only
            log.warning("agent.cancel_refused agent=%s reason=reply subject %r is not an inbox",
                        self.agent_id, reply[:128])  # fmt: skip
            return
        try:
            req = schema.decode(schema.cancel_decoder, msg.data, "cancel")
        except InvalidRequest as err:
            if reply:
                headers, body = to_reply(err)
                await self._publish(reply, body, headers)
            return
        state = self.cancel(req.request_id, req.reason or "cancelled by its caller")
        if reply:
            answer = schema.CancelReply(request_id=req.request_id, state=state,
                                        agent_id=self.agent_id)  # fmt: skip
            await self._publish(reply, schema.encoder.encode(answer), {})

    def cancel(self, request_id: str, reason: str) -> schema.CancelState:
        """Cancel ``request_id`` on this agent: ``cancelled`` (running here, its claim its own:
        its handler is interrupted, or never starts; or it ended here ``CANCELLED``),
        ``finished`` (it ended here already) or ``unknown``: nothing durable says it is
        cancelled — a run still taking its claim (it will not start, but the claim may be
        another's), or a request that does not run here: the cancel is remembered, a note that
        a copy arriving later runs already cancelled (see the module); asked again, still
        ``unknown``, so the asker has the brokers settle it."""
        run = self._runs.get(request_id)
        if run is not None and (run.phase != "ending" or run.cancelled is not None):
            if run.cancelled is None:
                run.cancelled = reason
                log.info("task.cancel agent=%s request_id=%s reason=%s", self.agent_id,
                         request_id, reason)  # fmt: skip
                if run.phase == "handling":
                    self._interrupt(run)
            if run.claim and not run.claimed.is_set():
                # Still taking its claim, which may yet turn out another's (or undecided):
                # the run will not start, but nothing durable says it is cancelled yet.
                return "unknown"
            return "cancelled"
        if run is not None:
            return "finished"  # its handler is done: the result is on its way
        now = time.monotonic()
        entry = self.dedup.lookup(request_id, now)
        if entry is not None:
            if entry.remembered is not None:
                return "unknown"  # a note of an earlier cancel: no run here ended it yet
            done = entry.future.done() and entry.future.result()[0].get(H_SERVICE_ERROR_CODE)
            return "cancelled" if done == str(Cancelled.status) else "finished"
        self.dedup.remember(request_id, reason, now, self.active)
        return "unknown"

    def _interrupt(self, run: Run) -> None:
        """Cancel the handler now, and again after the grace should it not have ended."""
        assert run.task is not None
        run.task.cancel()
        run.grace = asyncio.get_running_loop().call_later(self.cancel_grace, self._overdue, run)

    def _overdue(self, run: Run) -> None:
        if run.phase == "handling" and run.task is not None and not run.task.done():
            log.warning("task.cancel_overdue agent=%s: the handler did not end within %gs of "
                        "its cancel; cancelled again", self.agent_id,
                        self.cancel_grace)  # fmt: skip
            run.task.cancel()

    # --- a task runs ------------------------------------------------------------------

    def _cancelled(self, run: Run) -> Cancelled:
        return Cancelled(f"request_id {run.request_id!r} was cancelled on agent "
                         f"{self.agent_id!r}: {run.cancelled}")  # fmt: skip

    async def _run(self, run: Run) -> None:
        request_id, capability, hdrs = run.request_id, run.capability, run.headers
        # This asyncio task's own context: the handler's sub-calls and log lines see it.
        ctx = trace.TraceContext(request_id, self.agent_id, hdrs)
        trace.CURRENT.set(ctx)
        span = error = None
        if self.spans is not None:
            attributes = self._span_attributes(request_id, capability)
            span = self.spans.start(f"reach.run {capability}", hdrs.get(schema.H_TRACEPARENT),
                                    otel.SERVER, attributes)  # fmt: skip
            ctx.parent = self.spans.traceparent(span)
        try:
            held = None
            if run.claim:
                assert self.claimer is not None
                held, answer = await self._claim(ctx, run)
                if answer is not None:
                    await self._answer(run, answer)
                    return
                run.claimed.set()
                if run.msg.reply and run.admission.receipt:
                    await self._send_receipt(run.msg.reply, request_id)  # the claim is ours
            error = await self._execute(run, held)
        finally:
            if self._runs.get(request_id) is run:
                del self._runs[request_id]
            if run.cancelled is not None:
                self._keep_noted(run)
            if span is not None and self.spans is not None:
                self.spans.end(span, error)
            self._running.pop(request_id, None)
            self.active -= 1
            if self.active == 0:
                self._idle.set()

    def _keep_noted(self, run: Run) -> None:
        """A cancelled run that ended without a final answer here (another agent holds the
        claim, the store could not decide: its answer was forgotten) leaves its cancel
        remembered, so the next copy runs already cancelled too."""
        assert run.cancelled is not None
        now = time.monotonic()
        if self.dedup.lookup(run.request_id, now) is None:
            self.dedup.remember(run.request_id, run.cancelled, now, self.active)

    def _span_attributes(self, request_id: str, capability: str) -> dict[str, str]:
        return {"reach.request_id": request_id, "reach.capability": capability,
                "reach.agent_id": self.agent_id}  # fmt: skip

    async def _claim(
        self, ctx: trace.TraceContext, run: Run
    ) -> tuple[Held | None, tuple[str, Reply] | None]:
        """The request id's claim for the run's body (:meth:`Claimer.take`), in a
        ``reach.claim`` span when spans are on."""
        assert self.claimer is not None
        request_id, capability, digest = run.request_id, run.capability, run.digest
        if self.spans is None:
            return await self.claimer.take(request_id, capability, digest)
        span = self.spans.start("reach.claim", ctx.parent, otel.INTERNAL,
                                self._span_attributes(request_id, capability))  # fmt: skip
        try:
            held, answer = await self.claimer.take(request_id, capability, digest)
        except BaseException as exc:
            self.spans.end(span, exc)
            raise
        self.spans.end(span, claim="ours" if answer is None else answer[0])
        return held, answer

    async def _answer(self, run: Run, answer: tuple[str, Reply]) -> None:
        """Reply for a task this agent does not run (its claim is another's, or failed)."""
        label, (headers, body) = answer
        self._count(run.capability, label)
        self.dedup.finish(run.entry, (headers, body), time.monotonic())
        if label != "duplicate":
            self.dedup.forget(run.request_id, run.entry)  # it may change: ask the claim again
        reply = run.msg.reply
        if not reply:
            return
        if run.admission.ack_mode == "received" and label == "duplicate":
            await self._send_receipt(reply, run.request_id, holder=headers.get(schema.H_HOLDER))
        else:
            await self._publish(reply, body, headers)

    async def _execute(self, run: Run, held: Held | None) -> ReachError | None:
        """Run the handler and answer; the error the caller got (None: a result)."""
        msg, capability, request_id, entry, d = (run.msg, run.capability, run.request_id,
                                                 run.entry, run.admission)  # fmt: skip
        started = time.monotonic()
        handled = False  # whether the handler ran: only then is its time a task's duration
        error: ReachError | None = None
        headers: dict[str, str]
        body = b""
        wire: Reply | None = None  # what the reply subject gets instead (a stream's end)
        try:
            received = self._ack_record(run, "received")
            if not await self._record(received):
                raise StoreUnavailable(
                    f"agent {self.agent_id!r} did not run request_id {request_id!r}: its ack "
                    "sink could not record 'received' (see the agent's log): ask again"
                )
            # Not run when cancelled while it was being claimed, or before it came (a copy of
            # a request whose cancel was noted): then its body is not even read, so it ends
            # CANCELLED whatever it holds.
            if run.cancelled is None:
                try:
                    payload = _payload_decoder.decode(msg.data) if msg.data else None
                except msgspec.DecodeError as exc:
                    raise InvalidRequest(f"task payload: malformed JSON ({exc})") from None
                task = Task(payload, request_id, capability, run.headers, d.deadline,
                            self.agent_id)  # fmt: skip
                stream_to = msg.reply if d.ack_mode != "received" else None
                run.phase = "handling"
                handled = True
                try:
                    body, wire = await self.runner.run(self.handlers[capability], task,
                                                       stream_to)  # fmt: skip
                finally:
                    run.phase = "ending"
                    if run.grace is not None:
                        run.grace.cancel()
            if run.cancelled is not None:  # whatever the handler made after the cancel
                raise self._cancelled(run)
        except ReachError as err:
            error = err
        except asyncio.CancelledError:
            if run.cancelled is None:
                # Grace expired during a drain: retryable elsewhere (same request id).
                error = Draining(f"agent {self.agent_id!r} stopped before the task finished")
                raise
            # Our cancel: the run ends here, answered CANCELLED (the cancel is consumed).
            current = asyncio.current_task()
            while current is not None and current.cancelling():
                current.uncancel()
            error = self._cancelled(run)
        except Exception as exc:  # a handler failure is the caller's answer
            log.exception("task.failed agent=%s capability=%s request_id=%s", self.agent_id,
                          capability, request_id)  # fmt: skip
            error = InternalError(f"handler {capability!r} raised {type(exc).__name__}: {exc}")
        finally:
            run.phase = "ending"
            now = time.monotonic()
            if handled:  # (a run that never reached its handler says nothing of task times)
                self._durations.append((now - started) * 1000.0)
            if error is None:
                headers = {H_REQUEST_ID: request_id, schema.H_STATUS: "completed"}
                self.ok_total += 1
                self._count(capability, "ok")
            else:
                wire = None
                headers, body = to_reply(error)
                headers[H_REQUEST_ID] = request_id
                if isinstance(error, Cancelled):
                    # Neither a result nor the agent's failure: in neither total (brokers
                    # read ok_total as "it finishes tasks": a hung handler the caller's
                    # deadline cancelled did not).
                    self._count(capability, "cancelled")
                elif error.status < 500:
                    self.ok_total += 1  # the agent did its job: the request was refused
                    self._count(capability, "rejected")
                else:
                    self.fail_total += 1
                    self._count(capability, "failed")
            self.dedup.finish(entry, (headers, body), now)
            # The final record before the reply: once a caller has the result, the ack
            # writer's log has it, so a restarted agent can answer a repeat from the store.
            if error is None:
                final = self._ack_record(run, "completed", result=msgspec.Raw(body))
            else:
                failure = {"code": error.code, "message": error.message}
                final = self._ack_record(run, "failed", error=failure)
            confirm: Callable[[], Awaitable[object]] | None = None
            if held is not None and error is None:
                # The completed record is the claim's end (one synced write, not two): sent
                # on this connection ahead of the reply, so the server has it first.
                confirm = await self._record_ahead(final)
            if held is not None and confirm is None:
                # Sent before the reply: the server has the claim's end before the result.
                assert self.claimer is not None
                confirm = await self.claimer.end(held, error)
                if error is not None and error.retryable:
                    self.dedup.forget(request_id, entry)
                await self._record(final)
            elif held is None:
                await self._record(final)
            if msg.reply and d.ack_mode != "received":
                out_headers, out_body = wire or (headers, body)
                await self._publish(msg.reply, out_body, out_headers)
            elif d.ack_mode == "received" and self.ack_sink is None:
                log.info("task.result_dropped agent=%s request_id=%s: ack mode 'received' "
                         "and no ack sink", self.agent_id, request_id)  # fmt: skip
            if confirm is not None:
                await confirm()
        return error

    def _ack_record(
        self,
        run: Run,
        state: schema.AckState,
        result: msgspec.Raw | None = None,
        error: dict[str, str] | None = None,
    ) -> schema.AckRecord | None:
        """One ack record of this run for the ack sink (None: no sink)."""
        if self.ack_sink is None:
            return None
        ctx = trace.CURRENT.get()  # this task's (set in _run): a flow step names its run
        parent = ctx.headers.get(schema.H_PARENT_ID) if ctx is not None else None
        return schema.AckRecord(
            request_id=run.request_id, agent_id=self.agent_id, capability=run.capability,
            state=state, at_ms=int(time.time() * 1000), result=result, error=error,
            parent_request_id=parent, body_digest=run.digest,
        )  # fmt: skip

    async def _record(self, rec: schema.AckRecord | None) -> bool:
        """Hand one record to the ack sink; False (logged, counted) when the sink raised."""
        if rec is None or self.ack_sink is None:
            return True
        try:
            await self.ack_sink.record(rec)
        except Exception:  # the caller learns it from the task's answer, never a crash
            self._sink_failed(rec)
            return False
        return True

    async def _record_ahead(
        self, rec: schema.AckRecord | None
    ) -> Callable[[], Awaitable[object]] | None:
        """A claimed run's ``completed`` record sent ahead of the reply on this connection
        (:meth:`AheadAckSink.record_ahead`); the PubAck check to await after the reply, or
        None when the sink cannot (another sink, one that raised, a record it refused): the
        run then ends its claim itself."""
        sink = self.ack_sink  # (hasattr: isinstance of a runtime Protocol costs ~20 µs)
        if rec is None or not hasattr(sink, "record_ahead"):
            return None
        if self._js is None:
            self._js = self.nc.jetstream()
        try:
            return await cast(AheadAckSink, sink).record_ahead(rec, self._js)
        except Exception:  # the WAL refused it: the claim's end and the plain path
            self._sink_failed(rec)
            return None

    def _sink_failed(self, rec: schema.AckRecord) -> None:
        log.exception("agent.ack_sink_failed agent=%s request_id=%s state=%s",
                      self.agent_id, rec.request_id, rec.state)  # fmt: skip
        if self.metrics is not None:
            op = "received" if rec.state == "received" else "final"
            self.metrics.store_errors.labels("acks", op).inc()
