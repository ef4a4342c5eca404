"""``python -m loadtest.nemesis``: faults injected under load, then every breach of the
delivery guarantee found in the history (in the spirit of Jepsen).

    python -m loadtest.nemesis --duration 60 --seed 7 --report r.json

The system: a three-node NATS cluster (the ``reach dev-cluster`` nodes,
:mod:`reach_broker.cluster.natscluster`, with ``no_advertise`` so a client knows only the
addresses it is given), two ``reach broker`` processes, four SDK agents
(:mod:`loadtest.nemesis_agent`: a claimed capability whose handler writes each run's start
and end to a log of its own) and three callers (:mod:`loadtest.nemesis_caller`: ``call``
and ``submit`` back to back, their own request ids, every operation written down). Each
agent and broker reaches each node through a TCP proxy of its own
(:mod:`loadtest.tcpproxy`, one child process), so its link can be cut or stalled; callers
connect to the nodes directly. An independent monitor (one connection pinned to each node)
notes every heartbeat and every broker event it sees.

The nemesis (:mod:`loadtest.faults`) injects a fault every ``--interval`` seconds from
``--warmup`` on: SIGKILL or SIGSTOP of an agent, a broker or a node, a cut or stall of an
agent's or a broker's link, a broker restart; each is healed after its hold (a killed
process is started again with the same id and store). The schedule is a function of
``--seed``. After ``--duration`` every fault is healed, the cluster, brokers and agents are
waited for, the callers resolve what they left open (``finish``), the agents are stopped
(draining), and the history is read: the callers' and handlers' logs, ``REACH_ACKS``, the
compensation queue, ``REACH_AUDIT`` (with the monitor's live copy of the events), the
proxies' links and the faults. :func:`loadtest.history.check` lists the violations.

Prints a summary table, writes ``--report`` (JSON: ``violations``, ``faults``,
``fault_kinds``, ``calls``, ``submits``, ``unresolved``, …) and exits 1 on any violation
(2 when the run itself could not be made: a process that would not start, the budget).
Every process is ours, on loopback, started with ``PR_SET_PDEATHSIG`` and ended by PID;
the run is bounded (``--budget``). The run's files (logs, stores) are kept with ``--dir``.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import dataclasses
import json
import logging
import os
import re
import secrets
import shlex
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import msgspec
import nats
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js.api import DeliverPolicy

from jetstream import ackreads, audit, compensation
from jetstream.claims import ClaimStore, ClaimsUnavailable, claim_key
from jetstream.names import ACK_STREAM
from reach_agent.client.listing import agent_pages
from reach_agent.wire import schema
from reach_agent.wire.subjects import Subjects
from reach_broker.cluster.clusterconfig import plan
from reach_broker.cluster.natscluster import Cluster, Node

from . import faults, history
from .children import PY, Child, Children

log = logging.getLogger("loadtest.nemesis")

AGENTS = ("a1", "a2", "a3", "a4")
BROKERS = ("b1", "b2")
CALLERS = ("c1", "c2", "c3")
NODES = ("n1", "n2", "n3")
READY_S = 30.0
BROKER_READY_S = 120.0
"""How long a broker that is up may take to serve: it waits for JetStream itself (backing
off up to 8 s), and a restart amid node faults took 43-47 s (nemesis seed 77: a 30 s wait
aborted the run, no verdict)."""
HISTORY_FILE = "history.json"
"""The run's history, as the checker read it (kept with ``--dir``; ``--check`` reads it)."""
SILENCE = re.compile(r"no heartbeat for ([0-9.]+)s")
"""The silence a broker names as its reason for a move (docs/protocol.md, Events)."""
OFFLINE_AFTER = 6.0
"""The brokers' ``detection.offline_after`` (default): the checker's window."""


# --- the system under test ----------------------------------------------------------------


