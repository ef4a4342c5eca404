"""``python -m loadtest``: one broker under simulated agents and route load, against raw NATS.

Starts (unless ``--server``) a ``nats-server``, then the broker as a subprocess (its CPU and
RSS are read from ``/proc/<pid>``, its counters from its ``/metrics``), an echo responder,
simulated agents in their own processes, and the request driver in another. Phases:

1. register: every agent announces; broker RSS before and after gives RSS per agent;
2. heartbeats only: broker CPU with the fleet heartbeating;
3. load: echo and route slices alternate (``--rounds``), same driver, same client settings;
4. heartbeat storm: one sim process sends heartbeats at ``--storm-rate`` for a few seconds;
5. re-announce storm: every agent of that process announces again at once;
6. kill: 10% stop heartbeating and answering probes (connections open), then another 10%
   are SIGKILLed (one connection each, named by agent_id, so the server's disconnect
   advisory names them); each time we poll ``reach.route.<their capability>`` until no
   candidate comes back;
7. accounting: heartbeats sent (as the sims count them) minus the broker's
   ``reach_heartbeats_total``.

Every child is ours and is ended in ``finally``, by PID; a watchdog bounds the whole run.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import json
import os
import re
import signal
import socket
import sys
import tempfile
import time
import urllib.request
from datetime import UTC, datetime
from typing import Any

import nats

from reach_agent.errors import H_SERVICE_ERROR_CODE
from reach_broker.natsserver import NatsServer

from . import report as rpt
from .sim import CAPABILITIES

PY = sys.executable
VICTIM_ADV = "loadtest.victim_adv"
VICTIM_SILENT = "loadtest.victim_silent"
CLK_TCK = os.sysconf("SC_CLK_TCK")


def log(msg: str) -> None:
    sys.stderr.write(f"[loadtest {time.strftime('%H:%M:%S')}] {msg}\n")
    sys.stderr.flush()


def _die_with_parent() -> None:
    """Children get SIGTERM if the load tool dies (Linux), so none is left behind."""
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# --- /proc -------------------------------------------------------------------------------


def cpu_seconds(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / CLK_TCK
    except (OSError, IndexError, ValueError):
        return None


def rss_bytes(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def machine_busy() -> tuple[float, float]:
    """(busy, total) jiffies of the whole machine, for the share of CPU others used."""
    with open("/proc/stat") as f:
        vals = [int(v) for v in f.readline().split()[1:]]
    idle = vals[3] + (vals[4] if len(vals) > 4 else 0)
    total = sum(vals[:8])
    return float(total - idle), float(total)


def loadavg() -> str:
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


class CpuMeter:
    """CPU seconds of one process over a span, as a share of one core."""

    def __init__(self, pid: int | None) -> None:
        self.pid = pid
        self.t0 = time.perf_counter()
        self.c0 = cpu_seconds(pid) if pid else None

    def share(self) -> float | None:
        if self.pid is None or self.c0 is None:
            return None
        c1 = cpu_seconds(self.pid)
        dt = time.perf_counter() - self.t0
        return None if c1 is None or dt <= 0 else round((c1 - self.c0) / dt, 3)


# --- children ------------------------------------------------------------------------------


class Child:
    """A subprocess we started: JSON lines on stdout, commands on stdin, ended by PID."""

    def __init__(self, name: str, proc: asyncio.subprocess.Process) -> None:
        self.name = name
        self.proc = proc
        self.pid = proc.pid

    @classmethod
    async def start(cls, name: str, *argv: str, stdin: bool = False, quiet: bool = True) -> Child:
        proc = await asyncio.create_subprocess_exec(
            *argv,
            stdin=asyncio.subprocess.PIPE if stdin else asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.DEVNULL if quiet else None,
            preexec_fn=_die_with_parent,
        )
        return cls(name, proc)

    async def read_event(self, within: float) -> dict[str, Any]:
        assert self.proc.stdout is not None
        while True:
            line = await asyncio.wait_for(self.proc.stdout.readline(), within)
            if not line:
                raise RuntimeError(
                    f"{self.name} (pid {self.pid}) exited: rc={self.proc.returncode}"
                )
            with contextlib.suppress(ValueError):
                event = json.loads(line)
                if isinstance(event, dict):
                    return event

    async def wait_event(self, name: str, within: float) -> dict[str, Any]:
        deadline = time.monotonic() + within
        while True:
            event = await self.read_event(max(deadline - time.monotonic(), 0.01))
            if event.get("event") == name:
                return event

    async def command(
        self, cmd: str, reply: str | None = None, within: float = 10.0
    ) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write((cmd + "\n").encode())
        await self.proc.stdin.drain()
        return await self.wait_event(reply or cmd.split()[0], within)

    def alive(self) -> bool:
        return self.proc.returncode is None

    async def stop(self, grace: float = 5.0) -> None:
        """SIGTERM, then SIGKILL after ``grace``; only this child's PID."""
        if self.proc.returncode is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            self.proc.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(self.proc.wait(), grace)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                self.proc.kill()
            await self.proc.wait()

    async def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            self.proc.kill()
        await self.proc.wait()


