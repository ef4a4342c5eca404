"""The agent side: announce, heartbeat, answer probes, serve tasks, leave.

One NATS connection named after the agent id (the broker keys the server's disconnect
advisories on it). Control traffic never waits behind business work: announce and heartbeat
run on their own asyncio tasks, probes on their own subscription, and every task subscription
callback only decides (duplicate? draining? loop? full?) and hands the work to an asyncio
task, so the callback returns at once and the next message is read.

Per task (``reach.task.<agent_id>.<capability>``)::

    duplicate Reach-Request-Id → the first result (or join the running one)
    draining                   → DRAINING
    Reach-Hops visits us > 3   → LOOP_DETECTED
    active == max_concurrency  → TARGET_BUSY
    otherwise                  → receipt (if asked) → handler → result / error

The durable-ack hook: ``Agent(ack_sink=...)`` takes any object with
``async def record(rec: schema.AckRecord) -> None`` (and optional ``async start()`` /
``async stop()``, called when the agent starts and after it drained). It is called with
state ``received`` when a task is accepted (before the handler runs) and ``completed``
(``result`` = the reply body as ``msgspec.Raw``) or ``failed`` (``error`` =
``{"code", "message"}``) when it ends. Exceptions it raises are logged, never fatal.
With ``Reach-Ack-Mode: received`` the caller gets only the receipt; the result exists only
through the sink (without a sink it is logged and dropped).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import random
import time
import uuid
from collections import OrderedDict, deque
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol

import msgspec
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.errors import SlowConsumerError

from . import schema
from ._runtime import connect_options, drain_or_close, flush_subscriptions, server_list
from .errors import (
    Draining,
    InternalError,
    InvalidRequest,
    LoopDetected,
    ReachError,
    TargetBusy,
    from_reply,
    to_reply,
)
from .metrics import AgentMetrics
from .task import LOOP_LIMIT, Task

log = logging.getLogger(__name__)

Handler = Callable[[Task], Any]
Reply = tuple[dict[str, str], bytes]

_result_encoder = msgspec.json.Encoder()
_payload_decoder = msgspec.json.Decoder()


class AckSink(Protocol):
    """Receives an :class:`~reach_agent.schema.AckRecord` per task state change."""

    async def record(self, rec: schema.AckRecord) -> None: ...


class _Entry:
    """A request id seen recently: its running or finished reply."""

    __slots__ = ("expires", "future")

    def __init__(self, future: asyncio.Future[Reply]) -> None:
        self.future = future
        self.expires = float("inf")  # set when the task finishes


class Agent:
    """An agent: its identity and capabilities, its handlers, and the wiring to NATS.

    ``heartbeat_interval`` and ``timeout_hint`` are seconds; ``grace`` is how long a drain
    waits for in-flight tasks; ``dedup_size``/``dedup_ttl`` bound the cache of recent
    results that makes a repeated request id answer with the first result (the duplicate
    window, DESIGN §8: 2 min).
    """

    def __init__(
        self,
        agent_id: str,
        capabilities: Sequence[str],
        max_concurrency: int = 8,
        *,
        region: str | None = None,
        tags: dict[str, str] | None = None,
        version: str | None = None,
        heartbeat_interval: float = 5.0,
        timeout_hint: float | None = None,
        agent_type: str | None = None,
        metadata: dict[str, Any] | None = None,
        prefix: str = "reach",
        grace: float = 30.0,
        dedup_size: int = 10_000,
        dedup_ttl: float = 120.0,
        announce_refresh: float = 600.0,
        ack_sink: AckSink | None = None,
        metrics: AgentMetrics | None = None,
        durable_acks: bool = True,
        ack_wal_dir: str | None = None,
    ) -> None:
        schema.check_agent_id(agent_id)
        caps = list(capabilities)
        if not caps:
            raise InvalidRequest("capabilities is empty: an agent needs at least one")
        for i, cap in enumerate(caps):
            schema.check_capability(cap, f"capabilities[{i}]")
        if len(set(caps)) != len(caps):
            raise InvalidRequest(f"capabilities {caps!r} lists a capability twice")
        if max_concurrency < 1:
            raise InvalidRequest(f"max_concurrency {max_concurrency!r} must be at least 1")
        if heartbeat_interval < 0.05:
            raise InvalidRequest(f"heartbeat_interval {heartbeat_interval!r} is below 0.05 s")
        self.agent_id = agent_id
        self.capabilities = caps
        self.max_concurrency = max_concurrency
        self.prefix = prefix
        self.heartbeat_interval = heartbeat_interval
        self.grace = grace
        self.dedup_size = dedup_size
        self.dedup_ttl = dedup_ttl
        self.announce_refresh = announce_refresh
        self.ack_sink = ack_sink
        self.metrics = metrics
        # Issue 4: without an explicit ack_sink, acks go to REACH_ACKS through a write-ahead
        # AckWriter (WAL in ack_wal_dir, else $REACH_ACK_DIR/<agent_id> or
        # ~/.cache/reach/<agent_id>), created at start with the agent's servers.
        self.durable_acks = durable_acks
        self.ack_wal_dir = ack_wal_dir
        self.announcement = schema.Announce(
            agent_id=agent_id,
            capabilities=caps,
            max_concurrency=max_concurrency,
            heartbeat_interval_ms=int(heartbeat_interval * 1000),
            agent_type=agent_type,
            version=version,
            region=region,
            tags=dict(tags or {}),
            timeout_hint_ms=int(timeout_hint * 1000) if timeout_hint else None,
            metadata=dict(metadata or {}),
        )
        schema.validate_announce(self.announcement, agent_id)
        self._handlers: dict[str, tuple[Handler, bool]] = {}
        self.nc: NATS | None = None
        self.token: str | None = None
        self.broker_id: str | None = None
        self.draining = False
        self.ok_total = 0
        self.fail_total = 0
        self.active = 0
        self.seq = 0
        self._started = False
        self._initial = False
        self._subs: list[Subscription] = []
        self._task_subs: list[Subscription] = []
        self._bg: list[asyncio.Task[Any]] = []
        self._tasks: set[asyncio.Task[Any]] = set()
        self._running: dict[str, float] = {}
        # Durations of tasks finished since the last heartbeat: the broker smooths them
        # (EWMA), so the freshest p50 lets it see a slowdown within a heartbeat or two.
        self._durations: deque[float] = deque(maxlen=1024)
        self._last_p50: int | None = None
        self._seen: OrderedDict[str, _Entry] = OrderedDict()
        self._idle = asyncio.Event()
        self._idle.set()
        self._reannounce = asyncio.Event()
        self._hb_wake = asyncio.Event()
        self._executor: ThreadPoolExecutor | None = None
        self._task_cut = len(f"{prefix}.task.{agent_id}.")

    # --- handlers ---------------------------------------------------------------------

    def handler(self, capability: str) -> Callable[[Handler], Handler]:
        """Register the handler of ``capability``: ``async def f(task) -> result`` or a
        plain function (run in a worker thread). ``result`` must be JSON-serializable."""
        if capability not in self.capabilities:
            raise InvalidRequest(
                f"capability {capability!r} is not among this agent's {self.capabilities!r}"
            )

        def register(fn: Handler) -> Handler:
            self._handlers[capability] = (fn, inspect.iscoroutinefunction(fn))
            return fn

        return register

    # --- lifecycle ----------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def serve(self, servers: str | Sequence[str] | None = None) -> AsyncIterator[Agent]:
        """``async with agent.serve():`` serves until the block ends, then drains."""
        await self.start(servers)
        try:
            yield self
        finally:
            await self.stop()

    async def start(self, servers: str | Sequence[str] | None = None) -> None:
        if self._started:
            return
        missing = [c for c in self.capabilities if c not in self._handlers]
        if missing:
            raise InvalidRequest(f"capabilities {missing!r} have no handler")
        self.draining = False
        nc = NATS()
        await nc.connect(
            **connect_options(self.agent_id, server_list(servers)),
            error_cb=self._on_error,
            disconnected_cb=self._on_disconnected,
            reconnected_cb=self._on_reconnected,
        )
        self.nc = nc
        try:
            await self._setup(nc, servers)
        except BaseException:
            self._subs, self._task_subs = [], []
            await nc.close()
            raise
        self._started = True
        log.info("agent.started agent=%s capabilities=%s", self.agent_id, self.capabilities)

    async def _setup(self, nc: NATS, servers: str | Sequence[str] | None) -> None:
        if self.ack_sink is None and self.durable_acks:
            from .durable import default_ack_writer

            self.ack_sink = default_ack_writer(
                self.agent_id, server_list(servers), prefix=self.prefix, wal_dir=self.ack_wal_dir
            )
        if self.ack_sink is not None and hasattr(self.ack_sink, "start"):
            await self.ack_sink.start()
        p, me = self.prefix, self.agent_id
        self._subs.append(await nc.subscribe(f"{p}.probe.{me}", cb=self._on_probe))
        for cap in self.capabilities:
            sub = await nc.subscribe(
                f"{p}.task.{me}.{cap}", cb=self._on_task, pending_msgs_limit=100_000
            )
            self._task_subs.append(sub)
        self._subs.extend(self._task_subs)
        await flush_subscriptions(nc)
        self._bg = [
            asyncio.create_task(self._announce_loop(), name=f"reach-announce-{me}"),
            asyncio.create_task(self._heartbeat_loop(), name=f"reach-heartbeat-{me}"),
        ]

    async def stop(self, grace: float | None = None) -> None:
        """Drain: answer DRAINING to new tasks, leave, finish in-flight tasks within
        ``grace`` (default: the agent's), then close the connection."""
        if not self._started:
            return
        self._started = False
        grace = self.grace if grace is None else grace
        nc = self.nc
        assert nc is not None
        self.draining = True
        announce_task, hb_task = self._bg
        announce_task.cancel()
        self._reannounce.set()  # and wake it, should the cancel be lost (see _stop_loops)
        self._hb_wake.set()  # report `draining` now, not at the next tick
        await self._leave(nc)
        if self.active:
            log.info("agent.draining agent=%s in_flight=%d grace=%.1fs", self.agent_id,
                     self.active, grace)  # fmt: skip
            await _wait(self._idle, grace)
            if self.active:
                log.warning("agent.grace_expired agent=%s cancelling=%d", self.agent_id,
                            self.active)  # fmt: skip
        for t in list(self._tasks):
            t.cancel()
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=1.0)
        await _stop_loops(announce_task, hb_task)
        self._bg = []
        if self.ack_sink is not None and hasattr(self.ack_sink, "stop"):
            try:
                # Bounded: acks not yet stored stay in the sink's write-ahead file.
                async with asyncio.timeout(10.0):
                    await self.ack_sink.stop()
            except Exception:  # closing must go on
                log.exception("agent.ack_sink_stop_failed agent=%s", self.agent_id)
        await drain_or_close(nc, 5.0)
        self._subs, self._task_subs = [], []
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None
        log.info("agent.stopped agent=%s ok=%d fail=%d", self.agent_id, self.ok_total,
                 self.fail_total)  # fmt: skip

    # --- connection callbacks -----------------------------------------------------------

    async def _on_error(self, exc: Exception) -> None:
        kind = "slow_consumer" if isinstance(exc, SlowConsumerError) else type(exc).__name__
        if self.metrics is not None:
            self.metrics.nats_errors.labels(kind).inc()
        if isinstance(exc, SlowConsumerError):
            log.warning("agent.slow_consumer agent=%s subject=%s", self.agent_id, exc.subject)
        else:
            log.debug("agent.nats_error agent=%s error=%r", self.agent_id, exc)

    async def _on_disconnected(self) -> None:
        log.info("agent.disconnected agent=%s", self.agent_id)

    async def _on_reconnected(self) -> None:
        log.info("agent.reconnected agent=%s: re-announcing", self.agent_id)
        self._reannounce.set()

    # --- announce, heartbeat, probe, leave ----------------------------------------------

    async def _announce_loop(self) -> None:
        """Announce until a broker answers (backoff 0.1 s doubling to 5 s, jittered); then
        again on reconnect and every ``announce_refresh`` seconds (token rotation, and a
        broker that restarted without our record)."""
        nc = self.nc
        assert nc is not None
        subject = f"{self.prefix}.announce.{self.agent_id}"
        body = schema.encoder.encode(self.announcement)
        delay = 0.1
        while not self.draining:
            self._reannounce.clear()
            try:
                reply = await nc.request(subject, body, timeout=1.0)
                if self.draining:
                    return  # a cancel lost inside nc.request (3.11 wait_for race)
                err = from_reply(reply.headers, reply.data)
                if err is not None:
                    log.error("agent.announce_refused agent=%s code=%s message=%s",
                              self.agent_id, err.code, err.message)  # fmt: skip
                    delay = max(delay, 5.0)
                else:
                    ack = msgspec.json.decode(reply.data, type=schema.AnnounceAck)
                    self.token = ack.token
                    self.broker_id = ack.broker_id
                    if ack.heartbeat_interval_ms > 0:
                        self.heartbeat_interval = ack.heartbeat_interval_ms / 1000.0
                    self._initial = True
                    self._hb_wake.set()
                    log.info("agent.announced agent=%s broker=%s", self.agent_id, ack.broker_id)
                    delay = 0.1
                    refresh = self.announce_refresh * random.uniform(0.9, 1.1)
                    await _wait(self._reannounce, refresh)
                    continue
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # no broker yet: keep trying
                log.debug("agent.announce_unanswered agent=%s error=%r", self.agent_id, exc)
            await asyncio.sleep(delay * (0.5 + random.random()))
            delay = min(delay * 2, 5.0)

    def status(self) -> schema.AgentStatus:
        if self.draining:
            return "draining"
        return "busy" if self.active else "idle"

    def queue_depth(self) -> int:
        """Task messages received by the connection but not yet looked at."""
        return sum(s.pending_msgs for s in self._task_subs)

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

    def heartbeat(self) -> schema.Heartbeat:
        """The next heartbeat (advances ``seq``)."""
        self.seq += 1
        p50, oldest = self.load_figures()
        self._durations.clear()
        self._last_p50 = p50
        hb = schema.Heartbeat(
            agent_id=self.agent_id,
            token=self.token or "",
            seq=self.seq,
            status=self.status(),
            active=self.active,
            queue_depth=self.queue_depth(),
            ok_total=self.ok_total,
            fail_total=self.fail_total,
            task_ms_p50=p50,
            oldest_task_ms=oldest,
            initial=self._initial,
        )
        self._initial = False
        return hb

    async def _heartbeat_loop(self) -> None:
        nc = self.nc
        assert nc is not None
        subject = f"{self.prefix}.hb.{self.agent_id}"
        while self._bg:
            self._hb_wake.clear()
            if self.token is not None:
                try:
                    await nc.publish(subject, schema.encoder.encode(self.heartbeat()))
                except Exception as exc:  # the loop never dies
                    log.debug("agent.heartbeat_failed agent=%s error=%r", self.agent_id, exc)
            await _wait(self._hb_wake, self.heartbeat_interval)

    async def _on_probe(self, msg: Msg) -> None:
        if not msg.reply or self.nc is None:
            return
        reply = schema.ProbeReply(
            agent_id=self.agent_id, status=self.status(), active=self.active,
            queue_depth=self.queue_depth(), seq=self.seq,
        )  # fmt: skip
        try:
            await self.nc.publish(msg.reply, schema.encoder.encode(reply))
        except Exception as exc:
            log.debug("agent.probe_reply_failed agent=%s error=%r", self.agent_id, exc)

    async def _leave(self, nc: NATS) -> None:
        if self.token is None:
            return
        body = schema.encoder.encode(
            schema.Leave(agent_id=self.agent_id, token=self.token, reason="agent shutting down")
        )
        try:
            reply = await nc.request(f"{self.prefix}.leave.{self.agent_id}", body, timeout=1.0)
            err = from_reply(reply.headers, reply.data)
            if err is not None:
                log.warning("agent.leave_refused agent=%s code=%s message=%s", self.agent_id,
                            err.code, err.message)  # fmt: skip
        except Exception as exc:  # the draining heartbeat says it too
            log.info("agent.leave_unanswered agent=%s error=%r", self.agent_id, exc)

    # --- tasks --------------------------------------------------------------------------

    def _count(self, capability: str, result: str) -> None:
        if self.metrics is not None:
            self.metrics.tasks.labels(capability, result).inc()

    def _lookup(self, request_id: str, now: float) -> _Entry | None:
        entry = self._seen.get(request_id)
        if entry is not None and entry.expires <= now:
            del self._seen[request_id]
            return None
        return entry

    def _remember(self, request_id: str, entry: _Entry, now: float) -> None:
        seen = self._seen
        seen[request_id] = entry
        # Bounded: drop expired entries from the old end, then the oldest finished ones.
        # Running entries are never dropped; they go to the new end (at most `active` moves).
        moved = 0
        while seen:
            oldest_id, oldest = next(iter(seen.items()))
            if not oldest.future.done():
                if moved >= self.active:
                    break
                seen.move_to_end(oldest_id)
                moved += 1
            elif oldest.expires <= now or len(seen) > self.dedup_size:
                del seen[oldest_id]
            else:
                break

    async def _publish(self, subject: str, body: bytes, headers: dict[str, str]) -> None:
        assert self.nc is not None
        try:
            await self.nc.publish(subject, body, headers=headers)
        except Exception as exc:  # a reply that cannot go out is logged
            log.warning("agent.reply_failed agent=%s subject=%s error=%r", self.agent_id,
                        subject, exc)  # fmt: skip

    async def _reply_error(self, msg: Msg, err: ReachError, request_id: str) -> None:
        if msg.reply:
            headers, body = to_reply(err)
            headers[schema.H_REQUEST_ID] = request_id
            await self._publish(msg.reply, body, headers)

    async def _send_receipt(self, reply: str, request_id: str) -> None:
        body = schema.encoder.encode(schema.Receipt(request_id=request_id))
        await self._publish(reply, body, {schema.H_REQUEST_ID: request_id,
                                          schema.H_STATUS: "received"})  # fmt: skip

    async def _on_task(self, msg: Msg) -> None:
        """Decide at once and hand the work to a task: this callback must never block."""
        capability = msg.subject[self._task_cut :]
        hdrs = msg.headers or {}
        request_id = hdrs.get(schema.H_REQUEST_ID) or str(uuid.uuid4())
        receipt = hdrs.get(schema.H_RECEIPT) == "1"
        ack_mode = hdrs.get(schema.H_ACK_MODE, "completed")
        now = time.monotonic()
        entry = self._lookup(request_id, now)
        if entry is not None:
            self._count(capability, "duplicate")
            if msg.reply and (receipt or ack_mode == "received"):
                await self._send_receipt(msg.reply, request_id)
            if msg.reply and ack_mode != "received":
                if entry.future.done():
                    headers, body = entry.future.result()
                    await self._publish(msg.reply, body, headers)
                else:
                    self._spawn(self._reply_when_done(entry, msg.reply), "reach-dup")
            return
        if self.draining:
            self._count(capability, "draining")
            await self._reply_error(
                msg, Draining(f"agent {self.agent_id!r} is draining: send elsewhere"), request_id
            )
            return
        hops = hdrs.get(schema.H_HOPS)
        if hops and hops.split(",").count(self.agent_id) >= LOOP_LIMIT:
            self._count(capability, "loop")
            await self._reply_error(msg, LoopDetected(
                f"Reach-Hops {hops[:200]!r} already visits agent {self.agent_id!r} "
                f"{LOOP_LIMIT} times (limit {LOOP_LIMIT} per trace)"), request_id)  # fmt: skip
            return
        if self.active >= self.max_concurrency:
            self._count(capability, "busy")
            await self._reply_error(msg, TargetBusy(
                f"agent {self.agent_id!r} runs {self.active} tasks, its max_concurrency"
            ), request_id)  # fmt: skip
            return
        try:
            deadline = _deadline(hdrs, now)
            if ack_mode not in ("completed", "received"):
                raise InvalidRequest(
                    f"header Reach-Ack-Mode {ack_mode[:40]!r} is not 'completed' or 'received'"
                )
        except InvalidRequest as err:
            self._count(capability, "invalid")
            await self._reply_error(msg, err, request_id)
            return
        self.active += 1
        self._idle.clear()
        self._running[request_id] = now
        entry = _Entry(asyncio.get_running_loop().create_future())
        self._remember(request_id, entry, now)
        if msg.reply and (receipt or ack_mode == "received"):
            await self._send_receipt(msg.reply, request_id)
        self._spawn(
            self._run(msg, capability, request_id, entry, deadline, hdrs, ack_mode), "reach-task"
        )

    def _spawn(self, coro: Awaitable[Any], name: str) -> None:
        task = asyncio.ensure_future(coro)
        task.set_name(name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _reply_when_done(self, entry: _Entry, reply: str) -> None:
        headers, body = await asyncio.shield(entry.future)
        await self._publish(reply, body, headers)

    async def _run(
        self,
        msg: Msg,
        capability: str,
        request_id: str,
        entry: _Entry,
        deadline: float | None,
        hdrs: dict[str, str],
        ack_mode: str,
    ) -> None:
        started = time.monotonic()
        error: ReachError | None = None
        headers: dict[str, str]
        body = b""
        try:
            await self._record(request_id, capability, "received")
            try:
                payload = _payload_decoder.decode(msg.data) if msg.data else None
            except msgspec.DecodeError as exc:
                raise InvalidRequest(f"task payload: malformed JSON ({exc})") from None
            task = Task(payload, request_id, capability, hdrs, deadline, self.agent_id)
            fn, is_async = self._handlers[capability]
            if is_async:
                result = await fn(task)
            else:
                if self._executor is None:
                    self._executor = ThreadPoolExecutor(
                        max_workers=min(self.max_concurrency, 128),
                        thread_name_prefix=f"reach-{self.agent_id}",
                    )
                loop = asyncio.get_running_loop()
                result = await loop.run_in_executor(self._executor, fn, task)
            try:
                body = _result_encoder.encode(result)
            except (TypeError, msgspec.EncodeError) as exc:
                raise InternalError(
                    f"handler {capability!r} returned a result that is not JSON ({exc})"
                ) from None
        except ReachError as err:
            error = err
        except asyncio.CancelledError:
            # Grace expired during a drain: retryable elsewhere (same request id).
            error = Draining(f"agent {self.agent_id!r} stopped before the task finished")
            raise
        except Exception as exc:  # a handler failure is the caller's answer
            log.exception("task.failed agent=%s capability=%s request_id=%s", self.agent_id,
                          capability, request_id)  # fmt: skip
            error = InternalError(f"handler {capability!r} raised {type(exc).__name__}: {exc}")
        finally:
            now = time.monotonic()
            self._durations.append((now - started) * 1000.0)
            self._running.pop(request_id, None)
            self.active -= 1
            if self.active == 0:
                self._idle.set()
            if error is None:
                headers = {schema.H_REQUEST_ID: request_id, schema.H_STATUS: "completed"}
                self.ok_total += 1
                self._count(capability, "ok")
            else:
                headers, body = to_reply(error)
                headers[schema.H_REQUEST_ID] = request_id
                if error.status < 500:
                    self.ok_total += 1  # the agent did its job: the request was refused
                    self._count(capability, "rejected")
                else:
                    self.fail_total += 1
                    self._count(capability, "failed")
            entry.expires = now + self.dedup_ttl
            if not entry.future.done():
                entry.future.set_result((headers, body))
            if msg.reply and ack_mode != "received":
                await self._publish(msg.reply, body, headers)
            elif ack_mode == "received" and self.ack_sink is None:
                log.info("task.result_dropped agent=%s request_id=%s: ack mode 'received' "
                         "and no ack sink", self.agent_id, request_id)  # fmt: skip
            if error is None:
                await self._record(request_id, capability, "completed", result=msgspec.Raw(body))
            else:
                failure = {"code": error.code, "message": error.message}
                await self._record(request_id, capability, "failed", error=failure)

    async def _record(
        self,
        request_id: str,
        capability: str,
        state: schema.AckState,
        result: msgspec.Raw | None = None,
        error: dict[str, str] | None = None,
    ) -> None:
        sink = self.ack_sink
        if sink is None:
            return
        rec = schema.AckRecord(
            request_id=request_id, agent_id=self.agent_id, capability=capability, state=state,
            at_ms=int(time.time() * 1000), result=result, error=error,
        )  # fmt: skip
        try:
            await sink.record(rec)
        except Exception:  # the sink's trouble is not the caller's
            log.exception("agent.ack_sink_failed agent=%s request_id=%s state=%s",
                          self.agent_id, request_id, state)  # fmt: skip


async def _stop_loops(*tasks: asyncio.Task[Any]) -> None:
    """Cancel background loops and wait for them, bounded: on 3.11 a cancel that races a
    completing ``wait_for`` inside nats-py can be swallowed, so never wait forever."""
    for t in tasks:
        t.cancel()
    _, pending = await asyncio.wait(tasks, timeout=2.0)
    for t in pending:
        t.cancel()
        log.warning("agent.loop_did_not_stop task=%s", t.get_name())


async def _wait(event: asyncio.Event, seconds: float) -> None:
    """Wait for ``event`` at most ``seconds``. (``asyncio.timeout``, not ``wait_for``:
    on 3.11 ``wait_for`` can swallow a cancel that races the event being set.)"""
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(seconds):
            await event.wait()


def _deadline(hdrs: dict[str, str], now: float) -> float | None:
    raw = hdrs.get(schema.H_TIMEOUT_MS)
    if raw is None:
        return None
    try:
        ms = int(raw)
    except ValueError:
        ms = -1
    if ms < 0:
        raise InvalidRequest(f"header Reach-Timeout-Ms {raw[:40]!r} is not a non-negative integer")
    return now + ms / 1000.0
