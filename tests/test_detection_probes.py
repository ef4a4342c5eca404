"""RTT samples of healthy agents against a real server: answered ones feed the RTT EWMA; an
agent without a probe responder is left alone (no verdict on its liveness)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from nats.aio.client import Client as NATS

from reach_agent.connection import flush_subscriptions
from reach_broker.cluster.natsserver import NatsServer

from .conftest import BrokerFactory, wait_for
from .detection_agents import Transitions, agents


async def test_rtt_samples_reach_healthy_agents(
    nats_server: NatsServer, nc: NATS, broker_factory: BrokerFactory
) -> None:
    seen = Transitions()
    broker = await broker_factory(detection__rtt_sample_interval_s=0.2, watchers=[seen])
    reply = await nc.request("reach.announce.mute", json.dumps({
        "agent_id": "mute", "capabilities": ["summarize"], "max_concurrency": 2,
        "heartbeat_interval_ms": 60000}).encode(), 2)  # fmt: skip
    assert "token" in json.loads(reply.data)
    probes = broker.metrics.probes
    async with agents(nats_server.url, ("echo", ["--heartbeat-ms", "500"])):
        await wait_for(lambda: probes.labels("ok")._value.get() >= 3, 10, what="3 samples")
        await wait_for(lambda: probes.labels("no_responders")._value.get() >= 3, 10,
                       what="3 unanswered samples of mute")  # fmt: skip
        rtt = broker.registry.agents["echo"].stats.rtt_ewma_ms
        assert rtt is not None and rtt > 0
        mute = broker.registry.agents["mute"]
        assert (mute.state, mute.score, mute.probe_failures, mute.stats.live_n) == (
            "healthy", 100.0, 0, 0)  # fmt: skip
        assert seen.of("mute") == [] and seen.of("echo") == []
        assert probes.labels("timeout")._value.get() == 0


async def test_a_late_answer_of_a_suspect_settles_its_state_but_is_no_rtt_sample(
    nats_server: NatsServer, nc: NATS, broker_factory: BrokerFactory
) -> None:
    """A frozen agent answers the probe sent while it was silent when it thaws: that round
    trip measures the freeze. Taken as an RTT sample it sank the returning agent's score
    (rtt 255 ms: score 35, ejected) — the race test_detection_freeze hit under load."""
    broker = await broker_factory(detection__rtt_sample_interval_s=0.0)
    reply = await nc.request("reach.announce.thaw", json.dumps({
        "agent_id": "thaw", "capabilities": ["summarize"], "max_concurrency": 2,
        "heartbeat_interval_ms": 60000}).encode(), 2)  # fmt: skip
    assert "token" in json.loads(reply.data)

    async def late_answer(msg: Any) -> None:
        await asyncio.sleep(0.3)  # as a process that was stopped when the probe came
        await msg.respond(b'{"agent_id": "thaw"}')

    await nc.subscribe("reach.probe.thaw", cb=late_answer)
    await flush_subscriptions(nc)
    reg = broker.registry
    broker.fanout.emit(reg.disconnected("thaw", broker.clock(), "test"))  # suspect: probed
    await wait_for(lambda: reg.agents["thaw"].state == "healthy", 5, what="probe answered")
    rec = reg.agents["thaw"]
    assert broker.metrics.probes.labels("ok")._value.get() == 1
    assert rec.stats.rtt_ewma_ms is None
    assert rec.score == 95.0  # one missed sign of life of 20 (the disconnect), nothing else


async def test_a_thousand_probes_at_once_are_publishes_not_tasks(
    nc: NATS, broker_factory: BrokerFactory
) -> None:
    """1,000 agents probed at once (RTT samples due together): each probe is a publish and
    an entry in the prober's table, answered on its one inbox; no task, no future of its
    own. Answered, unanswered (a silent responder: timed out from the front of one queue)
    and no-responders are each counted once."""
    from reach_agent.wire.schema import Announce

    # All in flight at once: the deaf ones' second probes (after a 0.5-1 s backoff) come
    # after the first round is counted.
    broker = await broker_factory(detection__rtt_sample_interval_s=0.0,
                                  detection__probe_timeout_s=0.5,
                                  detection__probe_concurrency=2000)  # fmt: skip
    reg, prober, probes = broker.registry, broker.probes, broker.metrics.probes

    async def answer(msg: Any) -> None:
        await msg.respond(b"{}")

    async def ignore(msg: Any) -> None:
        pass

    for i in range(1000):
        reg.announce(Announce(agent_id=f"{('okay', 'deaf', 'none')[i % 3]}{i}",
                              capabilities=["summarize"], max_concurrency=2,
                              heartbeat_interval_ms=60000), broker.clock(), 0)  # fmt: skip
    okay = [a for a in reg.agents if a.startswith("okay")]
    deaf = [a for a in reg.agents if a.startswith("deaf")]
    for agent_id in okay:
        await nc.subscribe(f"reach.probe.{agent_id}", cb=answer)
    for agent_id in deaf:
        await nc.subscribe(f"reach.probe.{agent_id}", cb=ignore)
    await flush_subscriptions(nc)
    tasks_before = len(asyncio.all_tasks())
    base = {r: probes.labels(r)._value.get() for r in ("ok", "timeout", "no_responders")}
    most_tasks = 0
    for agent_id in reg.agents:
        prober.request(agent_id)

    def done() -> bool:
        nonlocal most_tasks
        most_tasks = max(most_tasks, len(asyncio.all_tasks()))
        got = sum(probes.labels(r)._value.get() - base[r] for r in base)
        return got >= 1000

    await wait_for(done, 20, what="1,000 probes decided")
    got = {r: probes.labels(r)._value.get() - base[r] for r in base}
    assert got == {
        "ok": len(okay),
        "timeout": len(deaf),
        "no_responders": 1000 - len(okay) - len(deaf),
    }
    assert most_tasks - tasks_before <= 2  # not one task a probe
    assert prober._waiting == {} and not prober._deadlines and not prober._inflight
