"""``python -m loadtest.callagent``: the SDK agent ``loadtest.calls`` calls, in its own process.

    python -m loadtest.callagent --server URL --wal-dir DIR [--agent-id bench-agent]

One ``reach_agent.Agent`` with two capabilities served by the same trivial handler (it
returns the payload): ``bench.idem``, marked idempotent (no claim: nothing is written
before the handler runs), and ``bench.claimed`` (the request id is claimed in KV
``reach_claims`` before the receipt). Its ack records go through the default write-ahead
``AckWriter`` (WAL in ``--wal-dir``), as any agent's do.

JSON lines on stdout: ``ready`` once the agent is started, then one line per command read
on stdin: ``flush`` waits (at most ``--flush-wait`` s) until the ack writer has stored every
record written so far and answers how many were pending and how long it took; ``stats``
flushes too and answers ``{"event": "stats", "runs": {capability: handler runs},
"acks_stored": …, "acks_folded": …, "acks_pending": …}`` (``acks_folded``: ``received``
records the writer folded into their final record instead of storing them). It stops
(draining the agent) on ``quit``, when stdin closes, on SIGTERM, or after ``--max-runtime``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import sys
import time
from typing import Any

import reach_agent
from jetstream.acks import AckWriter

IDEMPOTENT = "bench.idem"
CLAIMED = "bench.claimed"
CAPABILITIES = (IDEMPOTENT, CLAIMED)


def emit(event: str, **fields: Any) -> None:
    sys.stdout.write(json.dumps({"event": event, **fields}) + "\n")
    sys.stdout.flush()


class BenchAgent:
    """The agent, its handler runs counted per capability."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.runs = dict.fromkeys(CAPABILITIES, 0)
        self.agent = reach_agent.Agent(
            args.agent_id,
            list(CAPABILITIES),
            max_concurrency=args.max_concurrency,
            heartbeat_interval=1.0,
            idempotent={IDEMPOTENT},
            ack_wal_dir=args.wal_dir,
            grace=5.0,
        )
        for cap in CAPABILITIES:
            self.agent.handler(cap)(self._handler(cap))

    def _handler(self, capability: str) -> Any:
        async def echo(task: reach_agent.Task) -> Any:
            self.runs[capability] += 1
            return task.payload

        return echo

    async def flush(self) -> dict[str, Any]:
        """Until the ack writer has stored everything (``--flush-wait`` at most): records
        still pending when a slice ends are its cost too, paid after it."""
        sink = self.agent.ack_sink
        if not isinstance(sink, AckWriter):
            return {"pending_before": None, "seconds": 0.0, "flushed": None, "pending_after": None}
        pending, t0 = sink.pending, time.perf_counter()
        flushed = await sink.flush(self.args.flush_wait)
        seconds = round(time.perf_counter() - t0, 4)
        return {"pending_before": pending, "seconds": seconds, "flushed": flushed,
                "pending_after": sink.pending}  # fmt: skip

    async def stats(self) -> dict[str, Any]:
        flushed = await self.flush()
        sink = self.agent.ack_sink
        return {"runs": dict(self.runs), "acks_flushed": flushed["flushed"],
                "acks_stored": sink.stored if isinstance(sink, AckWriter) else None,
                "acks_folded": sink.folded if isinstance(sink, AckWriter) else None,
                "acks_pending": flushed["pending_after"]}  # fmt: skip

    async def commands(self, stop: asyncio.Event) -> None:
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader()
        await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
        while not stop.is_set():
            line = await reader.readline()
            words = line.decode().split()
            if not line or words[:1] == ["quit"]:
                return
            if words[:1] == ["stats"]:
                emit("stats", **await self.stats())
            elif words[:1] == ["flush"]:
                emit("flush", **await self.flush())
            elif words:
                emit("error", message=f"unknown command {words[0]!r}")

    async def run(self) -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        async with self.agent.serve(self.args.server):
            claimer = self.agent.tasks.claimer
            emit(
                "ready",
                agent_id=self.args.agent_id,
                pid=os.getpid(),
                claims=claimer is not None and claimer.available,
            )
            commands = asyncio.create_task(self.commands(stop))
            stopped = asyncio.create_task(stop.wait())
            await asyncio.wait(
                {commands, stopped},
                timeout=self.args.max_runtime,
                return_when=asyncio.FIRST_COMPLETED,
            )
            for task in (commands, stopped):
                task.cancel()
            await asyncio.gather(commands, stopped, return_exceptions=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m loadtest.callagent", description=__doc__.split("\n")[0]
    )
    p.add_argument("--server", required=True)
    p.add_argument("--wal-dir", required=True, help="the ack write-ahead directory")
    p.add_argument("--agent-id", default="bench-agent")
    p.add_argument("--max-concurrency", type=int, default=64)
    p.add_argument(
        "--flush-wait",
        type=float,
        default=120.0,
        help="longest wait for the ack writer on flush (s)",
    )
    p.add_argument("--max-runtime", type=float, default=3600.0)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    with contextlib.suppress(ImportError):
        import uvloop

        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    asyncio.run(BenchAgent(args).run())


if __name__ == "__main__":
    main()
