"""One agent of ``loadtest.nemesis``: an SDK agent whose handler writes down every run.

    python -m loadtest.nemesis_agent --id a1 --servers URL,URL,URL --log a1.jsonl \
        --wal DIR [--heartbeat 1.0] [--max-concurrency 8]

A ``reach_agent.Agent`` serving the claimed capability ``nemesis.work`` (claims on: the
capability is not idempotent), run by ``reach_agent.run`` (SIGTERM drains). Its handler
sleeps the payload's ``ms``, refuses the task (``BIZ_REJECT``) when the payload says
``reject``, and returns ``{"agent": <id>, "run": <run id>}``. Every run is two JSON lines in
``--log``, written with one ``write`` each on an ``O_APPEND`` descriptor, so a SIGKILL loses
nothing already returned from ``write``:

    {"ev": "start", "rid": …, "run": …, "t": …}
    {"ev": "end", "rid": …, "run": …, "t": …, "outcome": "ok" | "error" | "cancelled", "code"?}

and the process's own start is ``{"ev": "process", "agent", "instance", "pid", "t"}``. A run
id is ``<instance>-<n>``: the instance is random per process start, so a restarted agent's
runs are told from its earlier life's. ``t`` is Unix time (``time.time()``), the clock the
brokers stamp their events with. The ack write-ahead log is in ``--wal``: a restarted agent
(same id, same directory) sends what its killed predecessor had not.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import time
from typing import Any

import reach_agent

CAPABILITY = "nemesis.work"


class RunLog:
    """The handler's own log: one JSON line per ``write`` on an append-only descriptor."""

    def __init__(self, path: str) -> None:
        self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def write(self, **fields: Any) -> None:
        fields["t"] = time.time()
        os.write(self.fd, (json.dumps(fields) + "\n").encode())


def build(agent_id: str, log: RunLog, *, heartbeat: float, max_concurrency: int,
          wal_dir: str) -> reach_agent.Agent:  # fmt: skip
    instance = secrets.token_hex(4)
    agent = reach_agent.Agent(agent_id, [CAPABILITY], max_concurrency=max_concurrency,
                              heartbeat_interval=heartbeat, ack_wal_dir=wal_dir,
                              timeout_hint=5.0)  # fmt: skip
    runs = iter(range(1, 1 << 62))
    log.write(ev="process", agent=agent_id, instance=instance, pid=os.getpid())

    @agent.handler(CAPABILITY)
    async def work(task: reach_agent.Task) -> dict[str, str]:
        run = f"{instance}-{next(runs)}"
        payload = task.payload if isinstance(task.payload, dict) else {}
        log.write(ev="start", rid=task.request_id, run=run)
        try:
            await asyncio.sleep(float(payload.get("ms", 0)) / 1000.0)
            if payload.get("reject"):
                raise reach_agent.Reject(f"run {run} refuses {task.request_id} as asked")
        except reach_agent.ReachError as err:
            log.write(ev="end", rid=task.request_id, run=run, outcome="error", code=err.code)
            raise
        except asyncio.CancelledError:
            log.write(ev="end", rid=task.request_id, run=run, outcome="cancelled")
            raise
        log.write(ev="end", rid=task.request_id, run=run, outcome="ok")
        return {"agent": agent_id, "run": run}

    return agent


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m loadtest.nemesis_agent",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--id", required=True)
    ap.add_argument("--servers", required=True, help="comma-separated NATS URLs")
    ap.add_argument("--log", required=True, help="the handler's run log (JSON lines)")
    ap.add_argument("--wal", required=True, help="the ack write-ahead log's directory")
    ap.add_argument("--heartbeat", type=float, default=1.0, help="seconds (1.0)")
    ap.add_argument("--max-concurrency", type=int, default=8)
    args = ap.parse_args(argv)
    agent = build(args.id, RunLog(args.log), heartbeat=args.heartbeat,
                  max_concurrency=args.max_concurrency, wal_dir=args.wal)  # fmt: skip
    reach_agent.run(agent, args.servers.split(","))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
