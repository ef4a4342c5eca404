"""The wire contract, spoken by a raw NATS client (no SDK) to a real broker and server."""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import nats
import pytest
from nats.aio.client import Client as NATS

from jetstream.names import STREAM_NAMES
from reach_agent.connection import flush_subscriptions
from reach_agent.routing.table import partition
from reach_broker.broker import Broker

from .conftest import BrokerFactory, wait_for


def announce_body(agent_id: str, **extra: Any) -> bytes:
    body = {
        "agent_id": agent_id,
        "capabilities": ["text_processing", "intent.recognition"],
        "max_concurrency": 4,
        "heartbeat_interval_ms": 100,
        "region": "eu",
        "version": "1.2.0",
        "tags": {"tier": "gold"},
    }
    body.update(extra)
    return json.dumps(body).encode()


async def announce(nc: NATS, agent_id: str, **extra: Any) -> dict[str, Any]:
    reply = await nc.request(f"reach.announce.{agent_id}", announce_body(agent_id, **extra), 2)
    assert reply.headers is None or "Nats-Service-Error" not in reply.headers, reply.headers
    return json.loads(reply.data)


async def heartbeat(nc: NATS, agent_id: str, token: str, seq: int, **extra: Any) -> None:
    body = {"agent_id": agent_id, "token": token, "seq": seq, "status": "idle", "active": 0,
            "queue_depth": 0, "ok_total": 0, "fail_total": 0}  # fmt: skip
    body.update(extra)
    if "body_agent_id" in body:
        body["agent_id"] = body.pop("body_agent_id")
    await nc.publish(f"reach.hb.{agent_id}", json.dumps(body).encode())


class EventLog:
    """Collects ``reach.event.>`` as decoded dicts."""

    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []

    async def start(self, nc: NATS) -> EventLog:
        async def cb(msg: Any) -> None:
            event = json.loads(msg.data)
            event["_subject"] = msg.subject
            self.events.append(event)

        await nc.subscribe("reach.event.>", cb=cb)
        await flush_subscriptions(nc)
        return self

    def transitions(self, agent_id: str) -> list[tuple[str, str | None, str | None]]:
        return [(e["kind"], e.get("from"), e.get("to")) for e in self.events
                if e["agent_id"] == agent_id]  # fmt: skip


async def test_raw_client_announces_heartbeats_and_routes_itself(nc: NATS, broker: Broker) -> None:
    ack = await announce(nc, "alpha")
    assert ack["agent_id"] == "alpha"
    assert ack["heartbeat_interval_ms"] == 100
    assert ack["broker_id"] == broker.broker_id
    assert ack["token"].startswith("v1.")
    await heartbeat(nc, "alpha", ack["token"], 1)
    await wait_for(lambda: broker.metrics.heartbeat_result["accepted"].value == 1)

    reply = await nc.request("reach.route.text_processing", b"", timeout=2)
    assert reply.headers is None
    body = json.loads(reply.data)
    assert body["capability"] == "text_processing"
    assert isinstance(body["generated_at_ms"], int)
    assert body["candidates"] == [
        {
            "agent_id": "alpha",
            "subject": "reach.task.alpha.text_processing",
            "score": 100.0,
            "state": "healthy",
            "load": 0.0,
            "region": "eu",
            "version": "1.2.0",
            "protocol": "reach",
        }
    ]
    # A dotted capability routes the same way.
    reply = await nc.request("reach.route.intent.recognition", b"{}", timeout=2)
    assert [c["subject"] for c in json.loads(reply.data)["candidates"]] == [
        "reach.task.alpha.intent.recognition"
    ]
    # reach.agents lists it.
    reply = await nc.request("reach.agents", b"{}", timeout=2)
    [view] = json.loads(reply.data)
    assert view["agent_id"] == "alpha"
    assert view["state"] == "healthy"
    assert view["capabilities"] == ["text_processing", "intent.recognition"]
    assert view["success_rate"] == 1.0


