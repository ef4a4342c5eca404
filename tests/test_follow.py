"""A follow (jetstream/follow.py) hands over every message once, in order, whatever happens
to its consumer: the node holding it (and the stream's leader) SIGKILLed in a three-node
cluster; the consumer deleted from under it; a lost message (a consumer sequence skipped);
its single server restarted on the same store. The claims, rules and audit follows are all
followers; the broker's releases wait for a lost claims follow instead of forgetting.

Where nats-py's ordered consumer stops for good (a follow from a start time whose consumer
is lost: the library re-creates it with a start sequence *and* the start time, which the
server refuses), the test shows the refusal first, then the follower going on.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import nats
import nats.aio.client
import pytest
from nats.aio.client import Client as NATS
from nats.js import api
from nats.js.errors import APIError

from jetstream import audit, claims, follow
from jetstream import rules as rules_bucket
from jetstream.claims import ClaimStore, ClaimsUnavailable, claim_key
from jetstream.names import AUDIT_STREAM, CLAIMS_STREAM, RULES_STREAM
from jetstream.provision import load_definitions, provision
from reach_agent.wire import schema
from reach_broker.broker import Broker
from reach_broker.cluster.natsserver import NatsServer
from reach_broker.service.metrics import Metrics

from .cluster import nats_cluster
from .conftest import BrokerFactory, wait_for
from .test_broker_wire import announce, heartbeat
from .test_claims import claim_becomes
from .test_jetstream_audit import SUBJECTS, Kept, publish

WITHIN_S = 30.0
"""Every written claim is delivered within this after the fault (an election takes 4-10 s,
the stall is noticed after 3 heartbeats of 1 s)."""


def only(*names: str, **overrides: Any) -> list[dict[str, Any]]:
    """The named asset definitions (``overrides`` applied to each), for ``provision``."""
    defs = load_definitions(overrides={n: overrides for n in names})
    return [d for d in defs if d["name"] in names]


class Claims:
    """A claims follow's callback that keeps (key, revision) of each claim it is told of."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, int]] = []

    async def __call__(self, key: str, revision: int, data: bytes) -> None:
        self.seen.append((key, revision))


async def write(store: ClaimStore, key: str, within: float = WITHIN_S) -> tuple[str, int]:
    """Create the claim ``key``; tried again while JetStream elects a leader. A create whose
    answer was lost but which was stored comes back as the stored claim (same revision)."""
    deadline = time.monotonic() + within
    while True:
        try:
            _, stored = await store.create(key, json.dumps({"key": key}).encode())
            return key, stored.revision
        except ClaimsUnavailable:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.2)


async def delete_consumer(nc: NATS, stream: str, consumer: str | None) -> None:
    reply = await nc.request(f"$JS.API.CONSUMER.DELETE.{stream}.{consumer}", b"", timeout=2)
    assert json.loads(reply.data).get("success") is True, reply.data


@contextlib.asynccontextmanager
async def connected(*urls: str) -> AsyncIterator[NATS]:
    """A client that reconnects at once and for ever (the fault tests want it back)."""
    nc = await nats.connect(list(urls), name="follow-test", max_reconnect_attempts=-1,
                            reconnect_time_wait=0.1, connect_timeout=1)  # fmt: skip
    try:
        yield nc
    finally:
        await nc.close()


def said(caplog: pytest.LogCaptureFixture, prefix: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith(prefix)]


# --- nats-py's ordered consumer stops; the follower goes on ----------------------------------


