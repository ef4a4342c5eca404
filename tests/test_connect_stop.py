"""A process whose NATS server is unreachable says so, and stops when asked.

Real processes against a loopback port nothing listens on (a typo in ``NATS_URL``, or a
server not started yet): an SDK agent (``reach_agent.run``), the HTTP sidecar (``reach adapt
http``), ``reach broker --server`` and ``reach mcp`` (a ``reach_agent.Client``). Each logs
its failed first connects (``<role>.connect_failed server=… error=…``, rate-limited), and
SIGTERM or SIGINT ends the wait at once: exit status non-zero, one line saying it never
connected. The in-process ``Client`` is checked the same way with a stop event.
"""

from __future__ import annotations

import asyncio
import logging
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

import reach_agent
from reach_agent.connection import NotConnected

HERE = Path(__file__).parent


def nowhere() -> str:
    """The URL of a loopback port nothing listens on (bound, then closed)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"nats://127.0.0.1:{s.getsockname()[1]}"


def argv_of(which: str, url: str) -> tuple[list[str], str]:
    """(the command, the role its connect_failed lines name)."""
    cli = [sys.executable, "-m", "reach_broker"]
    return {
        "sdk agent": ([sys.executable, str(HERE / "agents" / "design_agent.py")], "agent"),
        "http sidecar": ([*cli, "adapt", "http", "--agent-id", "side", "--capability", "text",
                          "--url", "http://127.0.0.1:9/", "--server", url], "agent"),
        "reach broker": ([*cli, "broker", "--server", url, "--metrics-port", "0"], "broker"),
        "reach mcp": ([*cli, "mcp", "--server", url], "client"),
    }[which]  # fmt: skip


class Lines:
    """A process's stderr, line by line, read in a thread (a blocking pipe)."""

    def __init__(self, stream: Any) -> None:
        self.seen: list[str] = []
        self._q: queue.Queue[str | None] = queue.Queue()
        self.reader = threading.Thread(target=self._read, args=(stream,), daemon=True)
        self.reader.start()

    def _read(self, stream: Any) -> None:
        for line in stream:
            self._q.put(line.rstrip("\n"))
        self._q.put(None)

    def until(self, predicate: Any, limit_s: float) -> None:
        deadline = time.monotonic() + limit_s
        while not predicate(self.seen):
            left = deadline - time.monotonic()
            assert left > 0, "\n".join(self.seen)
            try:
                line = self._q.get(timeout=left)
            except queue.Empty:
                continue
            assert line is not None, "the process ended early:\n" + "\n".join(self.seen)
            self.seen.append(line)

    def rest(self, limit_s: float) -> list[str]:
        deadline = time.monotonic() + limit_s
        while (left := deadline - time.monotonic()) > 0:
            try:
                line = self._q.get(timeout=left)
            except queue.Empty:
                break
            if line is None:
                break
            self.seen.append(line)
        return self.seen


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
@pytest.mark.parametrize("which", ["sdk agent", "http sidecar", "reach broker", "reach mcp"])
def test_an_unreachable_server_is_logged_and_a_signal_ends_the_wait(
    which: str, sig: signal.Signals
) -> None:
    url = nowhere()
    argv, role = argv_of(which, url)
    env = {k: v for k, v in os.environ.items() if not k.startswith("NATS_")}
    env.update(NATS_URL=url, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)  # fmt: skip
    lines = None
    try:
        assert proc.stderr is not None
        lines = Lines(proc.stderr)
        failed = f"{role}.connect_failed "

        def two_failures(seen: list[str]) -> bool:
            return sum(failed in line for line in seen) >= 2

        lines.until(two_failures, 20)
        said = [line for line in lines.seen if failed in line]
        assert f"server={url} error=ConnectionRefusedError" in said[0], said[0]
        assert said[0].endswith("attempts=1: no NATS server accepted the connection yet; "
                                "trying again")  # fmt: skip
        assert proc.poll() is None
        sent = time.monotonic()
        proc.send_signal(sig)
        code = proc.wait(5)
        took = time.monotonic() - sent
        assert took < 2.0, f"{which} took {took:.2f}s to stop"
        assert code != 0
        never = [line for line in lines.rest(2) if "never connected" in line]
        assert len(never) == 1, lines.seen
        assert f"never connected to {url}: stopped after " in never[0]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        if lines is not None:
            lines.reader.join(5)  # it ends at the pipe's end, once the process is gone
        if proc.stderr is not None:
            proc.stderr.close()


async def test_a_client_logs_each_failed_connect_and_a_stop_event_ends_the_wait(
    caplog: pytest.LogCaptureFixture,
) -> None:
    url = nowhere()
    caplog.set_level(logging.WARNING, logger="reach_agent.connection")
    client = reach_agent.Client(url, reach_agent.ClientConfig(connect_timeout_s=30),
                                name="lonely")  # fmt: skip
    stop = asyncio.Event()
    starting = asyncio.ensure_future(client.start(stop=stop))
    for _ in range(400):
        if any("client.connect_failed client=lonely" in r.getMessage() for r in caplog.records):
            break
        await asyncio.sleep(0.01)
    stop.set()
    with pytest.raises(NotConnected) as never:
        await asyncio.wait_for(starting, 2)
    assert str(never.value).startswith(f"client 'lonely' never connected to {url}: stopped after")
    said = [r.getMessage() for r in caplog.records if "connect_failed" in r.getMessage()]
    assert said[0].startswith(f"client.connect_failed client=lonely server={url} error=")
