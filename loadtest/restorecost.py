"""``python -m loadtest.restorecost``: a partition's restore, by direct get and by watch.

    python -m loadtest.restorecost [--agents 3125] [--partitions 32] [--others 31]
                                   [--rounds 5] [--batch 1024]

On a ``nats-server`` this tool starts (``loadtest.local``: loopback, file store), KV
``reach_registry`` is provisioned from its definition and filled with ``--agents`` agents of
partition 0 and as many of each of ``--others`` other partitions (``loadtest.sim``'s
announces, stored as the snapshot stores them), so the read filters one partition out of
the bucket. Then ``Snapshot.restore_partition(0)`` runs into a fresh registry each round, the
whole takeover restore (keys read, decoded, validated, restored, ``Registry.restored``):

- ``direct``: the bucket's stream has ``allow_direct`` (the definition): the keys are read
  by batched direct get, ``--batch`` a page;
- ``watch``: the stream's ``allow_direct`` turned off for the round, so the restore falls
  back to a consumer of the keys' last values (``lastvalues.values``; until 2026-12-05 a
  nats-py KV watch, which now and then read none: see :mod:`jetstream.lastvalues`).

The two alternate, round by round (the stream updated between them; which read ran is
checked on the snapshot's counters, and that every agent came back). After each restore the
same read runs alone, without the restore (``directget.values``; ``lastvalues.values``):
``*_read``. Printed: one JSON line, the best and the median of each (ms) and the ratios
(watch / direct). The fill is written with the server's default ``sync_interval`` (a read
does not depend on it).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from typing import Any

import nats
import uvloop
from nats.aio.client import Client as NATS

from jetstream import directget, lastvalues
from jetstream.directget import BATCH
from jetstream.names import REGISTRY_BUCKET, REGISTRY_STREAM
from jetstream.provision import load_definitions, provision
from reach_agent.routing.table import partition
from reach_agent.wire import schema
from reach_agent.wire.subjects import Subjects
from reach_broker.config import Config
from reach_broker.core.registry import Registry
from reach_broker.core.tokens import TokenSigner
from reach_broker.service.context import BrokerContext, Link, Tasks
from reach_broker.service.metrics import Metrics
from reach_broker.service.snapshot import Snapshot, SnapshotEntry

from .local import local_stack
from .sim import CAPABILITIES, SimAgent

READS = ("direct", "watch")


def fleet(agents: int, partitions: int, others: int, seed: int = 7) -> list[tuple[str, bytes]]:
    """``agents`` agents of partition 0 and of each of ``others`` more: their keys' subjects
    and stored values, as the snapshot writes them."""
    rng = random.Random(seed)
    count = dict.fromkeys(range(others + 1), 0)
    out: list[tuple[str, bytes]] = []
    i = 0
    while len(out) < agents * len(count):
        agent_id = f"sim-{i}"
        i += 1
        p = partition(agent_id, partitions)
        if count.get(p, agents) == agents:
            continue
        count[p] += 1
        agent = SimAgent(agent_id, rng.sample(CAPABILITIES, k=rng.randint(1, 3)), 0, rng)
        entry = SnapshotEntry(announce=agent.announce(5000), state="healthy",
                              last_seen_ms=1_800_000_000_000, broker_id="b",
                              task_ms=agent.task_base_ms)  # fmt: skip
        subject = f"$KV.{REGISTRY_BUCKET}.{partitions}.{p}.{agent_id}"
        out.append((subject, schema.encoder.encode(entry)))
    return out


async def fill(nc: NATS, stored: list[tuple[str, bytes]], chunk: int = 1000) -> None:
    """Write every key, ``chunk`` publishes pipelined at a time."""
    js = nc.jetstream(timeout=30.0)
    for i in range(0, len(stored), chunk):
        futures = [await js.publish_async(subject, value)
                   for subject, value in stored[i : i + chunk]]  # fmt: skip
        await asyncio.gather(*futures)


async def set_direct(nc: NATS, on: bool) -> None:
    """Turn the registry stream's ``allow_direct`` on or off."""
    reply = await nc.request(f"$JS.API.STREAM.INFO.{REGISTRY_STREAM}", b"", timeout=10)
    cfg = json.loads(reply.data)["config"]
    cfg["allow_direct"] = on
    reply = await nc.request(f"$JS.API.STREAM.UPDATE.{REGISTRY_STREAM}", json.dumps(cfg).encode(),
                             timeout=10)  # fmt: skip
    if "error" in json.loads(reply.data):
        raise RuntimeError(f"allow_direct={on} refused: {reply.data!r}")


