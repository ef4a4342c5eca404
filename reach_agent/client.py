"""The caller side: route by capability, call with receipts, retry, break circuits.

A call moves CREATED → SENT → ACKED → PROCESSING → FINISHED / TIMEOUT / FAILED:

* SENT: the task goes to the first candidate (the broker's weighted order) whose breaker is
  not open, with ``Reach-Receipt: 1`` and the same ``Reach-Request-Id`` on every attempt.
* ACKED: the agent's receipt arrived within ``ack_timeout_s``. No receipt (or no
  responders) means "not delivered": the next candidate is tried at once.
* PROCESSING: wait for the result up to the call's deadline. If the broker reports the
  agent ``offline``/``evicted``, or ``suspect`` and it does not answer our probe, the attempt
  is abandoned as lost and retried elsewhere instead of waiting out the deadline.
* Retries (at most ``retries``) only on TIMEOUT, TARGET_BUSY, DRAINING, not delivered and
  lost targets; never on BIZ_REJECT or any other error. A retry goes at once to a candidate
  not tried yet; when every candidate was tried it waits an exponential, jittered backoff
  that must fit inside the deadline.

Every attempt of a call replies to its own subject under one client-wide inbox
subscription (``<inbox>.<call>.<attempt>``), so the receipt and the result are both
received (``nc.request`` would keep only the first), and a late result of an earlier
attempt still finishes the call.
"""

from __future__ import annotations

import asyncio
import importlib
import itertools
import logging
import random
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import Any, Literal

import msgspec
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError

from . import schema
from ._runtime import connect_options, drain_or_close, flush_subscriptions, server_list
from .breaker import Breakers, BreakerState
from .config import ClientConfig
from .errors import (
    Draining,
    InternalError,
    InvalidRequest,
    NoReachableAgent,
    ReachError,
    TargetBusy,
    Timeout,
    from_reply,
)
from .metrics import ClientMetrics

log = logging.getLogger(__name__)

AckMode = Literal["completed", "received"]
Outcome = Literal["ok", "error", "not_delivered", "no_responders", "timeout", "lost", "closed"]

_payload_encoder = msgspec.json.Encoder()
_result_decoder = msgspec.json.Decoder()
_receipt_decoder = msgspec.json.Decoder(schema.Receipt)

_LOST = object()
_CLOSED = object()
_STATUS = "Status"
_RETRY_ERRORS = (TargetBusy, Draining, Timeout)


class _Call:
    """One call in flight: where its replies are queued, and which attempt is current."""

    __slots__ = ("agent_id", "attempt", "queue")

    def __init__(self) -> None:
        self.queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()
        self.agent_id: str | None = None
        self.attempt = 0


class _Route:
    __slots__ = ("candidates", "fetched_at", "limit", "used_at")

    def __init__(self, candidates: list[schema.Candidate], limit: int, now: float) -> None:
        self.candidates = candidates
        self.limit = limit
        self.fetched_at = now
        self.used_at = now


RouteKey = tuple[str, str | None, tuple[tuple[str, str], ...], bool]


