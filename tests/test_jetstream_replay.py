"""Compensation replay, durable acks and the registry snapshot with real processes.

Agents (and, where a broker is killed, the broker) run as child processes; each test kills
only the processes it started, by PID.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import json
import logging
import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
from nats.aio.client import Client as NATS
from nats.js.errors import KeyNotFoundError

import reach_agent
from jetstream import ackreads, acks, compensation
from jetstream.claims import ClaimStore, claim_key
from jetstream.names import CLAIMS_STREAM, H_REQUEST_ID
from reach_agent.agent.agent import Agent
from reach_agent.client import durable
from reach_agent.connection import connect_options
from reach_agent.routing.table import partition
from reach_agent.wire import schema
from reach_agent.wire.errors import Overloaded, ReachError
from reach_agent.wire.schema import Announce, RouteRequest
from reach_agent.wire.subjects import Subjects
from reach_broker.broker import Broker
from reach_broker.cluster.natsserver import NatsServer
from reach_broker.replay.replaysend import STALL_WAIT_S
from reach_broker.service import snapshot

from .conftest import BrokerFactory, connections_named, leases_aged_out, wait_for
from .test_broker_wire import announce, heartbeat
from .test_client_wait_store import frozen
from .test_fleet_routes import Ghost, holder, two_brokers
from .test_sdk_failover import healthy

SUBJECTS = Subjects()

ROOT = Path(__file__).resolve().parent.parent

AGENT_SCRIPT = """
import asyncio, os, signal, sys
from reach_agent.agent.agent import Agent
from jetstream.acks import AckWriter
from reach_agent.connection import connect_options
from reach_agent.wire.subjects import Subjects

url, agent_id, cap, log_path, wal_dir = sys.argv[1:6]
delay = float(os.environ.get("TEST_DELAY", "0"))
crash_after = os.environ.get("TEST_CRASH_AFTER_WAL")

def crash(request_id, state):
    # The record of `state` is in the write-ahead file and not yet published: die here.
    if state == crash_after:
        os.kill(os.getpid(), signal.SIGKILL)

writer = AckWriter(wal_dir, author=agent_id, connect=connect_options(f"{agent_id}-acks", url),
                   subjects=Subjects(), after_wal=crash if crash_after else None)
agent = Agent(agent_id, [cap], max_concurrency=int(os.environ.get("TEST_MAXC", "4")),
              heartbeat_interval=float(os.environ.get("TEST_HEARTBEAT", "0.1")),
              ack_sink=writer)

@agent.handler(cap)
async def handle(task):
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.write(fd, (task.request_id + "\\n").encode())
    os.close(fd)
    await asyncio.sleep(delay)
    return {"n": task.payload["n"], "by": os.getpid()}

async def main():
    async with agent.serve(url):
        print("ready", flush=True)
        await asyncio.Event().wait()

asyncio.run(main())
"""


class Procs:
    """Child processes of one test; stopped (by PID) at teardown."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.procs: list[subprocess.Popen[bytes]] = []

    def spawn(self, args: list[str], env: dict[str, str] | None = None,
              name: str = "proc") -> subprocess.Popen[bytes]:  # fmt: skip
        full_env = {**os.environ, "PYTHONPATH": str(ROOT)}
        full_env.update(env or {})
        with open(self.tmp / f"{name}-{len(self.procs)}.log", "wb") as out:
            proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, env=full_env,
                                    cwd=ROOT)  # fmt: skip
        self.procs.append(proc)
        return proc

    def kill(self, proc: subprocess.Popen[bytes]) -> None:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(10)

    def stop_all(self) -> None:
        for proc in self.procs:
            self.kill(proc)


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[Procs]:
    p = Procs(tmp_path)
    try:
        yield p
    finally:
        p.stop_all()


def spawn_agent(procs: Procs, url: str, agent_id: str, cap: str, tmp: Path,
                **env: str) -> subprocess.Popen[bytes]:  # fmt: skip
    script = tmp / "agent_proc.py"
    script.write_text(AGENT_SCRIPT)
    return procs.spawn(
        [sys.executable, str(script), url, agent_id, cap, str(tmp / "runs.log"), str(tmp / "wal")],
        env=env, name=f"agent-{agent_id}",
    )  # fmt: skip


