"""HTTP agents through the sidecar: ``reach adapt http`` (a real process) in front of a small
HTTP server of the test's own. Routed and called (request id, time left and ``traceparent``
as headers), the same request id never POSTed twice, 429 → ``TARGET_BUSY`` and failover to a
second agent, 400 → ``BIZ_REJECT``, a failing health URL → out of the routes and back, a
killed backend (no health URL) → out of the routes within 1.5 s."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

import reach_agent
from reach_agent.wire.errors import BizReject, TargetBusy
from reach_broker.broker import Broker
from reach_broker.cluster.natsserver import NatsServer

from .conftest import wait_for
from .test_cli import CLI, cli_env

pytest.importorskip("httpx", reason="pip install -e '.[dev]' (nats-reach[http])")

TRACE = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


class Backend:
    """A local HTTP agent: POST / echoes (``status`` answers instead, when set); GET /health
    answers ``health``. Every POST is recorded (headers, body)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.status = 200
        self.health = 200
        self.posts: list[tuple[dict[str, str], Any]] = []
        backend = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def _send(self, status: int, body: bytes) -> None:
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self) -> None:
                self._send(backend.health, b'{"ok": true}')

            def do_POST(self) -> None:
                payload = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                backend.posts.append((dict(self.headers.items()), payload))
                if payload == {"bad": True}:
                    self._send(400, b'{"error": "bad input"}')
                elif backend.status != 200:
                    self._send(backend.status, b'{"error": "busy"}')
                else:
                    self._send(200, json.dumps({"by": backend.name, "echo": payload}).encode())

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        if self.thread.is_alive():
            self.server.shutdown()
            self.server.server_close()
            self.thread.join(5)

    def runs_of(self, request_id: str) -> int:
        return sum(1 for h, _ in self.posts if h.get("Reach-Request-Id") == request_id)


@pytest.fixture
def backends() -> Iterator[Callable[[str], Backend]]:
    made: list[Backend] = []

    def make(name: str) -> Backend:
        made.append(Backend(name))
        return made[-1]

    try:
        yield make
    finally:
        for b in made:
            b.close()


Sidecar = Callable[..., Awaitable[asyncio.subprocess.Process]]


@pytest.fixture
async def sidecar(nats_server: NatsServer, tmp_path: Path) -> AsyncIterator[Sidecar]:
    """``reach adapt http`` processes (its first output line read); stopped at teardown."""
    procs: list[asyncio.subprocess.Process] = []

    async def start(agent_id: str, backend: Backend, *extra: str) -> asyncio.subprocess.Process:
        proc = await asyncio.create_subprocess_exec(
            *CLI, "adapt", "http", "-s", nats_server.url, "--agent-id", agent_id,
            "--capability", "llm.chat", "--url", backend.url + "/", "--interval", "0.2", *extra,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
            env={**cli_env(), "REACH_ACK_DIR": str(tmp_path / "acks")},
        )  # fmt: skip
        procs.append(proc)
        assert proc.stdout is not None
        line = await asyncio.wait_for(proc.stdout.readline(), 20)
        assert line.startswith(f"adapting {agent_id} (llm.chat)".encode()), line
        return proc

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


def healthy(broker: Broker, agent_id: str) -> bool:
    rec = broker.registry.agents.get(agent_id)
    return rec is not None and rec.state == "healthy"


async def test_an_http_agent_is_routed_and_called_and_a_request_id_runs_once(
    broker: Broker, nats_server: NatsServer, backends: Callable[[str], Backend], sidecar: Sidecar
) -> None:
    a = backends("a")
    await sidecar("http-a", a, "--max-concurrency", "4", "--timeout-hint-ms", "15000")
    await wait_for(lambda: healthy(broker, "http-a"), 10, what="http-a healthy")
    rec = broker.registry.agents["http-a"]
    assert (rec.announce.agent_type, rec.max_concurrency, rec.timeout_hint_ms) == ("http", 4, 15000)
    async with reach_agent.Client(nats_server.url) as client:
        [cand] = await client.route("llm.chat")
        assert (cand.agent_id, cand.protocol) == ("http-a", "reach")
        got = await client.call("llm.chat", {"q": 1}, request_id="rid-1", traceparent=TRACE,
                                timeout=10)  # fmt: skip
        assert got == {"by": "a", "echo": {"q": 1}}
        [(headers, body)] = a.posts
        assert body == {"q": 1}
        assert headers["Reach-Request-Id"] == "rid-1"
        assert headers["traceparent"] == TRACE
        assert 0 < int(headers["Reach-Timeout-Ms"]) <= 15000
        # The same request id again, and twice at once: the first result, one POST; with
        # another body, refused (a request id names one request).
        assert await client.call("llm.chat", {"q": 1}, request_id="rid-1", timeout=10) == got
        with pytest.raises(reach_agent.IdempotencyMismatch, match="request_id 'rid-1'"):
            await client.call("llm.chat", {"q": 2}, request_id="rid-1", timeout=10)
        both = await asyncio.gather(*(client.call("llm.chat", {"q": 3}, request_id="rid-2",
                                                  timeout=10) for _ in range(2)))  # fmt: skip
        assert both == [{"by": "a", "echo": {"q": 3}}] * 2
        assert (a.runs_of("rid-1"), a.runs_of("rid-2")) == (1, 1)
        # Other 4xx: BIZ_REJECT, not retried.
        with pytest.raises(BizReject, match="400"):
            await client.call("llm.chat", {"bad": True}, timeout=10)
        assert len(a.posts) == 3


