"""A request id runs once across the fleet: claims in KV ``reach_claims``, real servers.

The decision is pure (:func:`reach_agent.agent.claiming.decide`); the rest runs against a real
nats-server and broker, with in-process agents where nothing crashes and agent processes
(``tests/agents/worker.py``, which log every handler start) where one is stalled or killed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import nats
import pytest
from nats.aio.client import Client as NATS

import reach_agent
from jetstream.claims import ClaimStore, claim_key
from jetstream.names import H_REQUEST_ID
from jetstream.provision import load_definitions
from reach_agent import ClientConfig
from reach_agent.agent.claiming import decide
from reach_agent.wire import schema
from reach_agent.wire.subjects import Subjects
from reach_broker.broker import Broker
from reach_broker.cluster.natsserver import NatsServer, find_binary

from .conftest import wait_for
from .test_sdk_failover import EventLog, healthy, lines, worker

SUBJECTS = Subjects("reach")

# --- the decision ---------------------------------------------------------------------------


def claim(state: schema.ClaimState, agent: str = "alpha", instance: str = "i1") -> schema.Claim:
    return schema.Claim(request_id="r", agent_id=agent, instance=instance, capability="cap",
                        state=state, at_ms=1)  # fmt: skip


def test_a_stored_claim_means_wait_answer_or_take_over() -> None:
    me = {"agent_id": "alpha", "instance": "i1"}
    assert decide(claim("running", "beta", "i9"), **me) == "in_progress"
    assert decide(claim("running", "alpha", "i1"), **me) == "in_progress"  # ours, running
    assert decide(claim("running", "alpha", "i0"), **me) == "take_over"  # our dead predecessor
    assert decide(claim("released", "beta", "i9"), **me) == "take_over"
    assert decide(claim("completed", "beta", "i9"), **me) == "stored"
    assert decide(claim("failed", "alpha", "i0"), **me) == "stored"


def test_every_request_id_has_one_key_and_the_bucket_lives_as_long_as_the_acks() -> None:
    uuid4 = "0b7c1c4e-4a55-4f43-9d55-1d6f3f1f0c2a"
    assert claim_key(uuid4) == uuid4
    assert claim_key("a b/c") == claim_key("a b/c") != claim_key("a b/d")
    assert claim_key("a b/c").startswith("h-") and len(claim_key("a b/c")) == 34
    defs = {d["name"]: d for d in load_definitions(overrides={"REACH_ACKS": {"max_age": 7}})}
    assert defs["KV_reach_claims"]["max_age"] == 7
    assert {d["name"]: d for d in load_definitions()}["KV_reach_claims"]["max_age"] == 86400 * 10**9


async def test_the_claim_store_creates_once_and_changes_only_by_revision(
    nc: NATS, broker: Broker
) -> None:
    store = ClaimStore(nc)
    assert await store.exists() is True
    created, mine = await store.create("k1", b'{"v":1}')
    assert created is True
    again, theirs = await store.create("k1", b'{"v":2}')
    assert (again, theirs) == (False, mine)
    assert await store.swap("k1", b'{"v":3}', mine.revision - 1) is None  # a stale revision
    revision = await store.swap("k1", b'{"v":3}', mine.revision)
    assert revision is not None and revision > mine.revision
    stored = await store.get("k1")
    assert stored is not None and (stored.revision, stored.data) == (revision, b'{"v":3}')
    assert await store.get("k2") is None


# --- in-process agents ----------------------------------------------------------------------


def slow_agent(agent_id: str, cap: str, runs: list[tuple[str, str]], sleep: float = 0.0,
               **kw: Any) -> reach_agent.Agent:  # fmt: skip
    agent = reach_agent.Agent(agent_id, [cap], heartbeat_interval=0.1,
                              tags={"slot": agent_id}, **kw)  # fmt: skip

    @agent.handler(cap)
    async def handle(task: reach_agent.Task) -> dict[str, Any]:
        runs.append((agent_id, task.request_id))
        await asyncio.sleep(sleep)
        return {"agent": agent_id, "n": (task.payload or {}).get("n")}

    return agent


async def stored_claim(nc: NATS, request_id: str) -> schema.Claim | None:
    stored = await ClaimStore(nc).get(claim_key(request_id))
    return None if stored is None else schema.claim_decoder.decode(stored.data)


async def test_one_request_id_sent_to_two_agents_at_once_runs_once_and_both_get_its_result(
    nats_server: NatsServer, broker: Broker, agents: Any, nc: NATS
) -> None:
    runs: list[tuple[str, str]] = []
    await agents(slow_agent("twin-a", "book", runs, sleep=0.5))
    await agents(slow_agent("twin-b", "book", runs, sleep=0.5))
    await wait_for(lambda: healthy(broker, "twin-a") and healthy(broker, "twin-b"))
    rid = str(uuid.uuid4())
    async with (
        reach_agent.Client(nats_server.url) as one,
        reach_agent.Client(nats_server.url) as other,
    ):
        results = await asyncio.wait_for(asyncio.gather(
            one.call("book", {"n": 1}, request_id=rid, tags={"slot": "twin-a"}, timeout=10),
            other.call("book", {"n": 1}, request_id=rid, tags={"slot": "twin-b"}, timeout=10),
        ), 15)  # fmt: skip
    assert len(runs) == 1
    holder = runs[0][0]
    assert runs == [(holder, rid)]
    assert results == [{"agent": holder, "n": 1}, {"agent": holder, "n": 1}]
    stored = await stored_claim(nc, rid)
    assert stored is not None
    assert (stored.agent_id, stored.state, stored.ack_subject) == (
        holder, "completed", f"reach.ack.{holder}.{rid}")  # fmt: skip


async def test_an_idempotent_capability_runs_without_a_claim(
    nats_server: NatsServer, broker: Broker, agents: Any, nc: NATS
) -> None:
    runs: list[tuple[str, str]] = []
    await agents(slow_agent("idem-a", "lookup", runs, idempotent={"lookup"}))
    per_handler = reach_agent.Agent("idem-b", ["peek"], heartbeat_interval=0.1)

    @per_handler.handler("peek", idempotent=True)
    async def peek(task: reach_agent.Task) -> str:
        runs.append(("idem-b", task.request_id))
        return "seen"

    await agents(per_handler)
    await wait_for(lambda: healthy(broker, "idem-a") and healthy(broker, "idem-b"))
    async with reach_agent.Client(nats_server.url) as client:
        assert await client.call("lookup", {"n": 2}, request_id="idem-1") == {"agent": "idem-a",
                                                                               "n": 2}  # fmt: skip
        assert await client.call("peek", None, request_id="idem-2") == "seen"
    assert runs == [("idem-a", "idem-1"), ("idem-b", "idem-2")]
    assert await stored_claim(nc, "idem-1") is None
    assert await stored_claim(nc, "idem-2") is None
    with pytest.raises(reach_agent.InvalidRequest, match=r"idempotent \['nope'\] are not among"):
        reach_agent.Agent("idem-c", ["lookup"], idempotent={"nope"})


async def test_compensation_replay_of_a_completed_request_does_not_run_it_again(
    nats_server: NatsServer, broker: Broker, agents: Any, nc: NATS
) -> None:
    runs: list[tuple[str, str]] = []
    await agents(slow_agent("done-a", "bill", runs))
    await wait_for(lambda: healthy(broker, "done-a"))
    rid = str(uuid.uuid4())
    async with reach_agent.Client(nats_server.url) as client:
        first = await client.call("bill", {"n": 7}, request_id=rid, timeout=10)
        assert first == {"agent": "done-a", "n": 7}
        submitted = await client.submit("bill", {"n": 7}, request_id=rid)
        assert submitted == rid and submitted.duplicate is False
        await wait_for(
            lambda: broker.replayer.sender.claimed == 1, 10, what="the entry seen as claimed"
        )
        record = await client.wait(rid, timeout=5)
        # A replay that raced the broker's own check reaches another agent: it answers the
        # stored result and does not run the handler either.
        await agents(slow_agent("done-b", "bill", runs))
        await wait_for(lambda: healthy(broker, "done-b"))
        raw = await nc.request("reach.task.done-b.bill", b'{"n": 7}', timeout=5,
                               headers={H_REQUEST_ID: rid})  # fmt: skip
    assert (record.state, record.agent_id) == ("completed", "done-a")
    assert record.result == {"agent": "done-a", "n": 7}  # decoded, as wait() returns it
    assert (raw.headers or {}).get(schema.H_STATUS) == "completed"
    assert msgspec.json.decode(raw.data) == {"agent": "done-a", "n": 7}
    assert runs == [("done-a", rid)]
    assert (broker.replayer.sender.replayed, broker.replayer.sender.claimed) == (0, 1)
    assert broker.metrics.compensation_result["claimed"]._value.get() == 1


@pytest.fixture
def plain_server() -> Iterator[str]:
    """A nats-server without JetStream (open dev mode at its barest): its URL."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([find_binary(), "-a", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    try:
        yield f"nats://127.0.0.1:{port}"
    finally:
        proc.kill()
        proc.wait(10)


