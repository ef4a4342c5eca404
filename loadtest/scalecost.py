"""``python -m loadtest.scalecost``: what one partition costs a broker, for docs/scale.md.

    python -m loadtest.scalecost [--fleet 100000] [--partitions 8 32] [--rounds 5]

In this process, no NATS: the per-partition work a broker does when it takes a partition
over, measured on ``loadtest.sim``'s agents (their announces as the snapshot stores them):

- ``restore_ms``: ``fleet / P`` snapshot values (``SnapshotEntry`` JSON, as in KV
  ``reach_registry``) decoded, validated and restored into a registry
  (``Registry.restore``), then ``Registry.restored`` (medians, scores) — the CPU of a
  takeover's restore, without the KV read (see the KV figures in docs/scale.md);
- ``share_ms``: that partition's route-table shares made (``TableBook.own``: every
  capability's entries, as a new owner publishes them);
- ``follow_ms``: those shares loaded into a follower's tables (``RouteTable.load`` of
  ``SharedMember``s: what the other brokers and callers do with them), and
  ``follow_bytes_per_agent`` (tracemalloc: what a follower holds an agent of them with);
- with ``--kv``, ``kv_read_ms``: the partition's values read back from a JetStream KV bucket
  alone by a consumer of the keys' last values (``jetstream/lastvalues.py``,
  ``Snapshot.restore_partition``'s fallback read, what a KV watch reads; its batched direct
  get, and the whole restore both ways, are ``loadtest.restorecost``'s), on a
  ``nats-server`` this tool starts (file store, loopback).

Each figure is the best of ``--rounds`` (the least disturbed by the rest of the machine).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
import tracemalloc

import msgspec
import nats
import uvloop

from jetstream import lastvalues
from reach_agent.routing.table import RouteTable, SharedMember, TableMember, partition
from reach_agent.wire import schema
from reach_agent.wire.schema import TableRouting
from reach_broker.config import Config
from reach_broker.core.registry import Registry
from reach_broker.core.tables import TableBook
from reach_broker.core.tokens import TokenSigner
from reach_broker.service.snapshot import SnapshotEntry

from .local import local_stack
from .sim import CAPABILITIES, SimAgent

_decode = msgspec.json.Decoder(SnapshotEntry).decode


def values(n: int, seed: int = 7) -> list[tuple[str, bytes]]:
    """``n`` agents' snapshot values (key, JSON), as ``loadtest.sim`` announces them."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        caps = rng.sample(CAPABILITIES, k=rng.randint(1, 3))
        agent = SimAgent(f"sim-{i}", caps, 0, rng)
        entry = SnapshotEntry(announce=agent.announce(5000), state="healthy",
                              last_seen_ms=1_800_000_000_000, broker_id="b",
                              task_ms=agent.task_base_ms)  # fmt: skip
        out.append((agent.agent_id, schema.encoder.encode(entry)))
    return out


def restore(cfg: Config, stored: list[tuple[str, bytes]]) -> tuple[float, Registry]:
    reg = Registry(
        cfg.detection,
        cfg.scoring,
        TokenSigner(b"k" * 32, 3600.0, wall=lambda: 1_800_000_000.0),
        interval_ms=cfg.broker.interval_ms,
    )
    t0 = time.perf_counter()
    for key, value in stored:
        snap = _decode(value)
        ann = schema.validate_announce(snap.announce, key)
        reg.restore(ann, snap.state, 1.0, 1_800_000_000_000, snap.task_ms, warm=True)
    reg.restored(1.0)
    return time.perf_counter() - t0, reg


def kv_read_ms(stored: list[tuple[str, bytes]], rounds: int) -> float:
    """The best of ``rounds`` reads of ``stored``'s last values back from a KV bucket (each
    read checked whole: ``lastvalues`` raises rather than come back short)."""

    async def run() -> float:
        with local_stack("reach-scalecost-") as (_, server, _cfg):
            nc = await nats.connect(server.url)
            js = nc.jetstream()
            kv = await js.create_key_value(bucket="scalecost", history=1)
            for i in range(0, len(stored), 500):
                await asyncio.gather(*(kv.put(k, v) for k, v in stored[i : i + 500]))
            best = 1e9
            for _ in range(rounds):
                t0 = time.perf_counter()
                n = len(await lastvalues.values(nc, "KV_scalecost", "$KV.scalecost.>"))
                assert n == len(stored), n
                best = min(best, (time.perf_counter() - t0) * 1000)
            await nc.close()
            return best

    return uvloop.run(run())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--fleet", type=int, default=100_000)
    p.add_argument("--partitions", type=int, nargs="+", default=[8, 32])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--kv", action="store_true", help="also time the KV read (a nats-server)")
    args = p.parse_args()
    cfg = Config()
    out: dict[str, object] = {"fleet": args.fleet}
    for parts in args.partitions:
        n = args.fleet // parts
        # One partition's agents: ids hashing to partition 0, as its owner would hold them.
        stored = [kv for kv in values(n * parts) if partition(kv[0], parts) == 0]
        best: dict[str, float] = {"restore_ms": 1e9, "share_ms": 1e9, "follow_ms": 1e9}
        for _ in range(args.rounds):
            took, reg = restore(cfg, stored)
            best["restore_ms"] = min(best["restore_ms"], took * 1000)
            book = TableBook(parts, cfg.routing, lambda cap: (True, schema.NO_RULE))
            t0 = time.perf_counter()
            book.own(0, 1, reg.agents, 1.0)
            best["share_ms"] = min(best["share_ms"], (time.perf_counter() - t0) * 1000)
            shares = [book.share(s.partition, cap, 0) for cap in CAPABILITIES
                      for s in book.of(cap)]  # fmt: skip
            members: dict[str, TableMember] = {}
            t0 = time.perf_counter()
            for share in shares:
                table = RouteTable(share.capability, TableRouting(), SharedMember)
                table.load(share, members, 1.0)
            best["follow_ms"] = min(best["follow_ms"], (time.perf_counter() - t0) * 1000)
        tracemalloc.start()
        before = tracemalloc.get_traced_memory()[0]
        held: dict[str, TableMember] = {}
        tables = []
        for share in shares:
            tables.append(RouteTable(share.capability, TableRouting(), SharedMember))
            tables[-1].load(share, held, 1.0)
        best["follow_bytes_per_agent"] = (tracemalloc.get_traced_memory()[0] - before) / len(stored)
        tracemalloc.stop()
        if args.kv:
            best["kv_read_ms"] = kv_read_ms(stored, args.rounds)
        out[f"P={parts}"] = {"agents": len(stored),
                             **{k: round(v, 1) for k, v in best.items()}}  # fmt: skip
    print(json.dumps(out))


if __name__ == "__main__":
    main()
