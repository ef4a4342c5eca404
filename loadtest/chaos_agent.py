"""A tiny agent speaking the wire contract with raw nats-py (no SDK ``Agent``), for faults.

    python -m loadtest.chaos_agent --server nats://127.0.0.1:4222 --id alpha \
        --capability summarize --heartbeat-ms 1000 --work-ms 20

Connects with the connection name = agent_id, announces (retrying), heartbeats with seq,
load, results and the p50 of the tasks finished since the last heartbeat, answers probes,
and runs tasks (a receipt when asked, sleep ``--work-ms``, reply ``{"agent": id}``).
Subjects, header names and connection options still come from ``reach_agent``
(``Subjects``, ``schema``, ``connect_options``), so there is one address for each.
``--sdk`` runs the same agent on ``reach_agent.Agent`` instead. SIGUSR1 adds
``--fault-ms`` (1500) to every task, SIGUSR2 takes it away again. Prints
``ready <agent_id>`` once announced. Used by the detection integration tests and by
``loadtest.chaos``; real processes, so SIGKILL and SIGSTOP mean what they say.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import statistics
import sys
import time
from typing import Any

import nats
from nats.aio.msg import Msg

from jetstream.names import H_REQUEST_ID
from reach_agent.connection import connect_options
from reach_agent.wire.schema import H_RECEIPT, H_STATUS
from reach_agent.wire.subjects import Subjects


class ChaosAgent:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.agent_id: str = args.id
        self.subjects = Subjects(args.prefix)
        self.extra_ms = 0.0
        self.active = 0
        self.ok_total = 0
        self.seq = 0
        self.token = ""
        self.recent: list[float] = []
        self.oldest: dict[int, float] = {}
        self._n = 0
        self._running: set[asyncio.Future[None]] = set()
        self.nc: Any = None

    async def run(self) -> None:
        a = self.args
        self.nc = await nats.connect(
            **connect_options(self.agent_id, a.server, reconnect_time_wait=0.2)
        )
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGUSR1, self._fault, a.fault_ms)
        loop.add_signal_handler(signal.SIGUSR2, self._fault, 0.0)
        await self.nc.subscribe(self.subjects.probe(self.agent_id), cb=self._on_probe)
        await self.nc.subscribe(self.subjects.tasks_of(self.agent_id), cb=self._on_task)
        await self._announce()
        print(f"ready {self.agent_id}", flush=True)
        while True:
            await asyncio.sleep(a.heartbeat_ms / 1000.0)
            await self._heartbeat()

    def _fault(self, extra_ms: float) -> None:
        self.extra_ms = extra_ms

    async def _announce(self) -> None:
        a = self.args
        body = json.dumps({
            "agent_id": self.agent_id, "capabilities": a.capability,
            "max_concurrency": a.max_concurrency, "heartbeat_interval_ms": a.heartbeat_ms,
            "timeout_hint_ms": 5000,
        }).encode()  # fmt: skip
        delay = 0.1
        for _ in range(100):
            try:
                reply = await self.nc.request(self.subjects.announce(self.agent_id), body, 1.0)
                self.token = json.loads(reply.data)["token"]
                self.seq = 0
                return
            except Exception:  # broker not up yet: back off and retry
                await asyncio.sleep(delay)
                delay = min(delay * 2, 1.0)
        raise SystemExit(f"{self.agent_id}: no broker answered the announce")

    async def _heartbeat(self) -> None:
        self.seq += 1
        now = time.monotonic()
        body: dict[str, Any] = {
            "agent_id": self.agent_id, "token": self.token, "seq": self.seq,
            "status": "busy" if self.active else "idle", "active": self.active,
            "queue_depth": 0, "ok_total": self.ok_total, "fail_total": 0,
        }  # fmt: skip
        if self.recent:
            # p50 of the tasks finished since the last heartbeat: the freshest signal.
            body["task_ms_p50"] = int(statistics.median(self.recent))
            self.recent.clear()
        if self.oldest:
            body["oldest_task_ms"] = int((now - min(self.oldest.values())) * 1000)
        await self.nc.publish(self.subjects.heartbeat(self.agent_id), json.dumps(body).encode())

    async def _on_probe(self, msg: Msg) -> None:
        reply = {"agent_id": self.agent_id, "active": self.active, "seq": self.seq}
        await msg.respond(json.dumps(reply).encode())

    async def _on_task(self, msg: Msg) -> None:
        task = asyncio.ensure_future(self._run_task(msg))
        self._running.add(task)
        task.add_done_callback(self._running.discard)

    async def _run_task(self, msg: Msg) -> None:
        self._n += 1
        n = self._n
        t0 = time.monotonic()
        self.active += 1
        self.oldest[n] = t0
        try:
            hdrs = msg.headers or {}
            rid = hdrs.get(H_REQUEST_ID, "")
            if hdrs.get(H_RECEIPT) == "1" and msg.reply:
                receipt = json.dumps({"request_id": rid, "status": "received"}).encode()
                await self.nc.publish(msg.reply, receipt, headers={
                    H_REQUEST_ID: rid, H_STATUS: "received"})  # fmt: skip
            await asyncio.sleep((self.args.work_ms + self.extra_ms) / 1000.0)
            headers = {H_STATUS: "completed"}
            if rid:
                headers[H_REQUEST_ID] = rid
            if msg.reply:
                await self.nc.publish(msg.reply, json.dumps({"agent": self.agent_id}).encode(),
                                      headers=headers)  # fmt: skip
            self.ok_total += 1
            self.recent.append((time.monotonic() - t0) * 1000.0)
        finally:
            self.active -= 1
            del self.oldest[n]


async def run_sdk(args: argparse.Namespace) -> None:
    """The same agent on the reach SDK (``reach_agent.Agent``): the handler sleeps."""
    import reach_agent

    extra = [0.0]
    agent = reach_agent.Agent(
        args.id, capabilities=args.capability, max_concurrency=args.max_concurrency,
        heartbeat_interval=args.heartbeat_ms / 1000.0, timeout_hint=5.0, prefix=args.prefix,
    )  # fmt: skip

    async def work(task: reach_agent.Task) -> dict[str, str]:
        await asyncio.sleep((args.work_ms + extra[0]) / 1000.0)
        return {"agent": args.id}

    for cap in args.capability:
        agent.handler(cap)(work)
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGUSR1, extra.__setitem__, 0, args.fault_ms)
    loop.add_signal_handler(signal.SIGUSR2, extra.__setitem__, 0, 0.0)
    async with agent.serve(args.server):
        for _ in range(1000):
            if agent.token is not None:
                break
            await asyncio.sleep(0.01)
        print(f"ready {args.id}", flush=True)
        await asyncio.Event().wait()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        prog="python -m loadtest.chaos_agent",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--server", required=True)
    ap.add_argument("--id", required=True)
    ap.add_argument("--capability", action="append", default=None)
    ap.add_argument("--prefix", default="reach")
    ap.add_argument("--heartbeat-ms", type=int, default=1000)
    ap.add_argument("--work-ms", type=float, default=20.0)
    ap.add_argument("--fault-ms", type=float, default=1500.0)
    ap.add_argument("--max-concurrency", type=int, default=64)
    ap.add_argument("--sdk", action="store_true", help="run on reach_agent.Agent instead")
    args = ap.parse_args(argv)
    args.capability = args.capability or ["summarize"]
    try:
        asyncio.run(run_sdk(args) if args.sdk else ChaosAgent(args).run())
    except KeyboardInterrupt:
        pass
    sys.exit(0)


if __name__ == "__main__":
    main()
