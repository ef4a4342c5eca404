"""The console's parts: its bounded history (pure), who may look, the HTTP server, and the
whole port on an in-process broker with raw agents (a real nats-server)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
from nats.aio.client import Client as NATS

from jetstream.provision import load_definitions, provision
from reach_agent.wire.schema import Announce, Event
from reach_broker.broker import Broker
from reach_broker.cluster.natsserver import NatsServer
from reach_broker.config import Config, ConfigError, console_token
from reach_broker.console.app import Access, App, host_name, is_loopback
from reach_broker.console.history import History
from reach_broker.console.httpd import BadRequest, HttpServer, Request, parse_head
from reach_broker.console.port import HttpPort, access_of
from reach_broker.core.records import AgentRecord
from reach_broker.service.metrics import Metrics

from .conftest import BrokerFactory, fast_config, wait_for
from .test_cli import QUIET, announce

TOKEN = "s3cret-token-0123456789"


def record(agent_id: str, score: float = 100.0) -> AgentRecord:
    from reach_broker.core.detector import ArrivalWindow

    ann = Announce(agent_id=agent_id, capabilities=["summarize"], max_concurrency=4,
                   heartbeat_interval_ms=1000)  # fmt: skip
    rec = AgentRecord(ann, 1.0, ArrivalWindow(10))
    rec.score = score
    return rec


def event(agent_id: str, at_ms: int, to: str = "suspect", broker: str = "b1") -> Event:
    return Event(kind="state", agent_id=agent_id, reason="no heartbeat", at_ms=at_ms,
                 broker_id=broker, from_="healthy", to=to)  # type: ignore[arg-type]  # fmt: skip


# --- history -----------------------------------------------------------------------------------


def test_samples_are_a_bounded_ring_on_the_fleets_ticks() -> None:
    h = History(sample_s=5.0, history_s=20.0, events=10)
    assert h.capacity == 4
    a, b = record("a"), record("b")
    a.stats.task_ewma_ms = 120.0
    for tick in range(6):
        a.score = 90.0 + tick
        h.sample(1000 * tick, {"a": a} if tick < 3 else {"a": a, "b": b})
    s = h.samples("a")
    assert s.at_ms == [2000, 3000, 4000, 5000]  # the last 4 of 6 ticks
    assert s.score == [92.0, 93.0, 94.0, 95.0]
    assert (s.task_ms, s.load) == ([120.0] * 4, [0.0] * 4)
    assert h.samples("b").at_ms == [3000, 4000, 5000]  # b from its first tick on
    assert len(h.series["a"].values) == 8 * 4  # 8 bytes a sample
    h.sample(6000, {"b": b})  # a is gone from the registry: forgotten
    assert "a" not in h.series
    assert h.samples("a").at_ms == []


def test_an_unmeasured_task_time_is_none() -> None:
    h = History(5.0, 10.0, 10)
    h.sample(0, {"a": record("a")})
    assert h.samples("a").task_ms == [None]


def test_samples_keep_what_the_page_shows() -> None:
    """Score and load are kept in hundredths and ten-thousandths (the page shows two
    decimals), the task time as a float32."""
    h = History(5.0, 10.0, 10)
    a = record("a", score=87.654321)
    a.load, a.stats.task_ewma_ms = 0.3456, 1234.5678
    h.sample(0, {"a": a})
    s = h.samples("a")
    assert (s.score, s.load, s.task_ms) == ([87.65], [0.35], [1234.57])


def test_events_are_kept_bounded_and_a_replicas_copy_is_merged() -> None:
    h = History(5.0, 10.0, events=3)
    assert h.event(event("a", 1000, broker="b1")) is not None
    assert h.event(event("a", 1200, broker="b2")) is None  # the same move, another replica
    assert [e.brokers for e in h.events] == [["b1", "b2"]]
    assert h.event(event("a", 5000, broker="b2")) is not None  # later: a move of its own
    for i in range(3):
        h.event(event(f"x{i}", 9000 + i))
    assert [e.event.agent_id for e in h.events] == ["x0", "x1", "x2"]
    assert [e.event.at_ms for e in h.transitions("a")] == [1000, 5000]


def test_a_burst_of_transitions_costs_one_comparison_each_at_most() -> None:
    """10,000 transitions within one second, each reported by two replicas (the copy right
    after the original, as two brokers seeing the same heartbeats publish them): every copy
    is found with one comparison, none of the originals needs any. A scan back over the
    burst would compare each event with up to ``events`` entries (500 x 10,000 here)."""
    h = History(5.0, 300.0, events=500)
    n = 10_000
    for i in range(n):
        at = 1000 + i // 10  # 10,000 within 1,000 ms
        assert h.event(event(f"a{i}", at, broker="b1")) is not None
        assert h.event(event(f"a{i}", at + 3, broker="b2")) is None
    assert h.compared == n
    assert len(h.events) == 500 and len(h._latest) == 500  # the keys leave with the entries
    assert all(e.brokers == ["b1", "b2"] for e in h.events)
    # A third replica's copies, after the burst: those still in the timeline are found with
    # one comparison each; one whose original has left the timeline is an entry of its own.
    for i in range(n - 400, n):
        assert h.event(event(f"a{i}", 1000 + i // 10 + 5, broker="b3")) is None
    assert h.compared == n + 400
    assert h.event(event("a0", 1005, broker="b3")) is not None
    assert h.compared == n + 400
    assert [e.brokers for e in h.events][-400:-1] == [["b1", "b2", "b3"]] * 399


def test_an_event_seen_again_from_the_same_replica_or_later_is_a_move_of_its_own() -> None:
    h = History(5.0, 10.0, events=10)
    assert h.event(event("a", 1000, broker="b1")) is not None
    assert h.event(event("a", 1500, broker="b1")) is not None  # the same broker: a new move
    assert h.event(event("a", 1600, broker="b2")) is None  # merged into the newest
    assert h.event(event("a", 3601, broker="b3")) is not None  # > 2 s after the newest
    assert [e.brokers for e in h.events] == [["b1"], ["b1", "b2"], ["b3"]]
    assert h.compared == 3


def test_each_agent_keeps_its_last_transitions_only() -> None:
    h = History(5.0, 10.0, events=5)
    for i in range(40):
        h.event(event("a", 10_000 * i, to="suspect" if i % 2 else "healthy"))
    assert [e.event.at_ms for e in h.transitions("a")] == [10_000 * i for i in range(24, 40)]


class CountingFleet(dict[str, AgentRecord]):
    """The registry's agents, counting how many a tick looks at."""

    looked = 0

    def items(self):  # type: ignore[no-untyped-def]
        for pair in super().items():
            self.looked += 1
            yield pair

    def get(self, key, default=None):  # type: ignore[no-untyped-def]
        self.looked += 1
        return super().get(key, default)


