"""``python -m loadtest.chaos``: one fault on one of three agents while a caller keeps calling.

    python -m loadtest.chaos --fault kill|freeze|latency [--hold 45] [--watch 60] \
        [--calls 1000 | --concurrency 8] [--agents 3] [--max-concurrency 64] \
        [--heartbeat-ms 1000] [--sdk-agents] [--fleet 1000] --report chaos-kill.json

Starts a ``nats-server`` (``configs/nats-server.conf``: advisories on), a broker in this
process (default settings), ``--agents`` agents ``alpha``/``beta``/``gamma``/… as their own
processes (``loadtest.chaos_agent``: 20 ms tasks, ``--max-concurrency`` slots each), and a
caller through the SDK (``reach_agent.Client``): ``--calls`` calls at a steady rate over
warm-up + hold + watch, or with ``--concurrency N`` N callers each calling back to back for
the whole run (N calls always in flight). ``--fleet N`` makes the broker carry N agents in
all: the rest are simulated (``loadtest.sim``, other capabilities, 1 s heartbeats), so the
broker's heartbeat ingest and route-table publishing run at that fleet's size while the fault
is measured. After the warm-up one fault hits ``alpha`` for ``--hold`` seconds:

- ``kill``: SIGKILL; cleared by starting the agent again;
- ``freeze``: SIGSTOP (alive to the kernel, silent on the bus — a partition as the bus sees
  it); cleared by SIGCONT;
- ``latency``: +1500 ms on every task (SIGUSR1); cleared by SIGUSR2.

Measured (monotonic clock, polled every 10 ms from the broker's own routing):

- ``switch_ms``: fault start → ``alpha`` no longer among the route candidates (no new tasks);
- ``table_switch_ms``: fault start → ``alpha`` out of the caller's own route table (not
  healthy there, or out of its ranking: ejected for its score); the SDK routes its calls from
  it, and the broker's change reaches it as a table delta;
- ``detect_ms``: fault start → first state change of ``alpha`` (kill/freeze);
- ``routable_ms``: fault cleared → ``alpha`` routable again;
- ``recover_ms``: fault cleared → ``alpha`` back at full share (its routing weight ≥ 90% of
  an even share; slow start makes this ~50 s with the defaults: 20% for 30 s, then a ramp);
- ``failed_calls``: calls that raised, by error code; ``served``: calls per agent per phase.

Prints a table like the field report's and writes the JSON report. Every child process is
ours and ended in ``finally`` by PID.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import logging
import os
import shlex
import signal
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from reach_agent import Client, ReachError
from reach_agent.client.tables import TableRoutes
from reach_agent.wire.errors import NoReachableAgent, Overloaded
from reach_agent.wire.schema import RouteRequest
from reach_broker.broker import Broker
from reach_broker.cluster.natsserver import NatsServer
from reach_broker.config import Config
from reach_broker.core.records import AgentRecord, Transition

from .children import Children

CAPABILITY = "summarize"
NAMES = ("alpha", "beta", "gamma", "delta", "epsilon")
VICTIM = "alpha"
ROOT = Path(__file__).resolve().parent.parent
POLL_S = 0.01
FULL_SHARE = 0.9
"""``alpha`` is back at full share when its routing weight is >= this * an even share."""


@dataclass
class Run:
    fault: str
    hold_s: float
    watch_s: float
    warmup_s: float
    calls: int
    agent_args: list[str]
    sdk: bool
    agents: tuple[str, ...] = NAMES[:3]
    concurrency: int = 0
    """Callers calling back to back (0: ``calls`` at a steady rate instead)."""
    fleet: int = 0
    """Agents the broker carries in all (simulated ones fill up to it; 0: none simulated)."""
    t_fault: float = 0.0
    t_clear: float = 0.0
    switch_at: float | None = None
    table_switch_at: float | None = None
    routable_at: float | None = None
    recover_at: float | None = None
    transitions: list[tuple[float, str | None, str | None, str]] = field(default_factory=list)
    results: list[tuple[int, float, float, str | None, str | None]] = field(default_factory=list)
    errors: dict[int, str] = field(default_factory=dict)
    """A failed call's error message, by call number."""
    procs: dict[str, asyncio.subprocess.Process] = field(default_factory=dict)


