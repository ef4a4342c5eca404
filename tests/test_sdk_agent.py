"""The agent SDK against a real nats-server and broker: announce, heartbeats, probes, tasks."""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import msgspec
import nats
import pytest
from nats.aio.client import Client as NATS
from nats.errors import NoRespondersError

import reach_agent
from jetstream.claims import ClaimStore, claim_key
from jetstream.names import H_REQUEST_ID
from jetstream.provision import load_definitions, provision
from reach_agent.connection import flush_subscriptions
from reach_agent.wire import schema
from reach_broker.broker import Broker
from reach_broker.cluster.natsserver import NatsServer

from .agents.procs import AgentProcess
from .conftest import wait_for


class Replies:
    """Every message on one inbox (receipt and result both), for raw-client tests."""

    def __init__(self) -> None:
        self.msgs: list[Any] = []

    async def start(self, nc: NATS) -> Replies:
        self.inbox = nc.new_inbox()

        async def cb(msg: Any) -> None:
            self.msgs.append(msg)

        await nc.subscribe(self.inbox, cb=cb)
        await flush_subscriptions(nc)
        return self

    def bodies(self) -> list[Any]:
        return [json.loads(m.data) for m in self.msgs]


async def send(nc: NATS, subject: str, payload: Any, replies: Replies, **headers: str) -> None:
    await nc.publish(subject, json.dumps(payload).encode(), reply=replies.inbox,
                     headers=headers or None)  # fmt: skip


def registered(broker: Broker, agent_id: str, state: str = "healthy") -> bool:
    assert broker.registry is not None
    rec = broker.registry.agents.get(agent_id)
    return rec is not None and rec.state == state


async def test_design_agent_process_serves_call_and_plain_request(
    nats_server: NatsServer, broker: Broker, nc: NATS, tmp_path: Path
) -> None:
    proc = AgentProcess("design_agent.py", nats_server.url, log_path=tmp_path / "alpha.err")
    try:
        await wait_for(lambda: registered(broker, "alpha"), 20, what="alpha registered")
        async with reach_agent.Client(nats_server.url) as client:
            assert await client.call("text_processing", {"text": "hi"}, timeout=30) == {"chars": 2}
            candidates = await client.route("text_processing", limit=2)
            assert [c.agent_id for c in candidates] == ["alpha"]
            assert candidates[0].subject == "reach.task.alpha.text_processing"
        # A plain request without any header gets the result, with a generated request id.
        reply = await nc.request("reach.task.alpha.text_processing", b'{"text": "hello"}', 5)
        assert json.loads(reply.data) == {"chars": 5}
        assert reply.headers is not None
        assert reply.headers[schema.H_STATUS] == "completed"
        assert uuid.UUID(reply.headers[H_REQUEST_ID]).version == 4
    finally:
        proc.stop()
    assert proc.proc.returncode is not None, proc.output()


@pytest.fixture
async def agent_factory(provisioned: NatsServer) -> Any:
    """In-process agents served on the test's loop (the server provisioned as a broker
    would: agents claim each task); all drained at teardown."""
    nats_server = provisioned
    agents: list[reach_agent.Agent] = []

    async def make(agent: reach_agent.Agent) -> reach_agent.Agent:
        await agent.start(nats_server.url)
        agents.append(agent)
        return agent

    try:
        yield make
    finally:
        for a in agents:
            await a.stop(grace=2)