def test_charts_are_bounded_whatever_the_fleet() -> None:
    h = History(5.0, 20.0, events=10, chart_agents=10)
    fleet = CountingFleet((f"a{i}", record(f"a{i}")) for i in range(1000))
    h.sample(0, fleet)
    assert sorted(h.series) == sorted(f"a{i}" for i in range(10))  # the first ten charted
    fleet.looked = 0
    h.sample(5000, fleet)
    assert fleet.looked == 10  # full: the charted agents alone, not the 1,000
    del fleet["a3"]
    fleet.looked = 0
    h.sample(10_000, fleet)
    assert fleet.looked == 10 and "a3" not in h.series and len(h.series) == 9
    h.sample(15_000, fleet)  # room again: a newcomer is charted from this tick on
    assert len(h.series) == 10 and h.samples("a10").at_ms == [15_000]
    h.event(event("zz", 20_000))  # full: an event charts nobody new either
    assert "zz" not in h.series


def test_beyond_the_bound_a_viewer_gets_the_chart_of_the_agent_it_opens() -> None:
    h = History(5.0, 20.0, events=10, chart_agents=3)
    fleet = {f"a{i}": record(f"a{i}") for i in range(5)}
    h.sample(0, fleet)
    assert list(h.series) == ["a0", "a1", "a2"]
    h.watch("a4")  # full: the ring charted first (a0) goes to it
    assert list(h.series) == ["a1", "a2", "a4"] and h.samples("a4").at_ms == []
    h.sample(5000, fleet)
    assert h.samples("a4").at_ms == [5000] and h.samples("a0").at_ms == []
    h.watch("a1")  # charted: only moved to the back of the order rings are given away in
    h.watch("a3")
    assert list(h.series) == ["a4", "a1", "a3"]
    assert h.samples("a1").at_ms == [0, 5000]
    h.sample(10_000, fleet)
    assert h.samples("a3").at_ms == [10_000]


