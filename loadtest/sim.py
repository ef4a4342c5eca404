"""Simulated agents: announce, heartbeat with varying load figures, answer probes.

One process simulates many agents over a bounded number of NATS connections (``--connections``)
or, with ``--conn-per-agent``, one connection per agent named by its ``agent_id`` (what the
server's disconnect advisories key on). The process is driven over stdin by the load tool,
one command per line, and answers with one JSON object per line on stdout:

    pause | resume            stop / restart heartbeats (connections stay open)
    silence                   stop heartbeats and probe answers (a hung agent)
    storm RATE SECONDS        heartbeats as fast as RATE/s for SECONDS, then steady again
    reannounce                every agent announces again at once (as after a NATS restart)
    count                     report heartbeats sent so far
    quit                      close connections and exit

Every command is answered with ``{"event": <command>, "sent": <heartbeats sent>, ...}``.
The process exits by itself after ``--max-runtime`` seconds, whatever happens.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import sys
import time
from typing import Any

import nats
from nats.aio.client import Client as NATS

from reach_agent.connection import connect_options
from reach_agent.wire import schema
from reach_agent.wire.errors import H_SERVICE_ERROR
from reach_agent.wire.schema import Announce, Heartbeat, ProbeReply
from reach_agent.wire.subjects import Subjects

CAPABILITIES = tuple(f"loadtest.cap{i}" for i in range(10))
"""The shared capabilities route load is spread over; each agent has one to three."""


def emit(event: str, **fields: Any) -> None:
    sys.stdout.write(json.dumps({"event": event, **fields}) + "\n")
    sys.stdout.flush()


class SimAgent:
    """One simulated agent: its token, sequence and a random walk of load figures."""

    __slots__ = (
        "active",
        "agent_id",
        "capabilities",
        "conn",
        "fail_total",
        "max_concurrency",
        "ok_total",
        "queue_depth",
        "region",
        "rng",
        "seq",
        "subject",
        "task_base_ms",
        "tier",
        "token",
    )

    def __init__(self, agent_id: str, capabilities: list[str], conn: int, rng: random.Random):
        self.agent_id = agent_id
        self.capabilities = capabilities
        self.conn = conn
        self.rng = rng
        self.max_concurrency = rng.choice((4, 8, 16, 32))
        self.active = rng.randrange(0, max(1, self.max_concurrency // 2))
        self.queue_depth = 0
        self.ok_total = 0
        self.fail_total = 0
        self.task_base_ms = rng.uniform(50.0, 3000.0)
        self.seq = 0
        self.token = ""
        self.subject = ""
        self.region = rng.choice(("eu", "us", "ap"))
        self.tier = rng.choice(("gold", "silver"))

    def announce(self, interval_ms: int) -> Announce:
        return Announce(
            agent_id=self.agent_id,
            capabilities=self.capabilities,
            max_concurrency=self.max_concurrency,
            heartbeat_interval_ms=interval_ms,
            agent_type="loadtest",
            version="1.0.0",
            region=self.region,
            tags={"tier": self.tier},
            timeout_hint_ms=30_000,
        )

    def heartbeat(self) -> bytes:
        """The next heartbeat: load drifts by ±1, results accrue, 2% of tasks fail."""
        rng = self.rng
        cap = self.max_concurrency
        # Mostly below the routing watermark (0.85); now and then an agent runs full.
        ceiling = cap if rng.random() < 0.05 else int(cap * 0.8)
        self.active = min(max(self.active + rng.choice((-1, 0, 1)), 0), ceiling)
        self.queue_depth = rng.randrange(0, 3) if self.active >= ceiling else 0
        done = rng.randrange(0, 4)
        failed = 1 if rng.random() < 0.02 else 0
        self.ok_total += done - failed if done >= failed else 0
        self.fail_total += failed
        self.seq += 1
        hb = Heartbeat(
            agent_id=self.agent_id,
            token=self.token,
            seq=self.seq,
            status="busy" if self.active >= cap else "idle",
            active=self.active,
            queue_depth=self.queue_depth,
            ok_total=self.ok_total,
            fail_total=self.fail_total,
            task_ms_p50=int(self.task_base_ms * rng.uniform(0.8, 1.2)),
            oldest_task_ms=int(self.task_base_ms * rng.uniform(0.5, 2.0)) if self.active else None,
            context_usage_pct=round(rng.uniform(5, 90), 1),
        )
        return schema.encoder.encode(hb)


class Sim:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.subjects = Subjects(args.prefix)
        self.interval = args.interval
        rng = random.Random(args.seed)
        self.agents: list[SimAgent] = []
        n_conns = args.agents if args.conn_per_agent else max(1, min(args.connections, args.agents))
        self.n_conns = n_conns
        extra = [c for c in (args.extra_capability or []) if c]
        for i in range(args.agents):
            agent_id = f"{args.id_prefix}-{i:05d}"
            shared = CAPABILITIES[: args.capabilities]
            caps = rng.sample(shared, rng.randint(1, min(3, len(shared)))) + extra
            agent = SimAgent(agent_id, caps, i % n_conns, random.Random(rng.random()))
            agent.subject = self.subjects.heartbeat(agent_id)
            self.agents.append(agent)
        self.by_id = {a.agent_id: a for a in self.agents}
        self.conns: list[NATS] = []
        self.probe_subs: list[Any] = []
        self.sent = 0
        self.probes_answered = 0
        self.announce_errors = 0
        self.reannounced = 0
        self.heartbeating = True
        self.answering = True
        self.storm: tuple[float, float] | None = None  # (rate, until)
        self.errors = 0

    async def _error_cb(self, exc: Exception) -> None:
        self.errors += 1

    async def connect(self) -> None:
        # Tuned for many connections in one process: pings every 5 s, large buffers.
        tuned: dict[str, Any] = {
            "error_cb": self._error_cb,
            "reconnect_time_wait": 0.2,
            "ping_interval": 5,
            "pending_size": 64 * 1024 * 1024,
            "flusher_queue_size": 65536,
        }
        sem = asyncio.Semaphore(64)

        async def one(i: int) -> NATS:
            name = (
                self.agents[i].agent_id
                if self.args.conn_per_agent
                else f"{self.args.id_prefix}-conn{i}"
            )
            async with sem:
                return await nats.connect(**connect_options(name, self.args.server, **tuned))

        self.conns = list(await asyncio.gather(*(one(i) for i in range(self.n_conns))))
        # Probes: a wildcard subscription per connection would deliver each probe to every
        # connection; with shared connections one wildcard on the first answers for all.
        if self.args.conn_per_agent:
            for agent in self.agents:
                nc = self.conns[agent.conn]
                self.probe_subs.append(
                    await nc.subscribe(self.subjects.probe(agent.agent_id), cb=self._on_probe)
                )
        else:
            self.probe_subs.append(
                await self.conns[0].subscribe(self.subjects.all_probes, cb=self._on_probe)
            )
        # A broker that does not know an agent asks it to announce again: one wildcard on
        # the first connection serves every agent of this process.
        self.probe_subs.append(
            await self.conns[0].subscribe(self.subjects.all_reannounces, cb=self._on_reannounce)
        )
        for nc in self.conns:
            await nc.flush()

    async def _on_reannounce(self, msg: Any) -> None:
        agent = self.by_id.get(self.subjects.agent_of_reannounce(msg.subject))
        if agent is None or not self.heartbeating:
            return  # another process's agent, or a paused fleet
        self.reannounced += 1
        body = schema.encoder.encode(agent.announce(int(self.interval * 1000)))
        try:
            reply = await self.conns[agent.conn].request(
                self.subjects.announce(agent.agent_id), body, timeout=5.0
            )
            agent.token = schema.announce_ack_decoder.decode(reply.data).token
        except Exception:  # noqa: BLE001 - the broker asks again at the next heartbeat
            self.announce_errors += 1

    async def _on_probe(self, msg: Any) -> None:
        if not self.answering or not msg.reply:
            return
        agent_id = self.subjects.agent_of_probe(msg.subject)
        agent = self.by_id.get(agent_id)
        if agent is None:
            return  # another process's agent
        reply = ProbeReply(agent_id=agent_id, active=agent.active, seq=agent.seq)
        self.probes_answered += 1
        await self.conns[agent.conn].publish(msg.reply, schema.encoder.encode(reply))

    async def announce_all(self) -> float:
        """Announce every agent (bounded concurrency); returns the seconds it took."""
        t0 = time.perf_counter()
        interval_ms = int(self.interval * 1000)
        sem = asyncio.Semaphore(self.args.announce_concurrency)

        async def one(agent: SimAgent) -> None:
            body = schema.encoder.encode(agent.announce(interval_ms))
            async with sem:
                for attempt in range(5):
                    try:
                        msg = await self.conns[agent.conn].request(
                            self.subjects.announce(agent.agent_id), body, timeout=5.0
                        )
                        if msg.headers and msg.headers.get(H_SERVICE_ERROR):
                            raise RuntimeError(msg.headers.get(H_SERVICE_ERROR))
                        ack = schema.announce_ack_decoder.decode(msg.data)
                        agent.token = ack.token
                        # seq is per process and keeps rising across re-announces (never stale)
                        return
                    except Exception:
                        await asyncio.sleep(0.1 * (attempt + 1))
                self.announce_errors += 1

        await asyncio.gather(*(one(a) for a in self.agents))
        return time.perf_counter() - t0

    async def heartbeat_loop(self) -> None:
        """Spread heartbeats evenly over the interval; a storm sends at its rate instead."""
        agents = self.agents
        n = len(agents)
        conns = self.conns
        tick = 0.01
        cursor = 0  # heartbeats due since ``t0`` that were sent (or skipped while paused)
        t0 = time.perf_counter()
        storm_cursor = 0
        storm_t0 = 0.0
        while True:
            await asyncio.sleep(tick)
            now = time.perf_counter()
            if self.storm is not None:
                rate, until = self.storm
                if storm_t0 == 0.0:
                    storm_t0, storm_cursor = now, 0
                due = int((min(now, until) - storm_t0) * rate)
                for k in range(storm_cursor, due):
                    agent = agents[k % n]
                    await conns[agent.conn].publish(agent.subject, agent.heartbeat())
                    self.sent += 1
                storm_cursor = max(due, storm_cursor)
                if now >= until:
                    seconds = now - storm_t0
                    self.storm, storm_t0 = None, 0.0
                    for nc in conns:
                        await nc.flush()
                    emit("storm_done", sent=self.sent, storm_sent=storm_cursor,
                         seconds=round(seconds, 4))  # fmt: skip
                    t0, cursor = time.perf_counter(), 0
                continue
            due = int((now - t0) / self.interval * n)
            if not self.heartbeating:
                cursor = due
                continue
            for k in range(cursor, due):
                if not self.heartbeating:
                    break  # paused mid-batch: what was counted is what was published
                agent = agents[k % n]
                if not agent.token:
                    continue  # not announced yet: it beats from its first slot after that
                await conns[agent.conn].publish(agent.subject, agent.heartbeat())
                self.sent += 1
            cursor = due

    async def flush(self) -> None:
        await asyncio.gather(*(nc.flush(timeout=5) for nc in self.conns), return_exceptions=True)

    async def command_loop(self) -> None:
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader()
        await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
        while True:
            line = await reader.readline()
            if not line:
                return  # the load tool went away: stop
            words = line.decode().split()
            if not words:
                continue
            cmd = words[0]
            if cmd == "pause":
                self.heartbeating = False
                await self.flush()
            elif cmd == "resume":
                self.heartbeating = True
            elif cmd == "silence":
                self.heartbeating = False
                self.answering = False
                await self.flush()
            elif cmd == "storm":
                rate, seconds = float(words[1]), float(words[2])
                self.storm = (rate, time.perf_counter() + seconds)
            elif cmd == "reannounce":
                took = await self.announce_all()
                emit("reannounce", sent=self.sent, seconds=round(took, 4),
                     errors=self.announce_errors)  # fmt: skip
                continue
            elif cmd == "count":
                await self.flush()
            elif cmd == "quit":
                await self.flush()
                emit("quit", sent=self.sent)
                return
            emit(cmd, sent=self.sent, probes_answered=self.probes_answered, errors=self.errors)

    async def run(self) -> None:
        await self.connect()
        # Beating while the others announce, as an SDK agent beats from its own announce on:
        # beats begun only once all had announced left the first agents silent for the whole
        # registration (4 s at 10,000 agents), and a third of the fleet silent at once made
        # the broker doubt itself (observer.suspect_self) for what the simulator did.
        hb = asyncio.create_task(self.heartbeat_loop())
        try:
            took = await self.announce_all()
            emit("ready", agents=len(self.agents), connections=len(self.conns),
                 announce_s=round(took, 4), announce_errors=self.announce_errors,
                 pid=os.getpid())  # fmt: skip
            await asyncio.wait_for(self.command_loop(), self.args.max_runtime)
        except TimeoutError:
            emit("max_runtime", sent=self.sent)
        finally:
            hb.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await hb
            for nc in self.conns:
                with contextlib.suppress(Exception):
                    await nc.close()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m loadtest.sim", description=__doc__.split("\n")[0])
    p.add_argument("--server", required=True)
    p.add_argument("--prefix", default="reach")
    p.add_argument("--agents", type=int, default=1000)
    p.add_argument("--interval", type=float, default=1.0, help="heartbeat interval (s)")
    p.add_argument("--connections", type=int, default=8, help="NATS connections shared by agents")
    p.add_argument("--conn-per-agent", action="store_true",
                   help="one connection per agent, named by agent_id")  # fmt: skip
    p.add_argument("--id-prefix", default="sim")
    p.add_argument("--extra-capability", action="append",
                   help="a capability every agent of this process also has")  # fmt: skip
    p.add_argument("--capabilities", type=int, default=len(CAPABILITIES),
                   help="shared capabilities in use (each agent has 1-3 of them)")  # fmt: skip
    p.add_argument("--announce-concurrency", type=int, default=200)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--max-runtime", type=float, default=600.0)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    with contextlib.suppress(ImportError):
        import uvloop

        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    with contextlib.suppress(KeyboardInterrupt, SystemExit):
        asyncio.run(Sim(args).run())


if __name__ == "__main__":
    main()
