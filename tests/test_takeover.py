"""A takeover costs JetStream writes for what changed, not for what was taken.

Two brokers of P partitions share N agents; one of them goes (stopped: its leases handed
back; or its connection lost: its leases left to lapse), and the other takes its
partitions, warm, restoring their agents from the snapshot in the state it holds. Every taken
agent but K heartbeats on: each is confirmed by its first heartbeat, with no snapshot write
and no event. The K that fall silent at the takeover go ``suspect`` then ``offline`` at the
new owner, with their events and snapshot writes, as any silent agent does. Counted in the
streams themselves (``KV_reach_registry``'s and ``REACH_AUDIT``'s messages after the
takeover), not timed.

A lone broker restarted is warm only when it takes the leases its previous run handed back
(at once); started alone after they aged out (an outage), it is cold: its agents restored
``suspect``, refused to routes until heard.
"""

from __future__ import annotations

import asyncio
import json

import msgspec
import nats
import pytest
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from jetstream.names import AUDIT_STREAM, PARTITIONS_STREAM, REGISTRY_BUCKET, REGISTRY_STREAM
from reach_agent.aio import stop_loops
from reach_agent.connection import flush_subscriptions
from reach_agent.routing.table import partition
from reach_agent.wire import schema
from reach_broker.broker import Broker
from reach_broker.cluster.natsserver import NatsServer
from reach_broker.service.snapshot import SnapshotEntry

from .conftest import BrokerFactory, connections_named, leases_aged_out, wait_for

P = 8
N = 200
K = 4
"""Agents of the partitions taken over that fall silent at the takeover."""
AGENTS = [f"tk-{i:03d}" for i in range(N)]
CAPABILITY = "tk_cap"
INTERVAL_MS = 500


class Fleet:
    """Raw agents (N unless told) on one connection: announced, a heartbeat each every
    interval, probes answered; those :meth:`silence`d neither beat nor answer."""

    def __init__(self, nc: NATS, agents: list[str] = AGENTS,
                 interval_ms: int = INTERVAL_MS) -> None:  # fmt: skip
        self.nc = nc
        self.agents = agents
        self.interval_ms = interval_ms
        self.tokens: dict[str, str] = {}
        self.silent: set[str] = set()
        self.seq = 0
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        async def on_probe(msg: Msg) -> None:
            agent_id = msg.subject.rsplit(".", 1)[1]
            if agent_id not in self.silent:
                reply = schema.ProbeReply(agent_id=agent_id, active=0, seq=self.seq)
                await self.nc.publish(msg.reply, schema.encoder.encode(reply))

        await self.nc.subscribe("reach.probe.*", cb=on_probe)
        for agent_id in self.agents:
            body = {"agent_id": agent_id, "capabilities": [CAPABILITY], "max_concurrency": 4,
                    "heartbeat_interval_ms": self.interval_ms}  # fmt: skip
            reply = await self.nc.request(f"reach.announce.{agent_id}",
                                          json.dumps(body).encode(), timeout=5)  # fmt: skip
            self.tokens[agent_id] = json.loads(reply.data)["token"]
        self._task = asyncio.create_task(self._beat())

    def silence(self, agent_ids: list[str]) -> None:
        self.silent.update(agent_ids)

    def hear(self) -> None:
        """Every agent beats and answers again."""
        self.silent.clear()

    async def _beat(self) -> None:
        while True:
            self.seq += 1
            for agent_id, token in self.tokens.items():
                if agent_id not in self.silent:
                    hb = {"agent_id": agent_id, "token": token, "seq": self.seq}
                    await self.nc.publish(f"reach.hb.{agent_id}", json.dumps(hb).encode())
            await self.nc.flush()
            await asyncio.sleep(self.interval_ms / 1000)

    async def stop(self) -> None:
        # stop_loops, not one cancel: on 3.11 a cancel racing the flush's completing wait_for
        # inside nats-py is swallowed, the beats go on, and awaiting the task never returned
        # (CI at 3723c20: this test hung for its 120 s).
        if self._task is not None:
            await stop_loops(self._task)


async def last_seq(nc: NATS, stream: str) -> int:
    info = await nc.jetstream().stream_info(stream)
    return int(info.state.last_seq)


def state_of(broker: Broker, agent_id: str) -> str | None:
    rec = broker.registry.agents.get(agent_id)
    return None if rec is None else rec.state


