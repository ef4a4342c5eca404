"""The A2A registry and gateway end to end: a real nats-server (with the disconnect
advisories of configs/nats-server.conf), a broker, SDK agents, and the a2a-sdk's own client
resolving cards and sending messages through the gateway's HTTP port."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("a2a.client", reason="needs the extra 'a2a'")

import httpx
from a2a.client import A2ACardResolver, ClientConfig, ClientFactory
from a2a.types import a2a_pb2 as pb
from a2a.utils.errors import (
    InternalError,
    InvalidParamsError,
    TaskNotCancelableError,
    TaskNotFoundError,
)
from google.protobuf import struct_pb2
from google.protobuf.json_format import MessageToDict, ParseDict

import reach_agent
from reach_broker.broker import Broker
from reach_broker.cluster.natsserver import NatsServer
from reach_broker.config import A2ASection
from reach_broker.interop.a2a.cards import AVAILABILITY_URI
from reach_broker.interop.a2a.gateway import A2AGateway

from .agents.procs import AgentProcess
from .conftest import wait_for
from .test_a2a_cards import valid_1_0

Agents = Callable[[reach_agent.Agent], Awaitable[reach_agent.Agent]]
TOKEN = "a-test-token-0123456789"


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


def echo_agent(agent_id: str, *caps: str, **options: Any) -> reach_agent.Agent:
    agent = reach_agent.Agent(agent_id, list(caps), max_concurrency=4, heartbeat_interval=0.1,
                              **options)  # fmt: skip
    for cap in caps:

        @agent.handler(cap)
        async def handle(task: reach_agent.Task) -> Any:
            if (task.payload or {}).get("text") == "refuse":
                raise reach_agent.Reject("refused on purpose")
            return {"agent": agent_id, "capability": task.capability, "echo": task.payload}

    return agent


async def healthy(broker: Broker, *agent_ids: str, within: float = 5.0) -> None:
    def all_healthy() -> bool:
        recs = [broker.registry.agents.get(a) for a in agent_ids]
        return all(r is not None and r.state == "healthy" for r in recs)

    await wait_for(all_healthy, within, what=f"{agent_ids} healthy")


def text_message(text: str, **metadata: Any) -> pb.SendMessageRequest:
    msg = pb.Message(message_id="m-1", role=pb.ROLE_USER, parts=[pb.Part(text=text)])
    return pb.SendMessageRequest(message=msg, metadata=metadata or None)


async def send(http: httpx.AsyncClient, card: pb.AgentCard, request: pb.SendMessageRequest,
               *, streaming: bool = False) -> list[pb.StreamResponse]:  # fmt: skip
    client = ClientFactory(ClientConfig(streaming=streaming, httpx_client=http)).create(card)
    return [event async for event in client.send_message(request)]


def data_of(part: pb.Part) -> Any:
    return MessageToDict(part)["data"]


async def test_the_sdk_client_resolves_reachs_card_and_each_agents_card(
    broker: Broker, gateway: A2AGateway, agents: Agents, http: httpx.AsyncClient
) -> None:
    meta = {
        "description": "Summarizes and translates",
        "skills": {"summarize": {"description": "A short summary", "examples": ["tl;dr"]}},
    }
    await agents(echo_agent("alpha", "summarize", "translate", version="1.2.0", metadata=meta))
    await agents(echo_agent("beta", "summarize", region="eu"))
    await healthy(broker, "alpha", "beta")

    listing = (await http.get(f"{gateway.url}/agents")).json()
    assert [card["name"] for card in listing["agents"]] == ["alpha", "beta"]
    for data in listing["agents"]:
        valid_1_0(data)
    resolver = A2ACardResolver(http, gateway.url)
    reach_card = await resolver.get_agent_card()
    assert reach_card.name == "reach"
    assert [s.id for s in reach_card.skills] == ["summarize", "translate"]
    assert reach_card.supported_interfaces[0].url == f"{gateway.url}/a2a"
    valid_1_0((await http.get(f"{gateway.url}/.well-known/agent-card.json")).json())

    alpha = await resolver.get_agent_card("/agents/alpha/.well-known/agent-card.json")
    assert (alpha.description, alpha.version) == ("Summarizes and translates", "1.2.0")
    assert [(s.id, s.description, list(s.examples)) for s in alpha.skills] == [
        ("summarize", "A short summary", ["tl;dr"]),
        ("translate", "translate, served by alpha", []),
    ]
    assert alpha.supported_interfaces[0].url == f"{gateway.url}/agents/alpha/a2a"
    [ext] = alpha.capabilities.extensions
    assert (ext.uri, ext.params["state"], ext.params["max_concurrency"]) == (
        AVAILABILITY_URI, "healthy", 4)  # fmt: skip
    beta = await resolver.get_agent_card("/agents/beta/.well-known/agent-card.json")
    assert list(beta.skills[0].tags) == ["reach", "region:eu"]
    valid_1_0((await http.get(f"{gateway.url}/agents/beta/.well-known/agent-card.json")).json())

    eu = (await http.get(f"{gateway.url}/agents", params={"capability": "translate"})).json()
    assert [card["name"] for card in eu["agents"]] == ["alpha"]
    missing = await http.get(f"{gateway.url}/agents/nobody/.well-known/agent-card.json")
    assert (missing.status_code, missing.json()) == (404, {"error": {
        "code": "INVALID_REQUEST", "message": "agent 'nobody' is not registered"}})  # fmt: skip
    bad = await http.get(f"{gateway.url}/agents", params={"state": "asleep"})
    assert bad.status_code == 400
    assert bad.json()["error"]["message"] == (
        "state 'asleep' is not one of healthy, suspect, offline, recovering, draining"
    )


async def test_message_send_reaches_an_sdk_agent_and_returns_its_result(
    broker: Broker, gateway: A2AGateway, agents: Agents, http: httpx.AsyncClient
) -> None:
    await agents(echo_agent("alpha", "summarize"))
    await healthy(broker, "alpha")
    resolver = A2ACardResolver(http, gateway.url)
    reach_card = await resolver.get_agent_card()

    [event] = await send(http, reach_card, text_message("hello", skill="summarize"))
    answer = event.message
    assert answer.role == pb.ROLE_AGENT
    assert data_of(answer.parts[0]) == {
        "agent": "alpha", "capability": "summarize", "echo": {"text": "hello"}}  # fmt: skip
    meta = MessageToDict(answer.metadata)
    assert meta["capability"] == "summarize"
    assert answer.context_id == meta["request_id"]

    # Streamed: a working task, the result as an artifact, then completed.
    events = await send(http, reach_card, text_message("again", skill="summarize"),
                        streaming=True)  # fmt: skip
    kinds = [e.WhichOneof("payload") for e in events]
    assert kinds == ["task", "artifact_update", "status_update"]
    assert events[0].task.status.state == pb.TASK_STATE_WORKING
    assert data_of(events[1].artifact_update.artifact.parts[0])["echo"] == {"text": "again"}
    assert events[2].status_update.status.state == pb.TASK_STATE_COMPLETED

    # A refusal by the agent is a rejected task, not an error.
    [rejected] = await send(http, reach_card, text_message("refuse", skill="summarize"))
    assert rejected.task.status.state == pb.TASK_STATE_REJECTED
    assert rejected.task.status.message.parts[0].text == "BIZ_REJECT: refused on purpose"


async def test_a_streaming_handler_streams_through_the_gateway(
    broker: Broker, gateway: A2AGateway, agents: Agents, http: httpx.AsyncClient
) -> None:
    agent = reach_agent.Agent("poet", ["verse"], max_concurrency=2, heartbeat_interval=0.1)

    @agent.handler("verse")
    async def verse(task: reach_agent.Task) -> Any:
        for word in ("roses ", "are ", "red"):
            yield word

    await agents(agent)
    await healthy(broker, "poet")
    card = await A2ACardResolver(http, gateway.url).get_agent_card(
        "/agents/poet/.well-known/agent-card.json")  # fmt: skip
    events = await send(http, card, text_message("a poem"), streaming=True)
    updates = [e.artifact_update for e in events if e.HasField("artifact_update")]
    assert [u.artifact.parts[0].text for u in updates] == ["roses ", "are ", "red"]
    assert [u.append for u in updates] == [False, True, True]
    assert events[-1].status_update.status.state == pb.TASK_STATE_COMPLETED
    [joined] = await send(http, card, text_message("a poem"))
    assert joined.message.parts[0].text == "roses are red"


async def test_a2a_cancel_task_cancels_the_request(
    broker: Broker, gateway: A2AGateway, agents: Agents, http: httpx.AsyncClient
) -> None:
    """``CancelTask`` of the task id (= the request id) reaches the agent running it; the
    message waiting on it answers a ``CANCELED`` task."""
    agent = reach_agent.Agent("slowpoke", ["slow"], max_concurrency=1, heartbeat_interval=0.1)
    running, seen = asyncio.Event(), asyncio.Event()

    @agent.handler("slow")
    async def slow(task: reach_agent.Task) -> Any:
        running.set()
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            seen.set()
            raise

    await agents(agent)
    await healthy(broker, "slowpoke")
    card = await A2ACardResolver(http, gateway.url).get_agent_card()
    client = ClientFactory(ClientConfig(streaming=False, httpx_client=http)).create(card)
    waiting = asyncio.create_task(send(http, card, text_message("x", skill="slow",
                                                                request_id="rid-a2a")))  # fmt: skip
    # Its handler running, not just admitted: a cancel that comes while the request is still
    # being claimed stops it before its handler starts (the handler never sees it).
    await asyncio.wait_for(running.wait(), 10)
    task = await client.cancel_task(pb.CancelTaskRequest(id="rid-a2a"))
    assert (task.id, task.status.state) == ("rid-a2a", pb.TASK_STATE_CANCELED)
    await asyncio.wait_for(seen.wait(), 5)
    [event] = await asyncio.wait_for(waiting, 10)
    assert event.task.status.state == pb.TASK_STATE_CANCELED
    assert event.task.status.message.parts[0].text.startswith("CANCELLED: ")
    # The cancelled message is a task now (GetTask finds it); one answered with a Message
    # never was.
    got = await client.get_task(pb.GetTaskRequest(id="rid-a2a"))
    assert got.status.state == pb.TASK_STATE_CANCELED
    with pytest.raises(TaskNotCancelableError, match="task rid-a2a is already TASK_STATE_CANCELED"):
        await client.cancel_task(pb.CancelTaskRequest(id="rid-a2a"))
    await agents(echo_agent("quick", "fast"))
    await healthy(broker, "quick")
    [answer] = await send(http, card, text_message("y", skill="fast", request_id="rid-a2a-done"))
    assert answer.HasField("message")
    with pytest.raises(TaskNotFoundError, match="task rid-a2a-done not found"):
        await client.cancel_task(pb.CancelTaskRequest(id="rid-a2a-done"))


async def test_an_agents_own_endpoint_is_pinned_to_it(
    broker: Broker, gateway: A2AGateway, agents: Agents, http: httpx.AsyncClient
) -> None:
    await agents(echo_agent("alpha", "summarize"))
    await agents(echo_agent("beta", "summarize", "translate"))
    await healthy(broker, "alpha", "beta")
    resolver = A2ACardResolver(http, gateway.url)
    alpha = await resolver.get_agent_card("/agents/alpha/.well-known/agent-card.json")
    beta = await resolver.get_agent_card("/agents/beta/.well-known/agent-card.json")
    for _ in range(5):
        [event] = await send(http, alpha, text_message("x"))
        assert data_of(event.message.parts[0])["agent"] == "alpha"
    [event] = await send(http, beta, text_message("x", skill="translate"))
    assert data_of(event.message.parts[0])["capability"] == "translate"
    with pytest.raises(InvalidParamsError) as several:
        await send(http, beta, text_message("x"))
    assert several.value.message == (
        "agent 'beta' has the skills summarize, translate: name one in metadata.skill"
    )
    with pytest.raises(InternalError) as other:
        await send(http, alpha, text_message("x", skill="translate"))
    assert other.value.message == (
        "NO_REACHABLE_AGENT: agent 'alpha' has no capability 'translate' (it has summarize)"
    )


async def test_an_unreachable_capability_is_an_a2a_error_naming_the_reason(
    broker: Broker, gateway: A2AGateway, agents: Agents, http: httpx.AsyncClient
) -> None:
    await agents(echo_agent("alpha", "summarize"))
    await healthy(broker, "alpha")
    reach_card = await A2ACardResolver(http, gateway.url).get_agent_card()
    with pytest.raises(InternalError) as unknown:
        await send(http, reach_card, text_message("hi", skill="translation"))
    assert unknown.value.message == "NO_REACHABLE_AGENT: no agent has the capability 'translation'"
    assert unknown.value.data == {"code": "NO_REACHABLE_AGENT"}

    # Draining (a leave; its heartbeats keep it there): known, not routed, and said so.
    broker.fanout.emit(broker.registry.leave("alpha", broker.clock(), "test"))
    with pytest.raises(InternalError) as down:
        await send(http, reach_card, text_message("hi", skill="summarize"))
    assert down.value.message == (
        "NO_REACHABLE_AGENT: none of the 1 agents with 'summarize' is healthy (1 draining)"
    )

    # The A2A 0.3 method on the per-capability endpoint, as a plain JSON-RPC request.
    reply = await http.post(f"{gateway.url}/a2a/translation", json={
        "jsonrpc": "2.0", "id": 7, "method": "message/send", "params": {"message": {
            "kind": "message", "messageId": "m-9", "role": "user",
            "parts": [{"kind": "text", "text": "hi"}]}}},
        headers={"A2A-Version": "0.3"})  # fmt: skip
    assert reply.json()["error"]["message"] == (
        "NO_REACHABLE_AGENT: no agent has the capability 'translation'"
    )
    with pytest.raises(InvalidParamsError) as no_skill:
        await send(http, reach_card, text_message("hi"))
    assert no_skill.value.message == "no skill: name one in metadata.skill, or POST to /a2a/<skill>"


async def test_a_sigkilled_agent_is_offline_on_its_card_within_a_second(
    nats_server: NatsServer, broker: Broker, gateway: A2AGateway, http: httpx.AsyncClient,
    tmp_path: Path,
) -> None:  # fmt: skip
    assert broker.advisories.available is True  # configs/nats-server.conf's advisories
    proc = AgentProcess("worker.py", nats_server.url, "alpha", "summarize", "--log",
                        str(tmp_path / "alpha.log"), "--hb", "1.0")  # fmt: skip
    card_url = f"{gateway.url}/agents/alpha/.well-known/agent-card.json"

    async def availability() -> dict[str, Any]:
        reply = await http.get(card_url)
        if reply.status_code != 200:
            return {}
        params: dict[str, Any] = reply.json()["capabilities"]["extensions"][0]["params"]
        return params

    try:
        await healthy(broker, "alpha", within=20.0)  # a Python process starting
        assert (await availability())["state"] == "healthy"
        reach_card = await A2ACardResolver(http, gateway.url).get_agent_card()
        [event] = await send(http, reach_card, pb.SendMessageRequest(
            message=pb.Message(message_id="m-2", role=pb.ROLE_USER,
                               parts=[pb.Part(data=ParseDict({"n": 7}, struct_pb2.Value()))]),
            metadata={"skill": "summarize"}))  # fmt: skip
        assert data_of(event.message.parts[0]) == {"agent": "alpha", "n": 7.0}

        os.kill(proc.pid, signal.SIGKILL)
        assert proc.wait(5) == -signal.SIGKILL
        states: list[str] = []

        async def offline() -> bool:
            states.append((await availability())["state"])
            return states[-1] == "offline"

        await wait_async(offline, 1.0, what="alpha offline on its card")
        offline_cards = await http.get(f"{gateway.url}/agents", params={"state": "offline"})
        assert [c["name"] for c in offline_cards.json()["agents"]] == ["alpha"]
        reach_card = await A2ACardResolver(http, gateway.url).get_agent_card()
        assert list(reach_card.skills) == []
    finally:
        proc.stop()


async def wait_async(
    predicate: Callable[[], Awaitable[bool]],
    timeout: float,  # noqa: ASYNC109 - a polling deadline
    what: str,
) -> None:
    import time

    deadline = time.monotonic() + timeout
    while not await predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")


async def test_a_token_guards_every_request(
    broker: Broker, agents: Agents, http: httpx.AsyncClient
) -> None:
    await agents(echo_agent("alpha", "summarize"))
    await healthy(broker, "alpha")
    async with make_gateway(broker, token=TOKEN) as gw:
        for path in ("/agents", "/.well-known/agent-card.json"):
            refused = await http.get(f"{gw.url}{path}")
            assert refused.status_code == 401
            assert refused.headers["www-authenticate"] == 'Bearer realm="reach"'
            assert refused.json()["error"]["code"] == "FORBIDDEN"
        wrong = await http.get(f"{gw.url}/agents", headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401
        async with httpx.AsyncClient(headers={"Authorization": f"Bearer {TOKEN}"},
                                     timeout=10.0) as authed:  # fmt: skip
            card = await A2ACardResolver(authed, gw.url).get_agent_card()
            assert list(card.security_requirements[0].schemes) == ["bearer"]
            [event] = await send(authed, card, text_message("hi", skill="summarize"))
            assert data_of(event.message.parts[0])["agent"] == "alpha"


async def test_a_body_over_8_mib_is_refused(gateway: A2AGateway, http: httpx.AsyncClient) -> None:
    reply = await http.post(f"{gateway.url}/a2a/summarize", content=b" " * (8 * 1024 * 1024 + 1))
    assert reply.status_code == 413
    message = "request body larger than 8388608 bytes"
    assert reply.json() == {"error": {"code": "INVALID_REQUEST", "message": message}}


async def test_a_page_elsewhere_cannot_reach_the_gateway_on_loopback(
    gateway: A2AGateway, http: httpx.AsyncClient
) -> None:
    rebound = await http.get(f"{gateway.url}/agents", headers={"Host": "evil.example:80"})
    assert (rebound.status_code, rebound.json()) == (403, {"error": {
        "code": "FORBIDDEN",
        "message": "this gateway answers only under a loopback Host name"}})  # fmt: skip
    body = b'{"jsonrpc": "2.0", "id": 1, "method": "message/send", "params": {}}'
    simple = await http.post(f"{gateway.url}/a2a/summarize", content=body,
                             headers={"Content-Type": "text/plain"})  # fmt: skip
    assert (simple.status_code, simple.json()) == (415, {"error": {
        "code": "INVALID_REQUEST",
        "message": "a JSON-RPC request needs Content-Type: application/json"}})  # fmt: skip
    local = await http.get(f"{gateway.url}/agents", headers={"Host": "localhost"})
    assert (local.status_code, local.json()) == (200, {"agents": []})