async def restore_once(nc: NATS, partitions: int, batch: int) -> tuple[float, int, dict[str, int]]:
    """One ``restore_partition(0)`` into a fresh registry: (seconds, agents restored, reads)."""
    cfg = Config()
    reg = Registry(cfg.detection, cfg.scoring, TokenSigner(b"k" * 32, 3600.0),
                   interval_ms=cfg.broker.interval_ms, partitions=partitions)  # fmt: skip
    ctx = BrokerContext(nc=nc, subjects=Subjects(), broker_id="restorecost",
                        clock=time.monotonic, wall=time.time, spawn=Tasks().spawn,
                        emit=lambda _: None, link=Link())  # fmt: skip
    counted = Metrics().snapshot_reads
    snap = Snapshot(ctx, reg, reads=counted)
    snap.direct_batch = batch
    await snap.start()
    try:
        t0 = time.perf_counter()
        ids = await snap.restore_partition(0, warm=True)
        took = time.perf_counter() - t0
    finally:
        await snap.stop()
    return took, len(ids), {by: int(counted.labels(by)._value.get()) for by in ("direct", "watch")}


async def read_once(nc: NATS, read: str, keys: str, batch: int) -> tuple[float, int]:
    """The partition's values read alone, no restore: (seconds, values)."""
    t0 = time.perf_counter()
    subjects = f"$KV.{REGISTRY_BUCKET}.{keys}"
    if read == "direct":
        got = len(await directget.values(nc, REGISTRY_STREAM, subjects, batch=batch))
    else:
        got = len(await lastvalues.values(nc, REGISTRY_STREAM, subjects))
    return time.perf_counter() - t0, got


async def run(args: argparse.Namespace) -> dict[str, Any]:
    stored = fleet(args.agents, args.partitions, args.others)
    with local_stack("reach-restorecost-", sync="default") as (_, server, _cfg):
        nc = await nats.connect(server.url)
        try:
            await provision(nc, load_definitions(names=(REGISTRY_STREAM,)))
            await fill(nc, stored)
            took: dict[str, list[float]] = {f"{read}_{what}": [] for read in READS
                                            for what in ("restore", "read")}  # fmt: skip
            for _ in range(args.rounds):
                for read in READS:
                    await set_direct(nc, read == "direct")
                    seconds, restored, reads = await restore_once(nc, args.partitions, args.batch)
                    if restored != args.agents or reads[read] != 1:
                        raise RuntimeError(f"{read}: restored {restored} of {args.agents}, "
                                           f"reads {reads}")  # fmt: skip
                    took[f"{read}_restore"].append(seconds * 1000)
                    seconds, got = await read_once(nc, read, f"{args.partitions}.0.*", args.batch)
                    if got != args.agents:
                        raise RuntimeError(f"{read}: read {got} of {args.agents}")
                    took[f"{read}_read"].append(seconds * 1000)
        finally:
            await nc.close()
    out: dict[str, Any] = {"agents": args.agents, "keys_in_bucket": len(stored),
                           "batch": args.batch, "rounds": args.rounds}  # fmt: skip
    for name, ms in took.items():
        out[name] = {"best_ms": round(min(ms), 1), "median_ms": round(statistics.median(ms), 1)}
    for what in ("restore", "read"):
        watch, direct = out[f"watch_{what}"], out[f"direct_{what}"]
        out[f"{what}_watch_over_direct"] = {
            k.removesuffix("_ms"): round(watch[k] / direct[k], 2) for k in ("best_ms", "median_ms")
        }
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--agents", type=int, default=3125, help="agents per partition")
    p.add_argument("--partitions", type=int, default=32, help="P, the fleet's partition count")
    p.add_argument("--others", type=int, default=None,
                   help="other partitions filled too (default: P - 1: all)")  # fmt: skip
    p.add_argument("--rounds", type=int, default=5, help="restores of each kind")
    p.add_argument("--batch", type=int, default=BATCH, help="keys a direct-get page asks for")
    args = p.parse_args()
    if args.others is None:
        args.others = args.partitions - 1
    print(json.dumps(uvloop.run(run(args))))


if __name__ == "__main__":
    main()
