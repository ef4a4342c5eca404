"""``python -m loadtest.gateway``: the A2A gateway's added latency against a direct
``Client.call()`` (needs the extra ``a2a``).

    python -m loadtest.gateway [--calls 400] [--rounds 6] [--concurrency 1,16] \
        [--report gateway.json]

One ``nats-server``, a broker with its A2A gateway, one agent and the callers, all in this
process on one uvloop loop. The agent's capability ``bench.echo`` answers its payload
(marked idempotent, so no claim: the figure is the gateway's own cost, not the claim's).
Rounds alternate three ways of making the same call, ``--calls`` each, with every
concurrency in ``--concurrency``: ``direct`` (``reach_agent.Client.call``), ``a2a`` (an A2A
1.0 ``SendMessage`` JSON-RPC request to ``/a2a/bench.echo`` over a minimal keep-alive HTTP
client, :class:`Wire`: the gateway's own cost) and ``a2a_sdk`` (the a2a-sdk's own client,
non-streaming, over httpx: what a Python A2A caller sees); and, for scale, ``http_floor``:
the minimal client's bare round trip to the same server (a GET answered 404 by the
gateway's app without touching NATS), what HTTP through uvicorn alone costs here. The
figures are medians over rounds of each round's median latency and its calls per second,
and the ratios against ``direct``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import uvloop

import reach_agent
from reach_broker.broker import Broker
from reach_broker.config import A2ASection

from .local import local_stack

CAP = "bench.echo"


async def rounds_of(
    call: Callable[[], Awaitable[Any]], n: int, concurrency: int
) -> dict[str, float]:
    """``n`` calls, ``concurrency`` in flight: median latency (µs) and calls per second."""
    latencies: list[float] = []
    todo = iter(range(n))

    async def caller() -> None:
        for _ in todo:
            t0 = time.perf_counter()
            await call()
            latencies.append(time.perf_counter() - t0)

    t0 = time.perf_counter()
    await asyncio.gather(*(caller() for _ in range(concurrency)))
    wall = time.perf_counter() - t0
    return {"median_us": statistics.median(latencies) * 1e6, "per_s": n / wall}


class Wire:
    """A minimal HTTP/1.1 keep-alive client (one connection per caller in flight): the
    gateway's cost without a Python HTTP client's own (httpx costs about as much as the
    server here)."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []

    async def request(self, method: str, path: str, body: bytes = b"") -> tuple[int, bytes]:
        while self.idle:  # a kept connection, unless the server closed it while idle
            conn = self.idle.pop()
            try:
                return await self._exchange(conn, method, path, body)
            except (asyncio.IncompleteReadError, ConnectionError):
                conn[1].close()
        conn = await asyncio.open_connection(self.host, self.port)
        return await self._exchange(conn, method, path, body)

    async def _exchange(
        self, conn: tuple[asyncio.StreamReader, asyncio.StreamWriter], method: str, path: str,
        body: bytes,
    ) -> tuple[int, bytes]:  # fmt: skip
        reader, writer = conn
        writer.write(
            f"{method} {path} HTTP/1.1\r\nHost: {self.host}\r\nA2A-Version: 1.0\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        head = await reader.readuntil(b"\r\n\r\n")
        status = int(head[9:12])
        length = 0
        for line in head.split(b"\r\n")[1:]:
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value)
        data = await reader.readexactly(length)
        self.idle.append(conn)
        return status, data

    def close(self) -> None:
        for _, writer in self.idle:
            writer.close()


