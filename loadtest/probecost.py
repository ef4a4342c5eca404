"""``python -m loadtest.probecost``: what the broker's prober holds per agent for RTT sampling.

``--agents`` agents registered in a registry, each registration handed to the prober as the
broker does (``Prober.on_transition``); the bytes the prober allocated meanwhile
(tracemalloc), per agent. Before issue 24 every healthy agent had a planned sample in the
prober's heap; with the probe budget the rotation plans none. Run it from two checkouts
(``PYTHONPATH=<checkout>``) to compare.
"""

from __future__ import annotations

import argparse
import json
import random
import tracemalloc
from typing import Any

from nats.aio.client import Client as NATS

from reach_agent.wire.schema import Announce
from reach_agent.wire.subjects import Subjects
from reach_broker.config import Config
from reach_broker.core.registry import Registry
from reach_broker.core.tokens import TokenSigner
from reach_broker.service.context import BrokerContext, Link
from reach_broker.service.metrics import Metrics
from reach_broker.service.probes import Prober


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--agents", type=int, default=50_000)
    args = p.parse_args()
    cfg = Config()
    reg = Registry(cfg.detection, cfg.scoring, TokenSigner(b"k" * 32, 3600.0, wall=lambda: 1e6),
                   interval_ms=cfg.broker.interval_ms)  # fmt: skip
    metrics = Metrics()

    def nothing(*_: Any) -> None:
        return None

    ctx = BrokerContext(nc=NATS(), subjects=Subjects(), broker_id="b1", clock=lambda: 100.0,
                        wall=lambda: 1_000_000.0, spawn=nothing, emit=nothing,
                        link=Link())  # fmt: skip
    prober = Prober(ctx, reg, cfg.detection, results=metrics.probes, rtt=metrics.probe_rtt,
                    rng=random.Random(4))  # fmt: skip
    anns = [Announce(agent_id=f"a{i:06d}", capabilities=["summarize"], max_concurrency=4,
                     heartbeat_interval_ms=5000) for i in range(args.agents)]  # fmt: skip
    done = [reg.announce(ann, 100.0, 0) for ann in anns]
    sampler = getattr(prober, "sampler", None)
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    for rec, out in done:
        for t in out:
            prober.on_transition(t, rec)
    if sampler is not None:
        sampler.newcomers.clear()  # as once sampled: what stays is the rotation's
    held = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    print(
        json.dumps({"agents": args.agents, "prober_bytes_per_agent": round(held / args.agents, 1)})
    )


if __name__ == "__main__":
    main()
