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
    python -m loadtest.otelcost --base /tmp/reach-base --instructions --calls 400
    python -m loadtest.otelcost --base /tmp/reach-base --python-calls --calls 1000

``--python-calls`` counts Python function calls per call instead (cProfile; reproducible on a
noisy machine, though the timers of the broker and the agent add a little per second of wall
time). ``--instructions`` counts instead of timing (valgrind's callgrind: reproducible on a noisy
machine): instructions per call of the slice process, from the difference of a 100-call and
a ``--calls`` run in each tree, so start-up cancels out.

Each slice's nats-server is its own (a temp store dir), stopped and removed in ``finally``.
"""

from __future__ import annotations

import argparse
import json
import os
import pstats
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent.parent

SLICE = """
import asyncio, json, sys, time
import reach_agent
try:
    from reach_broker.broker import Broker
    from reach_broker.service.metrics import Metrics
except ImportError:  # a checkout from before the subpackages (issue 22)
    from reach_broker.service import Broker
    from reach_broker.metrics import Metrics
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


def run_slice(
    tree: Path, calls: int, wrap: list[str] | None = None
) -> tuple[dict[str, float], str]:
    """One slice's figures (and its stderr), in a fresh process on ``tree``'s packages."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env["PYTHONPATH"] = str(tree)
    done = subprocess.run(
        [*(wrap or []), sys.executable, "-c", SLICE, str(calls), str(tree)], cwd=tree, env=env,
        capture_output=True, text=True, timeout=3600,
    )  # fmt: skip
    if done.returncode != 0:
        raise SystemExit(f"slice in {tree} failed:\n{done.stderr}")
    result: dict[str, float] = json.loads(done.stdout.strip().splitlines()[-1])
    return result, done.stderr


CALLGRIND = ["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null"]


def python_calls(tree: Path, small: int, large: int) -> float:
    """Python function calls per call of the slice process (cProfile's count: the same on
    a noisy machine), from the difference of a ``large`` and a ``small`` run."""
    counts = []
    for n in (small, large):
        with tempfile.TemporaryDirectory(prefix="reach-otelcost-") as tmp:
            out = Path(tmp) / "profile"
            wrap = [sys.executable, "-m", "cProfile", "-o", str(out)]
            env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
            env["PYTHONPATH"] = str(tree)
            script = Path(tmp) / "slice.py"
            script.write_text(SLICE)
            done = subprocess.run([*wrap, str(script), str(n), str(tree)], cwd=tree, env=env,
                                  capture_output=True, text=True, timeout=3600)  # fmt: skip
            if done.returncode != 0:
                raise SystemExit(f"slice in {tree} failed:\n{done.stderr}")
            counts.append(pstats.Stats(str(out)).total_calls)  # type: ignore[attr-defined]
    return (counts[1] - counts[0]) / (large - small)


def instructions(tree: Path, small: int, large: int) -> float:
    """Instructions per call of the slice process (client, broker and agent; valgrind's
    callgrind, which counts them reproducibly): the difference of a ``large`` and a
    ``small`` run, over the calls between, so start-up and warm-up cancel out."""
    counts = []
    for n in (small, large):
        _, err = run_slice(tree, n, CALLGRIND)
        found = re.search(r"Collected : (\d+)", err)
        if found is None:
            raise SystemExit(f"no instruction count from callgrind:\n{err[-2000:]}")
        counts.append(int(found.group(1)))
    return (counts[1] - counts[0]) / (large - small)


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m loadtest.otelcost", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--base", type=Path, required=True,
                    help="a checkout without the hooks (the commit before them)")  # fmt: skip
    ap.add_argument("--rounds", type=int, default=8, help="rounds (one slice each way)")
    ap.add_argument("--calls", type=int, default=1000, help="calls per slice")
    ap.add_argument("--instructions", action="store_true",
                    help="instead: instructions per call under callgrind, with and without "
                         "(runs of 100 and --calls calls in each tree)")  # fmt: skip
    ap.add_argument("--python-calls", action="store_true",
                    help="instead: Python function calls per call (cProfile), with and "
                         "without (runs of 400 and 400 + --calls calls in each tree)")  # fmt: skip
    args = ap.parse_args()
    if args.python_calls:
        with_ = python_calls(HERE, 400, 400 + args.calls)
        without = python_calls(args.base, 400, 400 + args.calls)
        print(json.dumps({"python_calls_per_call_with": round(with_, 1),
                          "python_calls_per_call_without": round(without, 1),
                          "with_vs_without": round(with_ / without, 4)}, indent=2))  # fmt: skip
        return
    if args.instructions:
        with_ = instructions(HERE, 100, args.calls)
        without = instructions(args.base, 100, args.calls)
        print(json.dumps({"instructions_per_call_with": round(with_),
                          "instructions_per_call_without": round(without),
                          "with_vs_without": round(with_ / without, 4)}, indent=2))  # fmt: skip
        return
    per: dict[str, list[dict[str, float]]] = {"with": [], "without": []}
    for r in range(args.rounds):
        for key in ("with", "without") if r % 2 == 0 else ("without", "with"):
            per[key].append(run_slice(HERE if key == "with" else args.base, args.calls)[0])
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
