"""``python -m loadtest.tracecost``: what trace propagation costs on the call path, as ratios.

Trace propagation (:mod:`reach_agent.trace`) adds, per call, a context-variable read, a
generated ``traceparent`` (or a child of the task's) and ``Reach-Trace-Id`` — two headers
more on the wire — and, per task on the agent, one small context object set in a context
variable. "Without" swaps the ``trace`` module the call and serving code use for a stub that
does what the code did before (pass a given ``traceparent`` through, nothing else), in the
same process; slices alternate with and without, the order flipping every round.

* ``build``: a call's headers, in-process (``Call(...)`` and one attempt's headers), outside
  a task (``top``) and inside one (``nested``: the hops and trace inherited); nanoseconds
  per call (this process's CPU time), best round.
* ``loopback``: sequential ``client.call`` round trips through a real nats-server, an
  in-process broker and one in-process agent; calls per second, per round and overall,
  and this process's CPU microseconds per call (best round).

    python -m loadtest.tracecost --rounds 6 --calls 500

The nats-server is ours (a temp store dir) and is stopped, and the dir removed, in
``finally``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import time
import types
from collections.abc import Iterator
from typing import Any

from reach_agent import trace
from reach_agent.agent import serving
from reach_agent.client import calls
from reach_agent.wire import schema

from .local import echo_stack

CAP = "tracecost"


class _NoVar:
    def set(self, value: Any) -> None:
        return None

    def get(self) -> None:
        return None


def _untraced(hdrs: dict[str, str], traceparent: str | None) -> None:
    if traceparent:
        hdrs[schema.H_TRACEPARENT] = traceparent


_STUB = types.SimpleNamespace(outgoing=_untraced, CURRENT=_NoVar(),
                              TraceContext=lambda *a: None)  # fmt: skip


@contextlib.contextmanager
def mode(traced: bool) -> Iterator[None]:
    """With trace propagation (the code as it is) or without (the stub)."""
    if traced:
        yield
        return
    calls.trace, serving.trace = _STUB, _STUB  # type: ignore[assignment]
    try:
        yield
    finally:
        calls.trace, serving.trace = trace, trace  # type: ignore[assignment]


def build_ns(n: int, nested: bool) -> float:
    """Nanoseconds per call to build a call's headers and one attempt's."""
    task = {schema.H_HOPS: "up"}
    trace.outgoing(task, None)  # what a task from an SDK caller carries
    ctx = trace.TraceContext("rq-parent", "alpha", task)
    token = trace.CURRENT.set(ctx if nested else None)
    try:
        t0 = time.process_time()
        for i in range(n):
            c = calls.Call(str(i), CAP, b"{}", None, request_id=None, traceparent=None,
                           ack_mode="completed", deadline=1e9)  # fmt: skip
            c.attempt_headers(0.0)
        return (time.process_time() - t0) / n * 1e9
    finally:
        trace.CURRENT.reset(token)


async def loopback(rounds: int, n: int) -> dict[str, Any]:
    async with echo_stack("reach-tracecost-", CAP) as client:
        per: dict[str, list[float]] = {"with": [], "without": []}
        cpu: dict[str, list[float]] = {"with": [], "without": []}
        for r in range(rounds):
            order = (True, False) if r % 2 == 0 else (False, True)
            for traced in order:
                key = "with" if traced else "without"
                with mode(traced):
                    t0, c0 = time.perf_counter(), time.process_time()
                    for _ in range(n):
                        await client.call(CAP, {}, timeout=10)
                    c1 = time.process_time()
                    per[key].append(n / (time.perf_counter() - t0))
                    cpu[key].append((c1 - c0) / n * 1e6)
    ratios = [w / wo for w, wo in zip(per["with"], per["without"], strict=True)]
    return {
        "calls_per_s_with": round(statistics.median(per["with"]), 1),
        "calls_per_s_without": round(statistics.median(per["without"]), 1),
        "with_vs_without_per_round": [round(x, 3) for x in ratios],
        "with_vs_without": round(statistics.median(ratios), 3),
        # CPU of this process (client, broker and agent; not nats-server) per call, best
        # round: what a shared machine's noise moves least.
        "cpu_us_per_call_with": round(min(cpu["with"]), 1),
        "cpu_us_per_call_without": round(min(cpu["without"]), 1),
        "cpu_with_vs_without": round(min(cpu["with"]) / min(cpu["without"]), 3),
    }


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m loadtest.tracecost", description=__doc__)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--calls", type=int, default=500, help="loopback calls per slice")
    ap.add_argument("--build", type=int, default=20_000, help="in-process builds per slice")
    args = ap.parse_args()
    out: dict[str, Any] = {}
    for kind in ("top", "nested"):
        per: dict[bool, list[float]] = {True: [], False: []}
        for r in range(args.rounds):
            for traced in (True, False) if r % 2 == 0 else (False, True):
                with mode(traced):
                    per[traced].append(build_ns(args.build, kind == "nested"))
        best_with, best_without = min(per[True]), min(per[False])
        out[f"build_{kind}_ns_with"] = round(best_with)
        out[f"build_{kind}_ns_without"] = round(best_without)
        out[f"build_{kind}_with_vs_without"] = round(best_with / best_without, 3)
    out["loopback"] = asyncio.run(loopback(args.rounds, args.calls))
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
