"""``python -m loadtest.routecost``: the broker's route handler in-process, per kind of request.

One registry with ``--agents`` agents of one capability (half in region ``eu``), the real
``Handlers.route`` (subject, decode, router, encode; no NATS), and kinds of request timed in
turn, ``--rounds`` times alternated: ``plain`` (an empty body, the SDK's), ``filtered``
(``{"region": "eu"}``), ``peek`` (the plain request as a look: no hand-out counted, so
``plain_over_peek`` is the cost of counting one), where the code has it ``explain``, and the
routing policy of issue 18 over the same agents: ``rules`` (the capability's rule: a 95/5
version split and a required tag), ``quota`` (a token bucket per caller, never empty) and
``rules_quota`` (both), and issue 24's ``merged`` (the same agents split between this
broker's registry, the partitions it owns, and the other owners' shares it follows: the
route merges both; ``merged_over_plain``) with ``single`` (the plain route through a router
that asks for other owners' shares and has none, as a broker owning every partition does).
The broker's clock advances ``1 / --rate`` seconds per request
(default: each agent is handed a task per its 100 ms task time, a tenth of its slots), so the
hand-outs fade as they would in a fleet that keeps up. Each figure is the best round's
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

from reach_agent.routing.rules import Rules, build
from reach_agent.routing.table import RouteTable, SharedMember, TableMember, partition
from reach_agent.wire.schema import (
    Announce,
    Heartbeat,
    RouteRequest,
    TableEntry,
    TableRouting,
    TableShare,
)
from reach_agent.wire.subjects import Subjects
from reach_broker.config import Config, QuotasSection
from reach_broker.core.explain import Explainer
from reach_broker.core.quotas import Quotas
from reach_broker.core.registry import Registry
from reach_broker.core.routing import Router
from reach_broker.core.tokens import TokenSigner
from reach_broker.service.handlers import Handlers
from reach_broker.service.metrics import HandlerMetrics, Metrics

CAP = "summarize"


class Clock:
    """The broker's clock: ``step`` seconds later at every reading (one reading a request)."""

    def __init__(self, step: float) -> None:
        self.now, self.step = 1.0, step

    def __call__(self) -> float:
        self.now += self.step
        return self.now


def handlers(agents: int, rate: float | None = None) -> Handlers:
    """The broker's handlers over ``agents`` healthy agents, ranked as a route would, and
    asked ``rate`` routes a second (default: ten per agent)."""
    return policy_handlers(agents, rate)["plain"]


def policy_handlers(agents: int, rate: float | None = None) -> dict[str, Handlers]:
    """Handlers over one registry of ``agents`` agents: ``plain`` (no rules, no quotas),
    ``rules`` (a split and a required tag), ``quota`` (a bucket per caller), ``rules_quota``;
    asked ``rate`` routes a second (default: ten per agent)."""
    cfg = Config()
    reg = Registry(
        cfg.detection,
        cfg.scoring,
        TokenSigner(b"k" * 32, 3600.0, wall=lambda: 1_000_000.0),
        interval_ms=cfg.broker.interval_ms,
    )
    subjects = Subjects("reach")

    def router(rules: Rules) -> Router:
        return Router(cfg.routing, reg.indexes, subjects.task, inflight=lambda: reg.inflight,
                      capacity=lambda: reg.capacity, rng=random.Random(1),
                      rules=rules)  # fmt: skip

    for i in range(agents):
        ann = Announce(agent_id=f"a{i}", capabilities=[CAP], max_concurrency=10,
                       heartbeat_interval_ms=1000, region=("eu", "us")[i % 2],
                       version="2" if i % 20 == 0 else "1", tags={"env": "prod"})  # fmt: skip
        rec, _ = reg.announce(ann, 0.0, 0)
        hb = Heartbeat(agent_id=rec.agent_id, token=rec.token, seq=1, active=i % 8, ok_total=1,
                       task_ms_p50=100 + i % 50)  # fmt: skip
        reg.heartbeat(hb, 0.5, 0)
    # Only what Handlers reads of its context (no connection: nothing is sent).
    clock = Clock(1.0 / (rate or 10.0 * agents))
    ctx = types.SimpleNamespace(subjects=subjects, clock=clock, wall=lambda: 1000.0,
                                wall_ms=lambda: 10**6, nc=None, emit=None,
                                link=types.SimpleNamespace(secured=False))  # fmt: skip
    metrics = HandlerMetrics.of(Metrics())
    ruled = Rules()
    ruled.put(CAP, build(split="version=1:95,2:5", require=["env=prod"]))
    unlimited = QuotasSection(rate=1e12, burst=10**12)  # a bucket taken from, never empty
    out = {}
    for kind, foreign in (("merged", True), ("single", False)):
        held, r = merged_router(cfg, reg, subjects, foreign)
        out[kind] = Handlers(ctx, held, r, Quotas(QuotasSection(), Rules()),  # type: ignore[arg-type]
                             Explainer(r, cfg.scoring), metrics,
                             on_unknown=lambda _: None, announced=lambda _: None)  # fmt: skip
    for kind, rules, quota in (
        ("plain", Rules(), QuotasSection()),
        ("rules", ruled, None),
        ("quota", Rules(), unlimited),
        ("rules_quota", ruled, unlimited),
    ):
        q = Quotas(quota or QuotasSection(), rules)
        r = router(rules)
        out[kind] = Handlers(ctx, reg, r, q, Explainer(r, cfg.scoring), metrics,  # type: ignore[arg-type]
                             on_unknown=lambda _: None, announced=lambda _: None)  # fmt: skip
    return out


