"""The caller client against a real nats-server, broker and in-process agents."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
from typing import Any

import msgspec
import pytest
from nats.aio.client import Client as NATS

import reach_agent
from jetstream import ackreads, acks
from jetstream.names import CLAIMS_STREAM, H_REQUEST_ID
from loadtest.tcpproxy import TcpProxy
from reach_agent import BreakerConfig, ClientConfig, ClientMetrics
from reach_agent.aio import stop_loops
from reach_agent.connection import flush_subscriptions
from reach_agent.wire import schema
from reach_agent.wire.errors import Cancelled, StoreUnavailable, to_reply
from reach_agent.wire.subjects import Subjects
from reach_broker.broker import Broker
from reach_broker.cluster.natsserver import NatsServer

from .conftest import BrokerFactory, wait_for


def registered(broker: Broker, agent_id: str) -> bool:
    assert broker.registry is not None
    rec = broker.registry.agents.get(agent_id)
    return rec is not None and rec.state == "healthy"


def counting_agent(agent_id: str, capability: str, calls: list[str], **kw: Any) -> Any:
    agent = reach_agent.Agent(agent_id, [capability], heartbeat_interval=0.1, **kw)

    @agent.handler(capability)
    async def handle(task: reach_agent.Task) -> dict[str, Any]:
        calls.append(agent_id)
        if task.payload and task.payload.get("reject"):
            raise reach_agent.Reject("not today")
        return {"agent": agent_id, "payload": task.payload,
                "traceparent": task.headers.get("traceparent"),
                "trace_id": task.trace_id, "hops": task.hops}  # fmt: skip

    return agent


def by_agent(
    agent_id: str, capability: str, ran: list[str] | None = None, *, interval: float = 0.1
) -> reach_agent.Agent:
    """An agent that answers ``{"by": agent_id}``, the request ids it ran appended to
    ``ran``."""
    a = reach_agent.Agent(agent_id, [capability], heartbeat_interval=interval)

    @a.handler(capability)
    async def handle(task: reach_agent.Task) -> dict[str, str]:
        if ran is not None:
            ran.append(task.request_id)
        return {"by": agent_id}

    return a


async def test_call_returns_result_and_passes_headers_through(
    nats_server: NatsServer, broker: Broker, agents: Any
) -> None:
    calls: list[str] = []
    await agents(counting_agent("c1", "echo", calls))
    await wait_for(lambda: registered(broker, "c1"), what="c1 healthy")
    metrics = ClientMetrics()
    async with reach_agent.Client(nats_server.url, metrics=metrics) as client:
        result = await client.call(
            "echo", {"x": 1}, timeout=5, request_id="r-1",
            traceparent="00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
            headers={schema.H_TRACE_ID: "t-9", schema.H_HOPS: "up1"},
        )  # fmt: skip
        receipt = await client.call("echo", {"x": 2}, ack_mode="received", request_id="r-2")
    assert result == {
        "agent": "c1", "payload": {"x": 1},
        "traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
        "trace_id": "t-9", "hops": ["up1"],
    }  # fmt: skip
    assert receipt == schema.Receipt(request_id="r-2", agent_id="c1")
    assert (client.takers.get("r-1"), client.takers.get("r-2")) == ("c1", "c1")
    assert metrics.requests.labels("c1", "ok")._value.get() == 2
    assert metrics.duration._sum.get() > 0


async def test_wait_returns_the_final_ack_record_with_its_result_decoded(
    nats_server: NatsServer, broker: Broker, agents: Any
) -> None:
    await agents(counting_agent("w1", "echo", []))
    await wait_for(lambda: registered(broker, "w1"), what="w1 healthy")
    async with reach_agent.Client(nats_server.url) as client:
        receipt = await client.call("echo", {"x": 3}, ack_mode="received", request_id="r-3")
        assert receipt == schema.Receipt(request_id="r-3", agent_id="w1")
        record = await client.wait("r-3", timeout=10)
    assert isinstance(record, schema.AckRecord)
    got = (record.request_id, record.agent_id, record.capability, record.state)
    assert got == ("r-3", "w1", "echo", "completed")
    # Decoded, as call() would have returned it: not msgspec.Raw.
    trace_id, parent = record.result["trace_id"], record.result["traceparent"]  # a call's own
    assert record.result == {"agent": "w1", "payload": {"x": 3}, "hops": [],
                             "traceparent": parent, "trace_id": trace_id}  # fmt: skip
    assert parent.split("-")[1] == trace_id and len(trace_id) == 32
    assert record.error is None


async def test_a_result_lost_while_the_caller_reconnected_is_read_from_the_store(
    nats_server: NatsServer, nc: NATS, broker: Broker, agents: Any
) -> None:
    """The agent answered while the caller's link was down (its node killed: the reply is
    lost). Once the call's deadline passes, the call returns the result the agent stored in
    REACH_ACKS, not TIMEOUT "sent no result" (nemesis seed 42: two calls)."""
    release = asyncio.Event()
    agent = reach_agent.Agent("lost1", ["lost.cap"], heartbeat_interval=0.1)

    @agent.handler("lost.cap")
    async def handle(task: reach_agent.Task) -> dict[str, int]:
        await release.wait()
        return {"n": 7}

    await agents(agent)
    await wait_for(lambda: registered(broker, "lost1"), what="lost1 healthy")
    rid = "r-lost-reply"
    async with TcpProxy.to_url(nats_server.url) as proxy:
        async with reach_agent.Client(proxy.url) as client:
            call = asyncio.create_task(client.call("lost.cap", {}, request_id=rid, timeout=5))
            await wait_for(lambda: any(c.taker == "lost1" for c in client._calls.values()),
                           what="the receipt")  # fmt: skip
            await proxy.cut()
            await wait_for(lambda: not client.nc.is_connected, what="the caller cut off")
            release.set()
            subject, stored = Subjects().ack("lost1", rid), None
            for _ in range(100):  # the agent's completed record, stored meanwhile
                stored = await ackreads.final_at(nc, subject, subjects=Subjects())
                if stored is not None:
                    break
                await asyncio.sleep(0.05)
            assert stored is not None and stored.state == "completed"
            assert client.nc.is_connected is False  # its reply went nowhere
            await proxy.restore()
            assert await asyncio.wait_for(call, 10) == {"n": 7}
            assert client.nc.stats["reconnects"] == 1


async def test_a_caller_whose_own_link_stalls_blames_no_agent(
    nats_server: NatsServer, nc: NATS, broker: Broker, agents: Any,
    caplog: pytest.LogCaptureFixture,
) -> None:  # fmt: skip
    """The caller's own link stalls (its node stopped: the connection left open, nothing
    carried) while its agent runs the task and stores the result. Its liveness probes go
    unanswered as everything does, which says nothing of the agent: the attempt is not
    abandoned as lost (nor the call given up on the other candidates, unreachable too), and
    once the link is back the call returns the stored result within its deadline. Nemesis
    seed 50: c3-000060 and c3-000081 were told TIMEOUT ("agent ... was lost") 3.2 and 2.7 s
    after a4 stored their results and 3.5 and 6.3 s before their deadlines, their caller's
    node SIGSTOPped; it was back 1 s later."""
    caplog.set_level(logging.INFO, logger="reach_agent.client.liveness")
    release = asyncio.Event()
    ran: list[str] = []

    def agent(agent_id: str) -> reach_agent.Agent:
        a = reach_agent.Agent(agent_id, ["deaf.cap"], heartbeat_interval=0.1)

        @a.handler("deaf.cap")
        async def handle(task: reach_agent.Task) -> dict[str, str]:
            ran.append(agent_id)
            await release.wait()
            return {"by": agent_id}

        return a

    await agents(agent("deaf1"))
    await agents(agent("deaf2"))
    await wait_for(lambda: registered(broker, "deaf1") and registered(broker, "deaf2"))
    rid = "r-deaf-caller"
    cfg = ClientConfig(liveness_probe_s=0.3, ack_timeout_s=0.3, route_timeout_s=0.3,
                       backoff_s=0.2)  # fmt: skip
    async with TcpProxy.to_url(nats_server.url) as proxy:
        async with reach_agent.Client(proxy.url, config=cfg) as client:
            call = asyncio.create_task(client.call("deaf.cap", {}, request_id=rid, timeout=12))
            await wait_for(lambda: any(c.taker for c in client._calls.values()),
                           what="the receipt")  # fmt: skip
            taker = ran[0]
            await proxy.blackhole()  # the caller's link stalls, its connection left open
            release.set()
            # the taker's completed record, stored meanwhile
            stored = await ackreads.wait_final_at(nc, Subjects().ack(taker, rid), 5,
                                                  subjects=Subjects())  # fmt: skip
            assert stored.state == "completed"

            def unjudged() -> int:
                return sum(r.getMessage().startswith(f"call.probe_unjudged agent={taker} ")
                           for r in caplog.records)  # fmt: skip

            # Three probes of the taker unanswered while the caller heard nothing either
            # (on the parent the first abandoned the attempt, and the call was given up).
            await wait_for(lambda: unjudged() >= 3 or call.done(), 10,
                           what="three probes unjudged")  # fmt: skip
            assert not call.done(), call.result() if not call.exception() else call.exception()
            await proxy.restore()
            assert await asyncio.wait_for(call, 15) == {"by": taker}
    assert ran == [taker]


async def test_no_receipt_while_the_callers_own_link_stalls_spends_no_retry(
    nats_server: NatsServer, nc: NATS, broker: Broker, agents: Any,
    caplog: pytest.LogCaptureFixture,
) -> None:  # fmt: skip
    """The caller's own link stalls as it sends a call: no receipt comes, from any agent,
    because nothing reaches the caller (nor leaves it). An attempt without a receipt while
    the client's own server does not answer a round trip either says nothing of the agent:
    it spends no retry, and once the link is back the call is sent again and returns its
    result within its deadline. Nemesis seed 55: c3-000172's receipt from a4 was lost as its
    caller's node n1 was stopped (17:59:14.32-19.31); its three attempts ran out during the
    stall and it was told TIMEOUT ("not delivered") at 18.32, 6 s before its deadline and
    2.2 s after a4 had stored the result."""
    caplog.set_level(logging.INFO, logger="reach_agent.client.attemptloop")
    ran: list[str] = []
    await agents(by_agent("mute1", "mute.cap", ran))
    await wait_for(lambda: registered(broker, "mute1"))
    cfg = ClientConfig(liveness_probe_s=0.3, ack_timeout_s=0.3, route_timeout_s=0.3,
                       backoff_s=0.2, retries=2)  # fmt: skip
    async with TcpProxy.to_url(nats_server.url) as proxy:
        async with reach_agent.Client(proxy.url, config=cfg) as client:
            # Routed once with the link up: the route is known when the link stalls.
            assert await client.call("mute.cap", {}, request_id="r-mute-warm") == {"by": "mute1"}
            await proxy.blackhole()
            call = asyncio.create_task(client.call("mute.cap", {}, request_id="r-mute", timeout=12))
            await wait_for(lambda: proxy.held > 0, what="the call held by the stalled link")

            def unjudged() -> bool:
                return any(r.getMessage().startswith("call.attempt_unjudged request_id=r-mute ")
                           for r in caplog.records)  # fmt: skip

            # On the parent its three attempts (0.3 s each, backoff 0.2 s) each spent a
            # retry, and the call was refused TIMEOUT in the stall.
            await wait_for(lambda: unjudged() or call.done(), 10,
                           what="the first attempt unjudged")  # fmt: skip
            assert not call.done(), call.result() if not call.exception() else call.exception()
            await proxy.restore()
            assert await asyncio.wait_for(call, 10) == {"by": "mute1"}
    assert ran == ["r-mute-warm", "r-mute"]


async def test_a_call_out_of_retries_waits_for_its_agents_record_until_its_deadline(
    nats_server: NatsServer, broker: Broker, caplog: pytest.LogCaptureFixture
) -> None:
    """The agent's link stalls as a call is sent: no receipt comes, each attempt is judged
    not delivered (the caller hears its own server), and the retries run out seconds before
    the deadline. The agent, its copies held in the link, runs the request once the link is
    back: the call returns that result, within its deadline. Nemesis seed 58: c2-001098 and
    c2-001099 were told TIMEOUT "not delivered: no receipt from agent 'a2'" 7 s before their
    deadlines; a2, SIGSTOPped with the copies in its buffer, ran both after its SIGCONT and
    stored their results a second before the deadlines. (No claim is stored meanwhile, so
    the call first runs again once, its copies held too; the answer then comes from the
    store or as the late reply to one of its attempts, whichever the client hears first.)"""
    caplog.set_level(logging.INFO, logger="reach_agent.client.client")
    ran: list[str] = []
    a = by_agent("held1", "held.cap", ran, interval=1.0)

    cfg = ClientConfig(ack_timeout_s=0.3, backoff_s=0.2, retries=2)
    async with TcpProxy.to_url(nats_server.url) as proxy:
        await a.start(proxy.url)
        try:
            await wait_for(lambda: registered(broker, "held1"))
            async with reach_agent.Client(nats_server.url, config=cfg) as client:
                warm = await client.call("held.cap", {}, request_id="r-held-warm")
                assert warm == {"by": "held1"}
                await proxy.blackhole()
                call = asyncio.create_task(
                    client.call("held.cap", {}, request_id="r-held", timeout=12)
                )

                def waiting() -> bool:  # the second time: its one more round spent too
                    return sum(
                        r.getMessage().startswith("call.waiting_for_record request_id=r-held "
                                                  "agents=held1 ")
                        for r in caplog.records
                    ) == 2  # fmt: skip

                # Without the wait for a record the call was refused TIMEOUT here.
                await wait_for(lambda: waiting() or call.done(), 10,
                               what="the retries spent")  # fmt: skip
                assert not call.done(), call.exception()
                await proxy.restore()
                assert await asyncio.wait_for(call, 12) == {"by": "held1"}
        finally:
            await a.stop(grace=1)
    assert ran == ["r-held-warm", "r-held"]
    said = [r.getMessage() for r in caplog.records]
    assert [m.split(" ")[0] for m in said if " request_id=r-held " in m][:3] == [
        "call.waiting_for_record", "call.run_again", "call.waiting_for_record"]  # fmt: skip
    assert any(m.startswith(("call.result_from_store request_id=r-held agent=held1 "
                             "state=completed: the call ended ",
                             "call.late_reply request_id=r-held agent=held1: "))
               for m in said)  # fmt: skip


class MuteTaker:
    """A raw agent of ``capability`` on the test's connection, heartbeating every second: it
    takes each task (a receipt), stores its ``completed`` record ``{"by": <its id>}`` in
    ``REACH_ACKS`` and never sends the result (the reply lost); it answers probes running
    nothing. ``busy``: it stores nothing, and answers probes running one task (it never
    ends). ``deaf``: it does not listen for tasks at all (the server has no responder).
    ``refuse_late_s``: the first task is refused that long after it came, with no receipt
    (as an agent that could not confirm its claim does). ``answer_late_s``: each task is
    answered that long after it came, with no receipt and no record (an agent that stores
    none). ``others``: it runs other tasks all along (its probe answers say one more than
    its own, and how many it ended: ``finished``), and stores each record 0.5 s after the
    task came."""

    def __init__(self, nc: NATS, agent_id: str, capability: str, *, busy: bool = False,
                 deaf: bool = False, refuse_late_s: float | None = None,
                 answer_late_s: float | None = None, others: bool = False) -> None:  # fmt: skip
        self.nc, self.agent_id, self.capability = nc, agent_id, capability
        self.busy, self.deaf, self.refuse_late_s = busy, deaf, refuse_late_s
        self.answer_late_s, self.others, self.finished = answer_late_s, others, 0
        self.taken: list[str] = []
        self.refused: list[str] = []
        self._beats: asyncio.Task[None] | None = None
        self._refusing: asyncio.Task[None] | None = None

    async def start(self) -> None:
        nc, aid = self.nc, self.agent_id
        if not self.deaf:
            await nc.subscribe(Subjects().task(aid, self.capability), cb=self._on_task)
        await nc.subscribe(Subjects().probe(aid), cb=self._on_probe)
        await flush_subscriptions(nc)
        body = {"agent_id": aid, "capabilities": [self.capability], "max_concurrency": 4,
                "heartbeat_interval_ms": 1000}  # fmt: skip
        reply = await nc.request(f"reach.announce.{aid}", json.dumps(body).encode(), timeout=5)
        self._beats = asyncio.create_task(self._beat(json.loads(reply.data)["token"]))

    async def stop(self) -> None:
        for task in (self._beats, self._refusing):
            if task is not None:
                await stop_loops(task)

    async def _beat(self, token: str) -> None:
        seq = 0
        while True:
            seq += 1
            hb = {"agent_id": self.agent_id, "token": token, "seq": seq}
            await self.nc.publish(f"reach.hb.{self.agent_id}", json.dumps(hb).encode())
            await asyncio.sleep(1.0)

    async def _on_task(self, msg: Any) -> None:
        rid, aid = msg.headers[H_REQUEST_ID], self.agent_id
        if self.refuse_late_s is not None and not self.refused:
            self.refused.append(rid)
            self._refusing = asyncio.create_task(self._refuse(msg.reply, self.refuse_late_s))
            return
        self.taken.append(rid)
        if self.answer_late_s is not None:
            await asyncio.sleep(self.answer_late_s)
            await self.nc.publish(msg.reply, json.dumps({"by": aid}).encode())
            return
        receipt = schema.encoder.encode(schema.Receipt(request_id=rid, agent_id=aid))
        await self.nc.publish(msg.reply, receipt, headers={schema.H_STATUS: "received"})
        if self.busy:
            return
        if self.others:
            await asyncio.sleep(0.5)
            self.finished += 1
        record = schema.AckRecord(request_id=rid, agent_id=aid, capability=self.capability,
                                  state="completed", at_ms=1,
                                  result=msgspec.Raw(json.dumps({"by": aid}).encode()))  # fmt: skip
        await acks.publish_record(self.nc.jetstream(), Subjects().ack(aid, rid),
                                  acks.ack_msg_id(aid, rid, "completed"),
                                  schema.encoder.encode(record))  # fmt: skip

    async def _refuse(self, reply: str, after_s: float) -> None:
        await asyncio.sleep(after_s)
        headers, body = to_reply(StoreUnavailable("the claim was not confirmed in time"))
        await self.nc.publish(reply, body, headers=headers)

    async def _on_probe(self, msg: Any) -> None:
        active = 1 if self.busy or self.others else 0
        finished = self.finished if self.others else None
        reply = schema.ProbeReply(agent_id=self.agent_id, active=active, finished=finished)
        await self.nc.publish(msg.reply, schema.encoder.encode(reply))


async def one_call(url: str, broker: Broker, taker: MuteTaker, cfg: ClientConfig, rid: str,
                   deadline_s: float, within: float) -> Any:  # fmt: skip
    """``taker`` started and registered, one call of its capability: its answer (within
    ``within`` seconds, the call's own deadline, ``deadline_s``, longer)."""
    await taker.start()
    try:
        await wait_for(lambda: registered(broker, taker.agent_id))
        async with reach_agent.Client(url, config=cfg) as client:
            call = client.call(taker.capability, {}, request_id=rid, timeout=deadline_s)
            return await asyncio.wait_for(call, within)
    finally:
        await taker.stop()


async def test_a_call_whose_reply_is_lost_reads_the_result_once_its_agent_runs_nothing(
    nats_server: NatsServer, nc: NATS, broker: Broker, caplog: pytest.LogCaptureFixture
) -> None:
    """The agent takes the call, stores its result and stays up, but its reply never comes
    (lost). Its next liveness probe says it runs nothing: the call reads the agent's final
    record and returns it, well before its deadline (60 s here). Before, it waited out its
    deadline and read the record then (nemesis seed 62: five calls learnt results stored
    1.8-7.2 s before only at their deadlines)."""
    caplog.set_level(logging.INFO, logger="reach_agent.client.liveness")
    taker = MuteTaker(nc, "mute2", "mute2.cap")
    cfg = ClientConfig(liveness_probe_s=0.3)
    answer = await one_call(nats_server.url, broker, taker, cfg, "r-mute2", 60, 15)
    assert answer == {"by": "mute2"}
    assert taker.taken == ["r-mute2"]
    assert [r.getMessage() for r in caplog.records if "result_from_store" in r.getMessage()] == [
        "call.result_from_store request_id=r-mute2 agent=mute2 state=completed: the agent "
        "ended its run, its reply had not come"
    ]


async def test_a_call_whose_reply_is_lost_reads_the_result_once_its_busy_agent_ends_a_task(
    nats_server: NatsServer, nc: NATS, broker: Broker, caplog: pytest.LogCaptureFixture
) -> None:
    """The agent takes the call, ends it and stores its result, but the reply never comes;
    it runs other tasks all along (its probe answers never say ``active`` 0). The count of
    tasks it ended moved between two probes: the call reads the record and is answered
    (nemesis seed 78: two calls answered by a busy a3 7.0 and 9.7 s before their deadlines
    ended TIMEOUT; on the parent the call waits out its deadline)."""
    caplog.set_level(logging.INFO, logger="reach_agent.client.liveness")
    taker = MuteTaker(nc, "mute5", "mute5.cap", others=True)
    cfg = ClientConfig(liveness_probe_s=0.2)
    answer = await one_call(nats_server.url, broker, taker, cfg, "r-mute5", 60, 15)
    assert answer == {"by": "mute5"}
    assert (taker.taken, taker.finished) == (["r-mute5"], 1)
    assert [r.getMessage() for r in caplog.records if "result_from_store" in r.getMessage()] == [
        "call.result_from_store request_id=r-mute5 agent=mute5 state=completed: the agent "
        "ended its run, its reply had not come"
    ]


@pytest.mark.parametrize(
    ("claims", "refuse_late_s", "why"),
    [("unreadable", 0.6, "every agent it went to refused it before any receipt"),
     ("none stored", 30.0, "no claim of it is stored")],
    ids=["refused-late", "unclaimed"],
)  # fmt: skip
async def test_a_call_nobody_runs_while_it_waits_for_its_record_runs_again_at_once(
    nats_server: NatsServer, nc: NATS, broker: Broker, caplog: pytest.LogCaptureFixture,
    claims: str, refuse_late_s: float, why: str,
) -> None:  # fmt: skip
    """A call's one attempt gets no receipt in time, its retries are spent, and it waits for
    the agent's record. Nobody runs the request, so the call tries again at once and gets
    its answer (waited out on the parent: ``Timeout``):

    * ``refused-late``: the claims unreadable, the agent's refusal comes late (after its
      claim timeout, longer than the call's receipt timeout; nemesis seed 76: three calls
      waited 4.7-6.9 s for agents that had refused them, then ended TIMEOUT);
    * ``unclaimed``: the agent silent (its node stopped), no claim of the request stored (an
      agent running a claimed request holds its claim, and one taking it later finds the
      claim of whoever runs it again; seeds 77 and 78: four calls waited 5.6-6 s for an
      agent on a stopped node, the others having refused, and ended TIMEOUT)."""
    caplog.set_level(logging.INFO, logger="reach_agent.client.client")
    if claims == "unreadable":
        await nc.jetstream().delete_stream(CLAIMS_STREAM)  # (the agent does not claim)
    taker = MuteTaker(nc, "late1", "late1.cap", refuse_late_s=refuse_late_s)
    cfg = ClientConfig(retries=0, ack_timeout_s=0.3, liveness_probe_s=0.3)
    answer = await one_call(nats_server.url, broker, taker, cfg, "r-late1", 20, 10)
    assert answer == {"by": "late1"}
    assert (taker.refused, taker.taken) == (["r-late1"], ["r-late1"])
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("call.run_")]
    assert len(said) == 1 and why in said[0]


