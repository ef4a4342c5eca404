"""Agent processes killed or stopped under load, with a real broker and nats-server.

The agents are separate processes (``tests/agents/worker.py``) that log every handler start
and finish to a file of their own, so the tests can check what ran where.
"""

from __future__ import annotations

import asyncio
import json
import signal
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from nats.aio.client import Client as NATS

import reach_agent
from reach_agent.connection import flush_subscriptions
from reach_broker.broker import Broker
from reach_broker.cluster.natsserver import NatsServer

from .agents.procs import AgentProcess
from .conftest import wait_for

pytestmark = pytest.mark.slow


def lines(path: Path, kind: str) -> list[str]:
    if not path.exists():
        return []
    return [ln.split()[1] for ln in path.read_text().splitlines() if ln.startswith(kind + " ")]


def healthy(broker: Broker, agent_id: str) -> bool:
    assert broker.registry is not None
    rec = broker.registry.agents.get(agent_id)
    return rec is not None and rec.state == "healthy"


def worker(url: str, tmp: Path, agent_id: str, cap: str, *args: str) -> AgentProcess:
    return AgentProcess("worker.py", url, agent_id, cap, "--log", str(tmp / f"{agent_id}.log"),
                        *args, log_path=tmp / f"{agent_id}.err")  # fmt: skip


async def test_sigkill_mid_stream_every_call_completes_and_none_runs_twice_per_agent(
    nats_server: NatsServer, broker: Broker, tmp_path: Path
) -> None:
    procs = [
        worker(nats_server.url, tmp_path, name, "stream", "--delay", "0.3", "--max", "64")
        for name in ("kill-a", "kill-b")
    ]
    try:
        await wait_for(lambda: healthy(broker, "kill-a") and healthy(broker, "kill-b"), 30,
                       what="both agents healthy")  # fmt: skip
        log_a = tmp_path / "kill-a.log"
        async with reach_agent.Client(nats_server.url) as client:
            rids = [str(uuid.uuid4()) for _ in range(40)]
            calls: list[asyncio.Task[Any]] = []
            for i, rid in enumerate(rids):
                calls.append(asyncio.create_task(
                    client.call("stream", {"n": i}, request_id=rid, timeout=20)))  # fmt: skip
                await asyncio.sleep(0.02)
                if i == 15:
                    # Kill `kill-a` while it is running at least one task.
                    await wait_for(lambda: set(lines(log_a, "start")) - set(lines(log_a, "done")),
                                   10, what="a task in flight on kill-a")  # fmt: skip
                    procs[0].signal(signal.SIGKILL)
            results = await asyncio.wait_for(asyncio.gather(*calls), 60)
        assert [r["n"] for r in results] == list(range(40))
        assert {r["agent"] for r in results} <= {"kill-a", "kill-b"}
        starts_a = lines(log_a, "start")
        starts_b = lines(tmp_path / "kill-b.log", "start")
        # No request id ran its handler twice on the same agent.
        assert [rid for rid, n in Counter(starts_a).items() if n > 1] == []
        assert [rid for rid, n in Counter(starts_b).items() if n > 1] == []
        # Every task lost with kill-a was retried on kill-b with the same request id.
        lost = set(starts_a) - set(lines(log_a, "done"))
        assert lost and lost <= set(starts_b)
        assert {r["agent"] for r, rid in zip(results, rids, strict=True) if rid in lost} == {
            "kill-b"
        }
        # Every call ran somewhere, under the request id it was given.
        assert set(rids) == set(starts_a) | set(starts_b)
        assert procs[0].wait(5) == -signal.SIGKILL
    finally:
        for p in procs:
            p.stop()


class EventLog:
    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []

    async def start(self, nc: NATS) -> EventLog:
        async def cb(msg: Any) -> None:
            self.events.append(json.loads(msg.data))

        await nc.subscribe("reach.event.>", cb=cb)
        await flush_subscriptions(nc)
        return self

    def of(self, agent_id: str) -> list[tuple[str, str | None, str | None]]:
        return [(e["kind"], e.get("from"), e.get("to")) for e in self.events
                if e["agent_id"] == agent_id]  # fmt: skip


async def test_sigterm_under_load_drains_in_flight_and_takes_no_new_tasks(
    nats_server: NatsServer, broker: Broker, nc: NATS, tmp_path: Path
) -> None:
    events = await EventLog().start(nc)
    leaving = worker(nats_server.url, tmp_path, "term-a", "drainable", "--delay", "1.5",
                     "--max", "4")  # fmt: skip
    staying = worker(nats_server.url, tmp_path, "term-b", "drainable", "--delay", "0.05")
    log_a = tmp_path / "term-a.log"
    try:
        await wait_for(lambda: healthy(broker, "term-a") and healthy(broker, "term-b"), 30,
                       what="both agents healthy")  # fmt: skip
        async with reach_agent.Client(nats_server.url) as client:
            # Load term-a directly (sticky to it) with 4 slow tasks.
            key = None
            for i in range(300):
                if (await client.route("drainable", sticky_key=f"s{i}"))[0].agent_id == "term-a":
                    key = f"s{i}"
                    break
            assert key is not None
            slow = [asyncio.create_task(client.call("drainable", {"n": i}, sticky_key=key,
                                                    timeout=20)) for i in range(4)]  # fmt: skip
            await wait_for(lambda: len(lines(log_a, "start")) == 4, 10, what="4 tasks on term-a")
            leaving.signal(signal.SIGTERM)
            await wait_for(lambda: ("left", "healthy", "draining") in events.of("term-a"), 10,
                           what="term-a draining")  # fmt: skip
            # New work while term-a drains goes to term-b only.
            fresh = await asyncio.wait_for(asyncio.gather(*(
                client.call("drainable", {"n": 10 + i}, sticky_key=key, timeout=20)
                for i in range(6))), 30)  # fmt: skip
            assert {r["agent"] for r in fresh} == {"term-b"}
            finished = await asyncio.wait_for(asyncio.gather(*slow), 30)
        assert [(r["agent"], r["n"]) for r in finished] == [("term-a", i) for i in range(4)]
        assert leaving.wait(15) == 0
        assert len(lines(log_a, "start")) == 4
        assert sorted(lines(log_a, "done")) == sorted(lines(log_a, "start"))
        await wait_for(lambda: ("evicted", "draining", None) in events.of("term-a"), 10,
                       what="term-a gone")  # fmt: skip
        kinds = events.of("term-a")
        assert kinds.index(("left", "healthy", "draining")) < kinds.index(
            ("evicted", "draining", None)
        )
        assert broker.registry is not None and "term-a" not in broker.registry.agents
    finally:
        leaving.stop()
        staying.stop()
