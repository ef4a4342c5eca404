"""A2A tasks on reach's durable acks, end to end: a real nats-server, a broker with its
gateway, SDK agents, and the a2a-sdk's own client (1.0), or raw JSON-RPC for the 0.3 shapes
and the requests a client would not send."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("a2a.client", reason="needs the extra 'a2a'")

import httpx
from a2a.client import A2ACardResolver, Client, ClientConfig, ClientFactory
from a2a.types import a2a_pb2 as pb
from a2a.utils.errors import (
    InternalError,
    InvalidParamsError,
    TaskNotCancelableError,
    TaskNotFoundError,
    UnsupportedOperationError,
)
from google.protobuf.json_format import MessageToDict

import reach_agent
from jetstream.names import A2A_TASKS_STREAM
from reach_broker.broker import Broker
from reach_broker.cluster.natsserver import NatsServer
from reach_broker.config import A2ASection
from reach_broker.interop.a2a.gateway import A2AGateway
from reach_broker.service.metrics import Metrics

from .agents.procs import AgentProcess
from .conftest import BrokerFactory, fast_config, wait_for

Agents = Callable[[reach_agent.Agent], Awaitable[reach_agent.Agent]]
A2A_1_0 = {"A2A-Version": "1.0"}


def make_gateway(broker: Broker, **cfg: Any) -> A2AGateway:
    return A2AGateway(A2ASection(port=0, **cfg), nc=broker.nc, subjects=broker.subjects,
                      registry=broker.registry, router=broker.router, clock=broker.clock,
                      replicas=broker.replicas, wall=broker.wall)  # fmt: skip


@pytest.fixture
async def gateway(broker: Broker) -> AsyncIterator[A2AGateway]:
    async with make_gateway(broker) as gw:
        yield gw


@pytest.fixture
async def http() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(timeout=10.0) as client:
        yield client


class Gate:
    """A handler's run held until the test lets it finish (or its cancel arrives)."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.started: list[str] = []
        self.cancelled: list[str] = []

    def agent(self, agent_id: str, capability: str, *, hint: float | None = None,
              **options: Any) -> reach_agent.Agent:  # fmt: skip
        options.setdefault("heartbeat_interval", 0.1)
        agent = reach_agent.Agent(agent_id, [capability], max_concurrency=8, timeout_hint=hint,
                                  **options)  # fmt: skip

        @agent.handler(capability)
        async def held(task: reach_agent.Task) -> Any:
            self.started.append(task.request_id)
            try:
                await self.release.wait()
            except asyncio.CancelledError:
                self.cancelled.append(task.request_id)
                raise
            return {"echo": task.payload, "by": agent_id}

        return agent


async def healthy(broker: Broker, *agent_ids: str) -> None:
    def all_healthy() -> bool:
        recs = [broker.registry.agents.get(a) for a in agent_ids]
        return all(r is not None and r.state == "healthy" for r in recs)

    await wait_for(all_healthy, 10, what=f"{agent_ids} healthy")


def message(text: str, *, task_id: str = "", context_id: str = "", **metadata: Any) -> pb.Message:
    return pb.Message(message_id=f"m-{time.monotonic_ns()}", role=pb.ROLE_USER,
                      parts=[pb.Part(text=text)], task_id=task_id, context_id=context_id,
                      metadata=metadata or None)  # fmt: skip


def request(msg: pb.Message, *, at_once: bool = False) -> pb.SendMessageRequest:
    config = pb.SendMessageConfiguration(return_immediately=at_once)
    return pb.SendMessageRequest(message=msg, configuration=config)


async def client_of(http: httpx.AsyncClient, url: str, path: str = "",
                    streaming: bool = False) -> Client:  # fmt: skip
    resolver = A2ACardResolver(http, url)
    card = await resolver.get_agent_card(f"{path}/.well-known/agent-card.json" if path else None)
    return ClientFactory(ClientConfig(streaming=streaming, httpx_client=http)).create(card)


