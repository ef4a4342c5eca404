"""How a broker hears the agent subjects: the check of the server's mapping (its tokens tell
every other partition count), and the three modes on real servers: ``mapped`` (the shipped
config), ``plain`` (a bare nats-server), ``mismatch`` (the shipped config, another count); the
callers' outcome summaries in each, and from a server whose mapping predates theirs."""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path
from typing import Any

import nats
import pytest
from nats.aio.client import Client as NATS

from reach_agent.routing.table import partition
from reach_agent.wire import schema
from reach_broker.broker import Broker
from reach_broker.cluster.natsserver import NatsServer
from reach_broker.service.ingest import check_tokens
from reach_broker.service.metrics import Metrics

from .conftest import BrokerFactory, fast_config, wait_for


def test_the_check_tokens_tell_every_other_partition_count() -> None:
    for count in (1, 2, 7, 8, 32, 100):
        tokens = check_tokens(count, "salt")
        assert all(partition(t, count) == count - 1 for t in tokens)
        for other in range(1, 400):
            if other != count:
                assert any(partition(t, other) != count - 1 for t in tokens), (count, other)


async def announce_and_beat(nc: NATS, agent_id: str) -> None:
    body = {"agent_id": agent_id, "capabilities": ["ing"], "max_concurrency": 1,
            "heartbeat_interval_ms": 1000}  # fmt: skip
    reply = await nc.request(f"reach.announce.{agent_id}", json.dumps(body).encode(), timeout=5)
    token = json.loads(reply.data)["token"]
    hb = {"agent_id": agent_id, "token": token, "seq": 1}
    await nc.publish(f"reach.hb.{agent_id}", json.dumps(hb).encode())
    await nc.flush()


async def report(nc: NATS, agent_id: str) -> None:
    """A caller's outcome summary of ``agent_id``."""
    summary = schema.OutcomeSummary(caller="ing", attempts=1, ok=1, interval_ms=1000)
    await nc.publish(f"reach.outcome.{agent_id}", schema.encoder.encode(summary))
    await nc.flush()


def judged(broker: Broker) -> dict[str, float]:
    """``reach_outcomes_total`` by result."""
    c = broker.metrics.outcomes
    return {r: c.labels(r)._value.get() for r in ("accepted", "invalid", "unknown")}


def mode_gauge(broker: Broker) -> dict[str, float]:
    g = broker.metrics.partition_mapping
    return {m: g.labels(m)._value.get() for m in ("mapped", "plain", "mismatch")}


def beats(broker: Broker) -> float:
    value: float = broker.metrics.heartbeat_result["accepted"].value
    return value


async def test_mapped_on_the_shipped_config(broker: Broker, nc: NATS) -> None:
    assert broker.ingest.mode == "mapped"
    assert mode_gauge(broker) == {"mapped": 1.0, "plain": 0.0, "mismatch": 0.0}
    await announce_and_beat(nc, "ing-mapped")
    await wait_for(lambda: beats(broker) == 1, what="the heartbeat")
    p = partition("ing-mapped", 32)
    assert broker.ingest.beats[p] == 1 and sum(broker.ingest.beats) == 1
    assert broker.not_ready() is None
    await report(nc, "ing-mapped")
    await wait_for(lambda: judged(broker)["accepted"] == 1, what="the outcome summary")
    assert judged(broker) == {"accepted": 1, "invalid": 0, "unknown": 0}
    assert not broker.ingest.unmapped_outcomes  # heard on its partition's subscription


async def test_plain_on_a_server_that_does_not_map(plain_server: str) -> None:
    broker = Broker(fast_config(plain_server), metrics=Metrics())
    await broker.start()
    nc: Any = await nats.connect(plain_server)
    try:
        assert broker.ingest.mode == "plain"
        assert mode_gauge(broker) == {"mapped": 0.0, "plain": 1.0, "mismatch": 0.0}
        await announce_and_beat(nc, "ing-plain")
        await wait_for(lambda: beats(broker) == 1, what="the heartbeat")
        assert broker.ingest.beats[partition("ing-plain", 32)] == 1
        await report(nc, "ing-plain")
        await wait_for(lambda: judged(broker)["accepted"] == 1, what="the outcome summary")
        assert judged(broker) == {"accepted": 1, "invalid": 0, "unknown": 0}
    finally:
        await nc.close()
        await broker.stop()


async def test_a_mismatch_is_refused_visibly_and_no_agent_is_mispartitioned(
    broker_factory: BrokerFactory, nc: NATS
) -> None:
    broker = await broker_factory(fleet__partitions=8)  # the server maps into 32
    assert broker.ingest.mode == "mismatch"
    assert mode_gauge(broker) == {"mapped": 0.0, "plain": 0.0, "mismatch": 1.0}
    reason = broker.not_ready()
    assert reason is not None and "[fleet] partitions = 8" in reason
    await announce_and_beat(nc, "ing-mismatch")
    await wait_for(lambda: beats(broker) == 1, what="the heartbeat")
    # Counted in the agent's partition by the broker's own count, not the server's.
    assert broker.ingest.beats[partition("ing-mismatch", 8)] == 1


