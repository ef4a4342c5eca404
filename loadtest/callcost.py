"""``python -m loadtest.callcost --base REF``: a call's path with this tree's code against the
code of a git ref (the same path without a change: ``REF`` is the commit before it), as
ratios, alternated in the same run.

Each slice is a child process that starts a nats-server (a temp store dir), an in-process
broker and one in-process agent (no claims, no durable acks: the lightest path, where a
change's own cost weighs most) and times sequential ``client.call`` round trips after a
warm-up: calls per second, and the child's CPU microseconds per call (client, broker and
agent; not nats-server). The slices alternate — this tree, then the ref's, the order
flipping every round — and the ratios are taken round by round. The ref's ``reach_agent``,
``reach_broker`` and ``jetstream`` are exported with ``git archive`` to a temp directory put
first on the child's ``PYTHONPATH`` (this module, and ``loadtest``, stay this tree's).

    python -m loadtest.callcost --base HEAD~1 --rounds 8 --calls 2000

On a shared, noisy machine the timed ratios swing; ``--callgrind`` counts instructions
instead (valgrind's callgrind, the child process only: client, broker and agent, not
nats-server): each tree runs ``--calls`` and ``4 x --calls`` round trips, and the difference
over ``3 x --calls`` is the instructions of one call, which noise does not move.

    python -m loadtest.callcost --base HEAD~1 --callgrind --calls 200

Made for the cancellation plumbing (issue 26: every task an agent runs is findable by a
cancel, every call can be cancelled); any change on the call path can be measured the same way.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
CAP = "callcost"
PACKAGES = ("reach_agent", "reach_broker", "jetstream")


async def child(calls: int, warm: int) -> dict[str, float]:
    """One slice: ``calls`` sequential round trips after ``warm`` (this process's code)."""
    from .local import echo_stack

    async with echo_stack("reach-callcost-", CAP, warm) as client:
        t0, c0 = time.perf_counter(), time.process_time()
        for _ in range(calls):
            await client.call(CAP, {}, timeout=10)
        c1, t1 = time.process_time(), time.perf_counter()
    return {"calls_per_s": calls / (t1 - t0), "cpu_us_per_call": (c1 - c0) / calls * 1e6}


def export(ref: str, into: Path) -> str:
    """The ref's packages in ``into`` (made if missing); the commit it names."""
    into.mkdir(parents=True, exist_ok=True)
    commit = subprocess.run(["git", "rev-parse", "--short", ref], cwd=ROOT, check=True,
                            capture_output=True, text=True).stdout.strip()  # fmt: skip
    archive = subprocess.run(["git", "archive", commit, *PACKAGES], cwd=ROOT, check=True,
                             capture_output=True).stdout  # fmt: skip
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return commit


def slice_of(tree: Path | None, calls: int, warm: int) -> dict[str, float]:
    """Run one child; ``tree`` (the ref's packages) first on its path, else this tree's."""
    env = dict(os.environ)
    path = [str(tree)] if tree is not None else []
    env["PYTHONPATH"] = os.pathsep.join([*path, str(ROOT)])
    out = subprocess.run(
        [sys.executable, "-m", "loadtest.callcost", "--child", "--calls", str(calls),
         "--warm", str(warm)], cwd=ROOT, env=env, check=True, capture_output=True, text=True,
        timeout=600,
    )  # fmt: skip
    return json.loads(out.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def instructions(tree: Path | None, calls: int, warm: int, out: Path) -> int:
    """The instructions (callgrind's ``Ir``) of one child run of ``calls`` round trips."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([*([str(tree)] if tree else []),
                                                        str(ROOT)]))  # fmt: skip
    subprocess.run(
        ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", sys.executable, "-m",
         "loadtest.callcost", "--child", "--calls", str(calls), "--warm", str(warm)],
        cwd=ROOT, env=env, check=True, capture_output=True, timeout=3600,
    )  # fmt: skip
    for line in out.read_text().splitlines():
        if line.startswith(("totals:", "summary:")):
            return int(line.split()[1])
    raise RuntimeError(f"no totals in {out}")


def count(base: str, calls: int, warm: int) -> dict[str, Any]:
    """Instructions per call, this tree and the ref's, by the difference of two runs."""
    with tempfile.TemporaryDirectory(prefix="reach-callcost-base-") as tmp:
        commit = export(base, Path(tmp) / "tree")
        per: dict[str, float] = {}
        for key, tree in (("with", None), ("without", Path(tmp) / "tree")):
            few = instructions(tree, calls, warm, Path(tmp) / f"{key}-few.out")
            many = instructions(tree, 4 * calls, warm, Path(tmp) / f"{key}-many.out")
            per[key] = (many - few) / (3 * calls)
    return {
        "base": commit,
        "instructions_per_call_with": round(per["with"]),
        "instructions_per_call_without": round(per["without"]),
        "instructions_with_vs_without": round(per["with"] / per["without"], 4),
    }


def compare(base: str, rounds: int, calls: int, warm: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="reach-callcost-base-") as tmp:
        commit = export(base, Path(tmp))
        per: dict[str, list[dict[str, float]]] = {"with": [], "without": []}
        for r in range(rounds):
            for key in ("with", "without") if r % 2 == 0 else ("without", "with"):
                per[key].append(slice_of(None if key == "with" else Path(tmp), calls, warm))
    rate = [w["calls_per_s"] / wo["calls_per_s"] for w, wo in zip(per["with"], per["without"],
                                                                  strict=True)]  # fmt: skip
    cpu = [w["cpu_us_per_call"] / wo["cpu_us_per_call"]
           for w, wo in zip(per["with"], per["without"], strict=True)]  # fmt: skip
    return {
        "base": commit,
        "calls_per_slice": calls,
        "calls_per_s_with": round(statistics.median(s["calls_per_s"] for s in per["with"]), 1),
        "calls_per_s_without": round(
            statistics.median(s["calls_per_s"] for s in per["without"]), 1
        ),
        "with_vs_without_per_round": [round(x, 3) for x in rate],
        "with_vs_without": round(statistics.median(rate), 3),
        "cpu_us_per_call_with": round(min(s["cpu_us_per_call"] for s in per["with"]), 1),
        "cpu_us_per_call_without": round(min(s["cpu_us_per_call"] for s in per["without"]), 1),
        "cpu_with_vs_without_per_round": [round(x, 3) for x in cpu],
        "cpu_with_vs_without": round(statistics.median(cpu), 3),
    }


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m loadtest.callcost", description=__doc__)
    ap.add_argument("--base", default="HEAD~1", help="the git ref whose code is 'without'")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--calls", type=int, default=2000, help="timed calls per slice")
    ap.add_argument("--warm", type=int, default=200, help="untimed calls first, per slice")
    ap.add_argument("--callgrind", action="store_true",
                    help="count instructions (valgrind) instead of timing")  # fmt: skip
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(asyncio.run(child(args.calls, args.warm))))
        return
    if args.callgrind:
        print(json.dumps(count(args.base, args.calls, args.warm), indent=2))
        return
    print(json.dumps(compare(args.base, args.rounds, args.calls, args.warm), indent=2))


if __name__ == "__main__":
    main()
