"""``reach demo``: an embedded nats-server, a broker, the three demo agents
(:mod:`reach_broker.demo`), a trickle of calls and the live view, all started here and all
stopped here (Ctrl-C, SIGTERM, ``q`` or ``--duration``).

The broker and the agents are child processes in sessions of their own, so a Ctrl-C at the
terminal reaches only this process, which then stops them in order: calls, agents (SIGTERM:
the SDK drains and leaves), broker, server. A child that does not exit within its grace is
killed; on Linux every child also gets SIGTERM if this process dies first (PDEATHSIG).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from reach_agent.subjects import Subjects

from ..demo import DEMO_AGENTS, PAYLOADS
from ..natsserver import NatsServer, NatsServerError
from .common import (
    EXIT_UNAVAILABLE,
    EXIT_USAGE,
    CliError,
    Subcommands,
    add_common,
    stop_on_signals,
    subjects,
)
from .output import print_json
from .view import view_loop

log = logging.getLogger(__name__)

READY_TIMEOUT_S = 60.0
STOP_GRACE_S = 10.0


def add_parser(sub: Subcommands) -> None:
    p = sub.add_parser("demo", help="embedded NATS, a broker, three demo agents and calls")
    add_common(p)
    p.add_argument("--duration", type=float, default=None,
                   help="stop after this many seconds (default: until Ctrl-C)")  # fmt: skip
    p.add_argument("--rate", type=float, default=2.0, help="demo calls per second")
    p.add_argument("--no-view", action="store_true", help="no live view (logs only)")
    p.add_argument("--interval", type=float, default=1.0, help="seconds between refreshes")
    p.add_argument("--events", type=int, default=8, help="recent events shown")
    p.set_defaults(func=run)


# --- child processes ----------------------------------------------------------------------


def _die_with_parent() -> None:
    """preexec_fn: SIGTERM this child when the demo process dies (Linux prctl)."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