async def test_without_jetstream_claims_are_off_logged_once_and_the_process_window_applies(
    plain_server: str, caplog: pytest.LogCaptureFixture
) -> None:
    url = plain_server
    runs: list[tuple[str, str]] = []
    agent = slow_agent("nojs", "plain", runs, durable_acks=False)
    nc = None
    for _ in range(200):
        with contextlib.suppress(Exception):
            nc = await nats.connect(url, connect_timeout=1, allow_reconnect=False)
            break
        await asyncio.sleep(0.05)
    assert nc is not None
    caplog.set_level(logging.WARNING, logger="reach_agent.agent.claiming")
    await agent.start(url)
    try:
        assert agent.tasks.claimer is not None and agent.tasks.claimer.enabled is False
        for _ in range(3):
            reply = await nc.request("reach.task.nojs.plain", b"{}", timeout=5,
                                     headers={H_REQUEST_ID: "same"})  # fmt: skip
            assert msgspec.json.decode(reply.data) == {"agent": "nojs", "n": None}
    finally:
        await agent.stop(grace=1)
        await nc.close()
    assert runs == [("nojs", "same")]
    off = [r for r in caplog.records if r.getMessage().startswith("claims.off")]
    assert len(off) == 1
    assert "duplicates are caught by this process's window only" in off[0].getMessage()


