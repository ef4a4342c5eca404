"""Timeout hints: the announced ``timeout_hint_ms`` reaches the caller and stretches its wait."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from nats.aio.client import Client as NATS

import reach_agent
from reach_agent import ClientConfig, ClientMetrics
from reach_agent.connection import flush_subscriptions
from reach_agent.wire import schema
from reach_broker.broker import Broker
from reach_broker.cluster.natsserver import NatsServer

from .conftest import wait_for
from .test_sdk_failover import healthy


def sleeper(agent_id: str, hint: float | None, runs: list[str]) -> reach_agent.Agent:
    agent = reach_agent.Agent(agent_id, ["render"], heartbeat_interval=0.1, timeout_hint=hint)

    @agent.handler("render")
    async def render(task: reach_agent.Task) -> dict[str, Any]:
        runs.append(agent_id)
        await asyncio.sleep(float((task.payload or {}).get("sleep", 0)))
        return {"agent": agent_id, "time_left": round(task.time_left or 0)}

    return agent


async def test_route_candidates_carry_the_announced_timeout_hint(
    nats_server: NatsServer, broker: Broker, agents: Any, nc: NATS
) -> None:
    await agents(sleeper("hinted", 20.0, []))
    await agents(sleeper("plain", None, []))
    await wait_for(lambda: healthy(broker, "hinted") and healthy(broker, "plain"))
    reply = await nc.request("reach.route.render", b'{"limit": 2}', timeout=2)
    body = schema.decode(schema.route_reply_decoder, reply.data, "route reply")
    hints = {c.agent_id: c.timeout_hint_ms for c in body.candidates}
    assert hints == {"hinted": 20_000, "plain": None}
    raw = {c["agent_id"]: c for c in json.loads(reply.data)["candidates"]}
    assert raw["hinted"]["timeout_hint_ms"] == 20000
    assert "timeout_hint_ms" not in raw["plain"]  # a default is omitted


async def test_a_7s_task_with_a_20s_hint_completes_under_call_timeout_5(
    nats_server: NatsServer, broker: Broker, agents: Any
) -> None:
    runs: list[str] = []
    await agents(sleeper("long", 20.0, runs))
    await wait_for(lambda: healthy(broker, "long"))
    metrics = ClientMetrics()
    async with reach_agent.Client(nats_server.url, metrics=metrics) as client:
        result = await asyncio.wait_for(client.call("render", {"sleep": 7}, timeout=5), 25)
    # The agent saw the stretched deadline (Reach-Timeout-Ms ~ 20 s), and ran it once.
    assert result == {"agent": "long", "time_left": 13}
    assert runs == ["long"]
    assert metrics.requests.labels("long", "ok")._value.get() == 1


async def test_a_long_hint_never_delays_not_delivered(
    nats_server: NatsServer, broker: Broker, agents: Any, nc: NATS
) -> None:
    """An agent announcing a 20 min hint that never sends a receipt is still "not delivered"
    after ack_timeout_s (not "slow"), and the call goes to the next candidate."""
    runs: list[str] = []
    silent = sleeper("silent", 1200.0, runs)
    await agents(silent)
    await agents(sleeper("quick", 1200.0, runs))
    await wait_for(lambda: healthy(broker, "silent") and healthy(broker, "quick"))
    for sub in silent.tasks._subs:  # it keeps its heartbeats, but reads no more tasks
        await sub.unsubscribe()
    swallowed: list[str] = []

    async def swallow(msg: Any) -> None:
        swallowed.append(msg.subject)

    await nc.subscribe("reach.task.silent.render", cb=swallow)
    await flush_subscriptions(nc)
    metrics = ClientMetrics()
    cfg = ClientConfig(ack_timeout_s=0.5)
    async with reach_agent.Client(nats_server.url, config=cfg, metrics=metrics) as client:
        key = None
        for i in range(500):
            if (await client.route("render", sticky_key=f"k{i}"))[0].agent_id == "silent":
                key = f"k{i}"
                break
        assert key is not None
        result = await asyncio.wait_for(client.call("render", {}, sticky_key=key, timeout=5), 10)
    assert result["agent"] == "quick"
    assert swallowed == ["reach.task.silent.render"]
    assert metrics.requests.labels("silent", "not_delivered")._value.get() == 1
    assert metrics.requests.labels("silent", "timeout")._value.get() == 0
    assert runs == ["quick"]
