"""The processes a run starts: how each is launched, how it is spoken to, how it is ended.

Every child is a subprocess of this one (the broker, the simulated agents, the echo
responder, one request driver per slice), gets SIGTERM if the load tool dies
(``PR_SET_PDEATHSIG``), and is ended by its own PID: :class:`Children` keeps the list, in
start order, and stops them in reverse. Nothing here measures anything.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import json
import signal
import socket
import sys
import time
from collections.abc import Sequence
from typing import Any

PY = sys.executable


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _die_with_parent() -> None:
    """Children get SIGTERM if the load tool dies (Linux), so none is left behind."""
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _append(path: str) -> Any:
    """``path`` opened for appending (the child gets its own copy of the descriptor)."""
    return open(path, "ab")  # closed by the caller once the child has its copy


class Child:
    """A subprocess we started: JSON lines on stdout, commands on stdin, ended by PID."""

    def __init__(self, name: str, proc: asyncio.subprocess.Process) -> None:
        self.name = name
        self.proc = proc
        self.pid = proc.pid
        self._commands = asyncio.Lock()
        """One command at a time: two reading stdout together fail (asyncio allows one
        reader), and one would drop the other's reply as an event of another name."""

    @classmethod
    async def start(cls, name: str, *argv: str, stdin: bool = False, quiet: bool = True,
                    log: str | None = None, err_log: str | None = None) -> Child:  # fmt: skip
        """Start ``argv``; with ``log`` its stdout and stderr are appended to that file (and
        :meth:`read_event` has nothing to read), with ``err_log`` its stderr alone."""
        out: Any = asyncio.subprocess.PIPE
        err: Any = asyncio.subprocess.DEVNULL if quiet else None
        path = log or err_log
        sink = _append(path) if path else None
        try:
            if sink is not None:
                err = sink
                out = sink if log else out
            proc = await asyncio.create_subprocess_exec(
                *argv,
                stdin=asyncio.subprocess.PIPE if stdin else asyncio.subprocess.DEVNULL,
                stdout=out,
                stderr=err,
                preexec_fn=_die_with_parent,
            )
        finally:
            if sink is not None:
                sink.close()
        return cls(name, proc)

    async def read_event(self, within: float) -> dict[str, Any]:
        assert self.proc.stdout is not None
        while True:
            line = await asyncio.wait_for(self.proc.stdout.readline(), within)
            if not line:
                raise RuntimeError(
                    f"{self.name} (pid {self.pid}) exited: rc={self.proc.returncode}"
                )
            with contextlib.suppress(ValueError):
                event = json.loads(line)
                if isinstance(event, dict):
                    return event

    async def wait_event(self, name: str, within: float) -> dict[str, Any]:
        deadline = time.monotonic() + within
        while True:
            event = await self.read_event(max(deadline - time.monotonic(), 0.01))
            if event.get("event") == name:
                return event

    async def command(
        self, cmd: str, reply: str | None = None, within: float = 10.0
    ) -> dict[str, Any]:
        """Send ``cmd`` and wait for its reply event (``reply``, else the command's first
        word). Concurrent commands take turns (nemesis seed 57: two faults healed at once on
        the proxies' controller, and the run failed with asyncio's "readuntil() called while
        another coroutine is already waiting")."""
        assert self.proc.stdin is not None
        async with self._commands:
            self.proc.stdin.write((cmd + "\n").encode())
            await self.proc.stdin.drain()
            return await self.wait_event(reply or cmd.split()[0], within)

    def alive(self) -> bool:
        return self.proc.returncode is None

    async def stop(self, grace: float = 5.0) -> None:
        """SIGTERM, then SIGKILL after ``grace``; only this child's PID."""
        if self.proc.returncode is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            self.proc.send_signal(signal.SIGTERM)
            self.proc.send_signal(signal.SIGCONT)  # a stopped child acts on it only now
        try:
            await asyncio.wait_for(self.proc.wait(), grace)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                self.proc.kill()
            await self.proc.wait()

    async def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            self.proc.kill()
        await self.proc.wait()


class Children:
    """Every child of one run, in start order; the report lists them, none outlives the run."""

    def __init__(self) -> None:
        self._all: list[Child] = []

    async def spawn(self, name: str, *argv: str, stdin: bool = False, quiet: bool = True,
                    log: str | None = None, err_log: str | None = None) -> Child:  # fmt: skip
        child = await Child.start(name, *argv, stdin=stdin, quiet=quiet, log=log,
                                  err_log=err_log)  # fmt: skip
        self._all.append(child)
        return child

    def pids(self) -> dict[str, int]:
        """``<name>-<start index>`` → PID of every child started."""
        return {f"{c.name}-{i}": c.pid for i, c in enumerate(self._all)}

    async def stop_all(self) -> None:
        """Stop every child still running, the last started first."""
        for child in reversed(self._all):
            with contextlib.suppress(Exception):
                await child.stop()

    # --- the command line of each kind of child ------------------------------------------

    async def broker(
        self, url: str, prefix: str, metrics_port: int, config: str, *,
        profile: str | None = None, verbose: bool = False,
    ) -> Child:  # fmt: skip
        """``reach broker`` on ``url``, its /metrics on ``metrics_port`` (cProfile optional)."""
        argv = [PY]
        if profile:
            argv += ["-m", "cProfile", "-o", profile]
        argv += ["-m", "reach_broker.cli", "broker", "--server", url, "--prefix", prefix,
                 "--metrics-port", str(metrics_port), "--log-level", "warning",
                 "--config", config]  # fmt: skip
        return await self.spawn("broker", *argv, quiet=not verbose)

    async def sim(self, name: str, common: Sequence[str], *options: str) -> Child:
        """A ``loadtest.sim`` process (commands on stdin), with the fleet's ``common`` options."""
        return await self.spawn(name, PY, "-m", "loadtest.sim", *common, *options, stdin=True)

    async def echo_responder(self, url: str, reply_bytes: int, max_runtime: float) -> Child:
        """The raw NATS echo responder, answering with ``reply_bytes`` bytes."""
        return await self.spawn("echo", PY, "-m", "loadtest.driver", "echo-server", "--server",
                                url, "--reply-bytes", str(reply_bytes),
                                "--max-runtime", str(max_runtime))  # fmt: skip

    async def drive(
        self, mode: str, url: str, prefix: str, capabilities: Sequence[str], *,
        concurrency: int, seconds: float, warmup: float,
    ) -> dict[str, Any]:  # fmt: skip
        """One ``loadtest.driver`` slice (``route`` or ``echo``): its result line."""
        argv = [PY, "-m", "loadtest.driver", mode, "--server", url, "--prefix", prefix,
                "--concurrency", str(concurrency), "--duration", str(seconds),
                "--warmup", str(warmup)]  # fmt: skip
        for cap in capabilities:
            argv += ["--capability", cap]
        child = await self.spawn(f"driver-{mode}", *argv)
        try:
            return await child.read_event(seconds + warmup + 30)
        finally:
            await child.stop()