async def spawn(url: str, agent_id: str, run: Run) -> asyncio.subprocess.Process:
    args = [sys.executable, "-m", "loadtest.chaos_agent", "--server", url, "--id", agent_id,
            "--capability", CAPABILITY, *run.agent_args]  # fmt: skip
    if run.sdk:
        args.append("--sdk")
    proc = await asyncio.create_subprocess_exec(
        *args, cwd=ROOT, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    assert proc.stdout is not None
    try:
        line = await asyncio.wait_for(proc.stdout.readline(), 15.0)
    except BaseException:
        await reap(proc)
        raise
    if line.decode().strip() != f"ready {agent_id}":
        await reap(proc)
        raise RuntimeError(f"agent {agent_id} did not start: {line!r}")
    return proc


async def reap(proc: asyncio.subprocess.Process) -> None:
    if proc.returncode is None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGCONT)
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(proc.wait(), 10.0)


def victim_share(broker: Broker, now: float) -> tuple[bool, float] | None:
    """(``alpha`` among the route candidates, its share of the routing weight); None while
    every candidate is merely full (OVERLOADED: nothing to say about ``alpha`` then)."""
    router = broker.router
    try:
        got = router.route(CAPABILITY, RouteRequest(limit=len(NAMES)), now)
    except Overloaded:
        return None
    except NoReachableAgent:
        return False, 0.0
    routable = any(c.agent_id == VICTIM for c in got)
    recs = [broker.registry.agents[c.agent_id] for c in got]
    weights = {r.agent_id: router.weight(r, now) for r in recs}
    total = sum(weights.values())
    return routable, (weights.get(VICTIM, 0.0) / total if total else 0.0)


def in_callers_table(client: Client) -> bool | None:
    """Whether ``alpha`` is routable in the caller's own route table: there, healthy and in
    the ranking its last route used (not ejected for its score: the latency fault) (None: the
    caller routes through a broker, or holds no table yet)."""
    routes = client.routes
    if not isinstance(routes, TableRoutes) or CAPABILITY not in routes.follower.followed:
        return None
    m = routes.follower.members.get(VICTIM)
    if m is None or m.state != "healthy":
        return False
    return any(r is m for r in routes.follower.followed[CAPABILITY].table.index.ranked)


async def monitor(broker: Broker, client: Client, run: Run, stop: asyncio.Event) -> None:
    even = 1.0 / len(run.agents)
    while not stop.is_set():
        now = time.monotonic()
        if run.t_fault and now >= run.t_fault and run.table_switch_at is None:
            if in_callers_table(client) is False:
                run.table_switch_at = now
        seen = victim_share(broker, now)
        if seen is None:
            await asyncio.sleep(POLL_S)
            continue
        routable, share = seen
        if run.t_fault and now >= run.t_fault and run.switch_at is None and not routable:
            run.switch_at = now
        if run.t_clear and now >= run.t_clear:
            if run.routable_at is None and routable:
                run.routable_at = now
            if run.recover_at is None and routable and share >= FULL_SHARE * even:
                run.recover_at = now
        await asyncio.sleep(POLL_S)


async def call_one(client: Client, run: Run, i: int) -> None:
    t_send = time.monotonic()
    try:
        result = await client.call(CAPABILITY, {"i": i}, timeout=30)
        run.results.append((i, t_send, time.monotonic(), result.get("agent"), None))
    except ReachError as err:
        run.results.append((i, t_send, time.monotonic(), None, err.code))
        run.errors[i] = err.message


