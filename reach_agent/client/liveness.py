"""The client's watch over the agents running its calls.

An attempt whose agent is gone is abandoned as ``lost`` (and retried elsewhere) instead of
waiting out the call's deadline: at once when the broker reports the agent ``offline`` or
``evicted``; after an unanswered probe when it reports it ``suspect`` (``liveness_check``);
and, with no broker event at all (e.g. routing from the cache), when the agent does not
answer the probe the client sends it every ``liveness_probe_s`` while calls wait on it.

An agent that answers that probe running nothing (``active`` 0) while calls it took still
wait for its result has ended their runs: their replies were lost (or are on their way).
Each such call reads the agent's final record of its request id from ``REACH_ACKS`` and is
answered by it if stored, instead of at its deadline (:meth:`Call.stored`). So does each
when the agent, still running other tasks, has ended some since the probe before last
(the probe answer's ``finished`` count: one of them may be its).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any, Protocol

import msgspec
from nats.aio.client import Client as NATS
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError

from jetstream.roundtrip import round_trip
from reach_agent import results
from reach_agent.wire import schema
from reach_agent.wire.subjects import Subjects

from .calls import Call
from .config import ClientConfig

log = logging.getLogger(__name__)


class Spawner(Protocol):
    def spawn(self, coro: Coroutine[Any, Any, Any], name: str) -> Any: ...


class Liveness:
    """Which calls wait on which agent, and the probes that find a dead one."""

    def __init__(self, nc: NATS, subjects: Subjects, config: ClientConfig, tasks: Spawner) -> None:
        self.nc = nc
        self.subjects = subjects
        self.config = config
        self._tasks = tasks
        self._calls: dict[str, dict[Call, None]] = {}
        self._checking: set[str] = set()
        self._watching: set[str] = set()
        self._unprobed: set[str] = set()
        """Agents not probed (events alone end their attempts)."""
        self._reading: set[Call] = set()
        """Calls reading their taker's final record now."""
        self._finished: dict[str, tuple[int, int]] = {}
        """An agent's ``finished`` count in its last two probe answers (older, last)."""
        self._running = False

    def track(self, agent_id: str, call: Call, probe: bool = True) -> None:
        """``call``'s current attempt runs on ``agent_id``; watch that agent (by probes too
        unless ``probe`` is false: an agent that answers no reach probe, a Synadia one)."""
        self._calls.setdefault(agent_id, {})[call] = None
        if not probe:
            self._unprobed.add(agent_id)
            return
        if self.config.liveness_probe_s > 0 and agent_id not in self._watching:
            self._watching.add(agent_id)
            self._tasks.spawn(self._watch(agent_id), f"reach-watch-{agent_id}")

    def untrack(self, agent_id: str, call: Call) -> None:
        calls = self._calls.get(agent_id)
        if calls is not None:
            calls.pop(call, None)
            if not calls:
                del self._calls[agent_id]
                self._unprobed.discard(agent_id)
                self._finished.pop(agent_id, None)

    def start(self) -> None:
        self._running = True

    def close(self) -> None:
        """The client stops: the watch loops end."""
        self._running = False

    def on_event(self, ev: schema.Event) -> None:
        """A broker event: abandon, or check, the attempts on the agent it is about."""
        agent = ev.agent_id
        if agent not in self._calls:
            return
        if ev.kind == "evicted" or (ev.kind == "state" and ev.to == "offline"):
            self.abort(agent, ev.reason)
        elif ev.kind == "state" and ev.to == "suspect" and self.config.liveness_check:
            if agent not in self._checking and agent not in self._unprobed:
                self._checking.add(agent)
                self._tasks.spawn(self._check(agent), f"reach-check-{agent}")

    def abort(self, agent_id: str, reason: str) -> None:
        """End every attempt running on ``agent_id`` as ``lost``."""
        calls = self._calls.get(agent_id)
        if not calls:
            return
        log.info("call.target_lost agent=%s calls=%d reason=%s", agent_id, len(calls), reason)
        for call in calls:
            call.lose()

    async def _check(self, agent_id: str) -> None:
        """Probe a suspect agent that runs our calls; no answer: abandon those attempts."""
        try:
            await self._probe(agent_id, 2 * self.config.ack_timeout_s, "suspect and probe")
        finally:
            self._checking.discard(agent_id)

    async def _watch(self, agent_id: str) -> None:
        """Probe an agent every ``liveness_probe_s`` while calls wait on it, so a death goes
        noticed even when no broker reports it (e.g. while routing from the cache)."""
        every = self.config.liveness_probe_s
        try:
            while self._running and self._calls.get(agent_id):
                await asyncio.sleep(every)
                if not self._calls.get(agent_id):
                    break
                await self._probe(agent_id, max(2 * self.config.ack_timeout_s, every),
                                  "liveness probe")  # fmt: skip
        finally:
            self._watching.discard(agent_id)

    async def _probe(self, agent_id: str, timeout_s: float, what: str) -> None:
        """One probe; no answer (or no responders) abandons the attempts on ``agent_id`` —
        unless this client's own server does not answer a round trip either (its link
        stalled, its node stopped, reconnecting): then the silence says nothing of the
        agent, and its attempts wait (the next probe, the agent's reply, their deadline),
        as a broker believes no silence while it is deaf itself. Nemesis seed 50: a caller
        whose node was stopped abandoned every attempt as lost, gave up its calls seconds
        before their deadlines and was told TIMEOUT with their results stored."""
        try:
            reply = await self.nc.request(self.subjects.probe(agent_id), b"{}",
                                          timeout=timeout_s)  # fmt: skip
        except NoRespondersError as exc:  # the server answered: nobody listens there
            self.abort(agent_id, f"{what} unanswered ({type(exc).__name__})")
        except NatsTimeoutError as exc:
            if not await self.hearing():
                log.info("call.probe_unjudged agent=%s probe=%s: this client's own server "
                         "did not answer a round trip either; its attempts wait", agent_id,
                         what)  # fmt: skip
                return
            self.abort(agent_id, f"{what} unanswered ({type(exc).__name__})")
        except Exception:
            log.debug("client.probe_failed agent=%s probe=%s", agent_id, what, exc_info=True)
        else:
            self._answered(agent_id, reply.data)

    def _answered(self, agent_id: str, data: bytes) -> None:
        """A probe's answer: running nothing, ``agent_id`` has ended the runs of the calls
        that wait on it for a result (it took them): each reads the agent's final record
        (nemesis seed 62: five calls learnt results stored 1.8-7.2 s before only at their
        deadlines). Running others, it may have ended some of them if its ``finished`` count
        grew since the probe before last (two probes: a record is stored a moment after the
        count moves; nemesis seed 78: c1-000800 and c1-000813, answered by a3 running other
        tasks 7.0 and 9.7 s before their deadlines, their replies lost, ended TIMEOUT).
        Calls that stream, or wait for a receipt only, are left to their replies."""
        try:
            reply = schema.probe_reply_decoder.decode(data)
        except msgspec.MsgspecError:
            return
        ended = reply.active == 0
        if reply.finished is not None:
            older, last = self._finished.get(agent_id, (reply.finished, reply.finished))
            self._finished[agent_id] = (last, reply.finished)
            ended = ended or reply.finished > older
        if not ended:
            return
        for call in self._calls.get(agent_id, ()):
            if (call.taker == agent_id and call.ack_mode == "completed" and not call.stream
                    and call not in self._reading):  # fmt: skip
                self._reading.add(call)
                self._tasks.spawn(self._read(call, agent_id), f"reach-read-{call.request_id}")

    async def _read(self, call: Call, agent_id: str) -> None:
        try:
            record = await results.stored_final(
                self.nc, call.request_id, [agent_id], self.subjects, self.config.ack_timeout_s
            )
        finally:
            self._reading.discard(call)
        if record is not None and call in self._calls.get(agent_id, ()):
            log.info("call.result_from_store request_id=%s agent=%s state=%s: the agent ended "
                     "its run, its reply had not come", call.request_id, agent_id,
                     record.state)  # fmt: skip
            call.stored(record)

    async def hearing(self) -> bool:
        """Whether this client's own server answers a round trip (a PING's PONG) within
        ``ack_timeout_s``; False while the connection is down or reconnecting."""
        if not self.nc.is_connected:
            return False
        try:
            await round_trip(self.nc, max(self.config.ack_timeout_s, 0.1))
        except Exception:  # noqa: BLE001 - a timeout, a connection closed meanwhile
            return False
        return True
