"""Instant death: a SIGKILLed agent process is seen through the server's DISCONNECT advisory,
probed (no responders) and taken offline — long before its heartbeats would have said so."""

from __future__ import annotations

import logging
import os
import signal

import nats
import pytest
from nats.aio.client import Client as NATS

from reach_agent.connection import flush_subscriptions
from reach_agent.wire.errors import NoReachableAgent
from reach_agent.wire.schema import RouteRequest
from reach_broker.broker import Broker
from reach_broker.cluster.natsserver import NatsServer
from reach_broker.service.metrics import Metrics

from .conftest import BrokerFactory, fast_config, wait_for
from .detection_agents import Transitions, agents, spawn_agent, stop_agent

SLOW_HB = ["--heartbeat-ms", "5000"]  # heartbeat deadlines ≥ 12 s: they cannot explain < 4 s


async def test_sigkill_is_suspect_at_once_then_offline_then_recovers(
    nats_server: NatsServer, broker_factory: BrokerFactory
) -> None:
    seen = Transitions()
    broker = await broker_factory(watchers=[seen])
    assert broker.advisories.available is True
    assert broker.account.name == "APP"
    assert broker.metrics.advisories._value.get() == 1
    async with agents(nats_server.url, ("alpha", SLOW_HB), ("beta", SLOW_HB)) as procs:
        await wait_for(lambda: "alpha" in broker.registry.agents, 5, what="alpha registered")
        os.kill(procs["alpha"].pid, signal.SIGKILL)
        await wait_for(lambda: seen.reached("alpha", "offline"), 4.0, what="alpha offline")
        assert seen.of("alpha") == [
            ("healthy", "suspect", "connection closed"),
            ("suspect", "offline", "disconnected and probe unanswered"),
        ]
        assert broker.advisories.disconnects == 1
        assert broker.metrics.probes.labels("no_responders")._value.get() == 1
        got = broker.router.route("summarize", RouteRequest(limit=3), broker.clock())
        assert [c.agent_id for c in got] == ["beta"]

        # The same agent restarts: re-announce → recovering → probe answered → healthy,
        # slow-started from that moment.
        procs["alpha"] = await spawn_agent(nats_server.url, "alpha", *SLOW_HB)
        await wait_for(lambda: broker.registry.agents["alpha"].state == "healthy", 5,
                       what="alpha healthy again")  # fmt: skip
        assert seen.of("alpha")[2:] == [
            ("offline", "recovering", "re-announced"),
            ("recovering", "healthy", "probe answered"),
        ]
        rec = broker.registry.agents["alpha"]
        assert rec.recovered_at is not None
        assert broker.router.slow_start_factor(rec, broker.clock()) == 0.2


async def test_reconcile_suspects_known_agents_without_a_connection(
    nc: NATS, broker_factory: BrokerFactory
) -> None:
    seen = Transitions()
    broker = await broker_factory(watchers=[seen])
    # "ghost" announces through the test's own connection (named test-client): the broker
    # knows it, but no connection carries its name — as after a restore from a snapshot.
    reply = await nc.request("reach.announce.ghost", b'{"agent_id": "ghost", "capabilities":'
                             b' ["summarize"], "max_concurrency": 2, "heartbeat_interval_ms":'
                             b' 60000}', 2)  # fmt: skip
    assert b"token" in reply.data
    async with agents(broker.cfg.nats.url or "", ("alive", SLOW_HB)):
        assert await broker.advisories.reconcile() == 1
        await wait_for(lambda: seen.reached("ghost", "offline"), 4.0, what="ghost offline")
        assert seen.of("ghost") == [
            ("healthy", "suspect", "no connection at reconcile"),
            ("suspect", "offline", "disconnected and probe unanswered"),
        ]
        assert broker.registry.agents["alive"].state == "healthy"
        assert seen.of("alive") == []


async def test_connect_advisory_probes_an_offline_agent_at_once(
    nats_server: NatsServer, broker_factory: BrokerFactory
) -> None:
    seen = Transitions()
    await broker_factory(watchers=[seen])
    proc = await spawn_agent(nats_server.url, "gamma", *SLOW_HB)
    try:
        os.kill(proc.pid, signal.SIGKILL)
        await wait_for(lambda: seen.reached("gamma", "offline"), 4.0, what="gamma offline")
    finally:
        await stop_agent(proc)
    # A bare connection named "gamma" that answers probes (no announce, no heartbeat):
    # only the CONNECT advisory can bring the broker to probe it.
    raw = await nats.connect(nats_server.url, name="gamma")
    try:

        async def answer(msg: nats.aio.msg.Msg) -> None:
            await msg.respond(b'{"agent_id": "gamma"}')

        await raw.subscribe("reach.probe.gamma", cb=answer)
        await flush_subscriptions(raw)
        await wait_for(lambda: seen.reached("gamma", "recovering"), 4.0, what="probe answered")
        assert seen.of("gamma")[2] == ("offline", "recovering", "probe answered")
    finally:
        await raw.close()


async def test_without_advisories_heartbeats_alone_detect_death(
    tmp_path: object, caplog: pytest.LogCaptureFixture
) -> None:
    server = NatsServer(config=None, store_dir=os.path.join(str(tmp_path), "plain"))
    server.start()
    seen = Transitions()
    broker = Broker(fast_config(server.url), metrics=Metrics(), watchers=[seen])
    try:
        with caplog.at_level(logging.INFO, logger="reach_broker.service.advisories"):
            await broker.start()
            await broker.advisories.reconcile()  # asking again does not repeat the warning
        said = [r for r in caplog.records if r.name == "reach_broker.service.advisories"]
        assert [r.levelname for r in said] == ["WARNING"]
        assert said[0].getMessage().startswith("advisories.unavailable $SYS.REQ.ACCOUNT.$G.CONNZ"
                                               " not answered (NoRespondersError)")  # fmt: skip
        assert "heartbeats alone" in said[0].getMessage()
        assert (broker.account.name, broker.advisories.available) == ("$G", False)
        assert broker.metrics.advisories._value.get() == 0
        async with agents(server.url, ("delta", ["--heartbeat-ms", "200"])) as procs:
            await wait_for(lambda: "delta" in broker.registry.agents, 5, what="registered")
            os.kill(procs["delta"].pid, signal.SIGKILL)
            await wait_for(lambda: seen.reached("delta", "offline"), 10.0, what="offline")
        reasons = [r for _, _, r in seen.of("delta")]
        assert [(f, t) for f, t, _ in seen.of("delta")] == [("healthy", "suspect"),
                                                            ("suspect", "offline")]  # fmt: skip
        assert all(r.startswith("no heartbeat for ") for r in reasons), reasons
        with pytest.raises(NoReachableAgent):
            broker.router.route("summarize", RouteRequest(), broker.clock())
    finally:
        await broker.stop()
        server.stop()