async def caller(client: Client, run: Run, t0: float, rate: float) -> None:
    """``run.calls`` calls, one every ``1 / rate`` seconds, whatever their latency."""
    tasks = []
    for i in range(run.calls):
        delay = t0 + i / rate - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(call_one(client, run, i)))
    await asyncio.gather(*tasks)


async def concurrent_callers(client: Client, run: Run, until: float) -> None:
    """``run.concurrency`` callers, each starting its next call when the last one ended,
    until ``until`` (monotonic)."""
    numbers = itertools.count()

    async def one_caller() -> None:
        while time.monotonic() < until:
            await call_one(client, run, next(numbers))

    await asyncio.gather(*(one_caller() for _ in range(run.concurrency)))


async def inject(run: Run, url: str) -> None:
    proc = run.procs[VICTIM]
    run.t_fault = time.monotonic()
    if run.fault == "kill":
        proc.kill()
        await proc.wait()
    elif run.fault == "freeze":
        os.kill(proc.pid, signal.SIGSTOP)
    else:
        os.kill(proc.pid, signal.SIGUSR1)
    await asyncio.sleep(run.hold_s)
    run.t_clear = time.monotonic()
    if run.fault == "kill":
        run.procs[VICTIM] = await spawn(url, VICTIM, run)
    elif run.fault == "freeze":
        os.kill(proc.pid, signal.SIGCONT)
    else:
        os.kill(proc.pid, signal.SIGUSR2)


def ms(a: float | None, b: float) -> int | None:
    return None if a is None else round((a - b) * 1000)


def summarize(run: Run, command: str, broker_cfg: Config) -> dict[str, Any]:
    failed = [r for r in run.results if r[4] is not None]
    by_code: dict[str, int] = {}
    for r in failed:
        by_code[r[4] or "?"] = by_code.get(r[4] or "?", 0) + 1
    phases = {"before": (0.0, run.t_fault), "fault": (run.t_fault, run.t_clear),
              "after": (run.t_clear, float("inf"))}  # fmt: skip
    served: dict[str, dict[str, int]] = {}
    for name, (lo, hi) in phases.items():
        counts = dict.fromkeys(run.agents, 0)
        for _, t_send, _, agent, _ in run.results:
            if agent is not None and lo <= t_send < hi:
                counts[agent] += 1
        served[name] = counts
    in_fault = [t for _, t, _, a, _ in run.results
                if a == VICTIM and run.t_fault <= t < run.t_clear]  # fmt: skip
    last_victim = max(in_fault, default=None)
    durations = sorted((r[2] - r[1]) * 1000 for r in run.results if r[4] is None)

    def pct(p: float) -> int | None:
        if not durations:
            return None
        return round(durations[min(int(p * len(durations)), len(durations) - 1)])

    detect = next((t for t, _, to, _ in run.transitions if t >= run.t_fault), None)
    return {
        "fault": run.fault,
        "command": command,
        "calls": len(run.results),
        "failed_calls": len(failed),
        "failures_by_code": by_code,
        "failures_at_ms": [
            {
                "sent_ms": ms(r[1], run.t_fault),
                "ended_ms": ms(r[2], run.t_fault),
                "code": r[4],
                "message": run.errors.get(r[0]),
            }
            for r in failed[:20]
        ],
        "switch_ms": ms(run.switch_at, run.t_fault),
        "table_switch_ms": ms(run.table_switch_at, run.t_fault),
        "detect_ms": ms(detect, run.t_fault) if run.fault != "latency" else None,
        "last_task_sent_to_victim_ms": ms(last_victim, run.t_fault),
        "routable_ms": ms(run.routable_at, run.t_clear),
        "recover_ms": ms(run.recover_at, run.t_clear),
        "served": served,
        "call_ms": {
            "p50": pct(0.5),
            "p99": pct(0.99),
            "max": round(durations[-1]) if durations else None,
            "mean": round(statistics.fmean(durations)) if durations else None,
        },
        "victim_transitions": [
            {"t_ms": ms(t, run.t_fault), "from": f, "to": to, "reason": reason}
            for t, f, to, reason in run.transitions
        ],
        "setup": {
            "agents": list(run.agents),
            "concurrency": run.concurrency or None,
            "fleet": max(run.fleet, len(run.agents)),
            "victim": VICTIM,
            "sdk_agents": run.sdk,
            "agent_args": run.agent_args,
            "hold_s": run.hold_s,
            "watch_s": run.watch_s,
            "warmup_s": run.warmup_s,
            "min_reach_score": broker_cfg.routing.min_reach_score,
            "slow_start": [broker_cfg.routing.slow_start_share, broker_cfg.routing.slow_start_s],
            "choice": broker_cfg.routing.choice,
        },
    }


