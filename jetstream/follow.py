"""A stream followed from a start point, then live: every message of its subjects handed over
once, in order, with no gap, whatever happens to the consumer underneath (a reconnect, the
loss of the node that held it, a leader change, its deletion).

nats-py's ordered consumer promises as much, but rebuilds its consumer with
``deliver_policy=by_start_sequence`` while keeping the ``opt_start_time`` it was started with,
which the server refuses (``err_code`` 10094: "consumer delivery policy is deliver by start
sequence, but optional start time is also set"; nats.go fixed the same in its #1341), and a
creation that fails is only handed to the connection's error callback. A follow that started
from a time (the broker's claims, ``reach events --since``) stopped for good at the first
node loss, and nothing said so (loadtest.nemesis found it: a broker stopped learning claims
after a NATS node was killed). Turning the time into a sequence before subscribing mends
that reset (at the cost of a throwaway consumer per follow); the follower also
says when and why a follow is lost, counts it for an alert, and notices a lost consumer after
3 missed heartbeats of 1 s instead of nats-py's 2 of 5 s (waiting longer while stalls come
one after another: :class:`StallRule`).

:class:`Follower` owns its consumer instead, made as the ordered consumer makes its own
(ephemeral, one replica in memory, no acks, flow control, idle heartbeats) and delivering to
an inbox of its own. It remembers the stream sequence of the last message it took and
rebuilds the consumer from the next one when

- the idle heartbeats stop (``STALL_HEARTBEATS`` intervals with nothing, more after stalls
  in a row: the consumer was deleted, or its server is gone);
- a consumer sequence is skipped, on a delivery or in a heartbeat's ``Nats-Last-Consumer``
  (a message was lost: a reconnect, a slow-consumer drop);
- the connection was lost (the consumer may have gone with its server; messages sent
  meanwhile were).

A rebuild is tried again, with backoff, until the server takes it. Every loss, rebuild and
failed attempt is logged by the follow's name (``follow.lost``, ``follow.rebuilt``,
``follow.rebuild_failed``) and counted (:class:`FollowMetrics`). Each consumer asks for one
deliver policy only: the start as given while nothing was delivered yet (a start time is
fixed once, when the follow is made), else ``by_start_sequence`` after the last message taken.

The callback runs in one task, one message at a time, in stream order. Flow control is
answered once every message received before the request was handed over, so a slow callback
slows the server down instead of filling memory.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import logging
import math
import random
import time
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from typing import Any, NamedTuple, Protocol

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.errors import Error as NatsError
from nats.js import api

from .tasks import raise_if_cancelled

log = logging.getLogger(__name__)

HEARTBEAT_S = 1.0
"""The consumer's idle heartbeat: the server sends one when it had nothing to deliver for so
long (one small message per second per follow)."""
STALL_HEARTBEATS = 3
"""Heartbeat intervals without any message before the consumer counts as lost (the first
time: see :class:`StallRule`)."""
STALL_CALM_S = 60.0
"""A stall this long after the last one counts as the first again."""
STALL_MAX_S = 30.0
"""The longest silence a stall waits for, however many came in a row."""
RETRY_FIRST_S = 0.25
RETRY_MAX_S = 5.0
"""First and longest pause between two failed rebuilds (doubling, jittered)."""
API_TIMEOUT_S = 2.0
"""How long a consumer creation may take before it counts as failed."""

LOSS_REASONS = ("stall", "gap", "reconnect", "deleted")
"""Why a consumer was rebuilt (the ``reason`` of ``reach_follow_rebuilds_total``)."""
YIELD_EVERY = 32
"""Messages handed to the callback in a row before the event loop runs the rest. A backlog
delivered at once (the audit trail of 100,000 agents registering, to each broker's console)
was otherwise handed over whole, and no route request read meanwhile was answered: 3.4 s
without an answer from any of 4 brokers (``loadtest/README.md``)."""

_ACK_PREFIX = "$JS.ACK."
_STATUS = "Status"
_CONTROL = "100"
_LAST_CONSUMER = "Nats-Last-Consumer"
_STALLED = "Nats-Consumer-Stalled"
_GONE = ("404", "409")
"""Statuses a push consumer may be told on its way out (``409 Consumer Deleted``)."""

MsgCallback = Callable[[Msg], Awaitable[None]]
"""Handed each stored message (``msg.metadata`` has its stream sequence, time, pending)."""


class StallRule:
    """How long a follow may hear nothing before its consumer counts as lost.

    ``STALL_HEARTBEATS`` heartbeat intervals, doubled at each stall that comes within
    ``STALL_CALM_S`` of the one before (up to ``STALL_MAX_S``), the first again after a calm
    that long. A server so busy that its idle heartbeats come seconds late would otherwise
    be asked for a new consumer every few seconds by every follow (a hundred rebuilds a
    run, seen under 100,000 agents' snapshot writes), each one more request to the server
    that is behind; a lost consumer is then noticed later, and each stall says how long the
    next one waits (``follow.lost``). A skipped sequence or a reconnect is not a silence:
    it is acted on at once, whatever this says."""

    __slots__ = ("_last", "doublings", "heartbeat_s")

    def __init__(self, heartbeat_s: float) -> None:
        self.heartbeat_s = heartbeat_s
        self.doublings = 0
        """Stalls in a row, each within ``STALL_CALM_S`` of the one before, after the first."""
        self._last = -math.inf

    @property
    def after(self) -> float:
        """The silence (seconds) that counts as a stall now."""
        base = STALL_HEARTBEATS * self.heartbeat_s
        if not self.doublings:
            return base
        return min(base * 2.0 ** min(self.doublings, 16), max(STALL_MAX_S, base))

    def stalled(self, silent: float, now: float) -> bool:
        """Whether ``silent`` seconds without a message is a stall at ``now``."""
        if self.doublings and now - self._last > STALL_CALM_S:
            self.doublings = 0
        return silent > self.after

    def lost(self, now: float) -> None:
        """A stall was declared at ``now``: the next one waits twice as long if it comes
        within ``STALL_CALM_S``."""
        if now - self._last <= STALL_CALM_S:
            self.doublings += 1
        self._last = now


class Start(NamedTuple):
    """Where a follow begins: one deliver policy and the one option it takes."""

    policy: api.DeliverPolicy = api.DeliverPolicy.ALL
    seq: int | None = None
    time: datetime | None = None

    @classmethod
    def at_seq(cls, seq: int) -> Start:
        """From stream sequence ``seq`` (the first message stored at or after it)."""
        return cls(api.DeliverPolicy.BY_START_SEQUENCE, seq=max(seq, 1))

    @classmethod
    def at_time(cls, unix_s: float) -> Start:
        """From the first message stored at or after ``unix_s`` (Unix seconds)."""
        return cls(api.DeliverPolicy.BY_START_TIME,
                   time=datetime.fromtimestamp(max(unix_s, 0.0), UTC))  # fmt: skip

    @classmethod
    def last_per_subject(cls) -> Start:
        """The last message of each subject, in stream order."""
        return cls(api.DeliverPolicy.LAST_PER_SUBJECT)

    def describe(self) -> str:
        if self.seq is not None:
            return f"seq:{self.seq}"
        if self.time is not None:
            return f"time:{self.time.isoformat()}"
        return str(self.policy.value)


ALL = Start()
"""Every message stored, from the first."""


class FollowMetrics(Protocol):
    """Where a follower counts what happens to it (the broker's Prometheus metrics)."""

    def lost(self, reason: str) -> None:
        """The consumer was lost (one of :data:`LOSS_REASONS`): nothing is delivered until
        it is rebuilt."""

    def rebuilt(self, reason: str) -> None:
        """A consumer lost for ``reason`` was made again: deliveries go on."""

    def failed(self) -> None:
        """One attempt to rebuild failed (it is tried again)."""

    def stopped(self) -> None:
        """The follow was stopped on purpose (it is no longer lost either)."""


class _Uncounted:
    """The metrics of a follower nobody scrapes (the CLI's): logs only."""

    def lost(self, reason: str) -> None:
        pass

    def rebuilt(self, reason: str) -> None:
        pass

    def failed(self) -> None:
        pass

    def stopped(self) -> None:
        pass


UNCOUNTED: FollowMetrics = _Uncounted()


class Follower:
    """Every message of ``subject`` in ``stream`` from ``start``, then live, to ``cb``.

    :meth:`start` makes the first consumer (its errors are the caller's: no stream, no
    JetStream); from then on the follower keeps itself going until :meth:`stop` or until the
    connection is closed."""

    def __init__(
        self,
        nc: NATS,
        cb: MsgCallback,
        *,
        name: str,
        stream: str,
        subject: str,
        start: Start = ALL,
        metrics: FollowMetrics = UNCOUNTED,
        heartbeat_s: float = HEARTBEAT_S,
        timeout_s: float = API_TIMEOUT_S,
    ) -> None:
        self.nc = nc
        self.name = name
        """What the logs and the metrics call this follow (``claims``, ``rules``,
        ``presence``, ``audit``)."""
        self.stream = stream
        self.subject = subject
        self.start_at = start
        self.metrics = metrics
        self.heartbeat_s = heartbeat_s
        self.timeout_s = timeout_s
        self._cb = cb
        self._js = nc.jetstream(timeout=timeout_s)
        self.last = 0
        """Stream sequence of the last message handed to the callback (0: none yet)."""
        self.following = False
        """True while a consumer delivers (from a successful creation until a loss)."""
        self.consumer: str | None = None
        """The current consumer's name (the server's choice)."""
        self.inbox = ""
        """The subject the current consumer delivers to (a new inbox for each)."""
        self.rebuilds = 0
        """Consumers made again after a loss."""
        self.failures = 0
        """Attempts to make one again that failed."""
        self._taken = 0  # stream sequence of the last message queued for the callback
        self._gen = 0  # the consumer whose deliveries count; any other's are dropped
        self._dseq = 0  # its last consumer sequence received
        self._sub: Any = None
        self._seen = 0.0  # monotonic time of its last message (data, heartbeat, control)
        self.stall = StallRule(heartbeat_s)
        self._reconnects = 0
        # Taken, not yet handed over: at most what the server sends before flow control
        # waits for our answer. (A deque and a wake-up future: a tenth cheaper per message
        # than an asyncio.Queue, measured with loadtest/followcost.py.)
        self._queue: collections.deque[Msg] = collections.deque()
        self._wake: asyncio.Future[None] | None = None
        self._queued = 0  # messages taken so far
        self._handled = 0  # messages handed over (or dropped as seen) so far
        self._flow_reply: tuple[str, int] | None = None  # (reply, answer once handled >= n)
        self._why: str | None = None  # why the consumer is lost (None: it is not)
        self._lost_at = 0.0
        self._trouble = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._stopped = False

    async def start(self) -> api.ConsumerInfo:
        """Make the first consumer and start following; its info as created (before any
        delivery: ``num_pending`` is the history still to come)."""
        if self._tasks:
            raise RuntimeError(f"follow {self.name} already started")
        info = await self._open()
        self._tasks = [
            asyncio.create_task(self._deliver(), name=f"reach-follow-{self.name}"),
            asyncio.create_task(self._supervise(), name=f"reach-follow-{self.name}-watch"),
        ]
        return info

    async def stop(self, *, delete: bool = False) -> None:
        """Stop delivering. The server removes the consumer once it notices that nobody
        listens (an ephemeral consumer's inactive threshold, 5 s by default); ``delete``
        removes it now (one request; a consumer already gone or a lost connection ignored)."""
        self._stopped = True
        tasks, self._tasks = self._tasks, []
        current = asyncio.current_task()
        for task in tasks:
            if task is not current:
                task.cancel()
        waiting = [t for t in tasks if t is not current]
        if waiting:
            await asyncio.wait(waiting, timeout=2.0)
        self._gen += 1
        self.following = False
        self.metrics.stopped()
        sub, self._sub = self._sub, None
        if sub is not None:
            with contextlib.suppress(Exception):  # a closed connection has nothing to undo
                await sub.unsubscribe()
        consumer = self.consumer
        if delete and consumer is not None and self.nc.is_connected:
            with contextlib.suppress(Exception):  # gone already, or the connection with it
                await self._js.delete_consumer(self.stream, consumer)

    # --- the consumer ------------------------------------------------------------------

    def _next_start(self) -> Start:
        """The start as given until a message was taken, then right after the last one."""
        return self.start_at if self._taken == 0 else Start.at_seq(self._taken + 1)

    async def _open(self) -> api.ConsumerInfo:
        """Subscribe a new inbox, then make a consumer delivering to it; the old one's
        deliveries are dropped from here on."""
        self._gen += 1
        gen = self._gen
        start = self._next_start()
        self._dseq = 0
        inbox = self.nc.new_inbox()
        sub = await self.nc.subscribe(inbox, cb=functools.partial(self._receive, gen))
        config = api.ConsumerConfig(
            description=f"reach follow {self.name}",
            deliver_subject=inbox,
            filter_subject=self.subject,
            deliver_policy=start.policy,
            opt_start_seq=start.seq,
            opt_start_time=start.time,
            ack_policy=api.AckPolicy.NONE,
            max_deliver=1,
            flow_control=True,
            idle_heartbeat=self.heartbeat_s,
            num_replicas=1,
            mem_storage=True,
        )
        try:
            info = await self._js.add_consumer(self.stream, config, timeout=self.timeout_s)
        except BaseException:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
            raise
        old, self._sub = self._sub, sub
        self.consumer, self.inbox = info.name, inbox
        self.following = True
        self._seen = time.monotonic()
        self._reconnects = self.nc.stats["reconnects"]
        if old is not None:
            with contextlib.suppress(Exception):
                await old.unsubscribe()
        return info

    def _lose(self, reason: str, detail: str) -> None:
        """The consumer is lost: drop what it still sends, have it rebuilt."""
        if self._why is not None:
            return
        self._gen += 1
        self._why = reason
        self._lost_at = time.monotonic()
        self.following = False
        self.metrics.lost(reason)
        log.warning("follow.lost name=%s stream=%s consumer=%s reason=%s last_seq=%d: %s",
                    self.name, self.stream, self.consumer, reason, self._taken,
                    detail)  # fmt: skip
        self._trouble.set()

    async def _supervise(self) -> None:
        """Notice a stall or a lost connection; rebuild whatever was lost."""
        tick = self.heartbeat_s / 2
        while True:
            raise_if_cancelled()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(tick):
                    await self._trouble.wait()
            if self.nc.is_closed:
                self.following = False
                self._stopped = True
                self._wake_deliverer()
                log.debug("follow.ended name=%s stream=%s last_seq=%d: the connection is closed",
                         self.name, self.stream, self._taken)  # fmt: skip
                return
            if self._why is None:
                now = time.monotonic()
                silent = now - self._seen
                if not self.nc.is_connected or self.nc.stats["reconnects"] != self._reconnects:
                    self._lose("reconnect", "the connection to the server was lost")
                elif self.stall.stalled(silent, now):
                    self.stall.lost(now)
                    self._lose("stall", f"nothing heard for {silent:.1f}s (heartbeat every "
                                        f"{self.heartbeat_s:g}s; the next stall after "
                                        f"{self.stall.after:g}s)")  # fmt: skip
                else:
                    continue
            await self._rebuild()

    async def _rebuild(self) -> None:
        """Make the consumer again from the message after the last one taken; try again
        (after a pause, doubling) until the server takes it."""
        why = self._why or "stall"
        pause = RETRY_FIRST_S
        attempts = 0
        while True:
            raise_if_cancelled()
            if self.nc.is_closed:
                return
            if not self.nc.is_connected:  # nothing to ask until it is back
                await asyncio.sleep(self.heartbeat_s / 2)
                continue
            attempts += 1
            self._why = None
            self._trouble.clear()
            start = self._next_start()
            try:
                await self._open()
            except Exception as exc:  # noqa: BLE001 - a rebuild is retried, whatever failed
                self._why = why
                self._gen += 1
                self.following = False
                self.failures += 1
                self.metrics.failed()
                log.warning("follow.rebuild_failed name=%s stream=%s from=%s reason=%s "
                            "attempt=%d error=%s: tried again in %.2fs", self.name,
                            self.stream, start.describe(), why, attempts,
                            _describe(exc), pause)  # fmt: skip
                await asyncio.sleep(pause * random.uniform(0.8, 1.0))
                pause = min(pause * 2, RETRY_MAX_S)
                continue
            self.rebuilds += 1
            self.metrics.rebuilt(why)
            log.warning("follow.rebuilt name=%s stream=%s consumer=%s from=%s reason=%s "
                        "attempts=%d after=%.1fs", self.name, self.stream, self.consumer,
                        start.describe(), why, attempts,
                        time.monotonic() - self._lost_at)  # fmt: skip
            return

    # --- deliveries --------------------------------------------------------------------

    async def _receive(self, gen: int, msg: Msg) -> None:
        """Every message of consumer ``gen``'s inbox, in arrival order (nats-py runs one
        callback at a time per subscription): check, queue, answer flow control."""
        if gen != self._gen:
            return
        self._seen = time.monotonic()
        reply = msg.reply
        if reply.startswith(_ACK_PREFIX):
            try:
                md = msg.metadata
            except Exception:  # noqa: BLE001 - not a JetStream reply after all
                log.warning("follow.not_a_delivery name=%s reply=%s", self.name, reply[:120])
                return
            dseq = md.sequence.consumer
            if dseq != self._dseq + 1:
                self._lose("gap", f"consumer sequence {dseq} after {self._dseq}")
                return
            self._dseq = dseq
            seq = md.sequence.stream
            if seq <= self._taken:
                return
            self._taken = seq
            self._queued += 1
            self._queue.append(msg)
            self._wake_deliverer()
            return
        headers = msg.headers or {}
        status = headers.get(_STATUS)
        if status == _CONTROL:
            if reply:  # a flow control request
                await self._flow_control(reply)
                return
            last = headers.get(_LAST_CONSUMER)  # an idle heartbeat
            if last is not None and last.isdigit() and int(last) != self._dseq:
                self._lose("gap", f"the heartbeat names consumer sequence {last}, the last "
                                  f"one received is {self._dseq}")  # fmt: skip
                return
            stalled = headers.get(_STALLED)
            if stalled:
                await self._flow_control(stalled)
        elif status in _GONE:
            self._lose("deleted", f"the server said {status} {headers.get('Description', '')}")

    async def _flow_control(self, reply: str) -> None:
        """Answer now if every message received so far was handed over, else once it is."""
        if self._handled >= self._queued:
            await self._answer(reply)
        else:
            self._flow_reply = (reply, self._queued)

    async def _answer(self, reply: str) -> None:
        with contextlib.suppress(NatsError):  # lost with the connection: the server asks again
            await self.nc.publish(reply, b"")

    def _wake_deliverer(self) -> None:
        wake = self._wake
        if wake is not None and not wake.done():
            wake.set_result(None)

    async def _deliver(self) -> None:
        """Hand the queued messages to the callback, one at a time."""
        queue = self._queue
        while not self._stopped:
            raise_if_cancelled()
            if not queue:
                self._wake = asyncio.get_running_loop().create_future()
                await self._wake
                continue
            msg = queue.popleft()
            seq = msg.metadata.sequence.stream
            if seq > self.last:
                try:
                    await self._cb(msg)
                except Exception:  # noqa: BLE001 - one bad message never ends the follow
                    log.exception("follow.callback_failed name=%s stream=%s seq=%d",
                                  self.name, self.stream, seq)  # fmt: skip
                self.last = seq
            self._handled += 1
            pending = self._flow_reply
            if pending is not None and self._handled >= pending[1]:
                self._flow_reply = None
                await self._answer(pending[0])
            if self._handled % YIELD_EVERY == 0:
                await asyncio.sleep(0)


def _describe(exc: BaseException) -> str:
    """An exception in one line: nats-py's API errors print their description and codes."""
    text = str(exc) or repr(exc)
    return f"{type(exc).__name__}: {text}" if type(exc).__name__ not in text else text
