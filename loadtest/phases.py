"""The phases of a run other than the request load (:mod:`loadtest.rounds`).

Each phase is a function that takes what it uses (the arguments, the running
:class:`~loadtest.infra.System`, the :class:`~loadtest.fleet.Fleet`) and returns its
:class:`~loadtest.report.Figures`, whose fields are the report keys it measures.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import time
from typing import Any

from msgspec import UNSET, UnsetType

from .children import Children
from .fleet import VICTIM_ADV, VICTIM_SILENT, Fleet, victims_per_group
from .infra import System
from .observe import heartbeat_counts
from .procfs import CpuMeter, cpu_seconds, rss_bytes
from .report import Figures

log = logging.getLogger(__name__)


# --- 1. register ---------------------------------------------------------------------------


class Registration(Figures, frozen=True, kw_only=True):
    broker_rss_empty_bytes: int | None
    register_s: float
    announce_errors: int
    sim_connections: int
    broker_rss_bytes: int | None
    rss_per_agent_bytes: float | None


async def register(
    args: argparse.Namespace, system: System, children: Children
) -> tuple[Fleet, Registration]:
    """Every agent announces; broker RSS before and after gives RSS per agent."""
    n = args.agents
    rss0 = rss_bytes(system.broker_pid)
    fleet = await Fleet.spawn(children, args, system.url)
    t0 = time.perf_counter()
    conns, errors = await fleet.ready(60 + n / 100)
    register_s = round(time.perf_counter() - t0, 3)
    # All registered: the broker counts them as healthy.
    deadline = time.monotonic() + 30
    while system.observer.metrics_url:
        m = await system.observer.metrics()
        if m.get('reach_agents{state="healthy"}', 0) >= n - errors or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.2)
    await asyncio.sleep(max(2.0, 2 * args.interval))  # a few heartbeats: records settle
    rss1 = rss_bytes(system.broker_pid)
    log.info("registered %d agents over %d connections in %s s; broker RSS %s -> %s",
             n, conns, register_s, rss0, rss1)  # fmt: skip
    return fleet, Registration(
        broker_rss_empty_bytes=rss0,
        register_s=register_s,
        announce_errors=errors,
        sim_connections=conns,
        broker_rss_bytes=rss1,
        rss_per_agent_bytes=(
            round((rss1 - rss0) / n, 1) if rss0 is not None and rss1 is not None else None
        ),
    )


# --- 2. heartbeats only --------------------------------------------------------------------


class HeartbeatsOnly(Figures, frozen=True, kw_only=True):
    broker_cpu_share_heartbeats: float | None
    heartbeats_per_s: float | None


async def heartbeats_only(args: argparse.Namespace, system: System) -> HeartbeatsOnly:
    """Broker CPU with the fleet heartbeating and nothing else."""
    meter = CpuMeter(system.broker_pid)
    h0 = await system.observer.hb_total()
    t0 = time.perf_counter()
    await asyncio.sleep(max(3.0, 3 * args.interval))
    h1 = await system.observer.hb_total()
    dt = time.perf_counter() - t0
    return HeartbeatsOnly(
        broker_cpu_share_heartbeats=meter.share(),
        heartbeats_per_s=round((h1 - h0) / dt, 1) if h0 is not None and h1 is not None else None,
    )


# --- 4. re-announce storm ------------------------------------------------------------------


class Reannounce(Figures, frozen=True, kw_only=True):
    reannounce_s: float
    reannounce_errors: int
    reannounce_agents: int


async def reannounce(args: argparse.Namespace, fleet: Fleet) -> Reannounce:
    """Every agent of the first sim announces again at once, as after a NATS restart."""
    ev = await fleet.sims[0].command("reannounce", within=60 + args.agents / 100)
    await asyncio.sleep(max(1.0, 2 * args.interval))  # let heartbeats resume
    return Reannounce(
        reannounce_s=ev["seconds"], reannounce_errors=ev["errors"],
        reannounce_agents=fleet.counts[0],
    )  # fmt: skip


# --- 5. silence and kill -------------------------------------------------------------------


class Kill(Figures, frozen=True, kw_only=True):
    advisories_active: bool
    kill_detection_silent_ms: float | None
    kill_silent_routable_before: int
    kill_detection_ms: float | None
    kill_adv_routable_before: int
    kill_count: int


async def kill(args: argparse.Namespace, system: System, fleet: Fleet) -> Kill:
    """One victim group goes silent (connections open), then the other is SIGKILLed; each
    time the broker is asked for their capability until no candidate comes back."""
    timeout = max(30.0, 10 * args.interval)
    observer = system.observer
    m = await observer.metrics()
    k = victims_per_group(args)
    before_silent = await observer.wait_routable(VICTIM_SILENT, k // 2, timeout)
    t_silence = await fleet.silence("silent")
    silent_ms = await observer.until_unroutable(VICTIM_SILENT, t_silence, timeout)
    log.info("silenced %.0f%%: none routed after %s ms (%d routable before)",
             100 * args.kill_share, silent_ms, before_silent)  # fmt: skip
    before_adv = await observer.wait_routable(VICTIM_ADV, k // 2, timeout)
    t_kill = await fleet.kill("adv")
    adv_ms = await observer.until_unroutable(VICTIM_ADV, t_kill, timeout)
    log.info("SIGKILLed %.0f%%: none routed after %s ms (%d routable before)",
             100 * args.kill_share, adv_ms, before_adv)  # fmt: skip
    return Kill(
        advisories_active=bool(m.get("reach_disconnect_advisories", 0.0)),
        kill_detection_silent_ms=silent_ms,
        kill_silent_routable_before=before_silent,
        kill_detection_ms=adv_ms,
        kill_adv_routable_before=before_adv,
        kill_count=k,
    )


# --- 6. accounting -------------------------------------------------------------------------


class Accounting(Figures, frozen=True, kw_only=True):
    heartbeats_sent: int
    heartbeats_counted: int | UnsetType = UNSET
    heartbeat_results: dict[str, int] | UnsetType = UNSET
    heartbeats_dropped: int | UnsetType = UNSET
    heartbeats_rejected: int | UnsetType = UNSET
    """Counted but not accepted (stale, forged, invalid, unknown)."""
    nats_slow_consumers_steady: int | None
    broker_nats_errors: dict[str, float]


async def accounting(system: System, fleet: Fleet) -> Accounting:
    """Heartbeats sent by every sim minus those the broker counted (unset without metrics)."""
    observer = system.observer
    total_sent = await fleet.heartbeats_sent()
    counted = await observer.settle_heartbeats(total_sent, 15)
    by_result: dict[str, int] = {}
    if counted is not None:
        by_result = heartbeat_counts(await observer.metrics())
    await fleet.resume()
    steady = await observer.slow_consumers()
    m = await observer.metrics()
    return Accounting(
        heartbeats_sent=total_sent,
        heartbeats_counted=UNSET if counted is None else counted,
        heartbeat_results=UNSET if counted is None else by_result,
        heartbeats_dropped=UNSET if counted is None else total_sent - counted,
        heartbeats_rejected=UNSET if counted is None else counted - by_result.get("accepted", 0),
        nats_slow_consumers_steady=steady,
        broker_nats_errors={k: v for k, v in m.items() if k.startswith("reach_nats_errors_total")},
    )


# --- 7. heartbeat storm --------------------------------------------------------------------


class Storm(Figures, frozen=True, kw_only=True):
    storm_dropped: int
    nats_slow_consumers: int | None
    heartbeats_per_broker_cpu_s: float | None
    """Heartbeats per second of broker CPU over the storm and its catch-up: what one broker
    core would ingest if the load generators did not share the machine."""
    storm_offered_per_s: float | None
    heartbeat_ingest_peak_per_s: float
    """The best 1 s window of the broker's own counter (the whole span when the storm was
    over sooner)."""
    storm_heartbeats: int | None
    storm_catch_up_s: float


def peak_rate(samples: list[tuple[float, int]]) -> float:
    """The best rate over any window of at least 1 s (or the whole span, if shorter) of
    ``(time, counter)`` samples."""
    span = min(1.0, samples[-1][0] - samples[0][0])
    best = 0.0
    for i in range(len(samples)):
        for j in range(i + 1, len(samples)):
            if samples[j][0] - samples[i][0] >= span > 0:
                best = max(best, (samples[j][1] - samples[i][1]) / (samples[j][0] - samples[i][0]))
                break
    return best


async def storm(args: argparse.Namespace, system: System, fleet: Fleet) -> Storm:
    """One sim sends heartbeats at ``--storm-rate`` for ``--storm-seconds``, the others
    paused, so the broker's counter moves with the storm alone."""
    a = args
    observer = system.observer
    sim = fleet.sims[0]
    for other in fleet.sims[1:]:
        await other.command("pause")
    c0 = await sim.command("pause")
    h0 = await observer.settle_heartbeats(10**12, 5) or 0
    log.info("heartbeat storm: %g/s for %g s", a.storm_rate, a.storm_seconds)
    cpu0 = cpu_seconds(system.broker_pid)
    t0 = time.perf_counter()
    await sim.command(f"storm {a.storm_rate} {a.storm_seconds}", reply="storm")
    samples: list[tuple[float, int]] = [(t0, h0)]
    done: dict[str, Any] | None = None
    deadline = t0 + a.storm_seconds + 30
    reader = asyncio.create_task(sim.wait_event("storm_done", a.storm_seconds + 30))
    try:
        while time.perf_counter() < deadline:
            await asyncio.sleep(0.25)
            samples.append((time.perf_counter(), await observer.hb_total() or 0))
            if reader.done():
                done = reader.result()
                expect = h0 + (done["sent"] - c0["sent"])
                if samples[-1][1] >= expect or (
                    len(samples) > 3 and samples[-1][1] == samples[-3][1]
                ):
                    break
    finally:
        if not reader.done():
            reader.cancel()
    c1 = await sim.command("pause")
    sent = c1["sent"] - c0["sent"]
    h1 = await observer.settle_heartbeats(h0 + sent, 15) or 0
    cpu1 = cpu_seconds(system.broker_pid)
    offered = (done["storm_sent"] / done["seconds"]) if done and done["seconds"] else None
    return Storm(
        storm_dropped=sent - (h1 - h0),
        nats_slow_consumers=await observer.slow_consumers(),
        heartbeats_per_broker_cpu_s=(
            round((h1 - h0) / (cpu1 - cpu0), 1)
            if cpu0 is not None and cpu1 is not None and cpu1 > cpu0
            else None
        ),
        storm_offered_per_s=round(offered, 1) if offered else None,
        heartbeat_ingest_peak_per_s=round(peak_rate(samples), 1),
        storm_heartbeats=done["storm_sent"] if done else None,
        storm_catch_up_s=round(samples[-1][0] - t0, 3),
    )