async def test_streams_and_registrations_are_logged_once_each(
    nc: NATS, broker_factory: BrokerFactory, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO):
        await broker_factory()  # a fresh server: every stream is created
        await broker_factory()  # a second replica: every stream is already as defined
        await announce(nc, "alpha")

        def registered() -> list[str]:
            return [m for m in caplog.messages if m.startswith("agent.registered ")]

    # The reply is the owner's of alpha's partition, the only replica that hears it.
    assert registered() == ["agent.registered agent=alpha to=healthy reason=announced"]
    said = [(r.name, r.getMessage()) for r in caplog.records]
    streams = [(name, m) for name, m in said if any(s in m for s in STREAM_NAMES)]
    assert streams == [
        ("jetstream.provision", f"jetstream.stream_created name={s}") for s in STREAM_NAMES
    ]


async def test_missed_heartbeats_suspect_offline_then_recovering_healthy(
    nc: NATS, broker_factory: BrokerFactory
) -> None:
    broker = await broker_factory(detection__phi_enabled=False)
    events = await EventLog().start(nc)
    ack = await announce(nc, "beta", heartbeat_interval_ms=100)
    token = ack["token"]
    seq = 0
    for _ in range(3):
        seq += 1
        await heartbeat(nc, "beta", token, seq)
        await asyncio.sleep(0.1)
    rec = broker.registry.agents["beta"]  # type: ignore[union-attr]
    # Silence: suspect after 3 intervals, offline after 6, measured on the broker's clock.
    await wait_for(lambda: rec.state == "suspect", 2, what="suspect")
    suspect_silence = broker.clock() - rec.last_seen
    await wait_for(lambda: rec.state == "offline", 2, what="offline")
    offline_silence = broker.clock() - rec.last_seen
    assert 0.3 <= suspect_silence < 0.3 + 0.15
    assert 0.6 <= offline_silence < 0.6 + 0.15

    # Resume: offline → recovering → healthy (on-time heartbeats; no probe responder here).
    # The agent beats on until it is healthy, as a real one does: on a loaded machine a beat
    # can land later than 1.5 intervals and not count, and a fixed count of beats then ends
    # with the agent silent again, not with a slow broker.
    async def beat_until_healthy() -> None:
        nonlocal seq
        while rec.state != "healthy":
            seq += 1
            await heartbeat(nc, "beta", token, seq)
            await asyncio.sleep(0.1)

    beater = asyncio.create_task(beat_until_healthy())
    try:
        await wait_for(lambda: rec.state == "healthy", 2, what="healthy again")
    finally:
        beater.cancel()
    await wait_for(lambda: len(events.transitions("beta")) >= 5, 2, what="five events")
    assert events.transitions("beta")[:5] == [
        ("registered", None, "healthy"),
        ("state", "healthy", "suspect"),
        ("state", "suspect", "offline"),
        ("state", "offline", "recovering"),
        ("state", "recovering", "healthy"),
    ]
    subjects = [e["_subject"] for e in events.events if e["agent_id"] == "beta"][:3]
    assert subjects == ["reach.event.registered.beta", "reach.event.state.beta",
                        "reach.event.state.beta"]  # fmt: skip
    reasons = [e["reason"] for e in events.events if e["agent_id"] == "beta"]
    assert reasons[1].startswith("no heartbeat for ")
    assert reasons[3] == "heartbeat resumed"
    assert reasons[4] == "heartbeats on time"


async def test_leave_drains_and_stops_routes(nc: NATS, broker: Broker) -> None:
    events = await EventLog().start(nc)
    ack = await announce(nc, "gamma")
    reply = await nc.request("reach.leave.gamma", json.dumps({"token": ack["token"]}).encode(), 2)
    assert json.loads(reply.data) == {"ok": True}
    assert broker.registry.agents["gamma"].state == "draining"  # type: ignore[union-attr]
    reply = await nc.request("reach.route.text_processing", b"", timeout=2)
    assert reply.headers["Nats-Service-Error-Code"] == "503"
    assert json.loads(reply.data)["error"]["code"] == "NO_REACHABLE_AGENT"
    await wait_for(lambda: len(events.transitions("gamma")) == 2, 2, what="left event")
    assert events.transitions("gamma")[1] == ("left", "healthy", "draining")