class Stack:
    """Everything a run starts, and the faults done to it."""

    def __init__(self, args: argparse.Namespace, root: Path, children: Children) -> None:
        self.args = args
        self.root = root
        self.children = children
        self.subjects = Subjects()
        configs = [dataclasses.replace(c, no_advertise=True)
                   for c in plan(len(NODES), None, root / "cluster",
                                 sys_password=secrets.token_urlsafe(16))]  # fmt: skip
        self.cluster = Cluster(configs, root / "cluster")
        self.proxy: Child | None = None
        self.proxied: dict[str, list[str]] = {}
        """owner → its proxies' URLs (one per node, its own node first)."""
        self.brokers: dict[str, Child] = {}
        self.agents: dict[str, Child] = {}
        self.callers: dict[str, Child] = {}
        self.killed: dict[int, float] = {}
        """PID → when it was SIGKILLed (the agents')."""
        self.done: list[history.Fault] = []
        self.node_pids: list[int] = []
        """Every nats-server process started (restarts included)."""
        self.start_failures: list[str] = []
        """Broker starts that failed (the process exited at start), with its last line."""
        self._locks: dict[str, asyncio.Lock] = collections.defaultdict(asyncio.Lock)
        self._broker_toml = root / "broker.toml"

    # --- start -----------------------------------------------------------------------------

    def start_cluster(self) -> None:
        """The nodes (blocking; from the main thread, so PR_SET_PDEATHSIG ties them to us)."""
        self.cluster.start(READY_S, die_with_parent_=True)
        self.node_pids += [n.pid for n in self.cluster.nodes if n.pid is not None]

    @property
    def node_urls(self) -> list[str]:
        return self.cluster.urls

    async def start_proxies(self) -> None:
        self.proxy = await self.children.spawn(
            "proxy", PY, "-m", "loadtest.tcpproxy", "--links", str(self.root / "links.jsonl"),
            stdin=True, log=None,
        )  # fmt: skip
        for i, owner in enumerate((*BROKERS, *AGENTS)):
            urls = []
            for j in range(len(NODES)):
                node = self.cluster.nodes[(i + j) % len(NODES)]
                got = await self.proxy.command(f"add {owner}.{node.name} {node.url[7:]}", "add")
                urls.append(f"nats://127.0.0.1:{got['port']}")
            self.proxied[owner] = urls

    async def start_broker(self, name: str) -> None:
        if not self._broker_toml.exists():
            self._broker_toml.write_text(
                f'[broker]\ntoken_secret = "{secrets.token_hex(16)}"\nmetrics_port = 0\n'
            )
        logfile = self.root / f"{name}.log"
        deadline = time.monotonic() + READY_S
        while True:
            offset = logfile.stat().st_size if logfile.exists() else 0
            child = await self.children.spawn(
                name, PY, "-m", "reach_broker.cli", "broker", "--server",
                ",".join(self.proxied[name]), "--broker-id", name, "--config",
                str(self._broker_toml), "--metrics-port", "0", "--log-level", "info",
                log=str(logfile),
            )  # fmt: skip
            self.brokers[name] = child
            try:
                await _wait_line(logfile, offset, "serving on", child, BROKER_READY_S)
                return
            except ChildExited:
                # As a supervisor would: start it again (`reach broker` exits when JetStream
                # is not ready at its start, e.g. right after a node restarted).
                why = _read_bytes(logfile, offset).decode(errors="replace").strip()
                self.start_failures.append(f"{name}: {why.splitlines()[-1] if why else '?'}")
                log.warning("broker.start_failed broker=%s: %s", name, self.start_failures[-1])
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(1.0)

    async def start_agent(self, name: str) -> None:
        wal = self.root / "wal" / name
        wal.mkdir(parents=True, exist_ok=True)
        self.agents[name] = await self.children.spawn(
            name, PY, "-m", "loadtest.nemesis_agent", "--id", name,
            "--servers", ",".join(self.proxied[name]), "--log", str(self.runs_log(name)),
            "--wal", str(wal), "--heartbeat", str(self.args.heartbeat),
            log=str(self.root / f"{name}.log"),
        )  # fmt: skip

    def runs_log(self, agent: str) -> Path:
        return self.root / f"{agent}.runs.jsonl"

    def ops_log(self, caller: str) -> Path:
        return self.root / f"{caller}.ops.jsonl"

    async def start_callers(self) -> None:
        for name in CALLERS:
            child = await self.children.spawn(
                name, PY, "-m", "loadtest.nemesis_caller", "--name", name,
                "--servers", ",".join(self.node_urls), "--log", str(self.ops_log(name)),
                "--seed", str(self.args.seed), "--concurrency", str(self.args.concurrency),
                stdin=True, err_log=str(self.root / f"{name}.log"),
            )  # fmt: skip
            self.callers[name] = child
            try:
                await child.wait_event("ready", READY_S)
            except (RuntimeError, TimeoutError) as exc:
                raise RuntimeError(f"caller {name}: {exc!r}; see {self.root / name}.log") from None

    # --- faults ----------------------------------------------------------------------------

    def _pid(self, group: str, target: str) -> int:
        if group == "node":
            pid = self.cluster.node(target).pid
            assert pid is not None, f"node {target} is not running"
            return pid
        return (self.agents if group == "agent" else self.brokers)[target].pid

    async def inject(self, p: faults.Planned) -> None:
        """Do fault ``p``, hold it, heal it; record it (one target, one fault at a time)."""
        async with self._locks[p.target]:
            start = time.time()
            log.info("fault.start kind=%s target=%s hold=%.2f", p.kind, p.target, p.hold)
            try:
                await self._do(p)
                await asyncio.sleep(p.hold)
            finally:
                await self._heal(p)
                self.done.append(history.Fault(kind=p.kind, target=p.target, start=start,
                                               end=time.time()))  # fmt: skip
                log.info("fault.end kind=%s target=%s", p.kind, p.target)

    async def _do(self, p: faults.Planned) -> None:
        group, verb = p.group, p.verb
        if verb == "stop":
            os.kill(self._pid(group, p.target), signal.SIGSTOP)
        elif verb in ("cut", "stall"):
            assert self.proxy is not None
            await self.proxy.command(f"{verb} {p.target}", verb)
        elif verb == "kill" and group == "node":
            self.cluster.node(p.target).kill()
        elif verb == "kill":
            child = (self.agents if group == "agent" else self.brokers)[p.target]
            self.killed[child.pid] = time.time()
            await child.kill()
        elif verb == "restart":
            await self.brokers[p.target].stop(grace=10.0)

    async def _heal(self, p: faults.Planned) -> None:
        group, verb = p.group, p.verb
        if verb == "stop":
            with contextlib.suppress(ProcessLookupError):
                os.kill(self._pid(group, p.target), signal.SIGCONT)
        elif verb in ("cut", "stall"):
            assert self.proxy is not None
            await self.proxy.command(f"restore {p.target}", "restore")
        elif group == "node":
            await self.restart_node(self.cluster.node(p.target))
        elif group == "agent":
            await self.start_agent(p.target)
        else:
            await self.start_broker(p.target)

    async def restart_node(self, node: Node) -> None:
        node.spawn(die_with_parent_=True)  # forked on the main thread (PR_SET_PDEATHSIG)
        if node.pid is not None:
            self.node_pids.append(node.pid)
        await asyncio.to_thread(node.wait_listening)

    # --- after the faults ------------------------------------------------------------------

    async def wait_settled(self, nc: NATS, within: float) -> None:
        """The cluster agrees on a meta leader, and every agent is healthy to a broker. The
        fleet is read whole, paged partition by partition as ``reach agents`` does: one
        ``reach.agents`` reply lists only the answering broker's partitions."""
        await asyncio.to_thread(self.cluster.wait_ready, within)
        deadline = time.monotonic() + within
        states: dict[str, str] = {}
        while time.monotonic() < deadline:
            with contextlib.suppress(Exception):
                async with asyncio.timeout(deadline - time.monotonic()):
                    pages = [page async for page in agent_pages(nc, self.subjects)]
                states = {v.agent_id: v.state for page in pages for v in page.agents}
                if all(states.get(a) == "healthy" for a in AGENTS):
                    return
            await asyncio.sleep(0.5)
        log.warning("settle.incomplete states=%s", states)

    async def stop_all(self) -> None:
        """SIGCONT whatever a fault left stopped, then every child by PID, then the nodes."""
        for group in (self.agents, self.brokers):
            for child in group.values():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(child.pid, signal.SIGCONT)
        for node in self.cluster.nodes:
            if node.pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(node.pid, signal.SIGCONT)
        await self.children.stop_all()
        await asyncio.to_thread(self.cluster.stop)