async def test_busy_is_target_busy_and_fails_over(
    broker: Broker, nats_server: NatsServer, backends: Callable[[str], Backend], sidecar: Sidecar
) -> None:
    a, b = backends("a"), backends("b")
    b.status = 429
    await sidecar("http-b", b)
    await wait_for(lambda: healthy(broker, "http-b"), 10, what="http-b healthy")
    async with reach_agent.Client(nats_server.url) as client:
        with pytest.raises(TargetBusy, match="429"):
            await client.call("llm.chat", {"n": 0}, timeout=3)
        await sidecar("http-a", a)
        await wait_for(lambda: healthy(broker, "http-a"), 10, what="http-a healthy")
        tried_b = len(b.posts)
        for i in range(30):  # until one call went to the busy one first
            assert await client.call("llm.chat", {"n": i}, timeout=10) == {
                "by": "a",
                "echo": {"n": i},
            }
            if len(b.posts) > tried_b:
                break
        assert len(b.posts) > tried_b, "the busy agent was never tried first in 30 calls"


async def test_a_failing_health_url_takes_it_out_of_the_routes(
    broker: Broker, nats_server: NatsServer, backends: Callable[[str], Backend], sidecar: Sidecar
) -> None:
    a = backends("a")
    await sidecar("http-a", a, "--health", a.url + "/health")
    await wait_for(lambda: healthy(broker, "http-a"), 10, what="http-a healthy")
    a.health = 503
    # Checked every second, reported at once: out of the routes within 1.5 s.
    await wait_for(lambda: broker.registry.agents["http-a"].state == "draining", 1.5,
                   what="http-a out of the routes")  # fmt: skip
    async with reach_agent.Client(nats_server.url) as client:
        with pytest.raises(reach_agent.wire.errors.NoReachableAgent):
            await client.route("llm.chat")
        a.health = 200
        await wait_for(lambda: healthy(broker, "http-a"), 10, what="http-a back")
        assert await client.call("llm.chat", "hi", timeout=10) == {"by": "a", "echo": "hi"}


async def test_a_dead_backend_leaves_the_routes_within_a_second_and_a_half(
    broker: Broker, nats_server: NatsServer, backends: Callable[[str], Backend], sidecar: Sidecar
) -> None:
    """No health URL, no calls: the sidecar's TCP check finds the killed backend; the
    heartbeat it sends at once reports it draining, and a call goes elsewhere."""
    a, b = backends("a"), backends("b")
    await sidecar("http-a", a, "--interval", "5")  # heartbeats alone would take ~8 s
    await sidecar("http-b", b, "--interval", "5")
    await wait_for(lambda: healthy(broker, "http-a") and healthy(broker, "http-b"), 10,
                   what="both healthy")  # fmt: skip
    a.close()
    killed = time.monotonic()
    await wait_for(
        lambda: broker.registry.agents["http-a"].state == "draining",
        1.5,
        what="http-a out of the routes within 1.5 s of its backend's death",
    )
    took = time.monotonic() - killed
    assert healthy(broker, "http-b")
    async with reach_agent.Client(nats_server.url) as client:
        [cand] = await client.route("llm.chat")
        assert cand.agent_id == "http-b"
        assert await client.call("llm.chat", "hi", timeout=10) == {"by": "b", "echo": "hi"}
    print(f"http-a out of the routes {took:.3f}s after its backend died")