async def test_a_late_answer_of_an_agent_that_stores_no_record_ends_the_wait(
    nats_server: NatsServer, nc: NATS, broker: Broker, caplog: pytest.LogCaptureFixture
) -> None:
    """A call whose retries ran out (no receipt in time) waits for its agent's record, and
    the agent, which stores none, answers late: that answer is the call's result (on the
    parent it was dropped, and the call waited out its deadline: ``Timeout``). The claims
    cannot be read (none stored would make it run again at once, below)."""
    caplog.set_level(logging.INFO, logger="reach_agent.client.client")
    await nc.jetstream().delete_stream(CLAIMS_STREAM)
    taker = MuteTaker(nc, "late3", "late3.cap", answer_late_s=0.6)
    cfg = ClientConfig(retries=0, ack_timeout_s=0.3)
    answer = await one_call(nats_server.url, broker, taker, cfg, "r-late3", 20, 10)
    assert answer == {"by": "late3"}
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("call.late_")]
    assert said == ["call.late_reply request_id=r-late3 agent=late3: answered while the call "
                    "waited for its record"]  # fmt: skip


async def test_a_call_waiting_for_its_record_is_cancelled_at_once(
    nats_server: NatsServer, nc: NATS, broker: Broker, caplog: pytest.LogCaptureFixture
) -> None:
    """A call whose retries ran out waits for its agent's record; ``Client.cancel`` of it
    meanwhile ends it ``CANCELLED`` at once (on the parent it waited out its deadline, and
    ended ``Timeout``). The claims cannot be read (none stored would make it run again at
    once, below)."""
    caplog.set_level(logging.INFO, logger="reach_agent.client.client")
    await nc.jetstream().delete_stream(CLAIMS_STREAM)
    taker = MuteTaker(nc, "late2", "late2.cap", refuse_late_s=30)  # says nothing meanwhile
    await taker.start()
    try:
        await wait_for(lambda: registered(broker, "late2"))
        cfg = ClientConfig(retries=0, ack_timeout_s=0.3)
        async with reach_agent.Client(nats_server.url, config=cfg) as client:
            call = asyncio.ensure_future(
                client.call("late2.cap", {}, request_id="r-late2", timeout=20)
            )
            await wait_for(lambda: any("waiting_for_record" in r.getMessage()
                                       for r in caplog.records), 5, what="waiting")  # fmt: skip
            await client.cancel("r-late2", reason="stop it")
            with pytest.raises(Cancelled, match="stop it"):
                await asyncio.wait_for(call, 5)
    finally:
        await taker.stop()


