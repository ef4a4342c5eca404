"""The gateways as a user starts them: ``reach broker --a2a-port`` serving cards from its own
process, and the one-line refusals (a missing extra, beyond loopback without a token, a bad
token)."""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from reach_broker import extras, process
from reach_broker.cli.parser import main
from reach_broker.config import Config

from .test_broker_process import free_port


@pytest.fixture(autouse=True)
def _root_logging_kept() -> Iterator[None]:
    """``main()`` in process sets the root logger up as the CLI does (its handlers replaced by
    one on this test's stderr); put pytest's back, or later tests log to a closed stream."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    try:
        yield
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)


UNSET = ("NATS_URL", "REACH_A2A_TOKEN", "REACH_CONSOLE_TOKEN")
"""The environment the broker under test must not inherit (the tests set what it needs)."""


def test_reach_broker_serves_the_a2a_gateway(tmp_path: Path) -> None:
    pytest.importorskip("a2a.server", reason="needs the extra 'a2a'")
    a2a_port = free_port()
    env = {k: v for k, v in os.environ.items() if k not in UNSET}
    proc = subprocess.Popen(
        [sys.executable, "-m", "reach_broker.cli", "broker", "--port", "0", "--metrics-port",
         "0", "--store-dir", str(tmp_path / "js"), "--a2a-port", str(a2a_port)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if "A2A gateway on" in line:
                break
        assert lines[-1] == (
            f"reach: A2A gateway on http://127.0.0.1:{a2a_port}/ (cards at /agents and "
            "/.well-known/agent-card.json, JSON-RPC at /a2a/<capability>)\n"
        ), "".join(lines)
        url = f"http://127.0.0.1:{a2a_port}/.well-known/agent-card.json"
        with urllib.request.urlopen(url, timeout=5) as reply:
            card = json.loads(reply.read())
        assert (card["name"], card["skills"]) == ("reach", [])
        assert card["supportedInterfaces"][0]["url"] == f"http://127.0.0.1:{a2a_port}/a2a"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(20) == 0
        rest = proc.stdout.read()
        assert re.search(r"reach: stopping", rest), rest
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            proc.wait(10)
        if proc.stdout is not None:
            proc.stdout.close()


def test_beyond_loopback_without_a_token_is_refused_in_one_line() -> None:
    env = {k: v for k, v in os.environ.items() if k not in UNSET}
    done = subprocess.run(
        [sys.executable, "-m", "reach_broker.cli", "broker", "--port", "0", "--metrics-port",
         "0", "--ephemeral", "--a2a-port", "8080", "--a2a-host", "0.0.0.0"],
        capture_output=True, text=True, env=env, timeout=60,
    )  # fmt: skip
    assert (done.returncode, done.stdout) == (3, "")
    assert done.stderr == (
        "reach: --a2a-host 0.0.0.0 listens beyond loopback: give a token with --a2a-token or "
        "REACH_A2A_TOKEN, or the console's --console-token (16 or more characters)\n"
    )


def test_a_short_token_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["broker", "--a2a-port", "8080", "--a2a-token", "short"]) == 2
    assert capsys.readouterr().err == (
        "reach: --a2a-token: an A2A token is 16 to 256 of the characters A-Z a-z 0-9 . _ ~ + / "
        "= - (got 5 characters)\n"
    )


def test_a_missing_extra_is_one_line_naming_it(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(extras, "missing", lambda extra: list(extras.EXTRAS[extra][:1]))
    cfg = Config()
    cfg.a2a.port = 8080
    with pytest.raises(process.StartError) as a2a:
        process.check_a2a(cfg)
    assert str(a2a.value) == (
        "--a2a-port needs the optional extra 'a2a' (a2a-sdk not installed): pip install "
        "'nats-reach[a2a]' (in a clone: pip install -e '.[a2a]')"
    )
    assert main(["mcp"]) == 2
    assert capsys.readouterr().err == (
        "reach: reach mcp needs the optional extra 'mcp' (mcp not installed): pip install "
        "'nats-reach[mcp]' (in a clone: pip install -e '.[mcp]')\n"
    )


def test_without_a_token_of_its_own_the_gateway_takes_the_consoles() -> None:
    pytest.importorskip("a2a.server", reason="needs the extra 'a2a'")
    cfg = Config()
    cfg.a2a.port, cfg.a2a.host = 8080, "0.0.0.0"
    cfg.console.token = "the-console-token-0123"
    process.check_a2a(cfg)  # beyond loopback, yet it starts: it has the console's token
    assert cfg.a2a.token == "the-console-token-0123"
    cfg.a2a.token = "the-gateway-token-4567"
    process.check_a2a(cfg)
    assert (cfg.a2a.token, cfg.console.token) == (
        "the-gateway-token-4567",
        "the-console-token-0123",
    )


def test_a_bad_mcp_environment_is_reach_mcps_usage_error_only(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("REACH_MCP_CALL_TIMEOUT", "abc")
    monkeypatch.setenv("REACH_MCP_PORT", "zz")
    from reach_broker.cli.parser import build_parser

    build_parser()  # every other command still parses: the defaults are read by reach mcp
    with pytest.raises(SystemExit) as exc:
        main(["mcp"])
    assert exc.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        "reach mcp: error: argument --http: invalid int value: 'zz'"
    )
