"""How an agent is known to brokers: announce, heartbeat, answer probes, leave.

Control traffic never waits behind business work: the announce and heartbeat loops run on
asyncio tasks of their own and probes are answered on their own subscription. The figures
a heartbeat or probe reply carries come from the agent's
:class:`~reach_agent.agent.serving.TaskServer`.

An agent that fronts another service (an adapter: ``reach adapt http``, ``reach adapt a2a``)
hands in a *readiness* check: asked every ``readiness_interval`` (1 s), and when it says
False the agent reports ``status: "draining"`` in a heartbeat sent at once (brokers take it
out of the routes on that heartbeat) and refuses tasks with ``DRAINING`` (retryable
elsewhere); when it says True again the agent announces again, which makes it ``healthy``.
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

READINESS_INTERVAL_S = 1.0
"""How often an agent with a readiness check asks it (``Agent(readiness_interval=...)``)."""

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
        readiness: Callable[[], Awaitable[bool]] | None = None,
        readiness_interval: float = READINESS_INTERVAL_S,
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
        self.readiness = readiness
        """The check of the service behind an adapter (None: always ready): asked every
        ``readiness_interval`` seconds; False reports the agent ``draining`` at once."""
        self.readiness_interval = readiness_interval

    # --- lifecycle --------------------------------------------------------------------

    async def subscribe(self, nc: NATS) -> None:
        """Answer probes (``<p>.probe.<agent_id>``) and re-announce requests
        (``<p>.reannounce.<agent_id>``) on subscriptions of their own."""
        self.nc = nc
        await nc.subscribe(self.subjects.probe(self.agent_id), cb=self._on_probe)
        await nc.subscribe(self.subjects.reannounce(self.agent_id), cb=self._on_reannounce)

    async def start(self) -> None:
        """Start announcing and heartbeating (after the subscriptions are in place); with a
        readiness check, ask it once first, so a service that is down at start is never
        reported ready."""
        me = self.agent_id
        if self.readiness is not None:
            self.tasks.unready = not await self._ready()
            if self.tasks.unready:
                log.warning("agent.not_ready agent=%s: the service behind it does not answer",
                            me)  # fmt: skip
        self._loops = [
            asyncio.create_task(self._announce_loop(), name=f"reach-announce-{me}"),
            asyncio.create_task(self._heartbeat_loop(), name=f"reach-heartbeat-{me}"),
        ]
        if self.readiness is not None:
            self._loops.append(
                asyncio.create_task(self._readiness_loop(), name=f"reach-readiness-{me}")
            )

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
            if self.token is not None:
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

    # --- readiness (an adapter's service) ---------------------------------------------

    async def _ready(self) -> bool:
        assert self.readiness is not None
        try:
            return await self.readiness()
        except Exception as exc:  # a failing check is a "not ready", never a crash
            log.debug("agent.readiness_failed agent=%s error=%r", self.agent_id, exc)
            return False

    async def _readiness_loop(self) -> None:
        """Ask the readiness check every ``readiness_interval``; report a change at once."""
        while self._loops:
            started = asyncio.get_running_loop().time()
            ready = await self._ready()
            if not self.tasks.draining:
                self.set_ready(ready)
            elapsed = asyncio.get_running_loop().time() - started
            await asyncio.sleep(max(self.readiness_interval - elapsed, 0.0))

    def set_ready(self, ready: bool) -> None:
        """The service behind the agent answers (``True``) or not: not ready, the agent
        reports ``draining`` in a heartbeat sent now and refuses tasks with ``DRAINING``;
        ready again, it announces again (brokers make it ``healthy``)."""
        if ready != self.tasks.unready:
            return  # no change
        self.tasks.unready = not ready
        if ready:
            log.warning("agent.ready agent=%s: the service behind it answers again", self.agent_id)
            self._reannounce.set()
        else:
            log.warning("agent.not_ready agent=%s: the service behind it does not answer; "
                        "reported draining", self.agent_id)  # fmt: skip
            self._hb_wake.set()

    async def _on_probe(self, msg: Msg) -> None:
        if not msg.reply:
            return
        if not is_inbox(msg.reply):  # see TaskServer.on_task: answer inboxes only
            log.warning("agent.probe_refused agent=%s reason=reply subject %r is not an inbox",
                        self.agent_id, msg.reply[:128])  # fmt: skip
            return
        tasks = self.tasks
        info = self.nc._server_info or {}
        reply = schema.ProbeReply(
            agent_id=self.agent_id, status=tasks.status(), active=tasks.active,
            queue_depth=tasks.queue_depth(), seq=self.seq,
            instance_id=self.announcement.instance_id, server=info.get("server_name"),
            cid=self.nc.client_id, finished=tasks.ok_total + tasks.fail_total,
        )  # fmt: skip
        try:
            await self.nc.publish(msg.reply, schema.encoder.encode(reply))
        except Exception as exc:
            log.debug("agent.probe_reply_failed agent=%s error=%r", self.agent_id, exc)
