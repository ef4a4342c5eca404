"""``python -m loadtest.hbcost``: the broker's heartbeat path in-process, per way it is heard.

One registry with ``--agents`` healthy agents, the real heartbeat endpoint (admission, decode,
registry, counters; no NATS) and the ingest's callbacks (:mod:`reach_broker.service.ingest`)
in front of it, timed in turn, ``--rounds`` times alternated over the same agents, each pass
one heartbeat per agent with the next ``seq`` (every one accepted, as a fleet's are: the
report's ``accepted`` must equal ``heartbeats``; a repeated ``seq`` is refused ``stale`` early
and costs a fraction of it), one second of the broker's clock apart:

- ``endpoint``: the endpoint's callback alone (what a plain subscription called before
  partitioned ingest);
- ``mapped``: a partition's mapped subscription (``<p>.part.<n>.hb.<id>``): the partition's
  heartbeat counter, then the endpoint;
- ``plain``: the fallback on a server that does not map (``<p>.hb.<id>``): the agent id's
  partition looked up (cached), kept if owned, counted, then the endpoint.

Each figure is the best pass's microseconds per heartbeat; the ratios compare ways of the
same run. Run it from two checkouts (``PYTHONPATH=<checkout>``: a checkout without the ingest
times ``endpoint`` alone) to compare the endpoint itself with its parent's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from typing import Any

from nats.aio.msg import Msg

from reach_agent.routing.table import partition
from reach_agent.wire.schema import Announce
from reach_agent.wire.subjects import Subjects
from reach_broker.config import Config
from reach_broker.core.explain import Explainer
from reach_broker.core.quotas import Quotas
from reach_broker.core.registry import Registry
from reach_broker.core.routing import Router
from reach_broker.core.tokens import TokenSigner
from reach_broker.service.context import BrokerContext, Link, Tasks
from reach_broker.service.handlers import Handlers
from reach_broker.service.metrics import HandlerMetrics, Metrics

P = 32


class Clock:
    """The broker's clock: ``step`` seconds later at every reading (one a heartbeat)."""

    def __init__(self, step: float) -> None:
        self.now = 1.0
        self.step = step

    def __call__(self) -> float:
        self.now += self.step
        return self.now


def build(agents: int) -> tuple[Handlers, Any, list[tuple[str, str, str]], Metrics]:
    """The handlers over ``agents`` announced agents (each agent's heartbeats a second apart
    on the broker's clock), an ingest in front of them when the checkout has one, and each
    agent's (plain subject, mapped subject, token)."""
    cfg = Config()
    clock = Clock(1.0 / agents)
    reg = Registry(cfg.detection, cfg.scoring, TokenSigner(b"k" * 32, 3600),
                   interval_ms=cfg.broker.interval_ms, partitions=P)  # fmt: skip
    m = Metrics()
    subjects = Subjects()
    from reach_agent.routing.rules import Rules

    rules = Rules({})
    router = Router(cfg.routing, reg.indexes, subjects.task, inflight=lambda: reg.inflight,
                    capacity=lambda: reg.capacity, rules=rules)  # fmt: skip
    nc: Any = None
    ctx = BrokerContext(nc=nc, subjects=subjects, broker_id="bench", clock=clock,
                        wall=time.time, spawn=Tasks().spawn, emit=lambda t: None,
                        link=Link())  # fmt: skip
    h = Handlers(ctx, reg, router, Quotas(cfg.quotas, rules), Explainer(router, cfg.scoring),
                 HandlerMetrics.of(m), on_unknown=lambda a: None,
                 announced=lambda r: None)  # fmt: skip
    beats = []
    for i in range(agents):
        agent_id = f"agent-{i:06d}"
        ann = Announce(agent_id=agent_id, capabilities=["summarize"], max_concurrency=4,
                       heartbeat_interval_ms=1000)  # fmt: skip
        rec, _ = reg.announce(ann, clock(), 0)
        p = partition(agent_id, P)
        beats.append((subjects.heartbeat(agent_id), f"reach.part.{p}.hb.{agent_id}", rec.token))
    ingest = None
    try:
        from reach_broker.service.ingest import Ingest
    except ImportError:
        pass
    else:
        ep = h.endpoints["heartbeat"]
        ingest = Ingest(ctx, P, heartbeat=ep.on_message, announce=ep.on_message,
                        leave=ep.on_message, mapping=m.partition_mapping)  # fmt: skip
        ingest.mode = "plain"
        ingest.live.update(range(P))
    return h, ingest, beats, m


def msg(subject: str, body: bytes) -> Msg:
    client: Any = None
    return Msg(_client=client, subject=subject, reply="", data=body, headers=None)


def bodies(beats: list[tuple[str, str, str]], seq: int) -> list[bytes]:
    """Every agent's heartbeat with ``seq`` (some load on it, as an agent reports)."""
    return [json.dumps({"agent_id": plain.rsplit(".", 1)[1], "token": token, "seq": seq,
                        "active": seq % 4, "task_ms_p50": 100 + seq % 7}).encode()
            for plain, _, token in beats]  # fmt: skip


async def run(args: argparse.Namespace) -> dict[str, Any]:
    h, ingest, beats, _ = build(args.agents)
    ep = h.endpoints["heartbeat"].on_message
    # Each way: its callback of agent i, and which of the agent's subjects it hears.
    kinds: dict[str, tuple[Any, int]] = {"endpoint": (lambda p: ep, 0)}
    if ingest is not None:
        counted = [ingest._counted(p) for p in range(P)]
        parts = [partition(f"agent-{i:06d}", P) for i in range(args.agents)]
        kinds["mapped"] = (lambda i: counted[parts[i]], 1)
        kinds["plain"] = (lambda i: ingest._kept_heartbeat, 0)
    accepted = h.metrics.heartbeat_result["accepted"]
    before = accepted.value
    best: dict[str, float] = {}
    seq = 1
    sent = 0
    for _ in range(args.rounds):
        for kind, (cb_of, heard) in kinds.items():
            cbs = [cb_of(i) for i in range(len(beats))]
            for _rep in range(args.repeat):
                seq += 1
                msgs = [msg(b[heard], body) for b, body in zip(beats, bodies(beats, seq),
                                                                 strict=True)]  # fmt: skip
                t0 = time.perf_counter()
                for cb, m in zip(cbs, msgs, strict=True):
                    await cb(m)
                us = (time.perf_counter() - t0) / len(msgs) * 1e6
                best[kind] = min(best.get(kind, us), us)
                sent += len(msgs)
    out: dict[str, Any] = {k: round(v, 3) for k, v in best.items()}
    out["heartbeats"] = sent
    out["accepted"] = int(accepted.value - before)
    if out["accepted"] != sent:  # the figures would time refusals, not heartbeats
        raise SystemExit(f"hbcost: {out['accepted']} of {sent} heartbeats accepted: {out}")
    if "mapped" in best:
        out["mapped_over_endpoint"] = round(best["mapped"] / best["endpoint"], 3)
        out["plain_over_endpoint"] = round(best["plain"] / best["endpoint"], 3)
    return out


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m loadtest.hbcost",
                                description=__doc__.split("\n")[0])  # fmt: skip
    p.add_argument("--agents", type=int, default=10_000)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--repeat", type=int, default=3)
    print(json.dumps(asyncio.run(run(p.parse_args()))))


if __name__ == "__main__":
    main()
