"""``python -m loadtest``: one broker under simulated agents and route load, against raw NATS.

Starts (unless ``--server``) a ``nats-server``, then the broker as a subprocess (its CPU and
RSS are read from ``/proc/<pid>``, its counters from its ``/metrics``), an echo responder,
simulated agents in their own processes, and the request driver in another. Phases:

1. register: every agent announces; broker RSS before and after gives RSS per agent;
2. heartbeats only: broker CPU with the fleet heartbeating;
3. load: echo and route slices alternate (``--rounds``), same driver, same client settings;
4. re-announce storm: every agent of the first sim process announces again at once;
5. kill: 10% stop heartbeating and answering probes (connections open), then another 10%
   are SIGKILLed (one connection each, named by agent_id, so the server's disconnect
   advisory names them); each time we poll ``reach.route.<their capability>`` until no
   candidate comes back;
6. accounting: heartbeats sent (as the sims count them) minus the broker's
   ``reach_heartbeats_total``;
7. heartbeat storm, last: one sim process sends heartbeats at ``--storm-rate`` for a few
   seconds.

Each phase returns its figures (:mod:`loadtest.phases`, :mod:`loadtest.rounds`); the report
is assembled from them in :func:`loadtest.report.assemble`. Every child is ours and is ended
in ``finally``, by PID (:mod:`loadtest.children`); a watchdog bounds the whole run.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import sys
import traceback
from collections.abc import Awaitable
from datetime import UTC, datetime

from . import brokers, phases
from . import report as rpt
from .children import Children
from .infra import Infra
from .procfs import loadavg
from .rounds import load
from .sim import CAPABILITIES

log = logging.getLogger("loadtest")


class Settings(rpt.Figures, frozen=True, kw_only=True):
    """What the run was asked to do (the first keys of the report)."""

    date_utc: str
    host_cores: int | None
    loadavg_start: str
    agents: int
    interval_s: float
    duration_s: float
    concurrency: int
    rounds: int
    kill_share: float
    capabilities: int
    connections_per_sim: int
    conn_per_agent: bool


class End(rpt.Figures, frozen=True, kw_only=True):
    loadavg_end: str


class Progress:
    """Which phase the run is in: what a failure is reported with."""

    def __init__(self) -> None:
        self.phase = "start"

    def enter(self, phase: str) -> None:
        self.phase = phase
        log.info("%s", phase)


def failure(phase: str, exc: BaseException) -> str:
    """What failed, in which phase and where: the exception's type and text, and the
    load tool's frames it came through (innermost last)."""
    kind = type(exc)
    name = kind.__name__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__name__}"
    text = str(exc)
    ours = [
        f"{frame.filename.rsplit('/loadtest/', 1)[1]}:{frame.lineno} {frame.name}"
        for frame in traceback.extract_tb(exc.__traceback__)[1:]  # [0]: where it was caught
        if "/loadtest/" in frame.filename
    ]
    where = f" at {' < '.join(reversed(ours[-3:]))}" if ours else ""
    return f"phase {phase!r}: {name}{': ' + text if text else ''}{where}"


def settings(a: argparse.Namespace) -> Settings:
    return Settings(
        date_utc=datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        host_cores=os.cpu_count(), loadavg_start=loadavg(), agents=a.agents,
        interval_s=a.interval, duration_s=a.duration, concurrency=a.concurrency,
        rounds=a.rounds, kill_share=a.kill_share, capabilities=a.capabilities,
        connections_per_sim=a.connections, conn_per_agent=a.conn_per_agent,
    )  # fmt: skip


async def run(
    a: argparse.Namespace, infra: Infra, parts: list[rpt.Figures], progress: Progress
) -> None:
    """The phases in order; each one's figures are appended to ``parts`` as it returns, so a
    run cut short still reports what it measured."""
    progress.enter("setup")
    system = await infra.start()
    parts.append(system.setup)
    progress.enter("register")
    fleet, registration = await phases.register(a, system, infra.children)
    parts.append(registration)
    progress.enter("heartbeats only")
    hb_only = await phases.heartbeats_only(a, system)
    parts.append(hb_only)
    progress.enter("route and echo rounds")
    parts.append(await load(a, system, infra.children, hb_only.broker_cpu_share_heartbeats))
    if a.reannounce:
        progress.enter("re-announce storm")
        parts.append(await phases.reannounce(a, fleet))
    if fleet.victims:
        progress.enter("kill")
        parts.append(await phases.kill(a, system, fleet))
    progress.enter("accounting")
    parts.append(await phases.accounting(system, fleet))
    # Last: a storm may leave the broker behind for a while, which would blur the rest.
    if system.observer.metrics_url and a.storm_seconds > 0:
        progress.enter("heartbeat storm")
        parts.append(await phases.storm(a, system, fleet))
    parts.append(End(loadavg_end=loadavg()))