async def test_two_replicas_same_state_route_answered_once(
    nc: NATS, broker_factory: BrokerFactory
) -> None:
    # b1 takes every partition, and hands half to b2 as soon as it sees it join: each then
    # hears only its own partitions' agents (the other nothing of delta).
    b1 = await broker_factory()
    b2 = await broker_factory()
    await wait_for(lambda: (len(b1.partitions.held), len(b2.partitions.held)) == (16, 16),
                   what="each replica owning half the partitions")  # fmt: skip
    owner, other = (b1, b2) if partition("delta", 32) in b1.partitions.held else (b2, b1)
    ack = await announce(nc, "delta")
    for seq in range(1, 4):
        await heartbeat(nc, "delta", ack["token"], seq, active=1)
    await wait_for(lambda: owner.metrics.heartbeat_result["accepted"].value == 3)
    rec = owner.registry.agents["delta"]
    assert (rec.state, rec.seq, rec.active) == ("healthy", 3, 1)
    assert other.metrics.heartbeat_result["accepted"].value == 0
    assert other.registry.agents == {}

    # Route requests go to one replica each (the capability's owner answers, the other
    # forwards to it): count replies on a raw inbox. Peeks: no task follows, so neither
    # replica counts delta as handed 20 tasks (it has 4 slots).
    inbox = nc.new_inbox()
    replies: list[Any] = []

    async def collect(msg: Any) -> None:
        replies.append(msg)

    await nc.subscribe(inbox, cb=collect)
    for _ in range(20):
        await nc.publish("reach.route.text_processing", b'{"peek": true}', reply=inbox)
    await wait_for(lambda: len(replies) >= 20, 3, what="20 replies")
    await asyncio.sleep(0.2)  # give a duplicate reply time to arrive, then count exactly
    assert len(replies) == 20
    served = [b.metrics.route_result[r].value for b in (b1, b2)
              for r in ("ok", "no_agent")]  # fmt: skip
    assert sum(served) == 20


async def test_service_is_registered_with_micro_api(nc: NATS, broker: Broker) -> None:
    reply = await nc.request("$SRV.INFO.reach-broker", b"", timeout=2)
    info = json.loads(reply.data)
    assert info["name"] == "reach-broker"
    assert info["description"]
    assert sorted(e["subject"] for e in info["endpoints"]) == ["reach.agents", "reach.route.>"]
    assert {e["queue_group"] for e in info["endpoints"]} == {"reach-broker"}