async def send(client: Client, req: pb.SendMessageRequest) -> list[pb.StreamResponse]:
    return [event async for event in client.send_message(req)]


async def state_of(client: Client, task_id: str) -> pb.TaskState:
    return (await client.get_task(pb.GetTaskRequest(id=task_id))).status.state


async def until_state(client: Client, task_id: str, state: pb.TaskState) -> pb.Task:
    deadline = time.monotonic() + 10
    while True:
        task = await client.get_task(pb.GetTaskRequest(id=task_id))
        if task.status.state == state:
            return task
        assert time.monotonic() < deadline, (
            f"task {task_id} still {pb.TaskState.Name(task.status.state)}, "
            f"not {pb.TaskState.Name(state)}"
        )
        await asyncio.sleep(0.05)


def data_of(part: pb.Part) -> Any:
    return MessageToDict(part)["data"]


async def rpc(http: httpx.AsyncClient, url: str, method: str, params: Any,
              headers: dict[str, str] | None = None) -> dict[str, Any]:  # fmt: skip
    reply = await http.post(url, json={"jsonrpc": "2.0", "id": 1, "method": method,
                                       "params": params}, headers=headers)  # fmt: skip
    assert reply.status_code == 200, reply.text
    body: dict[str, Any] = reply.json()
    return body


# --- SendMessage answered with a task, GetTask --------------------------------------------


async def test_return_immediately_answers_a_working_task_get_task_reads_to_its_result(
    broker: Broker, gateway: A2AGateway, agents: Agents, http: httpx.AsyncClient
) -> None:
    gate = Gate()
    await agents(gate.agent("alpha", "summarize"))
    await healthy(broker, "alpha")
    client = await client_of(http, gateway.url, "/a2a/summarize")

    [event] = await send(client, request(message("hello", request_id="rid-t1"), at_once=True))
    task = event.task
    assert (task.id, task.status.state) == ("rid-t1", pb.TASK_STATE_WORKING)
    assert [m.parts[0].text for m in task.history] == ["hello"]
    assert (task.history[0].task_id, task.context_id) == ("rid-t1", "rid-t1")
    await wait_for(lambda: gate.started == ["rid-t1"], 5, what="the handler runs it")
    got = await client.get_task(pb.GetTaskRequest(id="rid-t1"))
    assert (got.status.state, list(got.artifacts)) == (pb.TASK_STATE_WORKING, [])

    gate.release.set()
    done = await until_state(client, "rid-t1", pb.TASK_STATE_COMPLETED)
    [artifact] = done.artifacts
    assert (artifact.artifact_id, data_of(artifact.parts[0])) == (
        "result", {"echo": {"text": "hello"}, "by": "alpha"})  # fmt: skip
    assert MessageToDict(done.metadata) == {"request_id": "rid-t1", "capability": "summarize",
                                            "requests": ["rid-t1"]}  # fmt: skip
    assert done.status.timestamp.ToMilliseconds() > 0
    bare = await client.get_task(pb.GetTaskRequest(id="rid-t1", history_length=0))
    assert list(bare.history) == []
    with pytest.raises(TaskNotFoundError, match="task no-such-task not found"):
        await client.get_task(pb.GetTaskRequest(id="no-such-task"))
    # Another capability's endpoint does not show it; reach's own endpoint does.
    other = await client_of(http, gateway.url, "/a2a/translate")
    with pytest.raises(TaskNotFoundError):
        await other.get_task(pb.GetTaskRequest(id="rid-t1"))
    root = await client_of(http, gateway.url)
    assert await state_of(root, "rid-t1") == pb.TASK_STATE_COMPLETED
    # The same request id again is the same task: not run twice.
    [again] = await send(client, request(message("hello", request_id="rid-t1"), at_once=True))
    assert (again.task.id, again.task.status.state) == ("rid-t1", pb.TASK_STATE_COMPLETED)
    assert gate.started == ["rid-t1"]


