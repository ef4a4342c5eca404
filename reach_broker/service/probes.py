"""Active probes: ``{}`` on ``<prefix>.probe.<agent_id>``, answered by the agent's SDK.

Three reasons to probe, one schedule:

- at once, when an agent turns ``suspect`` (silence or a closed connection) or
  ``recovering`` — the answer (or ``no responders``) settles its state in milliseconds;
- again with jittered exponential backoff while it keeps failing (``offline`` agents are
  re-probed at ``min(probe_backoff_max_s, 1 s * 2^(n-1)) * U(0.5, 1)``), so a fleet that
  comes back at once is not stormed;
- an RTT sample of every healthy agent about every ``rtt_sample_interval_s``, each agent at
  its own random phase (and ±20% jitter per round), so a fleet of N is sampled at a steady
  N / interval per second instead of in O(fleet) bursts.

Only those samples feed the agent's RTT EWMA (its latency score): the answer to a probe of
a suspect, offline or recovering agent settles its state, but its round trip measures the
silence that made it suspect (a frozen process answers when it thaws), not the network.

At most ``probe_concurrency`` probes are in flight; one agent is never probed twice at once.
Scheduling is a heap keyed by due time with lazy deletion, so a heartbeat costs nothing here
and a transition O(log n).
"""

from __future__ import annotations

import asyncio
import heapq
import logging
import random
from collections.abc import Awaitable, Callable
from typing import Any

from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError

from jetstream.tasks import raise_if_cancelled
from reach_agent.aio import stop_loops
from reach_broker.config import DetectionSection
from reach_broker.core.records import AgentRecord, Transition
from reach_broker.core.registry import Registry

from .context import BrokerContext

log = logging.getLogger(__name__)

BACKOFF_BASE_S = 1.0
"""First retry delay of a failing agent (before jitter); doubles per consecutive failure."""

SAMPLE_JITTER = 0.2
"""RTT samples come every interval * U(1 - jitter, 1 + jitter)."""

IDLE_WAKE_S = 1.0
"""The scheduler loop re-checks at least this often even with nothing due."""

ProbeSend = Callable[[float], Awaitable[object]]
"""Probes one agent within the timeout given; raises nats' TimeoutError or NoRespondersError
when unanswered."""
ProbeVia = Callable[[AgentRecord], ProbeSend | None]
"""How to probe an agent that is not probed on ``<p>.probe.<agent_id>`` (a Synadia agent:
its status endpoint); None: the reach probe."""


def backoff_delay(failures: int, cap_s: float, rng: random.Random) -> float:
    """Delay before the next probe of an agent that failed ``failures`` probes in a row."""
    exp = min(max(failures, 1) - 1, 30)
    return min(cap_s, BACKOFF_BASE_S * (2.0**exp)) * rng.uniform(0.5, 1.0)