# --- agent processes: stalls, restarts, deaths ------------------------------------------


slow = pytest.mark.slow


@slow
async def test_a_forced_not_delivered_runs_the_handler_once_in_total(
    nats_server: NatsServer, broker: Broker, tmp_path: Path
) -> None:
    """The first agent claims, then its event loop stalls past the caller's receipt timeout
    (but well short of being declared offline: heartbeats every second); the retry reaches
    the second agent, which answers IN_PROGRESS; the first finishes."""
    stalling = worker(nats_server.url, tmp_path, "stall-a", "pay", "--stall", "1.5",
                      "--delay", "0.2", "--hb", "1")  # fmt: skip
    other = worker(nats_server.url, tmp_path, "stall-b", "pay", "--delay", "0.2")
    try:
        await wait_for(lambda: healthy(broker, "stall-a") and healthy(broker, "stall-b"), 30,
                       what="both agents healthy")  # fmt: skip
        metrics = reach_agent.ClientMetrics()
        async with reach_agent.Client(nats_server.url, metrics=metrics) as client:
            key = await sticky_key_for(client, "pay", "stall-a")
            rid = str(uuid.uuid4())
            result = await asyncio.wait_for(
                client.call("pay", {"n": 1}, sticky_key=key, request_id=rid, timeout=15), 20
            )
        assert result == {"agent": "stall-a", "n": 1}
        assert metrics.requests.labels("stall-a", "not_delivered")._value.get() == 1
        assert metrics.requests.labels("stall-b", "IN_PROGRESS")._value.get() == 1
        assert lines(tmp_path / "stall-a.log", "stall") == [rid]
        assert lines(tmp_path / "stall-a.log", "start") == [rid]
        assert lines(tmp_path / "stall-b.log", "start") == []
    finally:
        stalling.stop()
        other.stop()