async def test_receipt_then_result_on_the_same_reply_subject(agent_factory: Any, nc: NATS) -> None:
    agent = reach_agent.Agent("r1", ["echo"], heartbeat_interval=0.1)

    @agent.handler("echo")
    async def echo(task: reach_agent.Task) -> dict[str, Any]:
        return {"got": task.payload, "rid": task.request_id, "left": task.time_left is not None}

    await agent_factory(agent)
    replies = await Replies().start(nc)
    await send(nc, "reach.task.r1.echo", {"a": 1}, replies,
               **{H_REQUEST_ID: "req-1", schema.H_RECEIPT: "1",
                  schema.H_TIMEOUT_MS: "5000"})  # fmt: skip
    await wait_for(lambda: len(replies.msgs) == 2, what="receipt and result")
    receipt, result = replies.msgs
    assert json.loads(receipt.data) == {"request_id": "req-1", "status": "received"}
    assert receipt.headers[schema.H_STATUS] == "received"
    assert json.loads(result.data) == {"got": {"a": 1}, "rid": "req-1", "left": True}
    assert result.headers[H_REQUEST_ID] == "req-1"
    assert result.headers[schema.H_STATUS] == "completed"


async def test_full_agent_answers_target_busy_at_once_and_probe_never_waits(
    agent_factory: Any, nc: NATS
) -> None:
    release = asyncio.Event()
    agent = reach_agent.Agent("busy1", ["slow"], max_concurrency=2, heartbeat_interval=0.1)

    @agent.handler("slow")
    async def slow(task: reach_agent.Task) -> str:
        await release.wait()
        return "done"

    await agent_factory(agent)
    replies = await Replies().start(nc)
    for i in range(2):
        await send(nc, "reach.task.busy1.slow", {}, replies, **{H_REQUEST_ID: f"b{i}"})
    await wait_for(lambda: agent.active == 2, what="two running")
    third = await nc.request("reach.task.busy1.slow", b"{}", timeout=2,
                             headers={H_REQUEST_ID: "b2"})  # fmt: skip
    err = reach_agent.wire.errors.from_reply(third.headers, third.data)
    assert err is not None and err.code == "TARGET_BUSY"
    assert third.headers["Nats-Service-Error-Code"] == "429"
    p50, oldest = agent.load_figures()
    assert p50 is None and oldest is not None and oldest >= 0
    hb = agent.heartbeat()
    assert (hb.status, hb.active, hb.ok_total, hb.oldest_task_ms is not None) == (
        "busy",
        2,
        0,
        True,
    )
    probe = await nc.request("reach.probe.busy1", b"{}", timeout=2)
    body = msgspec.json.decode(probe.data, type=schema.ProbeReply)
    assert (body.agent_id, body.status, body.active, body.finished) == ("busy1", "busy", 2, 0)
    release.set()
    await wait_for(lambda: len(replies.msgs) == 2, what="both results")
    assert replies.bodies() == ["done", "done"]
    probe = await nc.request("reach.probe.busy1", b"{}", timeout=2)
    body = msgspec.json.decode(probe.data, type=schema.ProbeReply)
    assert (body.active, body.finished) == (0, 2)  # ended: what a waiting caller reads on


async def test_duplicate_request_id_joins_running_then_returns_first_result(
    agent_factory: Any, nc: NATS
) -> None:
    release = asyncio.Event()
    runs: list[str] = []
    metrics = reach_agent.AgentMetrics()
    agent = reach_agent.Agent("dup1", ["once"], heartbeat_interval=0.1, metrics=metrics)
    duplicates = metrics.tasks.labels("once", "duplicate")

    @agent.handler("once")
    async def once(task: reach_agent.Task) -> dict[str, Any]:
        runs.append(task.request_id)
        await release.wait()
        return {"run": len(runs)}

    await agent_factory(agent)
    first, second, third = [await Replies().start(nc) for _ in range(3)]
    hdr = {H_REQUEST_ID: "same-id"}
    await send(nc, "reach.task.dup1.once", {}, first, **hdr)
    await wait_for(lambda: runs == ["same-id"], what="first run started")
    await send(nc, "reach.task.dup1.once", {}, second, **hdr)  # joins the running one
    await wait_for(lambda: duplicates._value.get() == 1, what="duplicate seen while running")
    assert second.msgs == []
    release.set()
    await wait_for(lambda: len(first.msgs) == 1 and len(second.msgs) == 1, what="both replies")
    await send(nc, "reach.task.dup1.once", {}, third, **hdr)  # after completion: cached
    await wait_for(lambda: len(third.msgs) == 1, what="cached reply")
    assert first.bodies() == second.bodies() == third.bodies() == [{"run": 1}]
    assert runs == ["same-id"]