def test_an_agent_without_a_chart_shows_its_transitions_from_the_timeline() -> None:
    h = History(5.0, 20.0, events=10, chart_agents=1)
    h.event(event("x", 1000))
    h.event(event("y", 2000))
    h.event(event("y", 3000, to="healthy"))
    assert list(h.series) == ["x"]  # full: y has no ring, its transitions are the timeline's
    assert [e.event.at_ms for e in h.transitions("y")] == [2000, 3000]
    h.watch("y")
    assert list(h.series) == ["y"] and h.transitions("x") == [h.events[0]]
    h.event(event("y", 4000))
    assert [e.event.at_ms for e in h.transitions("y")] == [2000, 3000, 4000]


def test_released_claims_of_one_agent_are_told_apart() -> None:
    h = History(5.0, 10.0, events=10)
    for broker, rid in (("b1", "r1"), ("b2", "r2"), ("b2", "r1")):
        h.event(Event(kind="released", agent_id="a", reason="agent offline", at_ms=1000,
                      broker_id=broker, request_id=rid))  # fmt: skip
    assert [(e.event.request_id, e.brokers) for e in h.events] == [
        ("r1", ["b1", "b2"]), ("r2", ["b2"])]  # fmt: skip


# --- who may look --------------------------------------------------------------------------------


def req(path: str = "/", host: str = "127.0.0.1:9464", **headers: str) -> Request:
    query = {}
    if "?" in path:
        path, _, q = path.partition("?")
        query = dict(p.split("=", 1) for p in q.split("&"))
    return Request("GET", path, query, {"host": host, **headers})


def test_loopback_is_open_but_only_under_a_loopback_host() -> None:
    access = Access("127.0.0.1", None)
    assert (access.loopback, access.enabled) == (True, True)
    assert access.refusal(req()) is None
    assert access.refusal(req(host="localhost:9464")) is None
    refused = access.refusal(req(host="evil.example:9464"))
    assert refused is not None
    assert (refused.status, refused.body) == (
        403, b"this console answers only under a loopback Host name\n")  # fmt: skip


def test_beyond_loopback_without_a_token_the_console_is_off() -> None:
    access = Access("0.0.0.0", None)
    assert access.enabled is False
    refused = access.refusal(req(host="10.1.2.3:9464"))
    assert refused is not None and refused.status == 403
    assert refused.body == (b"the console is off on 0.0.0.0: bound beyond loopback it needs a "
                            b"token (--console-token or REACH_CONSOLE_TOKEN)\n")  # fmt: skip


def test_the_token_by_query_bearer_or_cookie() -> None:
    access = Access("0.0.0.0", TOKEN)
    assert access.enabled is True
    host = "broker.internal:9464"
    denied = access.refusal(req(host=host))
    assert denied is not None and denied.status == 401
    wrong = access.refusal(req(f"/?token={TOKEN}x", host=host))
    assert wrong is not None and wrong.status == 401
    assert access.refusal(req(f"/?token={TOKEN}", host=host)) is None
    assert access.refusal(req(host=host, authorization=f"Bearer {TOKEN}")) is None
    assert access.refusal(req(host=host, cookie=f"a=b; reach_console={TOKEN}")) is None


async def test_the_token_in_the_address_becomes_a_cookie() -> None:
    app = App(Metrics().registry, Access("0.0.0.0", TOKEN), lambda: None)
    resp = await app(req(f"/?token={TOKEN}", host="b:1"))
    assert resp.status == 303
    headers = dict(resp.headers)  # type: ignore[union-attr]
    assert headers["Location"] == "/"
    assert headers["Set-Cookie"] == f"reach_console={TOKEN}; Path=/; HttpOnly; SameSite=Strict"


def test_console_tokens_are_checked() -> None:
    assert console_token(TOKEN, "--console-token") == TOKEN
    with pytest.raises(ConfigError) as exc:
        console_token("short", "--console-token")
    assert str(exc.value) == ("--console-token: a console token is 16 to 256 of the characters "
                              "A-Z a-z 0-9 . _ ~ + / = - (got 5 characters)")  # fmt: skip
    with pytest.raises(ConfigError):
        console_token("has a space in it, long enough", "REACH_CONSOLE_TOKEN")