async def run(args: argparse.Namespace) -> dict[str, Any]:
    import httpx
    from a2a.client import ClientConfig, ClientFactory
    from a2a.types import a2a_pb2 as pb

    from reach_broker.interop.a2a.gateway import A2AGateway

    with local_stack("reach-gateway-") as (tmp, server, cfg):
        agent = reach_agent.Agent("bench-agent", [CAP], max_concurrency=256,
                                  heartbeat_interval=1.0, idempotent={CAP})  # fmt: skip
        agent.ack_wal_dir = str(Path(tmp) / "acks")

        @agent.handler(CAP)
        async def echo(task: reach_agent.Task) -> Any:
            return task.payload

        async with Broker(cfg) as broker:
            gateway = A2AGateway(
                A2ASection(port=0), nc=broker.nc, subjects=broker.subjects,
                registry=broker.registry, router=broker.router, clock=broker.clock,
                replicas=broker.replicas, wall=broker.wall,
            )  # fmt: skip
            async with (
                gateway,
                agent.serve(server.url),
                reach_agent.Client(server.url) as client,
                httpx.AsyncClient(timeout=30, headers={"A2A-Version": "1.0"}) as http,
            ):
                for _ in range(200):  # routable once the broker has it
                    try:
                        await client.route(CAP, limit=1)
                        break
                    except reach_agent.ReachError:
                        await asyncio.sleep(0.05)
                url = f"{gateway.url}/a2a/{CAP}"
                card_json = await http.get(f"{gateway.url}/.well-known/agent-card.json")
                from a2a.client.card_resolver import parse_agent_card

                card = parse_agent_card(card_json.json())
                card.supported_interfaces[0].url = url
                sdk = ClientFactory(ClientConfig(streaming=False, httpx_client=http)).create(card)

                async def direct() -> None:
                    await client.call(CAP, {"text": "hi"}, timeout=30)

                wire = Wire("127.0.0.1", gateway.port)
                path = f"/a2a/{CAP}"

                async def a2a() -> None:
                    body = {"jsonrpc": "2.0", "id": 1, "method": "SendMessage", "params": {
                        "message": {"messageId": str(uuid.uuid4()), "role": "ROLE_USER",
                                    "parts": [{"text": "hi"}]}}}  # fmt: skip
                    status, data = await wire.request("POST", path, json.dumps(body).encode())
                    assert status == 200 and b'"result"' in data, data

                async def a2a_sdk() -> None:
                    msg = pb.Message(message_id=str(uuid.uuid4()), role=pb.ROLE_USER,
                                     parts=[pb.Part(text="hi")])  # fmt: skip
                    async for _ in sdk.send_message(pb.SendMessageRequest(message=msg)):
                        pass

                floor = "/agents/nobody/.well-known/agent-card.json"

                async def http_floor() -> None:
                    status, _ = await wire.request("GET", floor)
                    assert status == 404

                ways = {"direct": direct, "a2a": a2a, "a2a_sdk": a2a_sdk,
                        "http_floor": http_floor}  # fmt: skip
                for way in ways.values():  # warm-up
                    await rounds_of(way, 50, 4)
                per_conc: dict[str, dict[str, list[dict[str, float]]]] = {}
                for conc in args.concurrency:
                    per = per_conc.setdefault(str(conc), {k: [] for k in ways})
                    for _ in range(args.rounds):
                        for name, way in ways.items():
                            per[name].append(await rounds_of(way, args.calls, conc))
                wire.close()
    out: dict[str, Any] = {"calls_per_round": args.calls, "rounds": args.rounds}
    for conc, per in per_conc.items():
        med = {k: statistics.median(r["median_us"] for r in v) for k, v in per.items()}
        rate = {k: statistics.median(r["per_s"] for r in v) for k, v in per.items()}
        out[f"concurrency_{conc}"] = {
            "latency_us": med,
            "calls_per_s": rate,
            "latency_ratio": {k: med[k] / med["direct"] for k in ("a2a", "a2a_sdk")},
            "added_us_per_call": {k: med[k] - med["direct"] for k in ("a2a", "a2a_sdk")},
            "throughput_ratio": {k: rate[k] / rate["direct"] for k in ("a2a", "a2a_sdk")},
        }
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtest.gateway", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--calls", type=int, default=400, help="calls per round and way")
    p.add_argument("--rounds", type=int, default=6, help="alternated rounds per concurrency")
    p.add_argument("--concurrency", default="1,16", help="comma-separated calls in flight")
    p.add_argument("--report", default=None, help="write the figures as JSON here")
    args = p.parse_args(argv)
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    figures = uvloop.run(run(args))
    text = json.dumps(figures, indent=2)
    print(text)
    if args.report:
        Path(args.report).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