async def test_a_follow_from_a_time_goes_on_after_its_consumer_is_deleted_where_nats_py_stops(
    nats_server: NatsServer, nc: NATS
) -> None:
    """The failure the follower replaces, reproduced (nats-py 2.16): the ordered consumer's
    reset asks for ``by_start_sequence`` with the start time still set; the server refuses
    every time, and no consumer delivers again. If this half fails, nats-py changed: read
    its ``_JSI.reset_ordered_consumer`` again."""
    await provision(nc, only(CLAIMS_STREAM))
    store = ClaimStore(nc)
    errors: list[Exception] = []

    async def on_error(exc: Exception) -> None:
        errors.append(exc)

    old_path = await nats.connect(nats_server.url, error_cb=on_error, name="ordered")
    try:
        seen: list[int] = []

        async def on_msg(msg: Any) -> None:
            seen.append(msg.metadata.sequence.stream)

        a_minute_ago = datetime.now(UTC) - timedelta(minutes=1)
        config = api.ConsumerConfig(deliver_policy=api.DeliverPolicy.BY_START_TIME,
                                    opt_start_time=a_minute_ago)  # fmt: skip
        sub = await old_path.jetstream().subscribe(
            "$KV.reach_claims.>", stream=CLAIMS_STREAM, cb=on_msg, ordered_consumer=True,
            config=config, idle_heartbeat=0.2,
        )  # fmt: skip
        before = [await write(store, f"old-{i}") for i in range(3)]
        await wait_for(lambda: seen == [r for _, r in before], what="the first claims")
        name = (await sub.consumer_info()).name
        await delete_consumer(nc, CLAIMS_STREAM, name)
        await wait_for(lambda: errors, 10, what="nats-py's failed reset")
        assert isinstance(errors[0], APIError)
        refused = "deliver by start sequence, but optional start time is also set"
        assert errors[0].description == f"consumer delivery policy is {refused}"
        assert (await nc.jetstream().stream_info(CLAIMS_STREAM)).state.consumer_count == 0
        await sub.unsubscribe()
    finally:
        await old_path.close()

    # The same steps through the follower: it makes its consumer again, from the next claim.
    kept = Claims()
    follower = await claims.follow(nc, kept, since=time.time() - 60)
    try:
        written = [(f"old-{i}", r) for i, (_, r) in enumerate(before)]
        await wait_for(lambda: kept.seen == written, what="the stored claims")
        await delete_consumer(nc, CLAIMS_STREAM, follower.consumer)
        written += [await write(store, f"new-{i}") for i in range(3)]
        await wait_for(lambda: len(kept.seen) >= len(written) and follower.rebuilds >= 1, 10,
                       what="claims after, on the rebuilt consumer")  # fmt: skip
        assert kept.seen == written
        assert (follower.rebuilds, follower.failures) == (1, 0)
    finally:
        await follower.stop()


def test_stalls_in_a_row_are_waited_for_longer_and_a_calm_starts_over() -> None:
    """A follow's consumer counts as lost after 3 heartbeats of silence; each stall within a
    minute of the one before doubles that, up to 30 s; a calm minute starts over."""
    rule = follow.StallRule(1.0)
    assert (rule.after, rule.stalled(3.0, 100.0), rule.stalled(3.1, 100.0)) == (3.0, False, True)
    afters = []
    for now in (100.0, 104.0, 111.0, 124.0, 149.0, 180.0, 211.0):
        assert rule.stalled(rule.after + 0.1, now)
        rule.lost(now)
        afters.append(rule.after)
    assert afters == [3.0, 6.0, 12.0, 24.0, 30.0, 30.0, 30.0]
    assert not rule.stalled(29.9, 271.0)  # 60 s after the last: not yet calm
    assert rule.stalled(3.1, 271.1) and rule.after == 3.0  # calm: the first again
    rule.lost(271.1)
    assert rule.after == 3.0


# --- the consumer deleted, a message lost, the server restarted ------------------------------


async def test_a_deleted_consumer_is_made_again_from_the_next_claim_logged_and_counted(
    nc: NATS, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="jetstream.follow")
    await provision(nc, only(CLAIMS_STREAM))
    store = ClaimStore(nc)
    written = [await write(store, f"k{i}") for i in range(3)]
    metrics = Metrics()
    kept = Claims()
    follower = await claims.follow(nc, kept, since=time.time() - 60,
                                   metrics=metrics.follow("claims"))  # fmt: skip
    try:
        await wait_for(lambda: kept.seen == written, what="the stored claims")
        first = follower.consumer
        await delete_consumer(nc, CLAIMS_STREAM, first)
        written += [await write(store, f"k{i}") for i in range(3, 6)]
        # (the rebuild is counted once its consumer is made: its first deliveries may come first)
        await wait_for(lambda: len(kept.seen) >= 6 and follower.rebuilds >= 1, 10,
                       what="the claims written after, on the rebuilt consumer")  # fmt: skip
        assert kept.seen == written
        assert follower.consumer != first and follower.following is True
        assert (follower.rebuilds, follower.failures, follower.last) == (1, 0, written[-1][1])
        assert metrics.follow_rebuilds.labels("claims", "stall")._value.get() == 1
        assert metrics.follow_rebuild_failures.labels("claims")._value.get() == 0
        assert metrics.follow_down.labels("claims")._value.get() == 0
        [lost] = said(caplog, "follow.lost ")
        assert lost.startswith(f"follow.lost name=claims stream={CLAIMS_STREAM} "
                               f"consumer={first} reason=stall last_seq={written[2][1]}: "
                               "nothing heard for ")  # fmt: skip
        [rebuilt] = said(caplog, "follow.rebuilt ")
        assert rebuilt.startswith(f"follow.rebuilt name=claims stream={CLAIMS_STREAM} "
                                  f"consumer={follower.consumer} from=seq:{written[2][1] + 1} "
                                  "reason=stall attempts=1 ")  # fmt: skip
    finally:
        await follower.stop()
    assert metrics.follow_down.labels("claims")._value.get() == 0


