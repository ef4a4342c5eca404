"""Cancellation end to end, against a real nats-server (JetStream: claims, acks, the queue)
and a broker: ``Client.cancel``, a cancelled ``call()`` task, a caller's deadline and a
stream all reach the handler as ``asyncio.CancelledError``; the slot is free again, the claim
and the final ack record say cancelled, and the request id never runs again — also when
it was only queued, or its holder ignores cancels."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import msgspec
import pytest
from nats.aio.client import Client as NATS

import reach_agent
from jetstream.acks import ack_msg_id, publish_record
from jetstream.claims import ClaimStore, claim_key
from jetstream.names import H_REQUEST_ID
from reach_agent.client.calls import encode_payload
from reach_agent.client.config import ClientConfig
from reach_agent.wire import schema
from reach_agent.wire.errors import Cancelled, InProgress, Timeout, from_reply
from reach_broker.broker import Broker
from reach_broker.cluster.natsserver import NatsServer

from .conftest import wait_for
from .test_cli import reach

Agents = Callable[[reach_agent.Agent], Awaitable[reach_agent.Agent]]


class Sleeper:
    """An agent whose handler sleeps (``{"sleep": s}``) or answers at once; it records each
    start, and when and how a run saw its cancel."""

    def __init__(self, agent_id: str, cap: str, **options: Any) -> None:
        self.agent = reach_agent.Agent(agent_id, [cap], max_concurrency=1,
                                       heartbeat_interval=0.1, **options)  # fmt: skip
        self.started: dict[str, asyncio.Event] = {}
        self.runs: list[str] = []
        self.cancelled_at: dict[str, float] = {}
        self.cleaned: list[str] = []

        @self.agent.handler(cap)
        async def handle(task: reach_agent.Task) -> Any:
            rid = task.request_id
            self.runs.append(rid)
            self.started.setdefault(rid, asyncio.Event()).set()
            try:
                await asyncio.sleep(task.payload.get("sleep", 0))
            except asyncio.CancelledError:
                self.cancelled_at[rid] = time.monotonic()
                await asyncio.sleep(0.01)  # cleans up, within the grace
                self.cleaned.append(rid)
                raise
            return {"done": rid}

    async def wait_started(self, rid: str) -> None:
        event = self.started.setdefault(rid, asyncio.Event())
        await asyncio.wait_for(event.wait(), 10)


async def serving(broker: Broker, agents: Agents, agent_id: str, cap: str) -> Sleeper:
    """A :class:`Sleeper` started, once the broker knows it."""
    s = Sleeper(agent_id, cap)
    await agents(s.agent)
    await wait_for(lambda: agent_id in broker.registry.agents, what=f"{agent_id} announced")
    return s


@pytest.fixture
async def client(nats_server: NatsServer, broker: Broker) -> AsyncIterator[reach_agent.Client]:
    async with reach_agent.Client(nats_server.url, ClientConfig(min_timeout_s=0.5)) as c:
        yield c


async def started_call(
    client: reach_agent.Client, sleeper: Sleeper, cap: str, rid: str, **kw: Any
) -> asyncio.Task[Any]:
    task = asyncio.create_task(client.call(cap, {"sleep": 30}, request_id=rid, **kw))
    await sleeper.wait_started(rid)
    return task


async def claim_of(nc: NATS, rid: str) -> schema.Claim:
    stored = await ClaimStore(nc).get(claim_key(rid))
    assert stored is not None
    return schema.claim_decoder.decode(stored.data)


async def claim_in(nc: NATS, rid: str, state: str, limit_s: float = 5.0) -> schema.Claim:
    """The request id's claim once it is in ``state`` (read every 20 ms, at most ``limit_s``):
    a run ends its claim just before it replies, on another connection than the test's."""
    deadline = time.monotonic() + limit_s
    while True:
        stored = await ClaimStore(nc).get(claim_key(rid))
        claim = schema.claim_decoder.decode(stored.data) if stored is not None else None
        if claim is not None and claim.state == state:
            return claim
        assert time.monotonic() < deadline, f"the claim of {rid} is {claim}, not {state}"
        await asyncio.sleep(0.02)


