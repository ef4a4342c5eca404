"""Two brokers over one server, P = 8 (issue 24, "Tables merged, not fleets copied"): a
capability's route requests are answered by one broker, its owner, whichever broker they
reach (the others forward them), so a caller's quota and an agent's slots are counted once;
and a route lists the agents of every partition, whichever broker owns it."""

from __future__ import annotations

import time
from typing import Any

from nats.aio.client import Client as NATS

import reach_agent
from reach_agent.routing.table import partition
from reach_agent.wire import schema
from reach_agent.wire.errors import from_reply
from reach_agent.wire.schema import H_CALLER
from reach_broker.broker import Broker

from .conftest import BrokerFactory, wait_for
from .test_sdk_failover import healthy

P = 8


def worker(agent_id: str, cap: str, *, slots: int = 100, every: float = 0.1) -> reach_agent.Agent:
    agent = reach_agent.Agent(agent_id, [cap], heartbeat_interval=every, max_concurrency=slots)

    @agent.handler(cap)
    async def run(task: reach_agent.Task) -> Any:
        return task.payload

    return agent


async def two_brokers(broker_factory: BrokerFactory, **overrides: Any) -> tuple[Broker, Broker]:
    """Two brokers of P partitions, every partition owned by one of them."""
    pair = (await broker_factory(fleet__partitions=P, **overrides),
            await broker_factory(fleet__partitions=P, **overrides))  # fmt: skip
    await wait_for(lambda: sum(len(b.tables.book.epochs) for b in pair) == P,
                   what="every partition owned")  # fmt: skip
    return pair


def forwards(broker: Broker, result: str) -> float:
    value: float = broker.metrics.route_forwards.labels(result)._value.get()
    return value


def owner_and_other(pair: tuple[Broker, Broker], capability: str) -> tuple[Broker, Broker]:
    p = partition(capability, P)
    first, second = pair
    return (first, second) if p in first.tables.book.epochs else (second, first)


async def wait_owners_read(pair: tuple[Broker, Broker], capability: str) -> None:
    """The broker that does not own ``capability`` has read who does (its leases' round)."""
    owner, other = owner_and_other(pair, capability)
    p = partition(capability, P)
    await wait_for(lambda: other.forwarder.owners.of[p] == owner.forwarder.token,
                   what="the other broker knows the capability's owner")  # fmt: skip


async def test_a_callers_quota_is_counted_once_by_two_brokers(
    broker_factory: BrokerFactory, agents: Any, nc: NATS
) -> None:
    cap = "quota.cap"
    pair = await two_brokers(broker_factory, quotas__rate=10.0, quotas__burst=10)
    await agents(worker("q-agent", cap))
    await wait_for(lambda: all(healthy(b, "q-agent") for b in pair))
    await wait_owners_read(pair, cap)
    owner, other = owner_and_other(pair, cap)
    peek = schema.encoder.encode(schema.RouteRequest(peek=True))
    admitted = refused = 0
    start = time.monotonic()
    while time.monotonic() - start < 3.0:
        msg = await nc.request(f"reach.route.{cap}", peek, timeout=2, headers={H_CALLER: "q1"})
        err = from_reply(msg.headers, msg.data)
        if err is None:
            admitted += 1
        else:
            assert err.code == "OVERLOADED" and "over its quota" in err.message, err.message
            refused += 1
    elapsed = time.monotonic() - start
    # A token bucket of 10/s holding 10: at most 10 + 10/s over the run, and (requests
    # never stop for long) at least 90 % of 10/s. Two brokers each counting would admit twice.
    assert 0.9 * 10 * elapsed <= admitted <= 10 + 10 * elapsed + 1, (admitted, elapsed)
    assert refused > 0
    # The queue group spread the requests: the other broker forwarded, the owner answered.
    assert forwards(other, "ok") > 0
    assert forwards(owner, "answered") == forwards(other, "ok")
    assert forwards(owner, "ok") == 0


async def test_an_agents_slots_are_handed_out_once_by_two_brokers(
    broker_factory: BrokerFactory, agents: Any, nc: NATS
) -> None:
    cap = "slots.cap"
    pair = await two_brokers(broker_factory)
    # A long heartbeat interval: no report resets the brokers' hand-out count meanwhile.
    await agents(worker("four-slots", cap, slots=4, every=20.0))
    await wait_for(lambda: all(healthy(b, "four-slots") for b in pair))
    await wait_owners_read(pair, cap)
    owner, other = owner_and_other(pair, cap)
    handed = overloaded = 0
    for _ in range(40):  # spread over both brokers by the queue group
        msg = await nc.request(f"reach.route.{cap}", b"", timeout=2)
        err = from_reply(msg.headers, msg.data)
        if err is None:
            reply = schema.route_reply_decoder.decode(msg.data)
            assert reply.candidates[0].agent_id == "four-slots"
            handed += 1
        else:
            assert err.code == "OVERLOADED", err.message
            overloaded += 1
    assert (handed, overloaded) == (4, 36)
    assert forwards(other, "ok") > 0
    assert owner.registry.agents["four-slots"].handed == 4.0


async def test_a_route_lists_the_agents_of_every_partition(
    broker_factory: BrokerFactory, agents: Any, nc: NATS
) -> None:
    """Every partition has an agent of the capability; a route (limit 100) lists them all,
    whichever broker owns their partitions. (Until brokers ingest only the partitions they
    own, each also holds every agent itself; then the owner's own registry covers only its
    partitions and the rest come from the other's shares.)"""
    cap = "spread.cap"
    pair = await two_brokers(broker_factory)
    ids: dict[int, str] = {}
    n = 0
    while len(ids) < P:
        agent_id = f"spread-{n}"
        ids.setdefault(partition(agent_id, P), agent_id)
        n += 1
    for agent_id in ids.values():
        await agents(worker(agent_id, cap))
    await wait_for(lambda: all(healthy(b, a) for b in pair for a in ids.values()))
    await wait_owners_read(pair, cap)
    body = schema.encoder.encode(schema.RouteRequest(peek=True, limit=100))
    for _ in range(10):  # both brokers, by the queue group
        msg = await nc.request(f"reach.route.{cap}", body, timeout=2)
        assert from_reply(msg.headers, msg.data) is None
        reply = schema.route_reply_decoder.decode(msg.data)
        listed = {c.agent_id for c in reply.candidates}
        assert listed == set(ids.values())
        assert {partition(a, P) for a in listed} == set(range(P))
    owned = [set(b.tables.book.epochs) for b in pair]
    assert owned[0] | owned[1] == set(range(P)) and owned[0].isdisjoint(owned[1])