def table(report: dict[str, Any]) -> str:
    def cell(v: Any) -> str:
        return "-" if v is None else str(v)

    head = ("fault", "calls", "failed", "switch_ms", "table_switch_ms", "last_to_victim_ms",
            "detect_ms", "routable_ms", "recover_ms")  # fmt: skip
    row = (report["fault"], report["calls"], report["failed_calls"], report["switch_ms"],
           report.get("table_switch_ms"), report["last_task_sent_to_victim_ms"],
           report["detect_ms"], report["routable_ms"], report["recover_ms"])  # fmt: skip
    widths = [max(len(h), len(cell(v))) for h, v in zip(head, row, strict=True)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(head, widths, strict=True)),
             "  ".join(cell(v).ljust(w) for v, w in zip(row, widths, strict=True))]  # fmt: skip
    s = report["served"]
    agents = report["setup"]["agents"]
    lines.append(f"served ({'/'.join(agents)}): " + "; ".join(
        f"{phase} {'/'.join(str(s[phase][a]) for a in agents)}" for phase in s))  # fmt: skip
    c = report["call_ms"]
    lines.append(f"call ms: p50 {c['p50']} p99 {c['p99']} max {c['max']}")
    if report["failures_by_code"]:
        lines.append(f"failures: {report['failures_by_code']}")
    return "\n".join(lines)