async def orphan_claim(nc: NATS, broker: Broker, rid: str, holder: str, instance: str,
                       cap: str) -> None:  # fmt: skip
    """A ``running`` claim of ``holder``'s process ``instance`` that runs nothing (killed as
    its run began, or a create that landed although its task was refused)."""
    claim = schema.Claim(request_id=rid, agent_id=holder, instance=instance, capability=cap,
                         state="running", at_ms=int(time.time() * 1000),
                         ack_subject=broker.subjects.ack(holder, rid))  # fmt: skip
    created, _ = await ClaimStore(nc).create(claim_key(rid), schema.encoder.encode(claim))
    assert created


async def tell(nc: NATS, broker: Broker, agent_id: str, rid: str) -> schema.CancelState:
    """Tell ``agent_id`` to cancel ``rid``, as a caller's deadline does (but asking, to know
    it arrived): the state it answers."""
    told = schema.Cancel(request_id=rid, reason="the caller's deadline passed")
    answer = await nc.request(broker.subjects.cancel(agent_id), schema.encoder.encode(told),
                              timeout=5)  # fmt: skip
    return schema.decode(schema.cancel_reply_decoder, answer.data, "cancel reply").state


async def copy_to(nc: NATS, broker: Broker, agent_id: str, cap: str, rid: str) -> Any:
    """Send ``agent_id`` a copy of ``rid`` (``{"sleep": 0}``, as the client encodes it) and
    return the error its reply carries (None: a result)."""
    reply = await nc.request(broker.subjects.task(agent_id, cap), encode_payload({"sleep": 0}),
                             headers={H_REQUEST_ID: rid}, timeout=5)  # fmt: skip
    return from_reply(reply.headers, reply.data)


async def restarted(broker: Broker, agents: Agents, old: Sleeper, cap: str) -> Sleeper:
    """``old``'s agent stopped, and a new process of the same agent id serving ``cap``."""
    agent_id = old.agent.agent_id
    await old.agent.stop(grace=2)
    new = Sleeper(agent_id, cap)
    await agents(new.agent)
    await wait_for(lambda: broker.registry.agents[agent_id].state == "healthy", 5,
                   what=f"{agent_id} back")  # fmt: skip
    return new


async def test_client_cancel_interrupts_the_handler_frees_the_slot_and_sticks(
    broker: Broker, agents: Agents, client: reach_agent.Client, nc: NATS
) -> None:
    s = await serving(broker, agents, "sleeper-1", "cancel.one")
    call = await started_call(client, s, "cancel.one", "rid-c1", timeout=60)
    asked = time.monotonic()
    reply = await client.cancel("rid-c1", reason="the user pressed stop")
    assert (reply.state, reply.agent_id) == ("cancelled", "sleeper-1")
    # The handler saw the CancelledError within 200 ms, and cleaned up.
    await wait_for(lambda: "rid-c1" in s.cleaned, 5, what="the handler's cleanup")
    assert s.cancelled_at["rid-c1"] - asked < 0.2, s.cancelled_at["rid-c1"] - asked
    print(f"Client.cancel -> CancelledError in {s.cancelled_at['rid-c1'] - asked:.4f}s")
    # The caller's own call ends CANCELLED.
    with pytest.raises(Cancelled, match="the user pressed stop"):
        await asyncio.wait_for(call, 5)
    # max_concurrency=1: the slot is free, the next call is served at once.
    assert await client.call("cancel.one", {"sleep": 0}, request_id="rid-next", timeout=5) == {
        "done": "rid-next"
    }
    # The final ack record, and the claim, say cancelled.
    rec = await client.wait("rid-c1", 5)
    assert (rec.state, rec.agent_id, rec.error["code"]) == ("failed", "sleeper-1", "CANCELLED")
    claim = await claim_of(nc, "rid-c1")
    assert (claim.state, claim.reason, claim.agent_id) == ("failed", "cancelled", "sleeper-1")
    # A retry (the same request id and body) is answered CANCELLED, never run again.
    with pytest.raises(Cancelled):
        await client.call("cancel.one", {"sleep": 30}, request_id="rid-c1", timeout=5)
    assert s.runs.count("rid-c1") == 1
    assert s.agent.active == 0


