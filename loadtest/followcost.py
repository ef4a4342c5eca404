"""``python -m loadtest.followcost``: what a follow costs per message, ours against nats-py's.

The broker follows KV ``reach_claims`` (a message per claim written: two or more per task
call), ``reach_rules`` and the audit trail. :class:`jetstream.follow.Follower` replaced
nats-py's ordered consumer there (which could not rebuild a follow started from a time).
This has both read the same stored claims, on one embedded nats-server (the follower from a
start time, the ordered consumer from the sequence that time stands for):

- timed (default): ``--messages`` claims, ``--rounds`` rounds alternating the two in one
  process; the client's CPU time per message (``time.process_time``: what the broker pays)
  and the wall time, each the best round's; ``ratio_*`` is follower / ordered consumer;
- ``--callgrind``: instructions per message instead, which a noisy machine does not move
  (valgrind's callgrind on a child process that only follows; nats-server outside it): each
  kind reads ``--messages`` and ``4 x --messages`` claims, and the difference over
  ``3 x --messages`` is one message's instructions.

    python -m loadtest.followcost --messages 20000 --rounds 7
    python -m loadtest.followcost --callgrind --messages 5000
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import nats
from nats.aio.client import Client as NATS
from nats.js import api

from jetstream.follow import Follower, Start
from jetstream.names import CLAIMS_STREAM
from jetstream.provision import load_definitions, provision
from reach_broker.cluster.natsserver import NatsServer

ROOT = Path(__file__).resolve().parent.parent
PRE = "$KV.reach_claims."
CLAIM = json.dumps({"request_id": "r", "agent_id": "agent-0001", "instance": "0123456789ab",
                    "capability": "summarize", "state": "running",
                    "at_ms": 1_700_000_000_000}).encode()  # fmt: skip
KINDS = ("ordered", "follower")
HEARTBEAT_S = 30.0
"""Both follows' idle heartbeat. Long: no heartbeat is sent while messages flow anyway, and
under valgrind a follow can go seconds without handling a message, which with a short one
has the follower rebuild its consumer and nats-py's ordered consumer re-create its own
(costs that are not per message)."""

Stop = Callable[[], Awaitable[None]]
Run = Callable[[NATS, str, float, Callable[[Any], Awaitable[None]]], Awaitable[Stop]]


async def fill(nc: NATS, group: str, messages: int) -> None:
    """Store ``messages`` claims under ``$KV.reach_claims.<group>.``."""
    js = nc.jetstream()
    for i in range(0, messages, 500):
        batch = range(i, min(i + 500, messages))
        await asyncio.gather(*(js.publish(f"{PRE}{group}.k{j}", CLAIM) for j in batch))


async def ordered(nc: NATS, subject: str, since: float, cb: Any) -> Stop:
    """nats-py's ordered consumer, as ``claims.follow`` used it before the follower: from a
    start sequence (the start time turned into one beforehand, as it was then; the stream
    holds nothing older than ``since``, so 1). Never from the time itself: its reset would
    ask for both, which the server refuses (10094), and it would never deliver again (seen
    here under valgrind on a loaded machine)."""
    config = api.ConsumerConfig(deliver_policy=api.DeliverPolicy.BY_START_SEQUENCE,
                                opt_start_seq=1)  # fmt: skip
    sub = await nc.jetstream().subscribe(subject, stream=CLAIMS_STREAM, cb=cb,
                                         ordered_consumer=True, config=config,
                                         idle_heartbeat=HEARTBEAT_S,
                                         pending_msgs_limit=1_000_000)  # fmt: skip
    return sub.unsubscribe


async def follower(nc: NATS, subject: str, since: float, cb: Any) -> Stop:
    f = Follower(nc, cb, name="cost", stream=CLAIMS_STREAM, subject=subject,
                 start=Start.at_time(since), heartbeat_s=HEARTBEAT_S)  # fmt: skip
    await f.start()
    return f.stop


RUNS: dict[str, Run] = {"ordered": ordered, "follower": follower}


async def timed(nc: NATS, run: Run, subject: str, since: float,
                messages: int) -> tuple[float, float]:  # fmt: skip
    """(CPU, wall) seconds for ``run`` to hand ``messages`` messages to a callback that reads
    each one's metadata (as every caller does)."""
    seen = 0
    done = asyncio.Event()

    async def cb(msg: Any) -> None:
        nonlocal seen
        msg.metadata  # noqa: B018 - what every caller reads
        seen += 1
        if seen == messages:
            done.set()

    cpu, wall = time.process_time(), time.perf_counter()
    stop = await run(nc, subject, since, cb)
    await asyncio.wait_for(done.wait(), 600)
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    await stop()
    return cpu, wall


