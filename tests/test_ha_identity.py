"""Who is who: a broker restarted with an empty KV asks its fleet to announce again, and a
second live process with an agent's id is refused with CONFLICT (a crash-restart is not)."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import nats
import pytest

import reach_agent
from jetstream.names import REGISTRY_STREAM
from reach_agent.wire.errors import Conflict
from reach_agent.wire.schema import RouteRequest
from reach_broker.cluster.natsserver import NatsServer

from .agents.procs import AgentProcess
from .conftest import BrokerFactory, wait_for

INTERVAL_S = 0.5
FLEET = 8


def make_agent(agent_id: str, interval: float = INTERVAL_S) -> reach_agent.Agent:
    agent = reach_agent.Agent(agent_id, ["echo"], heartbeat_interval=interval,
                              durable_acks=False)  # fmt: skip

    @agent.handler("echo")
    async def echo(task: reach_agent.Task) -> object:
        return task.payload

    return agent


async def test_a_broker_restarted_with_an_empty_kv_has_the_fleet_back_within_two_intervals(
    nats_server: NatsServer, broker_factory: BrokerFactory
) -> None:
    first = await broker_factory()
    fleet = [make_agent(f"fleet-{i}") for i in range(FLEET)]
    try:
        for a in fleet:
            await a.start(nats_server.url)
        await wait_for(lambda: first.registry.counts["healthy"] == FLEET, 5, what="fleet up")
        old = {a.agent_id: a.token for a in fleet}
        await first.stop()
        nc = await nats.connect(nats_server.url, name="test-client")
        try:  # the snapshot and the token secret with it: nothing to restore
            await nc.jetstream(timeout=5).delete_stream(REGISTRY_STREAM)
        finally:
            await nc.close()
        second = await broker_factory()
        t0 = time.monotonic()
        assert second.snapshot.restored == 0
        # Nothing restored; an agent already known was asked to announce again by the new
        # broker (its ingest subscribes before start returns: a beat may cross), so it holds
        # a token of the new secret, not the one it had.
        assert all(r.token != old[aid] for aid, r in second.registry.agents.items())

        def routable() -> int:
            try:
                got = second.router.route("echo", RouteRequest(limit=FLEET), second.clock())
            except reach_agent.ReachError:
                return 0
            return len(got)

        await wait_for(lambda: routable() == FLEET, 2 * INTERVAL_S, interval=0.005,
                       what="the whole fleet routable again")  # fmt: skip
        took = time.monotonic() - t0
        assert took <= 2 * INTERVAL_S
        asked = second.metrics.reannounce_requests._value.get()
        assert FLEET <= asked <= 2 * FLEET  # once per agent (twice if a beat crossed)
        await wait_for(  # every agent beats with the token of its latest announce
            lambda: {a.token for a in fleet} == {r.token for r in second.registry.agents.values()},
            2, what="tokens agree",
        )  # fmt: skip
    finally:
        for a in fleet:
            await a.stop(grace=0.5)


async def test_a_second_live_process_is_refused_with_conflict(
    nats_server: NatsServer, broker_factory: BrokerFactory, tmp_path: Path
) -> None:
    broker = await broker_factory()
    proc = AgentProcess("worker.py", nats_server.url, "dup", "echo", "--log",
                        str(tmp_path / "dup.log"), "--hb", "0.2")  # fmt: skip
    try:
        await wait_for(lambda: "dup" in broker.registry.agents, 10, what="dup registered")
        first = broker.registry.agents["dup"].announce.instance_id
        assert first is not None
        second = make_agent("dup", 0.2)
        with pytest.raises(Conflict) as refused:
            await second.start(nats_server.url)
        assert refused.value.code == "CONFLICT"
        assert f"instance {first}" in refused.value.message
        assert "(cid " in refused.value.message and "at server " in refused.value.message
        assert broker.metrics.announce_result["conflict"]._value.get() == 1
        assert broker.identity.conflicts == 1
        rec = broker.registry.agents["dup"]
        assert (rec.announce.instance_id, rec.state) == (first, "healthy")  # untouched

        # The first process crashes; its restart (a new instance) is accepted at once.
        os.kill(proc.pid, signal.SIGKILL)
        await wait_for(lambda: broker.registry.agents["dup"].state != "healthy", 5,
                       what="dup seen gone")  # fmt: skip
        restarted = make_agent("dup", 0.2)
        await asyncio.wait_for(restarted.start(nats_server.url), 5)
        try:
            await wait_for(
                lambda: broker.registry.agents["dup"].announce.instance_id
                == restarted.announcement.instance_id, 5, what="the restart registered",
            )  # fmt: skip
            await wait_for(lambda: broker.registry.agents["dup"].state == "healthy", 5,
                           what="dup healthy again")  # fmt: skip
            assert broker.metrics.announce_result["conflict"]._value.get() == 1
        finally:
            await restarted.stop(grace=0.5)
    finally:
        proc.stop()