async def test_a_cancelled_call_task_and_a_passed_deadline_tell_the_agent(
    broker: Broker, agents: Agents, client: reach_agent.Client
) -> None:
    s = await serving(broker, agents, "sleeper-2", "cancel.two")
    call = await started_call(client, s, "cancel.two", "rid-task", timeout=60)
    cancelled = time.monotonic()
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    await wait_for(lambda: "rid-task" in s.cleaned, 5, what="the handler's cleanup")
    assert s.cancelled_at["rid-task"] - cancelled < 0.2, s.cancelled_at["rid-task"] - cancelled
    print(f"task.cancel() -> CancelledError in {s.cancelled_at['rid-task'] - cancelled:.4f}s")
    rec = await client.wait("rid-task", 5, agent_id="sleeper-2")
    assert (rec.state, rec.error["code"]) == ("failed", "CANCELLED")
    # The deadline: the call gives up with TIMEOUT, and the agent stops too.
    with pytest.raises(Timeout):
        await client.call("cancel.two", {"sleep": 30}, request_id="rid-late", timeout=0.5)
    await wait_for(lambda: "rid-late" in s.cleaned, 5, what="the late run's cleanup")
    rec = await client.wait("rid-late", 5, agent_id="sleeper-2")
    assert (rec.state, rec.error["code"]) == ("failed", "CANCELLED")
    assert "the caller's deadline passed" in rec.error["message"]
    assert s.agent.active == 0


async def test_a_stream_stops_at_the_next_chunk(
    broker: Broker, agents: Agents, client: reach_agent.Client
) -> None:
    agent = reach_agent.Agent("streamer", ["cancel.stream"], max_concurrency=1,
                              heartbeat_interval=0.1)  # fmt: skip
    made: list[int] = []
    closed = asyncio.Event()

    @agent.handler("cancel.stream")
    async def tokens(task: reach_agent.Task) -> AsyncIterator[str]:
        try:
            for i in range(1000):
                made.append(i)
                yield f"t{i}"
                await asyncio.sleep(0.05)
        finally:
            closed.set()

    await agents(agent)
    await wait_for(lambda: "streamer" in broker.registry.agents, what="announced")
    got = []
    with pytest.raises(Cancelled):
        async for chunk in client.stream("cancel.stream", {}, request_id="rid-s", timeout=30):
            got.append(chunk)
            if len(got) == 3:
                await client.cancel("rid-s")
    await asyncio.wait_for(closed.wait(), 2)
    assert got[:3] == ["t0", "t1", "t2"]
    assert len(made) < 10  # stopped, not run to its thousandth chunk
    rec = await client.wait("rid-s", 5, agent_id="streamer")
    assert (rec.state, rec.error["code"]) == ("failed", "CANCELLED")


async def test_a_queued_entry_is_cancelled_and_never_runs(
    broker: Broker, agents: Agents, client: reach_agent.Client
) -> None:
    rid = await client.submit("cancel.queued", {"sleep": 0})
    reply = await client.cancel(rid)
    assert (reply.state, reply.agent_id, reply.detail) == (
        "cancelled", "_broker", "removed 1 queued entry",
    )  # fmt: skip
    rec = await client.wait(rid, 5)
    assert (rec.state, rec.error["code"]) == ("failed", "CANCELLED")
    s = await serving(broker, agents, "late-agent", "cancel.queued")
    # Sent again by hand with the same request id: the claim answers, nothing runs.
    with pytest.raises(Cancelled):
        await client.call("cancel.queued", {"sleep": 0}, request_id=rid, timeout=5)
    assert s.runs == []
    assert broker.metrics.compensation_result["cancelled"]._value.get() == 1


