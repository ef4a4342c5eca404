"""The ``reach`` CLI run as a subprocess against a real nats-server and an in-process broker."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import socket
import sys
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from nats.aio.client import Client as NATS

from reach_agent.wire import schema
from reach_broker.broker import Broker
from reach_broker.cli.common import CliError, parse_duration
from reach_broker.cli.events import parse_since
from reach_broker.cli.view import BrokerStats, Snapshot, render
from reach_broker.cluster.natsserver import NatsServer

from .conftest import BrokerFactory, wait_for

CLI = [sys.executable, "-m", "reach_broker.cli"]
QUIET = {"detection__rtt_sample_interval_s": 0.0}  # no RTT probes: raw agents do not answer


def cli_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("REACH_", "NATS_"))}
    env["PYTHONUNBUFFERED"] = "1"
    return env


async def reach(
    *argv: str, limit_s: float = 30.0, env: dict[str, str] | None = None
) -> tuple[int, str, str]:
    """Run ``reach ARGV`` (``env`` added to a clean environment); returns (exit code, stdout,
    stderr)."""
    proc = await asyncio.create_subprocess_exec(
        *CLI, *argv, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        env={**cli_env(), **(env or {})},
    )  # fmt: skip
    out, err = await asyncio.wait_for(proc.communicate(), limit_s)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


async def announce(nc: NATS, agent_id: str, caps: list[str], **extra: Any) -> str:
    body = {"agent_id": agent_id, "capabilities": caps, "max_concurrency": 4,
            "heartbeat_interval_ms": 60_000, **extra}  # fmt: skip
    reply = await nc.request(f"reach.announce.{agent_id}", json.dumps(body).encode(), 2)
    assert reply.headers is None, reply.headers
    token: str = json.loads(reply.data)["token"]
    hb = {"agent_id": agent_id, "token": token, "seq": 1, "status": "idle", "active": 1,
          "queue_depth": 0, "ok_total": 0, "fail_total": 0}  # fmt: skip
    await nc.publish(f"reach.hb.{agent_id}", json.dumps(hb).encode())
    await nc.flush()
    return token


async def two_agents(nc: NATS, broker: Broker) -> None:
    await announce(nc, "alpha", ["text_processing", "tool_use"], region="eu", version="1.2.0")
    await announce(nc, "beta", ["data_cleaning", "text_processing"])
    await wait_for(lambda: broker.metrics.heartbeat_result["accepted"].value == 2,
                   what="two heartbeats")  # fmt: skip


async def ensure_audit_stream(nc: NATS) -> None:
    """REACH_AUDIT as the broker provisions it (deny delete and purge), unless it did already."""
    from nats.js.errors import NotFoundError

    js = nc.jetstream()
    try:
        await js.stream_info("REACH_AUDIT")
    except NotFoundError:
        await js.add_stream(name="REACH_AUDIT", subjects=["reach.event.>"], deny_delete=True,
                            deny_purge=True)  # fmt: skip


# --- entry points ----------------------------------------------------------------------


def test_every_entry_point_prints_the_same_help() -> None:
    import shutil
    import subprocess
    from pathlib import Path

    script = shutil.which("reach", path=str(Path(sys.executable).parent))
    assert script is not None, "the console script `reach` is installed next to python"
    entry_points = [[sys.executable, "-m", "reach_broker"], CLI, [script]]
    for argv in ([], ["events"]):
        outs = [subprocess.run([*ep, *argv, "--help"], capture_output=True, text=True,
                               env=cli_env(), timeout=30, check=True).stdout
                for ep in entry_points]  # fmt: skip
        assert outs[0].startswith("usage: reach ")
        assert outs == [outs[0]] * len(entry_points)


# --- reach agents ------------------------------------------------------------------------


async def test_agents_json_lists_every_agent_with_its_view(
    nats_server: NatsServer, nc: NATS, broker_factory: BrokerFactory
) -> None:
    broker = await broker_factory(**QUIET)
    before = int(time.time() * 1000)
    await two_agents(nc, broker)
    after = int(time.time() * 1000)
    code, out, err = await reach("agents", "--json", "-s", nats_server.url)
    assert (code, err) == (0, "")
    views = sorted(json.loads(out), key=lambda v: v["agent_id"])
    for view in views:
        assert before <= view.pop("last_seen_ms") <= after
    # The score is the broker's to compute (scoring.py); the CLI shows exactly the wire's.
    wire = json.loads((await nc.request("reach.agents", b"{}", timeout=2)).data)
    assert [v.pop("score") for v in views] == [v["score"] for v in sorted(
        wire, key=lambda v: v["agent_id"])]  # fmt: skip
    assert views == [
        {"agent_id": "alpha", "state": "healthy", "load": 0.25,
         "capabilities": ["text_processing", "tool_use"], "success_rate": 1.0,
         "region": "eu", "version": "1.2.0", "active": 1, "max_concurrency": 4},
        {"agent_id": "beta", "state": "healthy", "load": 0.25,
         "capabilities": ["data_cleaning", "text_processing"], "success_rate": 1.0,
         "active": 1, "max_concurrency": 4},
    ]  # fmt: skip

    code, out, _ = await reach("agents", "--json", "-C", "tool_use", "-s", nats_server.url)
    assert code == 0
    assert [v["agent_id"] for v in json.loads(out)] == ["alpha"]
    code, out, _ = await reach("agents", "--json", "--state", "offline", "-s", nats_server.url)
    assert (code, json.loads(out)) == (0, [])


async def test_agents_table_is_readable(
    nats_server: NatsServer, nc: NATS, broker_factory: BrokerFactory
) -> None:
    broker = await broker_factory(**QUIET)
    await two_agents(nc, broker)
    code, out, err = await reach("agents", "-C", "tool_use", "-s", nats_server.url)
    assert (code, err) == (0, "")
    header, row = out.splitlines()
    assert header.split() == ["AGENT", "STATE", "SCORE", "LOAD", "LAST", "HEARD",
                              "CAPABILITIES", "REGION", "SUCCESS"]  # fmt: skip
    cells = row.split()
    [wire] = json.loads((await nc.request("reach.agents", b'{"capability": "tool_use"}', 2)).data)
    assert cells[:4] == ["alpha", "healthy", f"{wire['score']:.1f}", "1/4"]
    assert cells[5:] == ["ago", "text_processing,tool_use", "eu", "100.0%"]


BAD_CAPABILITIES = ["text processing", "", "text.", "text..processing", "Bad"]
CAPABILITY_RULE = "is not a valid capability (dot-separated lowercase tokens [a-z0-9][a-z0-9_-]*)"


@pytest.mark.parametrize("value", BAD_CAPABILITIES)
@pytest.mark.parametrize(
    ("command", "flag"),
    [
        (["route"], "capability"),
        (["call"], "capability"),
        (["agents", "-C"], "--capability"),
        (["announce", "-C"], "--capability"),
    ],
)
async def test_a_bad_capability_is_one_line_before_anything_is_sent(
    command: list[str], flag: str, value: str
) -> None:
    # No server at all: the name is refused before connecting (a broker would say the same).
    with refused_port() as port:
        url = f"nats://127.0.0.1:{port}"
        code, out, err = await reach(*command, value, "-s", url)
        assert (code, out) == (2, "")
        assert err == f"reach: {flag} {value!r} {CAPABILITY_RULE}\n"
        code, out, err = await reach(*command, value, "--json", "-s", url)
    assert code == 2
    message = f"{flag} {value!r} {CAPABILITY_RULE}"
    assert json.loads(out) == {"error": {"code": "INVALID_CAPABILITY", "exit": 2,
                                         "message": message}}  # fmt: skip


# --- reach route ---------------------------------------------------------------------------


async def test_route_json_is_what_a_caller_gets(
    nats_server: NatsServer, nc: NATS, broker_factory: BrokerFactory
) -> None:
    broker = await broker_factory(**QUIET)
    await two_agents(nc, broker)
    t0 = int(time.time() * 1000)
    code, out, err = await reach("route", "tool_use", "--json", "-s", nats_server.url)
    assert (code, err) == (0, "")
    reply = json.loads(out)
    assert t0 <= reply.pop("generated_at_ms") <= int(time.time() * 1000)
    wire = json.loads((await nc.request("reach.route.tool_use", b"", timeout=2)).data)
    assert reply["candidates"][0].pop("score") == wire["candidates"][0]["score"]
    assert reply == {
        "capability": "tool_use",
        "candidates": [
            {"agent_id": "alpha", "subject": "reach.task.alpha.tool_use",
             "state": "healthy", "load": 0.25, "region": "eu", "version": "1.2.0",
             "protocol": "reach"},
        ],
    }  # fmt: skip
    code, out, _ = await reach("route", "text_processing", "--json", "--region", "eu",
                               "-s", nats_server.url)  # fmt: skip
    assert [c["agent_id"] for c in json.loads(out)["candidates"]] == ["alpha"]
    code, out, _ = await reach("route", "text_processing", "--json", "--limit", "1",
                               "--exclude", "alpha", "-s", nats_server.url)  # fmt: skip
    assert [c["agent_id"] for c in json.loads(out)["candidates"]] == ["beta"]


async def test_route_errors_are_one_line(
    nats_server: NatsServer, broker_factory: BrokerFactory
) -> None:
    await broker_factory(**QUIET)
    code, out, err = await reach("route", "translation", "-s", nats_server.url)
    assert (code, out) == (1, "")
    assert err == "reach: NO_REACHABLE_AGENT: no agent has the capability 'translation'\n"
    # With --json the same error is also one JSON object on stdout.
    code, out, err = await reach("route", "translation", "--json", "-s", nats_server.url)
    assert code == 1
    assert err == "reach: NO_REACHABLE_AGENT: no agent has the capability 'translation'\n"
    assert json.loads(out) == {
        "error": {
            "code": "NO_REACHABLE_AGENT",
            "exit": 1,
            "message": "no agent has the capability 'translation'",
        }
    }
    code, _, err = await reach("route", "x", "--tag", "tier", "-s", nats_server.url)
    assert (code, err) == (2, "reach: --tag 'tier' is not key=value\n")


# --- unreachable server / no broker -------------------------------------------------------


@contextlib.contextmanager
def refused_port() -> Iterator[int]:
    """A loopback port nobody listens on for as long as it is held: bound here and never
    listened on, so a connect is refused and no other process (a parallel test's server) can
    take it meanwhile (a port merely found free was, once, under xdist)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        yield int(s.getsockname()[1])


NO_SERVER_COMMANDS = [["agents"], ["route", "tool_use"], ["top", "--once"],
                      ["events", "--since", "1h"], ["events", "--follow"]]  # fmt: skip


@pytest.mark.parametrize("command", NO_SERVER_COMMANDS)
async def test_no_server_is_one_clear_line(command: list[str]) -> None:
    with refused_port() as port:
        url = f"nats://127.0.0.1:{port}"
        line = (f"cannot connect to NATS at {url}: connection refused "
                "(is `reach broker` running? set --server or NATS_URL)")  # fmt: skip
        code, out, err = await reach(*command, "-s", url, "--timeout", "1")
        assert (code, out, err) == (3, "", f"reach: {line}\n")
        code, out, err = await reach(*command, "--json", "-s", url, "--timeout", "1")
    assert (code, err) == (3, f"reach: {line}\n")
    assert json.loads(out) == {"error": {"code": "UNAVAILABLE", "message": line, "exit": 3}}


@pytest.mark.parametrize(
    ("server", "line"),
    [
        ("http://127.0.0.1:8222", "--server 'http://127.0.0.1:8222': http:// is not a NATS URL "
                                  "(use nats://HOST:PORT, tls://, ws:// or wss://)"),
        ("", "--server '' names no NATS server (give nats://HOST:PORT, or leave it out for "
             "nats://127.0.0.1:4222)"),
        (" , ", "--server ' , ' names no NATS server (give nats://HOST:PORT, or leave it out "
                "for nats://127.0.0.1:4222)"),
        ("nats://127.0.0.1:42x2", "--server 'nats://127.0.0.1:42x2': the port is not a number"),
        ("nats://:4222", "--server 'nats://:4222' names no host"),
    ],
)  # fmt: skip
async def test_a_bad_server_url_is_one_line(server: str, line: str) -> None:
    for command in (["agents"], ["route", "tool_use"], ["events", "--follow"], ["broker"]):
        code, out, err = await reach(*command, "-s", server)
        assert (code, out, err) == (2, "", f"reach: {line}\n"), command


async def test_a_port_that_does_not_speak_nats_is_one_line() -> None:
    """The monitoring or metrics port by mistake: an HTTP server answers, NATS does not."""
    import http.server
    import threading

    httpd = http.server.HTTPServer(("127.0.0.1", 0), http.server.SimpleHTTPRequestHandler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        url = f"nats://127.0.0.1:{httpd.server_address[1]}"
        code, out, err = await reach("agents", "-s", url, "--timeout", "1")
    finally:
        httpd.shutdown()
        httpd.server_close()
    assert (code, out) == (3, "")
    assert err == (f"reach: cannot connect to NATS at {url}: no NATS greeting within 1s: is "
                   "this a NATS client port? (nats-server listens on 4222 by default; 8222 is "
                   "for monitoring)\n")  # fmt: skip


async def test_a_missing_creds_file_says_so(nats_server: NatsServer, tmp_path: Any) -> None:
    creds = tmp_path / "nope.creds"
    line = (f"reach: creds file '{creds}' does not exist (set by the creds option or "
            "NATS_CREDS)\n")  # fmt: skip
    for command in (["agents"], ["route", "tool_use"], ["events", "--follow"], ["broker"]):
        code, out, err = await reach(*command, "-s", nats_server.url, "--creds", str(creds))
        assert (code, out, err) == (2, "", line), command
    code, out, err = await reach("agents", "-s", nats_server.url, env={"NATS_CREDS": str(creds)})
    assert (code, err) == (2, line)


@pytest.mark.parametrize("command", [["agents"], ["route", "tool_use"], ["top", "--once"]])
async def test_no_broker_is_one_clear_line(nats_server: NatsServer, command: list[str]) -> None:
    code, out, err = await reach(*command, "-s", nats_server.url)
    subject = "reach.agents.0" if command[0] != "route" else "reach.route.tool_use"
    assert (code, out) == (3, "")
    assert err == (f"reach: no broker answers on {subject} "
                   "(is `reach broker` running on this server?)\n")  # fmt: skip
    code, out, _ = await reach(*command, "--json", "-s", nats_server.url)
    assert code == 3
    assert json.loads(out)["error"]["code"] == "UNAVAILABLE"


async def test_nats_url_env_is_the_default_server(
    nats_server: NatsServer, broker_factory: BrokerFactory
) -> None:
    await broker_factory(**QUIET)
    env = {**cli_env(), "NATS_URL": nats_server.url}
    proc = await asyncio.create_subprocess_exec(
        *CLI, "agents", "--json", stdout=asyncio.subprocess.PIPE, env=env
    )
    out, _ = await asyncio.wait_for(proc.communicate(), 30)
    assert (proc.returncode, json.loads(out)) == (0, [])


# --- reach top ----------------------------------------------------------------------------


async def test_top_once_json_snapshot(
    nats_server: NatsServer, nc: NATS, broker_factory: BrokerFactory
) -> None:
    broker = await broker_factory(**QUIET)
    await two_agents(nc, broker)
    for _ in range(3):
        await nc.request("reach.route.tool_use", b"", timeout=2)
    code, out, err = await reach("top", "--once", "--json", "--events", "0", "-s", nats_server.url)
    assert (code, err) == (0, "")
    snap = json.loads(out)
    assert isinstance(snap.pop("at_ms"), int)
    assert [a["agent_id"] for a in snap.pop("agents")] == ["alpha", "beta"]
    [stats] = snap.pop("brokers")
    assert isinstance(stats.pop("id"), str)
    assert stats.pop("route_avg_ms") >= 0
    assert stats == {"broker_id": broker.broker_id, "version": "0.1.0", "route_requests": 3,
                     "route_errors": 0}  # fmt: skip
    assert snap == {
        "by_state": {"healthy": 2, "suspect": 0, "offline": 0, "recovering": 0, "draining": 0},
        "route_requests": 3,
        "route_rate": None,
        "events": [],
        "error": None,
    }


async def test_top_once_table_and_recent_events_from_the_audit_stream(
    nats_server: NatsServer, nc: NATS, broker_factory: BrokerFactory
) -> None:
    broker = await broker_factory(**QUIET)
    await ensure_audit_stream(nc)
    await two_agents(nc, broker)
    js = nc.jetstream()
    deadline = time.monotonic() + 5
    while (await js.stream_info("REACH_AUDIT")).state.messages < 2:
        assert time.monotonic() < deadline, "two registered events in REACH_AUDIT"
        await asyncio.sleep(0.02)
    code, out, err = await reach("top", "--once", "-s", nats_server.url)
    assert (code, err) == (0, "")
    lines = out.splitlines()
    assert lines[0].startswith(f"reach top — {nats_server.url} — ")
    assert lines[1] == ("brokers 1   agents 2: healthy 2  suspect 0  offline 0  recovering 0"
                        "  draining 0")  # fmt: skip
    assert lines[2].startswith(f"routes -   total 0   [{broker.broker_id}: 0, avg ")
    assert lines[4].split()[:2] == ["AGENT", "STATE"]
    assert [line.split()[0] for line in lines[5:7]] == ["alpha", "beta"]
    assert lines[8] == "recent events"
    assert [line.split()[1:5] for line in lines[9:11]] == [
        ["registered", "alpha", "-", "->"],
        ["registered", "beta", "-", "->"],
    ]


async def test_top_live_redraws_until_sigint(
    nats_server: NatsServer, nc: NATS, broker_factory: BrokerFactory
) -> None:
    broker = await broker_factory(**QUIET)
    await two_agents(nc, broker)
    proc = await asyncio.create_subprocess_exec(
        *CLI, "top", "--json", "--interval", "0.2", "-s", nats_server.url,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=cli_env(),
    )  # fmt: skip
    assert proc.stdout is not None
    first = json.loads(await asyncio.wait_for(proc.stdout.readline(), 20))
    for _ in range(5):
        await nc.request("reach.route.tool_use", b"", timeout=2)
    # A refresh may have sampled the stats while the requests ran: read until all 5 count.
    second = first
    deadline = time.monotonic() + 20
    while second["route_requests"] != first["route_requests"] + 5:
        assert time.monotonic() < deadline, f"route_requests stuck at {second['route_requests']}"
        second = json.loads(await asyncio.wait_for(proc.stdout.readline(), 20))
    proc.send_signal(signal.SIGINT)
    rest, err = await asyncio.wait_for(proc.communicate(), 20)
    assert (proc.returncode, err) == (0, b"")
    assert first["route_rate"] is None
    assert second["route_rate"] > 0
    assert all(json.loads(line)["by_state"]["healthy"] == 2 for line in rest.splitlines())


async def test_top_once_on_an_empty_audit_stream_shows_no_events(
    nats_server: NatsServer, nc: NATS, broker_factory: BrokerFactory
) -> None:
    await broker_factory(**QUIET)
    await ensure_audit_stream(nc)
    assert (await nc.jetstream().stream_info("REACH_AUDIT")).state.messages == 0
    code, out, err = await reach("top", "--once", "--json", "-s", nats_server.url)
    assert (code, err) == (0, "")
    snap = json.loads(out)
    assert (snap["events"], snap["agents"], snap["error"]) == ([], [], None)


@pytest.fixture
def fresh_broker() -> Iterator[str]:
    """`reach broker` just started, as a new user runs it (embedded server, empty streams)."""
    import subprocess

    proc = subprocess.Popen([*CLI, "broker", "--port", "0", "--metrics-port", "0", "--ephemeral"],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            env=cli_env())  # fmt: skip
    try:
        assert proc.stdout is not None
        url = None
        for line in proc.stdout:
            url = url or next(iter(re.findall(r"listening on (nats://\S+)", line)), None)
            if "serving on" in line:
                break
        assert url is not None
        yield url
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
        if proc.stdout is not None:
            proc.stdout.close()


async def test_top_on_a_fresh_broker_once_json_and_live(fresh_broker: str) -> None:
    """Before the first event (issue 11 item 1: this was a traceback)."""
    url = fresh_broker
    code, out, err = await reach("top", "--once", "-s", url)
    assert (code, err) == (0, "")
    lines = out.splitlines()
    assert (
        lines[1]
        == "brokers 1   agents 0: healthy 0  suspect 0  offline 0  recovering 0  draining 0"
    )
    assert "recent events" not in out
    code, out, err = await reach("top", "--once", "--json", "-s", url)
    assert (code, err) == (0, "")
    snap = json.loads(out)
    assert (snap["agents"], snap["events"], snap["error"], len(snap["brokers"])) == (
        [],
        [],
        None,
        1,
    )
    proc = await asyncio.create_subprocess_exec(
        *CLI, "top", "--json", "--interval", "0.2", "-s", url,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=cli_env(),
    )  # fmt: skip
    assert proc.stdout is not None
    try:
        for _ in range(2):
            live = json.loads(await asyncio.wait_for(proc.stdout.readline(), 20))
            assert (live["agents"], live["events"], live["error"]) == ([], [], None)
        proc.send_signal(signal.SIGINT)
        _, err_bytes = await asyncio.wait_for(proc.communicate(), 20)
        assert (proc.returncode, err_bytes) == (0, b"")
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


def test_render_is_cut_to_the_terminal() -> None:
    view = schema.AgentView(agent_id="alpha", state="healthy", score=97.5, load=0.5,
                            last_seen_ms=9_000, capabilities=["tool_use"], success_rate=1.0,
                            active=2, max_concurrency=4)  # fmt: skip
    event = schema.Event(kind="state", agent_id="alpha", reason="missed 3 heartbeats",
                         at_ms=8_000, broker_id="b1", from_="healthy", to="suspect")  # fmt: skip
    snap = Snapshot(at_ms=10_000, agents=[view], by_state={"healthy": 1}, route_requests=7,
                    brokers=[BrokerStats(id="x", broker_id="b1", version="0.1.0",
                                         route_requests=7, route_errors=0, route_avg_ms=0.2)],
                    route_rate=3.5, events=[event])  # fmt: skip
    frame = render(snap, server="nats://h:1", width=200, height=100).splitlines()
    assert (
        frame[1]
        == "brokers 1   agents 1: healthy 1  suspect 0  offline 0  recovering 0  draining 0"
    )
    assert frame[2] == "routes 3.5/s   total 7   [b1: 7, avg 0.20 ms]"
    assert frame[5].split() == ["alpha", "healthy", "97.5", "2/4", "1.0s", "ago", "tool_use", "-",
                                "100.0%"]  # fmt: skip
    assert frame[7] == "recent events"
    assert frame[8].split()[1:] == ["state", "alpha", "healthy", "->", "suspect", "missed", "3",
                                    "heartbeats", "[b1]"]  # fmt: skip
    small = render(snap, server="nats://h:1", width=20, height=4).splitlines()
    assert len(small) == 4
    assert all(len(line) <= 20 for line in small)
    assert small[-1] == "… 6 more lines"


# --- reach events -------------------------------------------------------------------------


async def test_events_since_reads_the_audit_stream(
    nats_server: NatsServer, nc: NATS, broker_factory: BrokerFactory
) -> None:
    broker = await broker_factory(**QUIET)
    await ensure_audit_stream(nc)
    js = nc.jetstream()
    old = schema.Event(kind="state", agent_id="old", reason="before the window",
                       at_ms=1, broker_id="b0", from_="healthy", to="suspect")  # fmt: skip
    await js.publish("reach.event.state.old", schema.encoder.encode(old))
    # Stored times are the server's: the window starts at an absolute time 1 s after the old
    # message and 1 s before the new ones (however long the CLI then takes to start).
    await asyncio.sleep(2.0)
    mid = time.time()
    await two_agents(nc, broker)
    deadline = time.monotonic() + 5
    while (await js.stream_info("REACH_AUDIT")).state.messages < 3:
        assert time.monotonic() < deadline, "two registered events in REACH_AUDIT"
        await asyncio.sleep(0.02)
    since = datetime.fromtimestamp(mid - 1.0, UTC).isoformat()
    code, out, err = await reach("events", "--since", since, "--json", "-s", nats_server.url)
    assert (code, err) == (0, "")
    events = [json.loads(line) for line in out.splitlines()]
    for e in events:
        assert isinstance(e.pop("at_ms"), int)
    assert events == [
        {"kind": "registered", "agent_id": a, "reason": "announced", "broker_id": broker.broker_id,
         "to": "healthy"} for a in ("alpha", "beta")
    ]  # fmt: skip
    code, out, err = await reach("events", "--since", "1h", "--json", "-s", nats_server.url)
    assert (code, err) == (0, "")
    assert [json.loads(line)["agent_id"] for line in out.splitlines()] == ["old", "alpha", "beta"]
    code, out, err = await reach("events", "--since", "1h", "-s", nats_server.url)
    assert code == 0
    assert out.splitlines()[0].split()[1:] == ["state", "old", "healthy", "->", "suspect",
                                               "before", "the", "window", "[b0]"]  # fmt: skip


def test_events_since_takes_a_duration_or_a_time_with_its_offset() -> None:
    now = datetime(2026, 12, 1, 13, 0, 0, tzinfo=UTC).timestamp()
    assert parse_since("90s", now) == 90.0
    assert parse_since("2026-12-01T12:58:30Z", now) == 90.0
    assert parse_since("2026-12-01 13:58:30+01:00", now) == 90.0
    for text, message in [
        ("2026-12-01T12:58:30", "--since '2026-12-01T12:58:30' has no UTC offset (add Z or "
                                "+01:00)"),
        ("2026-12-01T13:00:01Z", "--since '2026-12-01T13:00:01Z' is in the future"),
        ("2026-13-01T00:00:00Z", "--since '2026-13-01T00:00:00Z' is not a time (like "
                                 "2026-12-01T13:00:00Z)"),
    ]:  # fmt: skip
        with pytest.raises(CliError) as exc:
            parse_since(text, now)
        assert str(exc.value) == message


async def test_events_on_an_empty_window_say_so(nats_server: NatsServer, nc: NATS) -> None:
    await ensure_audit_stream(nc)
    code, out, err = await reach("events", "--since", "10m", "--json", "-s", nats_server.url)
    assert (code, out, err) == (0, "", "reach: no events in REACH_AUDIT in the last 10m\n")
    code, out, err = await reach("events", "-s", nats_server.url)
    assert (code, out, err) == (0, "", "reach: no events in REACH_AUDIT in the last 1h\n")


async def test_events_into_a_pipe_closed_early_end_quietly(
    nats_server: NatsServer, nc: NATS
) -> None:
    """`reach events | head -1`: the exit a SIGPIPE gives (141), no traceback."""
    import subprocess

    await ensure_audit_stream(nc)
    js = nc.jetstream()
    event = schema.Event(kind="state", agent_id="alpha", reason="x" * 100, at_ms=1,
                         broker_id="b1", from_="healthy", to="suspect")  # fmt: skip
    for _ in range(2000):  # well past a pipe's buffer, so the CLI writes after head is gone
        await js.publish("reach.event.state.alpha", schema.encoder.encode(event))
    script = 'set -o pipefail; "$@" | head -1; echo "exit ${PIPESTATUS[0]}" >&2'
    argv = ["bash", "-c", script, "bash", *CLI, "events", "--since", "1h", "-s", nats_server.url]
    out = await asyncio.to_thread(subprocess.run, argv, capture_output=True, text=True,
                                  env=cli_env(), timeout=60)  # fmt: skip
    assert out.stdout.splitlines()[0].split()[1:4] == ["state", "alpha", "healthy"]
    assert len(out.stdout.splitlines()) == 1
    assert out.stderr == "exit 141\n"


async def test_ack_without_the_stream_or_jetstream_says_which(nats_server: NatsServer) -> None:
    rid = "9f0c1d2e-0000-4000-8000-000000000001"
    code, out, err = await reach("ack", rid, "-s", nats_server.url)
    assert (code, out) == (3, "")
    assert err == ("reach: stream REACH_ACKS not found on this server: the broker creates it "
                   "at start when JetStream is on\n")  # fmt: skip
    assert nats_server.system_password is not None
    code, out, err = await reach("ack", rid, "-s", nats_server.url,
                                 env={"NATS_USER": "sys",
                                      "NATS_PASSWORD": nats_server.system_password})  # fmt: skip
    assert (code, out) == (3, "")
    assert err == ("reach: JetStream is not available on this server (or this account), so "
                   "there is no REACH_ACKS to read\n")  # fmt: skip


async def test_events_without_the_stream_say_so(nats_server: NatsServer) -> None:
    code, out, err = await reach("events", "--since", "1h", "-s", nats_server.url)
    assert (code, out) == (3, "")
    assert err == (
        "reach: stream REACH_AUDIT not found on this server: the broker creates it "
        "at start when JetStream is on (use --follow for live events only)\n"
    )


async def test_events_without_jetstream_say_so(nats_server: NatsServer) -> None:
    # NATS_USER/NATS_PASSWORD (read by connect_options): the system account of
    # configs/nats-server.conf, which has no JetStream.
    assert nats_server.system_password is not None
    code, out, err = await reach("events", "--since", "1h", "-s", nats_server.url,
                                 env={"NATS_USER": "sys",
                                      "NATS_PASSWORD": nats_server.system_password})  # fmt: skip
    assert (code, out) == (3, "")
    assert err == (
        "reach: JetStream is not available on this server, so there is no REACH_AUDIT "
        "history (use --follow for live events only)\n"
    )


async def test_events_follow_prints_live_events_and_logs_json(
    nats_server: NatsServer, nc: NATS
) -> None:
    event = schema.Event(kind="state", agent_id="gamma", reason="probe timeout", at_ms=42,
                         broker_id="b9", from_="suspect", to="offline")  # fmt: skip
    proc = await asyncio.create_subprocess_exec(
        *CLI, "events", "--follow", "--json", "--log-format", "json", "-s", nats_server.url,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=cli_env(),
    )  # fmt: skip
    assert proc.stdout is not None
    # Publish until the follower (subscribing in its own time) prints the first one.
    line = b""
    deadline = time.monotonic() + 20
    while not line:
        assert time.monotonic() < deadline, "reach events --follow printed nothing"
        await nc.publish("reach.event.state.gamma", schema.encoder.encode(event))
        try:
            line = await asyncio.wait_for(proc.stdout.readline(), 0.2)
        except TimeoutError:
            continue
    await nc.publish("reach.event.state.gamma", b"not json")
    # The server has it once flush returns, the follower only when it logs it: a SIGINT
    # sent before then could end the follower with the message unread.
    assert proc.stderr is not None
    said = await asyncio.wait_for(proc.stderr.readline(), 20)
    proc.send_signal(signal.SIGINT)
    rest, err = await asyncio.wait_for(proc.communicate(), 20)
    assert proc.returncode == 0
    expected = {"kind": "state", "agent_id": "gamma", "reason": "probe timeout", "at_ms": 42,
                "broker_id": "b9", "to": "offline", "from": "suspect"}  # fmt: skip
    assert all(json.loads(x) == expected for x in [line, *rest.splitlines()])
    logs = [json.loads(x) for x in [said, *err.splitlines()]]
    assert [(r["level"], r["logger"], r["msg"].split()[0]) for r in logs] == [
        ("warning", "reach", "events.undecodable")
    ]


async def test_events_since_and_follow_replays_then_stays_live(
    nats_server: NatsServer, nc: NATS, broker_factory: BrokerFactory
) -> None:
    broker = await broker_factory(**QUIET)
    await ensure_audit_stream(nc)
    await two_agents(nc, broker)
    proc = await asyncio.create_subprocess_exec(
        *CLI, "events", "--since", "1h", "--follow", "--json", "-s", nats_server.url,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=cli_env(),
    )  # fmt: skip
    assert proc.stdout is not None
    try:
        replayed = [json.loads(await asyncio.wait_for(proc.stdout.readline(), 20))
                    for _ in range(2)]  # fmt: skip
        assert [(e["kind"], e["agent_id"]) for e in replayed] == [
            ("registered", "alpha"),
            ("registered", "beta"),
        ]
        live = schema.Event(kind="left", agent_id="zeta", reason="leave", at_ms=7,
                            broker_id="b1", from_="healthy", to="draining")  # fmt: skip
        await nc.jetstream().publish("reach.event.left.zeta", schema.encoder.encode(live))
        line = json.loads(await asyncio.wait_for(proc.stdout.readline(), 20))
        assert line == {"kind": "left", "agent_id": "zeta", "reason": "leave", "at_ms": 7,
                        "broker_id": "b1", "to": "draining", "from": "healthy"}  # fmt: skip
        proc.send_signal(signal.SIGINT)
        rest, err = await asyncio.wait_for(proc.communicate(), 20)
        assert (proc.returncode, rest, err) == (0, b"", b"")
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


def test_parse_duration() -> None:
    assert [parse_duration(x) for x in ("90s", "15m", "1h30m", "2d", "500ms", "7")] == [
        90.0,
        900.0,
        5400.0,
        172800.0,
        0.5,
        7.0,
    ]
    for bad in ("", "1x", "h", "0s", "1h 2m", "-5s"):
        with pytest.raises(CliError) as info:
            parse_duration(bad)
        assert info.value.code == 2
        assert repr(bad) in str(info.value)


# --- reach demo ---------------------------------------------------------------------------


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


DEMO_PIDS = {"broker", "alpha", "beta", "gamma", "nats-server"}


@pytest.mark.slow
async def test_demo_runs_for_its_duration_and_leaves_no_process() -> None:
    code, out, err = await reach("demo", "--duration", "3", "--json", "--no-view", "--rate", "5",
                                 limit_s=90)  # fmt: skip
    assert code == 0, err
    started, ready, stopped = (json.loads(line) for line in out.splitlines())
    assert set(started) == {"event", "nats_url", "pids", "logs", "broker_id", "console"}
    assert started["event"] == "started"
    assert set(started["pids"]) == DEMO_PIDS
    assert ready == {"event": "ready", "agents": ["alpha", "beta", "gamma"],
                     "pids": started["pids"]}  # fmt: skip
    assert stopped["event"] == "stopped"
    assert stopped["reason"] == "duration"
    assert stopped["pids"] == started["pids"]
    assert stopped["restarts"] == {}
    # A run without failure leaves no logs.
    assert not await asyncio.to_thread(os.path.exists, started["logs"])
    calls = stopped["calls"]
    assert calls["failed"] == {}
    assert calls["ok"] >= 1
    assert sum(calls["by_agent"].values()) == calls["ok"]
    assert set(calls["by_agent"]) <= {"alpha", "beta", "gamma"}
    assert [name for name, pid in started["pids"].items() if alive(pid)] == []


@pytest.mark.slow
async def test_demo_shows_the_fleet_and_stops_everything_on_sigint() -> None:
    proc = await asyncio.create_subprocess_exec(
        *CLI, "demo", "--json", "--interval", "0.3", "--rate", "4",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=cli_env(),
    )  # fmt: skip
    assert proc.stdout is not None
    try:
        started = json.loads(await asyncio.wait_for(proc.stdout.readline(), 30))
        assert set(started["pids"]) == DEMO_PIDS
        # The live view (JSON snapshots here) shows the three agents healthy.
        deadline = time.monotonic() + 60
        while True:
            assert time.monotonic() < deadline, "the demo fleet never showed healthy"
            snap = json.loads(await asyncio.wait_for(proc.stdout.readline(), 30))
            if "event" in snap:  # the demo's own records (ready) between the snapshots
                continue
            healthy = {a["agent_id"] for a in snap["agents"] if a["state"] == "healthy"}
            if healthy == {"alpha", "beta", "gamma"}:
                break
        assert snap["by_state"]["healthy"] == 3
        agents = sorted(snap["agents"], key=lambda a: a["agent_id"])
        assert [{a["agent_id"]: a["capabilities"]} for a in agents] == [
            {"alpha": ["text_processing", "tool_use"]},
            {"beta": ["data_cleaning", "text_processing"]},
            {"gamma": ["intent.recognition", "tool_use"]},
        ]
        proc.send_signal(signal.SIGINT)
        rest, err = await asyncio.wait_for(proc.communicate(), 60)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert proc.returncode == 0, err
    stopped = json.loads(rest.splitlines()[-1])
    assert (stopped["event"], stopped["reason"]) == ("stopped", "signal")
    assert stopped["calls"]["failed"] == {}
    assert [name for name, pid in started["pids"].items() if alive(pid)] == []


def _read_until(fd: int, needle: bytes, limit_s: float) -> bytes:
    """Read a pty master until ``needle`` shows (blocking; run it in a thread)."""
    import select

    buf = b""
    deadline = time.monotonic() + limit_s
    while needle not in buf:
        left = deadline - time.monotonic()
        assert left > 0, f"{needle!r} not seen in {buf[-500:]!r}"
        ready, _, _ = select.select([fd], [], [], min(left, 0.2))
        if ready:
            try:
                buf += os.read(fd, 65536)
            except OSError:  # EIO: the child closed the terminal
                break
    return buf


async def test_top_on_a_terminal_redraws_and_quits_on_q(
    nats_server: NatsServer, nc: NATS, broker_factory: BrokerFactory
) -> None:
    import pty

    broker = await broker_factory(**QUIET)
    await two_agents(nc, broker)
    master, slave = pty.openpty()
    proc = await asyncio.create_subprocess_exec(
        *CLI, "top", "--interval", "0.2", "-s", nats_server.url,
        stdin=slave, stdout=slave, stderr=slave, env={**cli_env(), "TERM": "xterm"},
    )  # fmt: skip
    os.close(slave)
    try:
        # Two frames: alternate screen, cursor home + clear before each.
        seen = await asyncio.to_thread(_read_until, master, b"draining 0", 20)
        seen += await asyncio.to_thread(_read_until, master, b"draining 0", 20)
        assert seen.startswith(b"\x1b[?1049h\x1b[?25l")
        assert seen.count(b"\x1b[H\x1b[2J") >= 2
        assert b"agents 2: healthy 2" in seen
        os.write(master, b"q")
        assert await asyncio.wait_for(proc.wait(), 20) == 0
        tail = await asyncio.to_thread(_read_until, master, b"\x1b[?25h\x1b[?1049l", 5)
        assert tail.endswith(b"\x1b[?25h\x1b[?1049l")  # cursor and screen restored
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        os.close(master)


async def test_top_live_survives_a_server_restart(
    nats_server: NatsServer, nc: NATS, broker_factory: BrokerFactory
) -> None:
    broker = await broker_factory(**QUIET)
    await two_agents(nc, broker)
    proc = await asyncio.create_subprocess_exec(
        *CLI, "top", "--json", "--interval", "0.2", "--timeout", "0.5", "-s", nats_server.url,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=cli_env(),
    )  # fmt: skip
    assert proc.stdout is not None
    restarted = None

    async def next_snapshot() -> dict[str, Any]:
        assert proc.stdout is not None
        return dict(json.loads(await asyncio.wait_for(proc.stdout.readline(), 20)))

    async def until(pred: Any, what: str) -> dict[str, Any]:
        deadline = time.monotonic() + 30
        while not pred(snap := await next_snapshot()):
            assert time.monotonic() < deadline, what
        return snap

    try:
        await until(lambda s: s["error"] is None and len(s["brokers"]) == 1, "a first snapshot")
        port, store = nats_server.port, nats_server.store_dir
        nats_server.kill()
        down = await until(lambda s: s["error"] is not None, "an error frame while down")
        assert down["agents"] == []
        restarted = NatsServer(port=port, store_dir=store)
        await asyncio.to_thread(restarted.start)
        back = await until(lambda s: s["error"] is None and len(s["brokers"]) == 1, "back up")
        assert sorted(a["agent_id"] for a in back["agents"]) == ["alpha", "beta"]
        proc.send_signal(signal.SIGINT)
        _, err = await asyncio.wait_for(proc.communicate(), 20)
        assert (proc.returncode, err) == (0, b"")
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        if restarted is not None:
            # the broker and the raw client reconnected to it: close them before it stops
            await broker.stop()
            await nc.close()
            await asyncio.to_thread(restarted.stop)


@pytest.mark.slow
async def test_sigkill_of_the_demo_takes_every_child_along(tmp_path: Path) -> None:
    import shutil

    from reach_broker.cluster.natsserver import remove_stale_store_dirs

    from .test_broker_process import gone

    # Its own temp dir: any embedded server started on this machine meanwhile (another
    # test's, another checkout's) removes the stale store dirs it finds in the shared one,
    # and took this one first (the full suite, beside other runs).
    env = {**cli_env(), "TMPDIR": str(tmp_path)}
    proc = await asyncio.create_subprocess_exec(
        *CLI, "demo", "--json", "--no-view", "--rate", "1",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL, env=env,
    )  # fmt: skip
    assert proc.stdout is not None
    try:
        started = json.loads(await asyncio.wait_for(proc.stdout.readline(), 30))
        assert set(started["pids"]) == DEMO_PIDS
        proc.kill()
        await asyncio.wait_for(proc.wait(), 10)
        deadline = time.monotonic() + 20
        while running := [n for n, pid in started["pids"].items() if not gone(pid)]:
            assert time.monotonic() < deadline, f"still running after the demo's kill: {running}"
            await asyncio.sleep(0.05)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    # What a SIGKILL cannot clean: the demo's log dir, and its server's store (which the
    # next start of any embedded server removes).
    shutil.rmtree(started["logs"])
    removed = remove_stale_store_dirs(str(tmp_path))
    assert [p.name.split("-")[2] for p in removed] == [str(proc.pid)]


def test_render_shows_the_demos_notes_under_the_header() -> None:
    snap = Snapshot(at_ms=10_000, agents=[], by_state={}, brokers=[], route_requests=0,
                    route_rate=None, events=[])  # fmt: skip
    notes = ["10:00:01 beta exited with -9; restarting it in 3 s", "10:00:04 beta restarted"]
    frame = render(snap, server="nats://h:1", width=200, height=100, title="reach demo",
                   notes=notes).splitlines()  # fmt: skip
    assert frame[3:6] == ["", *notes]
    assert frame[6] == ""
