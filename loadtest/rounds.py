"""Phase 3, the request load: echo and route slices alternate, same driver, same client.

``--rounds`` rounds of one echo slice (against a raw NATS responder answering with as many
bytes as a route reply) and one route slice, so background noise hits both alike; the ratio
of the two is the broker's cost on top of NATS request-reply. Then one requester of each,
for the latency without queueing. CPU of the broker, the echo responder and the server is
read per slice, so each figure is the cost of the requests it served.
"""

from __future__ import annotations

import argparse
import logging
import time
from typing import Any

from msgspec import UNSET, UnsetType

from .children import Children
from .infra import System
from .procfs import CpuSpans, cpu_seconds, machine_busy
from .report import Figures
from .sim import CAPABILITIES

log = logging.getLogger(__name__)


class Load(Figures, frozen=True, kw_only=True):
    route_reply_bytes: int
    echo_c1_p50_ms: float | UnsetType | None = UNSET
    echo_c1_p99_ms: float | UnsetType | None = UNSET
    echo_c1_per_s: float | UnsetType = UNSET
    route_c1_p50_ms: float | UnsetType | None = UNSET
    route_c1_p99_ms: float | UnsetType | None = UNSET
    route_c1_per_s: float | UnsetType = UNSET
    """One requester (absent with ``--latency-seconds 0``)."""
    routes_per_s: float
    route_p50_ms: float | None
    route_p99_ms: float | None
    """The worst slice's percentile, so a bad slice is not hidden."""
    route_errors: dict[str, int]
    route_slices: list[dict[str, Any]]
    echo_per_s: float
    echo_p50_ms: float | None
    echo_p99_ms: float | None
    echo_errors: dict[str, int]
    echo_slices: list[dict[str, Any]]
    route_vs_echo_ratio: float | None
    broker_cpu_share: float | None
    broker_cpu_us_per_route: float | None
    """The slice's whole process time per route, so it includes the heartbeats handled
    meanwhile."""
    broker_cpu_us_per_route_net: float | None
    """Net of what the heartbeats-only phase cost, per route: the routing cost itself."""
    echo_responder_cpu_share: float | None
    echo_cpu_us_per_request: float | None
    nats_server_cpu_share: float | None
    machine_cpu_busy_share: float
    heartbeats_per_s_under_load: float | UnsetType = UNSET


def _share(c0: float | None, c1: float | None, wall: float) -> float | None:
    """CPU seconds per second of one process over one slice (None: not readable)."""
    return round((c1 - c0) / wall, 3) if c0 is not None and c1 is not None and wall else None


class Slices:
    """The driver results of one mode's slices, combined."""

    def __init__(self) -> None:
        self.results: list[dict[str, Any]] = []

    @property
    def ok(self) -> int:
        return sum(x["ok"] for x in self.results)

    def per_s(self) -> float:
        secs = sum(x["seconds"] for x in self.results)
        return round(self.ok / secs, 1) if secs else 0.0

    def worst(self, key: str) -> float | None:
        return max((x[key] for x in self.results if x[key] is not None), default=None)

    def errors(self) -> dict[str, int]:
        errs: dict[str, int] = {}
        for x in self.results:
            for key, v in x["errors"].items():
                errs[key] = errs.get(key, 0) + v
        return errs


