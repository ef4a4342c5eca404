"""Trace context: a handler's sub-calls inherit Reach-Hops, the trace id and traceparent
through a context variable (no headers passed by hand), and the SDK's log lines carry the
request id. Pure parts first, then real agents behind a real broker."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest

import reach_agent
from reach_agent import trace
from reach_agent.wire import schema
from reach_broker.broker import Broker
from reach_broker.cluster.natsserver import NatsServer

from .conftest import wait_for

TP = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


# --- pure ------------------------------------------------------------------------------


def test_traceparent_helpers() -> None:
    assert trace.trace_id_of(TP) == "0af7651916cd43dd8448eb211c80319c"
    for bad in (None, "", "junk", "ff-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
                "00-" + "0" * 32 + "-b7ad6b7169203331-01",
                "00-0af7651916cd43dd8448eb211c80319c-" + "0" * 16 + "-01",
                "00-0AF7651916CD43DD8448EB211C80319C-b7ad6b7169203331-01"):  # fmt: skip
        assert trace.trace_id_of(bad) is None, bad
    fresh = trace.new_traceparent()
    assert trace.trace_id_of(fresh) is not None and fresh.endswith("-01") and len(fresh) == 55
    assert trace.new_traceparent("a" * 32).startswith("00-" + "a" * 32 + "-")
    assert trace.trace_id_of(trace.new_traceparent("t-9")) not in (None, "t-9")
    child = trace.child_traceparent(TP)
    assert child[:36] == TP[:36] and child[-3:] == "-01" and child[36:52] != TP[36:52]
    assert trace.trace_id_of(trace.child_traceparent("junk")) is not None


def test_outgoing_outside_a_task_starts_a_trace() -> None:
    hdrs: dict[str, str] = {}
    trace.outgoing(hdrs, None)
    assert set(hdrs) == {schema.H_TRACEPARENT, schema.H_TRACE_ID}
    assert hdrs[schema.H_TRACE_ID] == trace.trace_id_of(hdrs[schema.H_TRACEPARENT])
    given = {schema.H_TRACE_ID: "t-9"}
    trace.outgoing(given, TP)
    assert given == {schema.H_TRACE_ID: "t-9", schema.H_TRACEPARENT: TP}


def test_outgoing_inside_a_task_inherits_its_trace_and_hops() -> None:
    ctx = trace.TraceContext("rq-1", "b", {schema.H_HOPS: "a", schema.H_TRACE_ID: "t-1",
                                           schema.H_TRACEPARENT: TP})  # fmt: skip
    token = trace.CURRENT.set(ctx)
    try:
        hdrs: dict[str, str] = {}
        trace.outgoing(hdrs, None)
        by_hand = {schema.H_HOPS: "x"}
        trace.outgoing(by_hand, None)
    finally:
        trace.CURRENT.reset(token)
    assert hdrs[schema.H_HOPS] == "a,b"
    assert hdrs[schema.H_TRACE_ID] == "t-1"
    assert hdrs[schema.H_TRACEPARENT][:36] == TP[:36] != hdrs[schema.H_TRACEPARENT]
    assert by_hand[schema.H_HOPS] == "x"  # headers passed by hand win


def test_log_context_names_the_request(caplog: pytest.LogCaptureFixture) -> None:
    sdk = trace.logger("reach_agent.test_trace")
    caplog.set_level(logging.INFO, logger="reach_agent.test_trace")
    sdk.info("outside.task n=%d", 1)
    token = trace.CURRENT.set(trace.TraceContext("rq-7", "a", {schema.H_TRACE_ID: "t-7"}))
    try:
        sdk.info("inside.task n=%d", 2)
        sdk.info("named.already request_id=%s", "other")
    finally:
        trace.CURRENT.reset(token)
    got = [(r.getMessage(), r.request_id, r.trace_id) for r in caplog.records]  # type: ignore[attr-defined]
    assert got == [
        ("outside.task n=1", "-", "-"),
        ("inside.task n=2 request_id=rq-7", "rq-7", "t-7"),
        ("named.already request_id=other", "rq-7", "t-7"),
    ]


# --- real agents --------------------------------------------------------------------


def healthy(broker: Broker, *ids: str) -> bool:
    assert broker.registry is not None
    return all(
        (rec := broker.registry.agents.get(i)) is not None and rec.state == "healthy" for i in ids
    )


async def test_a_to_b_to_a_chain_is_a_loop_without_headers_by_hand(
    nats_server: NatsServer, broker: Broker, agents: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """A's handler calls B, B's calls A, ... with plain ``client.call(cap, payload)``: the
    fourth visit of A is refused with LOOP_DETECTED, and every hop shares one trace id."""
    visits: list[tuple[str, list[str], str | None, str, str | None]] = []
    client = reach_agent.Client(nats_server.url)
    app = logging.getLogger("app.trace_test")
    caplog.set_level(logging.INFO, logger="app.trace_test")
    caplog.set_level(logging.DEBUG, logger="reach_agent.client.client")  # the handler's level too
    caplog.handler.addFilter(trace.LogContext())

    def bouncing(agent_id: str, mine: str, other: str) -> reach_agent.Agent:
        agent = reach_agent.Agent(agent_id, [mine], heartbeat_interval=0.1)

        @agent.handler(mine)
        async def handle(task: reach_agent.Task) -> Any:
            tp = trace.trace_id_of(task.headers.get(schema.H_TRACEPARENT))
            visits.append((agent_id, task.hops, task.trace_id, task.request_id, tp))
            app.info("bounce.visit agent=%s", agent_id)
            return await client.call(other, {"from": agent_id}, timeout=10)

        return agent

    await agents(bouncing("a", "ping_a", "ping_b"))
    await agents(bouncing("b", "ping_b", "ping_a"))
    await wait_for(lambda: healthy(broker, "a", "b"), what="a and b healthy")
    async with client:
        with pytest.raises(reach_agent.LoopDetected) as caught:
            await asyncio.wait_for(client.call("ping_a", {"from": "caller"}, timeout=10), 20)
    assert caught.value.code == "LOOP_DETECTED"
    # a, b, a, b, a, b served; the 7th hop, A's fourth visit (a,b,a,b,a,b), is refused.
    chain = ["a", "b"] * 3
    assert [(v[0], v[1]) for v in visits] == [(chain[i], chain[:i]) for i in range(6)]
    trace_ids = {v[2] for v in visits}
    assert len(trace_ids) == 1 and None not in trace_ids
    assert {v[4] for v in visits} == trace_ids  # the traceparent's trace id is the same one
    request_ids = [v[3] for v in visits]
    assert len(set(request_ids)) == 6
    # Log lines inside a handler name its request (and trace): the app's own, through the
    # filter, and the SDK's (a sub-call's `call.done` names the sub-call's own request id).
    mine = [(r.request_id, r.trace_id) for r in caplog.records  # type: ignore[attr-defined]
            if r.name == "app.trace_test"]  # fmt: skip
    assert mine == [(rid, visits[0][2]) for rid in request_ids]
    done = [r for r in caplog.records if r.getMessage().startswith("call.done")]
    parents = {r.request_id for r in done}  # type: ignore[attr-defined]
    assert parents == {*request_ids, "-"}  # "-": the caller's own call, outside any task