async def queue_drained(nc: NATS, timeout_s: float = 15.0) -> None:
    """Wait until the queue is empty: an entry is removed once its taker's final record is
    seen (by the replica holding it, or at redelivery when that replica died)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while (depth := (await compensation.depths(nc, SUBJECTS))[0]) != 0:
        assert loop.time() < deadline, f"{depth} entries still queued after {timeout_s}s"
        await asyncio.sleep(0.05)


def runs(tmp: Path) -> list[str]:
    path = tmp / "runs.log"
    return path.read_text().split() if path.exists() else []


def spawn_broker(procs: Procs, url: str, tmp: Path, broker_id: str) -> subprocess.Popen[bytes]:
    cfg = tmp / "broker.toml"
    cfg.write_text(
        "[compensation]\nack_wait_s = 2.0\nsweep_interval_s = 0.3\nreplay_concurrency = 2\n"
        "receipt_timeout_s = 1.0\n[detection]\nprobe_timeout_s = 0.5\n"
    )
    return procs.spawn(
        [sys.executable, "-m", "reach_broker.cli", "broker", "--server", url, "--metrics-port",
         "0", "--config", str(cfg), "--broker-id", broker_id, "--log-level", "info"],
        name=f"broker-{broker_id}",
    )  # fmt: skip


async def wait_log(procs: Procs, proc: subprocess.Popen[bytes], needle: str,
                   timeout_s: float = 20) -> None:  # fmt: skip
    idx = procs.procs.index(proc)
    path = next(procs.tmp.glob(f"*-{idx}.log"))
    await wait_for(lambda: needle in path.read_text(errors="replace") or proc.poll() is not None,
                   timeout=timeout_s, what=f"{needle!r} in {path.name}")  # fmt: skip
    assert proc.poll() is None, path.read_text(errors="replace")[-3000:]


async def test_a_sweep_the_queue_refuses_is_said_in_one_line_and_the_sweeps_go_on(
    nc: NATS, broker_factory: BrokerFactory, caplog: pytest.LogCaptureFixture
) -> None:
    """JetStream answers the sweep's STREAM.INFO with an error (here: the queue's stream
    deleted; nemesis seed 65: 503 "temporarily unavailable" during an election): a warning
    naming it, no traceback (one was logged as a bug), and the next sweep tries again."""
    caplog.set_level(logging.WARNING, logger="reach_broker.replay.replay")
    await broker_factory(compensation__sweep_interval_s=0.2)
    await nc.jetstream().delete_stream(compensation.COMP_STREAM)

    def failed() -> list[logging.LogRecord]:
        return [r for r in caplog.records if r.getMessage().startswith("replay.sweep_failed")]

    await wait_for(lambda: len(failed()) >= 2, 10, what="two sweeps refused")
    said = failed()[0]
    assert said.getMessage() == ("replay.sweep_failed stream info REACH_COMPENSATION: stream "
                                 "not found: swept again in 0.2 s")  # fmt: skip
    assert (said.levelno, said.exc_info) == (logging.WARNING, None)


# --- 2: queued while nobody serves, run exactly once when an agent comes ---------------------


async def test_tasks_queued_without_agent_run_exactly_once_when_one_starts(
    nc: NATS, broker_factory: BrokerFactory, nats_server: NatsServer, tmp_path: Path
) -> None:
    broker = await broker_factory(compensation__sweep_interval_s=0.2)
    ids = [await durable.submit(nc, "late.cap", {"n": i}, priority=(i % 2)) for i in range(10)]
    assert (await compensation.depths(nc, SUBJECTS))[0] == 10
    ran: list[tuple[str, int]] = []
    writer = acks.AckWriter(
        tmp_path / "wal",
        author="late1",
        connect=connect_options("late1-acks", nats_server.url),
        subjects=SUBJECTS,
    )
    agent = Agent("late1", ["late.cap"], max_concurrency=4, heartbeat_interval=0.1,
                  ack_sink=writer)  # fmt: skip

    @agent.handler("late.cap")
    async def handle(task: Any) -> dict[str, int]:
        ran.append((task.request_id, task.payload["n"]))
        return {"double": 2 * task.payload["n"]}

    async with agent.serve(nats_server.url):
        records = await asyncio.gather(*(durable.wait(nc, rid, timeout=20) for rid in ids))
    assert [r.state for r in records] == ["completed"] * 10
    assert [r.request_id for r in records] == list(ids)
    assert [r.result["double"] for r in records] == [2 * i for i in range(10)]
    assert {r.agent_id for r in records} == {"late1"}
    assert collections.Counter(rid for rid, _ in ran) == dict.fromkeys(ids, 1)
    # Priority first: the five priority-1 entries (odd n) were replayed before the rest.
    assert {n % 2 for _, n in ran[:4]} == {1}
    await queue_drained(nc)
    assert broker.replayer.sender.replayed == 10
    assert broker.metrics.compensation_result["replayed"]._value.get() == 10
    await wait_for(lambda: broker.metrics.ack_record_state["completed"]._value.get() >= 10)
    assert broker.metrics.ack_latency._sum.get() > 0


async def test_an_entry_whose_delivery_stalled_comes_back_after_a_pause(
    nc: NATS, broker_factory: BrokerFactory, nats_server: NatsServer,
    caplog: pytest.LogCaptureFixture,
) -> None:  # fmt: skip
    """Nemesis seed 31: an entry whose delivery stalled (JetStream could not say whose claim
    it was: an election) was given back at once and came back about three times a second
    for as long as the election lasted. It now comes back STALL_WAIT_S later. Here the claims
    bucket is gone, so every delivery stalls."""
    caplog.set_level(logging.INFO, logger="reach_broker.replay.replaysend")
    await broker_factory(compensation__sweep_interval_s=0.2)
    await nc.jetstream().delete_stream(CLAIMS_STREAM)
    rid = await durable.submit(nc, "stall.cap", {"n": 1})
    agent = Agent("stall1", ["stall.cap"], heartbeat_interval=0.1)

    @agent.handler("stall.cap")
    async def handle(task: Any) -> dict[str, int]:
        return {}

    def stalls() -> list[float]:
        return [r.created for r in caplog.records
                if r.getMessage().startswith(f"replay.stalled request_id={rid} ")]  # fmt: skip

    async with agent.serve(nats_server.url):
        await wait_for(lambda: len(stalls()) >= 3, 15, what="three stalled deliveries")
    gaps = [b - a for a, b in itertools.pairwise(stalls())]
    assert min(gaps) >= 0.9 * STALL_WAIT_S, gaps
    # Each line names the step whose store did not answer: the claim's read.
    said = {r.getMessage().split(" error=")[0] for r in caplog.records
            if r.getMessage().startswith(f"replay.stalled request_id={rid} ")}  # fmt: skip
    assert said == {f"replay.stalled request_id={rid} step=Releaser.claim_of"}


def full_agent(agent_id: str, cap: str, tmp: Path, url: str) -> Agent:
    """An agent of one slot (max_concurrency 1) writing its ack records."""
    connect = connect_options(f"{agent_id}-acks", url)
    writer = acks.AckWriter(tmp / f"wal-{agent_id}", author=agent_id, connect=connect,
                            subjects=SUBJECTS)  # fmt: skip
    return Agent(agent_id, [cap], max_concurrency=1, heartbeat_interval=0.1, ack_sink=writer)


async def test_a_backlog_for_a_full_agent_drains_without_waiting_for_the_sweep(
    nc: NATS, broker_factory: BrokerFactory, nats_server: NatsServer, tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:  # fmt: skip
    """Nemesis seed 34: a round ended when the router answered OVERLOADED (every agent at its
    load watermark), and nothing but the 5 s sweep started the next: a backlog drained one
    sweep at a time while the agents sat idle. Here the sweep never comes: one agent of one
    slot takes the eight entries one by one, each waiting in the round for the slot."""
    caplog.set_level(logging.INFO, logger="reach_broker.replay")
    broker = await broker_factory(compensation__sweep_interval_s=3600.0)
    ids = [await durable.submit(nc, "full.cap", {"n": i}) for i in range(8)]
    agent = full_agent("full1", "full.cap", tmp_path, nats_server.url)
    ran: list[int] = []

    @agent.handler("full.cap")
    async def handle(task: Any) -> dict[str, int]:
        ran.append(task.payload["n"])
        await asyncio.sleep(0.05)
        return {"n": task.payload["n"]}

    async with agent.serve(nats_server.url):
        records = await asyncio.gather(*(durable.wait(nc, rid, timeout=20) for rid in ids))
    assert [r.state for r in records] == ["completed"] * 8
    assert sorted(ran) == list(range(8))
    await queue_drained(nc)
    assert broker.metrics.compensation_result["replayed"]._value.get() == 8
    ended = [r.getMessage() for r in caplog.records if "the round ends" in r.getMessage()]
    assert ended == []


async def test_a_task_queued_while_its_agent_is_full_runs_when_the_slot_frees(
    nc: NATS, broker_factory: BrokerFactory, nats_server: NatsServer, tmp_path: Path
) -> None:
    """Queued while the router answers OVERLOADED for its capability, an entry was left to the
    sweep (nemesis seed 34); it is now looked at again after the refusal's retry_after_ms,
    and runs once the agent's slot is free. Here the sweep never comes."""
    broker = await broker_factory(compensation__sweep_interval_s=3600.0)
    agent = full_agent("full2", "full2.cap", tmp_path, nats_server.url)
    running, release = asyncio.Event(), asyncio.Event()

    @agent.handler("full2.cap")
    async def handle(task: Any) -> dict[str, int]:
        if task.payload["n"] == 0:
            running.set()
            await release.wait()
        return {"n": task.payload["n"]}

    def overloaded() -> bool:
        try:
            broker.router.choose("full2.cap", RouteRequest(), broker.replayer.ctx.clock())
        except Overloaded:
            return True
        except ReachError:
            return False
        return False

    async with agent.serve(nats_server.url):
        first = await durable.submit(nc, "full2.cap", {"n": 0})
        await asyncio.wait_for(running.wait(), 15)
        await wait_for(overloaded, 5, what="the router to see the agent full")
        replayer = broker.replayer
        await wait_for(lambda: "full2.cap" not in replayer._running, 5, what="the round's end")
        second = await durable.submit(nc, "full2.cap", {"n": 1})
        # The enqueue's kick: a round waiting in it for the slot, or a kick set for later.
        await wait_for(lambda: "full2.cap" in replayer._running or replayer._later, 5,
                       what="the second entry's kick")  # fmt: skip
        release.set()
        records = [await durable.wait(nc, rid, timeout=15) for rid in (first, second)]
    assert [(r.state, r.result) for r in records] == [("completed", {"n": 0}),
                                                      ("completed", {"n": 1})]  # fmt: skip
    # Counted once the receipt's record is written, which the result may overtake.
    replayed = broker.metrics.compensation_result["replayed"]._value
    await wait_for(lambda: replayed.get() >= 2, 5, what="two entries counted replayed")
    assert replayed.get() == 2