async def test_a_holder_that_ignores_the_cancel_still_ends_cancelled(
    broker: Broker, agents: Agents, client: reach_agent.Client, nc: NATS
) -> None:
    """The claim names an agent that answers no cancel (gone, or not written with the SDK):
    the broker takes the claim over, so the caller's result is CANCELLED either way."""
    ghost = schema.Claim(request_id="rid-ghost", agent_id="ghost", instance="x",
                         capability="cancel.ghost", state="running",
                         at_ms=int(time.time() * 1000))  # fmt: skip
    created, _ = await ClaimStore(nc).create(claim_key("rid-ghost"), schema.encoder.encode(ghost))
    assert created
    reply = await client.cancel("rid-ghost")
    assert (reply.state, reply.agent_id) == ("cancelled", "_broker")
    claim = await claim_of(nc, "rid-ghost")
    assert (claim.agent_id, claim.state, claim.reason) == ("_broker", "failed", "cancelled")
    rec = await client.wait("rid-ghost", 5)
    assert (rec.state, rec.error["code"]) == ("failed", "CANCELLED")
    s = await serving(broker, agents, "other", "cancel.ghost")
    with pytest.raises(Cancelled):
        await client.call("cancel.ghost", {"sleep": 0}, request_id="rid-ghost", timeout=5)
    assert s.runs == []


@pytest.mark.parametrize(("code", "state"), [("BIZ_REJECT", "finished"),
                                              ("CANCELLED", "cancelled")])  # fmt: skip
async def test_a_cancel_finds_a_request_its_holders_stored_failure_ended(
    broker: Broker, client: reach_agent.Client, nc: NATS, code: str, state: str
) -> None:
    """The claim names a holder gone before its ``failed`` end of the claim was stored, but
    its ``failed`` record is: an error that is not retryable ends the claim (docs/protocol.md,
    Claims). The cancel reports the request as that record left it, and the broker takes
    nothing over (it took the claim and wrote its own CANCELLED over the holder's answer)."""
    rid = f"rid-ended-{code.lower()}"
    ghost = schema.Claim(request_id=rid, agent_id="ghost", instance="x",
                         capability="cancel.ghost", state="running",
                         at_ms=int(time.time() * 1000))  # fmt: skip
    created, _ = await ClaimStore(nc).create(claim_key(rid), schema.encoder.encode(ghost))
    assert created
    error = {"code": code, "message": "the holder's own answer"}
    record = schema.AckRecord(request_id=rid, agent_id="ghost", capability="cancel.ghost",
                              state="failed", at_ms=2, error=error)  # fmt: skip
    await publish_record(nc.jetstream(), f"reach.ack.ghost.{rid}",
                         ack_msg_id("ghost", rid, "failed"),
                         schema.encoder.encode(record))  # fmt: skip
    reply = await client.cancel(rid)
    expected = (state, "ghost", "ghost's failed record is stored")
    assert (reply.state, reply.agent_id, reply.detail) == expected
    claim = await claim_of(nc, rid)
    assert (claim.agent_id, claim.state) == ("ghost", "running")
    rec = await client.wait(rid, 5)
    assert (rec.state, rec.agent_id, rec.error) == ("failed", "ghost", error)


async def test_a_finished_request_stays_finished(
    broker: Broker, agents: Agents, client: reach_agent.Client
) -> None:
    await serving(broker, agents, "quick", "cancel.done")
    assert await client.call("cancel.done", {"sleep": 0}, request_id="rid-done", timeout=5)
    reply = await client.cancel("rid-done")
    assert (reply.state, reply.agent_id) == ("finished", "quick")
    rec = await client.wait("rid-done", 5)
    assert (rec.state, rec.result) == ("completed", {"done": "rid-done"})