def test_follow_idle_s_is_checked(tmp_path: Any) -> None:
    from reach_broker import config

    path = tmp_path / "broker.toml"
    path.write_text("[console]\nfollow_idle_s = 5\n")
    assert config.load(path).console.follow_idle_s == 5.0
    path.write_text("[console]\nfollow_idle_s = 0\n")
    with pytest.raises(ConfigError) as exc:
        config.load(path)
    assert str(exc.value) == f"{path}: Expected `float` > 0.0 - at `$.console.follow_idle_s`"


@pytest.mark.parametrize(
    ("host", "loopback"),
    [("127.0.0.1", True), ("::1", True), ("localhost", True), ("0.0.0.0", False),
     ("192.168.1.4", False), ("broker.example", False)],
)  # fmt: skip
def test_loopback_addresses(host: str, loopback: bool) -> None:
    assert is_loopback(host) is loopback


def test_host_names() -> None:
    assert [host_name(h) for h in ("127.0.0.1:9464", "[::1]:9464", "localhost", "a:b")] == [
        "127.0.0.1", "::1", "localhost", "a:b"]  # fmt: skip


# --- the HTTP server ---------------------------------------------------------------------------


def test_request_heads() -> None:
    r = parse_head(b"GET /api/agents/a%2Db?x=1&y= HTTP/1.1\r\nHost: h\r\nX-A:  v ")
    assert r == Request("GET", "/api/agents/a-b", {"x": "1", "y": ""}, {"host": "h", "x-a": "v"})
    for head, status in ((b"GET /\r\n", 400), (b"GET / SPDY/3", 400), (b"GET x HTTP/1.1", 400),
                         (b"GET / HTTP/1.1\r\nno colon", 400)):  # fmt: skip
        with pytest.raises(BadRequest) as exc:
            parse_head(head)
        assert exc.value.status == status


async def http(port: int, head: str) -> tuple[int, dict[str, str], bytes]:
    """One raw request; (status, headers, body)."""
    reader, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), 5)
    writer.write(head.encode())
    data = await asyncio.wait_for(reader.read(), 5)
    writer.close()
    top, _, body = data.partition(b"\r\n\r\n")
    lines = top.decode().split("\r\n")
    headers = dict(line.split(": ", 1) for line in lines[1:])
    return int(lines[0].split()[1]), headers, body


async def get(
    port: int, path: str, host: str = "localhost", method: str = "GET"
) -> tuple[int, dict[str, str], bytes]:
    return await http(port, f"{method} {path} HTTP/1.1\r\nHost: {host}\r\n\r\n")


@pytest.fixture
async def port() -> AsyncIterator[HttpPort]:
    cfg = Config()
    cfg.broker.metrics_port = 0  # HttpPort binds it as given: 0 asks for any free port
    p = HttpPort(access_of(cfg.broker.metrics_host, cfg.console), cfg.broker.metrics_port,
                 Metrics().registry, lambda: "not running")  # fmt: skip
    await p.start()
    try:
        yield p
    finally:
        await p.stop()


async def test_metrics_the_page_and_read_only(port: HttpPort) -> None:
    n = port.server.port
    status, headers, body = await get(n, "/metrics", "x")
    assert (status, headers["Content-Type"]) == (200, "text/plain; version=0.0.4; charset=utf-8")
    assert b"# TYPE reach_route_requests_total counter" in body
    status, headers, body = await get(n, "/", "127.0.0.1")
    assert (status, headers["Content-Type"]) == (200, "text/html; charset=utf-8")
    assert b'<script src="/static/console.js" defer></script>' in body
    assert headers["Content-Security-Policy"].startswith("default-src 'self'")
    status, headers, _ = await get(n, "/static/console.js")
    assert (status, headers["Content-Type"]) == (200, "text/javascript; charset=utf-8")
    status, headers, body = await get(n, "/static/console.css", "[::1]:80", method="HEAD")
    assert (status, body) == (200, b"")
    assert int(headers["Content-Length"]) > 1000
    status, headers, body = await get(n, "/", method="POST")
    assert (status, headers["Allow"], body) == (405, "GET, HEAD", b"POST not allowed: read-only\n")
    status, _, body = await get(n, "/api/fleet")
    assert (status, body) == (503, b"the broker is starting\n")  # no feed runs here
    status, _, body = await get(n, "/nope")
    assert (status, body) == (404, b"no such page: /nope\n")
    status, _, _ = await get(n, "/static/../app.py")
    assert status == 404
    status, _, _ = await http(n, "GET / HTTP/1.1\r\n" + "X: y\r\n" * 2000 + "\r\n")
    assert status == 431


