"""``python -m loadtest.once``: what a fleet-wide claim costs per call, and stream throughput.

    python -m loadtest.once [--calls 400] [--rounds 6] [--concurrency 1,16] \
        [--chunks 20000] [--window 64] [--sync always|default] [--report once.json]

One ``nats-server`` (JetStream, file store), a broker, one agent and one client, all in
this process on one uvloop loop. The agent serves two capabilities with the same trivial
handler: ``bench.claimed`` (each task claims its request id in KV ``reach_claims`` and ends
the claim before replying: two JetStream round trips) and ``bench.idem`` (marked
idempotent: no claim). Rounds alternate the two, ``--calls`` calls each, with every
concurrency in ``--concurrency`` (calls in flight at once), so machine noise hits both
alike; the figure is the ratio of medians (claimed / idempotent) of per-call latency and of
calls per second. For scale, the median round trip of one bare claim create (a JetStream
KV publish) is measured in the same run. Then one stream of ``--chunks`` string chunks is
read as fast as possible (``--window`` ahead of credit): chunks per second.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import uvloop

import reach_agent
from jetstream.claims import ClaimStore
from reach_broker.broker import Broker

from .calls import SYNC_MODES
from .local import local_stack


def build_agent(url: str) -> reach_agent.Agent:
    agent = reach_agent.Agent("bench-agent", ["bench.claimed", "bench.idem", "bench.stream"],
                              max_concurrency=256, heartbeat_interval=1.0,
                              idempotent={"bench.idem"})  # fmt: skip

    async def echo(task: reach_agent.Task) -> Any:
        return task.payload

    async def tokens(task: reach_agent.Task) -> AsyncIterator[str]:
        for i in range(int(task.payload["chunks"])):
            yield f"tok{i} "

    agent.handler("bench.claimed")(echo)
    agent.handler("bench.idem")(echo)
    agent.handler("bench.stream")(tokens)
    return agent


async def calls(client: reach_agent.Client, cap: str, n: int, concurrency: int) -> dict[str, float]:
    """``n`` calls, ``concurrency`` in flight: (median latency µs, calls per second)."""
    latencies: list[float] = []
    todo = iter(range(n))

    async def caller() -> None:
        for _ in todo:
            t0 = time.perf_counter()
            await client.call(cap, {"x": 1}, request_id=str(uuid.uuid4()), timeout=30)
            latencies.append(time.perf_counter() - t0)

    t0 = time.perf_counter()
    await asyncio.gather(*(caller() for _ in range(concurrency)))
    wall = time.perf_counter() - t0
    return {"median_us": statistics.median(latencies) * 1e6, "per_s": n / wall}


async def run(args: argparse.Namespace) -> dict[str, Any]:
    with local_stack("reach-once-", args.sync) as (tmp, server, cfg):
        async with Broker(cfg):
            agent = build_agent(server.url)
            agent.ack_wal_dir = str(Path(tmp) / "acks")
            async with agent.serve(server.url), reach_agent.Client(server.url) as client:
                for _ in range(200):  # the agent is routable once the broker has it
                    try:
                        await client.route("bench.claimed", limit=1)
                        break
                    except reach_agent.ReachError:
                        await asyncio.sleep(0.05)
                for cap in ("bench.claimed", "bench.idem"):  # warm-up
                    await calls(client, cap, 50, 4)
                assert agent.tasks.claimer is not None and agent.tasks.claimer.refused == 0
                rounds: dict[str, dict[str, list[dict[str, float]]]] = {}
                for conc in args.concurrency:
                    per = rounds.setdefault(str(conc), {"claimed": [], "idem": []})
                    for _ in range(args.rounds):
                        for name in ("claimed", "idem"):
                            per[name].append(await calls(client, f"bench.{name}", args.calls, conc))
                store = ClaimStore(client.nc)
                creates = []
                for _ in range(500):
                    t0 = time.perf_counter()
                    await store.create(f"bench-{uuid.uuid4()}", b"{}")
                    creates.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                n = 0
                async for _ in client.stream("bench.stream", {"chunks": args.chunks},
                                             window=args.window, timeout=300):  # fmt: skip
                    n += 1
                stream_s = time.perf_counter() - t0
    out: dict[str, Any] = {"sync": args.sync, "calls_per_round": args.calls,
                           "rounds": args.rounds,
                           "claim_create_us": statistics.median(creates) * 1e6}  # fmt: skip
    for conc, per in rounds.items():
        med = {k: statistics.median(r["median_us"] for r in v) for k, v in per.items()}
        rate = {k: statistics.median(r["per_s"] for r in v) for k, v in per.items()}
        out[f"concurrency_{conc}"] = {
            "latency_us": med,
            "calls_per_s": rate,
            "latency_ratio": med["claimed"] / med["idem"],
            "throughput_ratio": rate["claimed"] / rate["idem"],
            "added_us_per_call": med["claimed"] - med["idem"],
        }
    out["stream"] = {"chunks": n, "window": args.window, "seconds": stream_s,
                     "chunks_per_s": n / stream_s}  # fmt: skip
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtest.once", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--calls", type=int, default=400, help="calls per round and capability")
    p.add_argument("--rounds", type=int, default=6, help="alternated rounds per concurrency")
    p.add_argument("--concurrency", default="1,16", help="comma-separated calls in flight")
    p.add_argument("--chunks", type=int, default=20_000, help="chunks of the streamed answer")
    p.add_argument("--window", type=int, default=64, help="the stream's credit window")
    p.add_argument("--sync", choices=SYNC_MODES, default="always",
                   help="the server's JetStream fsync: the shipped sync_interval: always, or "
                        "nats-server's default (every 2 min); run both, alternated, to see "
                        "what always costs")  # fmt: skip
    p.add_argument("--report", default=None, help="write the figures as JSON here")
    args = p.parse_args(argv)
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    figures = uvloop.run(run(args))
    text = json.dumps(figures, indent=2)
    print(text)
    if args.report:
        Path(args.report).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
