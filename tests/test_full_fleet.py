"""A fleet near or at its capacity, with real agent processes (``tests/agents/worker.py``), a
real nats-server and an in-process broker: the routes the broker hands out count until the
next heartbeat, a merely full fleet answers OVERLOADED with a retry-after hint that the SDK
waits out, and calls lost with a killed agent finish on the other one.

The agents heartbeat once a second, so between two heartbeats the load the broker last heard
is up to a second old: what it counts itself is what keeps calls from being refused.
"""

from __future__ import annotations

import asyncio
import json
import signal
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from nats.aio.client import Client as NATS

import reach_agent
from reach_agent.client.config import ClientConfig
from reach_agent.wire.errors import Overloaded
from reach_broker.broker import Broker
from reach_broker.cluster.natsserver import NatsServer

from .agents.procs import AgentProcess
from .conftest import wait_for
from .test_sdk_failover import healthy, lines, worker

pytestmark = pytest.mark.slow

CAP = "summarize"
CALLERS = 6
"""Callers calling back to back: 75 % of two 4-slot agents."""


def routes(broker: Broker, result: str) -> float:
    return broker.metrics.route_result[result].value


async def callers(
    client: reach_agent.Client, rounds: int, *, after: Any = None
) -> tuple[list[str], list[Any], list[BaseException]]:
    """``CALLERS`` callers, ``rounds`` calls each, back to back (a 50 ms task each): the
    request ids and their results (None for a call that failed), in the order the calls were
    made, and the errors."""
    rids: list[str] = []
    results: list[Any] = []
    errors: list[BaseException] = []

    async def caller(c: int) -> None:
        for i in range(rounds):
            rid = str(uuid.uuid4())
            # results[k] is rids[k]'s, however the calls of the callers interleave.
            k = len(rids)
            rids.append(rid)
            results.append(None)
            try:
                results[k] = await client.call(CAP, {"n": c * 1000 + i, "sleep": 0.05},
                                               request_id=rid, timeout=20)  # fmt: skip
            except Exception as exc:  # noqa: BLE001 - every failure is counted, none expected
                errors.append(exc)
            if after is not None:
                await after()

    await asyncio.wait_for(asyncio.gather(*(caller(c) for c in range(CALLERS))), 90)
    return rids, results, errors


async def known_task_times(client: reach_agent.Client, broker: Broker) -> None:
    """A few calls, then until both agents have reported a task time (their next heartbeat):
    from then on the broker's count of hand-outs fades with it."""
    await asyncio.wait_for(asyncio.gather(*(client.call(CAP, {"sleep": 0.05}, timeout=20)
                                            for _ in range(8))), 30)  # fmt: skip
    assert broker.registry is not None
    agents = broker.registry.agents
    await wait_for(lambda: all(agents[a].stats.task_ewma_ms is not None for a in ("fa", "fb")),
                   10, what="both task times known")  # fmt: skip


async def two_agents(url: str, tmp: Path, broker: Broker) -> list[AgentProcess]:
    procs = [worker(url, tmp, name, CAP, "--max", "4", "--hb", "1.0") for name in ("fa", "fb")]
    await wait_for(lambda: healthy(broker, "fa") and healthy(broker, "fb"), 30,
                   what="both agents healthy")  # fmt: skip
    return procs


async def test_six_callers_on_two_four_slot_agents_none_refused(
    nats_server: NatsServer, broker: Broker, tmp_path: Path
) -> None:
    procs = await two_agents(nats_server.url, tmp_path, broker)
    try:
        async with reach_agent.Client(nats_server.url) as client:
            await known_task_times(client, broker)
            rids, results, errors = await callers(client, 25)
        assert errors == []
        assert len(results) == len(rids) == 150
        assert sorted(r["n"] for r in results) == sorted(c * 1000 + i for c in range(CALLERS)
                                                         for i in range(25))  # fmt: skip
        starts = lines(tmp_path / "fa.log", "start") + lines(tmp_path / "fb.log", "start")
        mine = set(rids)
        assert sorted(s for s in starts if s in mine) == sorted(rids)  # each ran, once
        assert len(starts) == 8 + 150  # the warm-up's, and these
        # No route was refused. (A rare OVERLOADED is no refusal: the estimate just after a
        # hand-out runs ahead of the true count for a moment, and the call waits it out.)
        assert routes(broker, "no_agent") == 0
        served = Counter(r["agent"] for r in results)
        assert set(served) == {"fa", "fb"} and sum(served.values()) == 150
    finally:
        for p in procs:
            p.stop()


