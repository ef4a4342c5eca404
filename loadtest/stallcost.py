"""``python -m loadtest.stallcost``: how long one broker's event loop stops while a fleet
registers, and what the garbage collector's full collections take of it.

    python -m loadtest.stallcost [--agents 25000] [--settle 10] [--no-freeze]
                                 [--in-flight 256]

One ``nats-server`` (JetStream, a temporary directory) and, in this process on one uvloop
loop, a broker with all its loops running, its heap frozen after each full collection as
the ``reach broker`` process has it (:mod:`reach_broker.heap`; ``--no-freeze``: not).
``--agents`` agents (``loadtest.sim``'s) announce over NATS from a connection of their own,
``--in-flight`` at once (256, about one simulator's; the whole fleet: a storm of
re-announces, as after a broker restarted with an empty KV asks every agent); a route
request goes every 100 ms from another; a watcher on the same loop sleeps 5 ms at a time
and counts each oversleep past 50 ms as a stall. The measure runs
from the first announce until ``--settle`` seconds after the last (the snapshot, the tables
and the events written). Printed: the stalls (count, longest, the ten longest with when),
the slowest route request, every full collection (when, how long) and the registration's
time. Run it alternated with ``--no-freeze`` to compare; the figures are the machine's, the
ratios the change's.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import time
from typing import Any

import nats
import uvloop

from reach_agent.wire import schema
from reach_broker.broker import Broker
from reach_broker.heap import FrozenHeap
from reach_broker.service.metrics import Metrics

from .local import local_stack
from .memory import fleet

IN_FLIGHT = 256
"""Announces awaiting their answer at once, by default (about as ``loadtest.sim`` sends
them)."""
WATCH_S = 0.005
STALL_S = 0.05
"""The watcher sleeps ``WATCH_S``; an oversleep longer than ``STALL_S`` is a stall."""


class Collections:
    """The full collections seen (``gc.callbacks``): (when, seconds) from ``t0``."""

    def __init__(self, t0: float) -> None:
        self.t0 = t0
        self.full: list[tuple[float, float]] = []
        self._start = 0.0

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        now = time.perf_counter()
        if phase == "start":
            self._start = now
        elif info["generation"] == 2:
            self.full.append((round(self._start - self.t0, 2), round(now - self._start, 3)))


async def measure(args: argparse.Namespace) -> dict[str, Any]:
    n = args.agents
    with local_stack("reach-stall-") as (_tmp, server, cfg), contextlib.ExitStack() as heap:
        cfg.routing.inflight_ceiling = 20 * n  # as python -m loadtest raises it
        broker = Broker(cfg, metrics=Metrics())
        await broker.start()
        announcer = await nats.connect(server.url, pending_size=64 * 1024 * 1024)
        router = await nats.connect(server.url)
        stalls: list[tuple[float, float]] = []
        slowest = [0.0]
        done = asyncio.Event()
        t0 = time.perf_counter()
        seen = Collections(t0)
        gc.callbacks.append(seen)
        if args.freeze:
            heap.enter_context(FrozenHeap(asyncio.get_running_loop()).installed())

        async def watch() -> None:
            while not done.is_set():
                t = time.perf_counter()
                await asyncio.sleep(WATCH_S)
                over = time.perf_counter() - t - WATCH_S
                if over > STALL_S:
                    stalls.append((round(t - t0, 2), round(over, 3)))

        async def routes() -> None:
            subject = f"{cfg.broker.prefix}.route.text_processing"
            while not done.is_set():
                t = time.perf_counter()
                with contextlib.suppress(Exception):  # a refusal or a timeout: its time counts
                    await router.request(subject, b"", timeout=5.0)
                slowest[0] = max(slowest[0], time.perf_counter() - t)
                await asyncio.sleep(0.1)

        sem = asyncio.Semaphore(args.in_flight)
        subjects = broker.subjects

        async def announce(agent: Any) -> None:
            body = schema.encoder.encode(agent.announce(10_000))
            async with sem:
                await announcer.request(subjects.announce(agent.agent_id), body, timeout=30.0)

        beside = [asyncio.create_task(watch()), asyncio.create_task(routes())]
        try:
            await asyncio.gather(*(announce(a) for a in fleet(n, cfg.broker.prefix)))
            registered = time.perf_counter() - t0
            await asyncio.sleep(args.settle)
        finally:
            done.set()
            await asyncio.gather(*beside)
            gc.callbacks.remove(seen)
            await announcer.close()
            await router.close()
            await broker.stop()
        longest = sorted(stalls, key=lambda s: -s[1])
        return {
            "agents": n,
            "freeze": args.freeze,
            "registered_s": round(registered, 2),
            "stalls": len(stalls),
            "stall_max_s": longest[0][1] if longest else 0.0,
            "stalls_longest": longest[:10],
            "route_slowest_s": round(slowest[0], 3),
            "full_collections": seen.full,
        }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtest.stallcost",
                                description=__doc__.split("\n")[0])  # fmt: skip
    p.add_argument("--agents", type=int, default=25_000)
    p.add_argument("--settle", type=float, default=10.0, help="seconds measured after the last")
    p.add_argument("--in-flight", type=int, default=IN_FLIGHT,
                   help=f"announces awaiting their answer at once ({IN_FLIGHT})")  # fmt: skip
    p.add_argument(
        "--no-freeze",
        dest="freeze",
        action="store_false",
        help="no frozen heap (reach_broker/heap.py): full collections walk it all",
    )
    args = p.parse_args(argv)
    print(json.dumps(uvloop.run(measure(args))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
