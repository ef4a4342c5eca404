"""``reach demo``: an embedded nats-server, a broker, the three demo agents
(:mod:`reach_broker.demo`), a trickle of calls and the live view, all started here and all
stopped here (Ctrl-C, SIGTERM, SIGHUP, ``q`` or ``--duration``).

In order: the server (unless ``--server``), the broker, and only once *that* broker serves
(its NATS Services ping answers with its own ``broker_id``: another broker already on the
bus must not count, or agents would announce before this one listens) the agents, then the
calls and the view once the broker lists every agent healthy. An agent that dies is started
again after :data:`RESTART_DELAY_S`, so the view shows the failover and the way back; the
broker or the server dying ends the demo. Stop, the other way round: calls, agents
(SIGTERM: the SDK drains and leaves), broker, server. The children are
:mod:`~reach_broker.cli.children`; their logs are removed after a run without failure and
kept (path printed) after any failure, a restarted agent included.

``--auth`` runs it the secure way: a fresh auth DIR in the run's temp dir (``reach auth init``
with a credential per demo agent and a caller ``demo``), the embedded server from its
``server.conf`` (operator mode), the broker with ``broker.creds``, each agent with its own
``agents/<id>.creds`` (``NATS_CREDS``), the calls with the caller's credential. The view reads
the audit trail and the brokers' stats, which only the broker's credential may: it uses that.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import secrets
import shutil
import signal
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from reach_agent.wire.subjects import Subjects
from reach_broker.cluster.natsserver import NatsServer, NatsServerError
from reach_broker.demo import DEMO_AGENTS
from reach_broker.logs import say

from .children import Children
from .common import (
    EXIT_UNAVAILABLE,
    EXIT_USAGE,
    CliError,
    Subcommands,
    add_common,
    connect,
    connection_options,
    stop_on_signals,
    subjects,
)
from .democalls import Calls
from .output import print_json
from .view import SERVICE_NAME, view_loop

READY_TIMEOUT_S = 60.0
RESTART_DELAY_S = 3.0
"""How long a dead demo agent stays dead before it is started again (long enough for the
view to show it suspect, then offline or gone from the routes)."""
NOTES = 4
"""Latest restart notes shown in the view."""


def add_parser(sub: Subcommands) -> None:
    p = sub.add_parser("demo", help="embedded NATS, a broker, three demo agents and calls")
    add_common(p)
    p.add_argument("--duration", type=float, default=None,
                   help="stop after this many seconds (default: until Ctrl-C)")  # fmt: skip
    p.add_argument("--rate", type=float, default=2.0, help="demo calls per second")
    p.add_argument("--no-view", action="store_true", help="no live view (logs only)")
    p.add_argument("--interval", type=float, default=1.0, help="seconds between refreshes")
    p.add_argument("--events", type=int, default=8, help="recent events shown")
    p.add_argument("--auth", action="store_true",
                   help="secured: a fresh auth DIR, an operator-mode server and a credential "
                        "per process (see `reach auth`)")  # fmt: skip
    p.add_argument("--console-port", type=int, default=0,
                   help="port of the broker's web console (default 0: a free one)")  # fmt: skip
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.rate <= 0:
        raise CliError(f"--rate {args.rate!r} must be above zero", EXIT_USAGE)
    subs = subjects(args)
    if args.auth and args.creds:
        raise CliError("--auth makes its own credentials (one per process): leave out --creds",
                       EXIT_USAGE)  # fmt: skip
    connection_options(args, "reach-demo")  # a bad --server or --creds: say so before starting
    log_dir = Path(tempfile.mkdtemp(prefix="reach-demo-"))
    demo = Demo(args, subs, Children(log_dir))
    server: NatsServer | None = None
    try:
        url = None if args.auth else args.server  # --auth: always a secured server of its own
        if args.auth:
            server = demo.secure(log_dir / "auth")
        elif not url:
            server = NatsServer(port=0, new_session=True)
        if server is not None:
            try:
                server.start()
            except NatsServerError as exc:
                raise CliError(f"embedded nats-server: {exc}", EXIT_UNAVAILABLE) from None
            url = server.url
        assert url is not None  # --server, or the server started above
        try:
            return asyncio.run(demo.run(url, server))
        except CliError:
            demo.failed = True
            raise
    finally:
        for sig in (signal.SIGINT, signal.SIGHUP):  # a second one must not cut the cleanup
            signal.signal(sig, signal.SIG_IGN)
        demo.children.stop(list(DEMO_AGENTS))
        demo.children.stop(["broker"])
        if server is not None:
            server.stop()
        if demo.failed:
            sys.stderr.write(f"reach demo: logs kept in {log_dir}\n")
        else:
            shutil.rmtree(log_dir, ignore_errors=True)


def free_port() -> int:
    """A port free on loopback now (the broker binds it a moment later)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def child_commands(
    args: argparse.Namespace, url: str, prefix: str, broker_id: str, console_port: int
) -> tuple[list[str], dict[str, str]]:
    """The broker's command line, and the environment of every child: the server, the
    prefix, the credentials and the CA of the demo reach the broker (as flags) and the agents
    (``NATS_URL``, ``REACH_PREFIX``, ``NATS_CREDS``, ``NATS_CA``, read by the SDK). The broker
    serves its console (and /metrics) on loopback at ``console_port``."""
    env = {k: v for k, v in os.environ.items() if k != "REACH_METRICS_HOST"}
    env.update({"NATS_URL": url, "PYTHONUNBUFFERED": "1", "REACH_LOG_FORMAT": args.log_format,
                "REACH_PREFIX": prefix})  # fmt: skip
    argv = [sys.executable, "-m", "reach_broker.cli", "broker", "--server", url,
            "--metrics-port", str(console_port), "--metrics-host", "127.0.0.1",
            "--log-format", args.log_format, "--prefix", prefix,
            "--broker-id", broker_id]  # fmt: skip
    if args.creds:
        env["NATS_CREDS"] = args.creds
        argv += ["--creds", args.creds]
    tls_ca = getattr(args, "tls_ca", None)
    if tls_ca:
        env["NATS_CA"] = tls_ca
        argv += ["--tls-ca", tls_ca]
    return argv, env