async def test_entries_another_broker_can_run_are_not_kept_by_a_full_one(
    nc: NATS, broker_factory: BrokerFactory, nats_server: NatsServer, tmp_path: Path
) -> None:
    """A broker routes replays to the agents of its own partitions: its agents full, it gives
    the entries back at once, for a broker whose agents have room to take at its next sweep
    (nemesis seed 35: waiting in the round for its own agent's slot, one broker kept a
    backlog while the other's agents sat idle; given up after half of ack_wait_s, 30 s)."""
    pair = await two_brokers(broker_factory, compensation__ack_wait_s=60.0,
                             compensation__sweep_interval_s=0.5)  # fmt: skip
    mine = next(f"rx-{i}" for i in range(100) if holder(pair, f"rx-{i}") is pair[0])
    theirs = next(f"ry-{i}" for i in range(100) if holder(pair, f"ry-{i}") is pair[1])
    one = full_agent(mine, "split.cap", tmp_path, nats_server.url)
    room = reach_agent.Agent(theirs, ["split.cap"], max_concurrency=8, heartbeat_interval=0.1)
    running, release = asyncio.Event(), asyncio.Event()
    ran: dict[str, str] = {}

    @one.handler("split.cap")
    async def stuck(task: Any) -> dict[str, int]:
        ran[task.request_id] = mine
        running.set()
        await release.wait()
        return {}

    @room.handler("split.cap")
    async def quick(task: Any) -> dict[str, int]:
        ran[task.request_id] = theirs
        return {}

    async with one.serve(nats_server.url):
        await wait_for(lambda: healthy(pair[0], mine), 10, what=f"{mine} healthy")
        # Only `mine` can take them: its broker fetches all eight and gives it one.
        ids = [await durable.submit(nc, "split.cap", {"n": i}) for i in range(8)]
        await asyncio.wait_for(running.wait(), 15)
        async with room.serve(nats_server.url):
            rest = [rid for rid in ids if rid not in ran]
            records = await asyncio.gather(*(durable.wait(nc, rid, timeout=15) for rid in rest))
            release.set()
            first = await durable.wait(nc, next(iter(ran)), timeout=15)
    assert len(rest) == 7
    assert [r.state for r in records] == ["completed"] * 7
    assert {ran[rid] for rid in rest} == {theirs}
    assert first.state == "completed" and first.agent_id == mine