async def test_a_late_cancel_at_a_restarted_agent_leaves_the_finished_result_standing(
    broker: Broker, agents: Agents, client: reach_agent.Client, nc: NATS
) -> None:
    """The caller's deadline passes just as its agent completes the request, and the agent's
    process is restarted before the cancel reaches it: the new process remembers the
    cancel (it never ran the request), yet the caller's retry gets the stored result — the
    request's one final state — not CANCELLED (found by loadtest.nemesis: no_final_state)."""
    first = await serving(broker, agents, "phoenix", "cancel.late")
    assert await client.call("cancel.late", {"sleep": 0}, request_id="rid-late-done",
                             timeout=5) == {"done": "rid-late-done"}  # fmt: skip
    again = await restarted(broker, agents, first, "cancel.late")
    assert await tell(nc, broker, "phoenix", "rid-late-done") == "unknown"
    assert await client.call("cancel.late", {"sleep": 0}, request_id="rid-late-done",
                             timeout=5) == {"done": "rid-late-done"}  # fmt: skip
    assert again.runs == [] and first.runs == ["rid-late-done"]
    # A request it never saw and nobody ran stays cancelled for it — durably: the copy ran
    # already cancelled (no handler), so its claim and its record say so, and a process
    # that does not remember the cancel answers it the same.
    assert await tell(nc, broker, "phoenix", "rid-never") == "unknown"
    with pytest.raises(Cancelled):
        await client.call("cancel.late", {"sleep": 0}, request_id="rid-never", timeout=5)
    rec = await client.wait("rid-never", 5)
    assert (rec.state, rec.agent_id, rec.error["code"]) == ("failed", "phoenix", "CANCELLED")
    claim = await claim_in(nc, "rid-never", "failed")
    assert (claim.agent_id, claim.reason) == ("phoenix", "cancelled")
    third = await restarted(broker, agents, again, "cancel.late")
    with pytest.raises(Cancelled):
        await client.call("cancel.late", {"sleep": 0}, request_id="rid-never", timeout=5)
    assert first.runs == ["rid-late-done"] and again.runs == [] and third.runs == []


async def test_a_cancel_the_restarted_taker_remembered_is_never_run_after_its_next_restart(
    broker: Broker, agents: Agents, client: reach_agent.Client, nc: NATS
) -> None:
    """loadtest.nemesis c3-000570: the taker was SIGKILLed as its run began; the call's
    deadline told it to cancel, and its restarted process, running nothing, remembered the
    cancel; a repeat got CANCELLED from that memory alone; the taker was killed again (the
    memory gone) and a recall ran the request. Now the repeat runs already cancelled: it
    takes the dead process's claim over and ends it cancelled, so the recall, whichever of
    the two agents it reaches, gets CANCELLED and nothing runs. (Fails before the change:
    the recall runs.)"""
    taker = await serving(broker, agents, "taker", "cancel.c3")
    spare = await serving(broker, agents, "spare", "cancel.c3")
    await orphan_claim(nc, broker, "rid-c3", "taker", "killed-process", "cancel.c3")
    assert await tell(nc, broker, "taker", "rid-c3") == "unknown"
    assert isinstance(await copy_to(nc, broker, "taker", "cancel.c3", "rid-c3"), Cancelled)
    again = await restarted(broker, agents, taker, "cancel.c3")
    with pytest.raises(Cancelled):
        await client.call("cancel.c3", {"sleep": 0}, request_id="rid-c3", timeout=5)
    assert taker.runs == [] and again.runs == [] and spare.runs == []
    claim = await claim_in(nc, "rid-c3", "failed")
    assert (claim.agent_id, claim.instance, claim.reason) == (
        "taker", taker.agent.instance, "cancelled",
    )  # fmt: skip
    rec = await client.wait("rid-c3", 5)
    assert (rec.state, rec.agent_id, rec.error["code"]) == ("failed", "taker", "CANCELLED")


