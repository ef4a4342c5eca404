"""Request load: route requests against the broker, or the same load against a raw echo.

``python -m loadtest.driver route|echo --server URL --concurrency C --duration S`` runs ``C``
requesters on one connection, each awaiting ``nc.request`` in a loop, warms up, measures
for ``S`` seconds and prints one JSON line: requests, errors, requests/s, p50/p90/p99/max in
ms. ``route`` and ``echo`` share every client setting; only the subject differs, so the
ratio of the two is the broker's cost on top of NATS request-reply itself. Route requests
are peeks (``{"peek": true}``): no task follows them, so the broker must not count them as
tasks handed out (it would believe the simulated fleet full within a second).

``python -m loadtest.driver echo-server`` is the trivial responder the ``echo`` mode talks
to: a plain subscription (queue group) that answers every request with a fixed body of
``--reply-bytes`` (the size of a typical route reply).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import signal
import sys
import time
from typing import Any

import nats
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError

from reach_agent.connection import connect_options
from reach_agent.wire import schema
from reach_agent.wire.errors import H_SERVICE_ERROR_CODE
from reach_agent.wire.subjects import Subjects

ECHO_SUBJECT = "loadtest.echo"
PEEK_BODY = schema.encoder.encode(schema.RouteRequest(peek=True)).decode()
"""The route body the driver sends by default: every default, as a peek."""
"""The echo responder's own subject (not part of the wire contract)."""


def percentile(sorted_values: list[float], q: float) -> float | None:
    """Nearest-rank percentile of an ascending list (``q`` in [0, 100])."""
    if not sorted_values:
        return None
    k = max(0, min(len(sorted_values) - 1, round(q / 100.0 * len(sorted_values) + 0.5) - 1))
    return sorted_values[k]


def client_options(server: str, name: str = "loadtest-driver") -> dict[str, Any]:
    """The connection settings of both modes (the comparison depends on their being equal):
    no reconnect (a slice that loses its server fails), large buffers."""
    return connect_options(
        name,
        server,
        allow_reconnect=False,
        max_reconnect_attempts=0,
        pending_size=64 * 1024 * 1024,
        flusher_queue_size=65536,
    )


async def run_load(args: argparse.Namespace) -> dict[str, Any]:
    nc = await nats.connect(**client_options(args.server))
    if args.mode == "route":
        caps = args.capability or ["loadtest.cap0"]
        subjects = [Subjects(args.prefix).route(c) for c in caps]
    else:
        subjects = [ECHO_SUBJECT]
    body = args.body.encode()
    latencies: list[float] = []
    errors: dict[str, int] = {}
    measuring = False
    stop = False
    timeout = args.timeout

    async def requester(k: int) -> None:
        n = len(subjects)
        i = k
        perf = time.perf_counter
        while not stop:
            subject = subjects[i % n]
            i += 1
            t0 = perf()
            try:
                msg = await nc.request(subject, body, timeout=timeout)
                dt = perf() - t0
                if msg.headers and H_SERVICE_ERROR_CODE in msg.headers:
                    key = "status_" + msg.headers[H_SERVICE_ERROR_CODE]
                else:
                    if measuring:
                        latencies.append(dt)
                    continue
            except NatsTimeoutError:
                key = "timeout"
            except NoRespondersError:
                key = "no_responders"
                await asyncio.sleep(0.01)
            except Exception as exc:
                key = type(exc).__name__
                await asyncio.sleep(0.01)
            if measuring:
                errors[key] = errors.get(key, 0) + 1

    tasks = [asyncio.create_task(requester(k)) for k in range(args.concurrency)]
    try:
        await asyncio.sleep(args.warmup)
        measuring = True
        t0 = time.perf_counter()
        await asyncio.sleep(args.duration)
        measuring = False
        elapsed = time.perf_counter() - t0
        stop = True
        await asyncio.wait(tasks, timeout=timeout + 1.0)
    finally:
        stop = True
        for t in tasks:
            t.cancel()
        with contextlib.suppress(Exception):
            await nc.close()
    latencies.sort()
    ok = len(latencies)

    def ms(v: float | None) -> float | None:
        return None if v is None else round(v * 1000.0, 3)

    return {
        "mode": args.mode,
        "concurrency": args.concurrency,
        "seconds": round(elapsed, 3),
        "ok": ok,
        "errors": errors,
        "per_s": round(ok / elapsed, 1) if elapsed > 0 else 0.0,
        "p50_ms": ms(percentile(latencies, 50)),
        "p90_ms": ms(percentile(latencies, 90)),
        "p99_ms": ms(percentile(latencies, 99)),
        "max_ms": ms(latencies[-1] if latencies else None),
    }


async def echo_server(args: argparse.Namespace) -> None:
    nc = await nats.connect(**client_options(args.server, "loadtest-echo"))
    reply = b"x" * args.reply_bytes

    async def cb(msg: Any) -> None:
        await nc.publish(msg.reply, reply)

    await nc.subscribe(ECHO_SUBJECT, queue="loadtest-echo", cb=cb,
                       pending_msgs_limit=1_000_000)  # fmt: skip
    await nc.flush()
    sys.stdout.write(json.dumps({"event": "ready"}) + "\n")
    sys.stdout.flush()
    loop = asyncio.get_running_loop()
    done = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, done.set)
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(done.wait(), args.max_runtime)
    await nc.close()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m loadtest.driver", description=__doc__.split("\n")[0]
    )
    p.add_argument("mode", choices=["route", "echo", "echo-server"])
    p.add_argument("--server", required=True)
    p.add_argument("--prefix", default="reach")
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--duration", type=float, default=10.0)
    p.add_argument("--warmup", type=float, default=1.0)
    p.add_argument("--timeout", type=float, default=2.0, help="per request (s)")
    p.add_argument("--capability", action="append", help="route these (round robin)")
    p.add_argument(
        "--body",
        default=PEEK_BODY,
        help="request body (default: a peek with every route default: the driver sends no "
        "tasks, so its routes must not count as tasks handed out; '' counts them)",
    )
    p.add_argument("--reply-bytes", type=int, default=400, help="echo-server reply size")
    p.add_argument("--max-runtime", type=float, default=600.0, help="echo-server lifetime (s)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    with contextlib.suppress(ImportError):
        import uvloop

        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    if args.mode == "echo-server":
        asyncio.run(echo_server(args))
        return
    result = asyncio.run(run_load(args))
    sys.stdout.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