async def test_a_backlog_on_a_broker_owning_some_partitions_drains_without_the_sweep(
    nc: NATS, broker_factory: BrokerFactory, nats_server: NatsServer
) -> None:
    """A broker that gives entries back for load looks again once its agent has a slot,
    also when the slot freed before the round ended (nemesis seed 36: the eighth entry of a
    round was refused, the round ended with the agent no longer full, and nothing but a
    submit or the sweep looked again). Here the sweep never comes."""
    pair = await two_brokers(broker_factory, compensation__sweep_interval_s=3600.0)
    aid = next(f"rk-{i}" for i in range(100) if holder(pair, f"rk-{i}") is pair[1])
    agent = reach_agent.Agent(aid, ["rk.cap"], max_concurrency=8, heartbeat_interval=0.1)
    ran: list[str] = []

    @agent.handler("rk.cap")
    async def quick(task: Any) -> dict[str, int]:
        await asyncio.sleep(0.05)
        ran.append(task.request_id)
        return {}

    async with agent.serve(nats_server.url):
        await wait_for(lambda: healthy(pair[1], aid), 10, what=f"{aid} healthy")
        ids = [await durable.submit(nc, "rk.cap", {"n": i}) for i in range(24)]
        records = await asyncio.gather(*(durable.wait(nc, rid, timeout=15) for rid in ids))
    assert [r.state for r in records] == ["completed"] * 24
    assert sorted(ran) == sorted(ids)


async def test_entries_waiting_for_a_slot_are_given_back_when_the_broker_stops(
    nc: NATS, broker_factory: BrokerFactory, nats_server: NatsServer, tmp_path: Path
) -> None:
    """A stopping broker gives back the entries its round holds, those waiting for a slot and
    those not yet started: held, they came back only after ack_wait_s (nemesis seed 35: a
    task ran 30 s after its submit). Twelve entries: more than replay_concurrency (8), so the
    round also waits for a delivery to end (nemesis seed 36: those deliveries outlived the
    broker)."""
    first = await broker_factory(compensation__ack_wait_s=60.0,
                                 compensation__sweep_interval_s=3600.0)  # fmt: skip
    agent = full_agent("wait1", "wait.cap", tmp_path, nats_server.url)
    running, release = asyncio.Event(), asyncio.Event()
    ran: list[str] = []

    @agent.handler("wait.cap")
    async def handle(task: Any) -> dict[str, int]:
        ran.append(task.request_id)
        running.set()
        await release.wait()
        return {}

    async with agent.serve(nats_server.url):
        ids = [await durable.submit(nc, "wait.cap", {"n": i}) for i in range(12)]
        await asyncio.wait_for(running.wait(), 15)
        await wait_for(lambda: "wait.cap" in first.replayer._running, 5, what="the round")
        await first.stop()
        await broker_factory(compensation__ack_wait_s=60.0, compensation__sweep_interval_s=3600.0)
        release.set()
        records = await asyncio.gather(*(durable.wait(nc, rid, timeout=15) for rid in ids))
    assert [r.state for r in records] == ["completed"] * 12
    assert sorted(ran) == sorted(ids)


async def test_no_replay_round_starts_once_the_broker_stops(
    nc: NATS, broker_factory: BrokerFactory
) -> None:
    """A kick that comes while the broker stops (a submit's kick 50 ms after it, an agent
    turned healthy) starts no round. stop() waits for the loops running when it began, so a
    round started later outlived it and held what it fetched until ack_wait_s (nemesis seed
    42: an entry submitted as its broker was restarted ran 15 s later). Here a routable
    capability is kicked once stop() has cancelled the sweep."""
    first = await broker_factory(compensation__sweep_interval_s=3600.0)
    await announce(nc, "idle1", capabilities=["idle.cap"], heartbeat_interval_ms=60_000)
    sweep = first.replayer._sweeper
    assert sweep is not None
    stopping = asyncio.create_task(first.stop())
    deadline = asyncio.get_running_loop().time() + 15
    while not sweep.cancelling():  # stop() took the loops to wait for, and cancels them
        assert not stopping.done() and asyncio.get_running_loop().time() < deadline
        await asyncio.sleep(0)
    first.replayer.kick("idle.cap")
    started = "idle.cap" in first.replayer._running
    await stopping
    assert started is False


# --- 3: broker SIGKILLed mid-replay --------------------------------------------------------


async def test_broker_killed_mid_replay_loses_nothing_and_runs_nothing_twice(
    nc: NATS, nats_server: NatsServer, procs: Procs, tmp_path: Path
) -> None:
    url = nats_server.url
    b1 = spawn_broker(procs, url, tmp_path, "b1")
    await wait_log(procs, b1, "serving on")
    ids = [await durable.submit(nc, "slow.cap", {"n": i}) for i in range(12)]
    # Two slots, 0.3 s per task: the replay of twelve takes about two seconds.
    spawn_agent(procs, url, "slow1", "slow.cap", tmp_path, TEST_DELAY="0.3", TEST_MAXC="2")
    await wait_for(lambda: len(runs(tmp_path)) >= 3, timeout=20, what="replay under way")
    procs.kill(b1)
    done_before_kill = len(runs(tmp_path))
    assert done_before_kill < 12, "the replay was over before the kill"
    b2 = spawn_broker(procs, url, tmp_path, "b2")
    await wait_log(procs, b2, "serving on")
    records = await asyncio.gather(*(durable.wait(nc, rid, timeout=40) for rid in ids))
    assert [r.state for r in records] == ["completed"] * 12
    assert [r.result["n"] for r in records] == list(range(12))
    counts = collections.Counter(runs(tmp_path))
    assert counts == dict.fromkeys(ids, 1), f"runs per request id: {counts}"
    await queue_drained(nc)  # b1's held entries: redelivered to b2 after ack_wait, removed


# --- 3b: the agent SIGKILLed mid-task ------------------------------------------------------


