"""``python -m loadtest.calls``: what a call costs against its floors, in one run.

    python -m loadtest.calls [--sync always|default|both] [--rounds 4] [--calls 100000]
        [--duration 3] [--concurrency 1,16] [--trace 200] [--json calls.json]

Per ``sync_interval`` setting one stack, each on a fresh ``nats-server`` with the project's
config (``configs/nats-server.conf``; JetStream's ``sync_interval`` set to ``always``, or
left at the server's default, lazy fsync) and its own store, on loopback:

    nats-server   the config above, a temporary store, its monitoring port (/varz)
    broker        ``reach broker`` (``loadtest.children``), default settings
    echo          ``loadtest.driver echo-server``: answers each request with its size
    agent         ``loadtest.callagent``: one SDK agent, ``bench.idem`` (idempotent) and
                  ``bench.claimed`` (claims each request id), the same trivial handler
    caller        ``loadtest.caller``: one connection, four kinds of request —
                  ``raw`` (request-reply to the echo), ``js`` (a 200-byte JetStream publish
                  to a file stream), ``idem`` and ``claimed`` (``Client.call``)

A slice is one kind at one concurrency for ``--duration`` seconds or ``--calls`` requests,
whichever ends first; it ends when the agent's ack writer has stored the records it left
(how long that took is reported: ``sustained_per_s`` counts it). Rounds alternate the kinds
(raw, js, idem, claimed, raw, …), each concurrency, and with ``both`` the two stacks (the
order flips every round), so the machine's noise hits every figure alike. Per kind: the
median over the rounds of the slices' p50 and p99 latency at 1 in flight and of requests
per second at 16; the ratios issue 23 and issue 29 define; CPU µs per request of every
process. ``--trace N`` then makes N sequential claimed calls, idempotent calls and bare
requests per stack under a wiretap (:mod:`loadtest.hops`): the median time of every hop.

Every process the run starts is ended by its PID (the children also die with this one),
and ``--budget`` (derived from the options unless given) bounds the whole run.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import logging
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import nats

from jetstream.names import ACK_STREAM, CLAIMS_STREAM
from reach_agent.connection import connect_options
from reach_agent.wire.subjects import Subjects
from reach_broker.cluster.natsserver import NatsServer, default_config, find_binary

from . import hops, procfs
from .callagent import CLAIMED, IDEMPOTENT
from .caller import JS_STREAM, KINDS, PAYLOAD_BYTES
from .children import PY, Child, Children, free_port
from .driver import ECHO_SUBJECT

log = logging.getLogger("loadtest.calls")

SYNC_MODES = ("always", "default")
"""``always``: ``sync_interval: always`` (every JetStream write synced before its PubAck);
``default``: no ``sync_interval`` (the server's default: lazy fsync every 2 minutes)."""
PROCESSES = ("caller", "agent", "broker", "server", "echo")
TRACED = {"claimed": hops.CLAIMED_PATH, "idem": hops.IDEMPOTENT_PATH, "raw": hops.RAW_PATH}
"""What ``--trace`` sends, in this order, and the marks each passes."""
WARMUP_CONCURRENCY = 4

# The goals: (figure, bound, "<=" or ">=", where it is set).
GOALS = (
    ("idem_p50_over_raw", 1.5, "<=", "issue 23"),
    ("idem_per_s_over_raw", 0.5, ">=", "issue 23"),
    ("claimed_p50_over_raw", 2.0, "<=", "issue 23 (replaced by issue 29's two below)"),
    ("claimed_per_s_over_raw", 0.35, ">=", "issue 23 (replaced by issue 29's two below)"),
    ("claimed_p50_over_raw_plus_js", 1.3, "<=", "issue 29"),
    ("claimed_per_s_over_js", 0.8, ">=", "issue 29"),
)


def server_config(sync: str, base: str | None = None) -> str:
    """The project's server config with JetStream's ``sync_interval`` as ``sync`` asks: any
    ``sync_interval`` line the shipped file has is dropped, and ``always`` puts one back."""
    text = base if base is not None else Path(str(default_config())).read_text()
    text = re.sub(r"(?m)^[ \t]*sync_interval\s*[:=].*\n", "", text)
    if sync == "always":
        text, found = re.subn(
            r"(?m)^(jetstream\s*\{[ \t]*\n)", r"\1  sync_interval: always\n", text, count=1
        )
        if not found:
            raise ValueError("the server config has no 'jetstream {' block to set sync_interval in")
    return text


def nats_server_version() -> str:
    out = subprocess.run([find_binary(), "--version"], capture_output=True, text=True, timeout=10)
    return out.stdout.strip() or out.stderr.strip()


def median(values: list[float]) -> float | None:
    return round(statistics.median(values), 1) if values else None


async def quit_child(child: Child | None, within: float = 15.0) -> None:
    """Ask ``child`` to end (``quit`` on stdin), then make sure of it by its PID."""
    if child is None or not child.alive():
        return
    stdin = child.proc.stdin
    if stdin is not None:
        with contextlib.suppress(Exception):
            stdin.write(b"quit\n")
            await stdin.drain()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(child.proc.wait(), within)
    await child.stop()


class Stack:
    """One server (one ``sync_interval``), its broker, echo responder, agent and caller."""

    def __init__(self, sync: str, children: Children, args: argparse.Namespace) -> None:
        self.sync = sync
        self.children = children
        self.args = args
        self.tmp = Path(tempfile.mkdtemp(prefix=f"reach-calls-{sync}-"))
        self.server: NatsServer | None = None
        self.monitor = ""
        self.broker: Child | None = None
        self.echo: Child | None = None
        self.agent: Child | None = None
        self.caller: Child | None = None
        self.jetstream: dict[str, Any] = {}
        self.nc: Any = None
        """The run's own connection to this server (broker readiness, stream counts)."""

    @property
    def url(self) -> str:
        assert self.server is not None
        return self.server.url

    async def start(self) -> None:
        conf = self.tmp / "nats-server.conf"
        conf.write_text(server_config(self.sync))
        port = free_port()
        self.monitor = f"http://127.0.0.1:{port}"
        self.server = NatsServer(
            port=0, store_dir=self.tmp / "nats", config=conf, extra_args=["-m", str(port)]
        )
        await asyncio.to_thread(self.server.start)
        self.jetstream = await asyncio.to_thread(self._varz_jetstream)
        (self.tmp / "broker.toml").write_text("")  # every default
        url, lifetime = self.url, str(self.args.budget)
        self.broker = await self.children.broker(
            url, "reach", free_port(), str(self.tmp / "broker.toml")
        )
        self.echo = await self.children.echo_responder(url, len(PAYLOAD_BYTES), self.args.budget)
        await self.echo.wait_event("ready", 30)
        self.nc = await nats.connect(**connect_options("loadtest-calls-control", url))
        await self._broker_ready(60.0)
        argv = [PY, "-m", "loadtest.callagent", "--server", url,
                "--wal-dir", str(self.tmp / "acks"), "--max-runtime", lifetime]  # fmt: skip
        self.agent = await self.children.spawn(f"agent-{self.sync}", *argv, stdin=True)
        ready = await self.agent.wait_event("ready", 60)
        if not ready.get("claims"):
            raise RuntimeError(f"{self.sync}: the agent found no claims bucket: no claimed calls")
        argv = [PY, "-m", "loadtest.caller", "--server", url, "--max-runtime", lifetime]
        self.caller = await self.children.spawn(f"caller-{self.sync}", *argv, stdin=True)
        await self.caller.wait_event("ready", 90)
        log.info(
            "stack %s: server %s pid %s, broker %s, echo %s, agent %s, caller %s",
            self.sync,
            url,
            self.server.pid,
            self.broker.pid,
            self.echo.pid,
            self.agent.pid,
            self.caller.pid,
        )

    async def _broker_ready(self, within: float) -> None:
        """Until the broker answers ``reach.agents`` and has provisioned the claims bucket
        (an agent that starts before it runs with claims off)."""
        deadline = time.monotonic() + within
        js = self.nc.jetstream()
        while True:
            try:
                await self.nc.request(Subjects("reach").agents, b"{}", timeout=1)
                await js.stream_info(CLAIMS_STREAM)
                return
            except Exception:
                if time.monotonic() > deadline or (self.broker and not self.broker.alive()):
                    raise RuntimeError(
                        f"{self.sync}: the broker did not come up within {within:g} s"
                    ) from None
                await asyncio.sleep(0.1)

    def _varz_jetstream(self) -> dict[str, Any]:
        """The server's own word on its JetStream settings (``/varz``)."""
        with urllib.request.urlopen(f"{self.monitor}/varz", timeout=5) as r:
            varz = json.loads(r.read())
        conf = varz.get("jetstream", {}).get("config", {})
        return {
            "sync_always": bool(conf.get("sync_always", False)),
            "sync_interval_ns": conf.get("sync_interval"),
        }

    def pids(self) -> dict[str, int | None]:
        def pid(child: Child | None) -> int | None:
            return child.pid if child is not None else None

        return {
            "caller": pid(self.caller),
            "agent": pid(self.agent),
            "broker": pid(self.broker),
            "server": self.server.pid if self.server else None,
            "echo": pid(self.echo),
        }

    def cpu(self) -> dict[str, float | None]:
        return {name: procfs.cpu_seconds(pid) for name, pid in self.pids().items()}

    async def slice(
        self, kind: str, concurrency: int, calls: int, seconds: float
    ) -> dict[str, Any]:
        """One slice on the caller, with every process's CPU per successful request."""
        assert self.caller is not None
        c0, b0, w0 = self.cpu(), procfs.machine_busy(), time.perf_counter()
        result = await self.caller.command(
            f"run {kind} {concurrency} {calls} {seconds}", within=seconds + 60
        )
        # The ack records the slice left in the agent's writer are its cost too: the next
        # slice starts once they are stored, and the time that took is reported.
        assert self.agent is not None
        drain = await self.agent.command("flush", within=180)
        if not drain["flushed"]:
            raise RuntimeError(
                f"{self.sync}: the agent's ack writer still had "
                f"{drain['pending_after']} records pending after the slice"
            )
        c1, b1, wall = self.cpu(), procfs.machine_busy(), time.perf_counter() - w0
        ok = result["ok"]
        result["cpu_us_per_request"] = {
            name: (
                round((c1[name] - c0[name]) / ok * 1e6, 1)  # type: ignore[operator]
                if ok and c0[name] is not None and c1[name] is not None
                else None
            )
            for name in PROCESSES
        }
        result["machine_busy"] = (
            round((b1[0] - b0[0]) / (b1[1] - b0[1]), 3) if b1[1] > b0[1] else None
        )
        result["wall_s"] = round(wall, 3)
        result["acks_pending_at_end"] = drain["pending_before"]
        result["ack_drain_s"] = drain["seconds"]
        result["sustained_per_s"] = round(ok / (result["seconds"] + drain["seconds"]), 1)
        return result

    async def trace(self, n: int) -> dict[str, Any]:
        """``n`` sequential claimed calls, idempotent calls and bare requests (the tap's
        calibration) under the wiretap: per-hop medians."""
        assert self.caller is not None and self.agent is not None
        tap = hops.Wiretap(self.url)
        await tap.start()
        try:
            traced = {
                kind: await self.caller.command(f"trace {kind} {n}", within=n * 11 + 30)
                for kind in TRACED
            }
            await self.agent.command("flush", within=180)  # the ack records trail the calls
            await asyncio.sleep(0.2)  # their PubAcks reach the tap
        finally:
            seen = await tap.stop()
        by_subject = hops.index(seen)
        subjects = Subjects("reach")
        out: dict[str, Any] = {}
        for kind, path in TRACED.items():
            calls = traced[kind]["calls"]
            if kind == "raw":
                lines = [hops.raw_timeline(by_subject, ECHO_SUBJECT, body.encode(), t0, t1)
                         for body, t0, t1, error in calls if error is None]  # fmt: skip
            else:
                cap = CLAIMED if kind == "claimed" else IDEMPOTENT
                lines = [hops.timeline(by_subject, subjects, "bench-agent", cap, rid, t0, t1)
                         for rid, t0, t1, error in calls if error is None]  # fmt: skip
            errors = sum(1 for c in calls if c[3] is not None)
            out[kind] = {**hops.breakdown(lines, path), "errors": errors}
        return out

    async def stored(self) -> dict[str, Any]:
        """Messages in the claims bucket, the ack stream and the bench stream, and the
        agent's own counts (its ack writer flushed first)."""
        assert self.agent is not None
        agent = await self.agent.command("stats", within=30)
        js = self.nc.jetstream()
        streams = {}
        for key, name in (("claims", CLAIMS_STREAM), ("acks", ACK_STREAM), ("js", JS_STREAM)):
            streams[key] = (await js.stream_info(name)).state.messages
        return {
            "agent_runs": agent["runs"],
            "acks_written_by_agent": agent["acks_stored"],
            "acks_folded_by_agent": agent.get("acks_folded"),
            "acks_pending_in_agent": agent["acks_pending"],
            "stream_messages": streams,
        }

    async def stop(self) -> None:
        if self.nc is not None:
            with contextlib.suppress(Exception):
                await self.nc.close()
        await quit_child(self.caller)
        await quit_child(self.agent)
        for child in (self.echo, self.broker):
            if child is not None:
                await child.stop()
        if self.server is not None:
            await asyncio.to_thread(self.server.stop)
        shutil.rmtree(self.tmp, ignore_errors=True)


# --- figures ---------------------------------------------------------------------------


def figures(slices: list[dict[str, Any]], concurrencies: list[int]) -> dict[str, Any]:
    """Per kind and concurrency: medians over the rounds (latency µs, requests/s, CPU µs
    per request of each process)."""
    out: dict[str, Any] = {}
    for kind in KINDS:
        per: dict[str, Any] = {}
        for conc in concurrencies:
            rs = [s for s in slices if s["kind"] == kind and s["concurrency"] == conc]
            if not rs:
                continue
            per[str(conc)] = {
                "rounds": len(rs),
                "p50_us": median([s["p50_us"] for s in rs if s["p50_us"] is not None]),
                "p99_us": median([s["p99_us"] for s in rs if s["p99_us"] is not None]),
                "per_s": median([s["per_s"] for s in rs]),
                "sustained_per_s": median([s["sustained_per_s"] for s in rs]),
                "acks_pending_at_end": median([s["acks_pending_at_end"] or 0 for s in rs]),
                "cpu_us_per_request": {
                    p: median(
                        [
                            s["cpu_us_per_request"][p]
                            for s in rs
                            if s["cpu_us_per_request"][p] is not None
                        ]
                    )
                    for p in PROCESSES
                },
            }
        if per:
            out[kind] = per
    return out


def ratios(fig: dict[str, Any], low: str, high: str) -> dict[str, float | None]:
    """The ratios of issues 23 and 29: latency at ``low`` in flight, rate at ``high``."""

    def get(kind: str, conc: str, key: str) -> float | None:
        v = fig.get(kind, {}).get(conc, {}).get(key)
        return float(v) if v else None

    def div(a: float | None, b: float | None) -> float | None:
        return round(a / b, 3) if a is not None and b else None

    raw, js = get("raw", low, "p50_us"), get("js", low, "p50_us")
    return {
        "idem_p50_over_raw": div(get("idem", low, "p50_us"), raw),
        "claimed_p50_over_raw": div(get("claimed", low, "p50_us"), raw),
        "idem_per_s_over_raw": div(get("idem", high, "per_s"), get("raw", high, "per_s")),
        "claimed_per_s_over_raw": div(get("claimed", high, "per_s"), get("raw", high, "per_s")),
        "claimed_p50_over_raw_plus_js": div(
            get("claimed", low, "p50_us"), raw + js if raw and js else None
        ),
        "claimed_per_s_over_js": div(get("claimed", high, "per_s"), get("js", high, "per_s")),
    }


def goals(rat: dict[str, float | None]) -> dict[str, Any]:
    out = {}
    for name, bound, op, source in GOALS:
        value = rat.get(name)
        met = None if value is None else (value <= bound if op == "<=" else value >= bound)
        out[name] = {"value": value, "bound": f"{op} {bound}", "met": met, "set_by": source}
    return out


def per_round_ratios(slices: list[dict[str, Any]], low: str, high: str) -> list[dict[str, Any]]:
    """The same ratios within each round alone: their spread is the run's noise."""
    rounds = sorted({s["round"] for s in slices})
    out = []
    for r in rounds:
        fig = figures([s for s in slices if s["round"] == r], [int(low), int(high)])
        out.append({"round": r, **ratios(fig, low, high)})
    return out


def totals(slices: list[dict[str, Any]], extra: list[dict[str, Any]]) -> dict[str, Any]:
    """Requests sent, answered and failed per kind, over every slice and ``extra`` (warm-up,
    trace) of one stack."""
    out: dict[str, Any] = {k: {"sent": 0, "ok": 0, "errors": {}} for k in KINDS}
    for s in [*slices, *extra]:
        t = out[s["kind"]]
        t["sent"] += s["calls"]
        t["ok"] += s["ok"]
        for code, n in s["errors"].items():
            t["errors"][code] = t["errors"].get(code, 0) + n
    return out


# --- the run ---------------------------------------------------------------------------


async def run(
    args: argparse.Namespace, children: Children, stacks: dict[str, Stack], report: dict[str, Any]
) -> None:
    for stack in stacks.values():
        await stack.start()
        report["sync"][stack.sync] = {"server_jetstream": stack.jetstream}
    low, high = str(min(args.concurrency)), str(max(args.concurrency))
    slices: dict[str, list[dict[str, Any]]] = {s: [] for s in stacks}
    extra: dict[str, list[dict[str, Any]]] = {s: [] for s in stacks}
    for stack in stacks.values():  # warm-up: not measured, counted
        for kind in args.kinds if args.warmup_calls else ():
            extra[stack.sync].append(
                await stack.slice(kind, WARMUP_CONCURRENCY, args.warmup_calls, args.duration)
            )
    order = list(stacks)
    for r in range(args.rounds):
        for sync in order if r % 2 == 0 else order[::-1]:
            for conc in args.concurrency:
                for kind in args.kinds:
                    s = await stacks[sync].slice(kind, conc, args.calls, args.duration)
                    s["round"] = r
                    slices[sync].append(s)
                    log.info(
                        "round %d %s %-7s c=%-2d ok=%d errors=%s p50=%s µs %s/s",
                        r,
                        sync,
                        kind,
                        conc,
                        s["ok"],
                        s["errors"],
                        s["p50_us"],
                        s["per_s"],
                    )
    for sync, stack in stacks.items():
        entry = report["sync"][sync]
        fig = figures(slices[sync], args.concurrency)
        rat = ratios(fig, low, high)
        entry.update(
            figures=fig,
            ratios=rat,
            goals=goals(rat),
            ratios_per_round=per_round_ratios(slices[sync], low, high),
        )
        if args.trace:
            entry["hops"] = await stack.trace(args.trace)
            for kind in TRACED:
                calls = args.trace
                ok = calls - entry["hops"][kind]["errors"]
                extra[sync].append(
                    {
                        "kind": kind,
                        "calls": calls,
                        "ok": ok,
                        "errors": {"trace": calls - ok} if calls > ok else {},
                    }
                )
        entry["requests"] = totals(slices[sync], extra[sync])
        entry["stored"] = await stack.stored()
        entry["slices"] = slices[sync]
        entry["warmup"] = extra[sync]


def summary(report: dict[str, Any]) -> str:
    syncs = list(report["sync"])
    s = report["settings"]
    low, high = str(min(s["concurrency"])), str(max(s["concurrency"]))
    lines = [
        f"loadtest.calls {report['date_utc']}  {report['nats_server_version']}  "
        f"{s['rounds']} rounds, {s['duration_s']} s or {s['calls']} requests a slice",
        f"load average {report['loadavg_start']} → {report['loadavg_end']}",
        "",
        f"{'':42}" + "".join(f"{'sync_interval ' + x:>26}" for x in syncs),
    ]

    def row(label: str, cells: list[str]) -> None:
        lines.append(f"{label:42}" + "".join(f"{c:>26}" for c in cells))

    def figure(kind: str, conc: str, text: Callable[[dict[str, Any]], str]) -> list[str]:
        out = []
        for x in syncs:
            f = report["sync"][x].get("figures", {}).get(kind, {}).get(conc)
            out.append(text(f) if f else "-")
        return out

    for kind in KINDS:
        row(f"{kind}: p50 / p99 µs, {low} in flight",
            figure(kind, low, lambda f: f"{f['p50_us']} / {f['p99_us']}"))  # fmt: skip
    for kind in KINDS:
        row(f"{kind}: requests/s, {high} in flight", figure(kind, high, lambda f: f"{f['per_s']}"))
    for kind in ("idem", "claimed"):
        row(f"{kind}: the same, acks drained",
            figure(kind, high, lambda f: f"{f['sustained_per_s']}"))  # fmt: skip
    lines.append("")
    for name, bound, op, _source in GOALS:
        cells = []
        for x in syncs:
            g = report["sync"][x].get("goals", {}).get(name)
            if not g or g["value"] is None:
                cells.append("-")
            else:
                cells.append(f"{g['value']:.3f} {'met' if g['met'] else 'missed'}")
        row(f"{name} ({op} {bound})", cells)
    names = {"claimed": "claimed call", "idem": "idempotent call", "raw": "bare request"}
    for x in syncs:
        for kind, name in names.items():
            h = report["sync"][x].get("hops", {}).get(kind)
            if not h:
                continue
            lines += ["", f"{name}, hop by hop (sync_interval {x}; {h['complete']} traced, "
                          f"median µs; total {h['total_us']})"]  # fmt: skip
            lines += [f"  {v!s:>9}  {label}" for label, v in h["hops_us"].items()]
            off = {k: v for k, v in h["marks_us"].items() if k in hops.OFF_PATH}
            if off:
                lines.append(f"  off the path, µs after the call's start: {off}")
    return "\n".join(lines)


def budget(args: argparse.Namespace) -> float:
    """The whole run's bound: start-up, warm-up, every slice, traces, and stopping."""
    stacks = 2 if args.sync == "both" else 1
    per_slice = args.duration + 5
    slices = args.rounds * len(args.concurrency) * len(args.kinds) + len(args.kinds)
    return stacks * (120 + slices * per_slice + args.trace * 0.1 + 60)


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    children = Children()
    syncs = SYNC_MODES if args.sync == "both" else (args.sync,)
    stacks = {s: Stack(s, children, args) for s in syncs}
    report: dict[str, Any] = {
        "date_utc": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "command": "python -m loadtest.calls " + " ".join(args.argv),
        "nats_server_version": nats_server_version(),
        "python": sys.version.split()[0],
        "nproc": os.cpu_count(),
        "loadavg_start": procfs.loadavg(),
        "settings": {
            "sync": list(syncs),
            "rounds": args.rounds,
            "calls": args.calls,
            "duration_s": args.duration,
            "concurrency": args.concurrency,
            "kinds": args.kinds,
            "warmup_calls": args.warmup_calls,
            "trace": args.trace,
            "budget_s": args.budget,
        },
        "sync": {},
        "status": "incomplete",
    }
    try:
        async with asyncio.timeout(args.budget):
            await run(args, children, stacks, report)
        report["status"] = "ok"
    except TimeoutError:
        report["error"] = f"the run exceeded its budget of {args.budget:.0f} s"
        log.error(report["error"])
    except Exception as exc:
        report["error"] = f"{type(exc).__name__}: {exc}"
        log.exception("the run failed")
    finally:
        report["pids"] = children.pids()
        for sync, stack in stacks.items():
            if stack.server is not None and stack.server.pid is not None:
                report["pids"][f"nats-server-{sync}"] = stack.server.pid
        for stack in stacks.values():
            with contextlib.suppress(Exception):
                await stack.stop()
        await children.stop_all()
        report["loadavg_end"] = procfs.loadavg()
    report["summary"] = summary(report)
    return report


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m loadtest.calls",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--sync",
        choices=["always", "default", "both"],
        default="both",
        help="JetStream's sync_interval: always, the server's default, or both "
        "(two stacks, alternated)",
    )
    p.add_argument("--rounds", type=int, default=4, help="alternated rounds")
    p.add_argument("--calls", type=int, default=100_000, help="most requests a slice starts")
    p.add_argument("--duration", type=float, default=3.0, help="longest slice (s)")
    p.add_argument(
        "--concurrency",
        default="1,16",
        help="requests in flight, comma-separated: latency is read at the "
        "lowest, requests/s at the highest",
    )
    p.add_argument(
        "--kinds",
        default=",".join(KINDS),
        help=f"which of {','.join(KINDS)} to run (ratios need all four)",
    )
    p.add_argument(
        "--warmup-calls",
        type=int,
        default=200,
        help=f"requests of each kind before the rounds ({WARMUP_CONCURRENCY} in "
        "flight; counted, not measured)",
    )
    p.add_argument(
        "--trace",
        type=int,
        default=200,
        help="sequential claimed and idempotent calls under the wiretap, per "
        "stack, for the per-hop breakdown (0: none)",
    )
    p.add_argument("--budget", type=float, default=None, help="bound of the whole run (s)")
    p.add_argument("--json", default=None, help="write the report here")
    p.add_argument("-v", "--verbose", action="store_true")
    raw = sys.argv[1:] if argv is None else argv
    args = p.parse_args(raw)
    args.argv = raw
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    args.kinds = [k for k in args.kinds.split(",") if k]
    unknown = [k for k in args.kinds if k not in KINDS]
    if unknown:
        p.error(f"--kinds: {unknown} are not among {list(KINDS)}")
    for name in ("rounds", "calls", "warmup_calls"):
        if getattr(args, name) < (0 if name == "warmup_calls" else 1):
            p.error(f"--{name.replace('_', '-')} {getattr(args, name)} is too small")
    if args.duration <= 0 or min(args.concurrency) < 1:
        p.error("--duration and every --concurrency must be positive")
    if args.budget is None:
        args.budget = budget(args)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(asctime)s %(name)s %(message)s",
        stream=sys.stderr,
    )
    with contextlib.suppress(ImportError):
        import uvloop

        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    report = asyncio.run(main_async(args))
    print(report["summary"])
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return 0 if report["status"] == "ok" else 1


if __name__ == "__main__":
    raise SystemExit(main())