async def test_a_timed_out_calls_read_of_the_store_ends_soon_after_its_deadline(
    nats_server: NatsServer, nc: NATS, broker: Broker
) -> None:
    """A call times out (its agent took it and never answers) while its own link stalls:
    its read of the stored records at the deadline cannot be answered, and gives up 0.1 s
    past the deadline, not after the read's whole second (nemesis seed 66: two calls told
    TIMEOUT at 11.0 s of a 10 s deadline). The bound checked is the deadline's contract
    (1 s past it on the parent), with half a second to spare for a loaded machine."""
    taker = MuteTaker(nc, "busy3", "busy3.cap", busy=True)
    await taker.start()
    try:
        await wait_for(lambda: registered(broker, "busy3"))
        async with TcpProxy.to_url(nats_server.url) as proxy:
            cfg = ClientConfig(liveness_probe_s=0.3, min_timeout_s=0.5)
            async with reach_agent.Client(proxy.url, config=cfg) as client:
                assert await client.call("busy3.cap", {}, request_id="r-warm3", timeout=0.5,
                                         ack_mode="received") is not None  # fmt: skip
                loop = asyncio.get_running_loop()
                started = loop.time()
                call = asyncio.create_task(
                    client.call("busy3.cap", {}, request_id="r-busy3", timeout=2.0)
                )
                await wait_for(lambda: "r-busy3" in taker.taken, what="the call taken")
                await asyncio.sleep(max(started + 1.7 - loop.time(), 0.0))
                await proxy.blackhole()
                with pytest.raises(reach_agent.Timeout):
                    await asyncio.wait_for(call, 10)
                assert loop.time() - started < 2.0 + 0.6
                await proxy.restore()
    finally:
        await taker.stop()