async def load(
    args: argparse.Namespace, system: System, children: Children, hb_only_share: float | None
) -> Load:
    """Echo vs route slices, then one requester each. ``hb_only_share`` is the broker's
    CPU share in the heartbeats-only phase, for the CPU per route net of heartbeats."""
    a = args
    observer = system.observer
    caps = CAPABILITIES[: a.capabilities]

    async def drive(mode: str, seconds: float, concurrency: int) -> dict[str, Any]:
        return await children.drive(mode, system.url, a.prefix, caps, concurrency=concurrency,
                                    seconds=seconds, warmup=a.warmup)  # fmt: skip

    # Reply size of a route, so the echo answers with as many bytes.
    reply_bytes = await observer.route_reply_bytes(CAPABILITIES[0])
    echo = await children.echo_responder(system.url, reply_bytes, a.budget)
    await echo.wait_event("ready", 20)
    slice_s = a.duration / a.rounds
    routes, echoes = Slices(), Slices()
    route_cpu, echo_cpu, server_cpu = CpuSpans(), CpuSpans(), CpuSpans()
    busy: list[tuple[float, float]] = []
    h0 = await observer.hb_total()
    ht0 = time.perf_counter()
    for i in range(a.rounds):
        log.info("round %d/%d: echo %g s", i + 1, a.rounds, slice_s)
        e0, et0 = cpu_seconds(echo.pid), time.perf_counter()
        echoed = await drive("echo", slice_s, a.concurrency)
        e1, edt = cpu_seconds(echo.pid), time.perf_counter() - et0
        echo_cpu.add(e0, e1, edt)
        echoed["responder_cpu_share"] = _share(e0, e1, edt)
        echoes.results.append(echoed)
        log.info("round %d/%d: route %g s", i + 1, a.rounds, slice_s)
        c0, s0, m0 = cpu_seconds(system.broker_pid), cpu_seconds(system.server_pid), machine_busy()
        t0 = time.perf_counter()
        routed = await drive("route", slice_s, a.concurrency)
        dt = time.perf_counter() - t0
        c1, s1, m1 = cpu_seconds(system.broker_pid), cpu_seconds(system.server_pid), machine_busy()
        route_cpu.add(c0, c1, dt)
        server_cpu.add(s0, s1, dt)
        busy.append((m1[0] - m0[0], m1[1] - m0[1]))
        # Each slice's own shares: a slice slower than its round's other tells which process
        # (and whether the whole machine) was busier then.
        routed["broker_cpu_share"] = _share(c0, c1, dt)
        routed["machine_busy"] = round((m1[0] - m0[0]) / (m1[1] - m0[1]), 3) if m1[1] > m0[1] \
            else None  # fmt: skip
        routes.results.append(routed)
    h1 = await observer.hb_total()
    c1_figures: dict[str, Any] = {}
    if a.latency_seconds > 0:
        # One requester: the latency of a single route against a single echo, no queueing.
        for mode in ("echo", "route"):
            res = await drive(mode, a.latency_seconds, 1)
            c1_figures[f"{mode}_c1_p50_ms"] = res["p50_ms"]
            c1_figures[f"{mode}_c1_p99_ms"] = res["p99_ms"]
            c1_figures[f"{mode}_c1_per_s"] = res["per_s"]
    await echo.stop()

    routes_per_s, echo_per_s = routes.per_s(), echoes.per_s()
    loaded = route_cpu.share()
    return Load(
        route_reply_bytes=reply_bytes,
        **c1_figures,
        routes_per_s=routes_per_s,
        route_p50_ms=routes.worst("p50_ms"),
        route_p99_ms=routes.worst("p99_ms"),
        route_errors=routes.errors(),
        route_slices=routes.results,
        echo_per_s=echo_per_s,
        echo_p50_ms=echoes.worst("p50_ms"),
        echo_p99_ms=echoes.worst("p99_ms"),
        echo_errors=echoes.errors(),
        echo_slices=echoes.results,
        route_vs_echo_ratio=round(routes_per_s / echo_per_s, 3) if echo_per_s else None,
        broker_cpu_share=loaded,
        broker_cpu_us_per_route=route_cpu.us_per(routes.ok),
        broker_cpu_us_per_route_net=(
            round((loaded - hb_only_share) / routes_per_s * 1e6, 1)
            if loaded is not None and hb_only_share is not None and routes_per_s
            else None
        ),
        echo_responder_cpu_share=echo_cpu.share(),
        echo_cpu_us_per_request=echo_cpu.us_per(echoes.ok),
        nats_server_cpu_share=server_cpu.share(),
        machine_cpu_busy_share=round(sum(b for b, _ in busy) / sum(t for _, t in busy), 3),
        heartbeats_per_s_under_load=(
            round((h1 - h0) / (time.perf_counter() - ht0), 1)
            if h0 is not None and h1 is not None
            else UNSET
        ),
    )
