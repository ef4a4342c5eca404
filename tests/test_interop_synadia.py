"""Synadia Agent Protocol agents, discovered and routed: a real agent process hosted by their
PyPI host SDK (``tests/agents/synadia_agent.py``, no reach code in it) is found on
``$SRV.INFO.agents``, listed by ``reach agents``, offered by ``reach.route.<cap>`` with
``protocol: "synadia-agents"``, called with ``Client.call()`` / ``Client.stream()``, taken
out of the routes within a second of a SIGKILL (the server's DISCONNECT advisory of the
unnamed connection that held it), and found again when restarted."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest
from nats.aio.client import Client as NATS

import reach_agent
from reach_agent.client.config import ClientConfig
from reach_agent.wire import schema
from reach_agent.wire.errors import InternalError, TargetBusy, from_reply
from reach_agent.wire.subjects import Subjects
from reach_broker.broker import Broker
from reach_broker.cluster.natsserver import NatsServer
from reach_broker.interop.synadiainfo import agent_id_of, capabilities_of

from .conftest import wait_for
from .test_cli import reach

pytest.importorskip("synadia_ai.agent_service", reason="pip install -e '.[dev]' (synadia SDKs)")

ROOT = Path(__file__).resolve().parent.parent
Spawn = Callable[..., Awaitable[tuple[asyncio.subprocess.Process, str]]]


def test_the_agent_id_of_an_instance_is_readable_valid_and_unique() -> None:
    assert agent_id_of("claude-code", "alice", "main", "Xy12") == "claude-code_alice_main_Xy12"
    odd = agent_id_of("bot", "b64+/=", "s", "not a token!")
    assert odd.startswith("bot_b64---_s_h") and len(odd) == len("bot_b64---_s_h") + 16
    long = agent_id_of("a" * 200, "o", "s", "ID1")
    assert len(long) == 128 and long.endswith("_ID1")
    assert schema.check_agent_id(long) == long and schema.check_agent_id(odd) == odd
    caps, refused = capabilities_of("claude-code", " code.review, ,bad cap,code.review")
    assert caps == ["claude-code", "code.review"]
    assert len(refused) == 1 and "bad cap" in refused[0]


@pytest.fixture
async def spawn(nats_server: NatsServer) -> AsyncIterator[Spawn]:
    """Start Synadia agent processes (``ready <instance_id>`` read); killed at teardown."""
    procs: list[asyncio.subprocess.Process] = []

    async def start(*args: str) -> tuple[asyncio.subprocess.Process, str]:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "tests.agents.synadia_agent", "--server", nats_server.url,
            *args, cwd=ROOT, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL,
        )  # fmt: skip
        procs.append(proc)
        assert proc.stdout is not None
        line = (await asyncio.wait_for(proc.stdout.readline(), 20)).decode().split()
        assert line[:1] == ["ready"], line
        return proc, line[1]

    try:
        yield start
    finally:
        for proc in procs:
            if proc.returncode is None:
                proc.kill()
            await proc.wait()


async def routes(nc: NATS, capability: str) -> list[schema.Candidate]:
    """The candidates ``reach.route.<cap>`` offers ([] when it answers NO_REACHABLE_AGENT)."""
    msg = await nc.request(Subjects().route(capability), b"{}", timeout=2)
    err = from_reply(msg.headers, msg.data)
    if err is not None:
        assert err.code == "NO_REACHABLE_AGENT", err
        return []
    return list(schema.route_reply_decoder.decode(msg.data).candidates)


async def test_a_synadia_agent_is_routed_called_and_followed(
    broker: Broker, nc: NATS, nats_server: NatsServer, spawn: Spawn
) -> None:
    proc, instance = await spawn("--capabilities", "text.echo")
    agent_id = agent_id_of("echo-bot", "tests", "main", instance)
    rec = await wait_for(lambda: broker.registry.agents.get(agent_id), 10,
                         what="the Synadia agent registered")  # fmt: skip
    assert rec.protocol == "synadia-agents"
    assert rec.announce.capabilities == ["echo-bot", "text.echo"]
    await wait_for(lambda: broker.synadia.conns, 5, what="its connection located (CONNZ)")

    # reach agents lists it; reach.route.<cap> offers it as synadia-agents.
    code, out, err = await reach("agents", "--json", "-s", nats_server.url)
    assert code == 0, err
    [view] = [v for v in json.loads(out) if v["agent_id"] == agent_id]
    assert view["protocol"] == "synadia-agents" and view["state"] == "healthy"
    [cand] = await routes(nc, "text.echo")
    assert (cand.agent_id, cand.protocol) == (agent_id, "synadia-agents")
    assert cand.subject == "agents.prompt.echo-bot.tests.main"

    async with reach_agent.Client(nats_server.url) as client:
        assert await client.call("text.echo", "hello", timeout=10) == "echo:hello"
        assert await client.call("echo-bot", {"prompt": "upper hi"}, timeout=10) == "echo:HI"
        got = [c async for c in client.stream("text.echo", "streamed", timeout=10)]
        assert got == ["echo:", "streamed"]
        receipt = await client.call("text.echo", "x", ack_mode="received", request_id="r-1",
                                    timeout=10)  # fmt: skip
        assert receipt == schema.Receipt(request_id="r-1", agent_id=agent_id)
        with pytest.raises(TargetBusy, match="429"):
            await client.call("text.echo", "refuse", timeout=3)

    # SIGKILL: out of the routes within a second (the advisory names its unnamed connection).
    t0 = time.monotonic()
    os.kill(proc.pid, signal.SIGKILL)
    await wait_for(lambda: broker.registry.agents[agent_id].state != "healthy", 1.0,
                   what="suspect within 1 s of the SIGKILL")  # fmt: skip
    assert await routes(nc, "text.echo") == []
    gone_s = time.monotonic() - t0
    assert gone_s < 1.0
    await wait_for(lambda: broker.registry.agents[agent_id].state == "offline", 5,
                   what="offline (the status probe unanswered)")  # fmt: skip

    # Restarted: a new instance, found at once by its first heartbeat (or the sweep).
    _, instance2 = await spawn("--capabilities", "text.echo")
    again = agent_id_of("echo-bot", "tests", "main", instance2)
    await wait_for(lambda: (r := broker.registry.agents.get(again)) and r.state == "healthy", 10,
                   what="the restarted agent healthy")  # fmt: skip
    [cand] = await routes(nc, "text.echo")
    assert cand.agent_id == again
    async with reach_agent.Client(nats_server.url) as client:
        assert await client.call("text.echo", "back", timeout=10) == "echo:back"


async def test_a_busy_synadia_agent_fails_over_and_a_crash_is_an_error(
    broker: Broker, nats_server: NatsServer, spawn: Spawn
) -> None:
    _, one = await spawn("--session", "one", "--capabilities", "text.echo", "--busy")
    _, two = await spawn("--session", "two", "--capabilities", "text.echo")
    busy, free = agent_id_of("echo-bot", "tests", "one", one), agent_id_of(
        "echo-bot", "tests", "two", two)  # fmt: skip
    await wait_for(lambda: {busy, free} <= broker.registry.agents.keys(), 10,
                   what="both registered")  # fmt: skip
    async with reach_agent.Client(nats_server.url) as client:
        # The busy one answers 429 (TARGET_BUSY): every call fails over to the other.
        for i in range(6):
            assert await client.call("text.echo", f"n{i}", timeout=5) == f"echo:n{i}"
        # A handler error (their 500 frame) is the agent's error, not a result.
        with pytest.raises(InternalError, match="500"):
            await client.call("echo-bot", "fail", sticky_key="k", timeout=5)


async def test_a_synadia_stream_slower_than_the_liveness_probe_is_not_lost(
    broker: Broker, nats_server: NatsServer, spawn: Spawn
) -> None:
    """A Synadia agent answers no reach probe, so the client's liveness watch leaves it to the
    broker's events while it streams, as while it is called. Probed, its "no responders" was
    read as a death: the stream broke after its first chunk, and a call running on the agent
    when a stream's watch woke was lost (CI, 1 run in 7: the 429 call above got "lost")."""
    _, instance = await spawn("--capabilities", "text.slow", "--pause-s", "0.8")
    agent_id = agent_id_of("echo-bot", "tests", "main", instance)
    await wait_for(lambda: agent_id in broker.registry.agents, 10, what="registered")
    cfg = ClientConfig(liveness_probe_s=0.2)
    async with reach_agent.Client(nats_server.url, config=cfg) as client:
        got = [c async for c in client.stream("text.slow", "streamed", timeout=10)]
        assert got == ["echo:", "streamed"]
    assert broker.registry.agents[agent_id].state == "healthy"


async def test_the_compensation_queue_delivers_to_a_synadia_agent_and_records_its_answer(
    broker: Broker, nats_server: NatsServer, spawn: Spawn
) -> None:
    async with reach_agent.Client(nats_server.url) as client:
        # Queued while no agent has the capability; delivered once one appears.
        rid = await client.submit("text.late", "queued", ttl=60)
        _, instance = await spawn("--capabilities", "text.late")
        agent_id = agent_id_of("echo-bot", "tests", "main", instance)
        rec = await client.wait(rid, 20)
        assert (rec.state, rec.agent_id, rec.capability) == ("completed", agent_id, "text.late")
        assert rec.result == "echo:queued"  # wait() decodes the result
        assert broker.replayer.sender.replayed == 1
        # An entry the agent fails is recorded failed with its error.
        bad = await client.submit("text.late", "fail", ttl=60)
        rec = await client.wait(bad, 20)
        assert rec.state == "failed" and rec.error is not None
        assert rec.error["code"] == "INTERNAL" and "500" in rec.error["message"]
