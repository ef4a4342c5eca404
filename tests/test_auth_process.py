"""Secured mode as a user runs it: `reach auth …`, `reach broker --auth DIR`, agent processes
with their credentials, `reach route`, revocation without a restart, TLS."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import urllib.request
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

import reach_agent

from .agents.procs import AgentProcess
from .auth_helpers import connect, violation
from .conftest import wait_for
from .test_broker_process import free_port
from .test_cli import reach

CAP = "text_processing"


class BrokerProcess:
    """`reach broker ARGS` on an embedded server: its URL, the server's PID, its output."""

    def __init__(self, proc: subprocess.Popen[str], lines: list[str]) -> None:
        self.proc = proc
        self.lines = lines
        text = "".join(lines)
        found = re.search(r"embedded nats-server listening on (\S+) \(pid (\d+)", text)
        assert found, text
        self.url, self.server_pid = found.group(1), int(found.group(2))

    @property
    def output(self) -> str:
        return "".join(self.lines)


@contextmanager
def broker_process(*args: str, metrics_port: int) -> Iterator[BrokerProcess]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NATS_", "REACH_"))}
    proc = subprocess.Popen(
        [sys.executable, "-m", "reach_broker.cli", "broker", "--port", "0",
         "--metrics-port", str(metrics_port), *args],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
    )  # fmt: skip
    lines: list[str] = []
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if "serving on" in line or "reach: cannot" in line:
                break
        yield BrokerProcess(proc, lines)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        if proc.stdout is not None:
            proc.stdout.close()


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        return str(r.read().decode())


async def agents(url: str, creds: Path, *extra: str) -> dict[str, str]:
    code, out, err = await reach("agents", "-s", url, "--creds", str(creds), "--json", *extra)
    assert code == 0, err
    return {v["agent_id"]: v["state"] for v in json.loads(out)}


def worker(url: str, agent_id: str, creds: Path, tmp: Path, *extra: str) -> AgentProcess:
    return AgentProcess("worker.py", url, agent_id, CAP, "--log", str(tmp / f"{agent_id}.log"),
                        "--creds", str(creds), *extra,
                        log_path=tmp / f"{agent_id}.err")  # fmt: skip


async def test_the_walk_through_of_the_docs(tmp_path: Path) -> None:
    """docs/operations.md, "Securing reach", step by step."""
    d = tmp_path / "auth"
    code, out, err = await reach("auth", "init", str(d))
    assert code == 0, err
    assert f"server config  {d}/server.conf" in out
    code, out, _ = await reach("auth", "agent", "alpha", "--dir", str(d))
    assert (code, out.strip()) == (0, f"{d}/agents/alpha.creds")
    code, out, _ = await reach("auth", "caller", "ops", "--dir", str(d))
    assert (code, out.strip()) == (0, f"{d}/callers/ops.creds")
    code, out, _ = await reach("auth", "init", str(d))  # an existing DIR is kept
    assert code == 2
    code, out, _ = await reach("auth", "list", "--dir", str(d), "--json")
    assert sorted((i["role"], i["name"]) for i in json.loads(out)) == [
        ("agent", "alpha"),
        ("broker", "broker"),
        ("caller", "ops"),
    ]
    port = free_port()
    with broker_process("--auth", str(d), metrics_port=port) as broker:
        assert "broker.open_mode" not in broker.output
        assert "reach_auth_enabled 1.0" in await asyncio.to_thread(scrape, port)
        alpha = worker(broker.url, "alpha", d / "agents/alpha.creds", tmp_path)
        try:
            ops = d / "callers/ops.creds"
            await wait_for_state(broker.url, ops, "alpha", "healthy")
            code, out, err = await reach("route", CAP, "-s", broker.url, "--creds", str(ops))
            assert code == 0, err
            # (the score moves with the probes' round trips: not asserted)
            assert re.search(
                rf"^1\s+alpha\s+healthy\s+\d+\.\d\s.*reach\.task\.alpha\.{CAP}$", out, re.M
            ), out
            code, out, err = await reach("call", CAP, '{"n": 5}', "-s", broker.url,
                                         "--creds", str(ops))  # fmt: skip
            assert (code, json.loads(out)) == (0, {"agent": "alpha", "n": 5}), err
            # Without credentials nothing gets in.
            code, _, err = await reach("route", CAP, "-s", broker.url)
            assert code == 3 and "authorization violation" in err
        finally:
            alpha.stop()


