"""The caller side: route by capability, call with receipts, retry, break circuits.

A call moves CREATED → SENT → ACKED → PROCESSING → FINISHED / TIMEOUT / FAILED:

* SENT: the task goes to the first candidate (the broker's weighted order) whose breaker is
  not open, with ``Reach-Receipt: 1`` and the same ``Reach-Request-Id`` on every attempt.
* ACKED: the agent's receipt arrived within ``ack_timeout_s``. No receipt (or no
  responders) means "not delivered": the next candidate is tried at once.
* PROCESSING: wait for the result up to the call's deadline. If the broker reports the
  agent ``offline``/``evicted``, or ``suspect`` and it does not answer our probe, the attempt
  is abandoned as lost and retried elsewhere instead of waiting out the deadline.
* Retries (at most ``retries``) follow :mod:`reach_agent.retry`: error replies whose
  ``ReachError.retryable`` is set (TIMEOUT, TARGET_BUSY, DRAINING, OVERLOADED), not delivered
  and lost targets; never BIZ_REJECT or another error. A retry goes at once to a candidate
  not tried yet; when every candidate was tried it waits an exponential, jittered backoff
  that must fit inside the deadline.
* Full is not failed: when the broker answers OVERLOADED (every candidate is full) or every
  candidate answered TARGET_BUSY, the call waits the refusal's ``retry_after_ms`` (else
  ``busy_wait_s``), jittered, and asks again — until the deadline, without counting retries.

Every attempt of a call replies to its own subject under one client-wide inbox
subscription (:class:`~reach_agent.subjects.ReplyInbox`), so the receipt and the result are
both received (``nc.request`` would keep only the first), and a late result of an earlier
attempt still finishes the call.

The parts: :mod:`~reach_agent.calls` (one call, and how an attempt ends),
:mod:`~reach_agent.routes` (route requests and their cache), :mod:`~reach_agent.liveness`
(the watch over agents running our calls), :mod:`~reach_agent.breaker` (circuit breakers and
what counts as a failure), :mod:`~reach_agent.retry` (what is retried). This module wires
them to NATS and runs the attempts.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import random
import time
import uuid
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import Any, Unpack

import msgspec
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from . import durable, schema
from .aio import TaskSet
from .breaker import Breakers, BreakerState, verdict
from .calls import AckMode, Call, encode_payload
from .config import ClientConfig
from .connection import (
    CredentialOptions,
    Credentials,
    connect_options,
    drain_or_close,
    flush_subscriptions,
)
from .errors import InternalError, InvalidRequest, NoReachableAgent, ReachError
from .liveness import Liveness
from .metrics import ClientMetrics
from .retry import Outcome, merely_full, should_retry
from .routes import Routes
from .subjects import ReplyInbox, Subjects

log = logging.getLogger(__name__)


class Client:
    """``async with Client() as c: await c.call("cap", payload)``.

    ``servers`` defaults to ``NATS_URL`` or ``nats://127.0.0.1:4222``; pass ``nc`` to share
    a connection you own. ``metrics`` (a :class:`ClientMetrics`) is off by default.
    ``creds``, ``nkey_seed``, ``user``/``password``, ``token`` and ``tls_*`` are the
    credentials of the client's own connection (unset: ``NATS_CREDS``, ... from the
    environment; see :class:`~reach_agent.connection.Credentials`).
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
        self.routes = Routes(self.nc, self.subjects, self.config, metrics, clock)
        self._tasks = TaskSet()
        self.liveness = Liveness(self.nc, self.subjects, self.config, self._tasks)
        self._own_nc = nc is None
        self._servers = servers
        self._name = name or f"reach-client-{uuid.uuid4().hex[:8]}"
        self._inbox = ReplyInbox("")  # the connection's own inbox, from start()
        self._calls: dict[str, Call] = {}
        self._subs: list[Subscription] = []
        self._refresher: asyncio.Task[None] | None = None
        self._ids = itertools.count(1)
        self._started = False

    # --- lifecycle ----------------------------------------------------------------------

    async def start(self) -> None:
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
                    await nc.connect(**options, error_cb=self._on_error)
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
        self.routes.running = True
        self._refresher = asyncio.create_task(self.routes.refresh_loop(),
                                              name="reach-route-refresh")  # fmt: skip

    async def stop(self) -> None:
        if not self._started:
            return
        self._started = False
        self.routes.running = False
        self.liveness.close()
        if self._refresher is not None:
            self._refresher.cancel()
            # Bounded: a cancel can be lost inside nc.request (3.11 wait_for race); the
            # loop also ends by itself once the client is stopped.
            await asyncio.wait({self._refresher}, timeout=2.0)
        for call in self._calls.values():
            call.close()
        self._tasks.cancel()
        for sub in self._subs:
            try:
                await sub.unsubscribe()
            except Exception:  # a closed connection must not block shutdown
                log.debug("client.unsubscribe_failed", exc_info=True)
        self._subs = []
        if self._own_nc:
            await drain_or_close(self.nc, 5.0)

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
        region: str | None = None,
        tags: dict[str, str] | None = None,
        sticky_key: str | None = None,
        exclude: Sequence[str] | None = None,
        allow_suspect: bool = False,
    ) -> list[schema.Candidate]:
        """Ranked candidates for ``capability`` from a broker, best first: a look (a
        ``peek``), so the broker does not count a task handed to the first; :meth:`call`
        routes for real.

        When no broker answers, the last answer for the same capability and filters is used
        (minus agents that events since reported unhealthy, in weighted-random order);
        without one, :class:`NoReachableAgent` is raised.
        """
        return await self.routes.route(capability, limit, region=region, tags=tags,
                                       sticky_key=sticky_key, exclude=exclude,
                                       allow_suspect=allow_suspect, peek=True)  # fmt: skip

    async def _on_event(self, msg: Msg) -> None:
        try:
            ev = schema.event_decoder.decode(msg.data)
        except msgspec.MsgspecError:
            log.debug("client.event_undecodable subject=%s", msg.subject)
            return
        if ev.kind in ("left", "evicted") or (ev.kind == "state" and ev.to != "healthy"):
            self.routes.cache.drop_agent(ev.agent_id)
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
        sticky_key: str | None = None,
        request_id: str | None = None,
        headers: dict[str, str] | None = None,
        traceparent: str | None = None,
        region: str | None = None,
        tags: dict[str, str] | None = None,
    ) -> Any:
        """Run ``payload`` on an agent with ``capability`` and return its decoded result.

        ``timeout`` (seconds) is clamped to ``[min_timeout_s, max_timeout_s]``. With
        ``ack_mode="received"`` the call returns the :class:`~reach_agent.schema.Receipt`
        once an agent has accepted the task; the result goes to ``REACH_ACKS``.
        Raises a :class:`~reach_agent.errors.ReachError` subclass carrying the wire code.
        """
        if not self._started:
            raise InternalError("client is not started: use `async with Client() as client`")
        schema.check_capability(capability)
        if ack_mode not in ("completed", "received"):
            raise InvalidRequest(f"ack_mode {ack_mode!r} is not 'completed' or 'received'")
        clock = self.clock
        t0 = clock()
        call_id = format(next(self._ids), "x")
        call = Call(
            call_id, capability, encode_payload(payload), headers, request_id=request_id,
            traceparent=traceparent, ack_mode=ack_mode,
            deadline=t0 + self.config.clamp_timeout(timeout), region=region, tags=tags,
            sticky_key=sticky_key,
        )  # fmt: skip
        self._calls[call_id] = call
        result_label = "error"
        try:
            value = await self._run(call)
            result_label = "ok"
            return value
        finally:
            del self._calls[call_id]
            if self.metrics is not None:
                self.metrics.duration.observe(clock() - t0)
            if log.isEnabledFor(logging.DEBUG):
                log.debug("call.done capability=%s request_id=%s result=%s", capability,
                          call.request_id, result_label)  # fmt: skip

    async def _run(self, call: Call) -> Any:
        """Attempts until one succeeds or the retry rule says stop."""
        cfg = self.config
        capability = call.capability
        candidates: list[schema.Candidate] = []
        while True:
            target = self._next(candidates, call.tried, capability)
            if target is None:
                # Everything we knew was tried (or is behind an open breaker): ask again.
                try:
                    candidates = await self.routes.route(
                        capability, cfg.route_limit, region=call.region, tags=call.tags,
                        sticky_key=call.sticky_key,
                        exclude=self.breakers.blocked(capability, self.clock()),
                    )  # fmt: skip
                except NoReachableAgent as no_agent:
                    raise (call.last_err or no_agent) from None
                except ReachError as refused:
                    if not merely_full("error", refused):
                        raise
                    # OVERLOADED: every candidate is full. Wait as told, then ask again.
                    call.last_err = refused
                    await call.wait_full(refused, self.config, self.clock)
                    continue
                target = self._next(candidates, call.tried, capability) or self._next(
                    candidates, (), capability
                )
                if target is None:
                    raise call.last_err or NoReachableAgent(
                        f"every agent with capability {capability!r} is behind an open "
                        "circuit breaker"
                    )
            if call.attempt > 0 and target.agent_id in call.tried:
                assert call.last_err is not None
                if merely_full("error", call.last_err):
                    # Every candidate answered TARGET_BUSY: a moment, then a new round.
                    await call.wait_full(call.last_err, self.config, self.clock)
                else:
                    # A retry to an agent we already tried: back off first, inside the
                    # deadline.
                    delay = cfg.backoff(call.retries, random.random())
                    if self.clock() + delay + cfg.ack_timeout_s > call.deadline:
                        raise call.last_err
                    await asyncio.sleep(delay)
            call.attempt += 1
            call.tried.append(target.agent_id)
            allowed, change = self.breakers.allow(target.agent_id, capability, self.clock())
            self._breaker_changed(target.agent_id, capability, change)
            if not allowed:
                continue
            outcome, value = await self._attempt(call, target)
            if outcome == "ok":
                return value
            call.last_err = value
            if not should_retry(
                outcome, value, retries_done=call.retries, max_retries=cfg.retries,
                time_left_s=call.deadline - self.clock(),
                min_attempt_s=min(cfg.ack_timeout_s, 0.05),
            ):  # fmt: skip
                raise value
            if not merely_full(outcome, value):
                call.retries += 1
            if log.isEnabledFor(logging.DEBUG):
                log.debug("call.retry capability=%s request_id=%s agent=%s outcome=%s "
                          "retry=%d", capability, call.request_id, target.agent_id, outcome,
                          call.retries)  # fmt: skip

    def _next(
        self, candidates: list[schema.Candidate], tried: Sequence[str], capability: str
    ) -> schema.Candidate | None:
        """The first candidate (broker's weighted order) not tried and not breaker-blocked."""
        now = self.clock()
        for cand in candidates:
            if cand.agent_id not in tried and self.breakers.available(
                cand.agent_id, capability, now
            ):
                return cand
        return None

    async def _attempt(self, call: Call, target: schema.Candidate) -> tuple[Outcome, Any]:
        """Send the call's current attempt to ``target`` and wait for how it ends: (outcome,
        result or error)."""
        agent = target.agent_id
        now = self.clock()
        hdrs = call.attempt_headers(now)
        call.agent_id = agent
        self.liveness.track(agent, call)
        outcome: Outcome = "closed"
        value: Any = InternalError("client closed")
        try:
            await self.nc.publish(target.subject, call.body, headers=hdrs,
                                  reply=self._inbox.reply(call.call_id, call.attempt))  # fmt: skip
            outcome, value = await call.outcome(now, self.config.ack_timeout_s, self.clock)
            return outcome, value
        finally:
            self.liveness.untrack(agent, call)
            self._account(agent, call.capability, outcome, value)

    def _account(self, agent: str, capability: str, outcome: Outcome, value: Any) -> None:
        """Breaker and metrics bookkeeping of one attempt."""
        now = self.clock()
        ok = verdict(outcome, value if outcome == "error" else None)
        if ok is None:
            self.breakers.release(agent, capability, now)
        else:
            self._breaker_changed(agent, capability, self.breakers.record(agent, capability, ok,
                                                                          now))  # fmt: skip
        if self.metrics is not None:
            label = "ok" if outcome == "ok" else value.code if outcome == "error" else outcome
            self.metrics.requests.labels(agent, label).inc()

    def _breaker_changed(self, agent: str, capability: str, change: BreakerState | None) -> None:
        if change is None:
            return
        log.info("breaker.%s agent=%s capability=%s", change, agent, capability)
        if self.metrics is not None:
            self.metrics.breaker_open.labels(agent, capability).set(0 if change == "closed" else 1)

    # --- durable (JetStream) ------------------------------------------------------------

    async def submit(
        self, capability: str, payload: Any, *, deliver: str = "eventually", **kw: Any
    ) -> str:
        """Hand a task over for delivery now or later (compensation queue); returns its
        request id. Implemented in :mod:`reach_agent.durable`."""
        return await durable.submit(self, capability, payload, deliver=deliver, **kw)

    async def wait(self, request_id: str, timeout: float) -> schema.AckRecord:  # noqa: ASYNC109
        """The final durable ack record of ``request_id`` (``completed`` or ``failed``), its
        ``result`` decoded; raises ``Timeout`` after ``timeout`` seconds without one
        (:mod:`reach_agent.durable`)."""
        return await durable.wait(self, request_id, timeout)
