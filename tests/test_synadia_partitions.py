"""Synadia Agent Protocol agents under several brokers: each instance is held by the owner of
its partition alone, and taken over with it.

Their subjects (``$SRV.INFO.agents``, ``agents.hb.*.*.*``) are not mapped into partitions, so
every broker hears every instance; the registry of each holds the instances of the partitions
it owns, and nothing else (issue 24). Two in-process brokers of P = 8 partitions (leases of
2 s) over a real nats-server, and real agent processes hosted by their PyPI host SDK
(``tests/agents/synadia_agent.py``, a heartbeat every second): each instance is registered,
heard and evented by its partition's owner only, routes list every instance (the other
owner's through its route-table shares), and when one broker goes (stopped: its leases handed
back; or its connection lost: its leases left to lapse), the survivor holds every instance,
heard on without an event: none goes suspect or offline because its owner changed.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import msgspec
import pytest
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from reach_agent.connection import flush_subscriptions
from reach_agent.routing.table import partition
from reach_agent.wire import schema
from reach_broker.broker import Broker
from reach_broker.cluster.natsserver import NatsServer
from reach_broker.interop.synadiainfo import agent_id_of

from .conftest import BrokerFactory, wait_for

pytest.importorskip("synadia_ai.agent_service", reason="pip install -e '.[dev]' (synadia SDKs)")

ROOT = Path(__file__).resolve().parent.parent
P = 8
CAPABILITY = "text.parted"
FIRST = 4
"""Instances started at once; more are started one by one until both brokers hold some."""
MOST = 40
"""Instances started at most before both brokers hold one. Each lands in either broker's
half of the partitions by its random instance id, so all of ``n`` land in one half with
probability 2 x 0.5^n: 1 in 2,048 at 12 (CI on 2026-12-07 met it), 1 in 5.5e11 at 40. A run
stops at the first that lands in the other half: 4.25 instances on average."""
Spawn = Callable[[str], Awaitable[str]]


@pytest.fixture
async def spawn(nats_server: NatsServer) -> AsyncIterator[Spawn]:
    """Start a Synadia agent process of session ``session`` (a heartbeat every second, the
    capability :data:`CAPABILITY`): its reach agent id. Killed at teardown."""
    procs: list[asyncio.subprocess.Process] = []

    async def start(session: str) -> str:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "tests.agents.synadia_agent", "--server", nats_server.url,
            "--session", session, "--capabilities", CAPABILITY, "--heartbeat-s", "1",
            cwd=ROOT, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL,
        )  # fmt: skip
        procs.append(proc)
        assert proc.stdout is not None
        line = (await asyncio.wait_for(proc.stdout.readline(), 30)).decode().split()
        assert line[:1] == ["ready"], line
        return agent_id_of("echo-bot", "tests", session, line[1])

    try:
        yield start
    finally:
        for proc in procs:
            if proc.returncode is None:
                proc.kill()
            await proc.wait()


async def eventually(check: Callable[[], Awaitable[object]], timeout: float, what: str) -> None:  # noqa: ASYNC109 - a polling deadline
    """Poll the async ``check`` until it returns something truthy; fail after ``timeout``."""
    deadline = time.monotonic() + timeout
    while not await check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(0.1)


async def routed(nc: NATS) -> list[str]:
    """The agent ids ``reach.route.<CAPABILITY>`` offers, all of them ([] when none)."""
    body = json.dumps({"limit": MOST}).encode()
    reply = json.loads((await nc.request(f"reach.route.{CAPABILITY}", body, timeout=2)).data)
    return sorted(c["agent_id"] for c in reply.get("candidates", []))


def holders(brokers: list[Broker], agent_id: str) -> list[int]:
    """The indexes of the brokers whose registry holds ``agent_id``."""
    return [i for i, b in enumerate(brokers) if agent_id in b.registry.agents]


def owner(brokers: list[Broker], agent_id: str) -> int:
    """The index of the broker that hears ``agent_id``'s partition."""
    [i] = [i for i, b in enumerate(brokers) if partition(agent_id, P) in b.ingest.live]
    return i


def gauge(broker: Broker) -> float | None:
    return broker.metrics.registry.get_sample_value("reach_synadia_agents")