async def test_a_call_whose_attempts_found_no_responders_waits_for_no_record(
    nats_server: NatsServer, nc: NATS, broker: Broker, caplog: pytest.LogCaptureFixture
) -> None:
    """Every attempt of the call met no responders (the agent's subscription gone: its node
    killed as the call was sent): no agent got it, so none can store its answer, and the
    call, refused NO_REACHABLE_AGENT, does not wait until its deadline for their records
    (nemesis seed 69: c2-000291 waited 8.8 s for three agents that never got it)."""
    caplog.set_level(logging.INFO, logger="reach_agent.client.client")
    deaf = MuteTaker(nc, "deaf4", "deaf4.cap", deaf=True)
    await deaf.start()
    try:
        await wait_for(lambda: registered(broker, "deaf4"))
        async with reach_agent.Client(nats_server.url) as client:
            call = client.call("deaf4.cap", {}, request_id="r-deaf4", timeout=60)
            with pytest.raises(reach_agent.NoReachableAgent):
                await asyncio.wait_for(call, 15)
    finally:
        await deaf.stop()
    assert [r.getMessage() for r in caplog.records if "waiting_for_record" in r.getMessage()] == []


async def test_a_call_out_of_retries_takes_another_agents_result_stored_meanwhile(
    nats_server: NatsServer, nc: NATS, broker: Broker, caplog: pytest.LogCaptureFixture
) -> None:
    """A call (a repeat, say) whose attempts reached only a stalled agent waits until its
    deadline for a final record: another agent's record that ends the request's claim counts
    too, once stored (nemesis seed 59: three repeats of requests finished 23-39 s before
    were told TIMEOUT while the store could not be read; it answered again before their
    deadlines)."""
    caplog.set_level(logging.INFO, logger="reach_agent.client.client")
    a = by_agent("held2", "held2.cap", interval=1.0)

    cfg = ClientConfig(ack_timeout_s=0.3, backoff_s=0.2, retries=2)
    rid = "r-held2"
    async with TcpProxy.to_url(nats_server.url) as proxy:
        await a.start(proxy.url)
        try:
            await wait_for(lambda: registered(broker, "held2"))
            async with reach_agent.Client(nats_server.url, config=cfg) as client:
                assert await client.call("held2.cap", {}) == {"by": "held2"}
                await proxy.blackhole()
                call = asyncio.create_task(client.call("held2.cap", {}, request_id=rid,
                                                       timeout=12))  # fmt: skip
                await wait_for(lambda: call.done() or any(
                    r.getMessage().startswith(f"call.waiting_for_record request_id={rid} ")
                    for r in caplog.records), 10, what="the retries spent")  # fmt: skip
                assert not call.done(), call.exception()
                record = schema.AckRecord(request_id=rid, agent_id="other2",
                                          capability="held2.cap", state="completed", at_ms=1,
                                          result=msgspec.Raw(b'{"by":"other2"}'))  # fmt: skip
                await acks.publish_record(nc.jetstream(), Subjects().ack("other2", rid),
                                          acks.ack_msg_id("other2", rid, "completed"),
                                          schema.encoder.encode(record))  # fmt: skip
                assert await asyncio.wait_for(call, 12) == {"by": "other2"}
        finally:
            await proxy.restore()
            await a.stop(grace=1)


