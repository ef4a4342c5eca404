"""One call in flight: what it sends, by when, and how its current attempt ends.

A :class:`Call` carries the state the client's retry loop and the reply wait share (request
headers, deadline, filters, the agents tried, the attempt number, the last error), so no
method threads it through parameters. Replies arrive on the call's queue tagged with the
attempt they answer; :meth:`Call.outcome` turns them into one
:data:`~reach_agent.wire.retry.Outcome`:

* a receipt of the current attempt within ``ack_timeout_s`` → wait for the result until the
  deadline (with ``ack_mode="received"`` the receipt is the answer); a receipt is a reply
  with ``Reach-Status: received``, or one without ``Reach-Status`` whose body is exactly the
  receipt of this call's request id (:func:`~reach_agent.wire.schema.is_body_receipt`);
* no receipt in time → ``not_delivered``; a 503 without body → ``no_responders``;
* an error reply of the current attempt → ``error`` (the retry rule decides);
* a result from this attempt or an earlier one → ``ok`` (the first result wins); for a
  streamed call, so is its first chunk (a :class:`StreamStart`, read on by
  :mod:`~reach_agent.client.streaming`);
* :meth:`lose` (the agent died) → ``lost``; :meth:`close` (the client stops) → ``closed``;
  :meth:`cancel` (``Client.cancel`` of its request id) → ``closed`` with ``CANCELLED``;
* :meth:`stored` (the taker's final record, read from the store: its reply was lost) → its
  answer, as a result reply's.

An attempt to a Synadia Agent Protocol agent (``protocol: "synadia-agents"``) reads their
prompt stream instead (:mod:`~reach_agent.client.prompting`): the leading ack is the receipt, waited
for until the deadline — their protocol has no request id, so a prompt queued behind a busy
agent is never sent to a second one —, the response chunks joined are the result.

An ``IN_PROGRESS`` answer (another agent holds the request id's claim) is not retried: the
call waits in :func:`reach_agent.client.holder.held` for the holder's result — a late reply of an
earlier attempt, the holder's final ack record (:mod:`~reach_agent.client.holder` feeds it to the
queue), or the news that the claim was released (then it is tried again).
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable, Mapping
from typing import Any, Literal
from uuid import uuid4

import msgspec

from jetstream.names import H_REQUEST_ID
from reach_agent import trace
from reach_agent.results import answer_of
from reach_agent.wire import schema, streams
from reach_agent.wire.errors import (
    InternalError,
    InvalidRequest,
    NoReachableAgent,
    ReachError,
    Timeout,
    from_reply,
)
from reach_agent.wire.retry import Outcome, full_wait

from . import prompting
from .config import ClientConfig

AckMode = Literal["completed", "received"]

_payload_encoder = msgspec.json.Encoder()
_result_decoder = msgspec.json.Decoder()
_receipt_decoder = msgspec.json.Decoder(schema.Receipt)

_LOST = object()
_CLOSED = object()
_CANCELLED = object()
LOST, CLOSED, CANCELLED = _LOST, _CLOSED, _CANCELLED
"""The markers :meth:`Call.lose`, :meth:`Call.close` and :meth:`Call.cancel` put on the queue
(for readers of a stream, which go on reading it after :meth:`Call.outcome`)."""
_STATUS = "Status"  # nats-server's no-responders reply: Status: 503, no body


def is_no_responders(msg: Any) -> bool:
    """Whether ``msg`` is nats-server's no-responders reply (``Status: 503``, no body)."""
    hdrs = msg.headers
    return bool(hdrs) and hdrs.get(_STATUS) == "503" and not msg.data


class Stored:
    """A final ack record of the call's request id, read from ``REACH_ACKS`` (its reply
    lost): the call's answer, as a result reply would be."""

    __slots__ = ("record",)

    def __init__(self, record: schema.AckRecord) -> None:
        self.record = record


