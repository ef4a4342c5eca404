"""``python -m loadtest.stickycost``: what routing with sticky keys costs the broker, in time
per route request and in memory per agent.

One registry of ``--agents`` agents of one capability and the broker's real route handler
(:func:`loadtest.routecost.handlers`: subject, decode, router, encode; no NATS). Kinds timed
in turn, ``--rounds`` times: ``plain`` (an empty body: the yardstick of the same run),
``sticky_new`` (``{"sticky_key": ...}``, a key never asked before each time), ``sticky_again``
(500 keys asked over and over) and ``sticky_churn`` (the 500 keys, while one agent leaves and
another joins every ``--churn-every`` requests: a membership change). Each figure is the
best round's microseconds per request. ``bytes_per_agent`` is what the registry and its
index hold per agent once a sticky route has been answered (tracemalloc; the process's own
baseline subtracted). With ``--warm-slots`` a key of each of the 4,096 sticky-key slots
(docs/protocol.md, "Sticky keys") is asked first, not timed, and ``bytes_per_agent_warm`` is
what is held then: a capability's slots all remembered, its steady state. Run it from two
checkouts (``PYTHONPATH=<checkout>``) to compare a change with its parent, alternated.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import time
import tracemalloc

from reach_agent.wire.schema import Announce

from .routecost import CAP, handlers

SUBJECT = f"reach.route.{CAP}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--agents", type=int, default=1000)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--batch", type=int, default=2000, help="requests per kind and round")
    p.add_argument("--churn-every", type=int, default=100)
    p.add_argument("--warm-slots", action="store_true",
                   help="ask a key of every sticky-key slot first (not timed)")  # fmt: skip
    args = p.parse_args()

    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    h = handlers(args.agents)
    keys = [f'{{"sticky_key":"user-{i}"}}'.encode() for i in range(500)]
    h.route(SUBJECT, keys[0], "caller-1")  # the first sticky route (a ring was built here)
    held = tracemalloc.get_traced_memory()[0] - base
    held_warm = None
    if args.warm_slots:
        for key in slot_keys():
            h.route(SUBJECT, key, "caller-1")
        held_warm = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()

    reg, now = h.registry, [1.0]
    spare = [0]

    def churn() -> None:
        """One agent leaves, another joins: the capability's membership changes."""
        spare[0] += 1
        reg.evict(f"a{spare[0] % args.agents}", "churn", now[0])
        ann = Announce(agent_id=f"a{spare[0] % args.agents}", capabilities=[CAP],
                       max_concurrency=10, heartbeat_interval_ms=1000)  # fmt: skip
        reg.announce(ann, now[0], 0)

    fresh = iter(f'{{"sticky_key":"new-{i}"}}'.encode() for i in range(10**9))

    def run(kind: str) -> float:
        n = args.batch
        if kind == "sticky_again":
            for key in keys:  # asked before (not timed): they are remembered
                h.route(SUBJECT, key, "caller-1")
        t0 = time.perf_counter()
        for i in range(n):
            if kind == "plain":
                h.route(SUBJECT, b"", "caller-1")
                continue
            if kind == "sticky_new":
                h.route(SUBJECT, next(fresh), "caller-1")
                continue
            if kind == "sticky_churn" and i % args.churn_every == 0:
                churn()
            h.route(SUBJECT, keys[i % 500], "caller-1")
        return (time.perf_counter() - t0) / n * 1e6

    best: dict[str, float] = {}
    for _ in range(args.rounds):
        for kind in ("plain", "sticky_new", "sticky_again", "sticky_churn"):
            us = run(kind)
            best[kind] = min(best.get(kind, us), us)
    print(json.dumps({
        "agents": args.agents,
        "us_per_request": {k: round(v, 2) for k, v in best.items()},
        "sticky_again_over_plain": round(best["sticky_again"] / best["plain"], 3),
        "bytes_per_agent": round(held / args.agents),
        **({} if held_warm is None else
           {"bytes_per_agent_warm": round(held_warm / args.agents)}),
    }))  # fmt: skip


def slot_keys() -> list[bytes]:
    """A route body for one key of each of the 4,096 slots (the top 12 bits of the key's
    blake2b-64), computed here so the same keys are asked of a checkout without slots."""
    bodies: dict[int, bytes] = {}
    i = 0
    while len(bodies) < 4096:
        key = f"slot-{i}"
        digest = hashlib.blake2b(key.encode(), digest_size=8).digest()
        bodies.setdefault(int.from_bytes(digest, "big") >> 52, f'{{"sticky_key":"{key}"}}'.encode())
        i += 1
    return list(bodies.values())


if __name__ == "__main__":
    main()
