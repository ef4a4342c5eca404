"""The README's quick start as a new user runs it, with nothing but what its two set-up
commands install: a broker, ``reach announce`` in a second terminal, then every ``reach``
line of the third, each answering as the README says. The ``nats`` lines (natscli, not
installed here) come after them, as an alternative."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from .test_broker_process import free_port, read_until
from .test_ops_assets import readme_commands

ROOT = Path(__file__).resolve().parent.parent
CLI = [sys.executable, "-m", "reach_broker.cli"]


def reach_line(line: str) -> list[str]:
    """A README line ``.venv/bin/reach ARGS`` as this test's command."""
    argv = shlex.split(line)
    assert argv[0] == ".venv/bin/reach", line
    return [*CLI, *argv[1:]]


@pytest.fixture
def broker_env(tmp_path: Path) -> Iterator[dict[str, str]]:
    """``reach broker`` as the README starts it (embedded server; ports free ones, so this
    test runs beside anything else); yields the environment that points ``reach`` at it."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("REACH_", "NATS_"))}
    env |= {"PYTHONUNBUFFERED": "1", "REACH_ACK_DIR": str(tmp_path / "acks")}
    proc = subprocess.Popen(
        [*CLI, "broker", "--port", "0", "--metrics-port", str(free_port()), "--store-dir",
         str(tmp_path / "js")],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=tmp_path,
    )  # fmt: skip
    try:
        out = read_until(proc.stdout, "serving on")
        url = out.split("embedded nats-server listening on ")[1].split()[0]
        yield {**env, "NATS_URL": url}
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=30)


@pytest.mark.slow
def test_every_reach_line_of_the_quick_start_works(
    broker_env: dict[str, str], tmp_path: Path
) -> None:
    commands = readme_commands()
    reach_lines = [c for c in commands if c.startswith(".venv/bin/reach ")]
    nats_lines = [c for c in commands if c.startswith("nats ")]
    assert max(map(commands.index, reach_lines)) < min(map(commands.index, nats_lines))
    announce, *asks = reach_lines
    agent = subprocess.Popen(reach_line(announce), stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, env=broker_env,
                             cwd=tmp_path)  # fmt: skip
    try:
        read_until(agent.stdout, "announced text_processing")
        outs = {}
        for line in asks:
            # As written (its words), then with --json (to read what it said).
            for extra in ([], ["--json"]):
                done = subprocess.run(
                    [*reach_line(line), *extra], capture_output=True, text=True,
                    env=broker_env, cwd=tmp_path, timeout=60,
                )  # fmt: skip
                assert done.returncode == 0, (line, done.stderr)
                assert "alpha" in done.stdout, (line, done.stdout)
            outs[line.split()[1]] = json.loads(done.stdout)
        assert [c["agent_id"] for c in outs["route"]["candidates"]] == ["alpha"]
        assert outs["call"]["agent_id"] == "alpha" and outs["call"]["echo"] == {"text": "hi"}
        assert [(a["agent_id"], a["state"]) for a in outs["agents"]] == [("alpha", "healthy")]
    finally:
        agent.send_signal(signal.SIGINT)
        rest = agent.communicate(timeout=30)[0]
    assert agent.returncode == 0, rest
