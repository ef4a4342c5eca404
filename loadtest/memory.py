"""``python -m loadtest.memory``: where the broker's memory per agent goes, by module.

    python -m loadtest.memory [--agents 10000] [--beats 5] [--top 15] [--rss] [--report F]

One ``nats-server`` (JetStream, file store, a temporary directory), and in this process on
one uvloop loop the broker and its console's feed (the audit trail followed, the fleet
sampled), with ``tracemalloc`` on. The fleet is ``loadtest.sim``'s (the same announces and
drifting heartbeats), handed to the broker's own handlers (``Handlers.announce``,
``Handlers.heartbeat``) on a clock this tool advances, so what is measured does not depend
on how busy the machine is: nobody goes silent, nothing flaps. Every agent announces, then
``--beats`` rounds of one heartbeat each (one second of the broker's clock a round), as
``python -m loadtest`` waits a few heartbeats before it reads the RSS; then the events are
published and read back by the console, the snapshot written, and the live allocations are
compared with those after the broker started. Each block is counted where it was allocated
(an agent's record is ``records.py``'s, its announce ``msgspec``'s, via ``schema.py``).

``--rss`` runs without ``tracemalloc`` (whose own records would count) and gives the
process's RSS growth per agent instead: what the allocator keeps, freed blocks included.
``cpu_s`` is the process's CPU time from the first announce until the broker settled (the
tool's own encoding included; compare it between checkouts with ``--rss``).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import random
import sys
import time
import tracemalloc
from typing import Any

import uvloop

from reach_agent.wire import schema
from reach_agent.wire.subjects import Subjects
from reach_broker.broker import Broker
from reach_broker.console.feed import Feed

from .local import local_stack
from .procfs import rss_bytes
from .sim import CAPABILITIES, SimAgent


class Clock:
    """The broker's clocks, advanced by the tool."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now

    def wall(self) -> float:
        return 1_800_000_000.0 + self.now


def fleet(n: int, prefix: str) -> list[SimAgent]:
    """``loadtest.sim``'s agents (same capabilities and load figures)."""
    rng = random.Random(1)
    subjects = Subjects(prefix)
    agents = []
    for i in range(n):
        agent_id = f"sim0-{i:05d}"
        caps = rng.sample(CAPABILITIES, rng.randint(1, 3))
        agent = SimAgent(agent_id, caps, 0, random.Random(rng.random()))
        agent.subject = subjects.heartbeat(agent_id)
        agents.append(agent)
    return agents


async def settle(broker: Broker, feed: Feed) -> None:
    """Until the events are published and read back, and the snapshot is written."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        made = sum(s.value for m in broker.metrics.registry_changes.collect()
                   for s in m.samples if s.name.endswith("_total"))  # fmt: skip
        follow = feed._follow
        read = follow.delivered if follow is not None else made
        if not broker.snapshot._dirty and not broker.fanout._outbox and read >= made:
            await asyncio.sleep(0.5)  # the last batch's acknowledgements
            return
        await asyncio.sleep(0.1)
    raise RuntimeError("the broker did not settle within 120 s")


async def measure(args: argparse.Namespace) -> dict[str, Any]:
    n = args.agents
    clock = Clock()
    with local_stack("reach-memory-") as (_tmp, _server, cfg):
        cfg.routing.inflight_ceiling = 20 * n  # as python -m loadtest raises it
        broker = Broker(cfg, clock=clock.monotonic, wall=clock.wall, console=True)
        await broker.start()
        feed = broker.feed
        assert feed is not None  # console=True: the broker builds and starts its feed
        try:
            agents = fleet(n, cfg.broker.prefix)
            bodies = [schema.encoder.encode(a.announce(1000)) for a in agents]
            subjects = broker.subjects
            gc.collect()
            base = tracemalloc.take_snapshot() if tracemalloc.is_tracing() else None
            rss0 = rss_bytes(os.getpid()) if base is None else None
            cpu0 = time.process_time()
            handlers = broker.handlers
            for i, (agent, body) in enumerate(zip(agents, bodies, strict=True)):
                ack = schema.announce_ack_decoder.decode(
                    handlers.announce(subjects.announce(agent.agent_id), body)
                )
                agent.token = ack.token
                if i % 256 == 255:
                    await asyncio.sleep(0)  # the broker's other tasks run, as between messages
            for _ in range(args.beats):
                for i, agent in enumerate(agents):
                    clock.now += 1.0 / n
                    handlers.heartbeat(agent.subject, agent.heartbeat())
                    if i % 256 == 255:
                        await asyncio.sleep(0)
            await settle(broker, feed)
            cpu_s = time.process_time() - cpu0
            gc.collect()
            snap = tracemalloc.take_snapshot() if base is not None else None
            rss1 = rss_bytes(os.getpid()) if base is None else None
            counts = dict(broker.registry.counts)
        finally:
            await broker.stop()
    out: dict[str, Any] = {"agents": n, "beats": args.beats, "states": counts,
                           "cpu_s": round(cpu_s, 2)}  # fmt: skip
    if rss0 is not None and rss1 is not None:
        out["rss_bytes_per_agent"] = round((rss1 - rss0) / n, 1)
    if snap is not None and base is not None:
        mine = [tracemalloc.Filter(False, __file__)]  # the tool's own fleet is not the broker's
        snap, base = snap.filter_traces(mine), base.filter_traces(mine)
        rows: dict[str, int] = {}
        for stat in snap.compare_to(base, "filename"):
            name = module_of(stat.traceback[0].filename)
            rows[name] = rows.get(name, 0) + stat.size_diff
        out["python_bytes_per_agent"] = round(sum(rows.values()) / n, 1)
        out["by_module"] = {
            k: round(v / n, 1)
            for k, v in sorted(rows.items(), key=lambda kv: -kv[1])
            if abs(v) >= n
        }
        out["top_lines"] = {
            f"{module_of(s.traceback[0].filename)}:{s.traceback[0].lineno}": round(
                s.size_diff / n, 1
            )
            for s in snap.compare_to(base, "lineno")[: args.top]
        }
    return out


def module_of(filename: str) -> str:
    """A file's name relative to the tree or the packages it is in."""
    for marker in ("site-packages/", "/lib/python3", os.getcwd() + "/"):
        if marker in filename:
            tail = filename.split(marker, 1)[1]
            return tail.split("/", 1)[1] if marker == "/lib/python3" else tail
    return filename


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtest.memory",
                                description=__doc__.split("\n")[0])  # fmt: skip
    p.add_argument("--agents", type=int, default=10_000)
    p.add_argument("--beats", type=int, default=5, help="heartbeats per agent after announcing")
    p.add_argument("--top", type=int, default=15, help="lines of source listed")
    p.add_argument("--rss", action="store_true", help="RSS growth only (no tracemalloc)")
    p.add_argument("--report", help="write the JSON here too")
    args = p.parse_args(argv)
    if not args.rss:
        tracemalloc.start()
    out = uvloop.run(measure(args))
    text = json.dumps(out, indent=2)
    if args.report:
        with open(args.report, "w") as f:
            f.write(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
