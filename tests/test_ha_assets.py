"""Replicated assets on a real three-node cluster: a broker provisions R3 by default, and
moves assets it finds at R1 to R3 in place, keeping every message."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import nats
import pytest
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js.errors import ServiceUnavailableError

from jetstream import compensation
from jetstream.names import ACK_STREAM, COMP_STREAM, REGISTRY_BUCKET, STREAM_NAMES
from jetstream.provision import (
    JetStreamUnavailable,
    NoPeers,
    NotReady,
    ProvisionTimeout,
    UnsafeChange,
    ensure_stream,
)
from reach_agent.wire.subjects import Subjects
from reach_broker.broker import Broker
from reach_broker.config import Config
from reach_broker.service.assets import ReplicaKeeper, jetstream_not_ready
from reach_broker.service.metrics import Metrics

from .cluster import nats_cluster
from .conftest import fast_config, wait_for

pytestmark = pytest.mark.slow


def _config(servers: str, **overrides: object) -> Config:
    return fast_config(servers, **overrides)


async def test_a_broker_upgrades_r1_assets_to_r3_in_place(tmp_path: Path) -> None:
    async with nats_cluster(tmp_path / "cluster", nodes=3) as cluster:
        await cluster.wait_meta_leader()
        nc = await nats.connect(cluster.urls, name="test-client")
        try:
            # A broker told to keep one copy: every asset R1.
            async with Broker(_config(cluster.servers, jetstream__replicas=1),
                              metrics=Metrics()) as first:  # fmt: skip
                assert first.replicas == 1
            js = nc.jetstream(timeout=5.0)
            for name in STREAM_NAMES:
                assert (await js.stream_info(name)).config.num_replicas == 1, name
                await cluster.wait_stream_leader(nc, name)  # placed and answering
            subjects = Subjects()
            for i in range(20):
                await compensation.enqueue(
                    nc, "summarize", b'{"n": %d}' % i, request_id=f"req-{i}",
                    expires_at_ms=2**42, subjects=subjects, timeout_s=5.0,
                )  # fmt: skip
                await js.publish(subjects.ack("a1", f"req-{i}"), b"{}", timeout=5.0)
            kv = await js.key_value(REGISTRY_BUCKET)
            secret = (await kv.get("_broker.token_secret")).value

            # A broker with the default: the server reports three nodes, so R3, in place.
            async with Broker(_config(cluster.servers), metrics=Metrics()) as second:
                assert second.replicas == 3
                assert second.advisories.count.servers == 3  # every node answered CONNZ
            for name in STREAM_NAMES:
                await cluster.wait_stream_leader(nc, name, current=True)
                info = await js.stream_info(name)
                assert info.config.num_replicas == 3, name
                assert info.cluster is not None
                assert len(info.cluster.replicas or []) == 2, name  # + the leader
            assert (await js.stream_info(COMP_STREAM)).state.messages == 20
            assert (await js.stream_info(ACK_STREAM)).state.messages == 20
            assert (await kv.get("_broker.token_secret")).value == secret
        finally:
            await nc.close()


async def test_reach_dev_cluster_starts_in_the_background_and_stops(tmp_path: Path) -> None:
    root = tmp_path / "dc"
    env = {**os.environ, "REACH_CLUSTER_DIR": str(root)}
    reach = [sys.executable, "-m", "reach_broker.cli", "dev-cluster"]
    started = await asyncio.to_thread(
        subprocess.run, [*reach, "--nodes", "3", "--background"], capture_output=True,
        text=True, timeout=60, env=env,
    )  # fmt: skip
    try:
        assert started.returncode == 0, started.stderr
        line = json.loads(started.stdout)
        assert sorted(line) == ["dir", "pids", "urls"]
        assert (len(line["urls"]), len(line["pids"]), line["dir"]) == (3, 3, str(root))
        nc = await nats.connect(line["urls"], name="test-client")
        try:
            assert nc._server_info.get("cluster") == "reach"
        finally:
            await nc.close()
    finally:
        stopped = await asyncio.to_thread(
            subprocess.run, [*reach, "--stop"], capture_output=True, text=True, timeout=60,
            env=env,
        )  # fmt: skip
    assert stopped.returncode == 0, stopped.stderr
    assert "stopped pids" in stopped.stderr
    missing = await asyncio.to_thread(
        subprocess.run, [*reach, "--stop"], capture_output=True, text=True, timeout=60, env=env
    )
    assert missing.returncode == 1
    assert "no cluster recorded" in missing.stderr


async def test_a_stream_no_peer_can_take_is_no_peers_which_provisioning_retries(
    tmp_path: Path,
) -> None:
    """JetStream's "no suitable peers for placement" (10005; seen while a node is still
    joining) is NoPeers, a ProvisionTimeout: the broker tries again rather than failing."""
    async with nats_cluster(tmp_path / "cluster", nodes=3) as cluster:
        await cluster.wait_meta_leader()
        nc = await nats.connect(cluster.urls, name="test-client")
        try:
            # Placement on a tag no node carries: the server answers 10005 every time.
            cfg = {"name": "R3_PROBE", "subjects": ["r3probe.>"], "num_replicas": 3,
                   "placement": {"tags": ["nowhere"]}}  # fmt: skip
            with pytest.raises(NoPeers) as exc:
                await ensure_stream(nc, cfg)
            assert str(exc.value) == (
                "stream R3_PROBE: create failed: no suitable peers for placement, tags not "
                "matched ['nowhere']"
            )
            assert isinstance(exc.value, ProvisionTimeout)  # what the broker retries
        finally:
            await nc.close()


async def test_a_broker_starting_while_jetstream_has_no_quorum_waits_for_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A node restarted while the other two are down knows no meta leader: its JetStream
    API does not answer. A broker started on it tries again, each wait logged, and serves
    once a second node is back, rather than failing its start."""
    async with nats_cluster(tmp_path / "cluster", nodes=3) as cluster:
        await cluster.wait_meta_leader()
        for name in ("n2", "n3", "n1"):
            await cluster.kill(name)
        n1 = cluster.cluster.node("n1")
        await asyncio.to_thread(n1.spawn)
        await asyncio.to_thread(n1.wait_listening)
        caplog.set_level(logging.WARNING, logger="reach_broker.broker")
        broker = Broker(_config(cluster.url("n1")), metrics=Metrics())
        starting = asyncio.create_task(broker.start())
        try:

            def retries() -> list[str]:
                return [r.getMessage() for r in caplog.records
                        if r.getMessage().startswith("broker.jetstream_not_ready")]  # fmt: skip

            await wait_for(lambda: len(retries()) >= 2, 30, what="two retries")
            assert not starting.done()
            first = retries()[0]
            assert first == (
                "broker.jetstream_not_ready attempt=1 retry_in=0.5s error=ProvisionTimeout: "
                "JetStream API STREAM.INFO.REACH_ACKS: no answer within 5.0s"
            )
            await cluster.restart("n2")
            await asyncio.wait_for(asyncio.shield(starting), 40)
            assert broker.serving is True
            assert broker.jetstream_ok is True
            assert broker.not_ready() is None
        finally:
            if not starting.done():
                starting.cancel()
                await asyncio.gather(starting, return_exceptions=True)
            await broker.stop()


