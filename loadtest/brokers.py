"""``python -m loadtest --brokers N``: N broker processes over one nats-server, each owning a
share of the fleet's partitions.

Starts a ``nats-server`` from the shipped ``configs/nats-server.conf`` (its partition count
set to ``--partitions``, so the server maps the agent subjects), N ``reach broker`` processes
(``[fleet] partitions``, ``lease_ttl_s`` from the options) and the simulated agents
(:mod:`loadtest.sim`, ``--sim-procs`` processes). Then:

1. settle: every partition owned, no broker above ``ceil(P / N)``;
2. register: every agent announced and counted healthy by the brokers together;
3. measure ``--measure`` seconds: each broker's ``reach_heartbeats_total{result="accepted"}``
   growth and its share of the sum (the sims' own count of heartbeats sent over the same
   window, paused and flushed at both ends, is the fleet's total), each broker's RSS and its
   RSS per agent it holds (over its RSS before the agents came);
4. with ``--kill``, once the snapshot (KV ``reach_registry``) holds as many keys as there are
   agents (``snapshot_complete_s``: the wait after the measure): SIGKILL of the last broker;
   the time until the others own every partition
   again, ``offline`` events seen afterwards (there must be none; by reason, ``disconnect``
   when the server's advisory for a simulator's connection caused them), the agents each
   survivor then holds.

Route requests (``reach.route.<capability>``, one every 100 ms, 1 s timeout each) run from
registration to the end: answered, unanswered, and the longest time from an unanswered
request to the next answered one, with the phase it began in (``settle``: the records
settling after registration, ``measure``, ``snapshot``: the wait for the snapshot, ``kill``)
and how far into it (and the same from the kill on: ``..._after_kill``). The report is one
JSON object on stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import json
import math
import os
import signal
import tempfile
import time
from pathlib import Path
from typing import Any

import nats

from jetstream.names import REGISTRY_STREAM
from reach_broker.cluster.natsserver import NatsServer

from . import calls
from .children import Children, free_port
from .fleet import Fleet
from .observe import scrape
from .procfs import loadavg, rss_bytes
from .sim import CAPABILITIES

ROOT = Path(__file__).resolve().parent.parent
OWNED = "reach_partitions_owned"
ACCEPTED = 'reach_heartbeats_total{result="accepted"}'
STATES = ("healthy", "suspect", "offline", "recovering", "draining")


def add_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--brokers",
        type=int,
        default=0,
        help="run N broker processes over one server (this module); 0: one broker",
    )
    p.add_argument("--partitions", type=int, default=32, help="[fleet] partitions (--brokers)")
    p.add_argument("--lease-ttl", type=float, default=6.0, help="[fleet] lease_ttl_s (--brokers)")
    p.add_argument(
        "--measure",
        type=float,
        default=20.0,
        help="seconds the heartbeat shares are measured over (--brokers)",
    )
    p.add_argument("--kill", action="store_true",
                   help="SIGKILL the last broker and time the takeover (--brokers)")  # fmt: skip
    p.add_argument("--server-sync", choices=("always", "default"), default="always",
                   help="JetStream's sync_interval (--brokers): always, as the shipped config, "
                   "or the server's default (fsync every 2 minutes)")  # fmt: skip


class Broker:
    def __init__(self, name: str, child: Any, metrics_port: int) -> None:
        self.name = name
        self.child = child
        self.url = f"http://127.0.0.1:{metrics_port}/metrics"

    async def metrics(self) -> dict[str, float]:
        try:
            return await asyncio.to_thread(scrape, self.url)
        except OSError:
            return {}

    def rss(self) -> int | None:
        return rss_bytes(self.child.pid) if self.child.alive() else None


def server_config(tmp: Path, partitions: int, sync: str = "always") -> Path:
    """The shipped server config, mapping into ``partitions``, JetStream's ``sync_interval``
    as ``sync`` says (:func:`loadtest.calls.server_config`)."""
    text = (ROOT / "configs" / "nats-server.conf").read_text()
    conf = tmp / "nats-server.conf"
    mapped = text.replace("partition(32,1)", f"partition({partitions},1)")
    conf.write_text(calls.server_config(sync, mapped))
    return conf


async def wait(predicate: Any, within: float, what: str, every: float = 0.2) -> float:
    """Poll the async ``predicate`` until true; the seconds it took."""
    t0 = time.monotonic()
    while not await predicate():
        if time.monotonic() - t0 > within:
            raise RuntimeError(f"timed out after {within}s waiting for {what}")
        await asyncio.sleep(every)
    return time.monotonic() - t0


QUIET_S = 0.5
"""How long the brokers' heartbeat counts must stand still, the fleet paused, before they are
read: a broker behind on its socket still counts heartbeats sent before the pause (a fixed
0.5 s wait counted 204,631 of 200,160 sent in a window at 100,000 agents)."""


async def quiet(brokers: list[Broker], within: float = 30.0) -> list[dict[str, float]]:
    """Every broker's metrics once their heartbeat counts stood still for :data:`QUIET_S`
    (the fleet paused): all the heartbeats sent so far handled."""
    t0 = time.monotonic()
    last: list[float] | None = None
    while True:
        ms = [await b.metrics() for b in brokers]
        counts = [m.get(ACCEPTED, 0.0) for m in ms]
        if counts == last:
            return ms
        if time.monotonic() - t0 > within:
            raise RuntimeError(f"the brokers' heartbeat counts still moved after {within}s "
                               "with the fleet paused")  # fmt: skip
        last = counts
        await asyncio.sleep(QUIET_S)


class Routes:
    """A route request every 100 ms (1 s timeout), from start to stop."""

    def __init__(self, nc: Any, prefix: str) -> None:
        self.nc = nc
        self.prefix = prefix
        self.sent: list[tuple[float, bool]] = []
        self.killed_at: float | None = None
        """When the broker was killed (the figures from then on are reported apart)."""
        self.phases: list[tuple[float, str]] = [(time.monotonic(), "settle")]
        """When each phase began (:meth:`phase`)."""
        self._stop = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    async def _one(self, capability: str) -> None:
        t0 = time.monotonic()
        try:
            await self.nc.request(f"{self.prefix}.route.{capability}", b"", timeout=1.0)
        except Exception:  # noqa: BLE001 - an unanswered request is what is counted
            self.sent.append((t0, False))
        else:
            self.sent.append((t0, True))

    async def _loop(self) -> None:
        pending = []
        i = 0
        while not self._stop.is_set():
            pending.append(asyncio.create_task(self._one(CAPABILITIES[i % 3])))
            i += 1
            await asyncio.sleep(0.1)
        await asyncio.gather(*pending)

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop())

    def phase(self, name: str) -> None:
        """The run enters phase ``name`` (the longest outage says which it began in)."""
        self.phases.append((time.monotonic(), name))

    async def stop(self) -> dict[str, Any]:
        self._stop.set()
        if self._task is not None:
            await self._task
        sent = sorted(self.sent)
        out = self._figures(sent, "")
        if self.killed_at is not None:
            out |= self._figures([(t, ok) for t, ok in sent if t >= self.killed_at],
                                 "_after_kill")  # fmt: skip
        return out

    def _figures(self, sent: list[tuple[float, bool]], suffix: str) -> dict[str, Any]:
        lost = [t for t, ok in sent if not ok]
        outage, began = 0.0, None
        for t in lost:
            nxt = next((u for u, ok in sent if ok and u > t), None)
            took = (nxt - t) if nxt is not None else math.inf
            if took > outage:
                outage, began = took, t
        out: dict[str, Any] = {f"routes_sent{suffix}": len(sent),
                               f"routes_unanswered{suffix}": len(lost),
                               f"route_outage_max_s{suffix}": round(outage, 3)}  # fmt: skip
        if began is not None:
            at, name = max((p for p in self.phases if p[0] <= began), default=self.phases[0])
            out[f"route_outage_max_phase{suffix}"] = f"{name} +{began - at:.1f} s"
            # On the wall clock too, to be read beside the brokers' logs and profiles.
            wall = time.time() - (time.monotonic() - began)
            out[f"route_outage_max_at{suffix}"] = time.strftime(
                "%H:%M:%S", time.gmtime(wall)) + f".{int(wall % 1 * 1000):03d}"  # fmt: skip
        return out


async def run(args: argparse.Namespace) -> dict[str, Any]:
    a = args
    n, p = a.brokers, a.partitions
    tmp = Path(tempfile.mkdtemp(prefix="reach-brokers-"))
    server = NatsServer(port=0, store_dir=tmp / "nats",
                        config=server_config(tmp, p, a.server_sync))  # fmt: skip
    server.start()
    children = Children()
    report: dict[str, Any] = {
        "brokers": n, "partitions": p, "agents": a.agents, "interval_s": a.interval,
        "lease_ttl_s": a.lease_ttl, "server_sync": a.server_sync, "loadavg_start": loadavg(),
        "host_cores": os.cpu_count(),
    }  # fmt: skip
    nc = await nats.connect(server.url, name="loadtest-brokers")
    try:
        brokers = []
        for i in range(n):
            conf = tmp / f"b{i}.toml"
            fleet_section = f"[fleet]\npartitions = {p}\nlease_ttl_s = {a.lease_ttl}\n"
            conf.write_text(f'[broker]\nbroker_id = "b{i}"\n' + fleet_section)
            port = free_port()
            child = await children.broker(server.url, a.prefix, port, str(conf),
                                          verbose=a.verbose)  # fmt: skip
            brokers.append(Broker(f"b{i}", child, port))
        share = math.ceil(p / n)

        async def settled() -> bool:
            owned = [(await b.metrics()).get(OWNED, -1.0) for b in brokers]
            return min(owned) >= 0 and sum(owned) == p and max(owned) <= share

        report["settle_s"] = round(await wait(settled, 60 + 10 * a.lease_ttl, "the split"), 2)
        rss0 = [b.rss() for b in brokers]

        fleet = await Fleet.spawn(children, a, server.url)
        await fleet.ready(120 + a.agents / 100)

        async def registered() -> bool:
            ms = [await b.metrics() for b in brokers]
            return (
                sum(m.get(f'reach_agents{{state="{s}"}}', 0) for m in ms for s in STATES)
                >= a.agents
            )

        report["register_s"] = round(await wait(registered, 120 + a.agents / 100,
                                                "every agent registered"), 2)  # fmt: skip
        routes = Routes(nc, a.prefix)
        routes.start()
        await asyncio.sleep(max(2.0, 2 * a.interval))  # records settle

        # Measure: the sims paused (flushed) at both ends, so their count and the brokers'
        # cover the same heartbeats.
        routes.phase("measure")
        sent0 = await fleet.heartbeats_sent()
        hb0 = [m.get(ACCEPTED, 0.0) for m in await quiet(brokers)]
        await fleet.resume()
        await asyncio.sleep(a.measure)
        sent1 = await fleet.heartbeats_sent()
        ms = await quiet(brokers)
        await fleet.resume()
        sent = sent1 - sent0
        got = [m.get(ACCEPTED, 0.0) - x for m, x in zip(ms, hb0, strict=True)]
        held = [int(sum(m.get(f'reach_agents{{state="{s}"}}', 0) for s in STATES)) for m in ms]
        healthy = [int(m.get('reach_agents{state="healthy"}', 0)) for m in ms]
        rss1 = [b.rss() for b in brokers]
        report["measure"] = {
            "heartbeats_sent": sent,
            "heartbeats_counted": int(sum(got)),
            "shares_pct": [round(100 * g / sent, 1) if sent else None for g in got],
            "partitions_owned": [int(m.get(OWNED, 0)) for m in ms],
            "agents_held": held,
            "agents_healthy": healthy,
            "rss_mib": [round(r / 2**20, 1) if r else None for r in rss1],
            "rss_per_agent_bytes": [
                round((r1 - r0) / h) if r0 and r1 and h else None
                for r0, r1, h in zip(rss0, rss1, held, strict=True)
            ],
            # The same growth over the whole fleet: what each broker pays per agent of the
            # fleet (it holds its partitions' agents and follows the others' shares).
            "rss_per_fleet_agent_bytes": [
                round((r1 - r0) / a.agents) if r0 and r1 else None
                for r0, r1 in zip(rss0, rss1, strict=True)
            ],
        }
        if a.kill:
            # The kill comes in a steady state: once the snapshot holds the fleet (at 100,000
            # agents with a synced write each, registering is written for tens of seconds
            # after the agents are counted; an agent missing there is restored by no one).
            js = nc.jetstream(timeout=5.0)

            async def stored() -> bool:
                info = await js.stream_info(REGISTRY_STREAM)
                return info.state.messages >= a.agents

            routes.phase("snapshot")
            report["snapshot_complete_s"] = round(
                await wait(stored, 120 + a.agents / 500, "the snapshot holding the fleet"), 2
            )
            routes.killed_at = time.monotonic()
            routes.phase("kill")
            report["kill"] = await kill(brokers, nc, a, p)
        report.update(await routes.stop())
        report["loadavg_end"] = loadavg()
        return report
    finally:
        await children.stop_all()
        with contextlib.suppress(Exception):
            await nc.close()
        server.stop()


async def kill(brokers: list[Broker], nc: Any, a: argparse.Namespace, p: int) -> dict[str, Any]:
    """SIGKILL the last broker; how long until the others own every partition, and whether
    any agent went offline meanwhile."""
    offline: collections.Counter[str] = collections.Counter()
    """``offline`` events seen, by reason (``disconnect``: the server's advisory for the
    agent's connection; silence otherwise): which one tells the broker from the fleet."""

    async def on_event(msg: Any) -> None:
        with contextlib.suppress(ValueError):
            event = json.loads(msg.data)
            if event.get("to") == "offline":
                offline[str(event.get("reason"))] += 1

    sub = await nc.subscribe(f"{a.prefix}.event.>", cb=on_event)
    victim, survivors = brokers[-1], brokers[:-1]
    took0 = [await b.metrics() for b in survivors]
    with contextlib.suppress(ProcessLookupError):
        victim.child.proc.send_signal(signal.SIGKILL)
    await victim.child.proc.wait()

    async def owned() -> bool:
        return sum([(await b.metrics()).get(OWNED, 0) for b in survivors]) == p

    took = await wait(owned, 120, "the survivors owning every partition", every=0.05)
    await asyncio.sleep(max(3.0, 3 * a.interval))  # heard over several heartbeats
    ms = [await b.metrics() for b in survivors]
    await sub.unsubscribe()
    return {
        "takeover_s": round(took, 2),
        "offline_events": sum(offline.values()),
        "offline_reasons": dict(offline),
        "agents_held_after": [
            int(sum(m.get(f'reach_agents{{state="{s}"}}', 0) for s in STATES)) for m in ms
        ],
        "healthy_after": [int(m.get('reach_agents{state="healthy"}', 0)) for m in ms],
        # Each partition taken over: restored from its snapshot keys, heard, published.
        "partition_takeover_mean_s": [
            round(
                (m.get(f"{k}_sum", 0) - m0.get(f"{k}_sum", 0))
                / max(m.get(f"{k}_count", 0) - m0.get(f"{k}_count", 0), 1),
                3,
            )
            for m, m0 in zip(ms, took0, strict=True)
            for k in ("reach_partition_takeover_seconds",)
        ],
        "partitions_taken_over": [
            int(
                m.get("reach_partition_takeover_seconds_count", 0)
                - m0.get("reach_partition_takeover_seconds_count", 0)
            )
            for m, m0 in zip(ms, took0, strict=True)
        ],
    }


def main(args: argparse.Namespace) -> int:
    report = asyncio.run(run(args))
    text = json.dumps(report, indent=2)
    print(text)
    if args.report:
        Path(args.report).write_text(text + "\n")
    return 0
