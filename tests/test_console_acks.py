"""The console's latency charts hear the agents' ack records only while something needs them
(a page watching, ``/api/charts``): nobody watching, no subscription and no consumer on
``REACH_ACKS``; a follow starts with the records stored in the charts' window (at most
``ACK_BACKFILL_MAX`` of them), then each one stored, and charts every call once, also across
follows. The rule that keeps a late record out of a newer bucket is pure (first)."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any

import pytest
from nats.aio.client import Client as NATS

from jetstream import acks
from jetstream.follow import Follower, Start
from jetstream.provision import load_definitions, provision
from reach_agent.wire import schema
from reach_broker.broker import Broker
from reach_broker.cluster.natsserver import NatsServer
from reach_broker.console import capseries, feed
from reach_broker.console.capseries import BUCKET_S, BUCKETS, CapabilitySeries
from reach_broker.console.port import HttpPort

from .conftest import BrokerFactory, wait_for
from .test_cli import QUIET
from .test_console import Sse, audit_state, get, serve_port, until

CAP = "summarize"
T0 = 1_800_000_000_000 - 1_800_000_000_000 % (BUCKET_S * 1000)  # a bucket's start


# --- the window (pure) ---------------------------------------------------------------------------


def test_the_window_starts_at_the_oldest_bucket_a_chart_shows() -> None:
    s = CapabilitySeries()
    s.ack("r", CAP, "received", T0)
    s.ack("r", CAP, "completed", T0 + 20)
    wall = T0 + 7_000
    chart = s.chart(CAP, wall)
    assert chart is not None
    assert capseries.window_start_ms(wall) == chart.at_ms[0] == T0 - (BUCKETS - 1) * BUCKET_S * 1000


def test_a_record_older_than_its_slot_never_wipes_a_newer_bucket() -> None:
    """A final record 15 minutes older than the bucket its slot holds (read late, or from
    the edge of the stored window) is not charted: the slot keeps the newer calls."""
    s = CapabilitySeries()
    s.ack("new", CAP, "received", T0)
    s.ack("new", CAP, "completed", T0 + 20)
    old = T0 - BUCKETS * BUCKET_S * 1000  # the same slot, one turn of the ring before
    s.ack("old", CAP, "completed", old + 30, received_ms=old)
    chart = s.chart(CAP, T0 + 1000)
    assert chart is not None
    assert (chart.calls[-1], sum(chart.calls)) == (1, 1)
    assert s.stale == 1


# --- on a running broker -------------------------------------------------------------------------


async def store_record(
    nc: NATS, rid: str, state: str, at_ms: int, *, author: str = "alpha", **extra: Any
) -> None:
    record = schema.AckRecord(request_id=rid, agent_id=author, capability=CAP,
                              state=state, at_ms=at_ms, **extra)  # type: ignore[arg-type]  # fmt: skip
    duplicate = await acks.publish_record(nc.jetstream(), f"reach.ack.{author}.{rid}",
                                          acks.ack_msg_id(author, rid, state),
                                          schema.encoder.encode(record))  # fmt: skip
    assert duplicate is False


async def store_call(nc: NATS, rid: str, took_ms: int = 20) -> None:
    """A call's ``received`` and ``completed`` records, ``took_ms`` apart, stored now."""
    now = int(time.time() * 1000)
    await store_record(nc, rid, "received", now - took_ms)
    await store_record(nc, rid, "completed", now)


async def acks_state(nc: NATS) -> tuple[int, int]:
    """REACH_ACKS's stored records and its consumers (only the console's feed makes any
    here)."""
    js = nc.jetstream()
    info = await js.stream_info("REACH_ACKS")
    return info.state.messages, len(await js.consumers_info("REACH_ACKS"))


def ack_subscriptions(broker: Broker) -> int:
    """The broker connection's subscriptions to every ack record: the replay's ack watch
    holds one at all times; the console adds one only while it hears them without
    JetStream (with JetStream its follow delivers to an inbox of its own)."""
    return sum(1 for sub in broker.nc._subs.values() if sub.subject == "reach.ack.>")


async def timed(port: HttpPort) -> int:
    """The calls the latency chart shows (asked as a page asks: the request needs them)."""
    status, _, body = await get(port.server.port, f"/api/charts/{CAP}")
    if status == 404:
        return 0
    assert status == 200, body
    return sum(json.loads(body)["calls"])