@slow
async def test_an_agent_stalled_before_it_claims_never_runs_the_request_its_retry_ran(
    nats_server: NatsServer, broker: Broker, tmp_path: Path
) -> None:
    """The other order: the first agent is stopped before it even reads the task; the retry
    runs on the second; the first, resumed, finds the claim taken and does not run it."""
    stopped = worker(nats_server.url, tmp_path, "stop-a", "pay", "--delay", "0.2")
    other = worker(nats_server.url, tmp_path, "stop-b", "pay", "--delay", "0.2")
    try:
        await wait_for(lambda: healthy(broker, "stop-a") and healthy(broker, "stop-b"), 30,
                       what="both agents healthy")  # fmt: skip
        async with reach_agent.Client(nats_server.url) as client:
            key = await sticky_key_for(client, "pay", "stop-a")
            rid = str(uuid.uuid4())
            stopped.signal(signal.SIGSTOP)
            try:
                result = await asyncio.wait_for(
                    client.call("pay", {"n": 2}, sticky_key=key, request_id=rid, timeout=15), 20
                )
            finally:
                stopped.signal(signal.SIGCONT)
            assert result == {"agent": "stop-b", "n": 2}
            # Once stop-a has served a later task on the same subscription, it has read the
            # stale one (one callback at a time, in order) and answered it from the claim.
            # Sent to stop-a's own task subject, not routed: a freeze shorter than the probe
            # timeout leaves a late probe answer (a large RTT sample) that may keep it out of
            # the routes for a while, which is not what this test is about.
            await wait_for(lambda: healthy(broker, "stop-a"), 15, what="stop-a healthy again")
            later = str(uuid.uuid4())
            nc = await nats.connect(nats_server.url)
            try:
                task = SUBJECTS.task("stop-a", "pay")
                hdrs = {H_REQUEST_ID: later}
                reply = await nc.request(task, b'{"n": 3}', timeout=15, headers=hdrs)
            finally:
                await nc.close()
            assert msgspec.json.decode(reply.data) == {"agent": "stop-a", "n": 3}
        assert lines(tmp_path / "stop-a.log", "start") == [later]
        assert lines(tmp_path / "stop-b.log", "start") == [rid]
    finally:
        stopped.stop()
        other.stop()


async def sticky_key_for(client: reach_agent.Client, cap: str, agent_id: str) -> str:
    for i in range(500):
        if (await client.route(cap, sticky_key=f"k{i}"))[0].agent_id == agent_id:
            return f"k{i}"
    raise AssertionError(f"no sticky key routes {cap!r} to {agent_id!r}")


@slow
async def test_a_completed_request_is_not_run_again_by_its_restarted_agent(
    nats_server: NatsServer, broker: Broker, tmp_path: Path
) -> None:
    first = worker(nats_server.url, tmp_path, "phoenix", "mail", "--delay", "0.1")
    second = None
    try:
        await wait_for(lambda: healthy(broker, "phoenix"), 30, what="phoenix healthy")
        rid = str(uuid.uuid4())
        async with reach_agent.Client(nats_server.url) as client:
            assert await client.call("mail", {"n": 5}, request_id=rid, timeout=10) == {
                "agent": "phoenix", "n": 5}  # fmt: skip
            first.signal(signal.SIGKILL)
            assert first.wait(10) == -signal.SIGKILL
            await wait_for(lambda: not healthy(broker, "phoenix"), 15, what="phoenix gone")
            second = worker(nats_server.url, tmp_path, "phoenix", "mail", "--delay", "0.1")
            await wait_for(lambda: healthy(broker, "phoenix"), 30, what="phoenix back")
            again = await client.call("mail", {"n": 5}, request_id=rid, timeout=10)
        assert again == {"agent": "phoenix", "n": 5}
        assert lines(tmp_path / "phoenix.log", "start") == [rid]
    finally:
        first.stop()
        if second is not None:
            second.stop()