@pytest.mark.parametrize(
    ("subject", "body", "code", "needle"),
    [
        ("reach.announce.a1", b"{not json", "INVALID_REQUEST", "malformed JSON"),
        ("reach.announce.a1", b'{"agent_id": "a1", "capabilities": "x", "max_concurrency": 1,'
         b' "heartbeat_interval_ms": 1000}', "INVALID_REQUEST", "$.capabilities"),
        ("reach.announce.a1", announce_body("a1", capabilities=["UPPER"]),
         "INVALID_CAPABILITY", "'UPPER'"),
        ("reach.announce.a1", announce_body("a1", capabilities=["a..b"]),
         "INVALID_CAPABILITY", "'a..b'"),
        ("reach.announce.a1", announce_body("a1", capabilities=["x" * 200]),
         "INVALID_REQUEST", "$.capabilities[0]"),
        ("reach.announce.a1", announce_body("other"), "INVALID_REQUEST", "disagrees"),
        ("reach.announce.a1", announce_body("a1", max_concurrency=-3),
         "INVALID_REQUEST", "$.max_concurrency"),
        ("reach.announce.a1", announce_body("a1", heartbeat_interval_ms=10**12),
         "INVALID_REQUEST", "$.heartbeat_interval_ms"),
        ("reach.announce.a1", announce_body("a1", tags={"Bad Key": "x"}),
         "INVALID_REQUEST", "'Bad Key'"),
        ("reach.announce.a1", b"{" + b" " * 70_000 + b"}", "INVALID_REQUEST", "larger than"),
        ("reach.route.UPPER", b"", "INVALID_CAPABILITY", "'UPPER'"),
        ("reach.route.a.-b", b"", "INVALID_CAPABILITY", "'a.-b'"),
        ("reach.route." + "x" * 200, b"", "INVALID_CAPABILITY", "200 chars"),
        ("reach.route.unknown_cap", b"", "NO_REACHABLE_AGENT", "no agent has the capability"),
        ("reach.route.text_processing", b'{"limit": -1}', "INVALID_REQUEST", "$.limit"),
        ("reach.route.text_processing", b'{"limit": "3"}', "INVALID_REQUEST", "$.limit"),
        ("reach.route.text_processing", b'{"limit": ', "INVALID_REQUEST", "malformed JSON"),
        ("reach.leave.a1", b'{"token": "v1.1.forged"}', "FORBIDDEN", "token"),
        ("reach.agents", b'{"capability": "a..b"}', "INVALID_CAPABILITY", "'a..b'"),
    ],
)  # fmt: skip
async def test_bad_input_gets_documented_error(
    nc: NATS, broker: Broker, subject: str, body: bytes, code: str, needle: str
) -> None:
    reply = await nc.request(subject, body, timeout=2)
    assert reply.headers is not None
    error = json.loads(reply.data)["error"]
    assert error["code"] == code
    assert needle in error["message"]
    assert reply.headers["Nats-Service-Error"] == error["message"]
    expected_status = {"FORBIDDEN": "403", "NO_REACHABLE_AGENT": "503"}.get(code, "400")
    assert reply.headers["Nats-Service-Error-Code"] == expected_status


async def test_bad_heartbeats_are_dropped_and_counted(nc: NATS, broker: Broker) -> None:
    ack = await announce(nc, "epsilon")
    hb = broker.metrics.heartbeat_result
    await heartbeat(nc, "nobody", ack["token"], 1)  # before any announce
    await heartbeat(nc, "epsilon", "v1.1.forged", 1)  # forged token
    await nc.publish("reach.hb.epsilon", b"{broken")  # malformed
    await heartbeat(nc, "epsilon", ack["token"], 1, active=-1)  # negative number
    await heartbeat(nc, "epsilon", ack["token"], 1, body_agent_id="zeta")  # body vs subject
    await heartbeat(nc, "epsilon", ack["token"], 5)
    await heartbeat(nc, "epsilon", ack["token"], 5)  # stale: same seq
    await heartbeat(nc, "epsilon", ack["token"], 4)  # stale: lower seq
    await wait_for(lambda: sum(c.value for c in hb.values()) == 8, 3, what="8 heartbeats")
    counts = {k: c.value for k, c in hb.items()}
    assert counts == {"accepted": 1, "stale": 2, "forged": 1, "invalid": 3, "unknown": 1}
    # The broker keeps serving.
    reply = await nc.request("reach.route.text_processing", b"", timeout=2)
    assert [c["agent_id"] for c in json.loads(reply.data)["candidates"]] == ["epsilon"]


FAILURE_COUNTERS: dict[str, Any] = {
    "route": lambda m: m.route_result["error"].value,
    "announce": lambda m: m.announce_result["error"]._value.get(),
    "leave": lambda m: m.leaves.labels("error")._value.get(),
}


