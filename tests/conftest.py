"""Shared fixtures: a real nats-server per test, in-process brokers, raw NATS clients."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import subprocess
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from typing import Any

import nats
import pytest
from nats.aio.client import Client as NATS

from jetstream.names import PARTITIONS_STREAM
from jetstream.provision import load_definitions, provision
from reach_broker.broker import Broker
from reach_broker.cluster.natsserver import NatsServer, find_binary
from reach_broker.config import Config
from reach_broker.service.fanout import Consumer
from reach_broker.service.metrics import Metrics


@pytest.fixture(autouse=True)
def _ack_dir(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Agents' ack write-ahead files (REACH_ACK_DIR) go to the test's tmp dir, also in
    agent processes the test starts (they inherit the environment)."""
    monkeypatch.setenv("REACH_ACK_DIR", str(tmp_path / "acks"))


@pytest.fixture(autouse=True)
def _store_dir(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A `reach broker` a test starts without --store-dir or --ephemeral keeps its JetStream
    store in the test's tmp dir, never in ./reach-data of the directory pytest runs in."""
    monkeypatch.setenv("REACH_STORE_DIR", str(tmp_path / "reach-data"))
    monkeypatch.delenv("REACH_EPHEMERAL", raising=False)


@pytest.fixture
def nats_server(tmp_path: Any) -> Iterator[NatsServer]:
    """A real nats-server (JetStream, advisories config) on a free port, temp store dir."""
    server = NatsServer(port=0, store_dir=tmp_path / "nats")
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
async def nc(nats_server: NatsServer) -> AsyncIterator[NATS]:
    conn = await nats.connect(nats_server.url, name="test-client")
    try:
        yield conn
    finally:
        await conn.close()


@pytest.fixture
async def provisioned(nats_server: NatsServer) -> NatsServer:
    """The test server with the JetStream assets a broker creates at start (the claims
    bucket among them), for tests that run agents without a broker: without the bucket an
    agent refuses every claimed task (STORE_UNAVAILABLE)."""
    conn = await nats.connect(nats_server.url, name="test-provision")
    try:
        await provision(conn, load_definitions())
    finally:
        await conn.close()
    return nats_server


def fast_config(url: str, **overrides: Any) -> Config:
    """Broker config with short timings for tests; ``section__field=value`` overrides."""
    cfg = Config()
    cfg.nats.url = url
    cfg.broker.metrics_port = 0
    cfg.broker.min_heartbeat_interval_ms = 50
    cfg.detection.tick_s = 0.01
    cfg.detection.probe_timeout_s = 0.5
    cfg.routing.rank_refresh_ms = 0
    for key, value in overrides.items():
        section, field = key.split("__")
        setattr(getattr(cfg, section), field, value)
    return cfg


BrokerFactory = Callable[..., Awaitable[Broker]]


@pytest.fixture
async def broker_factory(nats_server: NatsServer) -> AsyncIterator[BrokerFactory]:
    """Start in-process brokers against the test server; all are stopped at teardown."""
    started: list[Broker] = []

    async def make(
        *, console: bool = False, watchers: Sequence[Consumer] = (), **overrides: Any
    ) -> Broker:
        """A started broker; ``overrides`` are config keys (``section__field``)."""
        broker = Broker(fast_config(nats_server.url, **overrides), metrics=Metrics(),
                        console=console, watchers=watchers)  # fmt: skip
        await broker.start()
        started.append(broker)
        return broker

    try:
        yield make
    finally:
        for broker in reversed(started):
            await broker.stop()


@pytest.fixture
async def broker(broker_factory: BrokerFactory) -> Broker:
    return await broker_factory()


@pytest.fixture
async def agents(nats_server: NatsServer) -> AsyncIterator[Callable[..., Awaitable[Any]]]:
    """Start in-process agents (``await agents(reach_agent.Agent(...))``) against the test
    server; all drained at teardown."""
    import reach_agent

    started: list[reach_agent.Agent] = []

    async def make(agent: reach_agent.Agent) -> reach_agent.Agent:
        await agent.start(nats_server.url)
        started.append(agent)
        return agent

    try:
        yield make
    finally:
        for a in started:
            await a.stop(grace=2)


async def wait_for(
    predicate: Callable[[], Any],
    timeout: float = 5.0,  # noqa: ASYNC109 - a polling deadline, not a cancellation scope
    interval: float = 0.01,
    what: str = "",
) -> Any:
    """Poll ``predicate`` until truthy; fail with ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what or predicate}")
        await asyncio.sleep(interval)


@contextlib.asynccontextmanager
async def connections_named(url: str, *agent_ids: str) -> AsyncIterator[None]:
    """A connection named after each agent, as an agent's own is (the protocol asks it): raw
    agents beating over a test's client, and a broker starting from the snapshot asks the
    server which agents it restored have a connection (a warm restore's agents without one
    are suspected and probed at once)."""
    conns = [await nats.connect(url, name=a) for a in agent_ids]
    try:
        yield
    finally:
        for conn in conns:
            await conn.close()


async def leases_aged_out(nc: NATS, timeout: float = 10.0) -> None:  # noqa: ASYNC109
    """Wait until KV ``reach_partitions`` holds nothing: every lease, handed back or not, and
    every presence key aged out, as after an outage longer than the leases' time to live. A
    broker starting now is alone, and takes its partitions cold."""
    js = nc.jetstream()
    deadline = time.monotonic() + timeout
    while (held := (await js.stream_info(PARTITIONS_STREAM)).state.messages) != 0:
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s: {held} leases or presence "
                                 "keys left")  # fmt: skip
        await asyncio.sleep(0.05)


@pytest.fixture
def plain_server() -> Iterator[str]:
    """A nats-server without JetStream (open dev mode at its barest): its URL."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([find_binary(), "-a", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    try:
        yield f"nats://127.0.0.1:{port}"
    finally:
        proc.kill()
        proc.wait(10)
