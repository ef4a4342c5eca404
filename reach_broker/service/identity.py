"""Who is who: re-announce on demand, and one live process per ``agent_id``.

**Re-announce.** A heartbeat from an agent the broker does not know (it restarted without a
usable snapshot, or its KV was emptied) or whose token it cannot verify (the shared secret
changed) is answered by a :class:`~reach_agent.wire.schema.Reannounce` on
``<p>.reannounce.<agent_id>``, at most once per :data:`REANNOUNCE_GAP_S` per agent; the SDK
announces again at once, after a small jitter. So a fleet is routable again within about
one heartbeat interval instead of its next scheduled announce (up to 10 minutes).

**One live process.** An announce names its process with a random ``instance_id``. When a
known agent announces with another instance id while the first looks alive (not offline, no
disconnect seen), the broker asks: a probe of the agent id, every answer gathered for
:data:`CONFLICT_PROBE_S`. If the first instance answers, the second announce is refused with
``CONFLICT`` (409, naming the first one's instance, connection id and server), counted in
``reach_announces_total{result="conflict"}`` and logged; otherwise (the first process
crashed and this is its restart) it is accepted. A re-announce of the same instance, or an
announce without an instance id (older SDKs, raw agents), is never checked. The check runs
on a task of its own: announces keep flowing meanwhile.

An announce of an agent the registry does not know (this broker just took its partition, or
restarted) may still come from the restart of a process that died holding claims, which no
broker saw replaced: when claims of the agent id run under other instances, those are asked
the same way and, when none answers, taken as replaced (their claims released). So is a
running claim of another instance than the registry's, learnt after the announce (the
broker's read of the claims bucket behind it: a restart, a takeover), and so is the
registry's process when a probe of the agent in trouble is answered by another one (a
restart whose announce has not come here: the prober tells :meth:`Identity.unseen`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import msgspec
from nats.aio.msg import Msg

from reach_agent.wire import schema
from reach_agent.wire.errors import Conflict, to_reply
from reach_broker.core.records import AgentRecord
from reach_broker.core.registry import Registry

from .clusterinfo import gather
from .context import BrokerContext
from .handlers import ANSWER_IN_A_ROW, Handlers

log = logging.getLogger(__name__)

REANNOUNCE_GAP_S = 1.0
"""An agent is asked to re-announce at most this often."""
REMEMBER_MAX = 100_000
"""Agents remembered for the re-announce rate limit (then the memory is renewed)."""
CONFLICT_PROBE_S = 0.5
"""How long the answers to a contested agent id's probe are gathered."""
UNSEEN_AGAIN_S = 10.0
"""A process found answering is not asked about again for this long (its claims keep
arriving while it runs)."""


class Reannouncer:
    """Re-announce on demand: what the heartbeat handler does with an agent it cannot place."""

    def __init__(self, ctx: BrokerContext, *, asked: Any) -> None:
        self.ctx = ctx
        self._counter = asked
        """``reach_reannounce_requests_total``."""
        self._asked: dict[str, float] = {}

    def unknown(self, agent_id: str) -> None:
        """A heartbeat from an agent this broker cannot place: ask it to announce again."""
        ctx = self.ctx
        now = ctx.clock()
        asked = self._asked
        if now - asked.get(agent_id, -REANNOUNCE_GAP_S) < REANNOUNCE_GAP_S:
            return
        if len(asked) >= REMEMBER_MAX:
            asked.clear()
        asked[agent_id] = now
        if not ctx.link.connected:
            return
        self._counter.inc()
        body = schema.encoder.encode(
            schema.Reannounce(reason="unknown agent", broker_id=ctx.broker_id)
        )
        ctx.spawn(ctx.nc.publish(ctx.subjects.reannounce(agent_id), body), "reannounce")


