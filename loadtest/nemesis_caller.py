"""One caller of ``loadtest.nemesis``: ``Client.call`` and ``Client.submit`` without pause,
each with a request id of its own, every operation written down.

    python -m loadtest.nemesis_caller --name c1 --servers URL,URL,URL --log c1.jsonl \
        [--seed 7] [--concurrency 4] [--submit-share 0.2] [--repeat-share 0.1] \
        [--call-timeout 10]

``--concurrency`` workers each issue one operation after another: a call (request id
``<name>-<n>``, payload ``{"ms": …, "reject"?: true}`` drawn from ``--seed``), with
probability ``--submit-share`` a submit to the compensation queue instead (and, aside, a
``wait`` for its final record, up to ``--wait-timeout``), and with
probability ``--repeat-share`` a call of one of its earlier request ids again, whatever
became of it (op ``repeat``, the same payload). Each operation is two
JSON lines in ``--log`` (one ``write`` each, ``t`` in Unix time):

    {"ev": "invoke", "op": …, "rid": …, "t": …}
    {"ev": "ok", "op": …, "rid": …, "t": …, …}   or   {"ev": "fail", …, "code": …}

Prints ``{"event": "ready"}`` once connected. The line ``finish SECONDS`` on stdin ends the
run within about that long: no new operation; the workers' last ones end; every call whose
last answer was not final (``TIMEOUT``, ``NO_REACHABLE_AGENT``, … — the caller gave up, as
the delivery guarantee allows) is sent again with the same request id and payload (op
``recall``) until it is; every submit whose enqueue is not known to have been stored is
sent again (op ``resubmit``; the queue's duplicate window makes that safe); then each queued
task whose final ack record was not read yet is read with ``Client.wait`` (op ``wait``).
Then it prints
``{"event": "finish", …}`` with its counts and exits.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import random
import sys
import time
from typing import Any

from reach_agent import Client, ReachError
from reach_agent.agent.runner import default_logging

from .history import FINAL_CODES, REFUSED_CODES
from .nemesis_agent import CAPABILITY, RunLog


class Caller:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.log = RunLog(args.log)
        self.rng = random.Random(f"{args.seed}/{args.name}")
        self.client = Client(args.servers.split(","), name=f"nemesis-{args.name}")
        self.payloads: dict[str, dict[str, Any]] = {}
        self.issued: list[str] = []
        """Every request id issued, in order (a repeat draws one)."""
        self.calls: dict[str, bool] = {}
        """Request id of each call → whether its last answer was final."""
        self.submits: dict[str, bool | None] = {}
        """Request id of each submit → stored (True), refused (False), unknown (None)."""
        self.waited: set[str] = set()
        """Submitted request ids whose final record ``wait`` read."""
        self._waits: set[asyncio.Task[None]] = set()
        self.stopping = False
        self._numbers = itertools.count(1)

    def payload(self) -> dict[str, Any]:
        r = self.rng.random()
        ms = self.rng.uniform(20, 300) if r < 0.7 else self.rng.uniform(300, 1500)
        if r > 0.95:
            ms = self.rng.uniform(1500, 4000)
        body: dict[str, Any] = {"ms": round(ms)}
        if self.rng.random() < 0.03:
            body["reject"] = True
        return body

    async def call(self, rid: str, op: str, *, final: bool = True) -> None:
        """Call ``rid``; ``final``: its answer decides whether the call is resolved (a
        repeat of an earlier request id decides nothing)."""
        self.log.write(ev="invoke", op=op, rid=rid)
        if not final:
            await self._call(rid, op)
            return
        self.calls[rid] = await self._call(rid, op)

    async def _call(self, rid: str, op: str) -> bool:
        """One call; whether its answer was final."""
        try:
            result = await self.client.call(
                CAPABILITY, self.payloads[rid], timeout=self.args.call_timeout, request_id=rid
            )
        except ReachError as err:
            self.log.write(ev="fail", op=op, rid=rid, code=err.code, message=str(err)[:200])
            return err.code in FINAL_CODES
        except Exception as exc:  # the caller's view: it gave up, not knowing the fate
            self.log.write(ev="fail", op=op, rid=rid, code="EXCEPTION",
                           message=f"{type(exc).__name__}: {exc}"[:200])  # fmt: skip
            return False
        self.log.write(ev="ok", op=op, rid=rid, agent=result.get("agent"), run=result.get("run"))
        return True

    async def submit(self, rid: str, op: str) -> None:
        self.log.write(ev="invoke", op=op, rid=rid)
        try:
            got = await self.client.submit(CAPABILITY, self.payloads[rid], request_id=rid)
        except ReachError as err:
            self.log.write(ev="fail", op=op, rid=rid, code=err.code, message=str(err)[:200])
            self.submits[rid] = False if err.code in REFUSED_CODES else None
            return
        except Exception as exc:
            self.log.write(ev="fail", op=op, rid=rid, code="EXCEPTION",
                           message=f"{type(exc).__name__}: {exc}"[:200])  # fmt: skip
            self.submits[rid] = None
            return
        self.log.write(ev="ok", op=op, rid=rid, duplicate=bool(getattr(got, "duplicate", False)))
        self.submits[rid] = True

    async def wait(self, rid: str, timeout: float) -> None:  # noqa: ASYNC109
        """Read a submitted task's final record (``Client.wait``)."""
        self.log.write(ev="invoke", op="wait", rid=rid)
        try:
            rec = await self.client.wait(rid, timeout=max(timeout, 0.1))
        except ReachError as err:
            self.log.write(ev="fail", op="wait", rid=rid, code=err.code, message=str(err)[:200])
            return
        except Exception as exc:
            self.log.write(ev="fail", op="wait", rid=rid, code="EXCEPTION",
                           message=f"{type(exc).__name__}: {exc}"[:200])  # fmt: skip
            return
        result = rec.result if isinstance(rec.result, dict) else {}
        self.log.write(ev="ok", op="wait", rid=rid, state=rec.state, agent=rec.agent_id,
                       run=result.get("run"), code=(rec.error or {}).get("code"))  # fmt: skip
        self.waited.add(rid)

    async def worker(self) -> None:
        while not self.stopping:
            draw = self.rng.random()
            if draw < self.args.repeat_share and self.payloads:
                # An earlier request id again, whatever became of it: it must never run
                # a second time (the delivery guarantee), and its answer is its first run's.
                rid = self.issued[self.rng.randrange(len(self.issued))]
                await self.call(rid, "repeat", final=False)
                continue
            rid = f"{self.args.name}-{next(self._numbers):06d}"
            self.payloads[rid] = self.payload()
            self.issued.append(rid)
            if draw < self.args.repeat_share + self.args.submit_share:
                await self.submit(rid, "submit")
                if self.submits[rid]:  # as a caller would: wait for it (bounded), aside
                    task = asyncio.create_task(self.wait(rid, self.args.wait_timeout))
                    self._waits.add(task)
                    task.add_done_callback(self._waits.discard)
            else:
                await self.call(rid, "call")

    async def finish(self, workers: list[asyncio.Task[None]], seconds: float) -> dict[str, Any]:
        """Stop, then resolve what the run left open, within ``seconds``."""
        deadline = time.monotonic() + seconds
        self.stopping = True
        await asyncio.gather(*workers)
        await asyncio.gather(*self._waits)  # each bounded by --wait-timeout
        gate = asyncio.Semaphore(16)

        async def bounded(coro: Any) -> None:
            async with gate:
                await coro

        while time.monotonic() < deadline - self.args.call_timeout:
            open_calls = [rid for rid, final in self.calls.items() if not final]
            open_submits = [rid for rid, stored in self.submits.items() if stored is None]
            if not open_calls and not open_submits:
                break
            await asyncio.gather(*(bounded(self.call(rid, "recall")) for rid in open_calls),
                                 *(bounded(self.submit(rid, "resubmit"))
                                   for rid in open_submits))  # fmt: skip
            await asyncio.sleep(0.5)
        queued = [rid for rid, stored in self.submits.items() if stored and rid not in self.waited]
        left = max(deadline - time.monotonic(), 1.0)
        await asyncio.gather(*(bounded(self.wait(rid, left)) for rid in queued))
        return {
            "event": "finish",
            "calls": len(self.calls),
            "calls_open": sum(not final for final in self.calls.values()),
            "submits": len(self.submits),
            "submits_open": sum(stored is None for stored in self.submits.values()),
        }


