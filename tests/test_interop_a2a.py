"""A2A agents through the sidecar: ``reach adapt a2a URL`` (a real process) in front of a real
a2a-sdk server agent (:mod:`tests.agents.a2a_agent`, its own process). Its card's skills are
the capabilities; ``Client.call`` and ``Client.stream`` reach it (the request id as the A2A
message id), its task states map to reach codes, a 0.3 card works as a 1.0 one, and a killed
agent is out of the routes within 1.5 s."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("a2a.client", reason="needs the extra 'a2a'")

import httpx

import reach_agent
from reach_agent.wire.errors import BizReject, InputRequired, InternalError
from reach_broker.broker import Broker
from reach_broker.cluster.natsserver import NatsServer

from .conftest import wait_for
from .test_cli import CLI, cli_env


class A2AAgent:
    """The a2a-sdk agent process; ``seen()`` and ``cancelled()`` read what it recorded."""

    def __init__(self, proc: asyncio.subprocess.Process, port: int) -> None:
        self.proc = proc
        self.url = f"http://127.0.0.1:{port}"

    async def _get(self, path: str) -> Any:
        async with httpx.AsyncClient(timeout=5) as http:
            return (await http.get(self.url + path)).json()

    async def seen(self) -> list[dict[str, Any]]:
        return await self._get("/_seen")  # type: ignore[no-any-return]

    async def cancelled(self) -> list[str]:
        return await self._get("/_cancelled")  # type: ignore[no-any-return]

    def kill(self) -> None:
        if self.proc.returncode is None:
            os.kill(self.proc.pid, signal.SIGKILL)


Processes = Callable[..., Awaitable[Any]]


@pytest.fixture
async def a2a_agent() -> AsyncIterator[Processes]:
    """Start a2a-sdk agent processes (``--card 0.3``, ``--no-streaming``); killed at teardown."""
    started: list[A2AAgent] = []

    async def start(*args: str) -> A2AAgent:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "tests.agents.a2a_agent", *args,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL,
            cwd=str(Path(__file__).parent.parent),
        )  # fmt: skip
        assert proc.stdout is not None
        line = await asyncio.wait_for(proc.stdout.readline(), 30)
        assert line.startswith(b"ready "), line
        agent = A2AAgent(proc, int(line.split()[1]))
        started.append(agent)
        return agent

    try:
        yield start
    finally:
        for agent in started:
            agent.kill()
            await agent.proc.wait()


@pytest.fixture
async def sidecar(nats_server: NatsServer, tmp_path: Path) -> AsyncIterator[Processes]:
    """``reach adapt a2a`` processes; returns (process, the lines it printed at start)."""
    procs: list[asyncio.subprocess.Process] = []

    async def start(url: str, *extra: str, lines: int = 3) -> tuple[Any, list[str]]:
        proc = await asyncio.create_subprocess_exec(
            *CLI, "adapt", "a2a", url, "-s", nats_server.url, "--interval", "0.2", *extra,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
            env={**cli_env(), "REACH_ACK_DIR": str(tmp_path / "acks")},
        )  # fmt: skip
        procs.append(proc)
        assert proc.stdout is not None
        out = []
        for _ in range(lines):
            line = await asyncio.wait_for(proc.stdout.readline(), 30)
            if not line:
                assert proc.stderr is not None
                raise AssertionError(f"sidecar ended: {(await proc.stderr.read()).decode()}")
            out.append(line.decode().rstrip("\n"))
        return proc, out

    try:
        yield start
    finally:
        for proc in procs:
            if proc.returncode is None:
                proc.terminate()
            try:
                await asyncio.wait_for(proc.communicate(), 20)
            except TimeoutError:
                proc.kill()
                await proc.wait()


def state(broker: Broker, agent_id: str) -> str | None:
    rec = broker.registry.agents.get(agent_id)
    return None if rec is None else rec.state


async def test_an_a2a_agent_is_routed_called_and_streamed(
    broker: Broker, nats_server: NatsServer, a2a_agent: Processes, sidecar: Processes
) -> None:
    agent = await a2a_agent()
    _, lines = await sidecar(agent.url, "--max-concurrency", "3")
    assert lines == [
        f"adapting echo-agent -> A2A 1.0 agent 'Echo Agent' at {agent.url} (streaming)",
        "  skill echo-text -> capability echo-text",
        "  skill summarize -> capability summarize",
    ]
    await wait_for(lambda: state(broker, "echo-agent") == "healthy", 10, what="echo-agent healthy")
    rec = broker.registry.agents["echo-agent"]
    assert (rec.announce.agent_type, rec.max_concurrency) == ("a2a", 3)
    assert sorted(rec.capabilities) == ["echo-text", "summarize"]
    async with reach_agent.Client(nats_server.url) as client:
        # A call: the streamed text chunks joined; the request id is the A2A message id.
        assert await client.call("echo-text", "hello", request_id="rid-call", timeout=10) == (
            "echo:hello"
        )
        # A stream: chunk by chunk.
        chunks = [c async for c in client.stream("summarize", {"text": "hi"}, timeout=10,
                                                 request_id="rid-stream")]  # fmt: skip
        assert chunks == ["echo:", "hi"]
        # A data payload goes as a data part, and comes back as one chunk (joined: a list).
        assert await client.call("echo-text", {"n": 1}, timeout=10) == [{"echo": {"n": 1}}]
        # The same request id and body again: the stored result, no second message to the
        # agent; with another body, refused (a request id names one request).
        assert await client.call("echo-text", "hello", request_id="rid-call", timeout=10) == (
            "echo:hello"
        )
        with pytest.raises(reach_agent.IdempotencyMismatch, match="request_id 'rid-call'"):
            await client.call("echo-text", "other", request_id="rid-call", timeout=10)
        seen = await agent.seen()
        assert [(s["message_id"], s["request_id"], s["skill"]) for s in seen[:2]] == [
            ("rid-call", "rid-call", "echo-text"),
            ("rid-stream", "rid-stream", "summarize"),
        ]
        assert len(seen) == 3
        # Task states: input-required is a code at once (not a hang), rejected and failed.
        t0 = time.monotonic()
        with pytest.raises(InputRequired, match="which language"):
            await client.call("echo-text", "ask", timeout=30)
        assert time.monotonic() - t0 < 10
        with pytest.raises(BizReject, match="not my kind of task"):
            await client.call("echo-text", "reject", timeout=10)
        with pytest.raises(InternalError, match="the model crashed"):
            await client.call("echo-text", "fail", timeout=10)
        assert await client.call("echo-text", "direct", timeout=10) == "direct answer"


async def test_a_0_3_card_without_streaming_picks_and_renames_skills(
    broker: Broker, nats_server: NatsServer, a2a_agent: Processes, sidecar: Processes
) -> None:
    agent = await a2a_agent("--card", "0.3", "--no-streaming")
    _, lines = await sidecar(agent.url, "--agent-id", "old-echo", "--skill", "summarize",
                             "--capability", "summarize=text.summary", lines=2)  # fmt: skip
    assert lines == [
        f"adapting old-echo -> A2A 0.3.0 agent 'Echo Agent' at {agent.url} (not streaming)",
        "  skill summarize -> capability text.summary",
    ]
    await wait_for(lambda: state(broker, "old-echo") == "healthy", 10, what="old-echo healthy")
    assert broker.registry.agents["old-echo"].capabilities == ("text.summary",)
    async with reach_agent.Client(nats_server.url) as client:
        # message/send returns at once; tasks/get until it completed; the parts joined.
        assert await client.call("text.summary", "hello", timeout=10) == "echo:hello"
        assert await client.call("text.summary", {"k": "v"}, timeout=10) == {"echo": {"k": "v"}}
        with pytest.raises(InputRequired, match="which language"):
            await client.call("text.summary", "ask", timeout=30)
        # A plain stream reader of an agent that does not stream: the whole result, once.
        assert [c async for c in client.stream("text.summary", "x", timeout=10)] == ["echo:x"]
    assert [s["skill"] for s in await agent.seen()] == ["summarize"] * 4


async def test_a_killed_a2a_agent_leaves_the_routes_within_a_second_and_a_half(
    broker: Broker, nats_server: NatsServer, a2a_agent: Processes, sidecar: Processes
) -> None:
    agent = await a2a_agent()
    await sidecar(agent.url, "--interval", "5")  # heartbeats alone would take ~8 s
    await wait_for(lambda: state(broker, "echo-agent") == "healthy", 10, what="echo-agent healthy")
    agent.kill()
    killed = time.monotonic()
    await wait_for(lambda: state(broker, "echo-agent") == "draining", 1.5,
                   what="echo-agent out of the routes within 1.5 s of the kill")  # fmt: skip
    took = time.monotonic() - killed
    async with reach_agent.Client(nats_server.url) as client:
        with pytest.raises(reach_agent.NoReachableAgent):
            await client.route("echo-text")
    print(f"echo-agent out of the routes {took:.3f}s after the kill")


async def test_a_card_that_is_not_there_is_one_line(
    nats_server: NatsServer, tmp_path: Path
) -> None:
    proc = await asyncio.create_subprocess_exec(
        *CLI, "adapt", "a2a", "http://127.0.0.1:9/", "-s", nats_server.url,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=cli_env(),
    )  # fmt: skip
    out, err = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode == 3
    assert err.decode().startswith("reach: no A2A agent card at http://127.0.0.1:9/"), err
    assert out == b""


@pytest.mark.parametrize("card", [("1.0",), ("0.3", "--no-streaming")], ids=["1.0-stream", "0.3"])
@pytest.mark.parametrize("prompt", ["slow 30", "slow 30 late 1"], ids=["named", "unnamed"])
async def test_a_cancel_is_forwarded_as_a2a_tasks_cancel(
    broker: Broker, nats_server: NatsServer, a2a_agent: Processes, sidecar: Processes,
    card: tuple[str, ...], prompt: str,
) -> None:  # fmt: skip
    """Also when the cancel comes before the agent named its task (``late 1``: the agent
    has the message, the sidecar no task id yet): the sidecar waits for the name."""
    agent = await a2a_agent("--card", *card)
    await sidecar(agent.url, "--agent-id", "slow-a2a")
    await wait_for(lambda: state(broker, "slow-a2a") == "healthy", 10, what="slow-a2a healthy")
    async with reach_agent.Client(nats_server.url) as client:
        call = asyncio.create_task(client.call("echo-text", prompt, request_id="rid-slow",
                                               timeout=60))  # fmt: skip

        async def running() -> bool:
            return any(s["request_id"] == "rid-slow" for s in await agent.seen())

        deadline = time.monotonic() + 10
        while not await running():
            assert time.monotonic() < deadline, "the A2A agent never got the message"
            await asyncio.sleep(0.05)
        reply = await client.cancel("rid-slow")
        assert (reply.state, reply.agent_id) == ("cancelled", "slow-a2a")
        with pytest.raises(reach_agent.Cancelled):
            await asyncio.wait_for(call, 10)
        deadline = time.monotonic() + 10
        while not await agent.cancelled():  # its executor saw the CancelledError
            assert time.monotonic() < deadline, "tasks/cancel never reached the A2A agent"
            await asyncio.sleep(0.05)
        rec = await client.wait("rid-slow", 5)
        assert (rec.agent_id, rec.error["code"]) == ("slow-a2a", "CANCELLED")
