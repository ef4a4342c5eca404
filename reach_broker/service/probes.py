"""Active probes: ``{}`` on ``<prefix>.probe.<agent_id>``, answered by the agent's SDK.

Three reasons to probe, one schedule:

- at once, when an agent turns ``suspect`` (silence or a closed connection) or
  ``recovering`` — the answer (or ``no responders``) settles its state in milliseconds;
- again with jittered exponential backoff while it keeps failing (``offline`` agents are
  re-probed at ``min(probe_backoff_max_s, 1 s * 2^(n-1)) * U(0.5, 1)``), so a fleet that
  comes back at once is not stormed;
- RTT samples of the healthy agents in turn, newcomers first, within a budget of
  ``probe_budget_per_s`` a second (:mod:`reach_broker.core.sampling`): each agent about every
  ``rtt_sample_interval_s`` while the fleet is small enough, else every ``healthy / budget``
  seconds; nothing planned per healthy agent.

Only those samples feed the agent's RTT EWMA (its latency score): the answer to a probe of
a suspect, offline or recovering agent settles its state, but its round trip measures the
silence that made it suspect (a frozen process answers when it thaws), not the network.

At most ``probe_concurrency`` probes are in flight; one agent is never probed twice at once.
Probes of agents in trouble are a heap keyed by due time with lazy deletion, so a heartbeat
costs nothing here and a transition O(log n); samples come from the rotation.

A probe is one publish (``{}`` with a reply subject under the prober's own inbox, one
subscription for all answers) and an entry in a table of waiting probes: no task, no
future, no timer of its own. Every probe has the same timeout, so the waiting ones, in send
order, are also in deadline order: the loop expires them from the front of one queue. The
loop wakes for a probe due now (a suspect, a recoverer) at once and otherwise at most every
:data:`TICK_S`, starting every probe due by then: at 10,000 agents (1,000 RTT samples a
second) it runs about 100 times a second, not once a probe. (An agent probed some other
way, :attr:`Prober.probe_via`, is probed in a task of its own.)
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import logging
import random
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any, NamedTuple

import msgspec
from nats.aio.msg import Msg
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError

from jetstream.tasks import raise_if_cancelled
from reach_agent.aio import stop_loops
from reach_agent.wire import schema
from reach_broker.config import DetectionSection
from reach_broker.core.records import AgentRecord, Transition
from reach_broker.core.registry import Registry
from reach_broker.core.sampling import Sampler

from .context import BrokerContext

log = logging.getLogger(__name__)

BACKOFF_BASE_S = 1.0
"""First retry delay of a failing agent (before jitter); doubles per consecutive failure."""

IDLE_WAKE_S = 1.0
"""The scheduler loop re-checks at least this often even with nothing due."""

TICK_S = 0.01
"""Between two rounds of the loop at least this long, unless a probe is due at once: RTT
samples due within it go out together."""

NO_RESPONDERS = "503"
"""The status header of the server's answer when nobody subscribes to the probe's subject."""

ProbeSend = Callable[[float], Awaitable[object]]
"""Probes one agent within the timeout given; raises nats' TimeoutError or NoRespondersError
when unanswered."""
ProbeVia = Callable[[AgentRecord], ProbeSend | None]
"""How to probe an agent that is not probed on ``<p>.probe.<agent_id>`` (a Synadia agent:
its status endpoint); None: the reach probe."""


class Waiting(NamedTuple):
    """A probe sent and not yet answered."""

    agent_id: str
    sent_at: float
    epoch: int
    """The broker's link epoch when it was sent (another one when it ends: not the agent's)."""
    sample: bool
    """Whether its answer is an RTT sample (the agent was healthy when probed)."""


def backoff_delay(failures: int, cap_s: float, rng: random.Random) -> float:
    """Delay before the next probe of an agent that failed ``failures`` probes in a row."""
    exp = min(max(failures, 1) - 1, 30)
    return min(cap_s, BACKOFF_BASE_S * (2.0**exp)) * rng.uniform(0.5, 1.0)


class Prober:
    """The broker's probe scheduler: probes agents and hands the results to the registry."""

    def __init__(self, ctx: BrokerContext, registry: Registry, cfg: DetectionSection, *,
                 results: Any, rtt: Any, sampled_every: Any = None,
                 probe_via: ProbeVia | None = None,
                 other_instance: Callable[[str, str, str], None] = lambda a, new, old: None,
                 rng: random.Random | None = None) -> None:  # fmt: skip
        """``results``, ``rtt``, ``sampled_every``: ``reach_probes_total``,
        ``reach_probe_rtt_seconds``, ``reach_rtt_sample_interval_seconds`` (None: not
        exported)."""
        self.ctx, self.registry, self.cfg = ctx, registry, cfg
        self.other_instance = other_instance
        """Told (agent id, the process that answered, the registry's) when a probe of an
        agent in trouble is answered by another process of its agent id than the one the
        registry knows (a restart whose announce has not come): the identity check asks
        whether the registry's still lives (its claims released if not)."""
        self._rtt = rtt
        self._sampled_every = sampled_every
        self._healthy = -1
        """The healthy count ``sampled_every`` was last set for (set again when it moves)."""
        self.probe_via: ProbeVia = probe_via or (lambda rec: None)
        self.rng = rng or random.Random()
        self.sampler = Sampler(cfg, registry.listing, registry.agents)
        """Which healthy agents get an RTT sample now (newcomers first, then in turn)."""
        self._heap: list[tuple[float, int, str]] = []
        self._gen: dict[str, int] = {}  # agent_id -> generation of its live heap entry
        self._seq = 0
        self._inflight: set[str] = set()
        self._again: set[str] = set()
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._probes: set[asyncio.Task[Any]] = set()
        self._sub: Any = None
        self._inbox = ""
        """``<an inbox of the connection>.``: a probe's reply subject is this + its token."""
        self._tokens = 0
        self._waiting: dict[str, Waiting] = {}
        """Probes sent and not yet answered, by reply token."""
        self._deadlines: deque[tuple[float, str]] = deque()
        """(when it times out, token) of each probe sent, in send order: deadline order."""
        outcomes = ("ok", "timeout", "no_responders", "link_down", "error")
        self._results = {r: results.labels(r) for r in outcomes}
        """``reach_probes_total``'s children, bound once."""

    # --- lifecycle --------------------------------------------------------------------------

    async def start(self) -> None:
        if self._task is not None:
            return
        nc = self.ctx.nc
        self._inbox = nc.new_inbox() + "."
        self._sub = await nc.subscribe(self._inbox + "*", cb=self._on_answer)
        self._task = asyncio.create_task(self._loop(), name="reach-probes")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is None:
            return
        await stop_loops(task, *self._probes)
        if self._sub is not None:
            sub, self._sub = self._sub, None
            with contextlib.suppress(Exception):  # a closed connection has nothing to undo
                await sub.unsubscribe()
        self._waiting.clear()
        self._deadlines.clear()

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
        elif t.kind == "registered":
            self.sampler.joined(t.agent_id)  # sampled soon, before the rotation reaches it

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
        if rec.state == "draining":
            self.cancel(agent_id)
        elif not ok or rec.state in ("offline", "suspect", "recovering"):
            self.schedule(agent_id, now + self._backoff(rec))
        else:
            self.cancel(agent_id)  # healthy: the rotation samples it again in its turn

    # --- the loop ---------------------------------------------------------------------------

    async def _loop(self) -> None:
        heap = self._heap
        while True:
            raise_if_cancelled()
            try:
                now = self.ctx.clock()
                self._expire(now)
                limit = self.cfg.probe_concurrency
                # Start a probe only when a slot is free: a burst of due probes (10,000
                # newcomers, a reconnect) waits in the heap, not as thousands in flight.
                while heap and heap[0][0] <= now and len(self._inflight) < limit:
                    _, gen, agent_id = heapq.heappop(heap)
                    if self._gen.get(agent_id) != gen:
                        continue  # superseded or cancelled
                    del self._gen[agent_id]
                    if agent_id in self._inflight:
                        self._again.add(agent_id)  # probe again once the running one ends
                        continue
                    await self._send(agent_id, now)
                healthy = self.registry.counts["healthy"]
                if healthy != self._healthy and self._sampled_every is not None:
                    self._healthy = healthy
                    self._sampled_every.set(self.sampler.every(healthy))
                free = limit - len(self._inflight)
                if free > 0:
                    for agent_id in self.sampler.due(now, healthy, free, self._busy):
                        await self._send(agent_id, now)
                wait = IDLE_WAKE_S
                if heap and len(self._inflight) < limit:
                    wait = heap[0][0] - now
                sample_in = self.sampler.wait(healthy)
                if sample_in is not None and len(self._inflight) < limit:
                    wait = min(wait, sample_in)
                if self._deadlines:
                    wait = min(wait, self._deadlines[0][0] - now)
                self._wake.clear()
                # At least a tick unless woken (a probe due now, a slot free again): what
                # falls due meanwhile goes out in one round.
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), min(max(wait, TICK_S), IDLE_WAKE_S))
            except asyncio.CancelledError:
                raise
            except Exception:  # the loop body never dies
                log.exception("probes.loop failed")
                await asyncio.sleep(0.1)

    def _busy(self, agent_id: str) -> bool:
        """Whether a probe of ``agent_id`` is in flight or planned (no sample of it now)."""
        return agent_id in self._inflight or agent_id in self._gen

    async def _send(self, agent_id: str, now: float) -> None:
        """Probe ``agent_id``: a publish, answered on our inbox (or a task for ``probe_via``)."""
        rec = self.registry.agents.get(agent_id)
        if rec is None:
            return
        self._inflight.add(agent_id)
        sample = rec.state == "healthy"
        via = self.probe_via(rec)
        if via is not None:
            task = asyncio.create_task(self._probe_via(agent_id, via, sample),
                                       name=f"probe-{agent_id}")  # fmt: skip
            self._probes.add(task)
            task.add_done_callback(self._probes.discard)
            return
        ctx = self.ctx
        self._tokens += 1
        token = str(self._tokens)
        self._waiting[token] = Waiting(agent_id, now, ctx.link.epoch, sample)
        self._deadlines.append((now + self.cfg.probe_timeout_s, token))
        try:
            await ctx.nc.publish(ctx.subjects.probe(agent_id), b"{}", reply=self._inbox + token)
        except Exception:  # noqa: BLE001 - a failed probe never breaks the broker
            if self._waiting.pop(token, None) is not None:
                self._results["error"].inc()
                log.exception("probe.failed agent=%s", agent_id)
                self._inflight.discard(agent_id)
                self._after_probe(agent_id, False)

    async def _on_answer(self, msg: Msg) -> None:
        """An answer on our inbox: the agent's reply, or the server's "no responders"."""
        w = self._waiting.pop(msg.subject[len(self._inbox) :], None)
        if w is None:
            return  # timed out already (a late answer is no sample)
        if msg.headers and msg.headers.get("Status") == NO_RESPONDERS:
            self._end(w, False, "no_responders", self.ctx.clock())
            return
        if not w.sample:  # (an agent in trouble: not the RTT samples' path)
            self._answered_by(w.agent_id, msg.data)
        self._end(w, True, "ok", self.ctx.clock())

    def _answered_by(self, agent_id: str, data: bytes) -> None:
        """The answer to a probe of ``agent_id`` in trouble: from another process than the
        registry's, the registry's may be dead with claims running (nemesis seed 73: a2
        killed kept its two claims 10.8 s; b2 took its new process's answer for the dead
        one's, and released them only at the new process's announce)."""
        rec = self.registry.agents.get(agent_id)
        known = rec.announce.instance_id if rec is not None else None
        if known is None:
            return
        try:
            answered = schema.probe_reply_decoder.decode(data).instance_id
        except msgspec.MsgspecError:
            return
        if answered is not None and answered != known:
            self.other_instance(agent_id, answered, known)

    def _expire(self, now: float) -> None:
        """Every probe sent ``probe_timeout_s`` ago or more and still unanswered: timed out."""
        deadlines, waiting = self._deadlines, self._waiting
        while deadlines and deadlines[0][0] <= now:
            w = waiting.pop(deadlines.popleft()[1], None)
            if w is not None:
                self._end(w, False, "timeout", now)

    def _end(self, w: Waiting, ok: bool, result: str, now: float) -> None:
        """A probe's outcome: counted, handed to the registry, the next one planned."""
        link = self.ctx.link
        try:
            if w.epoch != link.epoch or not link.connected:
                # The broker's own link dropped meanwhile: the outcome is not the agent's.
                self._results["link_down"].inc()
                ok = True
            else:
                ok = self._settle(w.agent_id, ok, result, w.sample, (now - w.sent_at) * 1000.0,
                                  now)  # fmt: skip
        except Exception:  # noqa: BLE001 - a failed probe never breaks the broker
            self._results["error"].inc()
            log.exception("probe.failed agent=%s", w.agent_id)
        finally:
            self._inflight.discard(w.agent_id)
            if len(self._inflight) == self.cfg.probe_concurrency - 1:
                self._wake.set()  # a slot is free again: the loop may start the next
        self._after_probe(w.agent_id, ok)

    def _settle(
        self, agent_id: str, ok: bool, result: str, sample: bool, rtt_ms: float, now: float
    ) -> bool:
        """Count one probe's outcome and hand it to the registry; whether it counts as ok."""
        ctx = self.ctx
        rtt = rtt_ms if ok else None
        self._results[result].inc()
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
        out = self.registry.probe_result(agent_id, ok, rtt if sample else None, now)
        if out:
            ctx.emit(out)
        return ok

    async def _probe_via(self, agent_id: str, via: ProbeSend, sample: bool) -> None:
        """A probe of an agent not probed on ``<p>.probe.<agent_id>``, in a task of its own."""
        ctx = self.ctx
        w = Waiting(agent_id, ctx.clock(), ctx.link.epoch, sample)
        try:
            await via(self.cfg.probe_timeout_s)
            ok, result = True, "ok"
        except NatsTimeoutError:
            ok, result = False, "timeout"
        except NoRespondersError:
            ok, result = False, "no_responders"
        except asyncio.CancelledError:
            self._inflight.discard(agent_id)
            raise
        except Exception:  # a failed probe never breaks the broker
            self._results["error"].inc()
            log.exception("probe.failed agent=%s", agent_id)
            self._inflight.discard(agent_id)
            self._wake.set()
            self._after_probe(agent_id, False)
            return
        self._end(w, ok, result, ctx.clock())