class Identity:
    """Broker component: the announce subscription's first stop (one live process per
    agent id)."""

    def __init__(
        self, ctx: BrokerContext, registry: Registry, handlers: Handlers, *, conflict: Any,
        replaced: Callable[[str, str, str], None] = lambda agent_id, instance, old: None,
        claiming: Callable[[str], set[str]] = lambda agent_id: set(),
    ) -> None:  # fmt: skip
        self.ctx = ctx
        self.replaced = replaced
        """Told when an announce of a new instance is accepted over a known one of the same
        agent id (the first process is gone: it crashed and this is its restart): (agent id,
        the new instance, the old one). The releaser frees what the old instance held."""
        self.claiming = claiming
        """The instances of an agent id that hold running claims (the releaser's)."""
        self._asked: dict[tuple[str, str], float] = {}
        """(agent id, instance) asked about by :meth:`unseen`, and when (oldest first)."""
        self.registry = registry
        self.handlers = handlers
        self.endpoint = handlers.endpoints["announce"]
        self.conflicts = 0
        self._conflict = conflict
        """``reach_announces_total{result="conflict"}``."""
        self._taken = 0
        """Announces taken (every :data:`ANSWER_IN_A_ROW`th lets the loop run: a fleet
        registering queues thousands, and route requests would wait behind all of them)."""

    async def on_message(self, msg: Msg) -> None:
        """Callback of the announce subscription."""
        self._taken += 1
        if self._taken % ANSWER_IN_A_ROW == 0:
            await asyncio.sleep(0)
        try:
            ann = self.handlers.parse_announce(msg.subject, msg.data)
        except Exception:  # noqa: BLE001 - answered (and counted) by the endpoint
            await self.endpoint.on_message(msg)
            return
        rec = self.registry.agents.get(ann.agent_id)
        if rec is not None and contested(rec, ann):
            self.ctx.spawn(self._settle(msg, ann, rec.announce.instance_id or ""), "announce")
            return
        await self._apply(msg, ann, None if rec is None else rec.announce.instance_id)

    async def _apply(self, msg: Msg, ann: schema.Announce, before: str | None) -> None:
        """Register ``ann`` and answer; ``before``: the instance the registry knew."""
        try:
            body = self.handlers.apply_announce(ann)
        except Exception as exc:  # noqa: BLE001 - answered by failure(), never kills the sub
            reply = self.endpoint.failure(msg.subject, exc)
            if reply is not None and msg.reply:
                await self.ctx.nc.publish(msg.reply, reply[0], headers=reply[1])
            return
        if before is not None and ann.instance_id is not None and ann.instance_id != before:
            self.replaced(ann.agent_id, ann.instance_id, before)
        elif before is None and ann.instance_id is not None:
            others = self.claiming(ann.agent_id) - {ann.instance_id}
            if others:
                self.ctx.spawn(self._unseen(ann.agent_id, ann.instance_id, others), "announce")
        if msg.reply:
            await self.ctx.nc.publish(msg.reply, body)

    def unseen(self, agent_id: str, instance: str, old: str) -> None:
        """Process ``old`` of ``agent_id`` may have been replaced by process ``instance``
        unseen: ``old`` is asked as at an announce, and taken as replaced by ``instance`` if
        it does not answer (at most once per :data:`UNSEEN_AGAIN_S`). Told by the releaser
        (a running claim of ``old`` learnt while the registry knows ``instance``) and by the
        prober (a probe answered by ``instance`` while the registry knows ``old``)."""
        now = self.ctx.clock()
        asked = self._asked
        if now - asked.get((agent_id, old), -UNSEEN_AGAIN_S) < UNSEEN_AGAIN_S:
            return
        if len(asked) >= REMEMBER_MAX:
            asked.clear()
        asked[(agent_id, old)] = now
        self.ctx.spawn(self._unseen(agent_id, instance, {old}), "announce")

    async def _unseen(self, agent_id: str, instance: str, others: set[str]) -> None:
        """``instance`` of ``agent_id`` announced, unknown here, while ``others`` of it hold
        running claims: each of those that does not answer a probe was replaced by it (nemesis
        seed 66: a2 killed holding six claims while its partition changed owner; its restart
        announced to a broker that did not know it, and the claims stayed running for nobody
        until a later fault, six calls told TIMEOUT)."""
        answering = {r.instance_id or "" for r in await self._answers(agent_id)} & others
        if answering:  # alive (another process of the agent id, or one not yet announced)
            log.info("announce.replaced_unseen_skipped agent=%s instance=%s answering=%s: "
                     "it answers; no claim released", agent_id, instance,
                     ",".join(sorted(answering)))  # fmt: skip
            return
        for old in sorted(others):
            log.info("announce.replaced_unseen agent=%s instance=%s old=%s: its running "
                     "claims are released", agent_id, instance, old)  # fmt: skip
            self.replaced(agent_id, instance, old)

    async def _settle(self, msg: Msg, ann: schema.Announce, first: str) -> None:
        """Accept ``ann`` unless instance ``first`` of the agent still answers."""
        holder = await self._live(ann.agent_id, first)
        if holder is None:
            await self._apply(msg, ann, first)
            return
        self.conflicts += 1
        self._conflict.inc()
        rec = self.registry.agents.get(ann.agent_id)
        age = self.ctx.clock() - rec.last_seen if rec is not None else 0.0
        err = Conflict(
            f"agent_id {ann.agent_id!r} is live in another process: instance {first} on "
            f"connection {ann.agent_id!r} (cid {holder.cid}) at server {holder.server}, last "
            f"heard {age:.1f}s ago; stop that process or use another agent_id"
        )
        log.warning("announce.conflict agent=%s instance=%s holder=%s cid=%s server=%s",
                    ann.agent_id, ann.instance_id, first, holder.cid, holder.server)  # fmt: skip
        if msg.reply:
            headers, body = to_reply(err)
            await self.ctx.nc.publish(msg.reply, body, headers=headers)

    async def _live(self, agent_id: str, instance_id: str) -> schema.ProbeReply | None:
        """The probe answer of ``instance_id`` of ``agent_id``, if it answers."""
        return next((r for r in await self._answers(agent_id) if r.instance_id == instance_id),
                    None)  # fmt: skip

    async def _answers(self, agent_id: str) -> list[schema.ProbeReply]:
        """Every process's answer to a probe of ``agent_id``, gathered for
        :data:`CONFLICT_PROBE_S`."""
        ctx = self.ctx
        try:
            wait = CONFLICT_PROBE_S
            replies = await gather(ctx.nc, ctx.subjects.probe(agent_id), b"{}",
                                   timeout_s=wait, quiet_s=wait)  # fmt: skip
        except Exception:  # noqa: BLE001 - nobody answers: nobody holds it
            return []
        out = []
        for msg in replies:
            try:
                out.append(schema.probe_reply_decoder.decode(msg.data))
            except msgspec.DecodeError:
                continue
        return out


def contested(rec: AgentRecord, ann: schema.Announce) -> bool:
    """Whether ``ann`` may come from a second live process of ``rec``'s agent id: another
    instance id, while the first is not known to be gone."""
    first = rec.announce.instance_id
    return (
        first is not None
        and ann.instance_id is not None
        and ann.instance_id != first
        and rec.state != "offline"
        and not rec.disconnected
    )
