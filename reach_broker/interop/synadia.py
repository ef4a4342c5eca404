"""Synadia Agent Protocol agents, discovered and kept in the registry as reach agents.

Nothing is asked of them: the broker reads what they already publish and answer.

- **Discovery**: ``$SRV.INFO.agents`` at start and every ``synadia.sweep_interval_s`` (every
  instance answers), and ``$SRV.INFO.agents.<instance_id>`` when a heartbeat comes from an
  instance not known yet. Each instance becomes one reach agent (``synadiainfo.agent_id_of``),
  registered through the broker's own announce path with ``agent_type: synadia-agents``, its
  prompt subject as the task subject and capabilities = its agent token plus the service
  metadata's ``capabilities``.
- **Liveness**: their heartbeats (``agents.hb.*.*.*``, every 30 s) are fed to the registry as
  heartbeats of that agent; probes go to their ``status`` endpoint (a reply naming another
  instance of the same session falls back to ``$SRV.PING.agents.<instance_id>``, which only
  this instance answers); a closed connection is seen at once: their connections are usually
  unnamed, so the server's ``CONNZ`` (filtered on ``$SRV.PING.agents``, with subscription
  details) tells which connection — (server, client id) — holds each instance's
  ``$SRV.INFO.agents.<instance_id>``, and a DISCONNECT advisory of that connection suspects
  its instances (the probe then settles them). A known instance without a connection in that
  list is suspected too (the reconcile of :mod:`reach_broker.service.advisories`, for them).
  The prober is handed :class:`StatusProbes` and the advisories this component (as the
  follower of unnamed connections) when the broker is built.
- An instance ``offline`` for ``synadia.forget_after_s`` is evicted; a restarted agent is a
  new instance (a new micro service id) and one that only reconnected is found again on its
  next heartbeat.
- **Partitions**: their subjects are not mapped into partitions, so every broker hears every
  instance's heartbeats and discovery answers. A broker holds — registers, heartbeats,
  locates, judges and so probes — only the instances of the partitions it hears (``owns``,
  the ingest's :meth:`~reach_broker.service.ingest.Ingest.hears`, handed in when the broker
  is built: from the partition's restore until it is handed over), so each instance has one
  broker's events, probes and snapshot writes. The others are kept in a cache only (what
  their ``$SRV.INFO`` said, which connection holds them), not judged: when a partition is
  taken over, its takeover restores the instances the previous owner stored in the snapshot
  (warm: in their stored state, with a whole silence window from when it is heard), and each
  one's next heartbeat is then fed to the registry like any other, confirming it without an
  event or a write; one the snapshot lacks is registered by that heartbeat, or by the next
  sweep. (Registering them at the takeover instead would write each one's key again, and
  a heartbeat is due within the window anyway.) When a partition is handed over, the
  takeover drops its instances from the registry, and from then on this broker registers,
  heartbeats and judges none of them. An instance of another broker's partition that no
  longer answers a sweep leaves the cache (heard again, it is looked up again).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Any

import msgspec
from nats.aio.msg import Msg
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError

from jetstream.names import ACK_STREAM
from reach_agent.connection import flush_subscriptions
from reach_agent.wire.errors import InvalidRequest
from reach_agent.wire.schema import PROTOCOL_SYNADIA, Announce, Heartbeat
from reach_agent.wire.subjects import AGENTS
from reach_broker.config import SynadiaSection
from reach_broker.core.records import AgentRecord, Transition
from reach_broker.core.registry import Registry
from reach_broker.service.clusterinfo import (
    Account,
    ServerCount,
    connz_subject,
    gather,
    server_of,
)
from reach_broker.service.context import BrokerContext
from reach_broker.service.handlers import Handlers
from reach_broker.service.probes import Prober, ProbeSend

from . import synadiainfo

log = logging.getLogger(__name__)

LOOKUP_TIMEOUT_S = 1.0
LOOKUP_AGAIN_S = 5.0
"""An instance whose ``$SRV.INFO`` lookup failed is asked again at most this often."""
LOCATE_DELAY_S = 0.05
"""New instances are located (CONNZ) this long after their registration, together."""
CONNZ_PAGE = 1024
ConnKey = tuple[str, int]
"""(server name, client id): one connection."""


_encoder = msgspec.json.Encoder()


class _Instance:
    __slots__ = ("announce", "conn", "info", "interval_s")

    def __init__(self, info: synadiainfo.ServiceInfo, announce: Announce, interval_s: int) -> None:
        self.info = info
        self.announce = announce
        self.interval_s = interval_s
        self.conn: ConnKey | None = None


class SynadiaAgents:
    """Broker component following the Synadia Agent Protocol agents of the account."""

    def __init__(self, ctx: BrokerContext, registry: Registry, handlers: Handlers,
                 prober: Prober, account: Account, cfg: SynadiaSection, *,
                 owns: Callable[[str], bool], instances: Any, heartbeats: dict[str, Any],
                 dropped: Any) -> None:  # fmt: skip
        """``owns``: whether this broker holds an agent id's partition (the module docstring,
        "Partitions"); ``instances``: ``reach_synadia_agents`` (the instances the registry
        holds, counted at each scrape); ``heartbeats``: ``reach_heartbeats_total`` by result;
        ``dropped``: ``reach_dropped_messages_total``."""
        self.ctx, self.cfg, self.registry = ctx, cfg, registry
        self.owns = owns
        self.handlers = handlers
        self.prober = prober
        self.account = account
        """The account whose CONNZ tells which connection holds which instance (the
        advisories learn it)."""
        self._heartbeats, self._dropped = heartbeats, dropped
        self.instances: dict[str, _Instance] = {}
        """By reach agent id: every instance known, of any partition (those of the partitions
        this broker does not own are cached, not held)."""
        self.by_instance: dict[str, str] = {}
        """Micro service (instance) id → reach agent id."""
        self.conns: dict[ConnKey, set[str]] = {}
        self.located = 0
        """CONNZ answers taken (tests wait on it)."""
        self.count = ServerCount(ACK_STREAM)
        """Servers that answered the last whole CONNZ: the next one answered by fewer is
        partial, until answers have been short for a minute."""
        self._lookups: dict[str, float] = {}
        self._locate_due = False
        self._sub: Any = None
        self._loop: asyncio.Task[None] | None = None
        self._timers: dict[str, asyncio.TimerHandle] = {}
        instances.set_function(self.held)

    def held(self) -> int:
        """How many instances the registry holds (those of the partitions owned)."""
        agents = self.registry.agents
        return sum(1 for agent_id in self.instances if agent_id in agents)

    # --- lifecycle ----------------------------------------------------------------------

    async def start(self) -> None:
        if self._loop is not None or not self.cfg.enabled:
            return
        nc = self.ctx.nc
        self._sub = await nc.subscribe(AGENTS.all_heartbeats, cb=self._on_heartbeat,
                                       pending_msgs_limit=1_000_000)  # fmt: skip
        await flush_subscriptions(nc)
        with contextlib.suppress(Exception):
            await self.sweep()
        self._loop = asyncio.create_task(self._sweeps(), name="reach-synadia")

    async def stop(self) -> None:
        loop, self._loop = self._loop, None
        if loop is None:
            return
        for timer in self._timers.values():
            timer.cancel()
        self._timers.clear()
        if self._sub is not None:
            with contextlib.suppress(Exception):
                await self._sub.unsubscribe()
        loop.cancel()
        await asyncio.gather(loop, return_exceptions=True)

    async def _sweeps(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.sweep_interval_s)
            try:
                await self.sweep()
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - the loop never dies
                log.exception("synadia.sweep_failed")

    async def sweep(self) -> None:
        """Discover every instance, then ask which connection holds which."""
        await self.discover()
        await self.locate()

    # --- discovery ----------------------------------------------------------------------

    async def discover(self) -> int:
        """``$SRV.INFO.agents``: register every instance that answers (cache those of other
        brokers' partitions); how many answered. A cached instance of another broker's
        partition that did not answer leaves the cache (its owner judges it)."""
        try:
            replies = await gather(self.ctx.nc, AGENTS.info, b"")
        except NoRespondersError:
            replies = []
        answered = {agent_id for msg in replies if (agent_id := self._take(msg.data, None))}
        for agent_id in [a for a in self.instances if a not in answered and not self.owns(a)]:
            self._forget(agent_id)
        return len(replies)

    async def _lookup(self, instance_id: str, interval_s: int) -> None:
        """One instance's registration, asked because its heartbeat came first."""
        try:
            msg = await self.ctx.nc.request(AGENTS.info_of(instance_id), b"",
                                            timeout=LOOKUP_TIMEOUT_S)  # fmt: skip
        except (NatsTimeoutError, NoRespondersError) as exc:
            log.info("synadia.lookup_unanswered instance=%s error=%s", instance_id,
                     type(exc).__name__)  # fmt: skip
            return
        agent_id = self._take(msg.data, interval_s)
        if agent_id is not None:
            self._lookups.pop(instance_id, None)

    def _take(self, data: bytes, interval_s: int | None) -> str | None:
        """Register (or update) the instance a ``$SRV.INFO`` reply describes; its agent id,
        None when it cannot be routed (dropped and counted, with why in the log)."""
        try:
            info = synadiainfo.info_decoder.decode(data)
        except msgspec.MsgspecError as exc:
            self._dropped.labels("synadia_info", "invalid").inc()
            log.info("synadia.info_invalid error=%s", exc)
            return None
        if info.name != AGENTS.service:
            return None  # another micro service answering $SRV.INFO (not ours to judge)
        known = self.by_instance.get(info.id)
        inst = self.instances.get(known) if known is not None else None
        interval = interval_s or (inst.interval_s if inst else synadiainfo.DEFAULT_INTERVAL_S)
        try:
            ann, refused = synadiainfo.announce_of(
                info, interval_s=interval, max_concurrency=self.cfg.max_concurrency
            )
        except InvalidRequest as exc:
            self._dropped.labels("synadia_info", "unroutable").inc()
            log.warning("synadia.unroutable %s", exc.message)
            return None
        for why in refused:
            log.warning("synadia.capability_refused instance=%s %s (ignored)", info.id, why)
        owned = self.owns(ann.agent_id)
        rec = self.registry.agents.get(ann.agent_id)
        if inst is not None and inst.announce == ann and (rec is not None or not owned):
            if rec is not None and rec.state == "offline":
                self.prober.request(ann.agent_id)  # it answers: settle it by a probe
            return ann.agent_id
        self.instances[ann.agent_id] = _Instance(info, ann, interval)
        self.by_instance[info.id] = ann.agent_id
        if owned:
            self._register(ann)
        # else another broker's partition: cached, not registered (its owner holds it)
        return ann.agent_id

    def _register(self, ann: Announce) -> None:
        self.handlers.apply_announce(ann)
        log.info("synadia.registered agent=%s capabilities=%s subject=%s", ann.agent_id,
                 ",".join(ann.capabilities), ann.metadata["prompt"])  # fmt: skip
        if not self._locate_due:
            self._locate_due = True
            asyncio.get_running_loop().call_later(LOCATE_DELAY_S, self._locate_soon)

    def _locate_soon(self) -> None:
        self._locate_due = False
        if self._loop is not None:
            self.ctx.spawn(self.locate(), "synadia-locate")

    # --- heartbeats ---------------------------------------------------------------------

    async def _on_heartbeat(self, msg: Msg) -> None:
        ctx = self.ctx
        try:
            beat = synadiainfo.beat_decoder.decode(msg.data)
        except msgspec.MsgspecError:
            self._dropped.labels("synadia_heartbeat", "invalid").inc()
            return
        agent_id = self.by_instance.get(beat.instance_id)
        inst = self.instances.get(agent_id) if agent_id is not None else None
        if inst is None or agent_id is None:
            self._unknown(beat)
            return
        owned = self.owns(agent_id)
        if beat.interval_s != inst.interval_s and beat.interval_s > 0:
            # Registered (or cached) before its first heartbeat said how often it beats.
            inst.interval_s = beat.interval_s
            ann = msgspec.structs.replace(
                inst.announce, heartbeat_interval_ms=min(beat.interval_s, 3600) * 1000
            )
            inst.announce = ann  # fmt: skip
            if owned:
                self._register(ann)
            return
        if not owned:
            return  # another broker's partition: its owner feeds it to its registry
        rec = self.registry.agents.get(agent_id)
        if rec is None:  # evicted meanwhile, or of a partition taken whose snapshot lacked it
            self._register(inst.announce)
            return
        hb = Heartbeat(agent_id=agent_id, token=rec.token, seq=max(rec.seq, 0) + 1,
                       initial=rec.seq < 0)  # fmt: skip
        result, transitions = self.registry.heartbeat(hb, ctx.clock(), ctx.wall_ms())
        self._heartbeats[result].inc()
        if transitions:
            ctx.emit(transitions)

    def _unknown(self, beat: synadiainfo.Beat) -> None:
        """A heartbeat of an instance not known (yet): ask for its registration."""
        now = self.ctx.clock()
        asked = self._lookups.get(beat.instance_id)
        if asked is not None and now - asked < LOOKUP_AGAIN_S:
            return
        self._lookups[beat.instance_id] = now
        self.ctx.spawn(self._lookup(beat.instance_id, beat.interval_s), "synadia-lookup")

    # --- connections --------------------------------------------------------------------

    async def locate(self) -> None:
        """Which connection holds each instance (CONNZ with subscription details); a known
        instance held by none is suspected as a closed connection would be. A CONNZ that
        fewer servers answered than the cluster has (:func:`unanswered`) judges nobody."""
        account = self.account.name
        if account is None or not self.instances:
            return
        # Only those held before the question (every instance known is located, so that a
        # partition taken over has its instances' connections at once).
        judged = {agent_id for agent_id in self.instances if self.owns(agent_id)}
        found: dict[str, ConnKey] = {}
        servers: set[str] | None = None
        offset = 0
        while True:
            body = _encoder.encode(
                {
                    "subscriptions_detail": True,
                    "offset": offset,
                    "limit": CONNZ_PAGE,
                    "filter_subject": AGENTS.ping,
                }
            )
            try:  # fmt: skip
                replies = await gather(self.ctx.nc, connz_subject(account), body)
            except NoRespondersError:
                return
            if not replies:
                return
            more = False
            for msg in replies:
                try:
                    data = synadiainfo.connz_decoder.decode(msg.data).data
                except msgspec.MsgspecError:
                    return
                if data is None:
                    return
                server = server_of(msg)
                for conn in data.connections:
                    for sub in conn.subscriptions_list_detail or ():
                        instance = AGENTS.instance_of_info(sub.subject)
                        agent_id = self.by_instance.get(instance or "")
                        if agent_id is not None:
                            found[agent_id] = (server, conn.cid)
                more = more or len(data.connections) >= CONNZ_PAGE
            if servers is None:
                servers = {server_of(msg) for msg in replies}
            if not more:
                break
            offset += CONNZ_PAGE
        answered = len(servers or ())
        missing = await self.count.missing(self.ctx.nc, answered)
        if not self.count.settle(answered, missing, self.ctx.clock()):
            # The instances of a server that did not answer would look held by none: left
            # as they were until the next sweep asks again.
            log.warning("synadia.locate_partial answered by %d of %d servers: not judged",
                        answered, answered + missing)  # fmt: skip
            return
        self.located += 1
        self.conns = {}
        for agent_id, key in found.items():
            self.conns.setdefault(key, set()).add(agent_id)
            inst = self.instances.get(agent_id)
            if inst is not None:
                inst.conn = key
        now = self.ctx.clock()
        out: list[Transition] = []
        for agent_id in judged - found.keys():
            if not self.owns(agent_id):
                continue  # its partition handed over meanwhile: no longer judged here
            out += self.registry.disconnected(agent_id, now, "no connection holds it (CONNZ)")
        if out:
            self.ctx.emit(out)

    def followed(self) -> set[str]:
        """The instances' agent ids: their connections are this component's to judge, not
        the advisories' reconcile (they are usually unnamed)."""
        return set(self.instances)

    def on_closed(self, server: str, cid: int) -> None:
        """A DISCONNECT advisory: the instances that connection held are suspect at once
        (those of the partitions this broker owns: the others' owners judge theirs)."""
        agent_ids = self.conns.pop((server, cid), None)
        if not agent_ids:
            return
        now = self.ctx.clock()
        out: list[Transition] = []
        for agent_id in agent_ids:
            if not self.owns(agent_id):
                continue
            out += self.registry.disconnected(
                agent_id, now, f"connection closed (client {cid} on {server})"
            )
        if out:
            self.ctx.emit(out)

    # --- forgetting ---------------------------------------------------------------------

    def on_transition(self, t: Transition, rec: AgentRecord | None) -> None:
        """Consumer: an instance offline is evicted after ``synadia.forget_after_s``, an
        evicted one forgotten (ignored while not running)."""
        agent_id = t.agent_id
        if self._loop is None or agent_id not in self.instances:
            return
        timer = self._timers.pop(agent_id, None)
        if timer is not None:
            timer.cancel()
        if t.kind == "evicted":
            self._forget(agent_id)
        elif t.to == "offline":
            self._timers[agent_id] = asyncio.get_running_loop().call_later(
                self.cfg.forget_after_s, self._evict, agent_id
            )

    def _evict(self, agent_id: str) -> None:
        self._timers.pop(agent_id, None)
        rec = self.registry.agents.get(agent_id)
        if rec is not None and rec.state == "offline":
            reason = f"offline for {self.cfg.forget_after_s:g}s (a Synadia agent instance)"
            self.ctx.emit(self.registry.evict(agent_id, reason, self.ctx.clock()))

    def _forget(self, agent_id: str) -> None:
        timer = self._timers.pop(agent_id, None)
        if timer is not None:
            timer.cancel()
        inst = self.instances.pop(agent_id, None)
        if inst is None:
            return
        self.by_instance.pop(inst.info.id, None)
        if inst.conn is not None:
            held = self.conns.get(inst.conn)
            if held is not None:
                held.discard(agent_id)
                if not held:
                    del self.conns[inst.conn]


class StatusProbes:
    """How the prober reaches a Synadia instance (handed to it when the broker is built): its
    status endpoint, else its micro ping; None for any other agent (the reach probe)."""

    def __init__(self, nc: Any, clock: Callable[[], float]) -> None:
        self.nc = nc
        self.clock = clock

    def __call__(self, rec: AgentRecord) -> ProbeSend | None:
        if rec.protocol != PROTOCOL_SYNADIA:
            return None
        meta = rec.announce.metadata
        status, instance = meta.get("status", ""), meta.get("instance_id", "")
        nc, clock = self.nc, self.clock

        async def send(timeout_s: float) -> None:
            t0 = clock()
            msg = await nc.request(status, b"", timeout=timeout_s)
            try:
                if synadiainfo.status_decoder.decode(msg.data).instance_id == instance:
                    return
            except msgspec.MsgspecError:
                pass  # an error frame: who answered is unknown
            # Another instance of the session answered: ask this one alone.
            await nc.request(AGENTS.ping_of(instance), b"",
                             timeout=max(timeout_s - (clock() - t0), 0.05))  # fmt: skip

        return send