async def test_a_remembered_cancel_asked_again_is_unknown_and_the_brokers_settle_it(
    broker: Broker, agents: Agents, client: reach_agent.Client, nc: NATS
) -> None:
    """loadtest.nemesis c1-000842: the agent refused the task (its claim create was not
    confirmed in time, but was stored) and was told to cancel at the deadline. Asked again,
    it answered ``cancelled`` from its memory, so ``Client.cancel`` took that and made
    nothing durable. Now it answers ``unknown`` again, and the brokers settle the cancel."""
    keeper = await serving(broker, agents, "keeper", "cancel.c1")
    await orphan_claim(nc, broker, "rid-c1", "keeper", keeper.agent.instance, "cancel.c1")
    assert await tell(nc, broker, "keeper", "rid-c1") == "unknown"
    assert await tell(nc, broker, "keeper", "rid-c1") == "unknown"
    reply = await client.cancel("rid-c1")
    assert (reply.state, reply.agent_id) == ("cancelled", "_broker")
    claim = await claim_of(nc, "rid-c1")
    assert (claim.agent_id, claim.state, claim.reason) == ("_broker", "failed", "cancelled")
    rec = await client.wait("rid-c1", 5)
    assert (rec.state, rec.agent_id, rec.error["code"], rec.error["reason"]) == (
        "failed", broker.broker_id, "CANCELLED", "cancelled",
    )  # fmt: skip
    # A recall reaching the agent that remembers the cancel gets that record's CANCELLED.
    err = await copy_to(nc, broker, "keeper", "cancel.c1", "rid-c1")
    assert isinstance(err, Cancelled)
    assert err.message == "request_id 'rid-c1' was cancelled: cancelled by its caller"
    assert keeper.runs == []


async def test_a_remembered_cancel_leaves_a_claim_another_agent_runs_alone(
    broker: Broker, agents: Agents, client: reach_agent.Client, nc: NATS
) -> None:
    """A copy of a request another agent runs is answered IN_PROGRESS, as any copy, although
    a cancel of it is remembered here, and the agent's one slot is taken; the cancel stays
    remembered: once the claim is released (its holder declared offline), the next copy
    takes it over already cancelled."""
    s = await serving(broker, agents, "bystander", "cancel.held")
    await orphan_claim(nc, broker, "rid-held", "runner", "r1", "cancel.held")
    assert await tell(nc, broker, "bystander", "rid-held") == "unknown"
    busy = await started_call(client, s, "cancel.held", "rid-busy", timeout=60)
    err = await copy_to(nc, broker, "bystander", "cancel.held", "rid-held")
    assert isinstance(err, InProgress) and err.holder == "runner"
    assert await tell(nc, broker, "bystander", "rid-held") == "unknown"
    stored = await ClaimStore(nc).get(claim_key("rid-held"))
    assert stored is not None
    held = schema.claim_decoder.decode(stored.data)
    released = msgspec.structs.replace(held, state="released", reason="a test")
    assert await ClaimStore(nc).swap(claim_key("rid-held"), schema.encoder.encode(released),
                                     stored.revision) is not None  # fmt: skip
    assert isinstance(await copy_to(nc, broker, "bystander", "cancel.held", "rid-held"),
                      Cancelled)  # fmt: skip
    claim = await claim_in(nc, "rid-held", "failed")
    assert (claim.agent_id, claim.reason) == ("bystander", "cancelled")
    rec = await client.wait("rid-held", 5)
    assert (rec.state, rec.agent_id, rec.error["code"]) == ("failed", "bystander", "CANCELLED")
    assert s.runs == ["rid-busy"]
    await client.cancel("rid-busy")
    with pytest.raises(Cancelled):
        await asyncio.wait_for(busy, 5)


