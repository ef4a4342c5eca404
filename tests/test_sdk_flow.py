"""Flows (reach_agent.client.flow): fan-outs with a partial threshold, critical steps and fallbacks,
step request ids under the parent's, recorded for ``reach ack --steps``. The decisions first
over a scripted client (pure logic, no NATS), then real agents behind a real broker."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import pytest

import reach_agent
from reach_agent import trace
from reach_agent.client import durable
from reach_agent.client.flow import FanOut, Flow, fan_out
from reach_agent.wire import schema
from reach_agent.wire.errors import BizReject, ReachError, Timeout
from reach_broker.broker import Broker
from reach_broker.cluster.natsserver import NatsServer

from .conftest import wait_for
from .test_cli import reach


class Scripted:
    """A stand-in for ``Client.call`` that answers from a table: capability → result, or
    an exception to raise, or ``"hang"``. Records every call's request id and headers."""

    def __init__(self, answers: dict[str, Any]) -> None:
        self.answers = answers
        self.calls: list[tuple[str, Any, str, dict[str, str]]] = []

    async def call(self, capability: str, payload: Any = None, *, request_id: str,
                   headers: dict[str, str], **options: Any) -> Any:  # fmt: skip
        self.calls.append((capability, payload, request_id, headers))
        answer = self.answers[capability]
        if answer == "hang":
            await asyncio.sleep(3600)
        if isinstance(answer, BaseException):
            raise answer
        return answer(payload) if callable(answer) else answer


FIVE = {"w1": 1, "w2": 2, "w3": 3, "w4": BizReject("no"), "w5": Timeout("slow")}


def flow_of(answers: dict[str, Any], request_id: str = "run-1") -> tuple[Flow, Scripted]:
    client = Scripted(answers)
    return Flow(client, request_id=request_id), client  # type: ignore[arg-type]


# --- pure: the decisions -----------------------------------------------------------------


async def test_fan_out_succeeds_at_its_partial_share_and_fails_below_it() -> None:
    flow, client = flow_of(FIVE)
    out = await flow.fan_out(["w1", "w2", "w3", "w4", "w5"], {"q": 1}, partial=0.6)
    assert isinstance(out, FanOut) and out.ratio == 0.6
    assert out.results == [1, 2, 3]
    assert [(b.index, b.capability, b.error.code) for b in out.failures if b.error] == [
        (4, "w4", "BIZ_REJECT"), (5, "w5", "TIMEOUT"),
    ]  # fmt: skip
    assert [c[2] for c in client.calls] == [f"run-1-{i}" for i in range(1, 6)]
    assert {c[3][schema.H_PARENT_ID] for c in client.calls} == {"run-1"}
    assert flow.previous == [1, 2, 3]
    with pytest.raises(reach_agent.FlowFailed) as caught:
        await flow.fan_out(["w1", "w2", "w3", "w4", "w5"], partial=0.8)
    err = caught.value
    assert err.code == "FLOW_FAILED" and err.status == 424
    assert err.message == ("flow run-1: fan-out 3 of 5 succeeded, below partial 0.8 "
                           "(failed 9:BIZ_REJECT, 10:TIMEOUT)")  # fmt: skip
    assert err.fan_out.results == [1, 2, 3]
    assert [s.index for s in flow.steps] == list(range(1, 11))


async def test_fan_out_of_one_capability_over_payloads_and_max_wait() -> None:
    flow, client = flow_of({"double": lambda p: p * 2, "stuck": "hang"})
    out = await flow.fan_out(("double", [1, 2, 3]), partial=1.0)
    assert out.results == [2, 4, 6]
    assert [c[1] for c in client.calls] == [1, 2, 3]
    t0 = time.monotonic()
    with pytest.raises(reach_agent.FlowFailed) as caught:
        await asyncio.wait_for(flow.fan_out(["double", "stuck"], 5, max_wait=0.2), 5)
    assert time.monotonic() - t0 < 2.0
    failed = caught.value.fan_out.failures
    assert [(b.capability, b.error.code) for b in failed] == [("stuck", "TIMEOUT")]
    assert failed[0].error.message == "step 5 (stuck) still running after max_wait 0.2s"


