"""``reach demo`` beyond its happy path: next to a running broker, under another prefix, and
the failover it shows when one of its agents is killed."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import signal
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from reach_broker.cli.demo import child_commands
from reach_broker.cluster.natsserver import NatsServer

from .conftest import BrokerFactory
from .test_broker_process import gone
from .test_cli import CLI, DEMO_PIDS, cli_env, reach

pytestmark = pytest.mark.slow


def fetch(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=5) as r:
        return bytes(r.read())


def remove_logs(out: str) -> None:
    """A failed demo keeps its logs (and says where): a test must not leave them behind."""
    for line in out.splitlines():
        record = json.loads(line)
        if record.get("event") == "started":
            shutil.rmtree(record["logs"], ignore_errors=True)


async def records(proc: asyncio.subprocess.Process) -> Any:
    """The demo's JSON records, one at a time (each read bounded)."""
    assert proc.stdout is not None
    while line := await asyncio.wait_for(proc.stdout.readline(), 60):
        yield json.loads(line)


async def next_event(stream: Any, event: str) -> dict[str, Any]:
    async for record in stream:
        if record.get("event") == event:
            return dict(record)
    raise AssertionError(f"the demo ended before {event}")


async def test_demo_next_to_a_running_broker_starts_its_own_first(
    nats_server: NatsServer, broker_factory: BrokerFactory
) -> None:
    """Another broker already on the bus must not count as the demo's being ready: its
    agents would announce before the demo's broker listens, and half the routes fail."""
    other = await broker_factory()
    code, out, err = await reach("demo", "--server", nats_server.url, "--duration", "4",
                                 "--rate", "8", "--json", "--no-view", limit_s=120)  # fmt: skip
    remove_logs(out)
    assert code == 0, err
    started, ready, stopped = (json.loads(line) for line in out.splitlines())
    assert started["broker_id"].startswith("demo-") and started["broker_id"] != other.broker_id
    assert set(started["pids"]) == DEMO_PIDS - {"nats-server"}
    assert ready["event"] == "ready"
    assert (stopped["reason"], stopped["calls"]["failed"]) == ("duration", {})
    assert stopped["calls"]["ok"] >= 8
    assert [n for n, pid in started["pids"].items() if not gone(pid)] == []


async def test_demo_under_another_prefix() -> None:
    code, out, err = await reach("demo", "--prefix", "demo2", "--duration", "3", "--rate", "5",
                                 "--json", "--no-view", limit_s=120)  # fmt: skip
    remove_logs(out)
    assert code == 0, err
    stopped = json.loads(out.splitlines()[-1])
    assert (stopped["reason"], stopped["calls"]["failed"]) == ("duration", {})
    assert stopped["calls"]["ok"] >= 5


def test_the_prefix_and_credentials_reach_every_child(tmp_path: Path) -> None:
    creds = str(tmp_path / "user.creds")
    args = argparse.Namespace(creds=creds, log_format="json")
    argv, env = child_commands(args, "nats://127.0.0.1:4333", "demo2", "demo-1-ab", 19464)
    assert argv[argv.index("broker") :] == [
        "broker", "--server", "nats://127.0.0.1:4333", "--metrics-port", "19464",
        "--metrics-host", "127.0.0.1", "--log-format", "json", "--prefix", "demo2",
        "--broker-id", "demo-1-ab", "--creds", creds,
    ]  # fmt: skip
    assert (env["NATS_URL"], env["REACH_PREFIX"], env["NATS_CREDS"]) == (
        "nats://127.0.0.1:4333", "demo2", creds)  # fmt: skip
    argv, env = child_commands(argparse.Namespace(creds=None, log_format="text"), "u", "r", "b",
                               19464)  # fmt: skip
    assert "--creds" not in argv
    assert env.get("NATS_CREDS") == os.environ.get("NATS_CREDS")
    ca = str(tmp_path / "ca.pem")
    argv, env = child_commands(argparse.Namespace(creds=None, tls_ca=ca, log_format="text"),
                               "u", "r", "b", 19464)  # fmt: skip
    assert (argv[-2:], env["NATS_CA"]) == (["--tls-ca", ca], ca)


async def test_the_demo_runs_the_secure_way() -> None:
    """`reach demo --auth`: an operator-mode server, a credential per process, calls as a
    caller; every call served, nothing refused."""
    code, out, err = await reach("demo", "--auth", "--duration", "4", "--rate", "5", "--json",
                                 "--no-view", limit_s=120)  # fmt: skip
    remove_logs(out)
    assert code == 0, err
    stopped = json.loads(out.splitlines()[-1])
    assert (stopped["reason"], stopped["calls"]["failed"]) == ("duration", {})
    assert stopped["calls"]["ok"] >= 5
    assert "permission denied" not in err and "broker.open_mode" not in err


async def test_a_killed_demo_agent_is_restarted_and_the_logs_are_kept() -> None:
    proc = await asyncio.create_subprocess_exec(
        *CLI, "demo", "--json", "--no-view", "--rate", "5",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=cli_env(),
    )  # fmt: skip
    stream = records(proc)
    started: dict[str, Any] = {}
    try:
        started = await next_event(stream, "started")
        await next_event(stream, "ready")
        url, beta = started["nats_url"], started["pids"]["beta"]
        # The broker's console is up where the demo says, showing the three agents.
        assert re.fullmatch(r"http://127\.0\.0\.1:\d+/", started["console"]), started
        fleet = json.loads(await asyncio.to_thread(fetch, started["console"] + "api/fleet"))
        assert sorted(a["agent_id"] for a in fleet["agents"]) == ["alpha", "beta", "gamma"]
        os.kill(beta, signal.SIGKILL)
        exited = await next_event(stream, "exited")
        assert exited == {"event": "exited", "name": "beta", "code": -9, "restart_in_s": 3.0}
        restarted = await next_event(stream, "restarted")
        assert restarted["name"] == "beta" and restarted["pid"] != beta
        # The fleet shows the failover: beta left the healthy set, then came back.
        deadline = time.monotonic() + 60
        while True:
            assert time.monotonic() < deadline, "beta never healthy again"
            code, out, _ = await reach("agents", "--json", "-s", url)
            states = {v["agent_id"]: v["state"] for v in json.loads(out)} if code == 0 else {}
            if states.get("beta") == "healthy":
                break
            await asyncio.sleep(0.2)
        code, out, _ = await reach("events", "--since", "5m", "--json", "-s", url)
        moves = [(e["from"], e["to"]) for e in map(json.loads, out.splitlines())
                 if e["agent_id"] == "beta" and e["kind"] == "state"]  # fmt: skip
        assert any(to in ("suspect", "offline") for _, to in moves), moves
        proc.send_signal(signal.SIGINT)
        stopped = await next_event(stream, "stopped")
        assert (stopped["reason"], stopped["restarts"]) == ("signal", {"beta": 1})
        assert stopped["pids"]["beta"] == restarted["pid"]
        assert stopped["calls"]["ok"] >= 1
        _, err = await asyncio.wait_for(proc.communicate(), 60)
        assert proc.returncode == 0
        logs = Path(started["logs"])
        assert err.decode().splitlines()[-1] == f"reach demo: logs kept in {logs}"
        # beta's log holds both lives (appended, not replaced).
        assert (logs / "beta.log").read_text().count("agent.started") == 2
        for name, pid in stopped["pids"].items():
            assert gone(pid), name
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        if started:
            shutil.rmtree(started["logs"], ignore_errors=True)