async def test_reject_loop_internal_and_bad_input_map_to_wire_codes(
    agent_factory: Any, nc: NATS
) -> None:
    agent = reach_agent.Agent("codes1", ["judge"], heartbeat_interval=0.1)

    @agent.handler("judge")
    async def judge(task: reach_agent.Task) -> str:
        if task.payload.get("reject"):
            raise reach_agent.Reject(f"amount {task.payload['amount']} is above the limit")
        if task.payload.get("boom"):
            raise ValueError("kaput")
        return "fine"

    await agent_factory(agent)

    async def ask(body: bytes, **headers: str) -> reach_agent.ReachError | None:
        reply = await nc.request("reach.task.codes1.judge", body, timeout=2,
                                 headers=headers or None)  # fmt: skip
        return reach_agent.wire.errors.from_reply(reply.headers, reply.data)

    err = await ask(b'{"reject": true, "amount": 7}')
    assert err is not None and err.code == "BIZ_REJECT"
    assert err.message == "amount 7 is above the limit"
    err = await ask(b'{"boom": true}')
    assert err is not None and err.code == "INTERNAL"
    assert err.message == "handler 'judge' raised ValueError: kaput"
    err = await ask(b"{not json")
    assert err is not None and err.code == "INVALID_REQUEST"
    assert err.message.startswith("task payload: malformed JSON")
    err = await ask(b"{}", **{schema.H_TIMEOUT_MS: "soon"})
    assert err is not None and err.code == "INVALID_REQUEST"
    assert err.message == "header Reach-Timeout-Ms 'soon' is not a non-negative integer"
    # Three earlier visits of this agent in the trace: the fourth is a loop.
    err = await ask(b"{}", **{schema.H_HOPS: "codes1,x,codes1,codes1"})
    assert err is not None and err.code == "LOOP_DETECTED"
    assert await ask(b"{}", **{schema.H_HOPS: "codes1,x,codes1"}) is None
    assert (agent.ok_total, agent.fail_total) == (3, 1)  # fine, fine(hops), reject | boom


async def test_sync_handler_runs_in_a_worker_thread(agent_factory: Any, nc: NATS) -> None:
    agent = reach_agent.Agent("sync1", ["blocking"], heartbeat_interval=0.1)
    main = threading.get_ident()

    @agent.handler("blocking")
    def blocking(task: reach_agent.Task) -> dict[str, bool]:
        return {"other_thread": threading.get_ident() != main}

    await agent_factory(agent)
    reply = await nc.request("reach.task.sync1.blocking", b"", timeout=2)
    assert json.loads(reply.data) == {"other_thread": True}


async def test_announce_heartbeats_and_leave_reach_the_broker(
    broker: Broker, agent_factory: Any, nc: NATS
) -> None:
    beats: list[schema.Heartbeat] = []

    async def on_hb(msg: Any) -> None:
        beats.append(msgspec.json.decode(msg.data, type=schema.Heartbeat))

    await nc.subscribe("reach.part.*.hb.hb1", cb=on_hb)  # as the server maps it
    await flush_subscriptions(nc)
    agent = reach_agent.Agent("hb1", ["echo"], heartbeat_interval=0.1, region="eu",
                              tags={"tier": "gold"}, version="1.0", timeout_hint=2.0)  # fmt: skip
    agent.handler("echo")(lambda task: task.payload)
    await agent_factory(agent)
    await wait_for(lambda: len(beats) >= 3, what="three heartbeats")
    assert beats[0].initial is True and not any(b.initial for b in beats[1:])
    assert [b.seq for b in beats[:3]] == [beats[0].seq, beats[0].seq + 1, beats[0].seq + 2]
    assert beats[0].token == agent.token and agent.broker_id == broker.broker_id
    assert registered(broker, "hb1")
    assert broker.registry is not None
    rec = broker.registry.agents["hb1"]
    assert (rec.region, rec.version, rec.tags, rec.timeout_hint_ms) == (
        "eu",
        "1.0",
        {"tier": "gold"},
        2000,
    )
    for _ in range(3):
        await nc.request("reach.task.hb1.echo", b'{"i": 1}', timeout=2)
    # A heartbeat may leave between a task's count in ok_total and the end of its run (the
    # ack record and the reply are sent in between): such a beat says ok_total 3, active 1.
    await wait_for(lambda: (beats[-1].ok_total, beats[-1].active) == (3, 0),
                   what="ok_total reported, no task active")  # fmt: skip
    assert beats[-1].task_ms_p50 is not None
    await agent.stop(grace=1)
    assert registered(broker, "hb1", "draining") or "hb1" not in broker.registry.agents
    assert any(b.status == "draining" for b in beats)
    await wait_for(lambda: "hb1" not in broker.registry.agents, what="evicted after leaving")


