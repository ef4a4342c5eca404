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
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import nats
import pytest

from reach_broker.cluster.natsserver import NatsServer, NatsServerError

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
        [sys.executable, "-m", "reach_broker.cli", "broker", "--port", "0", "--metrics-port", "0",
         "--ephemeral"],
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


# --- the embedded server dies with its broker, however the broker ends -----------------------

READY = re.compile(r"listening on (nats://\S+) \(pid (\d+), JetStream store (\S+?): ([^;)]+)")


def gone(pid: int) -> bool:
    """No such process, or only its zombie (an orphan whose new parent has not reaped it)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] == "Z"


def wait_gone(pid: int, limit_s: float = 15.0) -> None:
    deadline = time.monotonic() + limit_s
    while not gone(pid):
        assert time.monotonic() < deadline, f"pid {pid} still running after {limit_s} s"
        time.sleep(0.02)


def refused(url: str) -> bool:
    host, port = url.removeprefix("nats://").split(":")
    try:
        socket.create_connection((host, int(port)), timeout=1).close()
    except OSError:
        return True
    return False


def read_until(stream: Any, needle: str, limit_s: float = 30.0) -> str:
    """Lines of a text pipe until one contains ``needle`` (blocking reads in a thread)."""
    seen: list[str] = []

    def read() -> None:
        for line in stream:
            seen.append(line)
            if needle in line:
                return

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(limit_s)
    assert not reader.is_alive() and needle in "".join(seen), "".join(seen)
    return "".join(seen)


def broker_argv(*extra: str) -> list[str]:
    """``reach broker`` with a throwaway store (``--ephemeral``), unless ``extra`` names one."""
    store = [] if "--store-dir" in extra else ["--ephemeral"]
    return [sys.executable, "-m", "reach_broker", "broker", "--metrics-port", "0", *store, *extra]


def clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k != "NATS_URL"}


def test_sigkill_of_the_broker_takes_its_server_along_and_the_next_start_cleans_up() -> None:
    proc = subprocess.Popen(broker_argv("--port", "0"), stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True, env=clean_env())  # fmt: skip
    try:
        assert proc.stdout is not None
        ready = READY.search(read_until(proc.stdout, "serving on"))
        assert ready, "the broker names its server's URL, PID and store"
        url, server_pid, store = ready.group(1), int(ready.group(2)), Path(ready.group(3))
        assert store.name.startswith(f"reach-nats-{proc.pid}-")
        assert ready.group(4) == "a throwaway temp dir, removed at exit"
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        wait_gone(server_pid)
        assert refused(url)
        assert store.is_dir(), "nobody was left to remove it"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        if proc.stdout is not None:
            proc.stdout.close()
    # The next start of any embedded server removes the store dirs of dead owners.
    with NatsServer(port=0) as server:
        assert server.store_dir is not None and server.store_dir.is_dir()
        assert not store.exists()


def test_closing_the_terminal_stops_broker_and_server_in_order() -> None:
    """SIGHUP from a real terminal hang-up: a clean stop, the temp store removed."""
    import fcntl
    import pty
    import select
    import termios

    master, slave = pty.openpty()

    def take_terminal() -> None:  # the pty becomes the session's controlling terminal
        fcntl.ioctl(0, termios.TIOCSCTTY, 0)

    proc = subprocess.Popen(broker_argv("--port", "0"), stdin=slave, stdout=slave, stderr=slave,
                            start_new_session=True, preexec_fn=take_terminal,
                            env=clean_env())  # fmt: skip
    os.close(slave)
    try:
        out = b""
        deadline = time.monotonic() + 30
        while b"serving on" not in out:
            assert time.monotonic() < deadline, out.decode(errors="replace")
            ready, _, _ = select.select([master], [], [], 0.2)
            if ready:
                out += os.read(master, 65536)
        match = READY.search(out.decode(errors="replace"))
        assert match, out
        url, server_pid, store = match.group(1), int(match.group(2)), Path(match.group(3))
        os.close(master)  # the terminal window closes: the kernel sends SIGHUP
        master = -1
        assert proc.wait(20) == 0
        wait_gone(server_pid)
        assert refused(url)
        assert not store.exists()
    finally:
        if master >= 0:
            os.close(master)
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def test_a_second_broker_on_a_busy_port_is_one_line(
    broker_process: tuple[subprocess.Popen[str], str, int],
) -> None:
    _, url, _ = broker_process
    port = url.rsplit(":", 1)[1]
    out = subprocess.run(broker_argv("--port", port), capture_output=True, text=True,
                         env=clean_env(), timeout=30)  # fmt: skip
    assert out.returncode == 3
    assert out.stdout == ""
    assert out.stderr == (
        f"reach: port {port} is already in use (another `reach broker` or nats-server?): stop "
        "that one, choose another port with --port (0: any free port), or use the running "
        f"server with --server nats://127.0.0.1:{port}\n"
    )


OWNER = """
import sys, threading, time
from reach_broker.cluster.natsserver import NatsServer
server = NatsServer(port=0, guard=sys.argv[1])
if sys.argv[2] == "thread":  # started from a thread that then ends
    worker = threading.Thread(target=server.start)
    worker.start()
    worker.join()