async def test_a_skipped_consumer_sequence_has_the_consumer_made_again_without_a_gap(
    nc: NATS,
) -> None:
    """A heartbeat naming a consumer sequence past the last one received means messages were
    lost on the way (here a heartbeat made up on the follower's inbox says so)."""
    await provision(nc, only(CLAIMS_STREAM))
    store = ClaimStore(nc)
    written = [await write(store, f"g{i}") for i in range(3)]
    kept = Claims()
    metrics = Metrics()
    follower = await claims.follow(nc, kept, since=time.time() - 60,
                                   metrics=metrics.follow("claims"))  # fmt: skip
    try:
        await wait_for(lambda: kept.seen == written, what="the stored claims")
        heartbeat = {"Status": "100", "Nats-Last-Consumer": "9"}
        await nc.publish(follower.inbox, b"", headers=heartbeat)
        await wait_for(lambda: follower.rebuilds == 1, 10, what="the rebuild")
        written += [await write(store, f"g{i}") for i in range(3, 5)]
        await wait_for(lambda: len(kept.seen) >= 5, 10, what="the claims written after")
        assert kept.seen == written
        assert metrics.follow_rebuilds.labels("claims", "gap")._value.get() == 1
    finally:
        await follower.stop()


async def test_a_follow_goes_on_after_its_server_restarts_on_the_same_store(
    tmp_path: Path,
) -> None:
    server = NatsServer(port=0, store_dir=tmp_path / "nats")
    await asyncio.to_thread(server.start)
    try:
        async with connected(server.url) as nc:
            await provision(nc, only(CLAIMS_STREAM))
            store = ClaimStore(nc)
            written = [await write(store, f"r{i}") for i in range(3)]
            kept = Claims()
            follower = await claims.follow(nc, kept, since=time.time() - 60)
            try:
                await wait_for(lambda: kept.seen == written, what="the stored claims")
                await asyncio.to_thread(server.kill)
                await asyncio.to_thread(server.start)  # same port, same store
                written += [await write(store, f"r{i}") for i in range(3, 6)]
                # (the rebuild is counted once its consumer is made: its first deliveries
                # may come first)
                await wait_for(lambda: len(kept.seen) >= 6 and follower.rebuilds >= 1,
                               WITHIN_S, what="claims after, on the rebuilt consumer")  # fmt: skip
                assert kept.seen == written
                assert follower.rebuilds >= 1 and follower.following is True
            finally:
                await follower.stop()
    finally:
        await asyncio.to_thread(server.stop)


# --- every follow is a follower: rules, audit ----------------------------------------------


async def test_the_rules_follow_goes_on_after_its_consumer_is_deleted(nc: NATS) -> None:
    await provision(nc, only(RULES_STREAM))
    seen: list[tuple[str, int, bytes | None]] = []

    async def on_change(capability: str, revision: int, data: bytes | None, at: float) -> None:
        seen.append((capability, revision, data))

    first = await rules_bucket.put(nc, "a", b'{"v":1}')
    follower = await rules_bucket.follow(nc, on_change)
    try:
        await wait_for(lambda: seen == [("a", first, b'{"v":1}')], what="the stored rule")
        await delete_consumer(nc, RULES_STREAM, follower.consumer)
        second = await rules_bucket.put(nc, "b", b'{"v":2}')
        assert await rules_bucket.delete(nc, "a") is True
        # (the rebuild is counted once its consumer is made: its first deliveries may come first)
        await wait_for(lambda: len(seen) >= 3 and follower.rebuilds >= 1, 10,
                       what="the changes after, on the rebuilt consumer")  # fmt: skip
        assert [(c, d) for c, _, d in seen] == [("a", b'{"v":1}'), ("b", b'{"v":2}'), ("a", None)]
        assert seen[1][1] == second and follower.rebuilds == 1
    finally:
        await follower.stop()