async def test_a_timed_out_repeat_returns_the_result_its_claim_holder_stored(
    nats_server: NatsServer, nc: NATS, broker: Broker, agents: Any
) -> None:
    """A request one agent completed, called again under its request id when the only agent
    the route gives never answers (stalled, SIGSTOPped): the call times out with no receipt,
    and returns the result the claim's holder stored, not TIMEOUT. Nemesis seed 48: two
    repeats (c2-000035, c2-000594) were told TIMEOUT "no receipt from agent 'a3'" 44 s and
    2 min after a4 and a2 stored their results; the timed-out call read only the records of
    the agents its attempts went to."""
    await agents(counting_agent("done1", "rep.cap", []))
    await wait_for(lambda: registered(broker, "done1"), what="done1 healthy")
    rid = "r-repeat-stored"
    async with reach_agent.Client(nats_server.url) as first:
        answer = await first.call("rep.cap", {"x": 1}, request_id=rid, timeout=5)
    assert answer["agent"] == "done1"
    got: list[str] = []

    async def swallow(msg: Any) -> None:  # takes the task, never answers (a stalled agent)
        got.append(msg.headers.get("Reach-Request-Id", "") if msg.headers else "")

    await nc.subscribe(Subjects().task("mute1", "rep.cap"), cb=swallow)
    body = {"agent_id": "mute1", "capabilities": ["rep.cap"], "max_concurrency": 4,
            "heartbeat_interval_ms": 60_000, "region": "eu"}  # fmt: skip
    reply = await nc.request("reach.announce.mute1", json.dumps(body).encode(), 2)
    hb = {"agent_id": "mute1", "token": json.loads(reply.data)["token"], "seq": 1,
          "status": "idle", "active": 0, "queue_depth": 0, "ok_total": 0,
          "fail_total": 0}  # fmt: skip
    await nc.publish("reach.hb.mute1", json.dumps(hb).encode())
    await wait_for(lambda: registered(broker, "mute1"), what="mute1 healthy")
    config = ClientConfig(min_timeout_s=2.0)
    async with reach_agent.Client(nats_server.url, config) as client:
        again = await client.call("rep.cap", {"x": 1}, request_id=rid, timeout=2,
                                  region="eu")  # fmt: skip
    assert got and set(got) == {rid}  # only mute1 was asked, and never answered
    assert again == answer


