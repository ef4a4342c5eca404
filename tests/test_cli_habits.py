"""What a user of command-line tools expects of ``reach``: the common options before or after
the command, a bad option answered with that command's usage, a description for every command
and a help line for every option, a refused start as one line and exit 1, the demo's agents'
PIDs where it says to kill one, and no write-ahead-log directory left after a clean drain."""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import sys
from pathlib import Path

import pytest

import reach_agent
from jetstream.acks import AckWriter
from reach_agent.wire.subjects import Subjects
from reach_broker.broker import Broker
from reach_broker.cli.parser import build_parser, hoist
from reach_broker.cluster.natsserver import NatsServer

from .conftest import wait_for
from .test_cli import CLI, cli_env, reach

DEAD = "nats://127.0.0.1:1"
ROOT = Path(__file__).resolve().parent.parent


async def test_common_options_before_or_after_the_command() -> None:
    after = await reach("route", "text_processing", "--json", "--timeout", "0.5", "-s", DEAD)
    before = await reach("--json", "--timeout", "0.5", "-s", DEAD, "route", "text_processing")
    mixed = await reach("--json", "route", "--server=" + DEAD, "text_processing")
    for code, out, err in (after, before, mixed):
        assert code == 3, err
        assert json.loads(out)["error"]["code"] == "UNAVAILABLE"
        assert err.startswith(f"reach: cannot connect to NATS at {DEAD}: connection refused")


def test_hoisted_options_go_after_the_last_subcommand() -> None:
    p = build_parser()
    assert hoist(p, ["--json", "-s", "u", "auth", "list", "--dir", "d"]) == [
        "auth", "list", "--json", "-s", "u", "--dir", "d"
    ]  # fmt: skip
    assert hoist(p, ["--context=prod", "rules", "show", "cap"]) == [
        "rules", "show", "--context=prod", "cap"
    ]  # fmt: skip
    assert hoist(p, ["--version"]) == ["--version"]  # not a common option: left alone
    assert hoist(p, ["route", "x", "--json"]) == ["route", "x", "--json"]


@pytest.mark.parametrize(("command", "argv"), [
    ("route", ["route", "x", "--bogus"]),
    ("route", ["--json", "route", "x", "--bogus"]),
    ("adapt http", ["adapt", "http", "--agent-id", "a", "--capability", "c", "--url", "http://h/",
                    "--nope", "1"]),
    ("rules show", ["rules", "show", "--bogus"]),
])  # fmt: skip
async def test_a_bad_option_prints_that_commands_usage(command: str, argv: list[str]) -> None:
    code, out, err = await reach(*argv)
    assert (code, out) == (2, "")
    assert err.startswith(f"usage: reach {command} [-h]"), err
    assert err.splitlines()[-1].startswith(f"reach {command}: error: unrecognized arguments: --")


async def test_a_bad_value_names_the_command_too() -> None:
    code, _, err = await reach("route", "x", "--limit", "many")
    assert code == 2 and err.startswith("usage: reach route [-h]")
    assert "reach route: error: argument --limit/-n: invalid int value: 'many'" in err


def test_every_command_has_a_description_and_every_option_a_help_line() -> None:
    missing: list[str] = []

    def walk(p: argparse.ArgumentParser, path: str) -> None:
        for a in p._actions:
            if isinstance(a, argparse._SubParsersAction):
                for name, child in a.choices.items():
                    if not child.description:
                        missing.append(f"{path} {name}: no description")
                    walk(child, f"{path} {name}")
            elif not isinstance(a, argparse._HelpAction | argparse._VersionAction) and (
                not a.help or a.help == argparse.SUPPRESS
            ):
                missing.append(f"{path} {'/'.join(a.option_strings) or a.dest}: no help")

    walk(build_parser(), "reach")
    assert missing == []


async def test_reach_route_help_explains_each_option() -> None:
    code, out, _ = await reach("route", "--help")
    assert code == 0
    for flag, words in (("--limit", "candidates to ask for"), ("--region", "region"),
                        ("--tag", "tag"), ("--sticky-key", "same key"),
                        ("--exclude", "leave this agent out"), ("--allow-suspect", "suspect"),
                        ("--context", "nats")):  # fmt: skip
        assert re.search(rf"{flag}\b[^\n]*\n?\s+[^\n]*{words}", out), (flag, out)


DUP_SCRIPT = """
import reach_agent
agent = reach_agent.Agent("dup", ["echo"], durable_acks=False)

@agent.handler("echo")
async def echo(task):
    return task.payload

reach_agent.run(agent)
"""