@pytest.mark.parametrize(
    ("subject", "body", "breaks"),
    [
        ("reach.route.text_processing", b"", "router.route_reply"),
        ("reach.announce.a1", announce_body("a1"), "registry.announce"),
        ("reach.leave.a1", b"", "registry.leave"),
        ("reach.agents", b"", "registry.views"),
    ],
)
async def test_a_failing_handler_answers_internal_and_counts_it(
    nc: NATS, broker: Broker, monkeypatch: pytest.MonkeyPatch, subject: str, body: bytes,
    breaks: str,
) -> None:  # fmt: skip
    """A bug in a handler becomes an INTERNAL error reply (one place maps it), is counted,
    and the subscription keeps serving."""
    await announce(nc, "a2")

    def boom(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("boom")

    owner, method = breaks.split(".")
    monkeypatch.setattr(getattr(broker, owner), method, boom)
    reply = await nc.request(subject, body, timeout=2)
    assert reply.headers is not None
    assert reply.headers["Nats-Service-Error-Code"] == "500"
    name = subject.split(".")[1]
    assert json.loads(reply.data)["error"] == {
        "code": "INTERNAL", "message": f"{name} failed: RuntimeError('boom')"
    }  # fmt: skip
    if name in FAILURE_COUNTERS:  # reach.agents has no counter
        assert FAILURE_COUNTERS[name](broker.metrics) == 1
    monkeypatch.undo()
    again = await nc.request("reach.route.text_processing", b"", timeout=2)
    assert [c["agent_id"] for c in json.loads(again.data)["candidates"]] == ["a2"]


async def test_a_burst_of_transitions_is_one_task_publishing_them_in_order(nc: NATS) -> None:
    """Fanout.emit is O(1) a transition: a burst of 1,000 queues its events and one task
    publishes them, in the order they were made (not one task an event)."""
    import time

    from reach_agent.wire.subjects import Subjects
    from reach_broker.core.records import Transition
    from reach_broker.service.context import BrokerContext, Link, Tasks
    from reach_broker.service.fanout import Fanout
    from reach_broker.service.metrics import Metrics

    got: list[str] = []

    async def on_event(msg: Any) -> None:
        got.append(json.loads(msg.data)["agent_id"])

    sub = await nc.subscribe("reach.event.>", cb=on_event)
    await flush_subscriptions(nc)
    tasks, spawned = Tasks(), []

    def spawn(coro: Any, name: str) -> None:
        spawned.append(name)
        tasks.spawn(coro, name)

    link, m = Link(), Metrics()
    ctx = BrokerContext(nc=nc, subjects=Subjects(), broker_id="b1", clock=time.monotonic,
                        wall=time.time, spawn=spawn, emit=lambda _: None, link=link)  # fmt: skip
    fanout = Fanout(ctx, lambda _: None, consumers=(), changes=m.registry_changes,
                    states=m.state_changes, withheld=m.dropped.labels("event", "link_down"),
                    unsent=m.dropped.labels("event", "error"))  # fmt: skip
    for i in range(1000):
        fanout.emit([Transition("state", f"x{i}", "healthy", "suspect", "test")])
    assert spawned == ["event"]
    await tasks.settle(10.0)
    await nc.flush()
    await wait_for(lambda: len(got) == 1000, what="1,000 events")
    assert got == [f"x{i}" for i in range(1000)]
    # Made while the link is down: withheld, counted, never sent later.
    link.lost(0.0)
    fanout.emit([Transition("state", "late", "healthy", "suspect", "test")])
    link.regained(1.0)
    fanout.emit([Transition("state", "after", "healthy", "suspect", "test")])
    await tasks.settle(10.0)
    await nc.flush()
    await wait_for(lambda: len(got) == 1001, what="the event made after the outage")
    assert (got[-1], fanout.withheld, spawned) == ("after", 1, ["event", "event"])
    await sub.unsubscribe()


async def test_the_rtt_sample_interval_is_exported(nc: NATS, broker_factory: BrokerFactory) -> None:
    """``reach_rtt_sample_interval_seconds``: 0 with no healthy agent, then how often each
    healthy agent gets an RTT sample (the interval, the budget allowing)."""
    broker = await broker_factory(detection__rtt_sample_interval_s=7.0)
    every = broker.metrics.rtt_sample_every
    await wait_for(lambda: broker.probes._healthy == 0, what="the prober's first round")
    assert every._value.get() == 0.0
    await announce(nc, "sampled-a", heartbeat_interval_ms=30_000)  # healthy throughout
    await wait_for(lambda: every._value.get() == 7.0, what="the interval of one healthy agent")


async def burst(
    nc: NATS, requests: list[tuple[str, bytes]], counted: Callable[[], float]
) -> list[float]:
    """Send ``requests`` (subject, body), each with a reply inbox, from another thread's
    connection while this loop (the broker runs in it) is held, so that the broker's next
    read finds them all queued, as under load. Returns by how much ``counted`` (a counter of
    the broker's) went up between each two turns of the loop until every reply came.

    Not sent from this loop: a flush here let the broker read and answer while it waited
    for the PONG (CI once saw all 100 answered before the loop was held)."""
    before = counted()
    replies: list[str] = []

    async def on_reply(msg: Any) -> None:
        replies.append(msg.subject)

    await nc.subscribe("_INBOX.burst.*", cb=on_reply)
    await flush_subscriptions(nc)
    url = nc.connected_url
    assert url is not None

    async def send() -> None:
        other = await nats.connect(url.geturl(), name="test-burst")
        for i, (subject, body) in enumerate(requests):
            await other.publish(subject, body, reply=f"_INBOX.burst.{i}")
        await other.flush()  # all of them at the server
        await other.close()

    sender = threading.Thread(target=asyncio.run, args=(send(),), name="test-burst")
    sender.start()
    sender.join(10)  # this loop held meanwhile: the broker reads nothing
    assert not sender.is_alive()
    time.sleep(0.2)  # noqa: ASYNC251 - held while the server delivers them
    assert counted() == before  # nothing taken yet
    seen = [0.0]

    async def ticker() -> None:
        while True:
            seen.append(counted() - before)
            await asyncio.sleep(0)

    ticking = asyncio.create_task(ticker())
    try:
        await wait_for(lambda: len(replies) == len(requests), what="every reply")
    finally:
        ticking.cancel()
    assert counted() - before == len(requests)
    return [b - a for a, b in itertools.pairwise(seen) if b > a]


async def test_a_burst_of_route_requests_is_answered_32_at_a_time_between_turns_of_the_loop(
    nc: NATS, broker: Broker
) -> None:
    """100 route requests queued at once: the endpoint lets the event loop run (and the
    connection's flusher write the replies so far) after every 32 it answers. It answered
    the whole queue in one turn, the first reply written only after the last request."""
    answered = broker.metrics.route_result["no_agent"]  # nobody has the capability
    steps = await burst(nc, [("reach.route.burst", b"")] * 100, lambda: answered.value)
    assert max(steps) <= 32, steps
    assert len(steps) >= 4, steps  # 100 in turns of at most 32


async def test_a_burst_of_announces_is_taken_32_at_a_time_between_turns_of_the_loop(
    nc: NATS, broker: Broker
) -> None:
    """100 announces queued at once (a fleet registering), all of one partition (one
    subscription: each partition's has a task of its own): the announce callback lets the
    event loop run after every 32, so route requests are not held up behind the whole
    queue. It took the whole queue in one turn."""
    count = broker.cfg.fleet.partitions
    ids = [a for a in (f"storm-{i:04d}" for i in range(100 * count)) if partition(a, count) == 0]
    ok = broker.metrics.announce_result["ok"]
    requests = [(f"reach.announce.{a}", announce_body(a)) for a in ids[:100]]
    steps = await burst(nc, requests, ok._value.get)
    assert max(steps) <= 32, steps
    assert len(steps) >= 4, steps  # 100 in turns of at most 32