def charted(f: feed.Feed) -> int:
    """The calls the latency chart holds, read without needing them."""
    chart = f.capabilities.chart(CAP, int(time.time() * 1000))
    return 0 if chart is None else sum(chart.calls)


def console_tasks() -> list[str]:
    return [t.get_name() for t in asyncio.all_tasks()
            if t.get_name().startswith(("reach-console", "reach-follow"))]  # fmt: skip


async def test_nobody_watching_no_ack_record_is_heard(
    nats_server: NatsServer, nc: NATS, broker_factory: BrokerFactory
) -> None:
    broker = await broker_factory(**QUIET, console=True)
    f = broker.feed
    assert f is not None
    await store_call(nc, "before-1")
    await store_call(nc, "before-2")
    await until(lambda: acks_state(nc), (4, 0), what="4 records stored, no consumer")
    assert ack_subscriptions(broker) == 1  # the replay's alone
    assert (f._ack_follow, f.capabilities.rings, charted(f)) == (None, {}, 0)


async def test_a_page_charts_the_calls_stored_before_it_and_after_it_once_each(
    nats_server: NatsServer, nc: NATS, broker_factory: BrokerFactory
) -> None:
    """A page opens: a call stored before shows (read from REACH_ACKS), so does one whose
    ``received`` was stored before and its ``completed`` after, and one stored after; two
    pages share one follow; follow_idle_s after the last left, no consumer; a call stored
    meanwhile shows when a page opens again, and none of the earlier ones twice."""
    broker = await broker_factory(**QUIET, console=True, console__follow_idle_s=0.3)
    port = await serve_port(broker)
    f = broker.feed
    assert f is not None
    try:
        await store_call(nc, "a")
        await store_record(nc, "b", "received", int(time.time() * 1000))
        await until(lambda: acks_state(nc), (3, 0), what="3 records stored, no consumer")

        one = await Sse.open(port.server.port)
        try:
            assert await timed(port) == 1  # a: stored before the page opened
            assert await acks_state(nc) == (3, 1)
            assert ack_subscriptions(broker) == 1  # the follow delivers to its own inbox
            await store_record(nc, "b", "completed", int(time.time() * 1000))
            await store_call(nc, "c")
            await wait_for(lambda: charted(f) == 3, what="b and c timed")
            two = await Sse.open(port.server.port)
            try:
                await two.next("hello")
                assert (await timed(port), await acks_state(nc)) == (3, (6, 1))  # one follow
            finally:
                two.close()
            follow = f._ack_follow
            assert follow is not None and (follow.read, follow.unreadable) == (6, 0)
        finally:
            one.close()
        await wait_for(lambda: not f.watchers, what="both pages gone")
        await until(lambda: acks_state(nc), (6, 0), what="the follow stopped after 0.3 s")
        assert (f._ack_follow, ack_subscriptions(broker)) == (None, 1)

        await store_call(nc, "d")  # stored while nobody watches: not heard
        await until(lambda: acks_state(nc), (8, 0), what="d stored")
        assert charted(f) == 3
        again = await Sse.open(port.server.port)
        try:
            assert await timed(port) == 4  # d read from the stream; a, b, c not again
            follow = f._ack_follow
            assert follow is not None and follow.read == 2  # d's two records, nothing before
        finally:
            again.close()
        await until(lambda: acks_state(nc), (8, 0), what="the follow stopped again")
    finally:
        await port.stop()


async def test_a_call_stored_before_the_broker_started_shows_when_a_page_opens(
    nats_server: NatsServer, nc: NATS, broker_factory: BrokerFactory
) -> None:
    """The charts open with the stored window, not empty: a call whose records were stored
    before this broker ran (another broker's console, a restart) is timed once."""
    await provision(nc, load_definitions())
    await store_call(nc, "earlier", took_ms=200)
    broker = await broker_factory(**QUIET, console=True)
    port = await serve_port(broker)
    try:
        page = await Sse.open(port.server.port)
        try:
            await page.next("hello")
            status, _, body = await get(port.server.port, f"/api/charts/{CAP}")
            assert status == 200, body
            chart = json.loads(body)
            assert (sum(chart["calls"]), [p for p in chart["p50_ms"] if p is not None]) == (
                1, [round(capseries.bin_ms(capseries.bin_of(200)), 1)])  # fmt: skip
        finally:
            page.close()
    finally:
        await port.stop()