class Demo:
    """One run of the demo: its children, what happened to them, and the output."""

    def __init__(self, args: argparse.Namespace, subs: Subjects, children: Children) -> None:
        self.args = args
        self.subs = subs
        self.children = children
        self.broker_id = f"demo-{os.getpid()}-{secrets.token_hex(2)}"
        self.failed = False
        self.restarts: dict[str, int] = {}
        self.notes: list[str] = []
        self.server: NatsServer | None = None
        self.console_port = args.console_port or free_port()
        self.console = f"http://127.0.0.1:{self.console_port}/"
        """The broker's web console (printed; the demo opens nothing)."""
        self.agent_creds: dict[str, str] = {}
        """Each demo agent's credential (``--auth``)."""
        self.caller_creds: str | None = None

    def secure(self, directory: Path) -> NatsServer:
        """``--auth``: an auth DIR with every credential of the demo, and its server (not
        started). The demo's own connection (view, readiness) uses the broker's credential."""
        from reach_broker.auth import init, issue_agent, issue_caller

        d = init(directory, prefix=self.subs.prefix)
        self.agent_creds = {a: str(issue_agent(d, a)) for a in DEMO_AGENTS}
        self.caller_creds = str(issue_caller(d, "demo"))
        self.args.creds = str(d.broker_creds)
        return NatsServer(port=0, config=d.server_conf, store_dir=d.store_dir,
                          config_store=True, new_session=True)  # fmt: skip

    def emit(self, record: dict[str, Any], text: str) -> None:
        """A record (``--json``) or a line; with the live view, lines go into its notes."""
        if self.args.json:
            print_json(record)
            sys.stdout.flush()
        elif self.args.no_view or record["event"] in ("started", "ready", "stopped"):
            say(f"reach demo: {text}")
        if record["event"] in ("exited", "restarted"):
            self.notes = [*self.notes, f"{time.strftime('%H:%M:%S')} {text}"][-NOTES:]

    def pids(self) -> dict[str, int]:
        pids = self.children.pids
        if self.server is not None and self.server.pid is not None:
            pids["nats-server"] = self.server.pid
        return pids

    async def run(self, url: str, server: NatsServer | None) -> int:
        args, subs = self.args, self.subs
        self.server = server
        stop = stop_on_signals()
        broker_argv, env = child_commands(args, url, subs.prefix, self.broker_id,
                                          self.console_port)  # fmt: skip
        # A wrong URL fails at once; once connected, reconnect after a blip for a minute or
        # so rather than forever (nats-py reads this option at each reconnect).
        nc = await connect(args, "reach-demo", urls=[url], allow_reconnect=True)
        nc.options["max_reconnect_attempts"] = 60
        try:
            self.children.spawn("broker", broker_argv, env)
            if not await self.until_serving(nc, stop):
                return self.stopped("signal", Calls(nc, subs.prefix, args.rate))
            for agent_id in DEMO_AGENTS:
                argv = [sys.executable, "-m", "reach_broker.demo", "agent", agent_id]
                own = self.agent_creds.get(agent_id)
                self.children.spawn(agent_id, argv, {**env, "NATS_CREDS": own} if own else env)
            logs = self.children.log_dir
            self.emit({"event": "started", "nats_url": url, "pids": self.pids(),
                       "logs": str(logs), "broker_id": self.broker_id, "console": self.console},
                      f"nats {url}; broker {self.broker_id} and agents {', '.join(DEMO_AGENTS)} "
                      f"started (logs in {logs}); console {self.console}; Ctrl-C stops "
                      "everything")  # fmt: skip
            calls_nc = nc
            if self.caller_creds is not None:  # the calls go as a caller, not as the broker
                as_caller = argparse.Namespace(**{**vars(args), "creds": self.caller_creds})
                calls_nc = await connect(as_caller, "reach-demo-calls", urls=[url],
                                         allow_reconnect=True)  # fmt: skip
            calls = Calls(calls_nc, subs.prefix, args.rate)
            try:
                if not await self.until_ready(nc, stop):
                    return self.stopped("signal", calls)
                pids = self.pids()
                agents = ", ".join(f"{a} pid {pids[a]}" for a in DEMO_AGENTS if a in pids)
                self.emit({"event": "ready", "agents": list(DEMO_AGENTS), "pids": pids},
                          f"{', '.join(DEMO_AGENTS)} healthy; calling. Kill one to watch the "
                          f"failover: {agents} (kill -9 PID; it comes back "
                          f"{RESTART_DELAY_S:g}s later)")  # fmt: skip
                return self.stopped(await self.live(nc, url, calls, stop), calls)
            finally:
                if calls_nc is not nc:
                    await calls_nc.close()
        finally:
            await nc.close()

    def stopped(self, reason: str, calls: Calls) -> int:
        record = {"event": "stopped", "reason": reason, "calls": calls.summary(),
                  "pids": self.pids(), "restarts": dict(self.restarts)}  # fmt: skip
        c = calls.summary()
        self.emit(record, f"stopped ({reason}); calls ok {c['ok']}, failed {c['failed']}, by "
                          f"agent {c['by_agent']}, restarts {self.restarts or 'none'}")  # fmt: skip
        return 1 if reason.startswith(("broker", "nats-server")) else 0

    def crashed(self) -> str | None:
        """``"<name> exited with <code>"`` when the broker or the server has ended."""
        exited = {n: c for n, c in self.children.exited().items() if n not in DEMO_AGENTS}
        proc = self.server.proc if self.server is not None else None
        if proc is not None and proc.poll() is not None:
            exited["nats-server"] = proc.returncode
        return next((f"{n} exited with {c}" for n, c in exited.items()), None)

    def _check_children(self) -> None:
        """A crashed broker (or server) is an error; agents are the supervisor's."""
        crash = self.crashed()
        if crash is not None:
            raise CliError(f"{crash}:\n{self.children.tail('broker')}", 1)

    async def until_serving(self, nc: Any, stop: asyncio.Event) -> bool:
        """Until the broker started here answers its NATS Services ping (its subscriptions
        to announces and heartbeats are made before the service, so then it hears them)."""
        from nats.micro.service import ServiceVerb, control_subject

        subject = control_subject(ServiceVerb.PING, SERVICE_NAME)
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not stop.is_set():
            self._check_children()
            if await _answers(nc, subject, self.broker_id):
                return True
            if time.monotonic() > deadline:
                raise CliError(f"broker {self.broker_id} not serving within "
                               f"{READY_TIMEOUT_S:.0f} s; its log:\n"
                               f"{self.children.tail('broker')}", 1)  # fmt: skip
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 0.1)
        return False

    async def until_ready(self, nc: Any, stop: asyncio.Event) -> bool:
        """Until a broker lists every demo agent healthy."""
        from reach_agent.wire import schema

        deadline = time.monotonic() + READY_TIMEOUT_S
        while not stop.is_set():
            self._check_children()
            for name, code in self.children.exited().items():
                raise CliError(f"{name} exited with {code} at start:\n{self.children.tail(name)}")
            try:
                msg = await nc.request(self.subs.agents, b"{}", timeout=1)
                views = schema.agent_views_decoder.decode(msg.data)
                if {v.agent_id for v in views if v.state == "healthy"} >= set(DEMO_AGENTS):
                    return True
            except Exception:  # noqa: BLE001 - broker not answering yet: ask again
                pass
            if time.monotonic() > deadline:
                raise CliError(f"demo agents not healthy within {READY_TIMEOUT_S:.0f} s; broker "
                               f"log:\n{self.children.tail('broker')}", 1)  # fmt: skip
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 0.2)
        return False

    async def live(self, nc: Any, url: str, calls: Calls, stop: asyncio.Event) -> str:
        """Calls, the view and the supervisor until a signal, --duration or a crash."""
        args = self.args
        reason = "signal"

        async def supervise() -> None:
            nonlocal reason
            deadline = None if args.duration is None else time.monotonic() + args.duration
            due: dict[str, float] = {}
            while not stop.is_set():
                now = time.monotonic()
                if deadline is not None and now >= deadline:
                    reason = "duration"
                    stop.set()
                    break
                crash = self.crashed()
                if crash is not None:
                    reason = crash
                    self.failed = True
                    stop.set()
                    break
                for name, code in self.children.exited().items():
                    if name not in due:
                        self.failed = True  # keep the logs: something went wrong
                        due[name] = now + RESTART_DELAY_S
                        self.emit({"event": "exited", "name": name, "code": code,
                                   "restart_in_s": RESTART_DELAY_S},
                                  f"{name} exited with {code}; restarting it in "
                                  f"{RESTART_DELAY_S:g} s")  # fmt: skip
                for name in [n for n, t in due.items() if t <= now and not stop.is_set()]:
                    del due[name]
                    pid = self.children.restart(name)
                    self.restarts[name] = self.restarts.get(name, 0) + 1
                    self.emit(
                        {"event": "restarted", "name": name, "pid": pid},
                        f"{name} restarted (pid {pid})",
                    )
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), 0.2)

        jobs = [asyncio.create_task(supervise()), asyncio.create_task(calls.run(stop))]
        if not args.no_view:
            jobs.append(asyncio.create_task(view_loop(
                nc, subjects=self.subs, server=url, interval=args.interval,
                timeout_s=args.timeout, max_events=args.events, once=False, as_json=args.json,
                stop=stop, title=f"reach demo · console {self.console}",
                notes=lambda: self.notes,
            )))  # fmt: skip
        try:
            await asyncio.gather(*jobs)
        finally:
            stop.set()
            for job in jobs:
                job.cancel()
            await asyncio.gather(*jobs, return_exceptions=True)
        if reason.startswith("broker"):
            sys.stderr.write(f"reach demo: {reason}; its log:\n{self.children.tail('broker')}\n")
        elif reason.startswith("nats-server"):
            sys.stderr.write(f"reach demo: {reason}\n")
        return reason


async def _answers(nc: Any, subject: str, broker_id: str, window_s: float = 0.5) -> bool:
    """Whether the reach broker ``broker_id`` is among those answering ``subject`` (a
    NATS Services ping gathers every replica) within ``window_s``."""
    import json

    inbox = nc.new_inbox()
    found = asyncio.Event()

    async def on_reply(msg: Any) -> None:
        with contextlib.suppress(ValueError, AttributeError):
            if (json.loads(msg.data).get("metadata") or {}).get("broker_id") == broker_id:
                found.set()

    sub = await nc.subscribe(inbox, cb=on_reply)
    try:
        await nc.publish(subject, b"", reply=inbox)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(found.wait(), window_s)
    finally:
        await sub.unsubscribe()
    return found.is_set()