async def test_the_audit_follow_from_a_time_goes_on_after_its_consumer_is_deleted(
    nc: NATS,
) -> None:
    await provision(nc, only(AUDIT_STREAM))
    await publish(nc, "e1", "e2")
    kept = Kept()
    follow_ = await audit.follow_events(nc, kept, subjects=SUBJECTS, since_s=60, timeout_s=2)
    try:
        assert await asyncio.wait_for(follow_.until_caught_up(2), 10)
        follower = follow_.follower
        assert follower is not None
        await delete_consumer(nc, AUDIT_STREAM, follower.consumer)
        await publish(nc, "e3", "e4")
        # (the rebuild is counted once its consumer is made: its first deliveries may come first)
        await wait_for(lambda: len(kept.data) >= 4 and follower.rebuilds >= 1, 10,
                       what="the events after, on the rebuilt consumer")  # fmt: skip
        assert kept.data == [b"e1", b"e2", b"e3", b"e4"]
        assert [e.seq for e in kept.events] == [1, 2, 3, 4]
        assert follower.rebuilds == 1
    finally:
        await follow_.stop()


async def test_a_follow_from_a_time_starts_at_the_first_event_stored_at_or_after_it(
    nc: NATS,
) -> None:
    """A start time picks the first message stored at or after it; a consumer lost before it
    delivered anything is made again from that same time (a time alone, never beside a
    sequence), so what was stored before it is still not delivered."""
    await provision(nc, only(AUDIT_STREAM))
    await publish(nc, "e1")
    await asyncio.sleep(0.2)  # separates the stored times around `between`
    between = time.time()
    await asyncio.sleep(0.2)
    await publish(nc, "e2")
    await asyncio.sleep(0.2)
    later = time.time()
    follows: list[follow.Follower] = []
    seen: dict[float, list[int]] = {}

    async def start(when: float) -> api.ConsumerInfo:
        seen[when] = []

        async def cb(msg: Any) -> None:
            seen[when].append(msg.metadata.sequence.stream)

        f = follow.Follower(nc, cb, name="t", stream=AUDIT_STREAM, subject=SUBJECTS.all_events,
                            start=follow.Start.at_time(when))  # fmt: skip
        follows.append(f)
        return await f.start()

    try:
        infos = [await start(when) for when in (between - 3600, between, later)]
        assert [i.num_pending for i in infos] == [2, 1, 0]
        assert [i.config.deliver_policy for i in infos] == [api.DeliverPolicy.BY_START_TIME] * 3
        await wait_for(lambda: seen[between - 3600] == [1, 2] and seen[between] == [2],
                       what="the events from each time")  # fmt: skip
        idle = follows[2]
        await delete_consumer(nc, AUDIT_STREAM, idle.consumer)
        await wait_for(lambda: idle.rebuilds == 1 and idle.following, 10, what="the rebuild")
        info = await nc.jetstream().consumer_info(AUDIT_STREAM, idle.consumer)
        assert (info.config.deliver_policy, info.config.opt_start_seq) == (
            api.DeliverPolicy.BY_START_TIME, None)  # fmt: skip
        await publish(nc, "e3")
        await wait_for(lambda: [len(s) for s in seen.values()] == [3, 2, 1],
                       what="e3 to every follow")  # fmt: skip
        assert list(seen.values()) == [[1, 2, 3], [2, 3], [3]]
        assert idle.failures == 0
    finally:
        for f in follows:
            await f.stop()


# --- the broker's releases wait for a lost claims follow ------------------------------------