async def test_the_charts_api_alone_follows_the_ack_records_not_the_audit_trail(
    nats_server: NatsServer, nc: NATS, broker_factory: BrokerFactory
) -> None:
    """``/api/charts`` lists a capability known from its ack records alone (an SDK caller
    routes from the tables and asks the broker for no route): it needs the records; the
    events it does not need."""
    broker = await broker_factory(**QUIET, console=True, console__follow_idle_s=0.3)
    port = await serve_port(broker)
    try:
        await store_call(nc, "a")
        await until(lambda: acks_state(nc), (2, 0), what="a stored")
        status, _, body = await get(port.server.port, "/api/charts")
        assert (status, json.loads(body)) == (200, {"capabilities": [[CAP, 0]], "untracked": 0})
        assert (await acks_state(nc), (await audit_state(nc))[1]) == ((2, 1), 0)
        await until(lambda: acks_state(nc), (2, 0), what="the follow stopped after 0.3 s")
    finally:
        await port.stop()


async def test_a_follow_reads_at_most_ack_backfill_max_stored_records(
    nats_server: NatsServer, nc: NATS, broker_factory: BrokerFactory,
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
) -> None:  # fmt: skip
    """More records stored in the window than the bound: the newest are read, no more."""
    monkeypatch.setattr(feed, "ACK_BACKFILL_MAX", 5)
    broker = await broker_factory(**QUIET, console=True)
    port = await serve_port(broker)
    f = broker.feed
    assert f is not None
    try:
        for i in range(10):
            await store_call(nc, f"r{i}")
        await until(lambda: acks_state(nc), (20, 0), what="20 records stored")
        with caplog.at_level(logging.INFO, logger="reach_broker.console.feed"):
            # The last 5: r7's completed (its received not read: not timed), r8 and r9.
            assert await timed(port) == 2
        follow = f._ack_follow
        assert follow is not None and follow.read == 5
        assert [r.getMessage() for r in caplog.records if "backfill" in r.getMessage()] == [
            "console.acks_backfill_capped from_seq=16 last_seq=20: the charts' window holds "
            "more than 5 stored records; the older ones are not read"]  # fmt: skip
    finally:
        await port.stop()


async def test_without_reach_acks_the_records_are_heard_live_while_needed(
    nats_server: NatsServer, nc: NATS, broker_factory: BrokerFactory
) -> None:
    """No stream to read: a plain subscription while something needs the charts (no
    history), and none after."""
    broker = await broker_factory(**QUIET, console=True, console__follow_idle_s=0.3)
    port = await serve_port(broker)
    f = broker.feed
    assert f is not None
    try:
        await nc.jetstream().delete_stream("REACH_ACKS")
        assert await timed(port) == 0
        assert ack_subscriptions(broker) == 2  # the replay's and the console's
        now = int(time.time() * 1000)
        for state, at_ms in (("received", now - 20), ("completed", now)):
            record = schema.AckRecord(request_id="live", agent_id="alpha", capability=CAP,
                                      state=state, at_ms=at_ms)  # type: ignore[arg-type]  # fmt: skip
            await nc.publish("reach.ack.alpha.live", schema.encoder.encode(record))
        await nc.flush()
        await wait_for(lambda: charted(f) == 1, what="the live call timed")
        await wait_for(lambda: f._ack_follow is None, what="the subscription ended after 0.3 s")
        assert ack_subscriptions(broker) == 1
    finally:
        await port.stop()


@pytest.mark.parametrize("need", ["events", "charts"])
async def test_needs_that_come_while_a_follow_stops_get_a_follow(
    nats_server: NatsServer, nc: NATS, broker_factory: BrokerFactory, need: str
) -> None:
    """Needs that begin as the follow (of the audit trail for the events, of the ack
    records for the charts) is being stopped (idle 20 ms, needs every 0-40 ms), and several
    at once: each is answered with a follow running, never two follows."""
    broker = await broker_factory(**QUIET, console=True, console__follow_idle_s=0.02)
    f = broker.feed
    assert f is not None
    needing, state = ((f.needing_events, audit_state) if need == "events"
                      else (f.needing_charts, acks_state))  # fmt: skip
    seen: list[bool] = []
    follows: set[int] = set()

    async def one(pause: float) -> None:
        await asyncio.sleep(pause)
        async with asyncio.timeout(10), needing():
            follow = f._follow if need == "events" else f._ack_follow
            follower = follow.follower if follow is not None else None
            seen.append(follower is not None and follower.following)
            if follow is not None:
                follows.add(id(follow))

    for i in range(20):
        await asyncio.gather(*(one(0.002 * ((i + k) % 20)) for k in range(3)))
    assert seen == [True] * 60
    assert len(follows) >= 2  # it did stop and start again in between
    await until(lambda: state(nc), (0, 0), what="the last follow stopped")