async def test_a_repeat_refused_no_reachable_agent_returns_the_stored_result(
    nats_server: NatsServer, broker: Broker, agents: Any
) -> None:
    """A request completed, then called again under its request id when no agent of the
    capability is left: the stored result, not ``NO_REACHABLE_AGENT`` (nemesis seed 53: 86
    repeats of requests finished 8-109 s before were refused while no agent was
    reachable). A new request id still gets the refusal."""
    calls: list[str] = []
    leaver = await agents(counting_agent("once1", "once.cap", calls))
    await wait_for(lambda: registered(broker, "once1"), what="once1 healthy")
    rid = "r-repeat-nobody"
    async with reach_agent.Client(nats_server.url) as client:
        first = await client.call("once.cap", {"x": 2}, request_id=rid, timeout=5)
        await leaver.stop(grace=1)
        await wait_for(lambda: "once1" not in broker.registry.agents or not registered(
            broker, "once1"), what="once1 gone")  # fmt: skip
        again = await client.call("once.cap", {"x": 2}, request_id=rid, timeout=5)
        with pytest.raises(reach_agent.NoReachableAgent):
            await client.call("once.cap", {"x": 2}, request_id="r-never-run", timeout=5)
    assert again == first
    assert calls == ["once1"]


async def test_busy_agent_sends_the_call_elsewhere_at_once(
    nats_server: NatsServer, broker: Broker, agents: Any
) -> None:
    release = asyncio.Event()
    busy_metrics = reach_agent.AgentMetrics()
    # A long heartbeat interval and a task sent past the broker: the broker does not learn
    # that `full` is busy (neither from a heartbeat nor from a route it answered), so it
    # still routes to it; the agent itself must answer TARGET_BUSY and the client move on.
    full = reach_agent.Agent("full", ["job"], max_concurrency=1, heartbeat_interval=30,
                             metrics=busy_metrics)  # fmt: skip

    @full.handler("job")
    async def hold(task: reach_agent.Task) -> str:
        await release.wait()
        return "full"

    calls: list[str] = []
    await agents(full)
    await agents(counting_agent("spare", "job", calls))
    await wait_for(lambda: registered(broker, "full") and registered(broker, "spare"))
    metrics = ClientMetrics()
    async with reach_agent.Client(nats_server.url, metrics=metrics) as client:
        # A sticky key whose first candidate is `full` makes the order deterministic.
        key = None
        for i in range(200):
            cands = await client.route("job", sticky_key=f"k{i}")
            if cands[0].agent_id == "full":
                key = f"k{i}"
                break
        assert key is not None
        await client.nc.publish("reach.task.full.job", b"{}")  # straight to the agent
        await wait_for(lambda: full.active == 1, what="full is busy")
        result = await client.call("job", {"n": 1}, sticky_key=key, timeout=10)
        assert result["agent"] == "spare"
        assert busy_metrics.tasks.labels("job", "busy")._value.get() == 1
        assert metrics.requests.labels("full", "TARGET_BUSY")._value.get() == 1
        release.set()
        await wait_for(lambda: full.active == 0, what="full done")
    assert calls == ["spare"]


