"""OpenTelemetry spans out (the extra ``otel``): a real OTLP/HTTP receiver on loopback (a
small HTTP server of the test's own decoding the protobuf export requests with the
opentelemetry-proto package) gets the spans of a caller, a broker and two agents, and one
trace holds them all, each a child of the span that caused it. Without the variable nothing
of OpenTelemetry is imported; without the extra, one warning and no spans."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

import reach_agent
from reach_agent import otel
from reach_agent.client.config import ClientConfig
from reach_broker.cluster.natsserver import NatsServer

from .conftest import BrokerFactory, wait_for

ROOT = Path(__file__).resolve().parent.parent


class Receiver:
    """An OTLP/HTTP trace receiver: POST /v1/traces, protobuf; keeps every span it got as
    a dict (name, ids, parent, service, attributes)."""

    def __init__(self) -> None:
        from opentelemetry.proto.collector.trace.v1 import trace_service_pb2 as pb

        self.spans: list[dict[str, Any]] = []
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                ok = self.path == "/v1/traces"
                if ok:
                    req = pb.ExportTraceServiceRequest()
                    req.ParseFromString(body)
                    receiver.take(req)
                out = pb.ExportTraceServiceResponse().SerializeToString()
                self.send_response(200 if ok else 404)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def take(self, req: Any) -> None:
        for rs in req.resource_spans:
            service = next(a.value.string_value for a in rs.resource.attributes
                           if a.key == "service.name")  # fmt: skip
            for ss in rs.scope_spans:
                for s in ss.spans:
                    self.spans.append({
                        "name": s.name, "trace": s.trace_id.hex(), "id": s.span_id.hex(),
                        "parent": s.parent_span_id.hex(), "service": service,
                        "error": s.status.code == 2,
                        "attrs": {a.key: a.value.string_value for a in s.attributes},
                    })  # fmt: skip

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def receiver(monkeypatch: pytest.MonkeyPatch) -> Iterator[Receiver]:
    """The receiver, and the environment pointing this process's spans at it (providers made
    afresh for the test, shut down after it)."""
    pytest.importorskip("opentelemetry.sdk", reason="needs the extra 'otel'")
    pytest.importorskip("opentelemetry.proto", reason="pip install -e '.[dev]'")
    rec = Receiver()
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", rec.url)
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")
    monkeypatch.delenv("OTEL_SERVICE_NAME", raising=False)
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", raising=False)
    monkeypatch.setattr(otel, "_BY_SERVICE", {})
    try:
        yield rec
    finally:
        for spans in otel._BY_SERVICE.values():
            if spans is not None:
                spans.provider.shutdown()
        rec.close()


async def test_one_trace_holds_the_callers_the_brokers_and_the_agents_spans(
    receiver: Receiver, nats_server: NatsServer, broker_factory: BrokerFactory
) -> None:
    broker = await broker_factory()
    assert broker.spans is not None
    inner = reach_agent.Agent("inner-agent", ["inner"], heartbeat_interval=0.2)
    outer = reach_agent.Agent("outer-agent", ["outer"], heartbeat_interval=0.2)
    # Both callers ask the broker for each route (as a caller in another language, the CLI,
    # or Client(local_routing=False) does): the broker's route span is in the trace. An SDK
    # caller routing from its table has none (the next test).
    asks = ClientConfig(local_routing=False)
    sub = reach_agent.Client(nats_server.url, asks)

    @inner.handler("inner")
    async def run_inner(task: reach_agent.Task) -> Any:
        return {"inner": task.payload}

    @outer.handler("outer")
    async def run_outer(task: reach_agent.Task) -> Any:
        return {"outer": await sub.call("inner", task.payload, timeout=10)}

    await inner.start(nats_server.url)
    await outer.start(nats_server.url)
    await sub.start()
    try:
        ids = ("inner-agent", "outer-agent")
        await wait_for(lambda: all((r := broker.registry.agents.get(a)) is not None
                                   and r.state == "healthy" for a in ids),
                       10, what="both agents healthy")  # fmt: skip
        async with reach_agent.Client(nats_server.url, asks) as client:
            assert client.spans is not None
            result = await client.call("outer", {"x": 1}, timeout=10, request_id="rq-otel-1")
        assert result == {"outer": {"inner": {"x": 1}}}
    finally:
        await sub.stop()
        await outer.stop(grace=1)
        await inner.stop(grace=1)

    def named(name: str) -> dict[str, Any] | None:
        return next((s for s in receiver.spans if s["name"] == name), None)

    wanted = ("reach.call outer", "reach.route outer", "reach.run outer", "reach.claim",
              "reach.call inner", "reach.route inner", "reach.run inner")  # fmt: skip
    await wait_for(lambda: all(named(n) for n in wanted) and
                   sum(s["name"] == "reach.claim" for s in receiver.spans) == 2,
                   10, what=f"spans {wanted}")  # fmt: skip
    call, route, run = (
        named("reach.call outer"),
        named("reach.route outer"),
        named("reach.run outer"),
    )
    sub_call, sub_route = named("reach.call inner"), named("reach.route inner")
    sub_run = named("reach.run inner")
    assert call and route and run and sub_call and sub_route and sub_run
    claims = {s["parent"]: s for s in receiver.spans if s["name"] == "reach.claim"}
    # One trace, every span a child of the one that caused it.
    assert {s["trace"] for s in receiver.spans} == {call["trace"]}
    assert call["parent"] == ""  # the caller's: a root
    assert route["parent"] == call["id"] and run["parent"] == call["id"]
    assert claims[run["id"]]["attrs"]["reach.claim"] == "ours"
    assert sub_call["parent"] == run["id"]  # the handler's sub-call, a child of its run
    assert sub_route["parent"] == sub_call["id"] and sub_run["parent"] == sub_call["id"]
    assert claims[sub_run["id"]]["attrs"]["reach.agent_id"] == "inner-agent"
    # Who sent each, and what they say.
    assert (call["service"], route["service"], run["service"]) == (
        "reach-client",
        "reach-broker",
        "reach-agent",
    )
    assert call["attrs"] == {"reach.capability": "outer", "reach.request_id": "rq-otel-1",
                             "reach.agent_id": "outer-agent"}  # fmt: skip
    assert route["attrs"] == {"reach.capability": "outer", "reach.request_id": "rq-otel-1",
                              "reach.agent_id": "outer-agent"}  # fmt: skip
    assert run["attrs"] == {"reach.capability": "outer", "reach.request_id": "rq-otel-1",
                            "reach.agent_id": "outer-agent"}  # fmt: skip
    assert sub_run["attrs"]["reach.agent_id"] == "inner-agent"
    assert not any(s["error"] for s in receiver.spans)


async def test_a_locally_routed_call_is_the_callers_span_and_the_agents(
    receiver: Receiver, nats_server: NatsServer, broker_factory: BrokerFactory
) -> None:
    """The SDK caller routes from its route table: one hop, no broker on the call's path,
    so the trace holds the call and the agent's run and claim, children of the call."""
    broker = await broker_factory()
    agent = reach_agent.Agent("local-agent", ["local"], heartbeat_interval=0.2)

    @agent.handler("local")
    async def run_local(task: reach_agent.Task) -> Any:
        return task.payload

    await agent.start(nats_server.url)
    try:
        await wait_for(lambda: (r := broker.registry.agents.get("local-agent")) is not None
                       and r.state == "healthy", 10, what="the agent healthy")  # fmt: skip
        async with reach_agent.Client(nats_server.url) as client:
            assert await client.call("local", {"y": 2}, timeout=10, request_id="rq-otel-3") == {
                "y": 2
            }
    finally:
        await agent.stop(grace=1)

    def named(name: str) -> dict[str, Any] | None:
        return next((s for s in receiver.spans if s["name"] == name), None)

    await wait_for(lambda: named("reach.call local") and named("reach.run local")
                   and named("reach.claim"), 10, what="the call's spans")  # fmt: skip
    call, run, claim = named("reach.call local"), named("reach.run local"), named("reach.claim")
    assert call and run and claim
    assert call["parent"] == "" and run["parent"] == call["id"] and claim["parent"] == run["id"]
    assert {s["trace"] for s in receiver.spans} == {call["trace"]}
    assert (call["service"], run["service"]) == ("reach-client", "reach-agent")
    assert named("reach.route local") is None  # no broker asked
    assert not any(s["error"] for s in receiver.spans)


