"""``python -m loadtest.caller``: the measuring side of ``loadtest.calls``, in its own process.

    python -m loadtest.caller --server URL

One NATS connection, shared by everything this process sends, so the four kinds of request
differ in what they do and in nothing else (client settings, loop, connection):

    raw      nc.request to the echo responder (``loadtest.driver echo-server``)
    js       a JetStream publish of ``JS_BYTES`` bytes to the file stream ``BENCH_JS``,
             awaiting its PubAck
    idem     reach_agent.Client.call on ``bench.idem`` (idempotent: no claim)
    claimed  reach_agent.Client.call on ``bench.claimed`` (a claim before the handler)

Commands on stdin, one JSON line each on stdout:

- ``run KIND CONCURRENCY CALLS SECONDS``: ``CONCURRENCY`` requests in flight until ``CALLS``
  were started or ``SECONDS`` passed; answers the slice's counts and figures (latency of
  the successful requests in µs, nearest rank; requests per second over the slice's wall
  time; errors by code).
- ``trace KIND N``: ``N`` sequential requests, each with its start and end on
  ``time.monotonic_ns()`` (one clock for every process of the machine), for the per-hop
  breakdown (:mod:`loadtest.hops`).
- ``quit``.

Prints ``ready`` once the client is started, the stream exists and both capabilities route.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import sys
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import nats
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js.api import DiscardPolicy, StorageType, StreamConfig

import reach_agent
from reach_agent.connection import connect_options

from .callagent import CLAIMED, IDEMPOTENT, emit
from .driver import ECHO_SUBJECT, percentile

KINDS = ("raw", "js", "idem", "claimed")
PAYLOAD = {"x": 1}
"""What every call carries (and the agent's handler returns)."""
PAYLOAD_BYTES = b'{"x":1}'
"""The same, as the raw request's body; the echo responder answers as many bytes."""
JS_STREAM = "BENCH_JS"
JS_SUBJECT = "loadtest.js.bench"
JS_BYTES = 200
JS_MAX_MSGS = 2_000_000
"""The stream keeps the newest this many (discard old): a bound on the store, not a limit
any run reaches."""
TIMEOUT_S = 10.0


def error_key(exc: BaseException) -> str:
    if isinstance(exc, reach_agent.ReachError):
        return exc.code
    if isinstance(exc, NatsTimeoutError | TimeoutError):
        return "timeout"
    return type(exc).__name__


class Caller:
    """The connection, the client and one request function per kind."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.nc: Any = None
        self.client: reach_agent.Client | None = None

    async def start(self) -> None:
        self.nc = await nats.connect(
            **connect_options("loadtest-caller", self.args.server, pending_size=64 * 1024 * 1024)
        )
        self.client = reach_agent.Client(nc=self.nc, name="loadtest-caller")
        await self.client.start()
        js = self.nc.jetstream()
        await js.add_stream(
            StreamConfig(
                name=JS_STREAM,
                subjects=[JS_SUBJECT],
                storage=StorageType.FILE,
                max_msgs=JS_MAX_MSGS,
                discard=DiscardPolicy.OLD,
                num_replicas=1,
            )
        )
        self.js = js
        deadline = time.monotonic() + self.args.route_wait
        for cap in (IDEMPOTENT, CLAIMED):
            while True:  # routable once a broker has the agent
                try:
                    await self.client.route(cap, limit=1)
                    break
                except reach_agent.ReachError:
                    if time.monotonic() > deadline:
                        raise
                    await asyncio.sleep(0.05)

    async def stop(self) -> None:
        if self.client is not None:
            with contextlib.suppress(Exception):
                await self.client.stop()
        if self.nc is not None:
            with contextlib.suppress(Exception):
                await self.nc.close()

    def request(self, kind: str, numbered: bool = False) -> Callable[[str], Awaitable[Any]]:
        """The one request of ``kind``, given its request id (``numbered``: a bare request's
        body is its id)."""
        nc, js, client = self.nc, self.js, self.client
        assert client is not None
        js_body = b"j" * JS_BYTES
        if kind == "raw" and numbered:
            return lambda rid: nc.request(ECHO_SUBJECT, rid.encode(), timeout=TIMEOUT_S)
        if kind == "raw":
            return lambda rid: nc.request(ECHO_SUBJECT, PAYLOAD_BYTES, timeout=TIMEOUT_S)
        if kind == "js":
            return lambda rid: js.publish(JS_SUBJECT, js_body, timeout=TIMEOUT_S)
        cap = {"idem": IDEMPOTENT, "claimed": CLAIMED}[kind]
        return lambda rid: client.call(cap, PAYLOAD, request_id=rid, timeout=TIMEOUT_S)

    async def run(self, kind: str, concurrency: int, calls: int, seconds: float) -> dict[str, Any]:
        send = self.request(kind)
        perf = time.perf_counter
        latencies: list[float] = []
        errors: dict[str, int] = {}
        started = 0
        deadline = perf() + seconds

        async def worker() -> None:
            nonlocal started
            while started < calls and perf() < deadline:
                started += 1
                rid = uuid.uuid4().hex
                t0 = perf()
                try:
                    await send(rid)
                except Exception as exc:
                    key = error_key(exc)
                    errors[key] = errors.get(key, 0) + 1
                    continue
                latencies.append(perf() - t0)

        t0 = perf()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = perf() - t0
        latencies.sort()

        def us(q: float) -> float | None:
            v = percentile(latencies, q)
            return None if v is None else round(v * 1e6, 1)

        return {
            "kind": kind,
            "concurrency": concurrency,
            "calls": started,
            "ok": len(latencies),
            "errors": errors,
            "seconds": round(wall, 4),
            "per_s": round(len(latencies) / wall, 1) if wall > 0 else 0.0,
            "p50_us": us(50),
            "p90_us": us(90),
            "p99_us": us(99),
            "max_us": round(latencies[-1] * 1e6, 1) if latencies else None,
        }

    async def trace(self, kind: str, n: int) -> dict[str, Any]:
        """``n`` sequential requests: [request id, start ns, end ns, error or None] each. A
        bare request's "request id" is its body, a number as long as the usual payload, so
        the wiretap can tell one from the next."""
        send = self.request(kind, numbered=kind == "raw")
        out: list[list[Any]] = []
        for i in range(n):
            rid = f"{i:0{len(PAYLOAD_BYTES)}d}" if kind == "raw" else uuid.uuid4().hex
            t0 = time.monotonic_ns()
            error = None
            try:
                await send(rid)
            except Exception as exc:
                error = error_key(exc)
            out.append([rid, t0, time.monotonic_ns(), error])
        return {"kind": kind, "calls": out}

    async def commands(self) -> None:
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader()
        await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
        while True:
            line = await reader.readline()
            words = line.decode().split()
            if not line or words[:1] == ["quit"]:
                return
            if not words:
                continue
            cmd, rest = words[0], words[1:]
            if cmd == "run" and len(rest) == 4 and rest[0] in KINDS:
                emit("run", **await self.run(rest[0], int(rest[1]), int(rest[2]), float(rest[3])))
            elif cmd == "trace" and len(rest) == 2 and rest[0] in KINDS:
                emit("trace", **await self.trace(rest[0], int(rest[1])))
            else:
                emit("error", message=f"cannot read command {line.decode().strip()!r}")

    async def main(self) -> None:
        try:
            await self.start()
            emit("ready", pid=os.getpid())
            await asyncio.wait_for(self.commands(), self.args.max_runtime)
        finally:
            await self.stop()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m loadtest.caller", description=__doc__.split("\n")[0]
    )
    p.add_argument("--server", required=True)
    p.add_argument(
        "--route-wait",
        type=float,
        default=30.0,
        help="how long to wait for both capabilities to route (s)",
    )
    p.add_argument("--max-runtime", type=float, default=3600.0)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    with contextlib.suppress(ImportError):
        import uvloop

        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    asyncio.run(Caller(args).main())


if __name__ == "__main__":
    main()