async def test_biz_reject_is_not_retried(
    nats_server: NatsServer, broker: Broker, agents: Any
) -> None:
    calls: list[str] = []
    await agents(counting_agent("rej1", "judge", calls))
    await agents(counting_agent("rej2", "judge", calls))
    await wait_for(lambda: registered(broker, "rej1") and registered(broker, "rej2"))
    async with reach_agent.Client(nats_server.url) as client:
        with pytest.raises(reach_agent.BizReject) as info:
            await client.call("judge", {"reject": True}, timeout=5)
    assert info.value.code == "BIZ_REJECT"
    assert info.value.message == "not today"
    assert len(calls) == 1


async def test_breaker_opens_after_failures_and_closes_after_trials(
    nats_server: NatsServer, broker: Broker, agents: Any
) -> None:
    healthy = False
    invocations = 0
    agent = reach_agent.Agent("flaky", ["risky"], heartbeat_interval=0.1)

    @agent.handler("risky")
    async def risky(task: reach_agent.Task) -> str:
        nonlocal invocations
        invocations += 1
        if not healthy:
            raise RuntimeError("backend down")
        return "ok"

    await agents(agent)
    await wait_for(lambda: registered(broker, "flaky"))
    cfg = ClientConfig(breaker=BreakerConfig(consecutive_failures=3, open_s=0.3, trial_calls=2))
    metrics = ClientMetrics()
    gauge = metrics.breaker_open.labels("flaky", "risky")
    async with reach_agent.Client(nats_server.url, config=cfg, metrics=metrics) as client:
        for _ in range(3):
            with pytest.raises(reach_agent.InternalError) as info:
                await client.call("risky", {}, timeout=5)
            assert info.value.message == "handler 'risky' raised RuntimeError: backend down"
        assert client.breakers.state("flaky", "risky") == "open"
        assert gauge._value.get() == 1
        # Open: the only agent is excluded from picks; the handler is not reached.
        with pytest.raises(reach_agent.NoReachableAgent):
            await client.call("risky", {}, timeout=5)
        assert invocations == 3
        healthy = True
        await wait_for(lambda: client.breakers.available("flaky", "risky", client.clock()),
                       what="open period over")  # fmt: skip
        assert await client.call("risky", {}, timeout=5) == "ok"
        assert client.breakers.state("flaky", "risky") == "half_open"
        assert await client.call("risky", {}, timeout=5) == "ok"
        assert client.breakers.state("flaky", "risky") == "closed"
        assert gauge._value.get() == 0
    assert invocations == 5