@pytest.mark.parametrize(
    ("targets", "why"),
    [([], "empty"), ("w1", "neither"), (("w1", 5), "neither"), ([1, 2], "neither")],
)
async def test_fan_out_refuses_bad_targets_and_options(targets: Any, why: str) -> None:
    flow, _ = flow_of(FIVE)
    with pytest.raises(ValueError, match=why):
        await flow.fan_out(targets)
    for partial in (0, 1.5, "x"):
        with pytest.raises(ValueError, match=f"partial {partial!r} is not a share in"):
            await flow.fan_out(["w1"], partial=partial)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_wait -1 is not a positive number"):
        await flow.fan_out(["w1"], max_wait=-1)


async def test_a_critical_steps_failure_aborts_and_others_fall_back_as_told() -> None:
    flow, client = flow_of({**FIVE, "echo": lambda p: p})
    assert await flow.step("w1") == 1
    assert await flow.step("w4", critical=False) == 1  # fallback "previous": w1's result
    assert await flow.step("w5", critical=False, fallback="skip") is None
    assert flow.previous == 1  # a fallback is not a result
    with pytest.raises(reach_agent.FlowFailed) as aborted:
        await flow.step("w4", critical=False, fallback="abort")
    assert aborted.value.message == ("flow run-1: step 4 (w4, fallback abort) failed: "
                                     "BIZ_REJECT: no")  # fmt: skip
    with pytest.raises(reach_agent.FlowFailed) as caught:
        await flow.step("w5")
    err = caught.value
    assert err.message == "flow run-1: step 5 (w5, critical) failed: TIMEOUT: slow"
    assert (err.step.index, err.cause.code) == (5, "TIMEOUT")
    assert isinstance(err.__cause__, ReachError)
    assert [(s.index, s.status) for s in flow.steps] == [
        (1, "ok"), (2, "fallback"), (3, "fallback"), (4, "failed"), (5, "failed"),
    ]  # fmt: skip
    assert len(client.calls) == 5
    with pytest.raises(ValueError, match="fallback 'later' is not one of previous, skip, abort"):
        await flow.step("w1", fallback="later")  # type: ignore[arg-type]


async def test_flows_inside_a_task_take_its_request_id_and_share_its_step_numbers() -> None:
    token = trace.CURRENT.set(trace.TraceContext("task-9", "agent-x", {}))
    try:
        first, client = flow_of(FIVE, request_id="")
        second = Flow(client)  # type: ignore[arg-type]
        await first.step("w1")
        await second.step("w2")
        await fan_out(client, ["w3"], partial=1.0)  # type: ignore[arg-type]
        own = Flow(client, request_id="mine")  # type: ignore[arg-type]
        await own.step("w1")
    finally:
        trace.CURRENT.reset(token)
    assert [(c[0], c[2], c[3][schema.H_PARENT_ID]) for c in client.calls] == [
        ("w1", "task-9-1", "task-9"), ("w2", "task-9-2", "task-9"),
        ("w3", "task-9-3", "task-9"), ("w1", "mine-1", "mine"),
    ]  # fmt: skip
    with pytest.raises(ValueError, match="request_id 'bad id' is not valid"):
        Flow(client, request_id="bad id")  # type: ignore[arg-type]


# --- real agents ---------------------------------------------------------------------------


def healthy(broker: Broker, *ids: str) -> bool:
    assert broker.registry is not None
    return all(
        (rec := broker.registry.agents.get(i)) is not None and rec.state == "healthy" for i in ids
    )


def worker(n: int, failing: bool) -> reach_agent.Agent:
    agent = reach_agent.Agent(f"w{n}", [f"work{n}"], heartbeat_interval=0.1)

    @agent.handler(f"work{n}")
    async def work(task: reach_agent.Task) -> Any:
        if failing:
            raise reach_agent.Reject(f"w{n} refuses")
        return {"by": f"w{n}", "got": task.payload}

    return agent