async def test_a_capability_that_runs_long_is_answered_with_a_task_and_a_quick_one_with_its_result(
    broker: Broker, gateway: A2AGateway, agents: Agents, http: httpx.AsyncClient
) -> None:
    gate = Gate()
    await agents(gate.agent("slow", "research", hint=60.0))
    quick = reach_agent.Agent("quick", ["echo"], max_concurrency=4, heartbeat_interval=0.1)

    @quick.handler("echo")
    async def echo(task: reach_agent.Task) -> Any:
        if (task.payload or {}).get("text") == "refuse":
            raise reach_agent.Reject("refused on purpose")
        return task.payload

    await agents(quick)
    await healthy(broker, "slow", "quick")
    research = await client_of(http, gateway.url, "/a2a/research")
    [event] = await send(research, request(message("a long question")))
    assert event.task.status.state == pb.TASK_STATE_WORKING
    task_id = event.task.id
    gate.release.set()
    await until_state(research, task_id, pb.TASK_STATE_COMPLETED)

    echo_client = await client_of(http, gateway.url, "/a2a/echo")
    [answer] = await send(echo_client, request(message("hi")))
    assert data_of(answer.message.parts[0]) == {"text": "hi"}
    with pytest.raises(TaskNotFoundError):  # a message answered at once is no task
        await echo_client.get_task(pb.GetTaskRequest(id=answer.message.metadata["request_id"]))
    # A refusal is a task, kept like any: GetTask finds it.
    [refused] = await send(echo_client, request(message("refuse")))
    assert refused.task.status.state == pb.TASK_STATE_REJECTED
    got = await echo_client.get_task(pb.GetTaskRequest(id=refused.task.id))
    assert got.status.state == pb.TASK_STATE_REJECTED
    assert got.status.message.parts[0].text == "BIZ_REJECT: refused on purpose"
    with pytest.raises(TaskNotCancelableError, match="is already TASK_STATE_REJECTED"):
        await echo_client.cancel_task(pb.CancelTaskRequest(id=refused.task.id))


async def test_a_routing_failure_is_an_error_and_leaves_no_task(
    broker: Broker, gateway: A2AGateway, http: httpx.AsyncClient
) -> None:
    client = await client_of(http, gateway.url, "/a2a/nobody")
    with pytest.raises(InternalError, match="NO_REACHABLE_AGENT: no agent has the capability"):
        await send(client, request(message("x", request_id="rid-none"), at_once=True))
    with pytest.raises(TaskNotFoundError):
        await client.get_task(pb.GetTaskRequest(id="rid-none"))


# --- ListTasks -----------------------------------------------------------------------------