class Prober:
    """The broker's probe scheduler: probes agents and hands the results to the registry."""

    def __init__(self, ctx: BrokerContext, registry: Registry, cfg: DetectionSection, *,
                 results: Any, rtt: Any, probe_via: ProbeVia | None = None,
                 rng: random.Random | None = None) -> None:  # fmt: skip
        """``results``, ``rtt``: ``reach_probes_total``, ``reach_probe_rtt_seconds``."""
        self.ctx, self.registry, self.cfg = ctx, registry, cfg
        self._results, self._rtt = results, rtt
        self.probe_via: ProbeVia = probe_via or (lambda rec: None)
        self.rng = rng or random.Random()
        self._heap: list[tuple[float, int, str]] = []
        self._gen: dict[str, int] = {}  # agent_id -> generation of its live heap entry
        self._seq = 0
        self._inflight: set[str] = set()
        self._again: set[str] = set()
        self._sem = asyncio.Semaphore(self.cfg.probe_concurrency)
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._probes: set[asyncio.Task[Any]] = set()

    # --- lifecycle --------------------------------------------------------------------------

    async def start(self) -> None:
        if self._task is not None:
            return
        self._task = asyncio.create_task(self._loop(), name="reach-probes")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is None:
            return
        await stop_loops(task, *self._probes)

    # --- scheduling -------------------------------------------------------------------------

    def request(self, agent_id: str) -> None:
        """Probe ``agent_id`` as soon as a slot is free (once, even if asked twice)."""
        self.schedule(agent_id, self.ctx.clock())

    def schedule(self, agent_id: str, at: float) -> None:
        """(Re)schedule the next probe of ``agent_id``; replaces any earlier plan."""
        self._seq += 1
        self._gen[agent_id] = self._seq
        heapq.heappush(self._heap, (at, self._seq, agent_id))
        if self._heap[0][1] == self._seq:
            self._wake.set()

    def cancel(self, agent_id: str) -> None:
        self._gen.pop(agent_id, None)
        self._again.discard(agent_id)

    def pending(self, agent_id: str) -> float | None:
        """When the next probe of ``agent_id`` is due (None: not scheduled). For tests."""
        gen = self._gen.get(agent_id)
        if gen is None:
            return None
        return next((at for at, g, a in self._heap if g == gen and a == agent_id), None)

    def on_transition(self, t: Transition, rec: AgentRecord | None) -> None:
        """Consumer: probe suspects and recoverers now; sample newcomers at a random phase
        (only plans: while the prober is not running nothing is sent)."""
        if t.kind == "evicted" or rec is None:
            self.cancel(t.agent_id)
            return
        now = self.ctx.clock()
        if t.to in ("suspect", "recovering"):
            self.schedule(t.agent_id, now)
        elif t.to == "offline":
            self.schedule(t.agent_id, now + self._backoff(rec))
        elif t.to == "draining":
            self.cancel(t.agent_id)
        elif t.to == "healthy" and t.agent_id not in self._gen:
            interval = self.cfg.rtt_sample_interval_s
            if interval > 0:
                self.schedule(t.agent_id, now + self.rng.uniform(0.0, interval))

    def _backoff(self, rec: AgentRecord) -> float:
        return backoff_delay(rec.probe_failures, self.cfg.probe_backoff_max_s, self.rng)

    def _after_probe(self, agent_id: str, ok: bool) -> None:
        """Plan the next probe from the agent's state after this one's result."""
        rec = self.registry.agents.get(agent_id)
        if rec is None:
            self.cancel(agent_id)
            return
        now = self.ctx.clock()
        if agent_id in self._again:
            self._again.discard(agent_id)
            self.schedule(agent_id, now)  # asked for while this one was in flight
            return
        if agent_id in self._gen:
            return  # a transition already planned the next one
        interval = self.cfg.rtt_sample_interval_s
        if rec.state == "draining":
            self.cancel(agent_id)
        elif not ok or rec.state in ("offline", "suspect", "recovering"):
            self.schedule(agent_id, now + self._backoff(rec))
        elif interval > 0:
            jitter = self.rng.uniform(1.0 - SAMPLE_JITTER, 1.0 + SAMPLE_JITTER)
            self.schedule(agent_id, now + interval * jitter)
        else:
            self.cancel(agent_id)

    # --- the loop ---------------------------------------------------------------------------

    async def _loop(self) -> None:
        heap = self._heap
        while True:
            raise_if_cancelled()
            try:
                now = self.ctx.clock()
                limit = self.cfg.probe_concurrency
                # Start a probe only when a slot is free: a burst of due probes (10,000
                # newcomers, a reconnect) waits in the heap, not as thousands of tasks.
                while heap and heap[0][0] <= now and len(self._inflight) < limit:
                    _, gen, agent_id = heapq.heappop(heap)
                    if self._gen.get(agent_id) != gen:
                        continue  # superseded or cancelled
                    del self._gen[agent_id]
                    if agent_id in self._inflight:
                        self._again.add(agent_id)  # probe again once the running one ends
                        continue
                    self._inflight.add(agent_id)
                    task = asyncio.create_task(self._probe(agent_id), name=f"probe-{agent_id}")
                    self._probes.add(task)
                    task.add_done_callback(self._probes.discard)
                full = len(self._inflight) >= limit
                wait = heap[0][0] - now if heap and not full else IDLE_WAKE_S
                self._wake.clear()
                try:
                    await asyncio.wait_for(self._wake.wait(), min(max(wait, 0.0), IDLE_WAKE_S))
                except TimeoutError:
                    pass
            except asyncio.CancelledError:
                raise
            except Exception:  # the loop body never dies
                log.exception("probes.loop failed")
                await asyncio.sleep(0.1)

    def _settle(
        self, agent_id: str, ok: bool, result: str, sample: bool, rtt_ms: float, now: float
    ) -> bool:
        """Count one probe's outcome and hand it to the registry; whether it counts as ok."""
        ctx = self.ctx
        rtt = rtt_ms if ok else None
        self._results.labels(result).inc()
        if rtt is not None:
            self._rtt.observe(rtt / 1000.0)
        if log.isEnabledFor(logging.DEBUG):
            log.debug("probe.%s agent=%s rtt_ms=%s", result, agent_id, rtt)
        if sample and result == "no_responders":
            # A heartbeating agent without a probe responder (a minimal agent in any
            # language may have none): no RTT sample, but no verdict on liveness
            # either. A dead one is the disconnect advisory's or the deadlines' job.
            return True
        # Only a healthy agent's answer is an RTT sample: a suspect's (a freeze that just
        # ended, an answer late by the whole stall) says it lives, not what its latency is.
        ctx.emit(self.registry.probe_result(agent_id, ok, rtt if sample else None, now))
        return ok

    async def _probe(self, agent_id: str) -> None:
        ctx = self.ctx
        registry = self.registry
        ok = False
        try:
            async with self._sem:
                rec = registry.agents.get(agent_id)
                if rec is None:
                    return
                sample = rec.state == "healthy"
                epoch = ctx.link.epoch
                via = self.probe_via(rec)
                t0 = ctx.clock()
                try:
                    if via is None:
                        await ctx.nc.request(
                            ctx.subjects.probe(agent_id), b"{}", timeout=self.cfg.probe_timeout_s
                        )
                    else:
                        await via(self.cfg.probe_timeout_s)
                    ok, result = True, "ok"
                except NatsTimeoutError:
                    result = "timeout"
                except NoRespondersError:
                    result = "no_responders"
                now = ctx.clock()
                if epoch != ctx.link.epoch or not ctx.link.connected:
                    # The broker's own link dropped meanwhile: the outcome is not the agent's.
                    self._results.labels("link_down").inc()
                    ok = True
                else:
                    ok = self._settle(agent_id, ok, result, sample, (now - t0) * 1000.0, now)
        except asyncio.CancelledError:
            raise
        except Exception:  # a failed probe never breaks the broker
            self._results.labels("error").inc()
            log.exception("probe.failed agent=%s", agent_id)
        finally:
            self._inflight.discard(agent_id)
            self._wake.set()  # a slot is free: the loop may start the next due probe
        self._after_probe(agent_id, ok)
