"""`reach broker` as a user runs it: a process with its embedded nats-server."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import nats
import pytest

from .conftest import wait_for


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def broker_process(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[str], str, int]]:
    """`reach broker` with an embedded server on a free port; yields (proc, url, metrics)."""
    metrics_port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "NATS_URL"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "reach_broker.cli", "broker", "--port", "0",
         "--metrics-port", str(metrics_port), "--store-dir", str(tmp_path / "js")],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
    )  # fmt: skip
    try:
        url = None
        assert proc.stdout is not None
        lines = []
        for line in proc.stdout:
            lines.append(line)
            match = re.search(r"embedded nats-server listening on (nats://\S+)", line)
            if match:
                url = match.group(1)
            if "serving on" in line:
                break
        assert url, "".join(lines)
        yield proc, url, metrics_port
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            proc.wait(10)
        if proc.stdout is not None:
            proc.stdout.close()


async def test_reach_broker_serves_routes_on_embedded_server(
    broker_process: tuple[subprocess.Popen[str], str, int],
) -> None:
    proc, url, metrics_port = broker_process
    nc = await nats.connect(url)
    try:
        body = {"agent_id": "solo", "capabilities": ["text_processing"], "max_concurrency": 2,
                "heartbeat_interval_ms": 1000}  # fmt: skip
        reply = await nc.request("reach.announce.solo", json.dumps(body).encode(), 5)
        ack = json.loads(reply.data)
        hb = {"agent_id": "solo", "token": ack["token"], "seq": 1}
        await nc.publish("reach.hb.solo", json.dumps(hb).encode())
        reply = await nc.request("reach.route.text_processing", b"", timeout=5)
        assert [c["agent_id"] for c in json.loads(reply.data)["candidates"]] == ["solo"]
    finally:
        await nc.close()

    def scrape() -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5) as r:
            return str(r.read().decode())

    text = await asyncio.to_thread(scrape)
    assert 'reach_route_requests_total{result="ok"} 1.0' in text
    assert 'reach_announces_total{result="ok"} 1.0' in text
    assert 'reach_agents{state="healthy"} 1.0' in text
    await wait_for(lambda: 'reach_heartbeats_total{result="accepted"} 1.0' in scrape(), 5)

    # SIGTERM: a clean exit, and the embedded server is gone with it.
    proc.send_signal(signal.SIGTERM)
    assert await asyncio.to_thread(proc.wait, 15) == 0
    with pytest.raises(OSError):
        host, port = url.removeprefix("nats://").split(":")
        socket.create_connection((host, int(port)), timeout=1).close()


def test_missing_nats_server_binary_is_a_clear_error(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "NATS_URL"}
    env["REACH_NATS_SERVER"] = str(tmp_path / "no-such-nats-server")
    out = subprocess.run(
        [sys.executable, "-m", "reach_broker.cli", "broker", "--port", "0", "--metrics-port", "0"],
        capture_output=True, text=True, env=env, timeout=30,
    )  # fmt: skip
    assert out.returncode == 3
    assert "Traceback" not in out.stderr
    assert "REACH_NATS_SERVER" in out.stderr and "not an executable file" in out.stderr


def test_ctrl_c_to_the_terminal_group_stops_broker_then_server(tmp_path: Path) -> None:
    """A terminal Ctrl-C signals the whole foreground group: the server must not die first."""
    env = {k: v for k, v in os.environ.items() if k != "NATS_URL"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "reach_broker.cli", "broker", "--port", "0", "--metrics-port", "0",
         "--store-dir", str(tmp_path / "js")],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
        start_new_session=True,  # its own group, as a shell's foreground job
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if "serving on" in line:
                break
        url = re.search(r"listening on (nats://\S+)", "".join(lines))
        assert url, "".join(lines)
        os.killpg(proc.pid, signal.SIGINT)
        out, _ = proc.communicate(timeout=20)
        assert proc.returncode == 0, out
        assert "Traceback" not in out
        assert "nats_error" not in out and "nats_disconnected" not in out, out
        host, port = url.group(1).removeprefix("nats://").split(":")
        with pytest.raises(OSError):
            socket.create_connection((host, int(port)), timeout=1).close()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        if proc.stdout is not None:
            proc.stdout.close()


def test_busy_metrics_port_is_a_clear_error_and_stops_the_embedded_server(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "NATS_URL"}
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        out = subprocess.run(
            [sys.executable, "-m", "reach_broker", "broker", "--port", "0",
             "--metrics-port", str(port), "--store-dir", str(tmp_path / "js")],
            capture_output=True, text=True, env=env, timeout=30,
        )  # fmt: skip
    assert out.returncode == 3, out.stderr
    assert "Traceback" not in out.stderr
    assert out.stderr.splitlines()[-1] == (
        f"reach: metrics port {port}: Address already in use "
        "(choose another with --metrics-port, 0 turns it off)"
    )
    url = re.search(r"embedded nats-server listening on (nats://\S+)", out.stdout)
    assert url, out.stdout
    host, nats_port = url.group(1).removeprefix("nats://").split(":")
    with pytest.raises(OSError):
        socket.create_connection((host, int(nats_port)), timeout=1).close()