async def test_list_tasks_pages_the_callers_tasks_newest_first_and_filters_them(
    broker: Broker, gateway: A2AGateway, agents: Agents, http: httpx.AsyncClient
) -> None:
    gate = Gate()
    await agents(gate.agent("alpha", "summarize"))
    await agents(gate.agent("beta", "translate"))
    await healthy(broker, "alpha", "beta")
    client = await client_of(http, gateway.url, "/a2a/summarize")
    made = []
    for i in range(5):
        [event] = await send(client, request(message(f"t{i}", context_id="ctx-a"), at_once=True))
        made.append(event.task.id)
    [other] = await send(client, request(message("elsewhere", context_id="ctx-b"), at_once=True))
    translate = await client_of(http, gateway.url, "/a2a/translate")
    [foreign] = await send(translate, request(message("x", context_id="ctx-a"), at_once=True))

    first = await client.list_tasks(pb.ListTasksRequest(context_id="ctx-a", page_size=2))
    assert (first.total_size, first.page_size) == (5, 2)
    page = pb.ListTasksRequest(context_id="ctx-a", page_size=2, page_token=first.next_page_token)
    second = await client.list_tasks(page)
    page.page_token = second.next_page_token
    third = await client.list_tasks(page)
    assert third.next_page_token == ""
    listed = [t.id for page in (first, second, third) for t in page.tasks]
    assert listed == made[::-1]  # newest first, each once, none of another capability
    assert all(t.status.state == pb.TASK_STATE_WORKING for t in first.tasks)
    assert [list(t.artifacts) for t in first.tasks] == [[], []]

    # Finished ones move to the front (their status is newer), and the status filters.
    gate.release.set()
    await until_state(client, made[1], pb.TASK_STATE_COMPLETED)
    for task_id in (*made, other.task.id):
        await until_state(client, task_id, pb.TASK_STATE_COMPLETED)
    done = await client.list_tasks(pb.ListTasksRequest(status=pb.TASK_STATE_COMPLETED,
                                                       include_artifacts=True,
                                                       history_length=0))  # fmt: skip
    assert sorted(t.id for t in done.tasks) == sorted([*made, other.task.id])
    stamps = [t.status.timestamp.ToMilliseconds() for t in done.tasks]
    assert stamps == sorted(stamps, reverse=True)
    assert all(t.artifacts[0].artifact_id == "result" and not t.history for t in done.tasks)
    working = await client.list_tasks(pb.ListTasksRequest(status=pb.TASK_STATE_WORKING))
    assert (list(working.tasks), working.total_size, working.next_page_token) == ([], 0, "")
    cut = max(stamps) + 1
    await asyncio.sleep(0.01)
    gate.release.clear()
    [late] = await send(client, request(message("late", context_id="ctx-a"), at_once=True))
    since = pb.ListTasksRequest(context_id="ctx-a")
    since.status_timestamp_after.FromMilliseconds(cut)
    assert [t.id for t in (await client.list_tasks(since)).tasks] == [late.task.id]
    gate.release.set()
    # reach's own endpoint lists every task of the caller.
    root = await client_of(http, gateway.url)
    everything = await root.list_tasks(pb.ListTasksRequest(context_id="ctx-a"))
    assert sorted(t.id for t in everything.tasks) == sorted([*made, late.task.id,
                                                             foreign.task.id])  # fmt: skip
    # Each listing's consumer is gone soon after (not left behind for minutes).
    js = broker.nc.jetstream()
    deadline = time.monotonic() + 15
    while (await js.stream_info(A2A_TASKS_STREAM)).state.consumer_count:
        assert time.monotonic() < deadline, "listing consumers left behind"
        await asyncio.sleep(0.2)


async def test_list_tasks_refuses_invalid_params_with_32602(
    gateway: A2AGateway, http: httpx.AsyncClient
) -> None:
    url = f"{gateway.url}/a2a/summarize"
    cases = [
        ({"pageSize": 0}, "minimum page size is 1"),
        ({"pageSize": 101}, "maximum page size is 100"),
        ({"historyLength": -1}, "history length must be non-negative"),
        ({"pageToken": "invalid-token-xyz"}, "params.pageToken 'invalid-token-xyz' is not a "
         "page token of this gateway (pass nextPageToken as it was given)"),
        ({"status": "INVALID_STATUS"}, "params.status 'INVALID_STATUS' is not a task state "
         "(one of TASK_STATE_AUTH_REQUIRED, TASK_STATE_CANCELED, TASK_STATE_COMPLETED, "
         "TASK_STATE_FAILED, TASK_STATE_INPUT_REQUIRED, TASK_STATE_REJECTED, "
         "TASK_STATE_SUBMITTED, TASK_STATE_WORKING)"),
    ]  # fmt: skip
    for params, why in cases:
        body = await rpc(http, url, "ListTasks", params, A2A_1_0)
        assert body["error"]["code"] == -32602, (params, body)
        assert body["error"]["message"] == why
    bad_time = await rpc(http, url, "ListTasks", {"statusTimestampAfter": "-1"}, A2A_1_0)
    assert bad_time["error"]["code"] == -32602
    empty = await rpc(http, url, "ListTasks", {"contextId": "nothing-here"}, A2A_1_0)
    assert empty["result"] == {"tasks": [], "nextPageToken": "", "pageSize": 0, "totalSize": 0}


