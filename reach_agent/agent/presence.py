"""How an agent is known to brokers: announce, heartbeat, answer probes, leave.

Control traffic never waits behind business work: the announce and heartbeat loops run on
asyncio tasks of their own and probes are answered on their own subscription. The figures
a heartbeat or probe reply carries come from the agent's
:class:`~reach_agent.agent.serving.TaskServer`.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from jetstream.tasks import raise_if_cancelled
from reach_agent.aio import stop_loops, wait_event
from reach_agent.wire import schema
from reach_agent.wire.errors import Conflict, ReachError, from_reply
from reach_agent.wire.subjects import Subjects, is_inbox

from .serving import TaskServer

log = logging.getLogger(__name__)

_announce_ack_decoder = msgspec.json.Decoder(schema.AnnounceAck)

REANNOUNCE_JITTER_S = 0.5
"""Ceiling of the random delay before obeying a broker's re-announce request (a quarter of
the heartbeat interval when that is shorter): a fleet asked at once does not answer at once."""


class Presence:
    """One agent's announce, heartbeats, probe answers and leave."""

    def __init__(
        self,
        announcement: schema.Announce,
        subjects: Subjects,
        tasks: TaskServer,
        *,
        heartbeat_interval: float,
        announce_refresh: float,
        health: Callable[[], Awaitable[bool]] | None = None,
    ) -> None:
        self.agent_id = announcement.agent_id
        self.announcement = announcement
        self.subjects = subjects
        self.tasks = tasks
        self.heartbeat_interval = heartbeat_interval
        """Seconds between heartbeats; the broker's announce reply may change it."""
        self.announce_refresh = announce_refresh
        self.token: str | None = None
        """The heartbeat token of the last announce reply (None until a broker answered)."""
        self.broker_id: str | None = None
        self.seq = 0
        self.nc = NATS()  # the agent's connection, from start()
        self._initial = False
        self.context_usage_pct: float | None = None
        """The share (0-100) of the context window in use, sent with every heartbeat
        (``Agent.context_usage_pct``): brokers route by the headroom it leaves."""
        self.conflict: ReachError | None = None
        """The CONFLICT a broker answered (another live process holds this agent_id)."""
        self.first_answer = asyncio.Event()
        """Set once the first announce attempt has ended (answered, refused or unanswered)."""
        self._reannounce = asyncio.Event()
        self._hb_wake = asyncio.Event()
        self._loops: list[asyncio.Task[Any]] = []
        self.health = health
        """Asked before each heartbeat and probe answer when set (an adapter's backend
        check): while it says False the agent is silent — no heartbeat, no probe answer — so
        brokers take it out of the routes as they would a dead one, and back when it
        answers again."""

    # --- lifecycle --------------------------------------------------------------------

    async def subscribe(self, nc: NATS) -> None:
        """Answer probes (``<p>.probe.<agent_id>``) and re-announce requests
        (``<p>.reannounce.<agent_id>``) on subscriptions of their own."""
        self.nc = nc
        await nc.subscribe(self.subjects.probe(self.agent_id), cb=self._on_probe)
        await nc.subscribe(self.subjects.reannounce(self.agent_id), cb=self._on_reannounce)

    def start(self) -> None:
        """Start announcing and heartbeating (after the subscriptions are in place)."""
        me = self.agent_id
        self._loops = [
            asyncio.create_task(self._announce_loop(), name=f"reach-announce-{me}"),
            asyncio.create_task(self._heartbeat_loop(), name=f"reach-heartbeat-{me}"),
        ]

    def reannounce(self) -> None:
        """Announce again now (after a reconnect)."""
        self._reannounce.set()

    async def leave(self) -> None:
        """Stop announcing, report ``draining`` at once, and send ``leave`` with the token;
        heartbeats go on until :meth:`stop`."""
        if self._loops:
            self._loops[0].cancel()
        self._reannounce.set()  # and wake it, should the cancel be lost (see stop_loops)
        self._hb_wake.set()  # report `draining` now, not at the next tick
        if self.token is None:
            return
        body = schema.encoder.encode(
            schema.Leave(agent_id=self.agent_id, token=self.token, reason="agent shutting down")
        )
        try:
            reply = await self.nc.request(self.subjects.leave(self.agent_id), body, timeout=1.0)
            err = from_reply(reply.headers, reply.data)
            if err is not None:
                log.warning("agent.leave_refused agent=%s code=%s message=%s", self.agent_id,
                            err.code, err.message)  # fmt: skip
        except Exception as exc:  # the draining heartbeat says it too
            log.info("agent.leave_unanswered agent=%s error=%r", self.agent_id, exc)

    async def stop(self) -> None:
        loops, self._loops = self._loops, []
        if loops:
            await stop_loops(*loops)

    # --- announce ---------------------------------------------------------------------

    async def _announce_loop(self) -> None:
        """Announce until a broker answers (backoff 0.1 s doubling to 5 s, jittered); then
        again on reconnect and every ``announce_refresh`` seconds (token rotation, and a
        broker that restarted without our record)."""
        nc = self.nc
        subject = self.subjects.announce(self.agent_id)
        body = schema.encoder.encode(self.announcement)
        delay = 0.1
        while not self.tasks.draining:
            raise_if_cancelled()
            self._reannounce.clear()
            try:
                reply = await nc.request(subject, body, timeout=1.0)
                if self.tasks.draining:
                    return  # a cancel lost inside nc.request (3.11 wait_for race)
                err = from_reply(reply.headers, reply.data)
                if isinstance(err, Conflict):
                    # At start, Agent.start raises it and its caller says it (one line);
                    # later (a re-announce), this line is all there is.
                    level = logging.ERROR if self.first_answer.is_set() else logging.DEBUG
                    log.log(level, "agent.conflict agent=%s: %s", self.agent_id, err.message)
                    self.conflict = err
                    self.first_answer.set()
                    return  # another process is this agent: never announce over it
                if err is not None:
                    log.error("agent.announce_refused agent=%s code=%s message=%s",
                              self.agent_id, err.code, err.message)  # fmt: skip
                    delay = max(delay, 5.0)
                else:
                    ack = _announce_ack_decoder.decode(reply.data)
                    self.token = ack.token
                    self.broker_id = ack.broker_id
                    if ack.heartbeat_interval_ms > 0:
                        self.heartbeat_interval = ack.heartbeat_interval_ms / 1000.0
                    self._initial = True
                    self._hb_wake.set()
                    log.info("agent.announced agent=%s broker=%s", self.agent_id, ack.broker_id)
                    self.first_answer.set()
                    delay = 0.1
                    refresh = self.announce_refresh * random.uniform(0.9, 1.1)
                    await wait_event(self._reannounce, refresh)
                    continue
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # no broker yet: keep trying
                log.debug("agent.announce_unanswered agent=%s error=%r", self.agent_id, exc)
            self.first_answer.set()
            await asyncio.sleep(delay * (0.5 + random.random()))
            delay = min(delay * 2, 5.0)

    # --- heartbeat and probe ----------------------------------------------------------

    def heartbeat(self) -> schema.Heartbeat:
        """The next heartbeat (advances ``seq``)."""
        self.seq += 1
        tasks = self.tasks
        p50, oldest = tasks.take_load_figures()
        hb = schema.Heartbeat(
            agent_id=self.agent_id,
            token=self.token or "",
            seq=self.seq,
            status=tasks.status(),
            active=tasks.active,
            queue_depth=tasks.queue_depth(),
            ok_total=tasks.ok_total,
            fail_total=tasks.fail_total,
            task_ms_p50=p50,
            oldest_task_ms=oldest,
            context_usage_pct=self.context_usage_pct,
            initial=self._initial,
        )
        self._initial = False
        return hb

    async def _heartbeat_loop(self) -> None:
        nc = self.nc
        subject = self.subjects.heartbeat(self.agent_id)
        while self._loops:
            self._hb_wake.clear()
            if self.token is not None and (self.health is None or await self._healthy()):
                try:
                    await nc.publish(subject, schema.encoder.encode(self.heartbeat()))
                except Exception as exc:  # the loop never dies
                    log.debug("agent.heartbeat_failed agent=%s error=%r", self.agent_id, exc)
            await wait_event(self._hb_wake, self.heartbeat_interval)

    async def _on_reannounce(self, msg: Msg) -> None:
        """A broker does not know us (it restarted without its snapshot, say): announce
        again soon, after a random pause so a whole fleet does not answer in one burst."""
        if self.tasks.draining or self.conflict is not None:
            return
        jitter = min(REANNOUNCE_JITTER_S, self.heartbeat_interval / 4)
        log.info("agent.reannounce_requested agent=%s", self.agent_id)
        asyncio.get_running_loop().call_later(random.uniform(0, jitter), self._reannounce.set)

    async def _healthy(self) -> bool:
        assert self.health is not None
        try:
            return await self.health()
        except Exception as exc:  # a failing check is an unhealthy answer, never a crash
            log.debug("agent.health_failed agent=%s error=%r", self.agent_id, exc)
            return False

    async def _on_probe(self, msg: Msg) -> None:
        if not msg.reply:
            return
        if not is_inbox(msg.reply):  # see TaskServer.on_task: answer inboxes only
            log.warning("agent.probe_refused agent=%s reason=reply subject %r is not an inbox",
                        self.agent_id, msg.reply[:128])  # fmt: skip
            return
        if self.health is not None and not await self._healthy():
            return
        tasks = self.tasks
        info = self.nc._server_info or {}
        reply = schema.ProbeReply(
            agent_id=self.agent_id, status=tasks.status(), active=tasks.active,
            queue_depth=tasks.queue_depth(), seq=self.seq,
            instance_id=self.announcement.instance_id, server=info.get("server_name"),
            cid=self.nc.client_id,
        )  # fmt: skip
        try:
            await self.nc.publish(msg.reply, schema.encoder.encode(reply))
        except Exception as exc:
            log.debug("agent.probe_reply_failed agent=%s error=%r", self.agent_id, exc)