else:
    server.start()
print(server.pid, server.url, flush=True)
time.sleep(120)
"""


@pytest.mark.parametrize("guard", ["watchdog", "pdeathsig"])
def test_a_killed_owner_takes_its_server_along(guard: str) -> None:
    owner = subprocess.Popen([sys.executable, "-c", OWNER, guard, "main"],
                             stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert owner.stdout is not None
        pid, url = read_until(owner.stdout, "nats://").split()
        assert not refused(url)
        owner.send_signal(signal.SIGKILL)
        owner.wait(10)
        wait_gone(int(pid))
        assert refused(url)
    finally:
        if owner.poll() is None:
            owner.kill()
            owner.wait(10)
        if owner.stdout is not None:
            owner.stdout.close()


def test_a_server_started_from_a_short_lived_thread_outlives_the_thread() -> None:
    """PR_SET_PDEATHSIG fires when the forking *thread* ends: the fork must not happen on a
    worker thread (asyncio.to_thread) that may end before the process does."""
    owner = subprocess.Popen([sys.executable, "-c", OWNER, "pdeathsig", "thread"],
                             stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert owner.stdout is not None
        pid, url = read_until(owner.stdout, "nats://").split()
        # A SIGTERM at the thread's end would stop the server within milliseconds.
        time.sleep(1.0)
        assert not gone(int(pid))
        assert not refused(url)
        owner.send_signal(signal.SIGKILL)
        owner.wait(10)
        wait_gone(int(pid))
    finally:
        if owner.poll() is None:
            owner.kill()
            owner.wait(10)
        if owner.stdout is not None:
            owner.stdout.close()


def test_forks_from_worker_threads_happen_on_the_one_spawner_thread() -> None:
    from reach_broker.cluster import lifeline

    where: list[str] = []

    def fork() -> Any:
        where.append(threading.current_thread().name)
        return None

    lifeline._on_long_lived_thread(fork)
    worker = threading.Thread(target=lifeline._on_long_lived_thread, args=(fork,), name="w")
    worker.start()
    worker.join(10)
    assert where[0] == "MainThread"
    assert where[1].startswith("reach-spawner")


def test_system_account_password_is_per_start_unless_set(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import asyncio

    from nats.aio.client import Client as NATS
    from nats.errors import Error as NatsError

    async def login(url: str, password: str) -> bool:
        nc = NATS()
        try:
            await nc.connect(url, user="sys", password=password, allow_reconnect=False,
                             max_reconnect_attempts=1, connect_timeout=2)  # fmt: skip
        except (NatsError, OSError):
            return False
        finally:
            await nc.close()
        return True

    monkeypatch.delenv("REACH_NATS_SYSTEM_PASSWORD", raising=False)
    with NatsServer(port=0) as one, NatsServer(port=0) as two:
        assert one.system_password and two.system_password
        assert one.system_password != two.system_password
        assert asyncio.run(login(one.url, one.system_password))
        assert not asyncio.run(login(one.url, "sys"))
    monkeypatch.setenv("REACH_NATS_SYSTEM_PASSWORD", "chosen-by-the-operator")
    with NatsServer(port=0) as three:
        assert three.system_password == "chosen-by-the-operator"
        assert asyncio.run(login(three.url, "chosen-by-the-operator"))
    monkeypatch.setenv("REACH_NATS_SYSTEM_PASSWORD", "short")
    with pytest.raises(NatsServerError, match="REACH_NATS_SYSTEM_PASSWORD must be at least 12"):
        NatsServer(port=0).start()


# --- durable by default: the store outlives the broker ------------------------------------


def default_env() -> dict[str, str]:
    """The environment of a user who set nothing: no server, no store options."""
    drop = ("NATS_URL", "REACH_STORE_DIR", "REACH_EPHEMERAL")
    return {k: v for k, v in os.environ.items() if k not in drop}


def start_default_broker(cwd: Path) -> tuple[subprocess.Popen[str], str, Path, str]:
    """`reach broker` with default settings, run in ``cwd``: (proc, url, store, kept)."""
    argv = [sys.executable, "-m", "reach_broker", "broker", "--metrics-port", "0", "--port", "0"]
    proc = subprocess.Popen(argv, cwd=cwd,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            env=default_env())  # fmt: skip
    assert proc.stdout is not None
    ready = READY.search(read_until(proc.stdout, "serving on"))
    assert ready, "the broker names its server's URL, PID and store"
    return proc, ready.group(1), Path(ready.group(3)), ready.group(4)


def stop_broker(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    if proc.stdout is not None:
        proc.stdout.close()


def serving(agent_id: str, capability: str, runs: list[str]) -> Any:
    import reach_agent

    agent = reach_agent.Agent(agent_id, [capability], heartbeat_interval=0.2)

    @agent.handler(capability)
    async def handle(task: reach_agent.Task) -> dict[str, Any]:
        runs.append(task.request_id)
        return {"by": agent_id, "n": task.payload["n"]}

    return agent


async def test_a_broker_restarted_with_default_settings_keeps_acks_and_queued_entries(
    tmp_path: Path,
) -> None:
    import reach_agent

    work = tmp_path / "work"
    work.mkdir()
    runs: list[str] = []
    proc, url, store, kept = start_default_broker(work)
    try:
        assert (store, kept) == (work / "reach-data", "kept across restarts")
        keeper = serving("keeper", "keep", runs)
        async with keeper.serve(url), reach_agent.Client(url) as client:
            acked = await client.call("keep", {"n": 1}, timeout=20)
            assert acked == {"by": "keeper", "n": 1}
            rid = runs[0]
            assert (await client.wait(rid, timeout=10)).state == "completed"  # stored
            queued = await client.submit("later", {"n": 2})
    finally:
        stop_broker(proc)
    assert (store / "jetstream").is_dir()

    proc, url, store_again, _ = start_default_broker(work)
    try:
        assert store_again == store
        out = await asyncio.to_thread(
            subprocess.run, [sys.executable, "-m", "reach_broker", "ack", rid, "--json",
                             "--server", url], capture_output=True, text=True, timeout=60,
            env=default_env(),
        )  # fmt: skip
        assert out.returncode == 0, out.stderr
        record = json.loads(out.stdout)
        assert (record["request_id"], record["state"], record["agent_id"]) == (
            rid, "completed", "keeper")  # fmt: skip
        assert record["result"] == {"by": "keeper", "n": 1}
        later = serving("later-a", "later", runs)
        async with later.serve(url), reach_agent.Client(url) as client:
            done = await client.wait(queued, timeout=30)  # replayed after the restart
        assert (done.state, done.agent_id, done.result) == ("completed", "later-a",
                                                            {"by": "later-a", "n": 2})  # fmt: skip
    finally:
        stop_broker(proc)
    assert runs == [rid, queued]


def test_a_second_broker_on_the_same_store_is_one_line(tmp_path: Path) -> None:
    store = tmp_path / "shared"
    first = subprocess.Popen(broker_argv("--port", "0", "--store-dir", str(store)),
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                             env=clean_env())  # fmt: skip
    try:
        assert first.stdout is not None
        read_until(first.stdout, "serving on")
        second = broker_argv("--port", "0", "--store-dir", str(store))
        out = subprocess.run(second, capture_output=True, text=True, env=clean_env(), timeout=30)
        assert out.returncode == 3
        assert out.stderr == (
            f"reach: JetStream store {store} is in use by another embedded nats-server (pid "
            f"{first.pid}): stop that broker, or give this one another store with --store-dir "
            "DIR (or --ephemeral)\n")  # fmt: skip
    finally:
        stop_broker(first)