async def main_async(args: argparse.Namespace, command: str) -> dict[str, Any]:
    run = Run(fault=args.fault, hold_s=args.hold, watch_s=args.watch, warmup_s=args.warmup,
              calls=args.calls, sdk=args.sdk_agents, agents=NAMES[: args.agents],
              concurrency=args.concurrency, fleet=args.fleet,
              agent_args=["--heartbeat-ms", str(args.heartbeat_ms), "--work-ms",
                          str(args.work_ms), "--max-concurrency",
                          str(args.max_concurrency)])  # fmt: skip
    server = NatsServer(port=0)
    await asyncio.to_thread(server.start)
    cfg = Config()
    cfg.nats.url = server.url
    cfg.broker.metrics_port = 0

    def on_transition(t: Transition, rec: AgentRecord | None) -> None:
        if t.agent_id == VICTIM and t.kind == "state":
            run.transitions.append((time.monotonic(), t.from_, t.to, t.reason))

    broker = Broker(cfg, watchers=[on_transition])
    client: Client | None = None
    stop = asyncio.Event()
    mon: asyncio.Task[None] | None = None
    children = Children()
    try:
        await broker.start()
        simulated = run.fleet - len(run.agents)
        if simulated > 0:
            total_s = args.warmup + args.hold + args.watch + 300
            sim = await children.sim("fleet", ["--server", server.url, "--interval", "1",
                                               "--max-runtime", str(total_s)],
                                     "--agents", str(simulated))  # fmt: skip
            ready = await sim.wait_event("ready", 120)
            if ready.get("announce_errors"):
                raise RuntimeError(f"the simulated fleet did not announce: {ready}")
            deadline = time.monotonic() + 60
            while len(broker.registry.agents) < simulated:
                if time.monotonic() > deadline:
                    raise RuntimeError("the simulated fleet did not register within 60 s")
                await asyncio.sleep(0.05)

        for agent_id in run.agents:
            run.procs[agent_id] = await spawn(server.url, agent_id, run)
        # Let phi learn each agent's rhythm before anything happens.
        reg = broker.registry
        need = cfg.detection.phi_min_samples + 1
        deadline = time.monotonic() + 30
        while any(len(reg.agents[a].window) < need for a in run.agents if a in reg.agents) or \
                any(a not in reg.agents for a in run.agents):  # fmt: skip
            if time.monotonic() > deadline:
                raise RuntimeError("agents did not settle within 30 s")
            await asyncio.sleep(0.05)
        client = Client(server.url, name="chaos-caller")
        await client.start()
        mon = asyncio.create_task(monitor(broker, client, run, stop))
        total = args.warmup + args.hold + args.watch
        t0 = time.monotonic()
        if run.concurrency:
            calling = asyncio.create_task(concurrent_callers(client, run, t0 + total))
        else:
            calling = asyncio.create_task(caller(client, run, t0, args.calls / total))
        await asyncio.sleep(args.warmup)
        await inject(run, server.url)
        await asyncio.wait_for(calling, args.watch + 120)
        return summarize(run, command, cfg)
    finally:
        stop.set()
        if mon is not None:
            await asyncio.gather(mon, return_exceptions=True)
        if client is not None:
            await client.stop()
        for proc in run.procs.values():
            await reap(proc)
        await children.stop_all()
        await broker.stop()
        await asyncio.to_thread(server.stop)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m loadtest.chaos",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--fault", choices=("kill", "freeze", "latency"), required=True)
    ap.add_argument("--hold", type=float, default=45.0, help="seconds the fault lasts (45)")
    ap.add_argument("--watch", type=float, default=60.0, help="seconds watched after (60)")
    ap.add_argument("--warmup", type=float, default=5.0, help="seconds of calls before (5)")
    ap.add_argument("--calls", type=int, default=1000, help="calls over the whole run (1000)")
    ap.add_argument(
        "--concurrency",
        type=int,
        default=0,
        metavar="N",
        help="instead of --calls: N callers calling back to back for the whole run",
    )
    ap.add_argument(
        "--agents",
        type=int,
        default=3,
        choices=range(2, len(NAMES) + 1),
        metavar="N",
        help=f"agents, the first of which takes the fault (3; 2-{len(NAMES)})",
    )
    ap.add_argument("--max-concurrency", type=int, default=64, help="each agent's slots (64)")
    ap.add_argument("--heartbeat-ms", type=int, default=1000, help="agents' interval (1000)")
    ap.add_argument(
        "--fleet",
        type=int,
        default=0,
        metavar="N",
        help="agents the broker carries in all: simulated agents of other capabilities "
        "fill up to N (0: none)",
    )
    ap.add_argument("--work-ms", type=float, default=20.0, help="a normal task's time (20)")
    ap.add_argument(
        "--sdk-agents",
        action="store_true",
        help="agents on reach_agent.Agent instead of the raw-NATS chaos agent",
    )
    ap.add_argument("--report", required=True, help="JSON report file")
    ap.add_argument("-v", "--verbose", action="store_true")
    args = ap.parse_args(argv)
    if args.concurrency < 0 or args.max_concurrency < 1:
        ap.error("--concurrency must be >= 0 and --max-concurrency >= 1")
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(name)s %(message)s")  # fmt: skip
    command = "python -m loadtest.chaos " + shlex.join(argv if argv is not None else sys.argv[1:])
    report = asyncio.run(main_async(args, command))
    Path(args.report).write_text(json.dumps(report, indent=2) + "\n")
    print(table(report))
    print(f"report: {args.report}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
