"""A test agent process: logs every handler start to a file, sleeps, answers.

    python worker.py AGENT_ID CAPABILITY --log FILE [--max N] [--hb S] [--delay S]
                     [--creds FILE]

Each handler start appends ``start <request_id>`` to ``--log`` and each finish appends
``done <request_id>`` (flushed at once, so a SIGKILL loses nothing written). The payload
may carry ``sleep`` (seconds, overrides ``--delay``) and ``n`` (echoed back).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os

import reach_agent

parser = argparse.ArgumentParser()
parser.add_argument("agent_id")
parser.add_argument("capability")
parser.add_argument("--log", required=True)
parser.add_argument("--max", type=int, default=8)
parser.add_argument("--hb", type=float, default=0.1)
parser.add_argument("--delay", type=float, default=0.0)
parser.add_argument("--grace", type=float, default=30.0)
parser.add_argument("--creds", default=None, help="passed to reach_agent.run(creds=...)")
args = parser.parse_args()
logging.basicConfig(level=logging.WARNING, format=f"{args.agent_id} %(levelname)s %(message)s")

agent = reach_agent.Agent(
    args.agent_id, capabilities=[args.capability], max_concurrency=args.max,
    heartbeat_interval=args.hb, grace=args.grace,
)  # fmt: skip
log_fd = os.open(args.log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)


def note(line: str) -> None:
    os.write(log_fd, f"{line}\n".encode())  # one write(2) per line: atomic append


@agent.handler(args.capability)
async def work(task: reach_agent.Task) -> dict:
    note(f"start {task.request_id}")
    payload = task.payload or {}
    await asyncio.sleep(float(payload.get("sleep", args.delay)))
    note(f"done {task.request_id}")
    return {"agent": args.agent_id, "n": payload.get("n")}


reach_agent.run(agent, creds=args.creds)