async def test_a_taken_port_is_an_oserror() -> None:
    first = HttpServer(
        "127.0.0.1", 0, App(Metrics().registry, Access("127.0.0.1", None), lambda: None)
    )
    await first.start()
    try:
        second = HttpServer("127.0.0.1", first.port, first.handler)
        with pytest.raises(OSError) as exc:
            await second.start()
        assert exc.value.errno == 98  # EADDRINUSE
    finally:
        await first.stop()


# --- on a running broker -------------------------------------------------------------------------


async def audit_state(nc: NATS) -> tuple[int, int]:
    """REACH_AUDIT's stored events and its consumers (only the console's feed makes any
    here)."""
    js = nc.jetstream()
    info = await js.stream_info("REACH_AUDIT")
    return info.state.messages, len(await js.consumers_info("REACH_AUDIT"))


async def until(
    read: Callable[[], Awaitable[Any]],
    expected: Any,
    timeout: float = 5.0,  # noqa: ASYNC109 - a polling deadline, not a cancellation scope
    what: str = "",
) -> None:
    """Poll ``await read()`` until it equals ``expected``; fail with the last value."""
    deadline = time.monotonic() + timeout
    while (value := await read()) != expected:
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}: {value!r}")
        await asyncio.sleep(0.02)


class Sse:
    """A raw /events client: the (event, data) pairs as they come."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    @classmethod
    async def open(cls, port: int) -> Sse:
        reader, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), 5)
        writer.write(b"GET /events HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        assert head.startswith(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream"), head
        return cls(reader, writer)

    async def next(self, kind: str, timeout: float = 5.0) -> Any:  # noqa: ASYNC109
        """The data of the next event of ``kind`` (others are skipped)."""
        async with asyncio.timeout(timeout):
            while True:
                block = (await self.reader.readuntil(b"\n\n")).decode()
                fields = dict(line.split(": ", 1) for line in block.split("\n") if ": " in line)
                if fields.get("event") == kind:
                    return json.loads(fields["data"])

    def close(self) -> None:
        self.writer.close()


async def serve_port(broker: Broker) -> HttpPort:
    """The port over a broker built with the console's feed (``console=True``)."""
    cfg = fast_config("unused")
    p = HttpPort(access_of(cfg.broker.metrics_host, cfg.console), cfg.broker.metrics_port,
                 broker.metrics.registry, broker.not_ready, broker.feed)  # fmt: skip
    await p.start()
    return p


async def test_the_page_is_told_of_the_fleet_and_of_each_transition(
    nats_server: NatsServer, nc: NATS, broker_factory: BrokerFactory
) -> None:
    broker = await broker_factory(**QUIET, console=True, console__sample_s=0.1)
    port = await serve_port(broker)
    try:
        await announce(nc, "alpha", ["summarize"], region="eu")
        await wait_for(lambda: broker.metrics.heartbeat_result["accepted"].value == 1,
                       what="alpha's heartbeat")  # fmt: skip
        feed = port.feed
        assert feed is not None
        beaten = feed.history.ticks  # samples from here on see the heartbeat's load
        # The page's first push lists the last events of REACH_AUDIT, read when it connects
        # (nobody watched before: nothing was followed).
        await until(lambda: audit_state(nc), (1, 0), what="alpha's registration stored")
        assert list(feed.history.events) == []
        sse = await Sse.open(port.server.port)
        try:
            hello = await sse.next("hello")
            assert (hello["broker_id"], hello["sample_s"]) == (broker.broker_id, 0.1)
            fleet = await sse.next("fleet")
            assert [a["agent_id"] for a in fleet["agents"]] == ["alpha"]
            (cap,) = fleet["capabilities"]
            assert (cap["name"], cap["reachable"], cap["panic"]) == ("summarize", 1, False)
            assert cap["routable"][0]["share"] == 1.0
            assert [e["event"]["kind"] for e in await sse.next("events")] == ["registered"]
            assert (await sse.next("compensation"))["available"] is False  # not read yet
            # A transition: the event, then the fleet with it, both pushed at once.
            await nc.request("reach.leave.alpha", b"{}", timeout=2)
            moved = await sse.next("event", 2.0)
            assert (moved["event"]["to"], moved["brokers"]) == ("draining", [broker.broker_id])
            fleet = await sse.next("fleet", 2.0)
            assert fleet["agents"][0]["state"] == "draining"
            comp = await sse.next("compensation", 7.0)
            assert (comp["available"], comp["total"], comp["capabilities"]) == (True, 0, [])
        finally:
            sse.close()
        await wait_for(lambda: feed.history.ticks >= beaten + 3, what="3 samples")
        status, _, body = await get(port.server.port, "/api/agents/alpha")
        detail = json.loads(body)
        assert status == 200
        assert [(t["event"].get("from"), t["event"]["to"]) for t in detail["transitions"]] == [
            (None, "healthy"), ("healthy", "draining")]  # fmt: skip
        samples = detail["samples"]
        assert len(samples["at_ms"]) >= 3  # every 0.1 s since alpha announced
        assert samples["at_ms"] == sorted(samples["at_ms"])
        assert samples["score"][-3:] == [91.5] * 3  # 1 of 4 slots busy: 100 x 0.8^0.4
        assert (samples["load"][-3:], samples["task_ms"][-3:]) == ([0.25] * 3, [None] * 3)
        status, _, _ = await get(port.server.port, "/api/agents/nobody")
        assert status == 404
        await wait_for(lambda: not port.feed or not port.feed.watchers, what="the page gone")
    finally:
        await port.stop()