# --- SendStreamingMessage, SubscribeToTask, CancelTask -------------------------------------


async def test_a_task_streams_its_state_and_result_and_can_be_subscribed_to_again(
    broker: Broker, gateway: A2AGateway, agents: Agents, http: httpx.AsyncClient
) -> None:
    gate = Gate()
    await agents(gate.agent("slow", "research", hint=60.0))
    await healthy(broker, "slow")
    client = await client_of(http, gateway.url, "/a2a/research", streaming=True)
    stream = client.send_message(request(message("dig", request_id="rid-s1")))
    first = await anext(stream)
    assert (first.task.id, first.task.status.state) == ("rid-s1", pb.TASK_STATE_WORKING)
    await stream.aclose()  # type: ignore[attr-defined]  # the client goes away: it runs on

    async def subscribed() -> list[pb.StreamResponse]:
        return [e async for e in client.subscribe(pb.SubscribeToTaskRequest(id="rid-s1"))]

    lost = asyncio.create_task(subscribed())
    await wait_for(lambda: gate.started == ["rid-s1"], 5, what="the handler runs it")
    await asyncio.sleep(0.2)
    lost.cancel()  # a disconnect mid-subscription
    with contextlib.suppress(asyncio.CancelledError):
        await lost
    again = asyncio.create_task(subscribed())
    await asyncio.sleep(0.3)
    assert not again.done()
    gate.release.set()
    events = await asyncio.wait_for(again, 15)
    kinds = [e.WhichOneof("payload") for e in events]
    assert kinds == ["task", "artifact_update", "status_update"]
    assert events[0].task.status.state == pb.TASK_STATE_WORKING
    assert data_of(events[1].artifact_update.artifact.parts[0])["echo"] == {"text": "dig"}
    assert events[2].status_update.status.state == pb.TASK_STATE_COMPLETED
    with pytest.raises(UnsupportedOperationError, match="task rid-s1 is TASK_STATE_COMPLETED"):
        await subscribed()
    with pytest.raises(TaskNotFoundError):
        await asyncio.wait_for(
            anext(client.subscribe(pb.SubscribeToTaskRequest(id="nonexistent-task-id"))), 5
        )


async def test_cancel_task_stops_the_agents_handler_and_get_task_shows_canceled(
    broker: Broker, gateway: A2AGateway, agents: Agents, http: httpx.AsyncClient
) -> None:
    gate = Gate()
    await agents(gate.agent("slow", "research", hint=60.0))
    await healthy(broker, "slow")
    client = await client_of(http, gateway.url, "/a2a/research")
    await send(client, request(message("dig", request_id="rid-c1")))
    await wait_for(lambda: gate.started == ["rid-c1"], 5, what="the handler runs it")
    cancelled = await client.cancel_task(pb.CancelTaskRequest(id="rid-c1"))
    assert (cancelled.id, cancelled.status.state) == ("rid-c1", pb.TASK_STATE_CANCELED)
    await wait_for(lambda: gate.cancelled == ["rid-c1"], 5, what="the handler sees its cancel")
    got = await client.get_task(pb.GetTaskRequest(id="rid-c1"))
    assert got.status.state == pb.TASK_STATE_CANCELED
    assert got.status.message.parts[0].text == "CANCELLED: A2A CancelTask"
    # The agent's own record agrees: the request ended CANCELLED.
    async with reach_agent.Client(nc=broker.nc) as reach:
        record = await reach.wait("rid-c1", 5, agent_id="slow")
    assert (record.state, (record.error or {}).get("code")) == ("failed", "CANCELLED")
    with pytest.raises(TaskNotCancelableError, match="task rid-c1 is already TASK_STATE_CANCELED"):
        await client.cancel_task(pb.CancelTaskRequest(id="rid-c1"))
    with pytest.raises(TaskNotFoundError):
        await client.cancel_task(pb.CancelTaskRequest(id="nonexistent-task-id"))


