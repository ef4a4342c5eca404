"""``python -m loadtest.otelcost --base DIR``: what the OpenTelemetry hooks cost when spans are
off (no ``OTEL_EXPORTER_OTLP_ENDPOINT``), as ratios against the code without them.

The hooks (:mod:`reach_agent.otel`) sit on the call path of the caller (``open_call``,
``close_call``, the route request), of the agent (each run and claim) and of the broker (each
route request): when spans are off each is an ``is not None`` test. They cannot be stubbed
out in process, so "without" is another checkout: ``DIR``, the commit before them (``git
worktree add /tmp/reach-base <commit>``). Each slice is a fresh process, run with this tree's
or ``DIR``'s packages first on ``sys.path``, that times sequential ``client.call`` round
trips through a real nats-server, an in-process broker and one in-process agent (claims on,
as by default); slices alternate with and without, the order flipping every round. Figures:
calls per second and this process's CPU microseconds per call (client, broker and agent; not
nats-server), per round and their medians, and the with/without ratios.

    python -m loadtest.otelcost --base /tmp/reach-base --rounds 8 --calls 1000

Each slice's nats-server is its own (a temp store dir), stopped and removed in ``finally``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent.parent

SLICE = """
import asyncio, json, sys, time
import reach_agent
from reach_broker.metrics import Metrics
from reach_broker.service import Broker
from loadtest.local import local_stack

assert reach_agent.__file__.startswith(sys.argv[2]), reach_agent.__file__

async def main(n):
    with local_stack("reach-otelcost-") as (_, server, cfg):
        broker = Broker(cfg, metrics=Metrics())
        await broker.start()
        agent = reach_agent.Agent("oc1", ["otelcost"], durable_acks=False)

        @agent.handler("otelcost")
        async def echo(task):
            return 1

        await agent.start(server.url)
        try:
            async with reach_agent.Client(server.url) as client:
                for _ in range(100):  # warm: route cached, connections hot
                    await client.call("otelcost", {}, timeout=10)
                t0, c0 = time.perf_counter(), time.process_time()
                for _ in range(n):
                    await client.call("otelcost", {}, timeout=10)
                c1, t1 = time.process_time(), time.perf_counter()
        finally:
            await agent.stop(grace=1)
            await broker.stop()
    print(json.dumps({"calls_per_s": n / (t1 - t0), "cpu_us_per_call": (c1 - c0) / n * 1e6}))

asyncio.run(main(int(sys.argv[1])))
"""


def run_slice(tree: Path, calls: int) -> dict[str, float]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env["PYTHONPATH"] = str(tree)
    done = subprocess.run(
        [sys.executable, "-c", SLICE, str(calls), str(tree)], cwd=tree, env=env,
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    if done.returncode != 0:
        raise SystemExit(f"slice in {tree} failed:\n{done.stderr}")
    result: dict[str, float] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m loadtest.otelcost", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--base", type=Path, required=True,
                    help="a checkout without the hooks (the commit before them)")  # fmt: skip
    ap.add_argument("--rounds", type=int, default=8, help="rounds (one slice each way)")
    ap.add_argument("--calls", type=int, default=1000, help="calls per slice")
    args = ap.parse_args()
    per: dict[str, list[dict[str, float]]] = {"with": [], "without": []}
    for r in range(args.rounds):
        for key in ("with", "without") if r % 2 == 0 else ("without", "with"):
            per[key].append(run_slice(HERE if key == "with" else args.base, args.calls))
    out: dict[str, Any] = {}
    for fig in ("calls_per_s", "cpu_us_per_call"):
        ratios = [w[fig] / wo[fig] for w, wo in zip(per["with"], per["without"], strict=True)]
        out[f"{fig}_with"] = round(statistics.median(x[fig] for x in per["with"]), 1)
        out[f"{fig}_without"] = round(statistics.median(x[fig] for x in per["without"]), 1)
        out[f"{fig}_with_vs_without_per_round"] = [round(x, 3) for x in ratios]
        out[f"{fig}_with_vs_without"] = round(statistics.median(ratios), 3)
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