async def wait_for_state(url: str, creds: Path, agent_id: str, state: str) -> None:
    for _ in range(100):
        if (await agents(url, creds)).get(agent_id) == state:
            return
        await asyncio.sleep(0.1)
    raise AssertionError(f"{agent_id} not {state}: {await agents(url, creds)}")


async def test_a_caller_routes_calls_submits_and_waits_but_acts_for_no_agent(
    tmp_path: Path,
) -> None:
    d = tmp_path / "auth"
    assert (await reach("auth", "init", str(d)))[0] == 0
    for role, name in (("agent", "alpha"), ("caller", "ops")):
        assert (await reach("auth", role, name, "--dir", str(d)))[0] == 0
    ops = d / "callers/ops.creds"
    with broker_process("--auth", str(d), metrics_port=free_port()) as broker:
        alpha = worker(broker.url, "alpha", d / "agents/alpha.creds", tmp_path)
        try:
            await wait_for_state(broker.url, ops, "alpha", "healthy")
            async with reach_agent.Client(broker.url, creds=str(ops)) as client:
                [cand] = await client.route(CAP)
                assert (cand.agent_id, cand.state) == ("alpha", "healthy")
                rid = str(uuid.uuid4())
                assert await client.call(CAP, {"n": 1}, request_id=rid, timeout=10) == {
                    "agent": "alpha",
                    "n": 1,
                }
                assert (await client.wait(rid, 10)).state == "completed"
                queued = await client.submit(CAP, {"n": 2})
                done = await client.wait(queued, 20)
                assert (done.agent_id, done.state, done.result) == (
                    "alpha",
                    "completed",
                    {"agent": "alpha", "n": 2},
                )
            async with connect(broker.url, ops, "ops", "_INBOX.caller.ops") as (nc, errors):
                await nc.subscribe("reach.task.>")
                for subject in ("reach.hb.alpha", "reach.announce.alpha", "reach.leave.alpha",
                                "reach.event.state.alpha", "reach.ack.alpha.x"):  # fmt: skip
                    await nc.publish(subject, b"{}")
                for subject in ("reach.hb.alpha", "reach.announce.alpha", "reach.leave.alpha",
                                "reach.event.state.alpha", "reach.ack.alpha.x"):  # fmt: skip
                    await errors.wait(violation("publish", subject))
                await errors.wait(violation("subscription", "reach.task.>"))
            assert (await agents(broker.url, ops)) == {"alpha": "healthy"}
        finally:
            alpha.stop()