class Client:
    """``async with Client() as c: await c.call("cap", payload)``.

    ``servers`` defaults to ``NATS_URL`` or ``nats://127.0.0.1:4222``; pass ``nc`` to share
    a connection you own. ``metrics`` (a :class:`ClientMetrics`) is off by default.
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
    ) -> None:
        self.config = config or ClientConfig()
        self.metrics = metrics
        self.clock = clock
        self.breakers = Breakers(self.config.breaker)
        self.nc: NATS = nc if nc is not None else NATS()
        self._own_nc = nc is None
        self._servers = servers
        self._name = name or f"reach-client-{uuid.uuid4().hex[:8]}"
        self._prefix = self.config.prefix
        self._inbox = ""
        self._inbox_cut = 0
        self._calls: dict[str, _Call] = {}
        self._by_agent: dict[str, dict[_Call, None]] = {}
        self._checking: set[str] = set()
        self._watching: set[str] = set()
        self._cache: OrderedDict[RouteKey, _Route] = OrderedDict()
        self._subs: list[Subscription] = []
        self._tasks: set[asyncio.Task[Any]] = set()
        self._refresher: asyncio.Task[None] | None = None
        self._ids = itertools.count(1)
        self._started = False

    # --- lifecycle ----------------------------------------------------------------------

    async def start(self) -> None:
        if self._started:
            return
        self._started = True
        nc = self.nc
        if self._own_nc:
            servers = server_list(self._servers)
            try:
                async with asyncio.timeout(self.config.connect_timeout_s):
                    await nc.connect(**connect_options(self._name, servers),
                                     error_cb=self._on_error)  # fmt: skip
            except TimeoutError:
                self._started = False
                await nc.close()
                raise ConnectionError(
                    f"no NATS server answered at {servers} within "
                    f"{self.config.connect_timeout_s:g}s"
                ) from None
        self._inbox = nc.new_inbox()
        self._inbox_cut = len(self._inbox) + 1
        self._subs = [
            await nc.subscribe(f"{self._inbox}.*.*", cb=self._on_reply,
                               pending_msgs_limit=1_000_000),
            await nc.subscribe(f"{self._prefix}.event.>", cb=self._on_event,
                               pending_msgs_limit=1_000_000),
        ]  # fmt: skip
        await flush_subscriptions(nc)
        self._refresher = asyncio.create_task(self._refresh_loop(), name="reach-route-refresh")

    async def stop(self) -> None:
        if not self._started:
            return
        self._started = False
        if self._refresher is not None:
            self._refresher.cancel()
            # Bounded: a cancel can be lost inside nc.request (3.11 wait_for race); the
            # loop also ends by itself once the client is stopped.
            await asyncio.wait({self._refresher}, timeout=2.0)
        for call in self._calls.values():
            call.queue.put_nowait((call.attempt, _CLOSED))
        for t in list(self._tasks):
            t.cancel()
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
        """Ranked candidates for ``capability`` from a broker, best first.

        When no broker answers, the last answer for the same capability and filters is used
        (minus agents that events since reported unhealthy, in weighted-random order);
        without one, :class:`NoReachableAgent` is raised.
        """
        schema.check_capability(capability)
        if tags:
            schema.check_tags(tags)
        limit = limit or self.config.route_limit
        key: RouteKey = (capability, region, tuple(sorted((tags or {}).items())), allow_suspect)
        excluded = list(exclude or ())
        req = schema.RouteRequest(limit=limit, region=region, tags=dict(tags or {}),
                                  sticky_key=sticky_key, exclude=excluded,
                                  allow_suspect=allow_suspect)  # fmt: skip
        try:
            reply = await self.nc.request(
                f"{self._prefix}.route.{capability}",
                schema.encoder.encode(req),
                timeout=self.config.route_timeout_s,
            )
        except (NatsTimeoutError, NoRespondersError) as exc:
            return self._from_cache(key, limit, excluded, exc)
        err = from_reply(reply.headers, reply.data)
        if err is not None:
            if isinstance(err, NoReachableAgent) and not excluded:
                self._cache.pop(key, None)
            raise err
        candidates = schema.decode(schema.route_reply_decoder, reply.data, "route reply").candidates
        if not excluded:
            self._store(key, candidates, limit)
        return candidates

    def _store(self, key: RouteKey, candidates: list[schema.Candidate], limit: int) -> None:
        now = self.clock()
        entry = self._cache.get(key)
        if entry is None:
            self._cache[key] = _Route(list(candidates), limit, now)
            while len(self._cache) > self.config.route_cache_size:
                self._cache.popitem(last=False)
        else:
            entry.candidates, entry.limit, entry.fetched_at = list(candidates), limit, now
            self._cache.move_to_end(key)

    def _from_cache(
        self, key: RouteKey, limit: int, exclude: list[str], exc: Exception
    ) -> list[schema.Candidate]:
        entry = self._cache.get(key)
        why = "no broker responded" if isinstance(exc, NoRespondersError) else "timed out"
        skip = set(exclude)
        pool = [c for c in entry.candidates if c.agent_id not in skip] if entry else []
        if not pool:
            raise NoReachableAgent(
                f"route request for capability {key[0]!r} {why} and no cached route is left"
            )
        entry.used_at = self.clock()  # type: ignore[union-attr]
        if self.metrics is not None:
            self.metrics.route_fallbacks.inc()
        log.info("route.cache_fallback capability=%s reason=%s", key[0], why)
        # Weighted-random order by score (Efraimidis-Spirakis keys) so callers do not herd.
        pool.sort(key=lambda c: random.random() ** (1.0 / max(c.score, 1e-3)), reverse=True)
        return pool[:limit]

    def _drop_agent(self, agent_id: str) -> None:
        for entry in self._cache.values():
            if any(c.agent_id == agent_id for c in entry.candidates):
                entry.candidates = [c for c in entry.candidates if c.agent_id != agent_id]

    async def _refresh_loop(self) -> None:
        """Re-ask the broker for cached routes older than ``route_refresh_s`` that were
        used recently, so the fallback stays fresh."""
        every = self.config.route_refresh_s
        while self._started:
            await asyncio.sleep(every / 2)
            now = self.clock()
            stale = [
                (key, e) for key, e in self._cache.items()
                if now - e.fetched_at >= every and now - e.used_at < 30 * every
            ][:64]  # fmt: skip
            for (cap, region, tags, allow_suspect), e in stale:
                try:
                    await self.route(cap, e.limit, region=region, tags=dict(tags),
                                     allow_suspect=allow_suspect)  # fmt: skip
                except ReachError:
                    pass  # no broker or no agent: route() already updated or kept the cache
                except Exception:  # the loop never dies
                    log.exception("route.refresh_failed capability=%s", cap)

    # --- events -------------------------------------------------------------------------

    async def _on_event(self, msg: Msg) -> None:
        try:
            ev = schema.event_decoder.decode(msg.data)
        except msgspec.MsgspecError:
            log.debug("client.event_undecodable subject=%s", msg.subject)
            return
        agent = ev.agent_id
        if ev.kind in ("left", "evicted") or (ev.kind == "state" and ev.to != "healthy"):
            self._drop_agent(agent)
        if agent not in self._by_agent:
            return
        if ev.kind == "evicted" or (ev.kind == "state" and ev.to == "offline"):
            self._abort(agent, ev.reason)
        elif ev.kind == "state" and ev.to == "suspect" and self.config.liveness_check:
            if agent not in self._checking:
                self._checking.add(agent)
                self._spawn(self._check(agent), f"reach-check-{agent}")

    async def _check(self, agent_id: str) -> None:
        """Probe a suspect agent that runs our calls; no answer: abandon those attempts."""
        try:
            await self.nc.request(f"{self._prefix}.probe.{agent_id}", b"{}",
                                  timeout=2 * self.config.ack_timeout_s)  # fmt: skip
        except (NatsTimeoutError, NoRespondersError) as exc:
            self._abort(agent_id, f"suspect and probe unanswered ({type(exc).__name__})")
        except Exception:
            log.debug("client.check_failed agent=%s", agent_id, exc_info=True)
        finally:
            self._checking.discard(agent_id)

    async def _watch(self, agent_id: str) -> None:
        """Probe an agent every ``liveness_probe_s`` while calls wait on it, so a death goes
        noticed even when no broker reports it (e.g. while routing from the cache)."""
        every = self.config.liveness_probe_s
        try:
            while self._started and self._by_agent.get(agent_id):
                await asyncio.sleep(every)
                if not self._by_agent.get(agent_id):
                    break
                wait = max(2 * self.config.ack_timeout_s, every)
                try:
                    await self.nc.request(f"{self._prefix}.probe.{agent_id}", b"{}", timeout=wait)
                except (NatsTimeoutError, NoRespondersError) as exc:
                    self._abort(agent_id, f"liveness probe unanswered ({type(exc).__name__})")
                except Exception:
                    log.debug("client.watch_failed agent=%s", agent_id, exc_info=True)
        finally:
            self._watching.discard(agent_id)

    def _abort(self, agent_id: str, reason: str) -> None:
        calls = self._by_agent.get(agent_id)
        if not calls:
            return
        log.info("call.target_lost agent=%s calls=%d reason=%s", agent_id, len(calls), reason)
        for call in calls:
            call.queue.put_nowait((call.attempt, _LOST))

    def _spawn(self, coro: Any, name: str) -> None:
        task = asyncio.ensure_future(coro)
        task.set_name(name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # --- calls --------------------------------------------------------------------------

    async def _on_reply(self, msg: Msg) -> None:
        call_id, _, attempt = msg.subject[self._inbox_cut :].partition(".")
        call = self._calls.get(call_id)
        if call is not None:
            try:
                call.queue.put_nowait((int(attempt), msg))
            except ValueError:
                pass

    async def call(
        self,
        capability: str,
        payload: Any = None,
        *,
        timeout: float | None = None,  # noqa: ASYNC109 - the call's deadline, DESIGN §6
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
        cfg = self.config
        clock = self.clock
        t0 = clock()
        deadline = t0 + cfg.clamp_timeout(timeout)
        rid = request_id or (headers or {}).get(schema.H_REQUEST_ID) or str(uuid.uuid4())
        body = _encode_payload(payload)
        base = dict(headers or {})
        base[schema.H_REQUEST_ID] = rid
        base[schema.H_RECEIPT] = "1"
        if ack_mode == "received":
            base[schema.H_ACK_MODE] = "received"
        if traceparent:
            base[schema.H_TRACEPARENT] = traceparent
        call_id = format(next(self._ids), "x")
        call = _Call()
        self._calls[call_id] = call
        result_label = "error"
        try:
            value = await self._run_call(
                call, call_id, capability, body, base, ack_mode, deadline,
                region=region, tags=tags, sticky_key=sticky_key,
            )  # fmt: skip
            result_label = "ok"
            return value
        finally:
            del self._calls[call_id]
            if self.metrics is not None:
                self.metrics.duration.observe(clock() - t0)
            if log.isEnabledFor(logging.DEBUG):
                log.debug("call.done capability=%s request_id=%s result=%s", capability, rid,
                          result_label)  # fmt: skip

    async def _run_call(
        self,
        call: _Call,
        call_id: str,
        capability: str,
        body: bytes,
        base: dict[str, str],
        ack_mode: AckMode,
        deadline: float,
        *,
        region: str | None,
        tags: dict[str, str] | None,
        sticky_key: str | None,
    ) -> Any:
        cfg = self.config
        tried: list[str] = []
        candidates: list[schema.Candidate] = []
        attempt = 0
        retries = 0
        last_err: ReachError | None = None
        while True:
            target = self._next(candidates, tried, capability)
            if target is None:
                # Everything we knew was tried (or is behind an open breaker): ask again.
                try:
                    candidates = await self.route(
                        capability, cfg.route_limit, region=region, tags=tags,
                        sticky_key=sticky_key,
                        exclude=self.breakers.blocked(capability, self.clock()),
                    )  # fmt: skip
                except NoReachableAgent as no_agent:
                    raise (last_err or no_agent) from None
                target = self._next(candidates, tried, capability) or self._next(
                    candidates, [], capability
                )
                if target is None:
                    raise last_err or NoReachableAgent(
                        f"every agent with capability {capability!r} is behind an open "
                        "circuit breaker"
                    )
            fresh = target.agent_id not in tried
            if attempt > 0 and not fresh:
                # A retry to an agent we already tried: back off first, inside the deadline.
                delay = cfg.backoff(retries, random.random())
                if self.clock() + delay + cfg.ack_timeout_s > deadline:
                    assert last_err is not None
                    raise last_err
                await asyncio.sleep(delay)
            attempt += 1
            allowed, change = self.breakers.allow(target.agent_id, capability, self.clock())
            self._breaker_changed(target.agent_id, capability, change)
            if not allowed:
                tried.append(target.agent_id)
                continue
            tried.append(target.agent_id)
            outcome, value = await self._attempt(
                call, call_id, attempt, target, capability, body, base, ack_mode, deadline
            )
            if outcome == "ok":
                return value
            err: ReachError = value
            if outcome == "error" and not isinstance(err, _RETRY_ERRORS):
                raise err
            last_err = err
            if outcome == "closed" or retries >= cfg.retries:
                raise err
            if self.clock() + min(cfg.ack_timeout_s, 0.05) >= deadline:
                raise err
            retries += 1
            if log.isEnabledFor(logging.DEBUG):
                log.debug("call.retry capability=%s request_id=%s agent=%s outcome=%s "
                          "retry=%d", capability, base[schema.H_REQUEST_ID], target.agent_id,
                          outcome, retries)  # fmt: skip

    def _next(
        self, candidates: list[schema.Candidate], tried: list[str], capability: str
    ) -> schema.Candidate | None:
        """The first candidate (broker's weighted order) not tried and not breaker-blocked."""
        now = self.clock()
        for cand in candidates:
            if cand.agent_id in tried:
                continue
            b = self.breakers.by_key.get((cand.agent_id, capability))
            if b is not None and not b.available(now):
                continue
            return cand
        return None

    async def _attempt(
        self,
        call: _Call,
        call_id: str,
        n: int,
        target: schema.Candidate,
        capability: str,
        body: bytes,
        base: dict[str, str],
        ack_mode: AckMode,
        deadline: float,
    ) -> tuple[Outcome, Any]:
        """One send and its wait. Returns (outcome, result or error)."""
        agent = target.agent_id
        clock = self.clock
        now = clock()
        hdrs = dict(base)
        hdrs[schema.H_TIMEOUT_MS] = str(max(int((deadline - now) * 1000), 0))
        call.agent_id, call.attempt = agent, n
        watching = self._by_agent.setdefault(agent, {})
        watching[call] = None
        if self.config.liveness_probe_s > 0 and agent not in self._watching:
            self._watching.add(agent)
            self._spawn(self._watch(agent), f"reach-watch-{agent}")
        outcome: Outcome = "closed"
        value: Any = InternalError("client closed")
        try:
            await self.nc.publish(target.subject, body, reply=f"{self._inbox}.{call_id}.{n}",
                                  headers=hdrs)  # fmt: skip
            outcome, value = await self._await_replies(call, n, agent, ack_mode, deadline, now)
            return outcome, value
        finally:
            watching.pop(call, None)
            if not watching:
                self._by_agent.pop(agent, None)
            self._account(agent, capability, outcome, value)

    async def _await_replies(
        self, call: _Call, n: int, agent: str, ack_mode: AckMode, deadline: float, sent: float
    ) -> tuple[Outcome, Any]:
        clock = self.clock
        ack_by = min(sent + self.config.ack_timeout_s, deadline)
        acked = False
        while True:
            until = deadline if acked else ack_by
            try:
                async with asyncio.timeout(max(until - clock(), 0.0)):
                    a, msg = await call.queue.get()
            except TimeoutError:
                if acked:
                    return "timeout", Timeout(
                        f"agent {agent!r} accepted the task but sent no result within the "
                        "call's deadline"
                    )
                return "not_delivered", Timeout(
                    f"not delivered: no receipt from agent {agent!r} within "
                    f"{self.config.ack_timeout_s:g}s"
                )
            if msg is _CLOSED:
                return "closed", InternalError("client closed while the call was in flight")
            current = a == n
            if msg is _LOST:
                if current:
                    return "lost", Timeout(f"agent {agent!r} was lost while running the task")
                continue
            hdrs = msg.headers
            if hdrs and hdrs.get(_STATUS) == "503" and not msg.data:
                if current:
                    return "no_responders", NoReachableAgent(
                        f"no responders: agent {agent!r} is not subscribed to {msg.subject!r}"
                    )
                continue
            err = from_reply(hdrs, msg.data)
            if err is not None:
                if current:
                    return "error", err
                continue  # an earlier attempt's error: the current attempt decides
            if hdrs and hdrs.get(schema.H_STATUS) == "received":
                if current:
                    acked = True
                    if ack_mode == "received":
                        return "ok", _receipt_decoder.decode(msg.data)
                continue
            # A result, from this attempt or a late one: the first result wins.
            try:
                return "ok", _result_decoder.decode(msg.data) if msg.data else None
            except msgspec.DecodeError as exc:
                return "error", InternalError(f"result from agent {agent!r} is not JSON ({exc})")

    def _account(self, agent: str, capability: str, outcome: Outcome, value: Any) -> None:
        """Breaker and metrics bookkeeping of one attempt."""
        now = self.clock()
        if outcome == "ok":
            verdict: bool | None = True
        elif outcome == "error":
            err: ReachError = value
            if isinstance(err, TargetBusy | Draining):
                verdict = None  # healthy but full or leaving: no verdict
            else:
                verdict = err.status < 500  # a refused request is a responsive agent
        elif outcome == "closed":
            verdict = None
        else:
            verdict = False
        if verdict is None:
            self.breakers.release(agent, capability, now)
        else:
            change = self.breakers.record(agent, capability, verdict, now)
            self._breaker_changed(agent, capability, change)
        if self.metrics is not None:
            if outcome == "ok":
                label = "ok"
            elif outcome == "error":
                label = value.code
            else:
                label = outcome
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
        durable = importlib.import_module("reach_agent.durable")
        return await durable.submit(self, capability, payload, deliver=deliver, **kw)  # type: ignore[no-any-return]

    async def wait(self, request_id: str, timeout: float) -> Any:  # noqa: ASYNC109
        """The durable ack record of ``request_id`` (see :mod:`reach_agent.durable`)."""
        durable = importlib.import_module("reach_agent.durable")
        return await durable.wait(self, request_id, timeout)


def _encode_payload(payload: Any) -> bytes:
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