class ListSink:
    def __init__(self) -> None:
        self.records: list[schema.AckRecord] = []
        self.started = self.stopped = False

    async def start(self) -> None:
        self.started = True

    async def record(self, rec: schema.AckRecord) -> None:
        self.records.append(rec)

    async def stop(self) -> None:
        self.stopped = True


async def test_ack_sink_gets_received_and_completed_and_ack_mode_received_replies_once(
    agent_factory: Any, nc: NATS
) -> None:
    sink = ListSink()
    agent = reach_agent.Agent("ack1", ["calc"], heartbeat_interval=0.1, ack_sink=sink)

    @agent.handler("calc")
    async def calc(task: reach_agent.Task) -> dict[str, int]:
        if task.payload["x"] < 0:
            raise reach_agent.Reject("x is negative")
        return {"y": task.payload["x"] * 2}

    await agent_factory(agent)
    assert sink.started
    replies = await Replies().start(nc)
    await send(nc, "reach.task.ack1.calc", {"x": 21}, replies,
               **{H_REQUEST_ID: "a-1", schema.H_ACK_MODE: "received"})  # fmt: skip
    await send(nc, "reach.task.ack1.calc", {"x": -1}, replies,
               **{H_REQUEST_ID: "a-2"})  # fmt: skip
    await wait_for(lambda: len(sink.records) == 4, what="four ack records")
    await nc.flush()
    await asyncio.sleep(0.05)  # a stray second reply to a-1 would have arrived by now
    assert [json.loads(m.data) for m in replies.msgs if m.headers[H_REQUEST_ID] == "a-1"] \
        == [{"request_id": "a-1", "status": "received"}]  # fmt: skip
    by = {(r.request_id, r.state): r for r in sink.records}
    assert set(by) == {("a-1", "received"), ("a-1", "completed"), ("a-2", "received"),
                       ("a-2", "failed")}  # fmt: skip
    assert msgspec.json.decode(by[("a-1", "completed")].result) == {"y": 42}
    assert by[("a-2", "failed")].error == {"code": "BIZ_REJECT", "message": "x is negative"}
    assert by[("a-1", "completed")].agent_id == "ack1"
    assert by[("a-1", "completed")].capability == "calc"


class FailingSink(ListSink):
    """Raises on the states named in ``failing`` (a full disk, a broken custom sink)."""

    def __init__(self, failing: set[str]) -> None:
        super().__init__()
        self.failing = failing

    async def record(self, rec: schema.AckRecord) -> None:
        if rec.state in self.failing:
            raise OSError(28, "No space left on device")
        await super().record(rec)