PARTITIONS = 32


def merged_router(
    cfg: Config, reg: Registry, subjects: Subjects, foreign: bool
) -> tuple[Registry, Router]:
    """A registry of the agents of ``reg`` in partitions 0-15 and a router over it and the
    others as the other owners' shares (``foreign``); or ``reg`` and a router over it asking
    for shares and getting none."""
    if not foreign:
        return reg, Router(cfg.routing, reg.indexes, subjects.task, inflight=lambda: reg.inflight,
                      capacity=lambda: reg.capacity, rng=random.Random(1),
                      foreign=lambda cap: None)  # fmt: skip
    own = Registry(
        cfg.detection,
        cfg.scoring,
        TokenSigner(b"k" * 32, 3600.0, wall=lambda: 1_000_000.0),
        interval_ms=cfg.broker.interval_ms,
    )
    table = RouteTable(CAP, TableRouting(), SharedMember)
    members: dict[str, TableMember] = {}
    shares: dict[int, list[TableEntry]] = {}
    for rec in reg.agents.values():
        p = partition(rec.agent_id, PARTITIONS)
        if p < PARTITIONS // 2:
            mine, _ = own.announce(rec.announce, 0.0, 0)
            hb = Heartbeat(agent_id=rec.agent_id, token=mine.token, seq=1, active=rec.active,
                           ok_total=1, task_ms_p50=int(rec.stats.task_ewma_ms or 100))  # fmt: skip
            own.heartbeat(hb, 0.5, 0)
        else:
            shares.setdefault(p, []).append(TableEntry(
                agent_id=rec.agent_id, state="healthy", score=rec.score,
                max_concurrency=rec.max_concurrency, active=rec.active, task_ms=100.0,
                region=rec.region, version=rec.version, tags=rec.tags))  # fmt: skip
    for p, entries in shares.items():
        table.load(TableShare(capability=CAP, partition=p, epoch=1, version=1, entries=entries),
                   members, 0.0)  # fmt: skip
    return own, Router(cfg.routing, own.indexes, subjects.task, inflight=lambda: own.inflight,
                       capacity=lambda: own.capacity, rng=random.Random(1),
                       foreign=lambda cap: table)  # fmt: skip


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
    p.add_argument("--rate", type=float, help="route requests per second of the broker's clock "
                   "(default: 10 per agent)")  # fmt: skip
    p.add_argument("--no-explain", action="store_true", help="leave the explained kind out")
    args = p.parse_args()
    hs = policy_handlers(args.agents, args.rate)
    h = hs["plain"]
    subject = f"reach.route.{CAP}"
    bodies = {"plain": b"", "filtered": json.dumps({"region": "eu"}).encode()}
    if "peek" in RouteRequest.__struct_fields__:
        bodies["peek"] = json.dumps({"peek": True}, separators=(",", ":")).encode()
    if "explain" in RouteRequest.__struct_fields__ and not args.no_explain:
        bodies["explain"] = json.dumps({"explain": True}).encode()
    kinds: dict[str, tuple[Handlers, bytes]] = {k: (h, b) for k, b in bodies.items()}
    for kind in ("rules", "quota", "rules_quota", "merged", "single"):
        kinds[kind] = (hs[kind], b"")
    best: dict[str, float] = {}
    for _ in range(args.rounds):
        for kind, (hk, body) in kinds.items():
            n = max(args.batch // 50, 20) if kind == "explain" else args.batch

            def one(hk: Handlers = hk, body: bytes = body) -> object:
                return hk.route(subject, body, "caller-1")

            us = per_request_us(one, n)
            best[kind] = min(best.get(kind, us), us)
    out: dict[str, object] = {"agents": args.agents, "us_per_request": {
        k: round(v, 2) for k, v in best.items()}}  # fmt: skip
    if "explain" in best:
        out["explain_over_plain"] = round(best["explain"] / best["plain"], 1)
    out["filtered_over_plain"] = round(best["filtered"] / best["plain"], 3)
    if "peek" in best:
        out["plain_over_peek"] = round(best["plain"] / best["peek"], 3)
    for kind in ("rules", "quota", "rules_quota", "merged", "single"):
        out[f"{kind}_over_plain"] = round(best[kind] / best["plain"], 3)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