async def test_a_task_survives_its_brokers_restart(
    nats_server: NatsServer, broker_factory: BrokerFactory, http: httpx.AsyncClient
) -> None:
    """The task's record and its agent's ack records are in JetStream: a new broker (on a
    restarted server, same store) reads the final state and the result."""
    broker = await broker_factory()
    gate = Gate()
    agent = gate.agent("slow", "research", hint=60.0)
    await agent.start(nats_server.url)
    restarted: NatsServer | None = None
    try:
        await healthy(broker, "slow")
        async with make_gateway(broker) as gateway:
            client = await client_of(http, gateway.url, "/a2a/research")
            [event] = await send(client, request(message("survive", request_id="rid-r1")))
            assert event.task.status.state == pb.TASK_STATE_WORKING
            await wait_for(lambda: gate.started == ["rid-r1"], 5, what="the handler runs it")
        await broker.stop()
        port, store = nats_server.port, nats_server.store_dir
        nats_server.kill()
        restarted = NatsServer(port=port, store_dir=store)
        await asyncio.to_thread(restarted.start)
        gate.release.set()  # it finishes while no broker runs: its agent stores the result
        second = Broker(fast_config(restarted.url), metrics=Metrics())
        await second.start()
        try:
            async with make_gateway(second) as gateway:
                client = await client_of(http, gateway.url, "/a2a/research")
                done = await until_state(client, "rid-r1", pb.TASK_STATE_COMPLETED)
                assert data_of(done.artifacts[0].parts[0]) == {
                    "echo": {"text": "survive"}, "by": "slow"}  # fmt: skip
                assert [m.parts[0].text for m in done.history] == ["survive"]
        finally:
            await second.stop()
    finally:
        await agent.stop(grace=1)
        if restarted is not None:
            await asyncio.to_thread(restarted.stop)


# --- more messages to a task ---------------------------------------------------------------


async def test_a_message_naming_a_task_is_its_next_turn(
    broker: Broker, gateway: A2AGateway, agents: Agents, http: httpx.AsyncClient
) -> None:
    gate = Gate()
    await agents(gate.agent("alpha", "summarize"))
    await healthy(broker, "alpha")
    client = await client_of(http, gateway.url, "/a2a/summarize")
    await send(client, request(message("first", request_id="rid-m1"), at_once=True))
    [more] = await send(client, request(message("second", task_id="rid-m1"), at_once=True))
    assert (more.task.id, more.task.status.state) == ("rid-m1", pb.TASK_STATE_WORKING)
    assert [m.parts[0].text for m in more.task.history] == ["first", "second"]
    await wait_for(lambda: gate.started == ["rid-m1", "rid-m1-2"], 5, what="both turns run")
    last = await client.get_task(pb.GetTaskRequest(id="rid-m1", history_length=1))
    assert [m.parts[0].text for m in last.history] == ["second"]
    with pytest.raises(InvalidParamsError, match=r"message\.contextId 'other' is not the context"):
        await send(client, request(message("x", task_id="rid-m1", context_id="other")))
    with pytest.raises(TaskNotFoundError, match="task no-such-task not found"):
        await send(client, request(message("x", task_id="no-such-task")))
    gate.release.set()
    done = await until_state(client, "rid-m1", pb.TASK_STATE_COMPLETED)
    assert [(a.artifact_id, data_of(a.parts[0])["echo"]) for a in done.artifacts] == [
        ("result", {"text": "first"}), ("result-2", {"text": "second"})]  # fmt: skip
    with pytest.raises(UnsupportedOperationError, match="task rid-m1 is TASK_STATE_COMPLETED: "
                       "it takes no more messages"):  # fmt: skip
        await send(client, request(message("third", task_id="rid-m1")))


