"""SIGKILL of one Synadia Agent Protocol agent: how long reach and their own caller SDK go
on offering it, and what a caller then gets from each.

    .venv/bin/python -m loadtest.synadia_sigkill      (from a checkout; about 95 s)

One embedded nats-server (the advisories config), one broker with its default config, one
agent hosted by their PyPI host SDK (``tests/agents/synadia_agent.py``, default 30 s
heartbeat) and their caller SDK (``synadia_ai.agents.Agents``: discovery plus its heartbeat
tracker, default slack 3 beats). The agent is killed just after a heartbeat — the tracker's
worst case; killed at a random moment it says offline 60-90 s later. Prints one JSON line.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import nats
from synadia_ai.agents import Agents

import reach_agent
from reach_agent.wire.errors import NoReachableAgent
from reach_agent.wire.schema import RouteRequest
from reach_broker.broker import Broker
from reach_broker.cluster.natsserver import NatsServer
from reach_broker.config import Config

ROOT = Path(__file__).resolve().parent.parent
CAP = "echo-bot"


async def _until(pred: Any, limit_s: float, step: float = 0.002) -> float:
    """Seconds until ``pred()`` holds (polled), or raise after ``limit_s``."""
    t0 = time.monotonic()
    while not pred():
        if time.monotonic() - t0 > limit_s:
            raise TimeoutError(f"not within {limit_s}s")
        await asyncio.sleep(step)
    return time.monotonic() - t0


async def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        server = NatsServer(port=0, store_dir=Path(tmp) / "nats")
        server.start()
        try:
            print(json.dumps(await measure(server.url)), flush=True)
        finally:
            server.stop()


async def measure(url: str) -> dict[str, Any]:
    cfg = Config()
    cfg.nats.url = url
    cfg.broker.metrics_port = 0
    broker = Broker(cfg)
    await broker.start()
    nc = await nats.connect(url)
    theirs = Agents(nc=nc)
    await theirs.start_tracking()
    beats: list[float] = []
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "tests.agents.synadia_agent", "--server", url, cwd=ROOT,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        instance = (await asyncio.wait_for(proc.stdout.readline(), 20)).decode().split()[1]
        theirs.on_heartbeat(instance, lambda hb: beats.append(time.monotonic()))

        def offered() -> bool:
            try:
                return bool(broker.router.route(CAP, RouteRequest(limit=3), broker.clock()))
            except NoReachableAgent:
                return False

        def online() -> bool:
            live = theirs.liveness(instance)
            return live is not None and live.is_online

        await _until(lambda: offered() and online() and beats, 40)
        [agent] = await theirs.discover()
        os.kill(proc.pid, signal.SIGKILL)
        t_kill = time.monotonic()
        reach_s = await _until(lambda: not offered(), 10)
        async with reach_agent.Client(url) as client:
            try:
                await client.call(CAP, "hi", timeout=5)
                reach_caller = "answered"
            except reach_agent.ReachError as exc:
                reach_caller = f"{exc.code}: {exc.message}"
        t_theirs = time.monotonic()
        try:
            async for _ in agent.prompt("hi", timeout=5):
                pass
            their_caller = "answered"
        except Exception as exc:  # noqa: BLE001 - what their caller gets, whatever it is
            their_caller = f"{type(exc).__name__}: {exc}"
        their_prompt_s = time.monotonic() - t_theirs
        rediscovered = len(await theirs.discover())
        tracker_s = time.monotonic() - t_kill + await _until(lambda: not online(), 120, 0.05)
        return {
            "reach_unoffered_s": round(reach_s, 4),
            "reach_caller_gets": reach_caller,
            "their_tracker_offline_s": round(tracker_s, 2),
            "their_heartbeat_interval_s": 30,
            "their_prompt_to_dead_instance": their_caller,
            "their_prompt_error_after_s": round(their_prompt_s, 3),
            "their_discover_after_kill": rediscovered,
        }
    finally:
        if proc.returncode is None:
            proc.kill()
        await proc.wait()
        with contextlib.suppress(Exception):
            await theirs.close()
        await nc.close()
        await broker.stop()


if __name__ == "__main__":
    asyncio.run(main())