async def test_a_task_whose_received_record_fails_is_refused_retryably_and_never_run(
    agent_factory: Any, nc: NATS
) -> None:
    runs: list[str] = []
    metrics = reach_agent.AgentMetrics()
    agent = reach_agent.Agent("sink1", ["calc"], heartbeat_interval=0.1, metrics=metrics,
                              ack_sink=FailingSink({"received"}))  # fmt: skip

    @agent.handler("calc")
    async def calc(task: reach_agent.Task) -> int:
        runs.append(task.request_id)
        return 1

    await agent_factory(agent)
    reply = await nc.request("reach.task.sink1.calc", b"{}", timeout=5,
                             headers={H_REQUEST_ID: "s-1"})  # fmt: skip
    err = reach_agent.wire.errors.from_reply(reply.headers, reply.data)
    assert isinstance(err, reach_agent.StoreUnavailable) and err.retryable
    assert err.message == ("agent 'sink1' did not run request_id 's-1': its ack sink could not "
                           "record 'received' (see the agent's log): ask again")  # fmt: skip
    assert runs == []
    stored = await ClaimStore(nc).get(claim_key("s-1"))
    assert stored is not None
    claim = schema.claim_decoder.decode(stored.data)
    assert claim.state == "released"  # another agent may run it
    assert metrics.store_errors.labels("acks", "received")._value.get() == 1


async def test_a_final_record_the_sink_refuses_is_counted_and_the_reply_still_goes_out(
    agent_factory: Any, nc: NATS
) -> None:
    metrics = reach_agent.AgentMetrics()
    sink = FailingSink({"completed"})
    agent = reach_agent.Agent("sink2", ["calc"], heartbeat_interval=0.1, metrics=metrics,
                              ack_sink=sink)  # fmt: skip
    agent.handler("calc")(lambda task: 2)
    await agent_factory(agent)
    reply = await nc.request("reach.task.sink2.calc", b"{}", timeout=5,
                             headers={H_REQUEST_ID: "s-2"})  # fmt: skip
    assert json.loads(reply.data) == 2
    assert [(r.request_id, r.state) for r in sink.records] == [("s-2", "received")]
    assert metrics.store_errors.labels("acks", "final")._value.get() == 1


async def test_draining_agent_refuses_new_tasks_and_finishes_running_ones(
    agent_factory: Any, nc: NATS
) -> None:
    release = asyncio.Event()
    agent = reach_agent.Agent("drain1", ["slow"], heartbeat_interval=0.1)

    @agent.handler("slow")
    async def slow(task: reach_agent.Task) -> str:
        await release.wait()
        return "finished"

    await agent_factory(agent)
    replies = await Replies().start(nc)
    await send(nc, "reach.task.drain1.slow", {}, replies, **{H_REQUEST_ID: "d1"})
    await wait_for(lambda: agent.active == 1, what="running")
    stopping = asyncio.create_task(agent.stop(grace=10))
    await wait_for(lambda: agent.draining, what="draining")
    late = await nc.request("reach.task.drain1.slow", b"{}", timeout=2)
    err = reach_agent.wire.errors.from_reply(late.headers, late.data)
    assert err is not None and err.code == "DRAINING"
    release.set()
    await asyncio.wait_for(stopping, 10)
    assert replies.bodies() == ["finished"]


async def test_agent_started_before_any_broker_announces_once_one_appears(
    broker_factory: Any, agent_factory: Any
) -> None:
    agent = reach_agent.Agent("early1", ["echo"], heartbeat_interval=0.1)
    agent.handler("echo")(lambda task: task.payload)
    await agent_factory(agent)
    await asyncio.sleep(0.3)  # a few unanswered announces (backoff 0.1 s doubling)
    assert agent.token is None
    broker = await broker_factory()
    await wait_for(lambda: registered(broker, "early1"), 10, what="registered late")
    await wait_for(lambda: agent.broker_id == broker.broker_id, 5, what="announce answered")


async def test_agent_re_announces_after_reconnecting(
    nats_server: NatsServer, broker: Broker, agent_factory: Any
) -> None:
    agent = reach_agent.Agent("re1", ["echo"], heartbeat_interval=0.1)
    agent.handler("echo")(lambda task: task.payload)
    await agent_factory(agent)
    await wait_for(lambda: registered(broker, "re1"), what="registered")
    announced = broker.metrics.announce_result["ok"]
    before = announced._value.get()
    nats_server.stop()  # same port and store dir on restart: clients reconnect
    nats_server.start()
    await wait_for(lambda: announced._value.get() == before + 1, 20, what="re-announced")
    assert agent.nc is not None and agent.nc.stats["reconnects"] == 1
    reply = await agent.nc.request("reach.task.re1.echo", b'{"back": true}', timeout=2)
    assert json.loads(reply.data) == {"back": True}