def test_jetstream_not_ready_is_a_503_or_no_answer_never_no_jetstream_or_a_refusal() -> None:
    """The errors the broker's start waits out: what JetStream says while it starts or
    elects. "Not enabled" and a refused change are answers, and fail (or degrade) at once."""
    unavailable = ServiceUnavailableError(
        code=503, err_code=10008, description="JetStream system temporarily unavailable"
    )
    assert jetstream_not_ready(unavailable) is True
    assert jetstream_not_ready(ServiceUnavailableError()) is True  # nats-py's "no responders"
    assert jetstream_not_ready(NatsTimeoutError()) is True
    assert jetstream_not_ready(NotReady("stream REACH_ACKS: info failed: ...")) is True
    assert jetstream_not_ready(NoPeers("stream REACH_ACKS: create failed: ...")) is True
    assert jetstream_not_ready(JetStreamUnavailable("not enabled")) is False
    assert jetstream_not_ready(UnsafeChange("stream REACH_ACKS: refusing ...")) is False
    assert jetstream_not_ready(ValueError("bad config")) is False


async def test_a_broker_started_with_a_node_down_keeps_every_asset_at_three_replicas(
    tmp_path: Path,
) -> None:
    """Nemesis seed 24: a broker started while one node of three was down counted two nodes
    and took every asset from R3 to R1 (logged at info only). A count worked out from the
    nodes answering never lowers a stream's now: the assets keep their three replicas."""
    async with nats_cluster(tmp_path / "cluster", nodes=3) as cluster:
        await cluster.wait_meta_leader()
        nc = await nats.connect(cluster.urls, name="test-client")
        try:
            js = nc.jetstream(timeout=5.0)
            async with Broker(_config(cluster.servers), metrics=Metrics()) as first:
                assert first.replicas == 3
            for name in STREAM_NAMES:
                await cluster.wait_stream_leader(nc, name, current=True)
            await cluster.kill("n3")
            await cluster.wait_meta_leader()
            two = f"{cluster.url('n1')},{cluster.url('n2')}"
            async with Broker(_config(two), metrics=Metrics()) as second:
                assert (second.replicas, second.serving) == (1, True)  # two nodes answer
            for name in STREAM_NAMES:
                assert (await js.stream_info(name)).config.num_replicas == 3, name
        finally:
            await nc.close()


