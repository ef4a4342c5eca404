"""A test agent process: logs every handler start to a file, sleeps, answers.

    python worker.py AGENT_ID CAPABILITY --log FILE [--max N] [--hb S] [--delay S]
                     [--creds FILE] [--stream] [--hint S] [--idempotent] [--stall S]

Each handler start appends ``start <request_id>`` to ``--log`` and each finish appends
``done <request_id>`` (flushed at once, so a SIGKILL loses nothing written). The payload
may carry ``sleep`` (seconds, overrides ``--delay``) and ``n`` (echoed back). With
``--stream`` the handler is an async generator yielding ``chunks`` (payload, default 10)
strings ``"<i>,"``, one every ``sleep`` seconds. ``--stall S`` blocks the event loop for
S seconds right before the first receipt goes out (an agent that stalls after claiming).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import time
from collections.abc import AsyncIterator

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
parser.add_argument("--stream", action="store_true")
parser.add_argument("--hint", type=float, default=None)
parser.add_argument("--idempotent", action="store_true")
parser.add_argument("--stall", type=float, default=0.0)
args = parser.parse_args()
logging.basicConfig(level=logging.WARNING, format=f"{args.agent_id} %(levelname)s %(message)s")

agent = reach_agent.Agent(
    args.agent_id, capabilities=[args.capability], max_concurrency=args.max,
    heartbeat_interval=args.hb, grace=args.grace, timeout_hint=args.hint,
    idempotent=[args.capability] if args.idempotent else [],
)  # fmt: skip
log_fd = os.open(args.log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)


def note(line: str) -> None:
    os.write(log_fd, f"{line}\n".encode())  # one write(2) per line: atomic append


async def work(task: reach_agent.Task) -> dict:
    note(f"start {task.request_id}")
    payload = task.payload or {}
    await asyncio.sleep(float(payload.get("sleep", args.delay)))
    note(f"done {task.request_id}")
    return {"agent": args.agent_id, "n": payload.get("n")}


async def stream(task: reach_agent.Task) -> AsyncIterator[str]:
    note(f"start {task.request_id}")
    payload = task.payload or {}
    pause = float(payload.get("sleep", args.delay))
    for i in range(int(payload.get("chunks", 10))):
        await asyncio.sleep(pause)
        yield f"{i},"
    note(f"done {task.request_id}")


agent.handler(args.capability)(stream if args.stream else work)

if args.stall:
    receipt = agent.tasks._send_receipt
    stalled: list[bool] = []

    async def stall_then_receipt(reply: str, request_id: str) -> None:
        if not stalled:
            stalled.append(True)
            note(f"stall {request_id}")
            time.sleep(args.stall)  # noqa: ASYNC251 - the whole event loop stops: a real stall
        await receipt(reply, request_id)

    agent.tasks._send_receipt = stall_then_receipt  # type: ignore[method-assign]


reach_agent.run(agent, creds=args.creds)