# --- broker metrics ----------------------------------------------------------------------

_SAMPLE_RE = re.compile(r"^(\w+)(?:\{([^}]*)\})? ([0-9.eE+-]+|NaN)$")


def scrape(url: str) -> dict[str, float]:
    """``name{labels}`` → value for every sample on the broker's /metrics."""
    with urllib.request.urlopen(url, timeout=5) as resp:
        text = resp.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = _SAMPLE_RE.match(line)
        if m:
            key = m.group(1) + ("{" + m.group(2) + "}" if m.group(2) else "")
            out[key] = float(m.group(3))
    return out


def heartbeat_counts(sample: dict[str, float]) -> dict[str, int]:
    prefix = 'reach_heartbeats_total{result="'
    return {k[len(prefix) : -2]: int(v) for k, v in sample.items() if k.startswith(prefix)}


class Run:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.children: list[Child] = []
        self.server: NatsServer | None = None
        self.url = args.server or ""
        self.broker: Child | None = None
        self.metrics_url = args.metrics_url
        self.nc: Any = None
        self.r: dict[str, Any] = {}
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        self.monitor_url: str | None = None

    # helpers

    async def spawn(self, name: str, *argv: str, stdin: bool = False, quiet: bool = True) -> Child:
        child = await Child.start(name, *argv, stdin=stdin, quiet=quiet)
        self.children.append(child)
        return child

    async def metrics(self) -> dict[str, float]:
        if not self.metrics_url:
            return {}
        return await asyncio.to_thread(scrape, self.metrics_url)

    async def hb_total(self) -> int | None:
        if not self.metrics_url:
            return None
        return sum(heartbeat_counts(await self.metrics()).values())

    async def settle_heartbeats(self, expect: int, within: float) -> int | None:
        """Wait until the broker counted ``expect`` heartbeats or its count stops moving."""
        deadline = time.monotonic() + within
        last, still = -1, 0
        while True:
            total = await self.hb_total()
            if total is None or total >= expect or time.monotonic() > deadline:
                return total
            still = still + 1 if total == last else 0
            if still >= 5:
                return total
            last = total
            await asyncio.sleep(0.1)

    async def slow_consumers(self) -> int | None:
        """The server's count of slow-consumer events (messages it dropped for a client)."""
        if not self.monitor_url:
            return None

        def get() -> int:
            with urllib.request.urlopen(self.monitor_url + "/varz", timeout=5) as resp:
                return int(json.loads(resp.read()).get("slow_consumers", 0))

        try:
            return await asyncio.to_thread(get)
        except Exception:
            return None

    async def routable(self, capability: str) -> int:
        """Candidates the broker returns for ``capability`` (0 when none is reachable)."""
        msg = await self.nc.request(
            f"{self.args.prefix}.route.{capability}", b'{"limit":100}', timeout=2
        )
        if msg.headers and H_SERVICE_ERROR_CODE in msg.headers:
            return 0
        return len(json.loads(msg.data)["candidates"])

    async def wait_routable(self, capability: str, want: int, within: float) -> int:
        """Wait until at least ``want`` candidates for ``capability`` come back."""
        deadline = time.monotonic() + within
        n = 0
        while time.monotonic() < deadline:
            with contextlib.suppress(Exception):
                n = await self.routable(capability)
                if n >= want:
                    break
            await asyncio.sleep(0.05)
        return n

    async def until_unroutable(self, capability: str, t_kill: float, within: float) -> float | None:
        """ms from ``t_kill`` until no candidate for ``capability`` (and none for 1 s after)."""
        deadline = time.perf_counter() + within
        first_none: float | None = None
        while time.perf_counter() < deadline:
            try:
                n = await self.routable(capability)
            except Exception:
                n = -1
            now = time.perf_counter()
            if n == 0:
                if first_none is None:
                    first_none = now
                elif now - first_none >= 1.0:
                    return round((first_none - t_kill) * 1000.0, 1)
            elif n > 0:
                first_none = None
            await asyncio.sleep(0.005)
        return None

    async def drive(self, mode: str, seconds: float, concurrency: int = 0) -> dict[str, Any]:
        a = self.args
        argv = [PY, "-m", "loadtest.driver", mode, "--server", self.url, "--prefix", a.prefix,
                "--concurrency", str(concurrency or a.concurrency), "--duration", str(seconds),
                "--warmup", str(a.warmup)]  # fmt: skip
        for cap in CAPABILITIES[: a.capabilities]:
            argv += ["--capability", cap]
        child = await self.spawn(f"driver-{mode}", *argv)
        try:
            return await child.read_event(seconds + a.warmup + 30)
        finally:
            await child.stop()

    # phases

    def _broker_toml(self) -> str:
        """Defaults, except the fleet-wide in-flight ceiling: 5000 (DESIGN §8) is for fleets
        far smaller than 10,000 agents each reporting a few running tasks."""
        ceiling = max(5000, 20 * self.args.agents)
        self._tmp = tempfile.TemporaryDirectory(prefix="reach-loadtest-")
        path = os.path.join(self._tmp.name, "broker.toml")
        with open(path, "w") as f:
            f.write(f"[routing]\ninflight_ceiling = {ceiling}\n")
        self.r["broker_config"] = {"routing.inflight_ceiling": ceiling}
        return path

    async def start_infra(self) -> None:
        a = self.args
        if not self.url:
            # The monitoring port tells whether the server itself dropped messages (slow
            # consumers): drops the broker cannot see or count.
            self.monitor_url = f"http://127.0.0.1:{free_port()}"
            self.server = NatsServer(port=0, extra_args=["-m", self.monitor_url.rsplit(":", 1)[1]])
            await asyncio.to_thread(self.server.start)
            self.url = self.server.url
            log(f"nats-server {self.url} pid {self.server.pid}")
        if not a.no_broker:
            port = free_port()
            self.metrics_url = f"http://127.0.0.1:{port}/metrics"
            cmd = [PY]
            if a.profile_broker:
                cmd += ["-m", "cProfile", "-o", a.profile_broker]
            cmd += ["-m", "reach_broker.cli", "broker", "--server", self.url, "--prefix", a.prefix,
                    "--metrics-port", str(port), "--log-level", "warning"]  # fmt: skip
            cmd += ["--config", a.broker_config or self._broker_toml()]
            self.broker = await self.spawn("broker", *cmd, quiet=not a.verbose)
            log(f"broker pid {self.broker.pid}, metrics {self.metrics_url}")
        self.nc = await nats.connect(self.url, name="loadtest-control")
        deadline = time.monotonic() + 30
        while True:  # the broker answers reach.agents once it is up
            try:
                await self.nc.request(f"{a.prefix}.agents", b"{}", timeout=1)
                if self.metrics_url:
                    await self.metrics()
                break
            except Exception:
                if time.monotonic() > deadline or (self.broker and not self.broker.alive()):
                    raise RuntimeError("the broker did not come up within 30 s") from None
                await asyncio.sleep(0.2)

    async def register(self) -> list[Child]:
        a = self.args
        n = a.agents
        k = max(1, round(n * a.kill_share)) if a.kill_share > 0 else 0
        main_n = n - 2 * k
        if main_n < 1:
            raise SystemExit(f"--agents {n} is too small for --kill-share {a.kill_share}")
        pid = self.broker.pid if self.broker else None
        rss0 = rss_bytes(pid) if pid else None
        self.r["broker_rss_empty_bytes"] = rss0
        common = ["--server", self.url, "--prefix", a.prefix, "--interval", str(a.interval),
                  "--max-runtime", str(a.budget),
                  "--capabilities", str(a.capabilities)]  # fmt: skip
        sims: list[Child] = []
        self.sim_counts: list[int] = []
        per_proc = -(-main_n // a.sim_procs)
        for i in range(a.sim_procs):
            count = min(per_proc, main_n - i * per_proc)
            if count <= 0:
                break
            argv = [PY, "-m", "loadtest.sim", *common, "--agents", str(count),
                    "--id-prefix", f"sim{i}", "--seed", str(i + 1),
                    "--connections", str(a.connections)]  # fmt: skip
            if a.conn_per_agent:
                argv.append("--conn-per-agent")
            sims.append(await self.spawn(f"sim{i}", *argv, stdin=True))
            self.sim_counts.append(count)
        victims = {}
        if k:
            for tag, cap in (("adv", VICTIM_ADV), ("silent", VICTIM_SILENT)):
                argv = [PY, "-m", "loadtest.sim", *common, "--agents", str(k), "--conn-per-agent",
                        "--id-prefix", f"victim-{tag}", "--extra-capability", cap,
                        "--seed", str(100 + len(victims))]  # fmt: skip
                victims[tag] = await self.spawn(f"victims-{tag}", *argv, stdin=True)
        t0 = time.perf_counter()
        conns = 0
        errors = 0
        for child in [*sims, *victims.values()]:
            ev = await child.wait_event("ready", 60 + n / 100)
            conns += ev["connections"]
            errors += ev["announce_errors"]
        self.r["register_s"] = round(time.perf_counter() - t0, 3)
        self.r["announce_errors"] = errors
        self.r["sim_connections"] = conns
        self.victims = victims
        self.sims = sims
        # All registered: the broker counts them as healthy.
        deadline = time.monotonic() + 30
        while self.metrics_url:
            m = await self.metrics()
            if (
                m.get('reach_agents{state="healthy"}', 0) >= n - errors
                or time.monotonic() > deadline
            ):
                break
            await asyncio.sleep(0.2)
        await asyncio.sleep(max(2.0, 2 * a.interval))  # a few heartbeats: records settle
        rss1 = rss_bytes(pid) if pid else None
        self.r["broker_rss_bytes"] = rss1
        self.r["rss_per_agent_bytes"] = (
            round((rss1 - rss0) / n, 1) if rss0 is not None and rss1 is not None else None
        )
        log(f"registered {n} agents over {conns} connections in {self.r['register_s']} s; "
            f"broker RSS {rss0} -> {rss1}")  # fmt: skip
        return [*sims, *victims.values()]

    async def heartbeats_only(self) -> None:
        a = self.args
        pid = self.broker.pid if self.broker else None
        meter = CpuMeter(pid)
        h0 = await self.hb_total()
        t0 = time.perf_counter()
        await asyncio.sleep(max(3.0, 3 * a.interval))
        h1 = await self.hb_total()
        dt = time.perf_counter() - t0
        self.r["broker_cpu_share_heartbeats"] = meter.share()
        if h0 is not None and h1 is not None:
            self.r["heartbeats_per_s"] = round((h1 - h0) / dt, 1)

    async def load(self) -> None:
        a = self.args
        pid = self.broker.pid if self.broker else None
        # Reply size of a route, so the echo answers with as many bytes.
        msg = await self.nc.request(f"{a.prefix}.route.{CAPABILITIES[0]}", b"", timeout=2)
        reply_bytes = len(msg.data)
        self.r["route_reply_bytes"] = reply_bytes
        echo = await self.spawn("echo", PY, "-m", "loadtest.driver", "echo-server", "--server",
                                self.url, "--reply-bytes", str(reply_bytes),
                                "--max-runtime", str(a.budget))  # fmt: skip
        await echo.wait_event("ready", 20)
        slice_s = a.duration / a.rounds
        routes: list[dict[str, Any]] = []
        echoes: list[dict[str, Any]] = []
        route_cpu: list[tuple[float, float]] = []
        echo_cpu: list[tuple[float, float]] = []
        server_cpu: list[tuple[float, float]] = []
        busy: list[tuple[float, float]] = []
        spid = self.server.pid if self.server else None
        h0 = await self.hb_total()
        ht0 = time.perf_counter()
        for i in range(a.rounds):
            log(f"round {i + 1}/{a.rounds}: echo {slice_s:g} s")
            e0, et0 = cpu_seconds(echo.pid), time.perf_counter()
            echoes.append(await self.drive("echo", slice_s))
            e1 = cpu_seconds(echo.pid)
            if e0 is not None and e1 is not None:
                echo_cpu.append((e1 - e0, time.perf_counter() - et0))
            log(f"round {i + 1}/{a.rounds}: route {slice_s:g} s")
            c0, s0, m0 = (
                cpu_seconds(pid) if pid else None,
                cpu_seconds(spid) if spid else None,
                machine_busy(),
            )
            t0 = time.perf_counter()
            routes.append(await self.drive("route", slice_s))
            dt = time.perf_counter() - t0
            c1, s1, m1 = (
                cpu_seconds(pid) if pid else None,
                cpu_seconds(spid) if spid else None,
                machine_busy(),
            )
            if c0 is not None and c1 is not None:
                route_cpu.append((c1 - c0, dt))
            if s0 is not None and s1 is not None:
                server_cpu.append((s1 - s0, dt))
            busy.append((m1[0] - m0[0], m1[1] - m0[1]))
        h1 = await self.hb_total()
        if a.latency_seconds > 0:
            # One requester: the latency of a single route against a single echo, no queueing.
            for mode in ("echo", "route"):
                res = await self.drive(mode, a.latency_seconds, concurrency=1)
                self.r[f"{mode}_c1_p50_ms"] = res["p50_ms"]
                self.r[f"{mode}_c1_p99_ms"] = res["p99_ms"]
                self.r[f"{mode}_c1_per_s"] = res["per_s"]
        await echo.stop()

        def combine(results: list[dict[str, Any]], prefix: str) -> None:
            ok = sum(x["ok"] for x in results)
            secs = sum(x["seconds"] for x in results)
            self.r[f"{prefix}_per_s"] = round(ok / secs, 1) if secs else 0.0
            # Percentiles of the slices: the worst slice's, so a bad slice is not hidden.
            self.r[f"{prefix}_p50_ms"] = max(
                (x["p50_ms"] for x in results if x["p50_ms"] is not None), default=None
            )
            self.r[f"{prefix}_p99_ms"] = max(
                (x["p99_ms"] for x in results if x["p99_ms"] is not None), default=None
            )
            errs: dict[str, int] = {}
            for x in results:
                for key, v in x["errors"].items():
                    errs[key] = errs.get(key, 0) + v
            self.r[f"{prefix}_errors"] = errs
            self.r[f"{prefix}_slices"] = results

        combine(routes, "route")
        combine(echoes, "echo")
        self.r["routes_per_s"] = self.r.pop("route_per_s")
        self.r["route_vs_echo_ratio"] = (
            round(self.r["routes_per_s"] / self.r["echo_per_s"], 3)
            if self.r["echo_per_s"]
            else None
        )
        self.r["broker_cpu_share"] = (
            round(sum(c for c, _ in route_cpu) / sum(t for _, t in route_cpu), 3)
            if route_cpu
            else None
        )
        # CPU per request of each responder (the slice's whole process time, so the broker's
        # figure includes the heartbeats it handled meanwhile): the cost, machine aside.
        routes_ok = sum(x["ok"] for x in routes)
        echoes_ok = sum(x["ok"] for x in echoes)
        self.r["broker_cpu_us_per_route"] = (
            round(sum(c for c, _ in route_cpu) / routes_ok * 1e6, 1)
            if route_cpu and routes_ok
            else None
        )
        hb_only = self.r.get("broker_cpu_share_heartbeats")
        loaded = self.r["broker_cpu_share"]
        rps = self.r["routes_per_s"]
        # Net of what the heartbeats-only phase cost, per route: the routing cost itself.
        self.r["broker_cpu_us_per_route_net"] = (
            round((loaded - hb_only) / rps * 1e6, 1)
            if loaded is not None and hb_only is not None and rps
            else None
        )
        self.r["echo_responder_cpu_share"] = (
            round(sum(c for c, _ in echo_cpu) / sum(t for _, t in echo_cpu), 3)
            if echo_cpu
            else None
        )
        self.r["echo_cpu_us_per_request"] = (
            round(sum(c for c, _ in echo_cpu) / echoes_ok * 1e6, 1)
            if echo_cpu and echoes_ok
            else None
        )
        self.r["nats_server_cpu_share"] = (
            round(sum(c for c, _ in server_cpu) / sum(t for _, t in server_cpu), 3)
            if server_cpu
            else None
        )
        self.r["machine_cpu_busy_share"] = round(
            sum(b for b, _ in busy) / sum(t for _, t in busy), 3
        )
        if h0 is not None and h1 is not None:
            self.r["heartbeats_per_s_under_load"] = round(
                (h1 - h0) / (time.perf_counter() - ht0), 1
            )

    async def storm(self) -> None:
        a = self.args
        if not self.metrics_url or a.storm_seconds <= 0:
            return
        sim = self.sims[0]
        for other in self.sims[1:]:
            await other.command("pause")  # the broker's count moves with the storm alone
        c0 = await sim.command("pause")
        h0 = await self.settle_heartbeats(10**12, 5) or 0
        log(f"heartbeat storm: {a.storm_rate:g}/s for {a.storm_seconds:g} s")
        bpid = self.broker.pid if self.broker else None
        cpu0 = cpu_seconds(bpid) if bpid else None
        t0 = time.perf_counter()
        await sim.command(f"storm {a.storm_rate} {a.storm_seconds}", reply="storm")
        samples: list[tuple[float, int]] = [(t0, h0)]
        done: dict[str, Any] | None = None
        deadline = t0 + a.storm_seconds + 30
        reader = asyncio.create_task(sim.wait_event("storm_done", a.storm_seconds + 30))
        try:
            while time.perf_counter() < deadline:
                await asyncio.sleep(0.25)
                samples.append((time.perf_counter(), await self.hb_total() or 0))
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
        h1 = await self.settle_heartbeats(h0 + sent, 15) or 0
        cpu1 = cpu_seconds(bpid) if bpid else None
        self.r["storm_dropped"] = sent - (h1 - h0)
        self.r["nats_slow_consumers"] = await self.slow_consumers()
        # Heartbeats per second of broker CPU over the storm and its catch-up: what one
        # broker core would ingest if the load generators did not share the machine.
        self.r["heartbeats_per_broker_cpu_s"] = (
            round((h1 - h0) / (cpu1 - cpu0), 1)
            if cpu0 is not None and cpu1 is not None and cpu1 > cpu0
            else None
        )
        offered = (done["storm_sent"] / done["seconds"]) if done and done["seconds"] else None
        # Peak ingest: the best 1 s window of the broker's own counter (the whole span when
        # the storm was over sooner).
        span = min(1.0, samples[-1][0] - samples[0][0])
        best = 0.0
        for i in range(len(samples)):
            for j in range(i + 1, len(samples)):
                if samples[j][0] - samples[i][0] >= span > 0:
                    best = max(
                        best, (samples[j][1] - samples[i][1]) / (samples[j][0] - samples[i][0])
                    )
                    break
        self.r["storm_offered_per_s"] = round(offered, 1) if offered else None
        self.r["heartbeat_ingest_peak_per_s"] = round(best, 1)
        self.r["storm_heartbeats"] = done["storm_sent"] if done else None
        self.r["storm_catch_up_s"] = round(samples[-1][0] - t0, 3)

    async def reannounce(self) -> None:
        sim = self.sims[0]
        ev = await sim.command("reannounce", within=60 + self.args.agents / 100)
        self.r["reannounce_s"] = ev["seconds"]
        self.r["reannounce_errors"] = ev["errors"]
        self.r["reannounce_agents"] = self.sim_counts[0]
        await asyncio.sleep(max(1.0, 2 * self.args.interval))  # let heartbeats resume

    async def kill(self) -> None:
        a = self.args
        timeout = max(30.0, 10 * a.interval)
        m = await self.metrics()
        self.r["advisories_active"] = bool(m.get("reach_disconnect_advisories", 0.0))
        self.hb_sent_final: dict[str, int] = {}
        k = max(1, round(a.agents * a.kill_share))
        if "silent" in self.victims:
            v = self.victims["silent"]
            before = await self.wait_routable(VICTIM_SILENT, k // 2, timeout)
            t_kill = time.perf_counter()
            ev = await v.command("silence")
            self.hb_sent_final["silent"] = ev["sent"]
            ms = await self.until_unroutable(VICTIM_SILENT, t_kill, timeout)
            self.r["kill_detection_silent_ms"] = ms
            self.r["kill_silent_routable_before"] = before
            log(
                f"silenced {a.kill_share:.0%}: none routed after {ms} ms ({before} routable before)"
            )
        if "adv" in self.victims:
            v = self.victims["adv"]
            before = await self.wait_routable(VICTIM_ADV, k // 2, timeout)
            ev = await v.command("pause")  # its final tally (flushed), then SIGKILL
            t_kill = time.perf_counter()
            await v.kill()
            self.hb_sent_final["adv"] = ev["sent"]
            ms = await self.until_unroutable(VICTIM_ADV, t_kill, timeout)
            self.r["kill_detection_ms"] = ms
            self.r["kill_adv_routable_before"] = before
            log(
                f"SIGKILLed {a.kill_share:.0%}: none routed after {ms} ms "
                f"({before} routable before)"
            )
        self.r["kill_count"] = max(1, round(a.agents * a.kill_share))

    async def accounting(self) -> None:
        """Heartbeats sent by every sim minus those the broker counted."""
        sent = dict(getattr(self, "hb_sent_final", {}))
        for sim in self.sims:
            ev = await sim.command("pause")
            sent[sim.name] = ev["sent"]
        if "silent" in self.victims and "silent" not in sent:
            sent["silent"] = (await self.victims["silent"].command("pause"))["sent"]
        if "adv" in self.victims and "adv" not in sent and self.victims["adv"].alive():
            sent["adv"] = (await self.victims["adv"].command("pause"))["sent"]
        total_sent = sum(sent.values())
        counted = await self.settle_heartbeats(total_sent, 15)
        self.r["heartbeats_sent"] = total_sent
        if counted is not None:
            by_result = heartbeat_counts(await self.metrics())
            self.r["heartbeats_counted"] = counted
            self.r["heartbeat_results"] = by_result
            self.r["heartbeats_dropped"] = total_sent - counted
            self.r["heartbeats_rejected"] = counted - by_result.get("accepted", 0)
        for sim in self.sims:
            await sim.command("resume")
        self.r["nats_slow_consumers_steady"] = await self.slow_consumers()
        m = await self.metrics()
        self.r["broker_nats_errors"] = {
            k: v for k, v in m.items() if k.startswith("reach_nats_errors_total")
        }

    async def run(self) -> dict[str, Any]:
        a = self.args
        r = self.r
        r.update({
            "date_utc": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "host_cores": os.cpu_count(), "loadavg_start": loadavg(), "agents": a.agents,
            "interval_s": a.interval, "duration_s": a.duration, "concurrency": a.concurrency,
            "rounds": a.rounds, "kill_share": a.kill_share, "capabilities": a.capabilities,
            "connections_per_sim": a.connections, "conn_per_agent": a.conn_per_agent,
        })  # fmt: skip
        for key in rpt.REQUIRED_KEYS:
            r.setdefault(key, None)
        await self.start_infra()
        await self.register()
        log("heartbeats only")
        await self.heartbeats_only()
        await self.load()
        if a.reannounce:
            log("re-announce storm")
            await self.reannounce()
        if self.victims:
            await self.kill()
        await self.accounting()
        # Last: a storm may leave the broker behind for a while, which would blur the rest.
        await self.storm()
        r["loadavg_end"] = loadavg()
        return r

    def pids(self) -> dict[str, int]:
        """Every process this run started (the report lists them; none outlives the run)."""
        out = {f"{c.name}-{i}": c.pid for i, c in enumerate(self.children)}
        if self.server is not None and self.server.pid is not None:
            out["nats-server"] = self.server.pid
        return out

    async def cleanup(self) -> None:
        if self.nc is not None:
            with contextlib.suppress(Exception):
                await self.nc.close()
        for child in reversed(self.children):
            with contextlib.suppress(Exception):
                await child.stop()
        if self.server is not None:
            await asyncio.to_thread(self.server.stop)
        if self._tmp is not None:
            self._tmp.cleanup()


async def amain(args: argparse.Namespace) -> int:
    run = Run(args)
    task = asyncio.current_task()
    assert task is not None
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, task.cancel)
    try:
        report = await asyncio.wait_for(run.run(), args.budget)
        status = 0
    except TimeoutError:
        log(f"watchdog: the run exceeded --budget {args.budget:g} s; partial report")
        report, status = run.r, 1
    except Exception as exc:
        log(f"failed: {exc!r}")
        report, status = run.r, 1
    finally:
        pids = run.pids()
        await run.cleanup()
    report["pids"] = pids
    report.setdefault("loadavg_end", loadavg())
    report["targets"] = rpt.targets(report)
    report["summary"] = rpt.summary(report)
    report["status"] = "ok" if status == 0 else "incomplete"
    if args.report:
        rpt.write(report, args.report)
    print(report["summary"])
    return status


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
    args = p.parse_args(argv)
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
    with contextlib.suppress(ImportError):
        import uvloop

        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    try:
        return asyncio.run(amain(args))
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