async def test_kill_under_load_every_in_flight_call_completes_on_the_other(
    nats_server: NatsServer, broker: Broker, tmp_path: Path
) -> None:
    procs = await two_agents(nats_server.url, tmp_path, broker)
    log_a = tmp_path / "fa.log"
    killed: list[float] = []

    async def kill_once_busy() -> None:
        # After a few rounds, SIGKILL fa while it runs calls (started, not done).
        if killed or len(lines(log_a, "done")) < 20:
            return
        if set(lines(log_a, "start")) - set(lines(log_a, "done")):
            procs[0].signal(signal.SIGKILL)
            killed.append(time.monotonic())

    try:
        async with reach_agent.Client(nats_server.url) as client:
            await known_task_times(client, broker)
            rids, results, errors = await callers(client, 25, after=kill_once_busy)
        assert killed, "fa was never seen running a call"
        assert errors == []
        assert len(results) == len(rids) == 150
        starts_a, starts_b = lines(log_a, "start"), lines(tmp_path / "fb.log", "start")
        lost = set(starts_a) - set(lines(log_a, "done"))
        assert lost  # in flight on fa when it died ...
        assert lost <= set(starts_b)  # ... each run again on fb, under the same request id
        by_rid = dict(zip(rids, results, strict=True))
        assert {by_rid[rid]["agent"] for rid in lost} == {"fb"}
        assert set(rids) <= set(starts_a) | set(starts_b)  # each ran (8 warm-up calls too)
        assert len(set(starts_a) | set(starts_b)) == 8 + 150
        assert [rid for rid, n in Counter(starts_b).items() if n > 1] == []
        assert procs[0].wait(5) == -signal.SIGKILL
    finally:
        for p in procs:
            p.stop()


async def test_a_full_fleet_answers_overloaded_with_the_hint_and_the_sdk_waits_it_out(
    nats_server: NatsServer, broker: Broker, nc: NATS, tmp_path: Path
) -> None:
    proc = worker(nats_server.url, tmp_path, "solo", CAP, "--max", "1", "--hb", "1.0")
    log = tmp_path / "solo.log"
    try:
        await wait_for(lambda: healthy(broker, "solo"), 30, what="solo healthy")
        # A caller that asks the broker for each route (ClientConfig(local_routing=False),
        # as every caller without route tables does): the broker's hand-outs and OVERLOADED.
        async with reach_agent.Client(nats_server.url, config=ClientConfig(
                min_timeout_s=0.5, busy_wait_s=0.05, local_routing=False)) as client:  # fmt: skip
            running = asyncio.create_task(client.call(CAP, {"sleep": 4}, timeout=20))
            await wait_for(lambda: len(lines(log, "start")) == 1, 10, what="solo busy")
            # Its one slot is taken (handed out by the broker, then reported): full.
            for body in (b"", b'{"peek": true}'):
                msg = await nc.request(f"reach.route.{CAP}", body, timeout=2)
                assert msg.headers is not None
                assert msg.headers["Nats-Service-Error-Code"] == "429"
                error = json.loads(msg.data)["error"]
                assert (error["code"], error["retry_after_ms"]) == ("OVERLOADED", 100)
                assert error["message"] == (
                    "no reachable agent for 'summarize' among 1: 1 at or above the load "
                    "watermark 0.85"
                )
            # A call waits the hint out, asking again, until its deadline: then OVERLOADED.
            t0 = time.monotonic()
            with pytest.raises(Overloaded) as exc:
                await client.call(CAP, {"sleep": 0}, timeout=1.0)
            waited = time.monotonic() - t0
            assert (exc.value.code, exc.value.retry_after_ms) == ("OVERLOADED", 100)
            assert 0.8 <= waited < 1.3  # the last wait would not fit the deadline: it stops
            assert routes(broker, "overloaded") >= 2 + 3  # the two above, and the call's asks
            assert lines(log, "start") == [lines(log, "start")[0]]  # nothing else ran
            assert (await asyncio.wait_for(running, 10))["agent"] == "solo"
    finally:
        proc.stop()