async def test_run_waits_for_a_server_that_starts_later(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"nats://127.0.0.1:{port}"
    proc = AgentProcess("design_agent.py", url, log_path=tmp_path / "late.err")
    server = NatsServer(port=port, store_dir=tmp_path / "late-nats")
    try:
        await asyncio.sleep(0.5)  # the agent process tries and fails to connect meanwhile
        assert proc.proc.poll() is None, proc.output()
        server.start()
        nc = await nats.connect(url)
        try:
            await provision(nc, load_definitions())  # as the broker would: the claims bucket
            reply = None
            for _ in range(200):  # bounded: the agent retries every 0.5 s
                try:
                    reply = await nc.request("reach.task.alpha.text_processing",
                                             b'{"text": "late"}', timeout=1)  # fmt: skip
                    break
                except NoRespondersError:
                    await asyncio.sleep(0.05)
            assert reply is not None and json.loads(reply.data) == {"chars": 4}
        finally:
            await nc.close()
        proc.signal(signal.SIGTERM)
        assert proc.wait(15) == 0, proc.output()
    finally:
        proc.stop()
        server.stop()


async def test_duplicate_window_is_bounded_in_size_and_time(agent_factory: Any, nc: NATS) -> None:
    runs: list[str] = []
    # The process's own window alone (claims=False): with claims a repeat outside the window
    # is answered from the claim's stored result instead.
    agent = reach_agent.Agent("win1", ["count"], heartbeat_interval=0.1, dedup_size=2,
                              dedup_ttl=0.3, claims=False)  # fmt: skip

    @agent.handler("count")
    async def count(task: reach_agent.Task) -> int:
        runs.append(task.request_id)
        return len(runs)

    await agent_factory(agent)

    async def ask(rid: str) -> int:
        reply = await nc.request("reach.task.win1.count", b"{}", timeout=2,
                                 headers={H_REQUEST_ID: rid})  # fmt: skip
        return int(json.loads(reply.data))

    assert [await ask(r) for r in ("w1", "w2", "w3")] == [1, 2, 3]
    assert await ask("w3") == 3  # remembered
    assert await ask("w1") == 4  # pushed out by size (2 entries): runs again
    await wait_for(lambda: agent.tasks.dedup.lookup("w3", time.monotonic()) is None, 5,
                   what="w3 expired")  # fmt: skip
    assert await ask("w3") == 5  # outside the duplicate window: runs again
    assert runs == ["w1", "w2", "w3", "w1", "w3"]


async def test_task_cut_off_by_the_grace_period_answers_draining(
    provisioned: NatsServer, nc: NATS
) -> None:
    nats_server = provisioned
    agent = reach_agent.Agent("cut1", ["forever"], heartbeat_interval=0.1)

    @agent.handler("forever")
    async def forever(task: reach_agent.Task) -> None:
        await asyncio.Event().wait()

    await agent.start(nats_server.url)
    replies = await Replies().start(nc)
    await send(nc, "reach.task.cut1.forever", {}, replies, **{H_REQUEST_ID: "c-1"})
    await wait_for(lambda: agent.active == 1, what="running")
    await asyncio.wait_for(agent.stop(grace=0.2), 10)
    await wait_for(lambda: len(replies.msgs) == 1, what="the cut-off reply")
    err = reach_agent.wire.errors.from_reply(replies.msgs[0].headers, replies.msgs[0].data)
    assert err is not None and err.code == "DRAINING"
    assert err.message == "agent 'cut1' stopped before the task finished"
    assert (agent.active, agent.fail_total) == (0, 1)
