"""Replicated assets on a real three-node cluster: a broker provisions R3 by default, and
moves assets it finds at R1 to R3 in place, keeping every message."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import nats
import pytest

from jetstream import compensation
from jetstream.names import ACK_STREAM, COMP_STREAM, REGISTRY_BUCKET, STREAM_NAMES
from jetstream.provision import NoPeers, ProvisionTimeout, ensure_stream
from reach_agent.wire.subjects import Subjects
from reach_broker.broker import Broker
from reach_broker.config import Config
from reach_broker.service.metrics import Metrics

from .cluster import nats_cluster
from .conftest import fast_config

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
                assert second.advisories.servers == 3  # every node answered CONNZ
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