async def test_the_queue_depth_and_the_oldest_entry(
    nats_server: NatsServer, nc: NATS, broker_factory: BrokerFactory
) -> None:
    from jetstream import compensation

    broker = await broker_factory(**QUIET, console=True)
    port = await serve_port(broker)
    try:
        for rid in ("r1", "r2"):
            await compensation.enqueue(nc, "translate", b"{}", request_id=rid,
                                       expires_at_ms=0, subjects=broker.subjects)  # fmt: skip
        first = await compensation.oldest(nc, "translate", subjects=broker.subjects)
        assert first is not None and first.request_id == "r1"
        sse = await Sse.open(port.server.port)
        try:
            comp = await sse.next("compensation", 5.0)
            if not comp["available"]:  # the page's first copy predates the first poll
                comp = await sse.next("compensation", 7.0)
        finally:
            sse.close()
        assert comp["total"] == 2
        assert comp["capabilities"] == [
            {"capability": "translate", "depth": 2, "oldest_ms": first.enqueued_ms}]  # fmt: skip
    finally:
        await port.stop()


def test_a_bad_console_token_is_a_usage_error() -> None:
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-m", "reach_broker.cli", "broker", "--console-token", "short",
         "--metrics-port", "0", "--server", "nats://127.0.0.1:1"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 2
    assert out.stderr == ("reach: --console-token: a console token is 16 to 256 of the "
                          "characters A-Z a-z 0-9 . _ ~ + / = - (got 5 characters)\n")  # fmt: skip


async def test_the_timeline_starts_with_the_audit_history(
    nats_server: NatsServer, nc: NATS, broker_factory: BrokerFactory
) -> None:
    from reach_agent.wire import schema

    await broker_factory(**QUIET)  # it provisions REACH_AUDIT
    js = nc.jetstream()
    old = event("ghost", 1_000, to="offline", broker="an-earlier-broker")
    await js.publish("reach.event.state.ghost", schema.encoder.encode(old))
    broker = await broker_factory(**QUIET, console=True)  # its feed reads the history
    port = await serve_port(broker)
    try:
        sse = await Sse.open(port.server.port)
        try:
            (entry,) = await sse.next("events")
            assert entry == {"event": {"kind": "state", "agent_id": "ghost", "reason":
                                       "no heartbeat", "at_ms": 1000,
                                       "broker_id": "an-earlier-broker", "to": "offline",
                                       "from": "healthy"},
                             "brokers": ["an-earlier-broker"]}  # fmt: skip
        finally:
            sse.close()
    finally:
        await port.stop()


def moves(entries: list[dict[str, Any]]) -> list[tuple[str, str, str | None]]:
    """What a page's events say: kind, agent and the state it went to."""
    return [(e["event"]["kind"], e["event"]["agent_id"], e["event"].get("to")) for e in entries]