async def test_a_submitted_task_whose_agent_dies_mid_task_completes_once_elsewhere(
    nc: NATS, broker_factory: BrokerFactory, nats_server: NatsServer, procs: Procs,
    tmp_path: Path,
) -> None:  # fmt: skip
    broker = await broker_factory(compensation__sweep_interval_s=0.2)
    url = nats_server.url
    rid = await durable.submit(nc, "mid.cap", {"n": 5})
    first = spawn_agent(procs, url, "mid1", "mid.cap", tmp_path, TEST_DELAY="120")
    await wait_for(lambda: runs(tmp_path) == [rid], timeout=20, what="the run on mid1")
    # Taken, not finished: the entry stays in the queue, held by the broker.
    assert (await compensation.depths(nc, SUBJECTS))[0] == 1
    await wait_for(lambda: broker.replayer.taken.holds(rid), what="the entry held")
    procs.kill(first)
    await wait_for(lambda: broker.replayer.taken.returned == 1, what="the entry given back")
    assert broker.metrics.compensation_result["requeued"]._value.get() == 1
    spawn_agent(procs, url, "mid2", "mid.cap", tmp_path)
    record = await durable.wait(nc, rid, timeout=30)
    assert (record.state, record.agent_id) == ("completed", "mid2")
    assert record.result["n"] == 5  # decoded, as wait() returns it
    assert runs(tmp_path) == [rid, rid]  # begun on mid1 (killed), run once on mid2
    await wait_for(lambda: broker.replayer.taken.finished == 1, what="the entry removed")
    assert (await compensation.depths(nc, SUBJECTS))[0] == 0  # acked (ack_sync) before
    assert len(broker.replayer.taken) == 0