class ChildExited(RuntimeError):
    """A child exited while it was being waited for."""


async def _wait_line(path: Path, offset: int, text: str, child: Child, within: float) -> None:
    """Wait until ``text`` appears in ``path`` after ``offset`` (the child's own lines)."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if text.encode() in _read_bytes(path, offset):
            return
        if not child.alive():
            raise ChildExited(f"{child.name} (pid {child.pid}) exited; see {path}")
        await asyncio.sleep(0.1)
    raise RuntimeError(f"{child.name} did not say {text!r} within {within} s; see {path}")


# --- the monitor --------------------------------------------------------------------------


class Monitor:
    """One connection pinned to each node: every heartbeat and every event it sees."""

    def __init__(self, subjects: Subjects) -> None:
        self.subjects = subjects
        self.beats: dict[str, list[float]] = collections.defaultdict(list)
        self.events: dict[tuple[Any, ...], history.Event] = {}
        self.conns: list[NATS] = []

    async def start(self, urls: list[str]) -> None:
        for i, url in enumerate(urls):
            nc = await nats.connect(url, name=f"nemesis-monitor-{i + 1}", allow_reconnect=True,
                                    max_reconnect_attempts=-1, reconnect_time_wait=0.5,
                                    ping_interval=2, max_outstanding_pings=2,
                                    error_cb=_quiet)  # fmt: skip
            # Plain (a server that does not map) and mapped (docs/protocol.md, "Partitioned
            # ingest"): a heartbeat arrives on exactly one of them.
            await nc.subscribe(self.subjects.all_heartbeats, cb=self._on_beat)
            await nc.subscribe(self.subjects.partition_heartbeats("*"), cb=self._on_beat)
            await nc.subscribe(self.subjects.all_events, cb=self._on_event)
            self.conns.append(nc)

    async def _on_beat(self, msg: Msg) -> None:
        self.beats[self.subjects.agent_of_heartbeat(msg.subject)].append(time.time())

    async def _on_event(self, msg: Msg) -> None:
        if audit.is_copy(msg, live=True):
            return
        self.add_event(msg.data)

    def add_event(self, data: bytes) -> None:
        try:
            ev = schema.event_decoder.decode(data)
        except msgspec.MsgspecError:
            return
        if ev.kind not in ("state", "released"):
            return
        key = (ev.kind, ev.agent_id, ev.at_ms, ev.to, ev.request_id, ev.broker_id)
        said = SILENCE.match(ev.reason or "")
        self.events[key] = history.Event(kind=ev.kind, agent=ev.agent_id, at=ev.at_ms / 1000,
                                         broker=ev.broker_id, to=ev.to, rid=ev.request_id,
                                         silence_s=float(said[1]) if said else None)  # fmt: skip

    async def stop(self) -> None:
        for nc in self.conns:
            with contextlib.suppress(Exception):
                await nc.close()


async def _quiet(exc: Exception) -> None:
    log.debug("monitor.nats_error error=%r", exc)


# --- reading the stores -------------------------------------------------------------------


async def read_acks(nc: NATS, subjects: Subjects) -> list[history.Ack]:
    """Every attributed record in ``REACH_ACKS`` (an ordered consumer from the first)."""
    js = nc.jetstream(timeout=5.0)
    last = (await js.stream_info(ACK_STREAM)).state.last_seq
    out: list[history.Ack] = []
    if not last:
        return out
    sub = await js.subscribe(subjects.all_acks, ordered_consumer=True,
                             deliver_policy=DeliverPolicy.ALL)  # fmt: skip
    try:
        while True:
            msg = await sub.next_msg(timeout=10.0)
            stored = ackreads.attribute(msg.subject, msg.headers, msg.data,
                                        msg.metadata.sequence.stream, subjects)  # fmt: skip
            if not isinstance(stored, str):
                out.append(_ack(stored))
            if msg.metadata.sequence.stream >= last:
                return out
    finally:
        await sub.unsubscribe()


def _ack(stored: ackreads.StoredAck) -> history.Ack:
    try:
        rec = schema.decode_ack_record(stored.data)
    except (msgspec.MsgspecError, ValueError):
        return history.Ack(author=stored.author, rid=stored.request_id, agent="?",
                           state=stored.state)  # fmt: skip
    run = None
    if rec.result is not None:
        with contextlib.suppress(msgspec.MsgspecError):
            body = msgspec.json.decode(bytes(rec.result))
            run = body.get("run") if isinstance(body, dict) else None
    return history.Ack(author=stored.author, rid=rec.request_id, agent=rec.agent_id,
                       state=rec.state, run=run,
                       code=(rec.error or {}).get("code"))  # fmt: skip


async def read_history(stack: Stack, nc: NATS, monitor: Monitor) -> history.History:
    subjects = stack.subjects
    for stored in await audit.read_events(nc, subjects=subjects, since_s=None, limit=1_000_000,
                                          timeout_s=5.0):  # fmt: skip
        monitor.add_event(stored.data)
    h = history.History(
        faults=list(stack.done),
        beats={a: list(ts) for a, ts in monitor.beats.items()},
        events=list(monitor.events.values()),
        acks=await read_acks(nc, subjects),
        queued=[e.request_id for e in await compensation.scan(nc, subjects=subjects)],
        links=history.parse_links(_read(stack.root / "links.jsonl")),
        ended=time.time(),
    )
    for caller in CALLERS:
        h.ops += history.parse_caller_log(caller, _read(stack.ops_log(caller)))
    for agent in AGENTS:
        procs, runs = history.parse_agent_log(_read(stack.runs_log(agent)), stack.killed)
        h.procs += procs
        h.runs += runs
    return h


def _read_bytes(path: Path, offset: int) -> bytes:
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            return f.read()
    except FileNotFoundError:
        return b""


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except FileNotFoundError:
        return ""


async def claims_of(nc: NATS, rids: list[str]) -> dict[str, str]:
    """The claim of each request id, in words (for the report of unresolved ones)."""
    store = ClaimStore(nc)
    out = {}
    for rid in rids[:200]:
        try:
            stored = await store.get(claim_key(rid))
        except ClaimsUnavailable as exc:
            out[rid] = f"unreadable ({exc})"
            continue
        if stored is None:
            out[rid] = "none"
            continue
        claim = schema.claim_decoder.decode(stored.data)
        out[rid] = f"{claim.state} by {claim.agent_id}/{claim.instance}"
    return out


# --- the run ------------------------------------------------------------------------------


async def run(args: argparse.Namespace, root: Path) -> dict[str, Any]:
    children = Children()
    stack = Stack(args, root, children)
    monitor = Monitor(stack.subjects)
    plan_ = faults.schedule(args.seed, duration=args.duration, interval=args.interval,
                            warmup=args.warmup, agents=AGENTS, brokers=BROKERS, nodes=NODES,
                            kinds=args.kinds)  # fmt: skip
    nc: NATS | None = None
    load0 = list(os.getloadavg())
    try:
        stack.start_cluster()
        await stack.start_proxies()
        for name in BROKERS:
            await stack.start_broker(name)
        for name in AGENTS:
            await stack.start_agent(name)
        await monitor.start(stack.node_urls)
        nc = await nats.connect(stack.node_urls, name="nemesis-control", error_cb=_quiet,
                                max_reconnect_attempts=-1)  # fmt: skip
        await stack.wait_settled(nc, READY_S)
        await stack.start_callers()
        t0 = time.monotonic()
        began = time.time()
        log.info("run.start duration=%s faults=%d", args.duration, len(plan_))
        tasks = []
        for p in plan_:
            await asyncio.sleep(max(t0 + p.at - time.monotonic(), 0.0))
            tasks.append(asyncio.create_task(stack.inject(p)))
        await asyncio.sleep(max(t0 + args.duration - time.monotonic(), 0.0))
        await asyncio.gather(*tasks)
        log.info("run.healed; settling")
        await stack.wait_settled(nc, READY_S)
        for child in stack.callers.values():
            assert child.proc.stdin is not None
            child.proc.stdin.write(f"finish {args.settle}\n".encode())
            await child.proc.stdin.drain()
        finished = {}
        for name, child in stack.callers.items():
            try:
                finished[name] = await child.wait_event("finish", args.settle + 60.0)
            except (TimeoutError, RuntimeError) as exc:
                log.warning("caller.unfinished caller=%s error=%r", name, exc)
        for child in stack.callers.values():
            await child.stop()
        await _drain_queue(nc, stack.subjects, 30.0)
        for child in stack.agents.values():
            await child.stop(grace=40.0)  # drains: its ack writer flushes
        h = await read_history(stack, nc, monitor)
        (root / HISTORY_FILE).write_bytes(msgspec.json.encode(h))
        rules = history.Rules(offline_window_s=OFFLINE_AFTER * args.heartbeat,
                              beat_gap_s=2 * args.heartbeat)  # fmt: skip
        verdict = history.check(h, rules)
        claims = await claims_of(nc, verdict.unresolved)
        extra = {"broker_start_failures": stack.start_failures,
                 "loadavg": {"start": load0, "end": list(os.getloadavg())},
                 "pids": [*children.pids().values(), *stack.node_pids]}  # fmt: skip
        return report(args, plan_, h, verdict, claims, began, finished, extra)
    finally:
        await monitor.stop()
        if nc is not None:
            with contextlib.suppress(Exception):
                await nc.close()
        await stack.stop_all()


async def _drain_queue(nc: NATS, subjects: Subjects, within: float) -> None:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        with contextlib.suppress(Exception):
            total, _ = await compensation.depths(nc, subjects)
            if total == 0:
                return
        await asyncio.sleep(0.5)


def report(args: argparse.Namespace, plan_: list[faults.Planned], h: history.History,
           verdict: history.Verdict, claims: dict[str, str], began: float,
           finished: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:  # fmt: skip
    kinds = collections.Counter(f.kind for f in h.faults)
    by_kind = collections.Counter(v.kind for v in verdict.violations)
    offline = [e for e in h.events if e.kind == "state" and e.to == "offline"]
    return {
        "command": "python -m loadtest.nemesis " + shlex.join(args.argv),
        "seed": args.seed,
        "duration_s": args.duration,
        "interval_s": args.interval,
        "violations": [msgspec.to_builtins(v) for v in verdict.violations],
        "violation_kinds": dict(by_kind),
        "faults": [
            {
                "kind": f.kind,
                "target": f.target,
                "start_s": round(f.start - began, 2),
                "held_s": round(f.end - f.start, 2),
            }
            for f in sorted(h.faults, key=lambda f: f.start)
        ],
        "fault_kinds": dict(sorted(kinds.items())),
        "planned": [msgspec.to_builtins(p) for p in plan_],
        "calls": verdict.calls,
        "submits": verdict.submits,
        "refused_submits": verdict.refused,
        "operations": len(h.ops),
        "runs": verdict.runs,
        "resolved": verdict.resolved,
        "unresolved": len(verdict.unresolved),
        "unresolved_ids": verdict.unresolved,
        "unresolved_claims": claims,
        "excused_second_runs": verdict.excused,
        "offline_declarations": len(offline),
        "released_events": sum(1 for e in h.events if e.kind == "released"),
        "ack_records": len(h.acks),
        "queued_at_end": len(h.queued),
        "callers": finished,
        "outcomes": dict(collections.Counter(f"{o.op}:{'ok' if o.ok else o.code}" for o in h.ops)),
        **extra,
    }


def table(r: dict[str, Any]) -> str:
    rows = [
        ("seed / duration / interval", f"{r['seed']} / {r['duration_s']} s / {r['interval_s']} s"),
        ("faults", f"{len(r['faults'])} of {len(r['fault_kinds'])} kinds: "
                   + ", ".join(f"{k} {n}" for k, n in r["fault_kinds"].items())),
        ("calls / submits checked", f"{r['calls']} / {r['submits']} "
                                    f"({r['refused_submits']} refused by the queue)"),
        ("operations / handler runs", f"{r['operations']} / {r['runs']}"),
        ("resolved / unresolved", f"{r['resolved']} / {r['unresolved']}"),
        ("second runs the guarantee allows",
         ", ".join(f"{k} {n}" for k, n in r["excused_second_runs"].items()) or "0"),
        ("offline declarations / released claims",
         f"{r['offline_declarations']} / {r['released_events']}"),
        ("VIOLATIONS", str(len(r["violations"])) + (
            " (" + ", ".join(f"{k} {n}" for k, n in r["violation_kinds"].items()) + ")"
            if r["violations"] else "")),
    ]  # fmt: skip
    width = max(len(k) for k, _ in rows)
    lines = [f"{k.ljust(width)}  {v}" for k, v in rows]
    for v in r["violations"][:20]:
        lines.append(f"  {v['kind']} {v.get('request_id') or v.get('agent')}: {v['seen']}")
    if len(r["violations"]) > 20:
        lines.append(f"  … {len(r['violations']) - 20} more in the report")
    return "\n".join(lines)


def recheck(path: Path, heartbeat: float) -> int:
    """``--check``: the verdict on a kept history, printed; 1 on any violation."""
    h = msgspec.json.decode(path.read_bytes(), type=history.History)
    rules = history.Rules(offline_window_s=OFFLINE_AFTER * heartbeat, beat_gap_s=2 * heartbeat)
    verdict = history.check(h, rules)
    print(f"calls {verdict.calls}, submits {verdict.submits}, runs {verdict.runs}, resolved "
          f"{verdict.resolved}, unresolved {len(verdict.unresolved)}, second runs allowed "
          f"{verdict.excused}, offline declarations {verdict.declarations}")  # fmt: skip
    for v in verdict.violations:
        print(f"{v.kind} {v.request_id or v.agent}: {v.seen}")
    print(f"VIOLATIONS {len(verdict.violations)}")
    return 1 if verdict.violations else 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m loadtest.nemesis",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--duration", type=float, default=60.0, help="seconds of faults (60)")
    ap.add_argument("--seed", type=int, default=0, help="the fault schedule's seed (0)")
    ap.add_argument("--report", help="JSON report file")
    ap.add_argument("--interval", type=float, default=5.0, help="seconds between faults (5)")
    ap.add_argument("--warmup", type=float, default=5.0, help="seconds before the first (5)")
    ap.add_argument("--heartbeat", type=float, default=1.0, help="agents' interval (1.0 s)")
    ap.add_argument("--concurrency", type=int, default=4, help="operations in flight per caller")
    ap.add_argument(
        "--settle",
        type=float,
        default=None,
        help="seconds the callers get to resolve what is open (60, or duration / 10 if more)",
    )
    ap.add_argument(
        "--kinds",
        default=",".join(faults.KINDS),
        help="comma-separated fault kinds (default: the whole menu)",
    )
    ap.add_argument(
        "--budget",
        type=float,
        default=None,
        help="the whole run's bound in seconds (default: duration + settle + 300)",
    )
    ap.add_argument("--dir", help="keep the run's files (logs, stores, history.json) here")
    ap.add_argument(
        "--check",
        metavar="HISTORY",
        help="no run: check a kept history.json again and print its violations",
    )
    ap.add_argument("-v", "--verbose", action="store_true")
    args = ap.parse_args(argv)
    args.argv = list(argv if argv is not None else sys.argv[1:])
    args.kinds = [k for k in args.kinds.split(",") if k]
    if args.settle is None:
        args.settle = max(60.0, args.duration / 10)
    try:
        faults.schedule(0, duration=1, interval=1, warmup=0, agents=AGENTS, brokers=BROKERS,
                        nodes=NODES, kinds=args.kinds)  # fmt: skip
    except ValueError as exc:
        ap.error(str(exc))
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(name)s %(message)s")  # fmt: skip
    if args.check:
        return recheck(Path(args.check), args.heartbeat)
    if args.dir:
        root = Path(args.dir).resolve()
        if root.exists() and any(root.iterdir()):
            ap.error(f"--dir {root} is not empty")
        root.mkdir(parents=True, exist_ok=True)
    else:
        root = Path(tempfile.mkdtemp(prefix="reach-nemesis-"))
    budget = args.budget or args.duration + args.settle + 300.0

    async def bounded() -> dict[str, Any]:
        return await asyncio.wait_for(run(args, root), budget)

    try:
        r = asyncio.run(bounded())
    except (RuntimeError, OSError, TimeoutError, nats.errors.Error) as exc:
        log.exception("run.failed")
        kept = root if args.dir else "removed; keep them with --dir"
        print(f"nemesis: the run could not be made: {exc!r} (its files: {kept})",
              file=sys.stderr)  # fmt: skip
        return 2
    finally:
        if not args.dir:
            shutil.rmtree(root, ignore_errors=True)
    if args.report:
        Path(args.report).write_text(json.dumps(r, indent=2) + "\n")
    print(table(r))
    if args.report:
        print(f"report: {args.report}")
    return 1 if r["violations"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