async def test_an_agent_that_asks_for_input_is_answered_by_the_next_message(
    broker: Broker, gateway: A2AGateway, agents: Agents, http: httpx.AsyncClient
) -> None:
    agent = reach_agent.Agent("asker", ["translate"], max_concurrency=2, heartbeat_interval=0.1)

    @agent.handler("translate")
    async def translate(task: reach_agent.Task) -> Any:
        text = (task.payload or {}).get("text", "")
        if not text.startswith("to:"):
            raise reach_agent.InputRequired("which language?")
        return f"translated {text}"

    await agents(agent)
    await healthy(broker, "asker")
    client = await client_of(http, gateway.url, "/a2a/translate")
    [asked] = await send(client, request(message("bonjour")))
    task = asked.task
    assert task.status.state == pb.TASK_STATE_INPUT_REQUIRED
    assert task.status.message.parts[0].text == "INPUT_REQUIRED: which language?"
    [answered] = await send(client, request(message("to:en", task_id=task.id)))
    assert answered.task.status.state == pb.TASK_STATE_COMPLETED
    assert [a.parts[0].text for a in answered.task.artifacts] == ["translated to:en"]
    assert MessageToDict(answered.task.metadata)["requests"] == [task.id, f"{task.id}-2"]


async def test_a_task_whose_agent_dies_fails_once_its_claim_is_released(
    nats_server: NatsServer, broker: Broker, gateway: A2AGateway, http: httpx.AsyncClient,
    tmp_path: Path,
) -> None:  # fmt: skip
    proc = AgentProcess("worker.py", nats_server.url, "doomed", "research", "--log",
                        str(tmp_path / "doomed.log"), "--hint", "60", "--delay", "60")  # fmt: skip
    try:
        await healthy(broker, "doomed")
        client = await client_of(http, gateway.url, "/a2a/research")
        [event] = await send(client, request(message("x", request_id="rid-lost")))
        assert event.task.status.state == pb.TASK_STATE_WORKING
        await wait_for(lambda: "start rid-lost" in (tmp_path / "doomed.log").read_text(), 10,
                       what="the worker runs it")  # fmt: skip
        os.kill(proc.pid, signal.SIGKILL)
        assert proc.wait(5) == -signal.SIGKILL
        failed = await until_state(client, "rid-lost", pb.TASK_STATE_FAILED)
        assert failed.status.message.parts[0].text.startswith(
            "LOST: agent doomed went offline before it finished"
        )
    finally:
        proc.stop()


# --- the origin as one capability, and the 0.3 shapes --------------------------------------


async def test_a_root_skill_makes_the_origin_one_capabilitys_agent(
    broker: Broker, agents: Agents, http: httpx.AsyncClient
) -> None:
    quick = reach_agent.Agent("echoer", ["echo"], max_concurrency=4, heartbeat_interval=0.1,
                              metadata={"skills": {"echo": {"description": "Says it back",
                                                            "examples": ["hello"]}}})  # fmt: skip

    @quick.handler("echo")
    async def echo(task: reach_agent.Task) -> Any:
        return task.payload

    await agents(quick)
    await healthy(broker, "echoer")
    async with make_gateway(broker, root_skill="echo") as gw:
        card = (await http.get(f"{gw.url}/.well-known/agent-card.json")).json()
        assert (card["name"], card["url"]) == ("echo", f"{gw.url}/")
        assert [(s["id"], s["description"], s["examples"]) for s in card["skills"]] == [
            ("echo", "Says it back", ["hello"])]  # fmt: skip
        assert card["capabilities"]["extensions"][0]["params"]["by_state"] == {"healthy": 1}
        client = await client_of(http, gw.url)  # knows nothing of reach's paths
        [answer] = await send(client, request(message("hello")))
        assert data_of(answer.message.parts[0]) == {"text": "hello"}
        same = (await http.get(f"{gw.url}/a2a/echo/.well-known/agent-card.json")).json()
        assert (same["name"], same["url"]) == ("echo", f"{gw.url}/a2a/echo")
        bad = await http.get(f"{gw.url}/a2a/Not Valid/.well-known/agent-card.json")
        assert (bad.status_code, bad.json()["error"]["code"]) == (400, "INVALID_CAPABILITY")