@pytest.mark.parametrize("how", ["stopped", "lapsed"])
async def test_each_synadia_instance_is_held_by_its_partitions_owner_and_taken_over(
    broker_factory: BrokerFactory, nc: NATS, spawn: Spawn, how: str
) -> None:
    brokers = [await broker_factory(fleet__partitions=P, fleet__lease_ttl_s=2.0)
               for _ in range(2)]  # fmt: skip
    await wait_for(lambda: [len(b.ingest.live) for b in brokers] == [P // 2] * 2, 20,
                   interval=0.05, what="each broker hearing half the partitions")  # fmt: skip
    events: list[schema.Event] = []

    async def on_event(msg: Msg) -> None:
        event = msgspec.json.decode(msg.data, type=schema.Event)
        if event.agent_id.startswith("echo-bot_"):
            events.append(event)

    await nc.subscribe("reach.event.>", cb=on_event)
    await flush_subscriptions(nc)

    # Instances until both brokers own the partition of one at least (the ids are random).
    agents = sorted(await asyncio.gather(*(spawn(f"s{i}") for i in range(FIRST))))
    while len({owner(brokers, a) for a in agents}) < 2:
        assert len(agents) < MOST, "every instance in one broker's partitions"
        agents = sorted([*agents, await spawn(f"s{len(agents)}")])
    owners = {a: owner(brokers, a) for a in agents}
    ids = [b.broker_id for b in brokers]

    # Each instance registered, heard and healthy at the owner of its partition, and held by
    # no other broker; its events come from that owner alone.
    def held_by_owners() -> bool:
        return all(holders(brokers, a) == [owners[a]]
                   and (r := brokers[owners[a]].registry.agents[a]).state == "healthy"
                   and r.seq >= 2 and r.announce.heartbeat_interval_ms == 1000
                   for a in agents)  # fmt: skip

    await wait_for(held_by_owners, 20, interval=0.05, what="each instance held by its owner")
    await wait_for(lambda: sorted(e.agent_id for e in events) == agents, 5,
                   what="one registered event each")  # fmt: skip
    assert {e.agent_id: (e.kind, e.to, e.broker_id) for e in events} == {
        a: ("registered", "healthy", ids[owners[a]]) for a in agents
    }
    assert {a: holders(brokers, a) for a in agents} == {a: [owners[a]] for a in agents}
    counts = [sum(1 for a in agents if owners[a] == i) for i in range(2)]
    assert [gauge(b) for b in brokers] == counts
    assert all(counts)
    # Routes list every instance: the route owner's own and the other's, by its shares.
    await eventually(lambda: _equal(routed(nc), agents), 10, "every instance routed")

    # One broker goes; the survivor takes its partitions and holds every instance.
    survivor, victim = brokers
    await wait_for(lambda: not any(b.snapshot._dirty for b in brokers), 5,
                   what="every instance's key written")  # fmt: skip
    events.clear()
    if how == "stopped":
        await victim.stop()
    else:
        await victim.nc.close()  # its leases left to lapse, nothing handed back
    await wait_for(lambda: len(survivor.ingest.live) == P, 15, interval=0.05,
                   what="the survivor hearing every partition")  # fmt: skip
    recs = survivor.registry.agents

    def heard_at_survivor() -> bool:
        return all(a in recs and recs[a].state == "healthy" and not recs[a].resync
                   for a in agents)  # fmt: skip

    await wait_for(heard_at_survivor, 10, interval=0.05, what="every instance heard anew")
    # Heartbeats keep coming in: three more each, every instance healthy throughout.
    seqs = {a: recs[a].seq for a in agents}
    await wait_for(lambda: all(recs[a].seq >= seqs[a] + 3 for a in agents), 10,
                   interval=0.05, what="three more heartbeats each")  # fmt: skip
    assert {a: recs[a].state for a in agents} == dict.fromkeys(agents, "healthy")
    assert gauge(survivor) == len(agents)
    await eventually(lambda: _equal(routed(nc), agents), 10, "every instance routed")
    await nc.flush()
    # Taken over warm: no instance moved (no suspect, no offline, no registration again).
    assert events == []


async def _equal(got: Awaitable[list[str]], want: list[str]) -> bool:
    return await got == want
