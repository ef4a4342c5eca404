"""``python -m loadtest.scalecost``: what one partition costs a broker, for docs/scale.md.

    python -m loadtest.scalecost [--fleet 100000] [--partitions 8 32] [--rounds 5]

In this process, no NATS: the per-partition work a broker does when it takes a partition
over, measured on ``loadtest.sim``'s agents (their announces as the snapshot stores them):

- ``restore_ms``: ``fleet / P`` snapshot values (``SnapshotEntry`` JSON, as in KV
  ``reach_registry``) decoded, validated and restored into a registry
  (``Registry.restore``), then ``Registry.restored`` (medians, scores) — the CPU of a
  takeover's restore, without the KV read (a watch delivering those values; see the KV
  figure in docs/scale.md);
- ``share_ms``: that partition's route-table shares made (``TableBook.own``: every
  capability's entries, as a new owner publishes them);
- ``follow_ms``: those shares loaded into a follower's tables (``RouteTable.load`` of
  ``SharedMember``s: what the other brokers and callers do with them).

Each figure is the best of ``--rounds`` (the least disturbed by the rest of the machine).
"""

from __future__ import annotations

import argparse
import json
import random
import time

import msgspec

from reach_agent.routing.table import RouteTable, SharedMember, TableMember, partition
from reach_agent.wire import schema
from reach_agent.wire.schema import TableRouting
from reach_broker.config import Config
from reach_broker.core.registry import Registry
from reach_broker.core.tables import TableBook
from reach_broker.core.tokens import TokenSigner
from reach_broker.service.snapshot import SnapshotEntry

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
    reg = Registry(cfg, TokenSigner(b"k" * 32, 3600.0, wall=lambda: 1_800_000_000.0))
    t0 = time.perf_counter()
    for key, value in stored:
        snap = _decode(value)
        ann = schema.validate_announce(snap.announce, key)
        reg.restore(ann, snap.state, 1.0, 1_800_000_000_000, snap.task_ms)
    reg.restored(1.0)
    return time.perf_counter() - t0, reg


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--fleet", type=int, default=100_000)
    p.add_argument("--partitions", type=int, nargs="+", default=[8, 32])
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    cfg = Config()
    out: dict[str, object] = {"fleet": args.fleet}
    for parts in args.partitions:
        n = args.fleet // parts
        # One partition's agents: ids hashing to partition 0, as its owner would hold them.
        stored = [kv for kv in values(n * parts) if partition(kv[0], parts) == 0]
        best = {"restore_ms": 1e9, "share_ms": 1e9, "follow_ms": 1e9}
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
        out[f"P={parts}"] = {"agents": len(stored),
                             **{k: round(v, 1) for k, v in best.items()}}  # fmt: skip
    print(json.dumps(out))


if __name__ == "__main__":
    main()
