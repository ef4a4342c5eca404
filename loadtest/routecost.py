"""``python -m loadtest.routecost``: the broker's route handler in-process, per kind of request.

One registry with ``--agents`` agents of one capability (half in region ``eu``), the real
``Handlers.route`` (subject, decode, router, encode; no NATS), and kinds of request timed in
turn, ``--rounds`` times alternated: ``plain`` (an empty body, the SDK's), ``filtered``
(``{"region": "eu"}``) and, where the code has it, ``explain``. Each figure is the best round's
microseconds per request (the least disturbed by whatever else the machine runs); the ratios
compare kinds of the same run. Run it from two checkouts (``PYTHONPATH=<checkout>``) to compare
a change's plain path with its parent's.
"""

from __future__ import annotations

import argparse
import json
import random
import time
import types
from collections.abc import Callable

from reach_agent.schema import Announce, Heartbeat, RouteRequest
from reach_agent.subjects import Subjects
from reach_broker.config import Config
from reach_broker.handlers import Handlers
from reach_broker.metrics import Metrics
from reach_broker.registry import Registry
from reach_broker.routing import Router
from reach_broker.tokens import TokenSigner

CAP = "summarize"


def handlers(agents: int) -> Handlers:
    """The broker's handlers over ``agents`` healthy agents, ranked as a route would."""
    cfg = Config()
    reg = Registry(cfg, TokenSigner(b"k" * 32, 3600.0, wall=lambda: 1_000_000.0))
    subjects = Subjects("reach")
    router = Router(cfg.routing, reg.indexes, subjects.task, inflight=lambda: reg.inflight,
                    capacity=lambda: reg.capacity,
                    rng=random.Random(1))  # fmt: skip
    for i in range(agents):
        ann = Announce(agent_id=f"a{i}", capabilities=[CAP], max_concurrency=10,
                       heartbeat_interval_ms=1000, region=("eu", "us")[i % 2])  # fmt: skip
        rec, _ = reg.announce(ann, 0.0, 0)
        hb = Heartbeat(agent_id=rec.agent_id, token=rec.token, seq=1, active=i % 8, ok_total=1,
                       task_ms_p50=100 + i % 50)  # fmt: skip
        reg.heartbeat(hb, 0.5, 0)
    # Only what Handlers reads of its context (no connection: nothing is sent).
    ctx = types.SimpleNamespace(metrics=Metrics(), subjects=subjects, clock=lambda: 1.0,
                                wall=lambda: 1000.0, wall_ms=lambda: 10**6, nc=None)  # fmt: skip
    return Handlers(ctx, reg, router)  # type: ignore[arg-type]


def per_request_us(call: Callable[[], object], n: int) -> float:
    t0 = time.perf_counter()
    for _ in range(n):
        call()
    return (time.perf_counter() - t0) / n * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--agents", type=int, default=1000)
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--batch", type=int, default=5000, help="plain/filtered requests per round")
    args = p.parse_args()
    h = handlers(args.agents)
    subject = f"reach.route.{CAP}"
    bodies = {"plain": b"", "filtered": json.dumps({"region": "eu"}).encode()}
    if "explain" in RouteRequest.__struct_fields__:
        bodies["explain"] = json.dumps({"explain": True}).encode()
    best: dict[str, float] = {}
    for _ in range(args.rounds):
        for kind, body in bodies.items():
            n = max(args.batch // 50, 20) if kind == "explain" else args.batch
            us = per_request_us(lambda body=body: h.route(subject, body), n)  # type: ignore[misc]
            best[kind] = min(best.get(kind, us), us)
    out: dict[str, object] = {"agents": args.agents, "us_per_request": {
        k: round(v, 2) for k, v in best.items()}}  # fmt: skip
    if "explain" in best:
        out["explain_over_plain"] = round(best["explain"] / best["plain"], 1)
    out["filtered_over_plain"] = round(best["filtered"] / best["plain"], 3)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