class StreamStart:
    """The first message of a streamed answer (a chunk, or a ``completed`` with
    ``Reach-Chunks``) and the attempt it answers."""

    __slots__ = ("attempt", "msg")

    def __init__(self, attempt: int, msg: Any) -> None:
        self.attempt = attempt
        self.msg = msg


class Call:
    """One call and its current attempt."""

    __slots__ = (
        "ack_mode",
        "agent_id",
        "agents",
        "attempt",
        "body",
        "call_id",
        "cancelled",
        "capability",
        "deadline",
        "filters",
        "gone",
        "headers",
        "last_err",
        "protocol",
        "queue",
        "received",
        "retries",
        "span",
        "span_headers",
        "started",
        "stream",
        "subject",
        "taker",
        "timeout",
        "tried",
        "untaken",
    )

    def __init__(
        self,
        call_id: str,
        capability: str,
        body: bytes,
        headers: Mapping[str, str] | None,
        *,
        request_id: str | None,
        traceparent: str | None,
        ack_mode: AckMode,
        deadline: float,
        filters: schema.Filters = schema.NO_FILTERS,
        started: float = 0.0,
        timeout: float | None = None,
        stream: int = 0,
    ) -> None:
        self.call_id = call_id
        self.capability = capability
        self.body = body
        hdrs = dict(headers or {})
        hdrs[H_REQUEST_ID] = request_id or hdrs.get(H_REQUEST_ID) or str(uuid4())
        hdrs[schema.H_RECEIPT] = "1"
        if ack_mode == "received":
            hdrs[schema.H_ACK_MODE] = "received"
        trace.outgoing(hdrs, traceparent)  # the current task's hops and trace, or a new one
        if stream:
            hdrs[schema.H_STREAM] = "1"
            hdrs[schema.H_STREAM_WINDOW] = str(stream)
        self.headers = hdrs
        """Headers of every attempt: the caller's, the request id (the same on every
        attempt), a receipt asked for, the trace (inherited from the task this call is made
        for, :mod:`~reach_agent.trace`); ``Reach-Timeout-Ms`` is added per attempt."""
        self.ack_mode = ack_mode
        self.deadline = deadline
        """When the call gives up (``time.monotonic()``); an attempt to an agent announcing a
        longer ``timeout_hint_ms`` pushes it out (:meth:`fit_hint`)."""
        self.started = started
        self.timeout = timeout
        """The timeout the caller asked for (None: the configured default)."""
        self.stream = stream
        """Chunks taken ahead of credits when the answer is streamed (0: not streamed)."""
        self.filters = filters
        """Who may take it: the filters of every route request it makes."""
        self.queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()
        self.agent_id: str | None = None
        """The agent of the current attempt."""
        self.protocol: str | None = None
        """How the current attempt's agent is spoken to (a candidate's ``protocol``)."""
        self.subject: str | None = None
        """Where the current attempt was sent (the agent's task or prompt subject)."""
        self.attempt = 0
        """Attempts begun (one refused by a breaker included); replies carry this number."""
        self.tried: list[str] = []
        self.gone: list[str] = []
        """Agents an attempt found dead (``lost``, ``no_responders``): never tried again by
        this call, and excluded from its route requests."""
        self.agents: dict[int, str] = {}
        """The agent each attempt went to."""
        self.untaken: tuple[int, ...] = ()
        """Attempts whose agent never took the request: the server had no responder, or the
        agent refused it before any receipt (a tuple: most calls have none, and allocate
        nothing for it)."""
        self.received = 0
        """Attempts whose agent sent a receipt or an answer, as bits (1 << attempt): it took
        the request, and a refusal of it later does not make it untaken (an int: no
        allocation on a call's path)."""
        self.taker: str | None = None
        """The agent whose receipt or result ended an attempt: who took the task."""
        self.retries = 0
        self.last_err: ReachError | None = None
        self.cancelled: ReachError | None = None
        """The ``CANCELLED`` this call ends with, once ``Client.cancel`` cancelled it."""
        self.span: Any = None
        """The call's OpenTelemetry span (:mod:`~reach_agent.otel`; None when spans are off)."""
        self.span_headers: dict[str, str] | None = None
        """What its route requests carry when spans are on: its ``traceparent`` and request
        id, so the broker's route span joins the trace."""

    @property
    def request_id(self) -> str:
        return self.headers[H_REQUEST_ID]

    def fit_hint(self, deadline: float) -> None:
        """The current target announced a timeout hint that gives ``deadline``: wait at
        least that long (never shorter than already promised)."""
        if deadline > self.deadline:
            self.deadline = deadline

    def attempt_headers(self, now: float) -> dict[str, str]:
        """The headers of an attempt sent at ``now``: the call's, plus the time left."""
        hdrs = dict(self.headers)
        hdrs[schema.H_TIMEOUT_MS] = str(max(int((self.deadline - now) * 1000), 0))
        return hdrs

    async def wait_full(
        self, refused: ReachError, config: ClientConfig, clock: Callable[[], float],
        error: ReachError | None = None,
    ) -> None:  # fmt: skip
        """Every candidate is merely full (:func:`~reach_agent.wire.retry.merely_full`): wait the
        refusal's hint (or ``busy_wait_s``), jittered, then start a new round (every
        candidate may be tried again); raise ``error`` (default: ``refused``) instead when the
        wait and one more attempt would not fit the deadline."""
        delay = full_wait(refused, config.busy_wait_s, config.backoff_max_s, random.random())
        if clock() + delay + min(config.ack_timeout_s, 0.05) > self.deadline:
            raise error or refused
        await asyncio.sleep(delay)
        self.tried.clear()

    # --- what arrives on the queue ------------------------------------------------------

    def deliver(self, attempt: str, msg: Any) -> None:
        """A reply to attempt ``attempt`` (as read from its reply subject); one naming no
        attempt made yet is dropped (its number is a bit of :attr:`received`)."""
        try:
            n = int(attempt)
        except ValueError:
            return
        if 0 < n <= self.attempt:
            self.queue.put_nowait((n, msg))

    def lose(self) -> None:
        """The agent of the current attempt is gone: end it as ``lost``."""
        self.queue.put_nowait((self.attempt, _LOST))

    def stored(self, record: schema.AckRecord) -> None:
        """``record``, the final one of the agent that took the request, was read from the
        store: the call's answer (its reply lost)."""
        self.queue.put_nowait((self.attempt, Stored(record)))

    def close(self) -> None:
        """The client is stopping: end the current attempt as ``closed``."""
        self.queue.put_nowait((self.attempt, _CLOSED))

    def cancel(self, err: ReachError) -> None:
        """``Client.cancel`` of the request id: the call ends with ``err`` (``CANCELLED``),
        as soon as it reads its queue or starts its next attempt."""
        if self.cancelled is None:
            self.cancelled = err
            self.queue.put_nowait((self.attempt, _CANCELLED))

    def runners(self) -> set[str]:
        """The agents that may be running the request for this call: every agent an
        attempt went to (but those that never took it: no responders, or a refusal before
        any receipt), and the one that took it (a claim's holder). Counted, one that never
        took it had a timed out call wait for its record until the deadline (nemesis seed
        69: c2-000291, 8.8 s for three agents whose node was killed as it was sent; seeds 70
        and 71: eleven calls for agents that had refused them, their claims unconfirmed)."""
        out = {a for n, a in self.agents.items() if n not in self.untaken}
        if self.taker is not None:
            out.add(self.taker)
        return out

    # --- how the current attempt ends ---------------------------------------------------

    async def outcome(
        self, sent: float, ack_timeout_s: float, clock: Callable[[], float]
    ) -> tuple[Outcome, Any]:
        """Wait for the current attempt (sent at ``sent``) to end: (outcome, result or error)."""
        if self.protocol == schema.PROTOCOL_SYNADIA:
            return await self._prompted(clock)
        n, agent, deadline = self.attempt, self.agent_id, self.deadline
        ack_by = min(sent + ack_timeout_s, deadline)
        acked = False
        while True:
            until = deadline if acked else ack_by
            got = await self.next_reply(until, clock)
            if got is None:
                if acked:
                    return "timeout", Timeout(
                        f"agent {agent!r} accepted the task but sent no result within the "
                        "call's deadline"
                    )
                return "not_delivered", Timeout(
                    f"not delivered: no receipt from agent {agent!r} within {ack_timeout_s:g}s"
                )
            a, msg = got
            closed = self._closed(msg)
            if closed is not None:
                return closed
            current = a == n
            if isinstance(msg, Stored):
                self.taker = msg.record.agent_id
                return answer_of(msg.record)
            if msg is _LOST:
                if current:
                    doing = "while running the task" if acked else "before its receipt"
                    return "lost", Timeout(f"agent {agent!r} was lost {doing}")
                continue
            hdrs = msg.headers
            if is_no_responders(msg):
                if current:
                    self.untaken += (n,)
                    return "no_responders", NoReachableAgent(
                        f"no responders: agent {agent!r} is not subscribed to {self.subject!r}"
                    )
                continue
            err = from_reply(hdrs, msg.data)
            if err is not None:
                if current:
                    if not acked:  # refused before its receipt: it did not take it
                        self.untaken += (n,)
                    return "error", err
                self._refused_late(a)
                continue  # an earlier attempt's error: the current attempt decides
            self.received |= 1 << a
            status = hdrs.get(schema.H_STATUS) if hdrs else None
            if status == "received" or (
                status is None and schema.is_body_receipt(msg.data, self.request_id)
            ):
                if current:
                    acked = True
                    # a receipt naming a holder: the agent answered from that one's claim
                    taker = (hdrs.get(schema.H_HOLDER) if hdrs else None) or agent
                    self.taker = taker
                    if self.ack_mode == "received":
                        receipt = _receipt_decoder.decode(msg.data)
                        return "ok", msgspec.structs.replace(receipt, agent_id=taker)
                continue
            # Only the agent an attempt was sent to can publish to that attempt's reply
            # subject: it took the task — or answered its holder's stored result, naming it.
            holder = hdrs.get(schema.H_HOLDER) if hdrs else None
            self.taker = holder or self.agents.get(a, agent)
            if status == "chunk" or (status == "completed" and schema.H_CHUNKS in hdrs):
                if self.stream:  # a stream began (late ones too: the claim allows one)
                    return "ok", StreamStart(a, msg)
                continue
            # A result, from this attempt or a late one: the first result wins.
            return self.result(msg, agent)

    def _refused_late(self, attempt: int) -> None:
        """An error reply to an earlier ``attempt`` (ended "not delivered": no receipt in
        time): with no receipt or answer from it before, its agent did not take the request
        (an agent that could not confirm its claim refuses it after its claim timeout, later
        than the caller's receipt timeout)."""
        if not self.received >> attempt & 1 and attempt not in self.untaken:
            self.untaken += (attempt,)

    async def late_reply(self) -> tuple[Literal["untaken", "closed", "ok", "error"], Any]:
        """Read the late replies while the call waits for a record, its attempts over, until
        one ends the wait: a result (``ok``, or ``error`` when it is not JSON; an agent that
        stores no record answers only so), ``untaken`` once no agent may be running the
        request (each refused it before any receipt, or had no responder: :meth:`runners`
        is empty), ``closed`` at this client's own close or cancel mark."""
        while True:
            a, msg = await self.queue.get()
            if msg is _CLOSED or msg is _CANCELLED:
                return "closed", None
            if msg is _LOST or isinstance(msg, Stored):
                continue
            hdrs = msg.headers
            if is_no_responders(msg) or from_reply(hdrs, msg.data) is not None:
                self._refused_late(a)
                if not self.runners():
                    return "untaken", None
                continue
            self.received |= 1 << a
            status = hdrs.get(schema.H_STATUS) if hdrs else None
            if status in ("received", "chunk") or (
                status is None and schema.is_body_receipt(msg.data, self.request_id)
            ) or (status == "completed" and schema.H_CHUNKS in hdrs):  # fmt: skip
                continue
            self.taker = (hdrs.get(schema.H_HOLDER) if hdrs else None) or self.agents.get(a)
            outcome, value = self.result(msg, self.taker)
            return ("ok" if outcome == "ok" else "error"), value

    async def next_reply(self, until: float, clock: Callable[[], float]) -> tuple[int, Any] | None:
        """The next reply to any attempt (or a lost, closed or cancelled mark), with its
        attempt; None once ``until`` on ``clock`` passes (asyncio.timeout, not wait_for: a
        cancel here is never lost)."""
        try:
            async with asyncio.timeout(max(until - clock(), 0.0)):
                return await self.queue.get()
        except TimeoutError:
            return None

    def _closed(self, msg: Any) -> tuple[Outcome, Any] | None:
        """The end a mark of this client's makes (it closed; ``Client.cancel``), else None."""
        if msg is _CLOSED:
            return "closed", InternalError("client closed while the call was in flight")
        if msg is _CANCELLED:
            assert self.cancelled is not None
            return "closed", self.cancelled
        return None

    async def _prompted(self, clock: Callable[[], float]) -> tuple[Outcome, Any]:
        """:meth:`outcome` of an attempt to a Synadia agent: its prompt stream (an earlier
        attempt's reach result still wins)."""
        n, agent = self.attempt, self.agent_id
        acked = False
        chunks: list[Any] = []
        while True:
            got = await self.next_reply(self.deadline, clock)
            if got is None:
                return "timeout", Timeout(
                    f"agent {agent!r} (synadia-agents) "
                    + ("sent no end of its answer" if acked else "did not acknowledge the "
                       "prompt (still busy with an earlier one, or gone)")
                    + " within the call's deadline"
                )  # fmt: skip
            a, msg = got
            closed = self._closed(msg)
            if closed is not None:
                return closed
            if msg is _LOST:
                if a == n:
                    return "lost", Timeout(f"agent {agent!r} was lost while running the prompt")
                continue
            hdrs = msg.headers
            if a != n:  # an earlier attempt's: only a reach agent's result counts
                if (
                    hdrs
                    and hdrs.get(schema.H_STATUS) == "completed"
                    and schema.H_CHUNKS not in hdrs
                ):
                    return self.result(msg, self.agents.get(a))
                continue
            if is_no_responders(msg):
                return "no_responders", NoReachableAgent(
                    f"no responders: agent {agent!r} is not subscribed to {self.subject!r}"
                )
            kind, value = prompting.read(msg, agent)
            if kind == "ack" and not acked:
                acked = True
                self.taker = agent
                if self.ack_mode == "received":
                    return "ok", schema.Receipt(request_id=self.request_id,
                                                agent_id=agent or msgspec.UNSET)  # fmt: skip
            elif kind == "chunk":
                self.taker = agent
                if self.stream:
                    return "ok", StreamStart(a, msg)
                chunks.append(value)
            elif kind == "end":
                return "ok", streams.join(chunks)
            elif kind == "error":
                return "error", value

    def result(self, msg: Any, agent: str | None) -> tuple[Outcome, Any]:
        """A result reply: its JSON decoded, or ``error`` when it is not JSON."""
        try:
            return "ok", _result_decoder.decode(msg.data) if msg.data else None
        except msgspec.DecodeError as exc:
            return "error", InternalError(f"result from agent {agent!r} is not JSON ({exc})")


def encode_payload(payload: Any) -> bytes:
    """The task body: bytes as given, anything else as JSON (``None``: empty)."""
    if payload is None:
        return b""
    if isinstance(payload, bytes | bytearray | memoryview):
        return bytes(payload)
    if isinstance(payload, msgspec.Raw):
        return bytes(payload)
    try:
        return _payload_encoder.encode(payload)
    except (TypeError, msgspec.EncodeError) as exc:
        raise InvalidRequest(f"payload is not JSON-serializable ({exc})") from None