async def test_an_entry_whose_claim_another_broker_released_is_given_back_at_once(
    nc: NATS, broker_factory: BrokerFactory, agents: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """The claim of an entry's taker released by another broker (the owner of the taker's
    partition, which declared it offline; this broker handed that partition over and heard
    no transition): the entry is given back at once, not at its claim check one
    ``ack_wait`` later (nemesis seed 48: 19.4 and 24.0 s after the submit). The request
    still runs once."""
    caplog.set_level(logging.INFO, logger="reach_broker.replay.taken")
    broker = await broker_factory(compensation__sweep_interval_s=0.2)
    go, runs = asyncio.Event(), []
    agent = reach_agent.Agent("rel1", ["rel.cap"], heartbeat_interval=0.1, max_concurrency=1)

    @agent.handler("rel.cap")
    async def handle(task: reach_agent.Task) -> dict[str, Any]:
        runs.append(task.request_id)
        await go.wait()
        return {"n": task.payload["n"]}

    await agents(agent)
    await wait_for(lambda: healthy(broker, "rel1"))
    rid = await durable.submit(nc, "rel.cap", {"n": 6})
    await wait_for(lambda: broker.replayer.taken.holds(rid), what="the entry held")
    claims = ClaimStore(nc)
    stored = await claims.get(claim_key(rid))
    assert stored is not None
    claim = schema.claim_decoder.decode(stored.data)
    assert (claim.agent_id, claim.state) == ("rel1", "running")
    released = msgspec.structs.replace(claim, state="released", reason="offline elsewhere")
    assert await claims.swap(claim_key(rid), schema.encoder.encode(released), stored.revision)
    await wait_for(lambda: broker.replayer.taken.returned == 1, 5,
                   what="the entry given back")  # fmt: skip
    assert broker.metrics.compensation_result["requeued"]._value.get() == 1
    assert [r.getMessage() for r in caplog.records if "taken_released" in r.getMessage()] == [
        f"replay.taken_released request_id={rid} capability=rel.cap agent=rel1: its claim "
        "was released; queued again, to run elsewhere"
    ]
    go.set()
    record = await durable.wait(nc, rid, timeout=15)
    assert (record.state, record.agent_id, record.result) == ("completed", "rel1", {"n": 6})
    assert runs == [rid]


async def test_an_entry_running_on_another_brokers_agent_is_held_for_it(
    provisioned: Any, nc: NATS, broker_factory: BrokerFactory, agents: Any
) -> None:
    """An entry whose claim is running on an agent of a partition another broker owns (the
    ghost's: this broker knows nothing of the agent) is sent to its holder and held, as for
    a live agent of its own, until the claim is released (by the holder's broker); then it
    runs here. The holder was judged gone here: the entry came back every half second for
    as long as the claim ran."""
    ghost = Ghost(nc, present=True)
    await ghost.start()
    try:
        broker = await broker_factory(fleet__partitions=8)
        assert sorted(broker.tables.book.epochs) == [0, 1, 2, 3]
        gx = next(f"gx-{i}" for i in range(100) if partition(f"gx-{i}", 8) in Ghost.OWNED)
        local = next(f"gl-{i}" for i in range(100) if partition(f"gl-{i}", 8) < 4)
        ran: list[str] = []
        agent = reach_agent.Agent(local, ["gx.cap"], heartbeat_interval=0.1)

        @agent.handler("gx.cap")
        async def handle(task: reach_agent.Task) -> dict[str, Any]:
            ran.append(task.request_id)
            return {"by": local}

        await agents(agent)
        await wait_for(lambda: healthy(broker, local), what=f"{local} healthy")
        rid = str(uuid.uuid4())
        claims = ClaimStore(nc)
        claim = schema.Claim(request_id=rid, agent_id=gx, instance="i1", capability="gx.cap",
                             state="running", at_ms=0)  # fmt: skip
        ours, stored = await claims.create(claim_key(rid), schema.encoder.encode(claim))
        assert ours
        assert await durable.submit(nc, "gx.cap", {"n": 1}, request_id=rid) == rid
        await wait_for(lambda: broker.replayer.taken.holds(rid), 10, what="the entry held")
        assert broker.replayer.taken._held[rid].agent_id == gx
        assert (ran, broker.metrics.compensation_result["deferred"]._value.get()) == ([], 0)
        released = msgspec.structs.replace(claim, state="released", reason="offline elsewhere")
        assert await claims.swap(claim_key(rid), schema.encoder.encode(released),
                                 stored.revision)  # fmt: skip
        record = await durable.wait(nc, rid, timeout=15)
        assert (record.state, record.agent_id, record.result) == ("completed", local,
                                                                 {"by": local})  # fmt: skip
        assert ran == [rid]
        assert broker.replayer.taken.returned == 1
    finally:
        await ghost.stop()


async def test_an_entry_running_on_an_unknown_agent_of_its_own_partitions_waits_for_release(
    nc: NATS, broker_factory: BrokerFactory, agents: Any
) -> None:
    """A broker that owns every partition (here without route tables: its leases, not its
    tables, say so) knows every live agent: a claim running on one it does not know is a dead
    process's. The entry is given back, a moment at a time, for the claim's release (counted
    ``deferred``), never held for it."""
    broker = await broker_factory(fleet__tables=False)
    assert len(broker.partitions.held) == broker.cfg.fleet.partitions
    local = reach_agent.Agent("un-local", ["un.cap"], heartbeat_interval=0.1)

    @local.handler("un.cap")
    async def handle(task: reach_agent.Task) -> dict[str, Any]:
        return {}

    await agents(local)
    await wait_for(lambda: healthy(broker, "un-local"), what="un-local healthy")
    rid = str(uuid.uuid4())
    claim = schema.Claim(request_id=rid, agent_id="un-gone", instance="i1", capability="un.cap",
                         state="running", at_ms=0)  # fmt: skip
    assert (await ClaimStore(nc).create(claim_key(rid), schema.encoder.encode(claim)))[0]
    assert await durable.submit(nc, "un.cap", {"n": 1}, request_id=rid) == rid
    deferred = broker.metrics.compensation_result["deferred"]._value.get
    await wait_for(lambda: deferred() >= 2, 10, what="the entry given back twice")
    assert not broker.replayer.taken.holds(rid)


async def test_an_entry_an_agent_finds_finished_elsewhere_is_removed_naming_no_taker(
    nc: NATS, broker_factory: BrokerFactory, nats_server: NatsServer, procs: Procs,
    agents: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture,
) -> None:  # fmt: skip
    """The broker reads an entry's claim (none yet) and sends the entry to an agent; before
    that agent reads the task, another agent claims and completes the request (a caller's
    call with the same request id). The agent answers the holder's stored result, naming it
    (``Reach-Holder``): no receipt. The entry is removed as claimed and no ``received``
    record names the agent, so a wait reads the holder's record. Nemesis seed 52
    (c3-000092): the replay took that answer for a2's receipt and recorded a2 as the taker,
    and the caller's wait waited 30 s for a record a2 never writes (a1 had completed it)."""
    caplog.set_level(logging.INFO, logger="reach_broker.replay.replaysend")
    broker = await broker_factory(compensation__sweep_interval_s=0.2,
                                  compensation__receipt_timeout_s=10.0)  # fmt: skip
    url, cap = nats_server.url, "fin.cap"
    # A long heartbeat: stopped for a moment, it stays healthy at the broker (no suspicion
    # within 2.4 intervals), so the entry is routed to it.
    late = spawn_agent(procs, url, "fin-late", cap, tmp_path, TEST_HEARTBEAT="5")
    await wait_for(lambda: healthy(broker, "fin-late"), 20, what="fin-late healthy")
    watch = await nc.subscribe(SUBJECTS.task("fin-late", cap))
    await nc.flush()
    os.kill(late.pid, signal.SIGSTOP)  # the task waits in its socket
    try:
        await wait_for(lambda: frozen(late.pid), what="fin-late stopped")
        rid = await durable.submit(nc, cap, {"n": 7})
        sent = await watch.next_msg(timeout=5)  # sent to fin-late: its claim was read before
        first = reach_agent.Agent("fin-first", [cap], heartbeat_interval=0.1)

        @first.handler(cap)
        async def handle(task: reach_agent.Task) -> dict[str, Any]:
            return {"n": task.payload["n"], "by": "fin-first"}

        await agents(first)
        reply = await nc.request(SUBJECTS.task("fin-first", cap), sent.data,
                                 headers={H_REQUEST_ID: rid}, timeout=5)  # fmt: skip
        assert json.loads(reply.data) == {"n": 7, "by": "fin-first"}
        await ackreads.wait_final_at(nc, SUBJECTS.ack("fin-first", rid), 5, subjects=SUBJECTS)
    finally:
        os.kill(late.pid, signal.SIGCONT)  # it reads the task: the request is fin-first's
    await wait_for(lambda: broker.replayer.sender.claimed == 1, 10,
                   what="the entry removed as fin-first's")  # fmt: skip
    await queue_drained(nc)
    assert not broker.replayer.taken.holds(rid)
    assert broker.replayer.sender.replayed == 0
    stored = await ackreads.all_records(nc, rid, subjects=SUBJECTS)
    assert [(r.author, r.state) for r in stored if r.author == "_broker"] == []
    record = await durable.wait(nc, rid, timeout=5)
    assert (record.state, record.agent_id, record.result) == (
        "completed", "fin-first", {"n": 7, "by": "fin-first"})  # fmt: skip
    assert runs(tmp_path) == []  # fin-late never ran it
    said = [m for r in caplog.records if (m := r.getMessage()).startswith("replay.claimed")]
    assert said == [f"replay.claimed request_id={rid} capability=fin.cap holder=fin-first "
                    "(completed): fin-late answered the holder's result"]  # fmt: skip


# --- 4: agent SIGKILLed between "handler done" and "ack stored" -----------------------------


async def test_agent_killed_before_its_ack_was_stored_publishes_it_after_restart(
    nc: NATS, broker: Broker, nats_server: NatsServer, procs: Procs, tmp_path: Path
) -> None:
    url = nats_server.url
    a1 = spawn_agent(procs, url, "crash1", "crash.cap", tmp_path,
                     TEST_CRASH_AFTER_WAL="completed")  # fmt: skip
    await wait_log(procs, a1, "ready")
    rid = str(uuid.uuid4())
    with pytest.raises(Exception):  # noqa: B017 - the agent dies before replying
        await nc.request("reach.task.crash1.crash.cap", b'{"n": 7}', timeout=3,
                         headers={"Reach-Request-Id": rid})  # fmt: skip
    await wait_for(lambda: a1.poll() is not None, timeout=10, what="agent crash")
    assert a1.returncode == -signal.SIGKILL
    assert runs(tmp_path) == [rid]
    last = await ackreads.last_record(nc, rid, subjects=SUBJECTS)
    assert last is None or last.state == "received"  # the completed ack was not stored
    wal_files = list((tmp_path / "wal").glob("acks-*.wal"))
    assert len(wal_files) == 1 and b"%s.completed" % rid.encode() in wal_files[0].read_bytes()

    waiter = asyncio.create_task(durable.wait(nc, rid, timeout=30, agent_id="crash1"))
    a2 = spawn_agent(procs, url, "crash1", "crash.cap", tmp_path)
    await wait_log(procs, a2, "ready")
    record = await waiter
    assert (record.request_id, record.state, record.agent_id) == (rid, "completed", "crash1")
    assert record.result["n"] == 7
    assert runs(tmp_path) == [rid]  # the handler did not run again


# --- 5: a second broker starts from the snapshot ----------------------------------------------


async def test_next_owner_has_the_same_registry_without_re_announces(
    nc: NATS, broker_factory: BrokerFactory, nats_server: NatsServer
) -> None:
    b1 = await broker_factory()
    tokens = {}
    for i in range(5):
        tokens[f"snap{i}"] = (await announce(nc, f"snap{i}", region=f"r{i}"))["token"]
    live = contextlib.AsyncExitStack()
    await live.enter_async_context(connections_named(nats_server.url, *list(tokens)[:4]))
    seq = 0
    stop = asyncio.Event()

    async def beat() -> None:
        nonlocal seq
        while not stop.is_set():
            seq += 1
            for agent_id, token in tokens.items():
                if agent_id != "snap4":  # snap4 falls silent
                    await heartbeat(nc, agent_id, token, seq)
            await asyncio.sleep(0.05)

    beater = asyncio.create_task(beat())
    try:
        await wait_for(lambda: b1.registry.agents["snap4"].state == "offline", timeout=10)
        # Stored: all five, snap4 as offline (the snapshot writes 0.2 s after a change).
        await wait_for(lambda: {a: w[1] for a, w in b1.snapshot._written.items()}
                       == {**dict.fromkeys(tokens, "healthy"), "snap4": "offline"},
                       timeout=10, what="the snapshot written")  # fmt: skip
        held = {a: (r.state, r.capabilities, r.region) for a, r in b1.registry.agents.items()}
        # b1 stops: it hands its partitions back, b2 takes every one over from its keys.
        await b1.stop()
        assert b1.registry.agents == {}  # dropped, not gone: no transition (b1 is stopped)
        b2 = await broker_factory()
        assert b2.snapshot.restored == 5
        assert b2.metrics.announce_result["ok"]._value.get() == 0
        assert sorted(b2.registry.agents) == sorted(held)
        for agent_id, (_, capabilities, region) in held.items():
            other = b2.registry.agents[agent_id]
            assert (other.capabilities, other.region) == (capabilities, region)
        # The states b1 held, from the snapshot; heard from again (heartbeats only, no
        # announce), each confirmed without a move.
        assert {a: r.state for a, r in b2.registry.agents.items()} == {
            a: h[0] for a, h in held.items()
        }
        await wait_for(lambda: not any(b2.registry.agents[a].resync for a in list(tokens)[:4]),
                       timeout=10, what="heard again")  # fmt: skip
        assert {a: r.state for a, r in b2.registry.agents.items()} == {
            a: h[0] for a, h in held.items()
        }
        changes = b2.metrics.registry_changes
        kinds = ("state", "registered", "left", "evicted")
        assert [changes.labels(k)._value.get() for k in kinds] == [0, 0, 0, 0]  # no move
        assert b2.metrics.announce_result["ok"]._value.get() == 0
        reply = await nc.request("reach.route.text_processing", b'{"limit": 10}', timeout=2)
        assert len(json.loads(reply.data)["candidates"]) == 4
    finally:
        stop.set()
        await beater
        await live.aclose()
    # The token secret key lives in the same bucket and is not an agent.
    assert b2.registry.signer is not None
    assert "_broker.token_secret" not in b2.registry.agents


async def test_snapshot_writes_only_what_changed(nc: NATS, broker_factory: BrokerFactory) -> None:
    broker = await broker_factory()
    await announce(nc, "snapw", region="eu")
    await wait_for(lambda: broker.snapshot.writes == 1, what="first write")
    kv = await nc.jetstream().key_value("reach_registry")
    first = await kv.get(broker.snapshot.key("snapw"))
    # The same announce again (a reconnect): nothing stored changes, nothing is written.
    await announce(nc, "snapw", region="eu")
    assert broker.metrics.announce_result["ok"]._value.get() == 2  # replied, so applied
    await broker.snapshot._flush()  # what the flush loop would do next, without waiting
    assert broker.snapshot.writes == 1
    assert (await kv.get(broker.snapshot.key("snapw"))).revision == first.revision
    # A changed announce is written once, with the new value.
    await announce(nc, "snapw", region="us")
    await wait_for(lambda: broker.snapshot.writes == 2, what="second write")
    stored = json.loads((await kv.get(broker.snapshot.key("snapw"))).value)
    assert (stored["announce"]["region"], stored["state"]) == ("us", "healthy")


async def values_stored(kv: Any, keys: list[str]) -> int:
    """How many of ``keys`` hold a value (one get each: nats-py's ``keys()`` can end before
    the values it was sent are handed over, and say there are none)."""
    n = 0
    for key in keys:
        with contextlib.suppress(KeyNotFoundError):
            n += bool((await kv.get(key)).value)
    return n


async def test_changed_agents_are_written_in_batches_one_round_trip_each(
    nc: NATS, broker_factory: BrokerFactory
) -> None:
    """N changed agents cost ceil(N / BATCH) round trips (each batch's publishes pipelined,
    their acknowledgements awaited together), not one request per agent."""
    broker = await broker_factory()
    snap, reg = broker.snapshot, broker.registry
    n = 1000
    for i in range(n):  # straight into the registry: the flush loop is not woken
        # On the broker's clock, heard from every minute: no state moves during the test.
        reg.announce(Announce(agent_id=f"burst{i}", capabilities=["text_processing"],
                              max_concurrency=2, heartbeat_interval_ms=60_000),
                     broker.clock(), 0)  # fmt: skip
    rounds, writes = snap.rounds, snap.writes
    snap._dirty = {f"burst{i}" for i in range(n)}
    await snap._flush()  # what the flush loop does 0.2 s after a change
    assert snapshot.BATCH == 256
    assert (snap.rounds - rounds, snap.writes - writes) == (4, n)  # ceil(1000 / 256)
    kv = await nc.jetstream().key_value("reach_registry")
    assert await values_stored(kv, [snap.key(f"burst{i}") for i in range(n)]) == n
    stored = json.loads((await kv.get(snap.key("burst7"))).value)
    assert (stored["announce"]["agent_id"], stored["state"]) == ("burst7", "healthy")
    # 300 evicted: 300 deletes in 2 round trips; the 700 unchanged cost nothing.
    for i in range(300):
        reg.evict(f"burst{i}", "test")
    snap._dirty = {f"burst{i}" for i in range(n)}
    await snap._flush()
    assert (snap.rounds - rounds, snap.writes - writes) == (6, n + 300)
    assert await values_stored(kv, [snap.key(f"burst{i}") for i in range(n)]) == 700


async def test_unacknowledged_writes_stay_dirty_and_are_written_later(
    nc: NATS, broker_factory: BrokerFactory
) -> None:
    broker = await broker_factory()
    snap, reg = broker.snapshot, broker.registry
    js = nc.jetstream()
    cfg = (await js.stream_info("KV_reach_registry")).config
    await js.delete_stream("KV_reach_registry")  # nothing answers the writes now
    for i in range(300):
        reg.announce(Announce(agent_id=f"lost{i}", capabilities=["text_processing"],
                              max_concurrency=2, heartbeat_interval_ms=60_000),
                     broker.clock(), 0)  # fmt: skip
    snap._dirty = {f"lost{i}" for i in range(300)}
    writes = snap.writes
    with pytest.raises(snapshot.WritesFailed, match="256 of 256 writes failed"):
        await snap._flush()  # the first batch fails: it and the second stay dirty
    assert snap.writes == writes and snap._dirty == {f"lost{i}" for i in range(300)}
    await js.add_stream(cfg)  # the bucket is back
    await snap._flush()
    assert snap.writes == writes + 300 and not snap._dirty
    kv = await js.key_value("reach_registry")
    assert await values_stored(kv, [snap.key(f"lost{i}") for i in range(300)]) == 300


async def test_restarted_broker_keeps_task_history_and_scores_slow_agents_as_before(
    nc: NATS, broker_factory: BrokerFactory
) -> None:
    """Agents whose tasks take 500 ms (above the 250 ms tolerance floor, fine against peers
    that take as long): before the history was kept, the first heartbeats after a restart
    scored them 50 against the bare floor and half of them were out of the routes until the
    next re-rank, ~10 s later. Now the snapshot holds each agent's task EWMA. The restart is
    cold (the broker alone, started after its leases aged out): the agents are restored
    ``suspect``, so the capability's median comes from their history until they are heard."""
    b1 = await broker_factory(fleet__lease_ttl_s=2.0)
    agents = ("slow1", "slow2")
    # A 5 s interval: no heartbeat is late while the test waits for writes and restarts.
    tokens = {a: (await announce(nc, a, heartbeat_interval_ms=5000))["token"] for a in agents}
    await wait_for(lambda: b1.snapshot.writes == 2, what="both written, with no history yet")
    seq = 0

    async def beat(ok_total: int) -> None:
        nonlocal seq
        seq += 1
        for a in agents:
            await heartbeat(nc, a, tokens[a], seq, ok_total=ok_total, task_ms_p50=500)

    for n in range(1, 4):  # tasks finished, each heartbeat; routes re-rank in between
        await beat(10 * n)
        await wait_for(lambda n=n: all(b1.registry.agents[a].ok_total == 10 * n for a in agents))
        await nc.request("reach.route.text_processing", b"", timeout=2)
    await beat(40)
    await wait_for(lambda: [b1.registry.agents[a].score for a in agents] == [100.0, 100.0],
                   what="both at 100 on the first broker")  # fmt: skip
    assert b1.snapshot.sweep_stats() == 2  # what the stats loop does every 10 s
    kv = await nc.jetstream().key_value("reach_registry")

    async def stored_task_ms(agent_id: str) -> float | None:
        return json.loads((await kv.get(b1.snapshot.key(agent_id))).value).get("task_ms")

    for _ in range(100):
        if [await stored_task_ms(a) for a in agents] == [500.0, 500.0]:
            break
        await asyncio.sleep(0.05)
    assert [await stored_task_ms(a) for a in agents] == [500.0, 500.0]

    await b1.stop()  # the restart, after an outage longer than the leases' time to live
    await leases_aged_out(nc)
    b2 = await broker_factory(fleet__lease_ttl_s=2.0)
    assert (b2.partitions.cold, b2.snapshot.restored) == (32, 2)
    restored = [b2.registry.agents[a] for a in agents]
    assert [(r.state, r.stats.task_ewma_ms) for r in restored] == [("suspect", 500.0)] * 2
    assert b2.registry.indexes["text_processing"].median_task_ms == 500.0
    # Not routed before they are heard (nobody heard them through the outage).
    reply = await nc.request("reach.route.text_processing", b'{"limit": 2}', timeout=2)
    assert json.loads(reply.data)["error"]["code"] == "NO_REACHABLE_AGENT"
    await beat(50)  # heard from again: more 500 ms tasks
    await wait_for(lambda: all(r.state == "healthy" for r in restored), what="healthy again")
    assert [r.score for r in restored] == [100.0, 100.0]
    reply = await nc.request("reach.route.text_processing", b'{"limit": 2}', timeout=2)
    got = sorted(c["agent_id"] for c in json.loads(reply.data)["candidates"])
    assert got == list(agents)
