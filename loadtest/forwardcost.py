"""``python -m loadtest.forwardcost``: what a forwarded route request costs against one a
broker answers itself (issue 24: one owner per capability).

    python -m loadtest.forwardcost [--seconds 2] [--rounds 6] [--concurrency 16]

Two ``nats-server``s (JetStream), in this process a deployment on each:

- ``direct``: one broker; every route request is answered by it;
- ``forwarded``: two brokers, the first owning every partition (started first: it took every
  lease), the second owning none and alone in the route endpoint's queue group (the first's
  route endpoint is stopped): every request reaches the second, which forwards it to the
  first on ``<p>.forward.<owner>.<capability>`` and relays the answer — the worst case (with
  N brokers sharing partitions evenly, (N-1)/N of the requests are forwarded).

Each deployment has one agent of the capability; ``--concurrency`` requesters send route
requests (``peek``: no hand-out, the same reply each time) for ``--seconds``, the two
deployments alternated ``--rounds`` times. Printed: requests a second of each (the best
round's), ``forwarded_over_direct`` (the throughput ratio) and the median latencies of one
requester.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

import nats
import uvloop

import reach_agent
from reach_agent.wire import schema
from reach_broker.broker import Broker
from reach_broker.config import Config
from reach_broker.service.metrics import Metrics

from .local import local_stack

CAP = "forwardcost.cap"
PEEK = schema.encoder.encode(schema.RouteRequest(peek=True))


async def rate(nc: nats.NATS, subject: str, seconds: float, concurrency: int) -> float:
    """Route requests answered a second by ``concurrency`` requesters over ``seconds``."""
    done = 0
    stop = time.monotonic() + seconds

    async def one() -> None:
        nonlocal done
        while time.monotonic() < stop:
            msg = await nc.request(subject, PEEK, timeout=5)
            assert not msg.headers, msg.headers  # an answer, not an error
            done += 1

    t0 = time.monotonic()
    await asyncio.gather(*(one() for _ in range(concurrency)))
    return done / (time.monotonic() - t0)


async def latency_ms(nc: nats.NATS, subject: str, n: int = 300) -> float:
    took = []
    for _ in range(n):
        t0 = time.perf_counter()
        await nc.request(subject, PEEK, timeout=5)
        took.append((time.perf_counter() - t0) * 1000)
    return statistics.median(took)


async def run(args: argparse.Namespace) -> dict[str, object]:
    with local_stack("reach-fwdcost-d-") as (_, one, _c), \
            local_stack("reach-fwdcost-f-") as (_, two, _c2):  # fmt: skip
        brokers: list[Broker] = []
        agents: list[reach_agent.Agent] = []
        conns: dict[str, nats.NATS] = {}
        try:
            for kind, server, count in (("direct", one, 1), ("forwarded", two, 2)):
                for _ in range(count):
                    c = Config()
                    c.nats.url, c.broker.metrics_port = server.url, 0
                    b = Broker(c, metrics=Metrics())
                    await b.start()
                    brokers.append(b)
                agent = reach_agent.Agent(f"{kind}-agent", [CAP], durable_acks=False,
                                          claims=False)  # fmt: skip

                @agent.handler(CAP)
                async def echo(task: reach_agent.Task) -> int:
                    return 1

                await agent.start(server.url)
                agents.append(agent)
                conns[kind] = await nats.connect(server.url)
            owner, front = brokers[1], brokers[2]
            assert owner.forwarder.owns_all() and not front.tables.book.epochs
            await owner._service.stop()  # type: ignore[union-attr]  # only the front takes routes
            subject = f"reach.route.{CAP}"
            deadline = time.monotonic() + 10
            for nc in conns.values():  # both answer (agents healthy, the owner read)
                while True:
                    msg = await nc.request(subject, PEEK, timeout=5)
                    if not msg.headers:
                        break
                    assert time.monotonic() < deadline, msg.headers
                    await asyncio.sleep(0.1)
            best = dict.fromkeys(conns, 0.0)
            for _ in range(args.rounds):
                for kind, nc in conns.items():
                    r = await rate(nc, subject, args.seconds, args.concurrency)
                    best[kind] = max(best[kind], r)
            lat = {k: round(await latency_ms(nc, subject), 3) for k, nc in conns.items()}
            forwarded = front.metrics.route_forwards.labels("ok")._value.get()
            return {
                "requests_per_s": {k: round(v, 1) for k, v in best.items()},
                "forwarded_over_direct": round(best["forwarded"] / best["direct"], 3),
                "median_ms_one_requester": lat,
                "forwarded_ok": forwarded,
                "concurrency": args.concurrency,
            }
        finally:
            for nc in conns.values():
                await nc.close()
            for a in agents:
                await a.stop(grace=1)
            for b in reversed(brokers):
                await b.stop()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, default=2.0)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--concurrency", type=int, default=16)
    args = p.parse_args()
    print(json.dumps(uvloop.run(run(args))))


if __name__ == "__main__":
    main()