@slow
async def test_a_holder_killed_mid_task_is_released_once_offline_and_runs_once_elsewhere(
    nats_server: NatsServer, broker: Broker, nc: NATS, tmp_path: Path
) -> None:
    events = await EventLog().start(nc)
    doomed = worker(nats_server.url, tmp_path, "hold-a", "ship", "--delay", "2")
    heir = worker(nats_server.url, tmp_path, "hold-b", "ship", "--delay", "0.3")
    try:
        await wait_for(lambda: healthy(broker, "hold-a") and healthy(broker, "hold-b"), 30,
                       what="both agents healthy")  # fmt: skip
        rid = str(uuid.uuid4())
        cfg = ClientConfig(claim_poll_s=30)  # the release event, not the poll, ends the wait
        async with reach_agent.Client(nats_server.url, config=cfg) as client:
            key = await sticky_key_for(client, "ship", "hold-a")
            call = asyncio.create_task(
                client.call("ship", {"n": 9}, sticky_key=key, request_id=rid, timeout=30)
            )
            log_a = tmp_path / "hold-a.log"
            await wait_for(lambda: lines(log_a, "start") == [rid], 10, what="running on hold-a")
            held = await stored_claim(nc, rid)
            assert held is not None and (held.agent_id, held.state) == ("hold-a", "running")
            doomed.signal(signal.SIGKILL)
            result = await asyncio.wait_for(call, 30)
        assert result == {"agent": "hold-b", "n": 9}
        released = [e for e in events.events if e["kind"] == "released"]
        assert [(e["agent_id"], e["request_id"]) for e in released] == [("hold-a", rid)]
        assert "declared offline before finishing" in released[0]["reason"]
        kinds = events.of("hold-a")
        assert kinds.index(("state", "suspect", "offline")) < kinds.index(("released", None, None))
        final = await stored_claim(nc, rid)
        assert final is not None and (final.agent_id, final.state) == ("hold-b", "completed")
        assert lines(log_a, "start") == [rid] and lines(log_a, "done") == []
        assert lines(tmp_path / "hold-b.log", "start") == [rid]
        assert lines(tmp_path / "hold-b.log", "done") == [rid]
        assert broker.releaser.released == 1
        assert broker.metrics.claims_released._value.get() == 1
    finally:
        doomed.stop()
        heir.stop()


async def test_a_broker_learns_running_claims_written_before_it_started_and_can_release_them(
    nc: NATS, broker_factory: Any
) -> None:
    from jetstream.provision import provision

    await provision(nc)
    rid = str(uuid.uuid4())
    running = schema.Claim(request_id=rid, agent_id="ghost", instance="i1", capability="cap",
                           state="running", at_ms=1,
                           ack_subject=f"reach.ack.ghost.{rid}")  # fmt: skip
    created, _ = await ClaimStore(nc).create(claim_key(rid), schema.encoder.encode(running))
    assert created is True
    events = await EventLog().start(nc)
    broker = await broker_factory()
    await wait_for(lambda: broker.releaser.held_by("ghost") == [rid], 5, what="claim learnt")
    assert await broker.releaser.release("ghost", "test") == 1
    assert await broker.releaser.release("ghost", "test") == 0  # already released
    stored = await stored_claim(nc, rid)
    assert stored is not None and (stored.agent_id, stored.state) == ("ghost", "released")
    assert stored.reason is not None and "declared offline before finishing (test)" in stored.reason
    await wait_for(lambda: [e["request_id"] for e in events.events] == [rid], 5,
                   what="the released event")  # fmt: skip
    await wait_for(lambda: broker.releaser.held_by("ghost") == [], 5, what="claim forgotten")
