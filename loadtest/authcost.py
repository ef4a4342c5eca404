"""``python -m loadtest.authcost``: what secured mode costs on the route path, as a ratio.

Two ``reach broker`` processes run side by side, each with its embedded server: one in open
mode, one with ``--auth DIR`` (operator mode; the broker connects with ``DIR/broker.creds``).
Both get the same ``--agents`` simulated agents (announced once, one heartbeat each, on one
connection: in secured mode a user of the DIR's account allowed every subject, since the
simulation speaks for every agent), then ``loadtest.driver route`` slices alternate between
them for ``--rounds`` rounds (the order flips every round, so background noise hits both
alike), the secured one with a caller's credential (``NATS_CREDS``). The figures are
``auth_vs_open_ratio`` (secured routes per second over open ones, per round and overall) and
the CPU the broker and its server spent per route in each mode (``/proc``), which a shared
machine's noise moves less than throughput.

    python -m loadtest.authcost --agents 1000 --duration 5 --rounds 3 --concurrency 32

Every child is ours and is ended by PID in ``finally``; the temp dir goes with them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import nats

from reach_agent.connection import Credentials, connect_options
from reach_agent.wire import schema
from reach_agent.wire.subjects import Subjects
from reach_broker.auth import AuthDir, claims, init, issue_caller
from reach_broker.auth.claims import User, UserClaims

from .procfs import cpu_seconds

log = logging.getLogger("loadtest.authcost")

CAPABILITY = "loadtest.cap0"


def fleet_credentials(d: AuthDir, path: Path) -> Path:
    """A user of the DIR's account with no permission limits: the simulation announces and
    heartbeats for every agent from one connection (no real agent may)."""
    seed = claims.new_seed("user")
    user = UserClaims(sub=claims.public_key(claims.keypair(seed)), name="loadtest-fleet",
                      nats=User.unlimited())  # fmt: skip
    path.write_bytes(claims.format_creds(claims.encode(user, d.signer("app")), seed))
    path.chmod(0o600)
    return path


class Broker:
    """One ``reach broker`` child with its embedded server."""

    def __init__(self, name: str, args: list[str], env: dict[str, str]) -> None:
        self.name = name
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "reach_broker.cli", "broker", "--port", "0",
             "--metrics-port", "0", "--log-level", "warning", *args],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
            start_new_session=True,
        )  # fmt: skip
        self.url = ""
        self.server_pid = 0
        assert self.proc.stdout is not None
        seen = []
        for line in self.proc.stdout:
            seen.append(line)
            found = re.search(r"embedded nats-server listening on (\S+) \(pid (\d+)", line)
            if found:
                self.url, self.server_pid = found.group(1), int(found.group(2))
            if "serving on" in line:
                break
        if not self.url:
            self.stop()
            raise RuntimeError(f"broker {name} did not start:\n{''.join(seen)}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        if self.proc.stdout is not None:
            self.proc.stdout.close()


async def register(url: str, creds: str | None, agents: int) -> None:
    """``agents`` agents with :data:`CAPABILITY`, announced and heartbeaten once each."""
    nc = await nats.connect(**connect_options("loadtest-fleet", url, Credentials(creds=creds)))
    subjects = Subjects()
    try:
        for start in range(0, agents, 200):
            batch = [f"sim-{i:05d}" for i in range(start, min(start + 200, agents))]
            replies = await asyncio.gather(*(nc.request(
                subjects.announce(a), schema.encoder.encode(schema.Announce(
                    agent_id=a, capabilities=[CAPABILITY], max_concurrency=8,
                    heartbeat_interval_ms=300_000)), timeout=10) for a in batch))  # fmt: skip
            for a, reply in zip(batch, replies, strict=True):
                token = schema.announce_ack_decoder.decode(reply.data).token
                hb = schema.Heartbeat(agent_id=a, token=token, seq=1, initial=True)
                await nc.publish(subjects.heartbeat(a), schema.encoder.encode(hb))
        await nc.flush()
    finally:
        await nc.close()


def cpu(b: Broker) -> tuple[float, float]:
    """CPU seconds used so far by the broker and by its server."""
    return cpu_seconds(b.proc.pid) or 0.0, cpu_seconds(b.server_pid) or 0.0


def drive(url: str, creds: str | None, a: argparse.Namespace) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("NATS_")}
    if creds:
        env["NATS_CREDS"] = creds
    out = subprocess.run(
        [sys.executable, "-m", "loadtest.driver", "route", "--server", url,
         "--concurrency", str(a.concurrency), "--duration", str(a.duration),
         "--warmup", "1", "--capability", CAPABILITY],
        capture_output=True, text=True, env=env, timeout=a.duration + 60, check=True,
    )  # fmt: skip
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


async def measure(a: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    d = init(tmp / "auth")
    caller = str(issue_caller(d, "loadtest"))
    fleet = str(fleet_credentials(d, tmp / "fleet.creds"))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NATS_", "REACH_"))}
    brokers: list[Broker] = []
    try:
        brokers.append(Broker("open", ["--store-dir", str(tmp / "open")], env))
        brokers.append(Broker("auth", ["--auth", str(d.root)], env))
        opened, secured = brokers
        await register(opened.url, None, a.agents)
        await register(secured.url, fleet, a.agents)
        await asyncio.sleep(1.0)  # heartbeats handled, rankings built
        runs: dict[str, list[dict[str, Any]]] = {"open": [], "auth": []}
        for r in range(a.rounds):
            order = (("open", opened, None), ("auth", secured, caller))
            for mode, b, creds in order if r % 2 == 0 else order[::-1]:
                before = cpu(b)
                res = await asyncio.to_thread(drive, b.url, creds, a)
                after = cpu(b)
                # The whole slice's CPU (warm-up included) over the whole slice's routes.
                routes = res["ok"] * (1 + 1.0 / a.duration)
                res["broker_cpu_us"] = round((after[0] - before[0]) / routes * 1e6, 1)
                res["server_cpu_us"] = round((after[1] - before[1]) / routes * 1e6, 1)
                runs[mode].append(res)
                log.info("round %d %s: %.0f routes/s p50 %s ms errors %s", r + 1, mode,
                         res["per_s"], res["p50_ms"], res["errors"])  # fmt: skip
    finally:
        for b in reversed(brokers):
            b.stop()

    def per_s(results: list[dict[str, Any]]) -> float:
        secs = sum(x["seconds"] for x in results)
        return round(sum(x["ok"] for x in results) / secs, 1) if secs else 0.0

    return {
        "agents": a.agents, "concurrency": a.concurrency, "duration_s": a.duration,
        "rounds": a.rounds, "open_routes_per_s": per_s(runs["open"]),
        "auth_routes_per_s": per_s(runs["auth"]),
        "auth_vs_open_ratio": round(per_s(runs["auth"]) / per_s(runs["open"]), 3)
        if per_s(runs["open"]) else None,
        "per_round_ratio": [round(x["per_s"] / o["per_s"], 3) if o["per_s"] else None
                            for o, x in zip(runs["open"], runs["auth"], strict=True)],
        "open_p50_ms": [x["p50_ms"] for x in runs["open"]],
        "auth_p50_ms": [x["p50_ms"] for x in runs["auth"]],
        "broker_cpu_us_per_route": {m: [x["broker_cpu_us"] for x in v] for m, v in runs.items()},
        "server_cpu_us_per_route": {m: [x["server_cpu_us"] for x in v] for m, v in runs.items()},
        "errors": {m: [x["errors"] for x in v] for m, v in runs.items()},
    }  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m loadtest.authcost", description=__doc__)
    p.add_argument("--agents", type=int, default=1000)
    p.add_argument("--duration", type=float, default=5.0, help="seconds per slice")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--report", help="write the figures here as JSON too")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    tmp = Path(tempfile.mkdtemp(prefix="reach-authcost-"))
    try:
        figures = asyncio.run(measure(a, tmp))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    text = json.dumps(figures, indent=2)
    print(text)
    if a.report:
        Path(a.report).write_text(text + "\n")


if __name__ == "__main__":
    main()