@pytest.mark.parametrize("phase", ["stream_info", "consumer", "window"])
async def test_a_broker_stopped_while_the_ack_follow_starts_leaves_nothing(
    nats_server: NatsServer, nc: NATS, broker_factory: BrokerFactory,
    monkeypatch: pytest.MonkeyPatch, phase: str,
) -> None:  # fmt: skip
    """A stop that comes while the follow reads the stream's state, once its consumer is
    made, or while it reads the window (each held there until the stop): the stop ends
    it at once, the request that needed it is answered, and neither a task nor a listener
    is left; the consumer goes with the connection."""
    broker = await broker_factory(**QUIET, console=True)
    port = await serve_port(broker)
    f = broker.feed
    assert f is not None
    there, held = asyncio.Event(), asyncio.Event()  # held is never set: the stop ends it
    if phase == "stream_info":
        ack_start = f._ack_start

        async def slow_start() -> Start:
            there.set()
            await held.wait()
            return await ack_start()

        monkeypatch.setattr(f, "_ack_start", slow_start)
    elif phase == "consumer":

        class SlowFollower(Follower):
            async def start(self) -> Any:
                info = await super().start()
                there.set()
                await held.wait()
                return info

        monkeypatch.setattr(feed, "Follower", SlowFollower)
    else:
        on_stored = f._on_stored_ack

        async def slow_record(follow: Any, msg: Any) -> None:
            await on_stored(follow, msg)
            there.set()
            await held.wait()

        monkeypatch.setattr(f, "_on_stored_ack", slow_record)
    try:
        for i in range(100):  # stored once the broker runs (its releaser reads none at start)
            await store_call(nc, f"r{i}")
        asking = asyncio.ensure_future(get(port.server.port, "/api/charts"))
        async with asyncio.timeout(10):
            await there.wait()
            await broker.stop()
            status, _, _ = await asking
        assert status == 200  # answered when the feed stopped
        assert (console_tasks(), f._ack_follow) == ([], None)
        consumers = 0 if phase == "stream_info" else 1
        assert (await acks_state(nc))[1] == consumers
        await until(lambda: acks_state(nc), (200, 0), timeout=15, what="the consumer gone")
    finally:
        await port.stop()


async def test_the_ack_follow_counts_a_lost_consumer_in_the_broker_metrics(
    nats_server: NatsServer, nc: NATS, broker_factory: BrokerFactory
) -> None:
    """The broker hands the ack records' follow its ``follow="acks"`` counters: a consumer
    deleted under it is rebuilt and counted, as the other follows' are."""
    broker = await broker_factory(**QUIET, console=True, console__follow_idle_s=30)
    f = broker.feed
    assert f is not None
    port = await serve_port(broker)
    try:
        await store_call(nc, "a")
        assert await timed(port) == 1  # the charts asked: the follow runs
        follower = f._ack_follow.follower if f._ack_follow is not None else None
        assert follower is not None and follower.consumer is not None
        reply = await nc.request(f"$JS.API.CONSUMER.DELETE.REACH_ACKS.{follower.consumer}",
                                 b"", timeout=2)  # fmt: skip
        assert json.loads(reply.data).get("success") is True, reply.data
        rebuilds = broker.metrics.follow_rebuilds

        def counted() -> float:
            return sum(rebuilds.labels("acks", r)._value.get()
                       for r in ("stall", "deleted", "gap", "reconnect"))  # fmt: skip

        await wait_for(lambda: counted() == 1, 15, what="the lost consumer counted once")
        await store_call(nc, "b")
        await wait_for(lambda: charted(f) == 2, 5, what="b charted after the rebuild")
    finally:
        await port.stop()
