"""Callers' outcomes on a real nats-server: an agent that sends receipts but never results is
out of the routes for a second caller after at most N (outcomes.unanswered_after) calls of a
first; a single noisy caller alone cannot eject a healthy agent. And an SDK agent's
permissions and context headroom, routed on."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from nats.aio.client import Client as NATS

import reach_agent
from reach_agent.client.config import ClientConfig
from reach_agent.wire.errors import NoReachableAgent, Timeout
from reach_agent.wire.schema import OutcomeSummary, encoder
from reach_broker.cluster.natsserver import NatsServer

from .conftest import BrokerFactory, wait_for
from .test_cli import QUIET

CAP = "summarize"
N = 3  # outcomes.unanswered_after, the documented default

FAST = ClientConfig(min_timeout_s=0.3, default_timeout_s=0.3, retries=0,
                    outcome_interval_s=0.1, liveness_probe_s=0)  # fmt: skip


async def hangs(task: Any) -> None:
    await asyncio.sleep(60)  # receipted, never answered (cancelled at teardown)


async def answers(task: Any) -> str:
    return "ok"


async def test_an_agent_with_receipts_but_no_results_is_out_for_a_second_caller_after_n_calls(
    nats_server: NatsServer, broker_factory: BrokerFactory, agents: Any
) -> None:
    broker = await broker_factory(**QUIET)
    stuck = reach_agent.Agent("stuck", [CAP], heartbeat_interval=0.1, tags={"kind": "stuck"},
                              claims=False)  # fmt: skip
    stuck.handler(CAP)(hangs)
    good = reach_agent.Agent("good", [CAP], heartbeat_interval=0.1, claims=False)
    good.handler(CAP)(answers)
    await agents(stuck)
    await agents(good)
    await wait_for(lambda: len(broker.registry.agents) == 2, what="two agents")
    async with reach_agent.Client(nats_server.url, config=FAST, name="first") as first:
        for _ in range(N):
            try:
                await asyncio.wait_for(first.call(CAP, {}, tags={"kind": "stuck"}), 5)
            except Timeout:
                pass
            else:
                raise AssertionError("the stuck agent answered")
        await wait_for(lambda: broker.registry.agents["stuck"].delivery == 0.0, timeout=3.0,
                       what="the unanswered rule")  # fmt: skip
    async with reach_agent.Client(nats_server.url, config=FAST, name="second") as second:
        for _ in range(20):
            got = await asyncio.wait_for(second.route(CAP, 3), 5)
            assert [c.agent_id for c in got] == ["good"]
        assert await asyncio.wait_for(second.call(CAP, {}), 5) == "ok"
    assert broker.metrics.delivery_ejected.labels("unanswered")._value.get() == 1


async def test_a_single_noisy_caller_alone_cannot_eject_a_healthy_agent(
    nats_server: NatsServer, nc: NATS, broker_factory: BrokerFactory, agents: Any
) -> None:
    broker = await broker_factory(**QUIET)
    for agent_id in ("a", "b"):
        agent = reach_agent.Agent(agent_id, [CAP], heartbeat_interval=0.1, claims=False)
        agent.handler(CAP)(answers)
        await agents(agent)
    await wait_for(lambda: len(broker.registry.agents) == 2, what="two agents")
    # One caller says every call to `a` failed, again and again.
    noisy = OutcomeSummary(caller="noisy", attempts=50, not_delivered=30, timeouts=20)
    for _ in range(10):
        await nc.publish("reach.outcome.a", encoder.encode(noisy))
    await nc.flush()
    accepted = broker.metrics.outcomes.labels("accepted")
    await wait_for(lambda: accepted._value.get() == 10, what="ten summaries folded")
    rec = broker.registry.agents["a"]
    assert (rec.delivery, broker.outcomes.book.agents["a"].verdict.rule) == (1.0, None)
    routed = {
        c["agent_id"]
        for c in json.loads(
            (await nc.request(f"reach.route.{CAP}", b'{"limit": 2}', timeout=2)).data
        )["candidates"]
    }
    assert routed == {"a", "b"}
    # A second caller seeing the same is what the outlier rule needs.
    second = OutcomeSummary(caller="second", attempts=20, not_delivered=2, ok=18)
    await nc.publish("reach.outcome.a", encoder.encode(second))
    await wait_for(lambda: rec.delivery == 0.0, what="outlier rule with two callers")
    assert broker.outcomes.book.agents["a"].verdict.rule == "outlier"
    # An invalid summary is dropped and counted, never folded.
    bad = json.dumps({"caller": "x", "attempts": 1, "ok": 5}).encode()
    await nc.publish("reach.outcome.b", bad)
    invalid = broker.metrics.outcomes.labels("invalid")
    await wait_for(lambda: invalid._value.get() == 1, what="invalid counted")


async def test_an_sdk_agent_s_permissions_and_context_are_routed_on(
    nats_server: NatsServer, broker_factory: BrokerFactory, agents: Any
) -> None:
    broker = await broker_factory(**QUIET)
    big = reach_agent.Agent("big", [CAP], heartbeat_interval=0.1, permissions=["pii"],
                            context_window=200_000, claims=False)  # fmt: skip
    small = reach_agent.Agent("small", [CAP], heartbeat_interval=0.1, context_window=8_000,
                              version="2", claims=False)  # fmt: skip
    for agent in (big, small):
        agent.handler(CAP)(lambda task, name=agent.agent_id: name)
        await agents(agent)
    await wait_for(lambda: len(broker.registry.agents) == 2, what="two agents")
    async with reach_agent.Client(nats_server.url, config=FAST) as client:
        got = await asyncio.wait_for(client.route(CAP, 3, requires=["pii"]), 5)
        assert [c.agent_id for c in got] == ["big"]
        got = await asyncio.wait_for(client.route(CAP, 3, min_context_tokens=100_000), 5)
        assert [c.agent_id for c in got] == ["big"]
        # The same filters on a call (and a canary: only agents of that version).
        for _ in range(5):
            assert await asyncio.wait_for(client.call(CAP, {}, requires=["pii"]), 5) == "big"
            assert await asyncio.wait_for(client.call(CAP, {}, canary="2"), 5) == "small"
        big.context_usage_pct = 75.0  # 50,000 tokens left
        await wait_for(lambda: broker.registry.agents["big"].headroom == 50_000, what="usage")
        try:
            await asyncio.wait_for(client.route(CAP, 3, min_context_tokens=100_000), 5)
        except NoReachableAgent as exc:
            assert "2 filtered by context" in exc.message
        else:
            raise AssertionError("routed an agent without the headroom")