async def server_with(groups: dict[str, int], tmp: str) -> tuple[NatsServer, float]:
    """A started server whose claims stream holds ``groups`` (group → claims); the time
    just before the first was stored."""
    server = NatsServer(port=0, store_dir=tmp)
    await asyncio.to_thread(server.start)
    nc = await nats.connect(server.url, name="followcost-fill")
    try:
        await provision(nc, [d for d in load_definitions() if d["name"] == CLAIMS_STREAM])
        since = time.time() - 1
        for group, n in groups.items():
            await fill(nc, group, n)
    finally:
        await nc.close()
    return server, since


async def compare(messages: int, rounds: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="followcost-") as tmp:
        server, since = await server_with({"a": messages}, tmp)
        try:
            nc = await nats.connect(server.url, name="followcost")
            try:
                best: dict[str, tuple[float, float]] = {}
                for r in range(rounds):
                    for kind in KINDS if r % 2 == 0 else KINDS[::-1]:
                        cpu, wall = await timed(nc, RUNS[kind], PRE + "a.>", since, messages)
                        old = best.get(kind)
                        best[kind] = (min(cpu, old[0]), min(wall, old[1])) if old else (cpu, wall)
            finally:
                await nc.close()
        finally:
            await asyncio.to_thread(server.stop)
    us = {k: (v[0] / messages * 1e6, v[1] / messages * 1e6) for k, v in best.items()}
    return {
        "messages": messages, "rounds": rounds,
        "cpu_us_per_msg": {k: round(v[0], 2) for k, v in us.items()},
        "wall_us_per_msg": {k: round(v[1], 2) for k, v in us.items()},
        "ratio_cpu": round(us["follower"][0] / us["ordered"][0], 3),
        "ratio_wall": round(us["follower"][1] / us["ordered"][1], 3),
    }  # fmt: skip


async def child(url: str, kind: str, subject: str, since: float, messages: int) -> None:
    """One follow under valgrind: connect, read ``messages`` claims, leave."""
    nc = await nats.connect(url, name=f"followcost-{kind}")
    try:
        await timed(nc, RUNS[kind], subject, since, messages)
    finally:
        # Under valgrind nats-py's close sometimes ends in a CancelledError from its own
        # transport (seen after the ordered consumer): the count is taken by then.
        with contextlib.suppress(Exception, asyncio.CancelledError):
            await nc.close()


def instructions(url: str, kind: str, group: str, since: float, messages: int,
                 out: Path) -> int:  # fmt: skip
    """The instructions (callgrind's ``Ir``) of one child reading ``messages`` claims."""
    proc = subprocess.run(
        ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", sys.executable, "-m",
         "loadtest.followcost", "--child", kind, "--url", url, "--subject", f"{PRE}{group}.>",
         "--since", repr(since), "--messages", str(messages)],
        cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)), capture_output=True, text=True,
        timeout=3600,
    )  # fmt: skip
    if proc.returncode != 0:
        raise RuntimeError(f"the {kind} child failed: {proc.stderr[-2000:]}")
    for line in out.read_text().splitlines():
        if line.startswith(("totals:", "summary:")):
            return int(line.split()[1])
    raise RuntimeError(f"no totals in {out}")


async def count(messages: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="followcost-") as tmp:
        server, since = await server_with({"few": messages, "many": 4 * messages}, tmp)
        try:
            per: dict[str, float] = {}
            for kind in KINDS:
                ir = {}
                for group, n in (("few", messages), ("many", 4 * messages)):
                    out = Path(tmp) / f"{kind}-{group}.callgrind"
                    ir[group] = await asyncio.to_thread(instructions, server.url, kind, group,
                                                        since, n, out)  # fmt: skip
                per[kind] = (ir["many"] - ir["few"]) / (3 * messages)
        finally:
            await asyncio.to_thread(server.stop)
    return {
        "messages": messages,
        "instructions_per_msg": {k: round(v) for k, v in per.items()},
        "ratio_instructions": round(per["follower"] / per["ordered"], 4),
    }


def cli() -> None:
    p = argparse.ArgumentParser(prog="python -m loadtest.followcost", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--messages", type=int, default=20_000)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--callgrind", action="store_true", help="count instructions (valgrind)")
    p.add_argument("--child", choices=KINDS, help=argparse.SUPPRESS)
    p.add_argument("--url", help=argparse.SUPPRESS)
    p.add_argument("--subject", help=argparse.SUPPRESS)
    p.add_argument("--since", type=float, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        asyncio.run(child(args.url, args.child, args.subject, args.since, args.messages))
        return
    if args.callgrind:
        result = asyncio.run(count(args.messages))
    else:
        result = asyncio.run(compare(args.messages, args.rounds))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    cli()