async def test_reach_cancel_and_reach_ack(
    broker: Broker, agents: Agents, client: reach_agent.Client, nats_server: NatsServer
) -> None:
    s = await serving(broker, agents, "cli-sleeper", "cancel.cli")
    call = await started_call(client, s, "cancel.cli", "rid-cli", timeout=60)
    code, out, err = await reach("cancel", "rid-cli", "--reason", "from the shell",
                                 "-s", nats_server.url)  # fmt: skip
    assert (code, out, err) == (0, "rid-cli: cancelled by agent cli-sleeper\n", "")
    with pytest.raises(Cancelled, match="from the shell"):
        await asyncio.wait_for(call, 5)
    await wait_for(lambda: "rid-cli" in s.cleaned, 5, what="the handler's cleanup")
    code, out, _ = await reach("ack", "rid-cli", "--json", "-s", nats_server.url)
    assert code == 0
    [rec] = [json.loads(line) for line in out.splitlines()]
    assert (rec["state"], rec["agent_id"], rec["error"]["code"]) == (
        "failed", "cli-sleeper", "CANCELLED",
    )  # fmt: skip
    assert "from the shell" in rec["error"]["message"]
    code, out, _ = await reach("cancel", "rid-cli", "--json", "-s", nats_server.url)
    assert (code, json.loads(out)) == (0, {"request_id": "rid-cli", "state": "cancelled",
                                           "agent_id": "cli-sleeper",
                                           "detail": "its claim is cancelled"})  # fmt: skip
    code, _, err = await reach("cancel", "not a request id", "-s", nats_server.url)
    assert code == 1 and "INVALID_REQUEST" in err, err


async def test_a_deadline_spent_waiting_for_a_slot_does_not_cancel_the_request_id(
    broker: Broker, agents: Agents, client: reach_agent.Client
) -> None:
    """Only an agent that took the request is told at the deadline: one that refused it
    (busy) must not remember it as cancelled, so the same request id runs later."""
    s = await serving(broker, agents, "busy-one", "cancel.busy")
    first = await started_call(client, s, "cancel.busy", "rid-first", timeout=60)
    with pytest.raises((Timeout, reach_agent.TargetBusy, reach_agent.Overloaded)):
        await client.call("cancel.busy", {"sleep": 0}, request_id="rid-later", timeout=0.5)
    assert "rid-later" not in s.runs
    await client.cancel("rid-first")
    with pytest.raises(Cancelled):
        await asyncio.wait_for(first, 5)
    assert await client.call("cancel.busy", {"sleep": 0}, request_id="rid-later", timeout=5) == {
        "done": "rid-later"
    }


async def test_a_handler_that_ignores_its_cancel_is_cancelled_again_after_the_grace(
    broker: Broker, agents: Agents, client: reach_agent.Client
) -> None:
    agent = reach_agent.Agent("stubborn", ["cancel.grace"], max_concurrency=1,
                              heartbeat_interval=0.1, cancel_grace=0.3)  # fmt: skip
    seen: list[float] = []
    started = asyncio.Event()

    @agent.handler("cancel.grace")
    async def stubborn(task: reach_agent.Task) -> str:
        started.set()
        while True:
            try:
                await asyncio.sleep(30)
            except asyncio.CancelledError:
                seen.append(time.monotonic())
                if len(seen) == 2:
                    raise
                # the first cancel is ignored: it keeps working

    await agents(agent)
    await wait_for(lambda: "stubborn" in broker.registry.agents, what="announced")
    call = asyncio.create_task(client.call("cancel.grace", {}, request_id="rid-g", timeout=60))
    await asyncio.wait_for(started.wait(), 10)
    await client.cancel("rid-g")
    with pytest.raises(Cancelled):
        await asyncio.wait_for(call, 5)
    await wait_for(lambda: len(seen) == 2 and agent.active == 0, 5, what="the second cancel")
    assert seen[1] - seen[0] >= 0.29, seen[1] - seen[0]  # not before the grace (0.3 s)
    rec = await client.wait("rid-g", 5)
    assert (rec.state, rec.error["code"]) == ("failed", "CANCELLED")