async def test_a_failed_call_is_an_error_span(
    receiver: Receiver, nats_server: NatsServer, broker_factory: BrokerFactory
) -> None:
    await broker_factory()
    async with reach_agent.Client(nats_server.url) as client:
        with pytest.raises(reach_agent.NoReachableAgent):
            await client.call("nobody", {}, timeout=5, request_id="rq-otel-2")
    names = ("reach.call nobody", "reach.route nobody")
    await wait_for(lambda: {s["name"] for s in receiver.spans} >= set(names), 10, what=names)
    call = next(s for s in receiver.spans if s["name"] == "reach.call nobody")
    route = next(s for s in receiver.spans if s["name"] == "reach.route nobody")
    assert call["error"] and call["attrs"]["reach.error.code"] == "NO_REACHABLE_AGENT"
    assert route["error"] and route["parent"] == call["id"]


PROBE = """
import json, sys
{block}
import reach_agent, reach_broker.broker, reach_broker.cli
from reach_broker.config import Config
from reach_broker.service.metrics import Metrics
client = reach_agent.Client()
agent = reach_agent.Agent("a", ["c"])
broker = reach_broker.broker.Broker(Config(), metrics=Metrics())
print(json.dumps({{"spans": [client.spans is None, agent.tasks.spans is None,
                             broker.spans is None],
                  "imported": sorted(m for m in sys.modules if m.startswith("opentelemetry"))}}))
"""


def probe(env: dict[str, str], block: str = "") -> tuple[dict[str, Any], str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    done = subprocess.run(
        [sys.executable, "-c", PROBE.format(block=block)],
        cwd=ROOT,
        env={**clean, **env},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout), done.stderr


def test_without_the_variable_nothing_of_opentelemetry_is_imported() -> None:
    out, _ = probe({})
    assert out == {"spans": [True, True, True], "imported": []}


def test_without_the_extra_one_warning_and_no_spans() -> None:
    block = "sys.modules['opentelemetry.sdk'] = None  # as if the extra were not installed"
    out, err = probe({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9"}, block)
    assert out["spans"] == [True, True, True]
    assert err.count("is set but the OpenTelemetry SDK is not installed") == 1, err
    assert "pip install 'nats-reach[otel]'" in err