async def test_the_audit_trail_is_followed_only_while_a_page_watches(
    nats_server: NatsServer, nc: NATS, broker_factory: BrokerFactory
) -> None:
    """Nobody watching: no consumer on REACH_AUDIT, no event decoded. Two pages connecting
    at once share one follow and get the events stored before they came, then live ones;
    follow_idle_s after the last one left the consumer is gone, and a new page gets a new
    follow that shows each event once."""
    broker = await broker_factory(**QUIET, console=True, console__follow_idle_s=0.3)
    port = await serve_port(broker)
    feed = port.feed
    assert feed is not None
    try:
        await announce(nc, "alpha", ["summarize"])
        await announce(nc, "beta", ["summarize"])
        await nc.request("reach.leave.alpha", b"{}", timeout=2)
        await until(lambda: audit_state(nc), (3, 0), what="3 events stored, no consumer")
        assert list(feed.history.events) == []  # no consumer: nothing could have come

        one, two = await asyncio.gather(Sse.open(port.server.port), Sse.open(port.server.port))
        try:
            before = [("registered", "alpha", "healthy"), ("registered", "beta", "healthy"),
                      ("left", "alpha", "draining")]  # fmt: skip
            assert moves(await one.next("events")) == before
            assert moves(await two.next("events")) == before
            assert await audit_state(nc) == (3, 1)  # one follow for both pages
            await announce(nc, "gamma", ["summarize"])
            assert moves([await one.next("event")]) == [("registered", "gamma", "healthy")]
            assert moves([await two.next("event")]) == [("registered", "gamma", "healthy")]
            status, _, body = await get(port.server.port, "/api/events")
            assert (status, moves(json.loads(body))) == (
                200, [*before, ("registered", "gamma", "healthy")])  # fmt: skip
        finally:
            one.close()
            two.close()
        await wait_for(lambda: not feed.watchers, what="both pages gone")
        await until(lambda: audit_state(nc), (4, 0), what="the follow stopped after 0.3 s")
        assert feed._follow is None

        await announce(nc, "delta", ["summarize"])  # stored while nobody watches: not decoded
        await until(lambda: audit_state(nc), (5, 0), what="delta's registration stored")
        assert len(feed.history.events) == 4
        again = await Sse.open(port.server.port)
        try:
            # Each once: the events kept from the first follow are not read twice.
            assert moves(await again.next("events")) == [
                *before, ("registered", "gamma", "healthy"),
                ("registered", "delta", "healthy")]  # fmt: skip
            assert await audit_state(nc) == (5, 1)
            await nc.request("reach.leave.beta", b"{}", timeout=2)
            assert moves([await again.next("event")]) == [("left", "beta", "draining")]
        finally:
            again.close()
        await until(lambda: audit_state(nc), (6, 0), what="the follow stopped again")
    finally:
        await port.stop()


async def test_a_trail_made_again_is_followed_from_its_first_event(
    nats_server: NatsServer, nc: NATS, broker_factory: BrokerFactory
) -> None:
    """REACH_AUDIT deleted and made again between two follows numbers its events from 1 again:
    the next follow shows them (the sequences kept from the old trail do not hide them)."""
    broker = await broker_factory(**QUIET, console=True, console__follow_idle_s=0.1)
    port = await serve_port(broker)
    try:
        for agent_id in ("alpha", "beta", "gamma"):
            await announce(nc, agent_id, ["summarize"])
        first = await Sse.open(port.server.port)
        try:
            shown = [m[1] for m in moves(await first.next("events"))]
            assert shown == ["alpha", "beta", "gamma"]
        finally:
            first.close()
        await until(lambda: audit_state(nc), (3, 0), what="the first follow stopped")
        await nc.jetstream().delete_stream("REACH_AUDIT")
        await provision(nc, [d for d in load_definitions() if d["name"] == "REACH_AUDIT"])
        await announce(nc, "delta", ["summarize"])  # seq 1 of the new trail
        await until(lambda: audit_state(nc), (1, 0), what="delta's registration stored anew")
        again = await Sse.open(port.server.port)
        try:
            shown = [m[1] for m in moves(await again.next("events"))]
            assert shown == ["alpha", "beta", "gamma", "delta"]
        finally:
            again.close()
    finally:
        await port.stop()