async def run(args: argparse.Namespace) -> None:
    caller = Caller(args)
    await caller.client.start()
    loop = asyncio.get_running_loop()
    stdin = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(stdin), sys.stdin)
    workers = [asyncio.create_task(caller.worker()) for _ in range(args.concurrency)]
    print(json.dumps({"event": "ready"}), flush=True)
    try:
        seconds = 60.0
        while line := (await stdin.readline()).decode():
            words = line.split()
            if words and words[0] == "finish":
                seconds = float(words[1]) if len(words) > 1 else seconds
                break
        print(json.dumps(await caller.finish(workers, seconds)), flush=True)
    finally:
        caller.stopping = True
        await caller.client.stop()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m loadtest.nemesis_caller",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--name", required=True)
    ap.add_argument("--servers", required=True, help="comma-separated NATS URLs")
    ap.add_argument("--log", required=True, help="the operations' log (JSON lines)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--submit-share", type=float, default=0.2)
    ap.add_argument("--repeat-share", type=float, default=0.1)
    ap.add_argument("--call-timeout", type=float, default=10.0)
    ap.add_argument(
        "--wait-timeout",
        type=float,
        default=30.0,
        help="seconds a worker waits for its submitted task's record (30)",
    )
    args = ap.parse_args(argv)
    default_logging()  # the client's lines (a result read from the store, ...) to its log
    asyncio.run(run(args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
