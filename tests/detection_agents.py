"""Agent processes for the detection tests: ``loadtest.chaos_agent`` as a real child process,
so SIGKILL and SIGSTOP mean what they say. Always cleaned up (SIGCONT, then SIGKILL)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
from collections.abc import AsyncIterator
from pathlib import Path

from reach_broker.core.records import AgentRecord, Transition

ROOT = Path(__file__).resolve().parent.parent


async def spawn_agent(url: str, agent_id: str, *args: str) -> asyncio.subprocess.Process:
    """Start an agent and wait (10 s at most) until it has announced."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "loadtest.chaos_agent", "--server", url, "--id", agent_id, *args,
        cwd=ROOT, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    assert proc.stdout is not None
    try:
        line = await asyncio.wait_for(proc.stdout.readline(), 10.0)
    except BaseException:
        await stop_agent(proc)
        raise
    assert line.decode().strip() == f"ready {agent_id}", line
    return proc


async def stop_agent(proc: asyncio.subprocess.Process) -> None:
    """SIGCONT (a frozen agent must not stay stopped), SIGKILL, reap. Idempotent."""
    if proc.returncode is None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGCONT)
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        await asyncio.wait_for(proc.wait(), 10.0)


@contextlib.asynccontextmanager
async def agents(
    url: str, *specs: tuple[str, list[str]]
) -> AsyncIterator[dict[str, asyncio.subprocess.Process]]:
    procs: dict[str, asyncio.subprocess.Process] = {}
    try:
        for agent_id, args in specs:
            procs[agent_id] = await spawn_agent(url, agent_id, *args)
        yield procs
    finally:
        for proc in procs.values():
            await stop_agent(proc)


class Transitions:
    """Records a broker's transitions for assertions: one of its watchers
    (``Broker(cfg, watchers=[seen])``)."""

    def __init__(self) -> None:
        self.items: list[Transition] = []

    def __call__(self, t: Transition, rec: AgentRecord | None) -> None:
        self.items.append(t)

    def of(self, agent_id: str) -> list[tuple[str | None, str | None, str]]:
        return [(t.from_, t.to, t.reason) for t in self.items
                if t.agent_id == agent_id and t.kind == "state"]  # fmt: skip

    def reached(self, agent_id: str, state: str) -> bool:
        return any(t.to == state for t in self.items if t.agent_id == agent_id)