class Children:
    """The demo's child processes, stopped in reverse start order."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def spawn(self, name: str, argv: list[str], env: dict[str, str]) -> int:
        logfile = open(self.log_dir / f"{name}.log", "wb")
        try:
            proc = subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=logfile, stderr=subprocess.STDOUT,
                env=env, start_new_session=True,
                preexec_fn=_die_with_parent if sys.platform == "linux" else None,
            )  # fmt: skip
        finally:
            logfile.close()
        self.procs[name] = proc
        log.debug("demo.spawned name=%s pid=%d", name, proc.pid)
        return proc.pid

    def exited(self) -> dict[str, int]:
        return {n: p.returncode for n, p in self.procs.items() if p.poll() is not None}

    def stop(self, names: list[str], grace: float = STOP_GRACE_S) -> None:
        """SIGTERM ``names`` together, wait up to ``grace``, then SIGKILL what is left."""
        procs = [self.procs[n] for n in names if n in self.procs]
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace
        for proc in procs:
            try:
                proc.wait(max(deadline - time.monotonic(), 0.01))
            except subprocess.TimeoutExpired:
                log.warning("demo.kill pid=%d: no exit %.0f s after SIGTERM", proc.pid, grace)
                proc.kill()
                proc.wait()

    def tail(self, name: str, lines: int = 15) -> str:
        path = self.log_dir / f"{name}.log"
        try:
            return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


# --- the demo -------------------------------------------------------------------------------


class Calls:
    """A trickle of calls over every demo capability, counted by outcome."""

    def __init__(self, url: str, rate: float) -> None:
        self.url = url
        self.rate = rate
        self.ok = 0
        self.failed: dict[str, int] = {}
        self.by_agent: dict[str, int] = {}

    async def run(self, stop: asyncio.Event) -> None:
        import reach_agent

        caps = sorted(PAYLOADS)
        pending: set[asyncio.Task[None]] = set()
        sem = asyncio.Semaphore(16)
        async with reach_agent.Client(self.url, name="reach-demo-caller") as client:

            async def one(cap: str) -> None:
                async with sem:
                    try:
                        result = await client.call(cap, PAYLOADS[cap], timeout=10)
                    except reach_agent.ReachError as err:
                        self.failed[err.code] = self.failed.get(err.code, 0) + 1
                        return
                    self.ok += 1
                    by = result.get("by", "?") if isinstance(result, dict) else "?"
                    self.by_agent[by] = self.by_agent.get(by, 0) + 1

            i = 0
            while not stop.is_set():
                task = asyncio.create_task(one(caps[i % len(caps)]))
                pending.add(task)
                task.add_done_callback(pending.discard)
                i += 1
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), 1.0 / self.rate)
            if pending:
                await asyncio.wait(pending, timeout=STOP_GRACE_S)
                for task in pending:
                    task.cancel()

    def summary(self) -> dict[str, Any]:
        return {"ok": self.ok, "failed": dict(sorted(self.failed.items())),
                "by_agent": dict(sorted(self.by_agent.items()))}  # fmt: skip


def run(args: argparse.Namespace) -> int:
    if args.rate <= 0:
        raise CliError(f"--rate {args.rate!r} must be above zero", EXIT_USAGE)
    subs = subjects(args)
    log_dir = Path(tempfile.mkdtemp(prefix="reach-demo-"))
    children = Children(log_dir)
    server: NatsServer | None = None
    failed = False
    try:
        url = args.server
        if not url:
            server = NatsServer(port=0, new_session=True)
            try:
                server.start()
            except NatsServerError as exc:
                raise CliError(f"embedded nats-server: {exc}", EXIT_UNAVAILABLE) from None
            url = server.url
        env = {**os.environ, "NATS_URL": url, "PYTHONUNBUFFERED": "1",
               "REACH_LOG_FORMAT": args.log_format}  # fmt: skip
        cli = [sys.executable, "-m", "reach_broker.cli"]
        broker_argv = [*cli, "broker", "--server", url, "--metrics-port", "0",
                       "--log-format", args.log_format]  # fmt: skip
        pids = {"broker": children.spawn("broker", broker_argv, env)}
        for agent_id in DEMO_AGENTS:
            pids[agent_id] = children.spawn(
                agent_id, [sys.executable, "-m", "reach_broker.demo", "agent", agent_id], env
            )
        if server is not None and server.pid is not None:
            pids["nats-server"] = server.pid
        started = {"event": "started", "nats_url": url, "pids": pids, "logs": str(log_dir)}
        if args.json:
            print_json(started)
        else:
            print(f"reach demo: nats {url}; broker and agents {', '.join(DEMO_AGENTS)} "
                  f"started (logs in {log_dir}); Ctrl-C stops everything", flush=True)  # fmt: skip
        calls = Calls(url, args.rate)
        try:
            result = asyncio.run(_demo(args, subs, url, children, calls))
        except CliError:
            failed = True
            raise
        summary = {"event": "stopped", "reason": result, "calls": calls.summary(), "pids": pids}
        if args.json:
            print_json(summary)
        else:
            c = calls.summary()
            print(f"reach demo: stopped ({result}); calls ok {c['ok']}, failed {c['failed']}, "
                  f"by agent {c['by_agent']}", flush=True)  # fmt: skip
        return 0
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not cut cleanup
        children.stop(list(DEMO_AGENTS))
        children.stop(["broker"])
        if server is not None:
            server.stop()
        if failed:
            sys.stderr.write(f"reach demo: logs kept in {log_dir}\n")
        else:
            shutil.rmtree(log_dir, ignore_errors=True)


async def _demo(
    args: argparse.Namespace, subs: Subjects, url: str, children: Children, calls: Calls
) -> str:
    """Wait for the fleet, then calls + live view until a signal, --duration or a crash."""
    import nats

    from reach_agent.connection import connect_options

    stop = stop_on_signals()
    reason = "signal"
    # Its own server (or --server): reconnect after a blip, but give up on a wrong URL
    # after a minute or so instead of waiting forever.
    nc = await nats.connect(**connect_options("reach-demo", url, connect_timeout=5,
                                              max_reconnect_attempts=60))  # fmt: skip
    try:
        await _wait_ready(nc, subs, children, stop)
        if stop.is_set():
            return reason

        async def watchdog() -> None:
            nonlocal reason
            deadline = None if args.duration is None else time.monotonic() + args.duration
            while not stop.is_set():
                if deadline is not None and time.monotonic() >= deadline:
                    reason = "duration"
                    stop.set()
                elif children.exited():
                    reason = f"child exited: {children.exited()}"
                    stop.set()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), 0.2)

        jobs = [asyncio.create_task(watchdog()), asyncio.create_task(calls.run(stop))]
        if not args.no_view:
            jobs.append(asyncio.create_task(view_loop(
                nc, subjects=subs, server=url, interval=args.interval,
                timeout_s=args.timeout, max_events=args.events, once=False, as_json=args.json,
                stop=stop, title="reach demo",
            )))  # fmt: skip
        try:
            await asyncio.gather(*jobs)
        finally:
            stop.set()
            for job in jobs:
                job.cancel()
            await asyncio.gather(*jobs, return_exceptions=True)
    finally:
        await nc.close()
    return reason


async def _wait_ready(nc: Any, subs: Subjects, children: Children, stop: asyncio.Event) -> None:
    """Until the broker lists every demo agent healthy; a crashed child is an error."""
    from reach_agent import schema

    deadline = time.monotonic() + READY_TIMEOUT_S
    while not stop.is_set():
        if children.exited():
            name, code = next(iter(children.exited().items()))
            raise CliError(f"{name} exited with {code} at start:\n{children.tail(name)}", 1)
        try:
            msg = await nc.request(subs.agents, b"{}", timeout=1)
            views = schema.agent_views_decoder.decode(msg.data)
            healthy = {v.agent_id for v in views if v.state == "healthy"}
            if healthy >= set(DEMO_AGENTS):
                return
        except Exception:  # noqa: BLE001 - broker not answering yet: ask again
            pass
        if time.monotonic() > deadline:
            raise CliError(f"demo agents not healthy within {READY_TIMEOUT_S:.0f} s; broker log:\n"
                           f"{children.tail('broker')}", 1)  # fmt: skip
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), 0.2)