async def test_fan_out_over_five_agents_with_two_failing(
    nats_server: NatsServer, broker: Broker, agents: Any
) -> None:
    for n in range(1, 6):
        await agents(worker(n, failing=n in (2, 4)))
    await wait_for(lambda: healthy(broker, "w1", "w2", "w3", "w4", "w5"), what="workers")
    caps = [f"work{n}" for n in range(1, 6)]
    async with reach_agent.Client(nats_server.url) as client:
        out = await asyncio.wait_for(fan_out(client, caps, {"x": 1}, partial=0.6), 30)
        assert [r["by"] for r in out.results] == ["w1", "w3", "w5"]
        assert [(b.capability, b.error.code) for b in out.failures if b.error] == [
            ("work2", "BIZ_REJECT"), ("work4", "BIZ_REJECT"),
        ]  # fmt: skip
        with pytest.raises(reach_agent.FlowFailed) as caught:
            await asyncio.wait_for(fan_out(client, caps, {"x": 1}, partial=0.8), 30)
        assert caught.value.code == "FLOW_FAILED"
        assert len(caught.value.fan_out.successes) == 3


async def test_a_flow_in_a_handler_aborts_on_its_critical_step_and_is_listed_by_reach_ack(
    nats_server: NatsServer, broker: Broker, agents: Any
) -> None:
    """A planner's handler runs three steps: w1 (critical, ok), w2 (not critical, fails:
    falls back to w1's result), w4 (critical, fails: the flow aborts). The caller gets
    FLOW_FAILED; each step's ack record names the planner's task as its parent."""
    client = reach_agent.Client(nats_server.url)
    fallbacks: list[Any] = []
    planner = reach_agent.Agent("planner", ["plan"], heartbeat_interval=0.1)

    @planner.handler("plan")
    async def plan(task: reach_agent.Task) -> Any:
        flow = Flow(client)
        first = await flow.step("work1", {"step": 1})
        fallbacks.append(await flow.step("work2", {"step": 2}, critical=False))
        return await flow.step("work4", {"step": 3, "first": first})

    for n in (1, 2, 4):
        await agents(worker(n, failing=n != 1))
    await agents(planner)
    await wait_for(lambda: healthy(broker, "w1", "w2", "w4", "planner"), what="agents")
    async with client:
        with pytest.raises(reach_agent.FlowFailed) as caught:
            await asyncio.wait_for(client.call("plan", {}, request_id="run-77", timeout=10), 30)
        assert caught.value.message == ("flow run-77: step 3 (work4, critical) failed: "
                                        "BIZ_REJECT: w4 refuses")  # fmt: skip
        assert fallbacks == [{"by": "w1", "got": {"step": 1}}]

        async def final(rid: str) -> schema.AckRecord:
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                rec = await durable.last(client, rid)
                if rec is not None and rec.state != "received":
                    return rec
                await asyncio.sleep(0.05)
            raise AssertionError(f"no final ack record of {rid}")

        recs = [await final(f"run-77-{n}") for n in (1, 2, 3)]
        assert [(r.agent_id, r.state, r.parent_request_id) for r in recs] == [
            ("w1", "completed", "run-77"), ("w2", "failed", "run-77"),
            ("w4", "failed", "run-77"),
        ]  # fmt: skip
        await final("run-77")
    code, out, err = await reach("ack", "run-77", "--steps", "--json", "-s", nats_server.url)
    assert code == 0, err
    shown = json.loads(out)
    assert shown["record"]["state"] == "failed"
    assert shown["record"]["error"]["code"] == "FLOW_FAILED"
    assert [(s["step"], s["request_id"], s["record"]["agent_id"], s["record"]["state"])
            for s in shown["steps"]] == [
        (1, "run-77-1", "w1", "completed"), (2, "run-77-2", "w2", "failed"),
        (3, "run-77-3", "w4", "failed"),
    ]  # fmt: skip
    code, out, err = await reach("ack", "run-77", "--steps", "-s", nats_server.url)
    assert code == 0, err
    assert out.splitlines()[0] == "flow run-77: 3 step(s) with records"
    assert [line.split()[:4] for line in out.splitlines()[2:]] == [
        ["-", "run-77", "failed", "planner"], ["1", "run-77-1", "completed", "w1"],
        ["2", "run-77-2", "failed", "w2"], ["3", "run-77-3", "failed", "w4"],
    ]  # fmt: skip