async def test_route_falls_back_to_cache_without_broker_and_events_prune_it(
    nats_server: NatsServer, broker_factory: BrokerFactory, agents: Any
) -> None:
    broker = await broker_factory()
    calls: list[str] = []
    await agents(counting_agent("k1", "cache_me", calls))
    leaver = await agents(counting_agent("k2", "cache_me", calls))
    await wait_for(lambda: registered(broker, "k1") and registered(broker, "k2"))
    metrics = ClientMetrics()
    async with reach_agent.Client(nats_server.url, metrics=metrics) as client:
        first = await client.route("cache_me", limit=5)
        assert sorted(c.agent_id for c in first) == ["k1", "k2"]
        await leaver.stop(grace=1)  # leave → `left` event → dropped from the cache
        cache = client.routes.broker.cache  # the broker-asked routes (a look asks a broker)
        await wait_for(
            lambda: [c.agent_id for r in cache.routes() for c in r.candidates] == ["k1"],
            what="k2 pruned from the cache by its event",
        )
        await broker.stop()
        cached = await client.route("cache_me", limit=5)
        assert [c.agent_id for c in cached] == ["k1"]
        assert metrics.route_fallbacks._value.get() == 1
        assert (await client.call("cache_me", {"n": 3}, timeout=5))["agent"] == "k1"
        with pytest.raises(reach_agent.NoReachableAgent) as info:
            await client.route("never_seen")
        assert "no cached route" in info.value.message


async def test_a_call_that_no_broker_answers_waits_for_one_within_its_deadline(
    nats_server: NatsServer, broker_factory: BrokerFactory, agents: Any
) -> None:
    """No broker answers a call's route request and nothing is cached (its brokers
    restarting, their links cut): the call asks again, backing off, within its deadline,
    where it used to be refused ``NO_REACHABLE_AGENT`` at once (nemesis seed 44: 706 calls
    in 2 s). A call whose deadline passes first is refused, saying how long it waited; a
    look (``Client.route``) is answered at once."""
    first = await broker_factory()
    calls: list[str] = []
    await agents(counting_agent("w1", "waits_for_broker", calls))
    await wait_for(lambda: registered(first, "w1"))
    await first.stop()
    metrics = ClientMetrics()
    cfg = ClientConfig(local_routing=False)  # every route a route request
    async with reach_agent.Client(nats_server.url, config=cfg, metrics=metrics) as client:
        with pytest.raises(reach_agent.NoReachableAgent) as looked:
            await client.route("waits_for_broker")
        assert looked.value.message == (
            "route request for capability 'waits_for_broker' no "
            "broker responded and no cached route is left"
        )
        assert metrics.route_broker_waits._value.get() == 0
        with pytest.raises(reach_agent.NoReachableAgent) as late:
            await client.call("waits_for_broker", {"n": 1}, timeout=1.5)
        assert late.value.message.startswith(
            "route request for capability 'waits_for_broker' no broker responded and no "
            "cached route is left; no broker answered in "
        )
        waited = metrics.route_broker_waits._value.get()
        assert waited >= 1
        calling = asyncio.create_task(client.call("waits_for_broker", {"n": 2}, timeout=15))
        await wait_for(lambda: metrics.route_broker_waits._value.get() >= waited + 2,
                       what="the call waiting for a broker")  # fmt: skip
        assert not calling.done()
        second = await broker_factory()
        await wait_for(lambda: registered(second, "w1"))
        result = await asyncio.wait_for(calling, 15)
    assert (result["agent"], result["payload"]) == ("w1", {"n": 2})
    assert calls == ["w1"]


async def test_call_without_any_agent_raises_no_reachable_agent(
    nats_server: NatsServer, broker: Broker
) -> None:
    async with reach_agent.Client(nats_server.url) as client:
        with pytest.raises(reach_agent.NoReachableAgent) as info:
            await client.call("nobody.home", {}, timeout=5)
        assert info.value.code == "NO_REACHABLE_AGENT"
        with pytest.raises(reach_agent.InvalidCapability):
            await client.call("Bad Cap", {})


async def test_client_without_a_server_fails_with_a_clear_error() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    client = reach_agent.Client(f"nats://127.0.0.1:{port}", ClientConfig(connect_timeout_s=0.5))
    with pytest.raises(ConnectionError) as info:
        await client.start()
    assert str(info.value) == f"no NATS server answered at ['nats://127.0.0.1:{port}'] within 0.5s"
    with pytest.raises(reach_agent.InternalError):
        await client.call("echo", {})


async def test_agent_dying_after_its_receipt_is_noticed_without_a_broker(
    nats_server: NatsServer, broker: Broker, agents: Any
) -> None:
    """With no broker to report it, the client's own liveness probes find the dead agent
    and the call is retried on the other one with the same request id. (The capability is
    idempotent: a claimed request id stays with its dead holder until a broker declares
    the holder offline, and here no broker runs.)"""
    seen: list[tuple[str, str]] = []

    def agent(agent_id: str, hang: bool) -> reach_agent.Agent:
        a = reach_agent.Agent(agent_id, ["mortal"], heartbeat_interval=0.1,
                              idempotent={"mortal"})  # fmt: skip

        @a.handler("mortal")
        async def handle(task: reach_agent.Task) -> str:
            seen.append((agent_id, task.request_id))
            if hang:
                await asyncio.Event().wait()
            return agent_id

        return a

    doomed = await agents(agent("doomed", True))
    await agents(agent("fine", False))
    await wait_for(lambda: registered(broker, "doomed") and registered(broker, "fine"))
    cfg = ClientConfig(liveness_probe_s=0.3, liveness_check=False)
    async with reach_agent.Client(nats_server.url, config=cfg) as client:
        key = None
        for i in range(300):
            if (await client.route("mortal", sticky_key=f"m{i}"))[0].agent_id == "doomed":
                key = f"m{i}"
                break
        assert key is not None
        call = asyncio.create_task(
            client.call("mortal", {}, sticky_key=key, request_id="m-1", timeout=30)
        )
        await wait_for(lambda: seen == [("doomed", "m-1")], what="running on doomed")
        await broker.stop()  # nobody reports what happens next
        assert doomed.nc is not None
        await doomed.nc.close()  # the agent's connection dies with its task accepted
        assert await asyncio.wait_for(call, 20) == "fine"
    assert seen == [("doomed", "m-1"), ("fine", "m-1")]
