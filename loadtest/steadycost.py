"""``python -m loadtest.steadycost``: the broker's CPU per heartbeat of a steady fleet, in
process, nats-py's receiving left out.

    python -m loadtest.steadycost [--agents 10000] [--seconds 6] [--profile FILE]

One ``nats-server`` (JetStream, a temporary directory) and, in this process on one uvloop
loop, the broker with all its loops running (route tables, snapshot, prober, observer). The
fleet is ``loadtest.sim``'s (:func:`loadtest.memory.fleet`): every agent announces through
``Handlers.announce``, then heartbeats go to ``Handlers.heartbeat`` paced in real time at
``agents`` a second (each agent once a second), 3 s to warm up, then ``--seconds`` measured.
The figure is the process's CPU time over the heartbeats handled, the broker's loops
included; the cost of making a heartbeat body (the tool's own) is printed beside it.
``--profile FILE``: the measured seconds under cProfile (slower; for where, not how much).
``--no-tables``: the broker publishes no route tables (what they cost, by difference).
Run it from two checkouts, alternated, to compare.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import json
import pstats
import time
from typing import Any

import uvloop

from reach_agent.wire import schema
from reach_broker.broker import Broker

from .local import local_stack
from .memory import fleet

WARM_S = 3.0


async def measure(args: argparse.Namespace) -> dict[str, Any]:
    n = args.agents
    with local_stack("reach-steady-") as (_tmp, _server, cfg):
        cfg.routing.inflight_ceiling = 20 * n  # as python -m loadtest raises it
        cfg.fleet.tables = args.tables
        broker = Broker(cfg)
        await broker.start()
        try:
            agents = fleet(n, cfg.broker.prefix)
            handlers, subjects = broker.handlers, broker.subjects
            for i, agent in enumerate(agents):
                body = schema.encoder.encode(agent.announce(1000))
                reply = handlers.announce(subjects.announce(agent.agent_id), body)
                agent.token = schema.announce_ack_decoder.decode(reply).token
                if i % 256 == 255:
                    await asyncio.sleep(0)

            async def beats(seconds: float) -> int:
                """Heartbeats at ``n`` a second for ``seconds``; how many were handled."""
                t0 = time.monotonic()
                k = 0
                while (elapsed := time.monotonic() - t0) < seconds:
                    due = int(elapsed * n)
                    while k < due:
                        agent = agents[k % n]
                        handlers.heartbeat(agent.subject, agent.heartbeat())
                        k += 1
                        if k % 64 == 0:
                            await asyncio.sleep(0)  # the broker's loops run between
                    await asyncio.sleep(0.002)
                return k

            await beats(WARM_S)
            t = time.process_time()
            for agent in agents:
                agent.heartbeat()
            making_us = (time.process_time() - t) / n * 1e6
            profile = cProfile.Profile() if args.profile else None
            cpu0 = time.process_time()
            if profile is not None:
                profile.enable()
            handled = await beats(args.seconds)
            if profile is not None:
                profile.disable()
            cpu = time.process_time() - cpu0
            if profile is not None:
                profile.dump_stats(args.profile)
                pstats.Stats(args.profile).sort_stats("cumulative").print_stats(40)
            return {
                "agents": n,
                "heartbeats": handled,
                "cpu_s": round(cpu, 3),
                "cpu_us_per_heartbeat": round(cpu / handled * 1e6, 1),
                "making_a_heartbeat_us": round(making_us, 1),
                "states": dict(broker.registry.counts),
            }
        finally:
            await broker.stop()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtest.steadycost",
                                description=__doc__.split("\n")[0])  # fmt: skip
    p.add_argument("--agents", type=int, default=10_000)
    p.add_argument("--seconds", type=float, default=6.0, help="measured (after 3 s warm-up)")
    p.add_argument("--profile", help="cProfile the measured seconds into this file")
    p.add_argument(
        "--no-tables",
        dest="tables",
        action="store_false",
        help="no route tables published ([fleet] tables = false): their share",
    )
    args = p.parse_args(argv)
    print(json.dumps(uvloop.run(measure(args)), indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