async def test_a_raise_of_replicas_the_cluster_cannot_place_is_left_for_later(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Asked for three replicas where the cluster cannot place them now (nemesis seed 24: a
    node down; here a cluster of two, deterministically), the broker no longer fails its
    start: the streams keep what they have, it serves, and
    ``reach_jetstream_replicas_short{stream}`` says by how much (each logged at warning)."""
    async with nats_cluster(tmp_path / "cluster", nodes=2) as cluster:
        await cluster.wait_meta_leader()
        nc = await nats.connect(cluster.urls, name="test-client")
        try:
            js = nc.jetstream(timeout=5.0)
            async with Broker(_config(cluster.servers, jetstream__replicas=1),
                              metrics=Metrics()):  # fmt: skip
                pass
            caplog.set_level(logging.WARNING, logger="jetstream.provision")
            metrics = Metrics()
            async with Broker(_config(cluster.servers, jetstream__replicas=3),
                              metrics=metrics) as second:  # fmt: skip
                assert (second.replicas, second.serving) == (3, True)
                # The keeper's round tries the raise again: still short, said once only.
                outcomes = await second.keeper.keep()
                assert [o.short for o in outcomes] == [(1, 3)] * len(STREAM_NAMES)
                checks = metrics.replica_checks
                assert (checks.labels("short")._value.get(),
                        checks.labels("raised")._value.get()) == (len(STREAM_NAMES), 0)  # fmt: skip
            for name in STREAM_NAMES:
                assert metrics.replicas_short.labels(name)._value.get() == 2, name
                assert (await js.stream_info(name)).config.num_replicas == 1, name
            short = [r.getMessage() for r in caplog.records
                     if r.getMessage().startswith("jetstream.replicas_short")]  # fmt: skip
            assert len(short) == len(STREAM_NAMES)
            assert short[0] == (
                f"jetstream.replicas_short name={STREAM_NAMES[0]} replicas=1 wanted=3: no "
                "suitable peers for placement; the stream keeps 1 until the cluster can place "
                "them (tried again every 30s)"
            )
        finally:
            await nc.close()


async def test_a_running_broker_raises_streams_with_fewer_replicas_than_counted(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The replica keeper of a running broker raises every stream that has fewer replicas
    than it counts, in place and once: what brings a cluster first provisioned while a node
    was down (counted as two: R1 assets) to R3 once the node is back, and a stream left short
    once the cluster can place it, without a restart of the broker. Here the streams are R1
    (a broker told so) and a keeper counts three (configured, as a count of the nodes would
    once the third is back; a node killed just before the assets are first made can be given
    one of them by the server, which then waits for that node)."""
    async with nats_cluster(tmp_path / "cluster", nodes=3) as cluster:
        await cluster.wait_meta_leader()
        nc = await nats.connect(cluster.urls, name="test-client")
        try:
            js = nc.jetstream(timeout=5.0)
            metrics = Metrics()
            async with Broker(_config(cluster.servers, jetstream__replicas=1),
                              metrics=metrics) as broker:  # fmt: skip
                assert (broker.replicas, broker.serving) == (1, True)
                outcomes = await broker.keeper.keep()  # counts 1, as configured: nothing
                assert [o.action for o in outcomes] == ["unchanged"] * len(STREAM_NAMES)
                caplog.set_level(logging.INFO, logger="reach_broker.service.assets")
                # A keeper that counts three, on a short timer (the broker's rounds are 30 s
                # apart).
                keeper = ReplicaKeeper(
                    broker.nc, dataclasses.replace(broker.provisioning, replicas=3),
                    metrics.replicas_short, metrics.replica_checks, every_s=0.2,
                )  # fmt: skip
                await keeper.start()
                try:
                    raised = metrics.replica_checks.labels("raised")
                    await wait_for(lambda: raised._value.get() == len(STREAM_NAMES),
                                   timeout=30.0, what="every stream raised")  # fmt: skip
                finally:
                    await keeper.stop()
                for name in STREAM_NAMES:
                    assert (await js.stream_info(name)).config.num_replicas == 3, name
                    assert metrics.replicas_short.labels(name)._value.get() == 0, name
                outcomes = await keeper.keep()  # raised once: nothing more to do
                assert [o.action for o in outcomes] == ["unchanged"] * len(STREAM_NAMES)
                outcomes = await broker.keeper.keep()  # counting 1 lowers nothing
                assert [o.action for o in outcomes] == ["unchanged"] * len(STREAM_NAMES)
            said = [r.getMessage() for r in caplog.records
                    if r.getMessage().startswith("jetstream.replicas_raised")]  # fmt: skip
            assert said == [f"jetstream.replicas_raised name={name} replicas=3"
                            for name in STREAM_NAMES]  # fmt: skip
        finally:
            await nc.close()