@pytest.fixture
def older_mapping(tmp_path: Path) -> Any:
    """The shipped server config without the outcome summaries' mapping (as configs and
    account JWTs written before it): its URL."""
    text = (Path(__file__).resolve().parent.parent / "configs" / "nats-server.conf").read_text()
    line = '      "reach.outcome.*": "reach.part.{{partition(32,1)}}.outcome.{{wildcard(1)}}"\n'
    assert line in text
    conf = tmp_path / "older.conf"
    conf.write_text(text.replace(line, ""))
    server = NatsServer(port=0, store_dir=tmp_path / "nats", config=conf)
    server.start()
    try:
        yield server.url
    finally:
        server.stop()


async def test_a_server_that_maps_the_agents_but_not_the_outcomes_is_heard_and_logged(
    older_mapping: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Mapped mode, summaries arriving unmapped: each broker keeps its partitions' (none lost),
    and says once that every broker is hearing every summary."""
    caplog.set_level(logging.WARNING, logger="reach_broker.service.ingest")
    broker = Broker(fast_config(older_mapping), metrics=Metrics())
    await broker.start()
    nc: Any = await nats.connect(older_mapping)
    try:
        assert broker.ingest.mode == "mapped"
        for agent_id in ("ing-old-1", "ing-old-2"):
            await announce_and_beat(nc, agent_id)
            await report(nc, agent_id)
        await wait_for(lambda: judged(broker)["accepted"] == 2, what="both summaries")
        assert judged(broker) == {"accepted": 2, "invalid": 0, "unknown": 0}
        assert broker.ingest.unmapped_outcomes
        logged = [r for r in caplog.records if "ingest.outcomes_unmapped" in r.getMessage()]
        assert len(logged) == 1 and "reach.outcome.*" in logged[0].getMessage()
    finally:
        await nc.close()
        await broker.stop()


async def test_a_lone_broker_hears_heartbeats_on_one_subscription_and_switches_without_loss(
    broker: Broker, nc: NATS
) -> None:
    """Owning every partition, a broker hears the heartbeats on one subscription; a partition
    handed over takes it back to one a partition, owned again to the one. Heartbeats flow
    all along: every one of the partitions kept is heard exactly once (none lost between the
    subscriptions, none handled twice, which the registry would refuse as stale)."""
    ingest = broker.ingest
    assert ingest.mode == "mapped" and len(ingest.live) == 32
    assert ingest.heartbeat_subscriptions == 1
    ids = [f"ing-sw-{i:03d}" for i in range(64)]
    tokens = {}
    for agent_id in ids:
        body = {"agent_id": agent_id, "capabilities": ["ing"], "max_concurrency": 1,
                "heartbeat_interval_ms": 60_000}  # fmt: skip
        reply = await nc.request(f"reach.announce.{agent_id}", json.dumps(body).encode(),
                                 timeout=5)  # fmt: skip
        tokens[agent_id] = json.loads(reply.data)["token"]
    handed = partition(ids[0], 32)
    kept = [a for a in ids if partition(a, 32) != handed]
    sent = {a: 0 for a in ids}
    before = list(ingest.beats)
    stale0 = broker.metrics.heartbeat_result["stale"].value
    flowing = True

    async def beat() -> None:
        seq = 0
        while flowing:
            seq += 1
            for agent_id in ids:
                hb = {"agent_id": agent_id, "token": tokens[agent_id], "seq": seq}
                await nc.publish(f"reach.hb.{agent_id}", json.dumps(hb).encode())
                sent[agent_id] += 1
            await asyncio.sleep(0)

    task = asyncio.create_task(beat())
    try:
        for _ in range(4):
            await ingest.lose(handed)
            assert ingest.heartbeat_subscriptions == 31
            await asyncio.sleep(0.02)  # heartbeats flow on the partitions' subscriptions
            await ingest.own(handed)
            assert ingest.heartbeat_subscriptions == 1
            await asyncio.sleep(0.02)
    finally:
        flowing = False
        await task
    await nc.flush()
    counts = {p: 0 for p in range(32)}
    for agent_id in kept:
        counts[partition(agent_id, 32)] += sent[agent_id]
    await wait_for(
        lambda: all(ingest.beats[p] - before[p] == n for p, n in counts.items() if p != handed),
        what="every heartbeat of the partitions kept heard",
    )
    assert [ingest.beats[p] - before[p] for p in range(32) if p != handed] == [
        counts[p] for p in range(32) if p != handed
    ]
    assert broker.metrics.heartbeat_result["stale"].value == stale0
    assert ingest.copies > 0, "no heartbeat came on both subscriptions: the switch went untested"