@pytest.mark.parametrize("how", ["stopped", "lapsed"])
async def test_a_takeover_writes_and_announces_only_what_changed(
    broker_factory: BrokerFactory, nc: NATS, how: str
) -> None:
    survivor = await broker_factory(fleet__partitions=P, fleet__lease_ttl_s=3.0)
    victim = await broker_factory(fleet__partitions=P, fleet__lease_ttl_s=3.0)
    pair = (survivor, victim)
    await wait_for(lambda: [len(b.tables.book.epochs) for b in pair] == [P // 2] * 2, 20,
                   what="each owning half the partitions")  # fmt: skip
    fleet = Fleet(nc)
    await fleet.start()
    try:

        def settled() -> bool:
            held = sorted(a for b in pair for a, r in b.registry.agents.items()
                          if r.state == "healthy" and not r.resync)  # fmt: skip
            return held == AGENTS and not any(b.snapshot._dirty for b in pair)

        await wait_for(settled, 20, interval=0.1, what="every agent healthy at its owner")
        await wait_for(lambda: survivor.snapshot.writes + victim.snapshot.writes == N, 10,
                       interval=0.1, what="every agent's key written once")  # fmt: skip
        stored = await last_seq(nc, REGISTRY_STREAM)
        await asyncio.sleep(2 * INTERVAL_MS / 1000)  # every agent beats twice more
        taken = [a for a in AGENTS if partition(a, P) in victim.tables.book.epochs]
        silent = taken[:K]
        events: list[schema.Event] = []

        async def on_event(msg: Msg) -> None:
            events.append(msgspec.json.decode(msg.data, type=schema.Event))

        await nc.subscribe("reach.event.>", cb=on_event)
        written: list[tuple[str, str]] = []
        """Every snapshot write, as it goes to the bucket: (agent, state stored)."""

        async def on_write(msg: Msg) -> None:
            entry = msgspec.json.decode(msg.data, type=SnapshotEntry)
            written.append((entry.announce.agent_id, entry.state))

        await nc.subscribe(f"$KV.{REGISTRY_BUCKET}.>", cb=on_write)
        await flush_subscriptions(nc)
        before = {s: await last_seq(nc, s) for s in (REGISTRY_STREAM, AUDIT_STREAM)}
        assert before[REGISTRY_STREAM] == stored  # nothing written while the fleet beat on
        writes = survivor.snapshot.writes
        if how == "stopped":
            await victim.stop()
        else:
            await victim.nc.close()  # its leases left to lapse, nothing handed back
        fleet.silence(silent)

        heartbeating = [a for a in AGENTS if a not in silent]

        def taken_over() -> bool:
            recs = survivor.registry.agents
            return (
                len(survivor.tables.book.epochs) == P
                and all(a in recs and recs[a].state == "healthy" and not recs[a].resync
                        for a in heartbeating)
                and [state_of(survivor, a) for a in silent] == ["offline"] * K
            )  # fmt: skip

        await wait_for(taken_over, 30, interval=0.1,
                       what="every partition taken, every beating agent heard, the silent "
                            "ones offline")  # fmt: skip
        await wait_for(lambda: not survivor.snapshot._dirty, 5, what="the snapshot flushed")
        expected = [(a, s) for a in silent for s in ("suspect", "offline")]

        async def audited() -> int:
            return await last_seq(nc, AUDIT_STREAM) - before[AUDIT_STREAM]

        deadline = asyncio.get_running_loop().time() + 10
        while await audited() < len(expected):
            assert asyncio.get_running_loop().time() < deadline, await audited()
            await asyncio.sleep(0.1)
        await asyncio.sleep(2 * INTERVAL_MS / 1000)  # every agent beats twice more
        await nc.flush()
    finally:
        await fleet.stop()
    # What changed: each silent agent's two moves, at the new owner; the others' first
    # heartbeats under it confirmed them without a transition.
    assert await audited() == len(expected)
    got = sorted((e.agent_id, e.to) for e in events)
    assert got == sorted(expected)
    assert {(e.kind, e.broker_id) for e in events} == {("state", survivor.broker_id)}
    moved = {a: tuple((e.from_, e.to) for e in events if e.agent_id == a) for a in silent}
    assert moved == dict.fromkeys(silent, (("healthy", "suspect"), ("suspect", "offline")))
    # Written: the silent agents' keys alone, each last as offline (a suspect written
    # before it went offline, unless both fell in one flush).
    assert await last_seq(nc, REGISTRY_STREAM) - before[REGISTRY_STREAM] == len(written)
    assert {a for a, _ in written} == set(silent), written
    assert {a: s for a, s in written} == dict.fromkeys(silent, "offline")
    assert set(written) <= set(expected)
    assert survivor.snapshot.writes - writes == len(written)
    assert [state_of(survivor, a) for a in heartbeating] == ["healthy"] * len(heartbeating)


async def test_an_agent_killed_while_its_partition_had_no_owner_is_judged_at_the_takeover(
    broker_factory: BrokerFactory, nc: NATS, nats_server: NatsServer
) -> None:
    """The victim's connection is lost (its leases left to lapse), and meanwhile a raw agent
    of one of its partitions is killed: its connection closes, nothing is said. The server's
    DISCONNECT reaches the survivor, which does not hold the agent (nobody does). The
    survivor then takes the partition warm and restores the agent ``healthy``, as stored: it
    was judged by nobody until its silence ran out (30 s here). The survivor remembers the
    close and, once it holds the agent, suspects it; the probe settles it (offline: nobody
    answers)."""
    survivor = await broker_factory(fleet__partitions=P, fleet__lease_ttl_s=3.0)
    victim = await broker_factory(fleet__partitions=P, fleet__lease_ttl_s=3.0)
    pair = (survivor, victim)
    await wait_for(lambda: [len(b.tables.book.epochs) for b in pair] == [P // 2] * 2, 20,
                   what="each owning half the partitions")  # fmt: skip
    agent_id = next(a for a in AGENTS if partition(a, P) in victim.tables.book.epochs)
    raw = await nats.connect(nats_server.url, name=agent_id)
    body = {"agent_id": agent_id, "capabilities": [CAPABILITY], "max_concurrency": 4,
            "heartbeat_interval_ms": 30_000}  # fmt: skip
    await raw.request(f"reach.announce.{agent_id}", json.dumps(body).encode(), timeout=5)
    await wait_for(
        lambda: (
            state_of(victim, agent_id) == "healthy"
            and victim.snapshot.writes
            and not victim.snapshot._dirty
        ),
        10,
        what="the agent healthy and written",
    )
    events: list[schema.Event] = []

    async def on_event(msg: Msg) -> None:
        events.append(msgspec.json.decode(msg.data, type=schema.Event))

    await nc.subscribe("reach.event.>", cb=on_event)
    await flush_subscriptions(nc)
    await victim.nc.close()  # its leases left to lapse, nothing handed back
    await raw.close()
    await wait_for(lambda: agent_id in survivor.advisories.closed, 5,
                   what="the survivor told of the close")  # fmt: skip
    assert state_of(survivor, agent_id) is None  # not held: nobody judged it
    await wait_for(lambda: state_of(survivor, agent_id) == "offline", 15,
                   what="the agent taken over and judged")  # fmt: skip
    await wait_for(lambda: len(events) == 2, 5, what="its two events")
    assert [(e.agent_id, e.from_, e.to, e.reason, e.broker_id) for e in events] == [
        (agent_id, "healthy", "suspect", "connection closed while its partition changed owner",
         survivor.broker_id),
        (agent_id, "suspect", "offline", "disconnected and probe unanswered", survivor.broker_id),
    ]  # fmt: skip
    assert agent_id not in survivor.advisories.closed


@pytest.mark.parametrize("warm", [True, False], ids=["handed-back", "cold"])
async def test_a_lone_broker_restarted_keeps_stored_states_only_when_warm(
    broker_factory: BrokerFactory, nc: NATS, nats_server: NatsServer, warm: bool
) -> None:
    """A lone broker stopped, then started again: at once (its leases handed back: warm), its
    agents are restored healthy as stored, routed before they are heard, and heard again
    without an event; after its leases aged out (alone after an outage: cold), each is
    restored ``suspect``, refused to routes until heard, then made healthy by its first
    heartbeat, with its event. The agents hold connections named after them, so the CONNZ
    reconcile at the start finds them all."""
    agents = AGENTS[:20]
    ttl = 2.0
    first = await broker_factory(fleet__partitions=P, fleet__lease_ttl_s=ttl)
    fleet = Fleet(nc, agents, interval_ms=1000)
    async with connections_named(nats_server.url, *agents):
        await fleet.start()
        try:
            await wait_for(lambda: sorted(a for a, r in first.registry.agents.items()
                                          if r.state == "healthy" and not r.resync) == agents
                           and not first.snapshot._dirty, 10,
                           what="every agent healthy and written")  # fmt: skip
            await first.stop()
            # Neither beats nor probe answers until the checks before they are heard are done
            # (their windows, 1 s of grace plus 2.4 s, outlast them).
            fleet.silence(agents)
            if not warm:
                await leases_aged_out(nc)
            events: list[schema.Event] = []

            async def on_event(msg: Msg) -> None:
                events.append(msgspec.json.decode(msg.data, type=schema.Event))

            await nc.subscribe("reach.event.>", cb=on_event)
            await flush_subscriptions(nc)
            before = await last_seq(nc, AUDIT_STREAM)
            second = await broker_factory(fleet__partitions=P, fleet__lease_ttl_s=ttl)
            assert second.partitions.cold == (0 if warm else P)
            restored = {a: (r.state, r.resync) for a, r in second.registry.agents.items()}
            assert restored == dict.fromkeys(agents, ("healthy" if warm else "suspect", True))
            body = json.dumps({"limit": len(agents)}).encode()
            reply = json.loads((await nc.request(f"reach.route.{CAPABILITY}", body,
                                                 timeout=2)).data)  # fmt: skip
            if warm:
                assert sorted(c["agent_id"] for c in reply["candidates"]) == agents
            else:
                assert reply["error"]["code"] == "NO_REACHABLE_AGENT"
            fleet.hear()
            recs = second.registry.agents
            await wait_for(lambda: all(recs[a].state == "healthy" and not recs[a].resync
                                       for a in agents), 10, what="every agent heard")  # fmt: skip
            await asyncio.sleep(2.0)  # every agent beats twice more
            await nc.flush()
            # Counted while the agents' connections are open (closing them is a disconnect).
            got = sorted((e.agent_id, e.from_, e.to, e.reason) for e in events)
            audited = await last_seq(nc, AUDIT_STREAM) - before
        finally:
            await fleet.stop()
    expected = [] if warm else [(a, "suspect", "healthy", "heartbeat resumed") for a in agents]
    assert got == expected
    assert audited == len(expected)


async def test_a_lone_broker_that_lost_every_lease_takes_them_back_cold(
    broker_factory: BrokerFactory, nc: NATS
) -> None:
    """A lone broker whose every lease vanished under it (here purged; in the field, aged
    out while its link to NATS was down, when nobody heard its agents) drops its partitions
    and takes them again alone, holding none: cold, as at a cold start. Each agent is restored
    ``suspect`` and its first heartbeat makes it ``healthy`` with its event; a warm take
    (another broker present, or partitions of its own held) would have made none."""
    agents = AGENTS[:20]
    broker = await broker_factory(fleet__partitions=P, fleet__lease_ttl_s=2.0)
    assert broker.partitions.cold == P  # its own start, alone
    fleet = Fleet(nc, agents, interval_ms=1000)
    await fleet.start()
    try:
        recs = broker.registry.agents
        await wait_for(lambda: sorted(a for a, r in recs.items()
                                      if r.state == "healthy" and not r.resync) == agents,
                       10, what="every agent healthy")  # fmt: skip
        events: list[schema.Event] = []

        async def on_event(msg: Msg) -> None:
            events.append(msgspec.json.decode(msg.data, type=schema.Event))

        await nc.subscribe("reach.event.>", cb=on_event)
        await flush_subscriptions(nc)
        await nc.jetstream().purge_stream(PARTITIONS_STREAM)  # every lease at once
        await wait_for(lambda: broker.partitions.cold == 2 * P and len(broker.partitions.held)
                       == P, 10, what="every partition taken back, cold")  # fmt: skip
        await wait_for(lambda: len(events) >= len(agents), 10, what="an event per agent")
        await nc.flush()
        got = sorted((e.agent_id, e.from_, e.to, e.reason) for e in events)
    finally:
        await fleet.stop()
    assert got == [(a, "suspect", "healthy", "heartbeat resumed") for a in agents]
