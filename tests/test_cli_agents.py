"""``reach announce`` (a hand-made agent) and ``reach call``: the quick start with reach alone,
against a real nats-server and broker."""

from __future__ import annotations

import asyncio
import json
import signal
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
from nats.aio.client import Client as NATS

from jetstream.names import H_REQUEST_ID
from reach_broker.broker import Broker
from reach_broker.cluster.natsserver import NatsServer

from .conftest import BrokerFactory, wait_for
from .test_cli import CLI, cli_env, reach


class Announcer:
    """A running ``reach announce --json``: its process and the records it printed."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc
        self.records: list[dict[str, Any]] = []

    async def until(self, event: str, limit_s: float = 20.0, **fields: Any) -> dict[str, Any]:
        """Read records until one of ``event`` (with ``fields``) shows; returns it."""
        assert self.proc.stdout is not None
        deadline = time.monotonic() + limit_s
        while True:
            left = deadline - time.monotonic()
            assert left > 0, f"no {event} {fields} in {self.records[-5:]}"
            line = await asyncio.wait_for(self.proc.stdout.readline(), left)
            assert line, f"reach announce ended before {event}: {self.records[-5:]}"
            record = json.loads(line)
            self.records.append(record)
            if record["event"] == event and all(record.get(k) == v for k, v in fields.items()):
                return record

    async def stop(self) -> tuple[int, list[dict[str, Any]], bytes]:
        self.proc.send_signal(signal.SIGINT)
        out, err = await asyncio.wait_for(self.proc.communicate(), 20)
        assert self.proc.returncode is not None
        return self.proc.returncode, [json.loads(x) for x in out.splitlines()], err


@pytest.fixture
async def announcer(nats_server: NatsServer) -> AsyncIterator[Any]:
    started: list[Announcer] = []

    async def start(*argv: str) -> Announcer:
        proc = await asyncio.create_subprocess_exec(
            *CLI, "announce", "--json", "-s", nats_server.url, *argv,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=cli_env(),
        )  # fmt: skip
        started.append(Announcer(proc))
        return started[-1]

    try:
        yield start
    finally:
        for a in started:
            if a.proc.returncode is None:
                a.proc.kill()
                await a.proc.wait()


async def test_announce_heartbeats_and_serves_what_call_sends(
    nats_server: NatsServer, broker_factory: BrokerFactory, announcer: Any
) -> None:
    broker = await broker_factory()
    agent = await announcer("--agent-id", "alpha", "-C", "text_processing", "-C", "tool_use",
                            "--interval", "0.2", "--max-concurrency", "2")  # fmt: skip
    subscribed = await agent.until("subscribed")
    assert subscribed["subjects"] == ["reach.probe.alpha", "reach.task.alpha.text_processing",
                                      "reach.task.alpha.tool_use"]  # fmt: skip
    announced = await agent.until("announced")
    assert announced == {"event": "announced", "agent_id": "alpha", "broker_id": broker.broker_id,
                         "heartbeat_interval_ms": 200,
                         "capabilities": ["text_processing", "tool_use"]}  # fmt: skip
    # Heartbeats keep it healthy well past the 3 intervals after which silence is suspect.
    await agent.until("heartbeat", seq=10)
    code, out, err = await reach("route", "tool_use", "--json", "-s", nats_server.url)
    assert (code, err) == (0, "")
    [candidate] = json.loads(out)["candidates"]
    assert (candidate["agent_id"], candidate["state"]) == ("alpha", "healthy")
    code, out, err = await reach("call", "text_processing", '{"text": "hi"}', "-s",
                                 nats_server.url)  # fmt: skip
    assert (code, err) == (0, "")
    assert out == '{"agent_id":"alpha","capability":"text_processing","echo":{"text":"hi"}}\n'
    served = await agent.until("task")
    assert (served["capability"], served.get("error")) == ("text_processing", None)
    code, rows, err = await agent.stop()
    assert (code, err) == (0, b"")
    assert rows[-1] == {"event": "left", "agent_id": "alpha", "confirmed": True}
    await wait_for(lambda: broker.registry is not None and (
        "alpha" not in broker.registry.agents
        or broker.registry.agents["alpha"].state == "draining"), 10, what="alpha left")  # fmt: skip


async def test_call_with_a_repeated_request_id_gets_the_first_result(
    nats_server: NatsServer, broker_factory: BrokerFactory, announcer: Any
) -> None:
    await broker_factory()
    agent = await announcer("--interval", "0.5")
    await agent.until("announced")
    rid = "7b0c5c1e-1d2e-4f00-8000-0000000000aa"
    first = await reach("call", "text_processing", '{"n": 1}', "--request-id", rid,
                        "-s", nats_server.url)  # fmt: skip
    again = await reach("call", "text_processing", '{"n": 2}', "--request-id", rid,
                        "-s", nats_server.url)  # fmt: skip
    assert first == again == (0, '{"agent_id":"alpha","capability":"text_processing",'
                                 '"echo":{"n":1}}\n', "")  # fmt: skip
    await agent.until("task", request_id=rid, repeat=True)


async def test_call_errors_are_one_line_and_json(
    nats_server: NatsServer, broker_factory: BrokerFactory
) -> None:
    await broker_factory()
    code, out, err = await reach("call", "translation", "-s", nats_server.url, "--timeout", "2")
    assert (code, out) == (1, "")
    assert err == "reach: NO_REACHABLE_AGENT: no agent has the capability 'translation'\n"
    code, out, _ = await reach("call", "translation", "--json", "-s", nats_server.url)
    assert code == 1
    assert json.loads(out)["error"]["code"] == "NO_REACHABLE_AGENT"
    code, out, err = await reach("call", "text_processing", "{bad", "-s", nats_server.url)
    assert (code, out) == (2, "")
    assert err.startswith("reach: payload '{bad' is not JSON (")
    assert err.count("\n") == 1
    code, out, err = await reach("call", "text processing", "-s", nats_server.url)
    assert (code, out) == (2, "")
    assert err == ("reach: capability 'text processing' is not a valid capability "
                   "(dot-separated lowercase tokens [a-z0-9][a-z0-9_-]*)\n")  # fmt: skip


@pytest.mark.parametrize(
    ("argv", "line"),
    [
        (["--agent-id", "a b"], "--agent-id 'a b' is not a valid agent id"),
        (["-C", "text."], "--capability 'text.' is not a valid capability"),
        (["--max-concurrency", "0"], "--max-concurrency 0 is not within 1-100000"),
        (["--interval", "0.01"], "--interval 0.01 is not within 0.05-3600 seconds"),
        (["-C", "a", "-C", "a"], "lists a capability twice"),
    ],
)
async def test_announce_refuses_bad_options_in_one_line(argv: list[str], line: str) -> None:
    code, out, err = await reach("announce", *argv, "-s", "nats://127.0.0.1:1")
    assert (code, out) == (2, "")
    assert err.startswith("reach: ") and line in err and err.count("\n") == 1, err


async def test_announce_waits_for_a_broker_then_announces(
    nats_server: NatsServer, broker_factory: BrokerFactory, announcer: Any
) -> None:
    agent = await announcer("--interval", "0.5")
    waiting = await agent.until("waiting")
    assert waiting["reason"] == "nats: no responders available for request"
    broker = await broker_factory()
    announced = await agent.until("announced")
    assert announced["broker_id"] == broker.broker_id


async def test_announce_announces_again_after_a_reconnect(
    nats_server: NatsServer, nc: NATS, broker_factory: BrokerFactory, announcer: Any
) -> None:
    broker = await broker_factory()
    agent = await announcer("--interval", "0.2")
    await agent.until("announced")
    port, store = nats_server.port, nats_server.store_dir
    nats_server.kill()
    await agent.until("disconnected")
    restarted = NatsServer(port=port, store_dir=store)
    await asyncio.to_thread(restarted.start)
    try:
        await agent.until("reconnected")
        again = await agent.until("announced")
        assert again["broker_id"] == broker.broker_id
        await agent.until("heartbeat", seq=3)
        code, *_ = await agent.stop()
        assert code == 0
    finally:
        await broker.stop()
        await nc.close()
        await asyncio.to_thread(restarted.stop)


async def test_announce_answers_the_protocol_errors(
    nats_server: NatsServer, nc: NATS, broker: Broker, announcer: Any
) -> None:
    from reach_agent.wire import schema
    from reach_agent.wire.errors import from_reply

    agent = await announcer("--interval", "0.5")
    await agent.until("announced")
    subject = "reach.task.alpha.text_processing"
    rid = "7b0c5c1e-1d2e-4f00-8000-0000000000bb"
    headers = {H_REQUEST_ID: rid, schema.H_ACK_MODE: "received"}
    received = await nc.request(subject, b"{}", timeout=5, headers=headers)
    err = from_reply(received.headers, received.data)
    assert err is not None and err.code == "INVALID_REQUEST"
    assert received.headers is not None
    assert received.headers[H_REQUEST_ID] == rid
    assert schema.H_STATUS not in received.headers
    loop = await nc.request(
        subject, b"{}", timeout=5, headers={schema.H_HOPS: "alpha,b,alpha,alpha"}
    )
    err = from_reply(loop.headers, loop.data)
    assert err is not None and err.code == "LOOP_DETECTED"
    bad = await nc.request(subject, b"{oops", timeout=5)
    err = from_reply(bad.headers, bad.data)
    assert err is not None and err.code == "INVALID_REQUEST"
    ok = await nc.request(subject, b"", timeout=5)
    assert json.loads(ok.data) == {"agent_id": "alpha", "capability": "text_processing",
                                   "echo": None}  # fmt: skip
    assert ok.headers is not None and ok.headers[schema.H_STATUS] == "completed"