async def test_the_0_3_methods_answer_tasks_and_invalid_params_with_32602(
    broker: Broker, gateway: A2AGateway, agents: Agents, http: httpx.AsyncClient
) -> None:
    gate = Gate()
    # A heartbeat a second: the test sends its messages over a few seconds, and an agent
    # beating every 0.1 s was judged suspect (NO_REACHABLE_AGENT, a final answer) whenever
    # the test process was starved for 0.3 s (the full suite at load 10).
    await agents(gate.agent("alpha", "summarize", heartbeat_interval=1.0))
    await healthy(broker, "alpha")
    url = f"{gateway.url}/a2a/summarize"
    msg = {"kind": "message", "messageId": "m-03", "role": "user",
           "parts": [{"kind": "text", "text": "hi"}]}  # fmt: skip
    invalid = await rpc(http, url, "message/send", {"message": {**msg, "parts": "invalid"}})
    assert invalid["error"]["code"] == -32602
    assert invalid["error"]["message"].startswith("params.message.parts: ")
    envelope = await http.post(url, json={"jsonrpc": "1.0", "id": 1, "method": "message/send",
                                          "params": {"message": msg}})  # fmt: skip
    assert envelope.json()["error"]["code"] == -32600
    started = await rpc(http, url, "message/send",
                        {"message": msg, "configuration": {"blocking": False}})  # fmt: skip
    task = started["result"]
    assert (task["kind"], task["status"]["state"]) == ("task", "working")
    got = await rpc(http, url, "tasks/get", {"id": task["id"], "historyLength": 1})
    assert got["result"]["history"][0]["parts"] == [{"kind": "text", "text": "hi"}]
    missing = await rpc(http, url, "tasks/get", {"id": "nonexistent-task-id"})
    assert missing["error"]["code"] == -32001
    gone = await rpc(http, url, "tasks/cancel", {"id": task["id"]})
    assert gone["result"]["status"]["state"] == "canceled"
    again = await rpc(http, url, "tasks/cancel", {"id": task["id"]})
    assert again["error"]["code"] == -32002


async def test_malformed_requests_get_json_rpc_errors_never_a_crash(
    gateway: A2AGateway, http: httpx.AsyncClient
) -> None:
    url = f"{gateway.url}/a2a/summarize"
    cases = [
        ({"jsonrpc": "2.0", "id": 1, "method": {"name": "tasks/get"}, "params": {}}, -32600),
        ({"jsonrpc": "2.0", "id": {"x": 1}, "method": "ListTasks", "params": {"status": "X"}},
         -32600),
        ({"jsonrpc": "2.0", "id": 2, "method": "message/stream", "params": []}, -32600),
        ({"jsonrpc": "2.0", "id": 3, "method": "invalid/nonexistent/method", "params": {}},
         -32601),
        ({"jsonrpc": "2.0", "id": 4, "method": "tasks/get", "params": {"id": 7}}, -32602),
    ]  # fmt: skip
    for body, code in cases:
        reply = await http.post(url, json=body)
        assert (reply.status_code, reply.json()["error"]["code"]) == (200, code), body
    # An error of a streaming method, to a client that asked for a stream, is a stream.
    sse = await http.post(url, json={"jsonrpc": "2.0", "id": 5, "method": "SubscribeToTask",
                                     "params": {"id": "nonexistent-task-id"}},
                          headers={**A2A_1_0, "Accept": "text/event-stream"})  # fmt: skip
    assert sse.headers["content-type"].startswith("text/event-stream")
    event, data = sse.text.strip().split("\r\n")
    assert event == "event: error"
    assert json.loads(data.removeprefix("data: "))["error"]["code"] == -32001