async def test_a_revoked_agent_is_refused_without_restarting_the_server(tmp_path: Path) -> None:
    d = tmp_path / "auth"
    assert (await reach("auth", "init", str(d)))[0] == 0
    for role, name in (("agent", "alpha"), ("agent", "beta"), ("caller", "ops")):
        assert (await reach("auth", role, name, "--dir", str(d)))[0] == 0
    ops = d / "callers/ops.creds"
    kept = tmp_path / "alpha-kept.creds"
    kept.write_bytes((d / "agents/alpha.creds").read_bytes())
    with broker_process("--auth", str(d), metrics_port=free_port()) as broker:
        alpha = worker(broker.url, "alpha", kept, tmp_path)
        beta = worker(broker.url, "beta", d / "agents/beta.creds", tmp_path)
        try:
            await wait_for_state(broker.url, ops, "alpha", "healthy")
            await wait_for_state(broker.url, ops, "beta", "healthy")
            code, out, err = await reach("auth", "revoke", "alpha", "--dir", str(d),
                                         "-s", broker.url)  # fmt: skip
            assert code == 0, err
            assert out.startswith("reach: revoked agent 'alpha' (key U")
            # The server closed alpha's connections (agent and ack writer) and refuses them:
            # the broker sees it gone at once, beta keeps working.
            await wait_for_state(broker.url, ops, "alpha", "offline")
            await wait_for(lambda: "agent.revoked agent=alpha" in alpha.output(), 10,
                           what="the agent logs its revocation")  # fmt: skip
            with pytest.raises(Exception, match="Authorization Violation"):
                async with connect(broker.url, kept, "alpha"):
                    pass
            assert (await agents(broker.url, ops))["beta"] == "healthy"
            code, out, _ = await reach("auth", "list", "--dir", str(d), "--json")
            revoked = [i for i in json.loads(out) if i["name"] == "alpha"]
            assert [i["revoked_at"] is not None for i in revoked] == [True]
            assert broker.proc.poll() is None
            assert os.kill(broker.server_pid, 0) is None  # the same server, never restarted
        finally:
            alpha.stop()
            beta.stop()


async def test_open_mode_says_so(tmp_path: Path) -> None:
    port = free_port()
    with broker_process("--store-dir", str(tmp_path / "js"), metrics_port=port) as broker:
        assert (
            "broker.open_mode: this NATS server lets anyone who can connect act for any "
            "agent" in broker.output
        )
        assert "reach_auth_enabled 0.0" in await asyncio.to_thread(scrape, port)


async def test_tls_refuses_plaintext_and_works_with_the_ca(tmp_path: Path) -> None:
    pytest.importorskip("cryptography")
    d = tmp_path / "auth"
    code, out, err = await reach("auth", "init", str(d), "--tls")
    assert code == 0, err
    assert f"CA             {d}/tls/ca.pem" in out
    for role, name in (("agent", "alpha"), ("caller", "ops")):
        assert (await reach("auth", role, name, "--dir", str(d)))[0] == 0
    ca = d / "tls/ca.pem"
    with broker_process("--auth", str(d), metrics_port=free_port()) as broker:
        assert broker.url.startswith("tls://127.0.0.1:")
        port = int(broker.url.rsplit(":", 1)[1])
        reader, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), 5)
        try:
            info = await asyncio.wait_for(reader.readline(), 5)
            assert json.loads(info[5:])["tls_required"] is True
            writer.write(b'CONNECT {"verbose":false}\r\nPING\r\n')
            await writer.drain()
            assert b"PONG" not in await asyncio.wait_for(reader.read(), 5)  # hung up
        finally:
            writer.close()
            await writer.wait_closed()
        agent = reach_agent.Agent("alpha", [CAP], heartbeat_interval=0.1,
                                  creds=str(d / "agents/alpha.creds"), tls_ca=str(ca))  # fmt: skip
        agent.handler(CAP)(lambda task: {"tls": True})
        await asyncio.wait_for(agent.start(broker.url), 20)
        try:
            ops = d / "callers/ops.creds"
            for _ in range(100):
                code, out, err = await reach("agents", "-s", broker.url, "--creds", str(ops),
                                             "--tls-ca", str(ca), "--json")  # fmt: skip
                assert code == 0, err
                if [v["state"] for v in json.loads(out)] == ["healthy"]:
                    break
                await asyncio.sleep(0.1)
            async with reach_agent.Client(broker.url, creds=str(ops), tls_ca=str(ca)) as c:
                assert await c.call(CAP, {}, timeout=10) == {"tls": True}
            code, _, err = await reach("agents", "-s", broker.url, "--creds", str(ops))
            assert code == 3, err  # no CA: the handshake fails
        finally:
            await asyncio.wait_for(agent.stop(grace=2), 20)