async def test_a_refused_start_is_one_line_and_exit_1(
    nats_server: NatsServer, broker: Broker, agents: object, tmp_path: Path
) -> None:
    live = reach_agent.Agent("dup", ["echo"], heartbeat_interval=0.2, durable_acks=False)

    @live.handler("echo")
    async def echo(task: reach_agent.Task) -> object:
        return task.payload

    await agents(live)  # type: ignore[operator]
    await wait_for(lambda: "dup" in broker.registry.agents, 5)
    env = {**cli_env(), "NATS_URL": nats_server.url, "REACH_ACK_DIR": str(tmp_path / "acks")}
    runs = {
        "run()": [sys.executable, "-c", DUP_SCRIPT],
        "adapt": [*CLI, "adapt", "http", "--agent-id", "dup", "--capability", "echo",
                  "--url", "http://127.0.0.1:9/"],
    }  # fmt: skip
    if "httpx" not in sys.modules:
        pytest.importorskip("httpx")
    for name, argv in runs.items():
        proc = await asyncio.create_subprocess_exec(
            *argv, env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
            cwd=ROOT,
        )  # fmt: skip
        _, err = await asyncio.wait_for(proc.communicate(), 30)
        lines = [ln for ln in err.decode().splitlines() if "CONFLICT" in ln or "conflict" in ln]
        assert proc.returncode == 1, (name, err.decode())
        assert "Traceback" not in err.decode(), (name, err.decode())
        prefix = "reach: agent dup: CONFLICT: " if name == "run()" else "reach: CONFLICT: "
        assert len(lines) == 1 and lines[0].startswith(prefix), (name, err.decode())
        assert "agent_id 'dup' is live in another process" in lines[0]
    assert live.watch.closed.is_set() is False  # the live one went on


async def test_the_demo_says_which_pids_to_kill() -> None:
    code, out, err = await reach("demo", "--no-view", "--duration", "3", "--rate", "5",
                                 limit_s=120)  # fmt: skip
    assert code == 0, err
    line = next(ln for ln in out.splitlines() if "Kill one to watch the failover" in ln)
    found = dict(re.findall(r"(alpha|beta|gamma) pid (\d+)", line))
    assert sorted(found) == ["alpha", "beta", "gamma"], line
    assert len(set(found.values())) == 3 and all(int(p) > 1 for p in found.values())
    assert line.endswith("(kill -9 PID; it comes back 3s later)"), line


async def test_a_clean_drain_leaves_no_write_ahead_log_dir(
    nats_server: NatsServer, broker: Broker, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("REACH_ACK_DIR", str(tmp_path / "acks"))
    agent = reach_agent.Agent("walker", ["echo"], heartbeat_interval=0.2)

    @agent.handler("echo")
    async def echo(task: reach_agent.Task) -> object:
        return task.payload

    await agent.start(nats_server.url)
    wal_dir = tmp_path / "acks" / "walker"
    try:
        assert wal_dir.is_dir()
        async with reach_agent.Client(nats_server.url) as client:
            assert await client.call("echo", {"n": 1}, timeout=10) == {"n": 1}
    finally:
        await agent.stop(grace=2)
    assert not wal_dir.exists()
    assert (tmp_path / "acks").is_dir()  # only the agent's own dir goes


async def test_records_still_pending_keep_the_write_ahead_log(
    tmp_path: Path, nats_server: NatsServer
) -> None:
    from reach_agent.connection import connect_options
    from reach_agent.wire.schema import AckRecord

    # No REACH_ACKS stream on this server (no broker provisioned it): nothing can be stored.
    wal_dir = tmp_path / "pending"
    writer = AckWriter(wal_dir, author="keeper", connect=connect_options("keeper-acks",
                       nats_server.url), subjects=Subjects("reach"))  # fmt: skip
    await writer.start()
    await writer.record(AckRecord(request_id="rq-1", agent_id="keeper", capability="echo",
                                  state="received", at_ms=1))  # fmt: skip
    await writer.stop(timeout_s=0.5)
    assert writer.pending == 1
    assert [p.suffix for p in wal_dir.iterdir()] == [".wal"]
    # Something else in the dir: a clean close of another writer leaves the dir alone.
    other = AckWriter(tmp_path / "shared", author="x", connect=connect_options("x-acks",
                      nats_server.url), subjects=Subjects("reach"))  # fmt: skip
    (tmp_path / "shared").mkdir()
    (tmp_path / "shared" / "README").write_text("not ours")
    await other.start()
    await other.stop()
    assert sorted(p.name for p in (tmp_path / "shared").iterdir()) == ["README"]
