"""``/healthz`` and ``/readyz`` as an orchestrator probes them: the broker's HTTP port, the
HTTP sidecar's ``--health-port`` and ``reach mcp --http``. Before NATS is reachable
``/readyz`` is 503 with the reason as JSON, once it serves 200; ``/healthz`` is 200 all along.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from reach_broker import process
from reach_broker.broker import Broker
from reach_broker.cluster.natsserver import NatsServer
from reach_broker.service.metrics import Metrics

from .conftest import fast_config
from .test_broker_process import free_port
from .test_cli import CLI, cli_env

ROOT = Path(__file__).resolve().parent.parent


async def probe(port: int, path: str) -> tuple[int, dict[str, Any]]:
    """GET ``path`` on loopback ``port``: (status, the JSON body); (0, {}) when refused."""
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), 5)
    except OSError:
        return 0, {}
    writer.write(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n".encode())
    data = await asyncio.wait_for(reader.read(), 5)
    writer.close()
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    assert "content-type: application/json" in (line.lower() for line in lines), head
    return int(lines[0].split()[1]), json.loads(body)


async def becomes(port: int, path: str, status: int, body: dict[str, Any]) -> None:
    """Wait (20 s at most) until ``path`` answers ``status`` with ``body``."""
    seen: list[tuple[int, dict[str, Any]]] = []
    deadline = asyncio.get_running_loop().time() + 20.0
    while (got := await probe(port, path)) != (status, body):
        seen.append(got)
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"{path} never answered {status} {body}: last {seen[-3:]}")
        await asyncio.sleep(0.05)


async def test_the_brokers_readyz_is_503_until_nats_is_reachable(tmp_path: Path) -> None:
    nats_port, http_port = free_port(), free_port()
    cfg = fast_config(f"nats://127.0.0.1:{nats_port}")
    cfg.broker.metrics_port = http_port
    stop = asyncio.Event()
    serving = asyncio.ensure_future(process.serve(cfg, stop=stop))
    server = NatsServer(port=nats_port, store_dir=tmp_path / "js")
    try:
        await becomes(http_port, "/healthz", 200, {"status": "ok"})
        assert await probe(http_port, "/readyz") == (503, {
            "ready": False,
            "reason": f"not connected to NATS yet (connecting to nats://127.0.0.1:{nats_port})",
        })  # fmt: skip
        await asyncio.to_thread(server.start)
        await becomes(http_port, "/readyz", 200, {"ready": True})
        await asyncio.to_thread(server.stop)
        await becomes(http_port, "/readyz", 503, {
            "ready": False,
            "reason": f"disconnected from NATS (reconnecting to nats://127.0.0.1:{nats_port})",
        })  # fmt: skip
        assert await probe(http_port, "/healthz") == (200, {"status": "ok"})
    finally:
        stop.set()
        await asyncio.to_thread(server.stop)
        # The broker's own outcome, without hiding a failure above (a broker stopped before
        # it ever connected ends with StartError, which would replace the assertion that says
        # why).
        (ended,) = await asyncio.wait_for(asyncio.gather(serving, return_exceptions=True), 20)
    assert ended is None


async def test_a_server_without_jetstream_is_not_ready(tmp_path: Path) -> None:
    bare = tmp_path / "bare.conf"
    bare.write_text("# no jetstream block: the server runs without JetStream\n")
    server = NatsServer(port=0, config=bare, config_store=True, store_dir=tmp_path / "js")
    await asyncio.to_thread(server.start)
    try:
        http_port = free_port()
        cfg = fast_config(server.url)
        cfg.broker.metrics_port = http_port
        stop = asyncio.Event()
        serving = asyncio.ensure_future(process.serve(cfg, stop=stop))
        try:
            await becomes(http_port, "/readyz", 503, {"ready": False, "reason": (
                "the NATS server has no JetStream: no claims, durable acks or compensation "
                "replay (start nats-server with -js)")})  # fmt: skip
        finally:
            stop.set()
            await asyncio.wait_for(serving, 20)
    finally:
        await asyncio.to_thread(server.stop)


@pytest.fixture
async def adapter_proc(
    tmp_path: Path,
) -> AsyncIterator[tuple[asyncio.subprocess.Process, int, int]]:
    """``reach adapt http --health-port`` against a NATS port nothing listens on yet; yields
    (the process, that NATS port, the probe port)."""
    nats_port, health_port = free_port(), free_port()
    proc = await asyncio.create_subprocess_exec(
        *CLI, "adapt", "http", "-s", f"nats://127.0.0.1:{nats_port}", "--agent-id", "side",
        "--capability", "llm.chat", "--url", "http://127.0.0.1:9/", "--interval", "0.2",
        "--health-port", str(health_port),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
        env={**cli_env(), "REACH_ACK_DIR": str(tmp_path / "acks")},
    )  # fmt: skip
    try:
        yield proc, nats_port, health_port
    finally:
        if proc.returncode is None:
            proc.terminate()
        try:
            await asyncio.wait_for(proc.communicate(), 20)
        except TimeoutError:
            proc.kill()
            await proc.wait()


async def test_the_http_sidecar_answers_probes(
    adapter_proc: tuple[asyncio.subprocess.Process, int, int], tmp_path: Path
) -> None:
    pytest.importorskip("httpx", reason="pip install -e '.[dev]' (nats-reach[http])")
    proc, nats_port, health_port = adapter_proc
    assert proc.stdout is not None
    line = await asyncio.wait_for(proc.stdout.readline(), 20)
    assert line.decode() == f"probes on http://127.0.0.1:{health_port}/healthz and /readyz\n"
    assert await probe(health_port, "/healthz") == (200, {"status": "ok"})
    assert await probe(health_port, "/readyz") == (
        503,
        {"ready": False, "reason": "not connected to NATS"},
    )
    server = NatsServer(port=nats_port, store_dir=tmp_path / "js")
    await asyncio.to_thread(server.start)
    broker = Broker(fast_config(server.url), metrics=Metrics())
    try:
        await becomes(health_port, "/readyz", 503, {
            "ready": False, "reason": "announced, but no broker has answered yet"
        })  # fmt: skip
        await broker.start()
        await becomes(health_port, "/readyz", 200, {"ready": True})
    finally:
        await broker.stop()
        proc.terminate()
        await asyncio.wait_for(proc.wait(), 20)
        await asyncio.to_thread(server.stop)


async def test_reach_mcp_http_answers_probes(nats_server: NatsServer) -> None:
    pytest.importorskip("mcp.server", reason="needs the extra 'mcp'")
    port = free_port()
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "reach_broker", "mcp", "--server", nats_server.url,
        "--http", str(port),
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    try:
        await becomes(port, "/readyz", 200, {"ready": True})
        assert await probe(port, "/healthz") == (200, {"status": "ok"})
        await asyncio.to_thread(nats_server.stop)
        await becomes(port, "/readyz", 503, {
            "ready": False, "reason": "not connected to NATS (reconnecting)"
        })  # fmt: skip
        assert await probe(port, "/healthz") == (200, {"status": "ok"})
    finally:
        proc.terminate()
        try:
            await asyncio.wait_for(proc.communicate(), 20)
        except TimeoutError:
            proc.kill()
            await proc.wait()
