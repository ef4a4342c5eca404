"""A caller routes from the route tables (issue 23): no route request per call, a fresh agent
is never refused as full, and the table keeps it routing with every broker stopped."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from typing import Any

import reach_agent
from jetstream import rules as rules_kv
from reach_agent import ClientConfig, ClientMetrics
from reach_agent.client.tables import TableRoutes
from reach_agent.routing.rules import RouteRule, rule_encoder
from reach_broker.broker import Broker
from reach_broker.cluster.natsserver import NatsServer

from .conftest import BrokerFactory, wait_for
from .detection_agents import agents as agent_procs
from .test_sdk_failover import healthy

SLOW_HB = ["--heartbeat-ms", "5000"]


def routes_answered(broker: Broker) -> float:
    m = broker.metrics.route_result
    return sum(child.value for child in m.values())


async def test_a_fresh_agent_serves_20_sequential_calls_without_overloaded(
    nats_server: NatsServer, broker: Broker, agents: Any
) -> None:
    """max_concurrency 2, 5 s heartbeats, no task time yet: the broker alone would count two
    hand-outs, find it full and answer OVERLOADED until its next heartbeat (~2 s stalls);
    the caller sees its own calls end."""
    agent = reach_agent.Agent("fresh", ["fresh.cap"], max_concurrency=2,
                              heartbeat_interval=5.0)  # fmt: skip

    @agent.handler("fresh.cap")
    async def run(task: reach_agent.Task) -> Any:
        return task.payload

    await agents(agent)
    await wait_for(lambda: healthy(broker, "fresh"))
    metrics = ClientMetrics()
    async with reach_agent.Client(nats_server.url, metrics=metrics) as client:
        took = []
        for n in range(20):
            t0 = time.monotonic()
            assert await asyncio.wait_for(client.call("fresh.cap", {"n": n}, timeout=5), 5) == {
                "n": n}  # fmt: skip
            took.append(time.monotonic() - t0)
        assert isinstance(client.routes, TableRoutes)
        assert client.routes.follower.followed["fresh.cap"].table.local
    assert metrics.requests.labels("fresh", "ok")._value.get() == 20
    assert routes_answered(broker) == 0  # every call routed from the table: none asked
    # The bound: the stall this replaces took ~2 s (a heartbeat interval's wait).
    assert max(took) < 0.2, took


async def test_a_caller_keeps_routing_from_its_table_with_every_broker_stopped(
    nats_server: NatsServer, broker_factory: BrokerFactory
) -> None:
    broker = await broker_factory()
    async with agent_procs(nats_server.url, ("alpha", SLOW_HB), ("beta", SLOW_HB)) as procs:
        await wait_for(lambda: healthy(broker, "alpha") and healthy(broker, "beta"), 10)
        async with reach_agent.Client(nats_server.url) as client:
            assert (await client.call("summarize", {}, timeout=5))["agent"] in ("alpha", "beta")
            routes = client.routes
            assert isinstance(routes, TableRoutes)
            members = routes.follower.members
            await wait_for(lambda: set(members) == {"alpha", "beta"}, what="both in the table")
            # A kill, learned through the table stream (the broker's advisory, then a delta).
            os.kill(procs["beta"].pid, signal.SIGKILL)
            await wait_for(lambda: members["beta"].state != "healthy", 5,
                           what="beta out of the caller's table")  # fmt: skip
            before = routes_answered(broker)
            await broker.stop()
            results = [(await client.call("summarize", {"n": n}, timeout=5))["agent"]
                       for n in range(10)]  # fmt: skip
            assert results == ["alpha"] * 10
            assert routes_answered(broker) == before  # no broker was there to ask
            assert members["alpha"].state == "healthy"


async def test_a_quota_sends_the_caller_back_to_the_broker(
    nats_server: NatsServer, broker_factory: BrokerFactory, agents: Any
) -> None:
    broker = await broker_factory(quotas__rate=1000.0)
    agent = reach_agent.Agent("q1", ["quota.cap"], heartbeat_interval=0.2)

    @agent.handler("quota.cap")
    async def run(task: reach_agent.Task) -> Any:
        return "ok"

    await agents(agent)
    await wait_for(lambda: healthy(broker, "q1"))
    async with reach_agent.Client(nats_server.url) as client:
        for _ in range(3):
            assert await client.call("quota.cap", {}, timeout=5) == "ok"
        routes = client.routes
        assert isinstance(routes, TableRoutes)
        assert routes.follower.followed["quota.cap"].table.local is False
    assert routes_answered(broker) == 3  # each call asked the broker, which keeps the quota


async def test_without_local_routing_every_call_asks_a_broker(
    nats_server: NatsServer, broker: Broker, agents: Any
) -> None:
    agent = reach_agent.Agent("plain1", ["plain.cap"], heartbeat_interval=0.2)

    @agent.handler("plain.cap")
    async def run(task: reach_agent.Task) -> Any:
        return "ok"

    await agents(agent)
    await wait_for(lambda: healthy(broker, "plain1"))
    config = ClientConfig(local_routing=False)
    async with reach_agent.Client(nats_server.url, config=config) as client:
        for _ in range(2):
            assert await client.call("plain.cap", {}, timeout=5) == "ok"
    assert routes_answered(broker) == 2


async def test_a_quota_set_live_reaches_the_table_and_the_caller_asks_a_broker(
    nats_server: NatsServer, broker: Broker, agents: Any, nc: Any
) -> None:
    """A rule with a quota put in KV ``reach_rules`` while a caller routes locally: the next
    delta says ``local: false`` and from then on each call asks the broker, which keeps it."""
    agent = reach_agent.Agent("lq1", ["livequota.cap"], heartbeat_interval=0.2)

    @agent.handler("livequota.cap")
    async def run(task: reach_agent.Task) -> Any:
        return task.payload

    await agents(agent)
    await wait_for(lambda: healthy(broker, "lq1"))
    async with reach_agent.Client(nats_server.url) as client:
        assert await client.call("livequota.cap", 0, timeout=5) == 0
        routes = client.routes
        assert isinstance(routes, TableRoutes)
        table = routes.follower.followed["livequota.cap"].table
        assert table.local is True and routes_answered(broker) == 0
        quota = RouteRule(quota_rate=1.0, quota_burst=2)
        await rules_kv.put(nc, "livequota.cap", rule_encoder.encode(quota))
        await wait_for(lambda: table.local is False, 5, what="the table says: ask a broker")
        for n in range(1, 4):  # a burst of 2: the third is refused once, then waited out
            assert await asyncio.wait_for(client.call("livequota.cap", n, timeout=5), 10) == n
    result = broker.metrics.route_result
    assert (result["ok"].value, result["overloaded"].value) == (3, 1)
    assert broker.metrics.quota_refused.labels("livequota.cap", "other")._value.get() == 1


async def test_a_caller_routing_locally_keeps_the_split_the_canary_and_sticky_keys(
    nats_server: NatsServer, broker: Broker, agents: Any, nc: Any
) -> None:
    """The capability's rule comes with its table: the caller's split (smooth weighted round
    robin) gives the arms their exact shares, a canary request its arm, and a sticky key the
    agent the broker names for it, with no route request but the broker's one look."""
    for agent_id, version in (("sv1", "1"), ("sv2", "2"), ("sv1b", "1")):
        agent = reach_agent.Agent(agent_id, ["split.cap"], version=version,
                                  heartbeat_interval=0.2)  # fmt: skip

        @agent.handler("split.cap")
        async def run(task: reach_agent.Task, me: str = agent_id) -> Any:
            return me

        await agents(agent)
    await wait_for(lambda: all(healthy(broker, a) for a in ("sv1", "sv2", "sv1b")))
    rule = RouteRule(split_by="version", split={"1": 90, "2": 10})
    await rules_kv.put(nc, "split.cap", rule_encoder.encode(rule))
    await wait_for(lambda: "split.cap" in broker.router.rules, what="the rule at the broker")
    async with reach_agent.Client(nats_server.url) as client:
        got = [await client.call("split.cap", n, timeout=5) for n in range(20)]
        table = client.routes.follower.followed["split.cap"].table  # type: ignore[attr-defined]
        assert table.local and table.rule is not None and table.rule.stored == rule
        assert len([a for a in got if a != "sv2"]) == 18 and got.count("sv2") == 2
        assert [await client.call("split.cap", n, canary="2", timeout=5) for n in range(3)] == [
            "sv2"] * 3  # fmt: skip
        assert routes_answered(broker) == 0
        looked = await client.route("split.cap", 1, sticky_key="user-7")  # the broker's word
        assert routes_answered(broker) == 1
        owner = looked[0].agent_id
        assert [await client.call("split.cap", n, sticky_key="user-7", timeout=5)
                for n in range(5)] == [owner] * 5  # fmt: skip
    assert routes_answered(broker) == 1