async def test_an_agents_transitions_start_the_follow_and_the_broker_stop_ends_it(
    nats_server: NatsServer, nc: NATS, broker_factory: BrokerFactory
) -> None:
    """``/api/agents/<id>`` reads the events too (the agent's last transitions); a broker
    stopped while its console follows leaves neither a task nor a listener behind."""
    broker = await broker_factory(**QUIET, console=True)  # follow_idle_s: 60 s
    port = await serve_port(broker)
    try:
        await announce(nc, "alpha", ["summarize"])
        await nc.request("reach.leave.alpha", b"{}", timeout=2)
        await until(lambda: audit_state(nc), (2, 0), what="2 events stored, no consumer")
        status, _, body = await get(port.server.port, "/api/agents/alpha")
        assert status == 200
        assert [(t["event"].get("from"), t["event"]["to"])
                for t in json.loads(body)["transitions"]] == [
            (None, "healthy"), ("healthy", "draining")]  # fmt: skip
        assert await audit_state(nc) == (2, 1)  # followed for follow_idle_s after the request
        await broker.stop()
        assert [t.get_name() for t in asyncio.all_tasks()
                if t.get_name().startswith(("reach-console", "reach-follow"))] == []  # fmt: skip
        assert broker.feed is not None and broker.feed._follow is None
    finally:
        await port.stop()


def test_a_row_is_rebuilt_only_for_an_agent_heard_from() -> None:
    from reach_broker.console.views import Views
    from reach_broker.core.explain import Explainer

    from .test_routing import World

    w = World("ab")
    views = Views(w.reg, Explainer(w.router, w.cfg.scoring), "b1")
    first = views.fleet(1.0, 1_000, 10)
    w.beat("a", 1.5, active=5)
    second = views.fleet(2.0, 2_000, 10)
    a1, b1 = first.agents
    a2, b2 = second.agents
    assert b2 is b1  # b not heard from: the same encoded row
    assert a2 is not a1
    assert json.loads(bytes(a2))["active"] == 5  # type: ignore[arg-type]
    assert [c.reachable for c in second.capabilities] == [2]


async def test_the_page_shows_who_owns_each_partition_and_pages_the_fleet(
    nats_server: NatsServer, nc: NATS, broker_factory: BrokerFactory
) -> None:
    broker = await broker_factory(**QUIET, console=True)
    port = await serve_port(broker)
    try:
        ids = [f"agent-{i:03d}" for i in range(120)]
        for agent_id in ids:
            await announce(nc, agent_id, ["summarize"])
        await wait_for(lambda: len(broker.registry.agents) == 120, what="120 agents")
        status, _, body = await get(port.server.port, "/api/owners")
        owners = json.loads(body)
        assert status == 200
        partitions = broker.cfg.fleet.partitions
        assert (owners["partitions"], owners["brokers"]) == (
            partitions,
            {broker.broker_id: partitions},
        )
        assert [r["partition"] for r in owners["rows"]] == list(range(partitions))
        assert {r["owner"] for r in owners["rows"]} == {broker.broker_id}
        assert [r["agents"] for r in owners["rows"]] == broker.registry.listing.counts()
        assert sum(r["agents"] for r in owners["rows"]) == 120
        sse = await Sse.open(port.server.port)
        try:
            pushed = await sse.next("owners", 5.0)
            if not pushed["partitions"]:  # the page's first copy predates the first ask
                pushed = await sse.next("owners", 7.0)
        finally:
            sse.close()
        assert pushed["rows"] == owners["rows"]

        seen: list[str] = []
        cursor = None
        for _ in range(200):  # bounded: 120 agents in pages of 7 over 32 partitions
            query = f"/api/agents?limit=7&cursor={cursor}" if cursor else "/api/agents?limit=7"
            status, _, body = await get(port.server.port, query)
            page = json.loads(body)
            assert status == 200 and len(page["agents"]) <= 7
            assert page["broker_id"] == broker.broker_id
            seen += [a["agent_id"] for a in page["agents"]]
            cursor = page.get("cursor")
            if cursor is None:
                break
        assert sorted(seen) == ids and len(seen) == 120
        status, _, body = await get(port.server.port, "/api/agents?limit=0")
        assert (status, body) == (400, b"limit '0' is not a number from 1 to 5000\n")
        status, _, body = await get(port.server.port, "/api/agents?cursor=99.x")
        assert (status, json.loads(body)["error"]) == (
            200,
            "INVALID_REQUEST: partition '99' of "
            "subject 'reach.agents.99' is not a "
            "partition of this fleet (0 to 31)",
        )
    finally:
        await port.stop()