async def watched(run: Awaitable[None], budget_s: float, progress: Progress) -> str | None:
    """Await ``run`` within ``budget_s``: None when it completed, else what cut it short,
    logged. The watchdog's message only when the budget itself ran out; a wait inside a
    phase that gave up (a ``TimeoutError``), a request nobody answered, any other error is
    reported as what it is, with the phase and where."""
    budget = asyncio.timeout(budget_s)
    try:
        async with budget:
            await run
    except TimeoutError as exc:
        if not budget.expired():
            failed = failure(progress.phase, exc)
            log.error("failed in %s", failed)
            return failed
        log.warning("watchdog: the run exceeded --budget %g s in phase %r; partial report",
                    budget_s, progress.phase)  # fmt: skip
        return f"phase {progress.phase!r}: the run exceeded --budget {budget_s:g} s"
    except Exception as exc:
        failed = failure(progress.phase, exc)
        log.error("failed in %s", failed)
        return failed
    return None


async def amain(args: argparse.Namespace) -> int:
    head = settings(args)
    infra = Infra(args, Children())
    parts: list[rpt.Figures] = []
    progress = Progress()
    task = asyncio.current_task()
    assert task is not None
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, task.cancel)
    try:
        failed = await watched(run(args, infra, parts, progress), args.budget, progress)
    finally:
        pids = infra.pids()
        await infra.close()
    report = rpt.assemble(head, parts, pids=pids, loadavg_end=loadavg(), complete=failed is None,
                          failure=failed)  # fmt: skip
    if args.report:
        rpt.write(report, args.report)
    print(report["summary"])
    return 0 if failed is None else 1


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m loadtest", description=__doc__.split("\n")[0])
    p.add_argument("--agents", type=int, default=1000)
    p.add_argument("--interval", type=float, default=1.0, help="heartbeat interval (s)")
    p.add_argument("--duration", type=float, default=10.0, help="seconds of route and of echo load")
    p.add_argument("--concurrency", type=int, default=64, help="concurrent requesters")
    p.add_argument("--report", help="write the JSON report here")
    p.add_argument("--server", default=os.environ.get("NATS_URL"),
                   help="use this NATS server (default: start one)")  # fmt: skip
    p.add_argument("--prefix", default="reach")
    p.add_argument("--no-broker", action="store_true",
                   help="use a broker already serving --server (no CPU/RSS figures)")  # fmt: skip
    p.add_argument("--metrics-url", help="/metrics of that broker (for heartbeat counts)")
    p.add_argument("--broker-config", help="broker.toml for the broker we start")
    p.add_argument("--connections", type=int, default=8, help="NATS connections per sim process")
    p.add_argument("--capabilities", type=int, default=len(CAPABILITIES), choices=range(1, 11),
                   metavar="1..10",
                   help="shared capabilities the route load is spread over")  # fmt: skip
    p.add_argument("--conn-per-agent", action="store_true", help="one connection per agent")
    p.add_argument("--sim-procs", type=int, default=1, help="sim processes for the fleet")
    p.add_argument("--rounds", type=int, default=2, help="alternating echo/route slices")
    p.add_argument("--latency-seconds", type=float, default=2.0,
                   help="single-requester latency of echo and route (0 skips)")  # fmt: skip
    p.add_argument("--warmup", type=float, default=1.0, help="driver warm-up per slice (s)")
    p.add_argument("--kill-share", type=float, default=0.1,
                   help="share of agents silenced, another share SIGKILLed (0: skip)")  # fmt: skip
    p.add_argument("--storm-rate", type=float, default=60_000, help="heartbeats/s offered")
    p.add_argument("--storm-seconds", type=float, default=3.0, help="0 skips the storm")
    p.add_argument("--no-reannounce", dest="reannounce", action="store_false")
    p.add_argument("--profile-broker", metavar="FILE", help="run the broker under cProfile")
    p.add_argument("--budget", type=float, default=0.0,
                   help="hard limit on the whole run (s; default from the phases)")  # fmt: skip
    p.add_argument("--verbose", action="store_true", help="show the broker's log")
    brokers.add_options(p)
    args = p.parse_args(argv)
    if args.brokers:  # the partitioned run (loadtest/brokers.py): no victims, its own phases
        args.kill_share = 0.0
        if args.budget <= 0:
            args.budget = 300 + 4 * args.measure + 20 * args.interval + args.agents / 50
    if args.budget <= 0:
        args.budget = (
            120
            + 2.5 * (args.duration + 2 * args.rounds * args.warmup)
            + 20 * args.interval
            + args.storm_seconds
            + args.agents / 50
        )
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.brokers:
        return brokers.main(args)
    # Progress on stderr, as "[loadtest 12:00:00] message"; the summary goes to stdout.
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("[loadtest %(asctime)s] %(message)s", "%H:%M:%S"))
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False
    with contextlib.suppress(ImportError):
        import uvloop

        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    try:
        return asyncio.run(amain(args))
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