async def test_a_claim_unknown_while_the_claims_follow_was_lost_is_released_once_it_is_back(
    nc: NATS, broker_factory: BrokerFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The holder is declared offline while the broker's claims follow has lost its consumer
    (and has not noticed yet: the stall threshold is raised for the test), so the broker
    does not know the claim then. Once the follow notices and is rebuilt, the claim arrives
    for a holder that is offline, and is released."""
    broker: Broker = await broker_factory(detection__phi_enabled=False)
    follower = broker.releaser.follower
    assert follower is not None
    monkeypatch.setattr(follow, "STALL_HEARTBEATS", 10_000)
    token = (await announce(nc, "ghost", heartbeat_interval_ms=100))["token"]
    for seq in range(1, 4):
        await heartbeat(nc, "ghost", token, seq)
        await asyncio.sleep(0.1)
    await delete_consumer(nc, CLAIMS_STREAM, follower.consumer)
    rid = str(uuid.uuid4())
    running = schema.Claim(request_id=rid, agent_id="ghost", instance="i1", capability="cap",
                           state="running", at_ms=1)  # fmt: skip
    await ClaimStore(nc).create(claim_key(rid), schema.encoder.encode(running))
    rec = broker.registry.agents["ghost"]
    await wait_for(lambda: rec.state == "offline", 5, what="ghost offline")
    assert broker.releaser.held_by("ghost") == [] and follower.rebuilds == 0

    monkeypatch.setattr(follow, "STALL_HEARTBEATS", 3)
    released = await claim_becomes(nc, rid, "released", WITHIN_S)
    assert released.agent_id == "ghost"
    await wait_for(lambda: follower.rebuilds >= 1, 5, what="the rebuild counted")
    assert follower.rebuilds == 1 and broker.releaser.released == 1
    assert broker.metrics.follow_rebuilds.labels("claims", "stall")._value.get() == 1
    await wait_for(lambda: broker.releaser.held_by("ghost") == [], 5, what="claim forgotten")


# --- a node of the cluster dies ------------------------------------------------------------


@pytest.fixture
def _placed(monkeypatch: pytest.MonkeyPatch) -> None:
    """Connect to the first server of the list (n1), then the next on a loss."""
    monkeypatch.setattr(nats.aio.client, "shuffle", lambda pool: None)


async def step_down_to(nc: NATS, stream: str, node: str) -> None:
    """Move ``stream``'s leader to ``node`` (nats-server 2.11+: a preferred placement)."""
    body = json.dumps({"placement": {"preferred": node}}).encode()
    reply = await nc.request(f"$JS.API.STREAM.LEADER.STEPDOWN.{stream}", body, timeout=5)
    assert json.loads(reply.data).get("success") is True, reply.data


@pytest.mark.slow
@pytest.mark.usefixtures("_placed")
async def test_killing_the_node_of_the_consumer_and_the_stream_leader_misses_no_claim(
    tmp_path: Path,
) -> None:
    async with nats_cluster(tmp_path / "cluster", nodes=3) as cluster:
        await cluster.wait_meta_leader()
        async with connected(*cluster.urls) as nc:
            await provision(nc, only(CLAIMS_STREAM, num_replicas=3))
            await cluster.wait_stream_leader(nc, CLAIMS_STREAM, current=True)
            store = ClaimStore(nc)
            written = [await write(store, f"before-{i}") for i in range(20)]
            kept = Claims()
            metrics = Metrics()
            follower = await claims.follow(nc, kept, since=time.time() - 60,
                                           metrics=metrics.follow("claims"))  # fmt: skip
            try:
                await wait_for(lambda: kept.seen == written, 10, what="the stored claims")
                info = await nc.jetstream().consumer_info(CLAIMS_STREAM, str(follower.consumer))
                assert info.cluster is not None and info.cluster.leader is not None
                victim = info.cluster.leader
                if await cluster.stream_leader(nc, CLAIMS_STREAM) != victim:
                    await step_down_to(nc, CLAIMS_STREAM, victim)
                assert await cluster.wait_stream_leader(nc, CLAIMS_STREAM) == victim
                await cluster.kill(victim)
                written += [await write(store, f"after-{i}") for i in range(20)]
                await wait_for(lambda: len(kept.seen) >= 40, WITHIN_S, what="claims after")
                assert kept.seen == written
                assert [r for _, r in written] == sorted({r for _, r in written})
                assert follower.rebuilds >= 1 and follower.following is True
                assert follower.consumer != info.name
                rebuilt = sum(metrics.follow_rebuilds.labels("claims", r)._value.get()
                              for r in follow.LOSS_REASONS)  # fmt: skip
                assert rebuilt == follower.rebuilds
                failed = metrics.follow_rebuild_failures.labels("claims")._value.get()
                assert failed == follower.failures
            finally:
                await follower.stop()
