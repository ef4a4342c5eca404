"""JetStream assets on a real server: provisioning, the bounded queue, the ack WAL, the audit."""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from pathlib import Path
from typing import Any

import msgspec
import nats
import pytest
from nats.aio.client import Client as NATS
from nats.errors import NoRespondersError
from nats.js.errors import APIError

from jetstream import ackreads, acks, audit, compensation
from jetstream import wal as jwal
from jetstream.names import H_REQUEST_ID, STREAM_NAMES
from jetstream.provision import UnsafeChange, load_definitions, provision
from reach_agent import Client
from reach_agent.client import durable
from reach_agent.connection import connect_options
from reach_agent.metrics import ClientMetrics
from reach_agent.wire import schema
from reach_agent.wire.errors import CompensationFull, StoreUnavailable, Timeout
from reach_agent.wire.subjects import Subjects
from reach_broker.broker import Broker
from reach_broker.cluster.natsserver import NatsServer
from reach_broker.config import CompensationSection

from .conftest import BrokerFactory, wait_for

SUBJECTS = Subjects()


async def stream_info(nc: NATS, name: str) -> dict:
    reply = await nc.request(f"$JS.API.STREAM.INFO.{name}", b"", timeout=2)
    return json.loads(reply.data)


# --- provisioning ---------------------------------------------------------------------------


async def test_provisioning_is_idempotent_and_matches_the_definitions(nc: NATS) -> None:
    first = await provision(nc)
    assert [(o.name, o.action) for o in first] == [
        ("REACH_ACKS", "created"), ("REACH_COMPENSATION", "created"),
        ("REACH_AUDIT", "created"), ("KV_reach_registry", "created"),
        ("KV_reach_claims", "created"), ("KV_reach_rules", "created"),
        ("KV_reach_partitions", "created"), ("KV_reach_tables", "created"),
    ]  # fmt: skip
    second = await provision(nc)
    assert [o.action for o in second] == ["unchanged"] * 8
    acks_cfg = (await stream_info(nc, "REACH_ACKS"))["config"]
    assert acks_cfg["subjects"] == ["reach.ack.>"]
    assert acks_cfg["storage"] == "file"
    assert acks_cfg["max_age"] == 24 * 3600 * 10**9
    assert acks_cfg["duplicate_window"] == 120 * 10**9
    comp = (await stream_info(nc, "REACH_COMPENSATION"))["config"]
    assert (comp["retention"], comp["discard"], comp["max_msgs"]) == ("workqueue", "new", 2000)
    aud = (await stream_info(nc, "REACH_AUDIT"))["config"]
    assert aud["subjects"] == ["reach.event.>"]
    assert (aud["deny_delete"], aud["deny_purge"]) == (True, True)
    # The KV bucket is usable by nats-py as a bucket.
    kv = await nc.jetstream().key_value("reach_registry")
    await kv.put("alpha", b"{}")
    assert (await kv.get("alpha")).value == b"{}"
    # The claims bucket: one value per key, kept exactly as long as the ack records.
    claims_cfg = (await stream_info(nc, "KV_reach_claims"))["config"]
    assert claims_cfg["subjects"] == ["$KV.reach_claims.>"]
    assert (claims_cfg["max_age"], claims_cfg["max_msgs_per_subject"]) == (24 * 3600 * 10**9, 1)
    assert (claims_cfg["allow_direct"], claims_cfg["deny_delete"]) == (True, True)
    claims_kv = await nc.jetstream().key_value("reach_claims")
    assert await claims_kv.create("r-1", b"{}") == 1


async def test_the_replica_keeper_checks_each_stream_on_its_own(
    nc: NATS, broker_factory: BrokerFactory, caplog: pytest.LogCaptureFixture
) -> None:
    """A running broker's replica keeper checks every stream in its round: one whose check
    fails (here deleted under the broker: never created again by the keeper) is counted
    ``failed`` and logged by name, and the streams after it are checked all the same."""
    broker = await broker_factory()
    await nc.jetstream().delete_stream(STREAM_NAMES[0])
    outcomes = await broker.keeper.keep()
    assert [o.name for o in outcomes] == list(STREAM_NAMES[1:])
    assert [o.action for o in outcomes] == ["unchanged"] * (len(STREAM_NAMES) - 1)
    checks = broker.metrics.replica_checks
    assert (checks.labels("failed")._value.get(), checks.labels("ok")._value.get()) == (
        1, len(STREAM_NAMES) - 1)  # fmt: skip
    [failed] = [r.getMessage() for r in caplog.records
                if r.getMessage().startswith("jetstream.replicas_check_failed")]  # fmt: skip
    assert failed.startswith(f"jetstream.replicas_check_failed name={STREAM_NAMES[0]} ")
    assert f"stream {STREAM_NAMES[0]} does not exist (not created here)" in failed
    with pytest.raises(APIError):
        await nc.jetstream().stream_info(STREAM_NAMES[0])  # not made again by the check


async def test_default_bound_is_2000() -> None:
    comp = next(d for d in load_definitions() if d["name"] == "REACH_COMPENSATION")
    assert comp["max_msgs"] == 2000
    assert CompensationSection().max_entries == 2000


async def test_safe_change_is_applied_unsafe_change_refused_and_data_kept(nc: NATS) -> None:
    await provision(nc)
    for i in range(5):
        await compensation.enqueue(
            nc, "cap", b"{}", request_id=f"r{i}", expires_at_ms=0, subjects=SUBJECTS
        )
    defs = load_definitions(overrides={"REACH_COMPENSATION": {"duplicate_window": 60 * 10**9}})
    outcomes = {o.name: o for o in await provision(nc, defs)}
    assert outcomes["REACH_COMPENSATION"].action == "updated"
    assert outcomes["REACH_COMPENSATION"].changes == ("duplicate_window: 3600s -> 60s",)

    bad = load_definitions(overrides={"REACH_COMPENSATION": {"retention": "limits"}})
    with pytest.raises(UnsafeChange) as exc:
        await provision(nc, bad)
    assert "stream REACH_COMPENSATION" in str(exc.value)
    assert 'retention: "workqueue" -> "limits"' in str(exc.value)
    assert "left as it is" in str(exc.value)

    shrink = load_definitions(overrides={"REACH_COMPENSATION": {"max_msgs": 3}})
    with pytest.raises(UnsafeChange, match=r"max_msgs: 2000 -> 3 \(the stream holds 5 messages"):
        await provision(nc, shrink)

    lift = load_definitions(overrides={"REACH_AUDIT": {"deny_purge": False}})
    with pytest.raises(UnsafeChange, match="deny_purge: true -> false"):
        await provision(nc, lift)

    info = await stream_info(nc, "REACH_COMPENSATION")
    assert info["config"]["retention"] == "workqueue"
    assert info["config"]["max_msgs"] == 2000
    assert info["state"]["messages"] == 5


async def test_audit_trail_cannot_be_purged_or_deleted_and_reads_back(
    nc: NATS, broker: Broker
) -> None:
    js = nc.jetstream()
    # It never beats: with a 100 ms interval its silence made a third event (draining ->
    # offline, 0.6 s later) before the trail was read back on a loaded machine.
    await nc.request("reach.announce.aud1", json.dumps({
        "agent_id": "aud1", "capabilities": ["audit_cap"], "max_concurrency": 1,
        "heartbeat_interval_ms": 60_000}).encode(), timeout=2)  # fmt: skip
    await nc.request("reach.leave.aud1", b"{}", timeout=2)
    events = await wait_for_events(nc, 2)
    assert [(e.subject, json.loads(e.data)["kind"]) for e in events] == [
        ("reach.event.registered.aud1", "registered"),
        ("reach.event.left.aud1", "left"),
    ]
    assert json.loads(events[1].data)["to"] == "draining"
    with pytest.raises(APIError) as purge:
        await js.purge_stream("REACH_AUDIT")
    assert purge.value.err_code == 10110  # stream purge not permitted
    with pytest.raises(APIError) as delete:
        await js.delete_msg("REACH_AUDIT", events[0].seq)
    assert delete.value.err_code == 10057  # message delete not permitted
    assert len(await audit.read_events(nc, subjects=SUBJECTS, since_s=3600)) == 2
    assert len(await audit.read_events(nc, subjects=SUBJECTS, subject="reach.event.left.>")) == 1


async def wait_for_events(nc: NATS, n: int) -> list[audit.StoredEvent]:
    deadline = asyncio.get_running_loop().time() + 5
    while True:
        events = await audit.read_events(nc, subjects=SUBJECTS)
        if len(events) >= n or asyncio.get_running_loop().time() > deadline:
            return events
        await asyncio.sleep(0.05)


# --- the bounded compensation queue ----------------------------------------------------------


async def test_full_queue_refuses_with_compensation_full_and_holds_exactly_the_bound(
    nc: NATS, broker_factory: BrokerFactory
) -> None:
    await broker_factory(compensation__max_entries=20)
    ids = [await durable.submit(nc, "nobody.serves", {"n": i}, priority=i % 3) for i in range(20)]
    assert len(set(ids)) == 20
    assert not any(i.duplicate for i in ids)
    with pytest.raises(CompensationFull) as exc:
        await durable.submit(nc, "nobody.serves", {"n": 20})
    assert exc.value.code == "COMPENSATION_FULL"
    assert "maximum messages exceeded" in exc.value.message
    total, per = await compensation.depths(nc, SUBJECTS)
    assert (total, per) == (20, {"nobody.serves": 20})
    # A duplicate enqueue is recognised even at the bound, and stores nothing.
    again = await durable.submit(nc, "nobody.serves", {"n": 0}, request_id=ids[0])
    assert again == ids[0]
    assert again.duplicate is True
    assert (await compensation.depths(nc, SUBJECTS))[0] == 20
    entries = await compensation.scan(nc, "nobody.serves", subjects=SUBJECTS)
    assert [e.request_id for e in entries] == list(ids)
    assert entries[4].priority == 1
    assert entries[4].headers[H_REQUEST_ID] == ids[4]


async def test_a_give_back_nobody_confirms_says_so_and_the_entry_stays_taken(
    nc: NATS, caplog: pytest.LogCaptureFixture
) -> None:
    """``give_back`` asks until ``within_s`` is over; a nak nobody confirmed (here: the
    consumer deleted under the fetched entry, so its ack subject has no responders) returns
    False and says so, naming the entry (nemesis seed 38: ten entries whose give-back met a
    stopped node waited for ack_wait without a line)."""
    js = nc.jetstream()
    await js.add_stream(name="GIVEBACK", subjects=["giveback.>"])
    await js.publish("giveback.x", b"x")
    psub = await js.pull_subscribe("giveback.x", durable="d", stream="GIVEBACK")
    [msg] = await psub.fetch(1, timeout=2.0)
    await js.delete_consumer("GIVEBACK", "d")
    with caplog.at_level(logging.WARNING, logger="jetstream.compensation"):
        started = asyncio.get_running_loop().time()
        assert await compensation.give_back(msg, within_s=0.6) is False
        took = asyncio.get_running_loop().time() - started
    assert took >= 0.6  # asked until within_s was over
    said = [r.getMessage() for r in caplog.records if r.name == "jetstream.compensation"]
    assert said == ["compensation.give_back_unconfirmed subject=giveback.x seq=1 "
                    "error=NoRespondersError: no answer within 0.6 s; the entry comes back "
                    "after the consumer's ack_wait"]  # fmt: skip


class SecondFetch:
    """A real pull subscription whose second fetch waits for ever (a fetch in flight when
    its round is cancelled), or with ``fails`` fails as one to a JetStream away does (no
    responders)."""

    def __init__(self, psub: Any, *, fails: bool = False) -> None:
        self.psub, self.fetches, self.waiting, self.fails = psub, 0, asyncio.Event(), fails

    async def consumer_info(self) -> Any:
        return await self.psub.consumer_info()

    async def fetch(self, batch: int, timeout: float) -> list[Any]:  # noqa: ASYNC109 - nats-py's
        self.fetches += 1
        if self.fetches == 2:
            if self.fails:
                raise NoRespondersError
            self.waiting.set()
            await asyncio.Event().wait()
        return await self.psub.fetch(batch=batch, timeout=timeout)


async def three_queued(nc: NATS, broker_factory: BrokerFactory,
                       monkeypatch: pytest.MonkeyPatch, capability: str) -> Any:  # fmt: skip
    """Three entries of ``capability`` queued, fetched two a batch: its consumer (60 s
    ack_wait)."""
    await broker_factory(compensation__sweep_interval_s=3600.0)
    monkeypatch.setattr(compensation, "FETCH_BATCH", 2)
    for i in range(3):
        await durable.submit(nc, capability, {"n": i})
    return await compensation.ensure_consumer(nc, capability, ack_wait_s=60.0,
                                              max_ack_pending=100, subjects=SUBJECTS)  # fmt: skip


async def test_a_take_cancelled_between_fetches_gives_back_what_it_fetched(
    nc: NATS, broker_factory: BrokerFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A round cancelled (its broker stopping) while ``take`` fetches a second batch gives
    the first back at once; before, it was held until the consumer's ack_wait (60 s here)."""
    psub = await three_queued(nc, broker_factory, monkeypatch, "take.cancel")
    reader = SecondFetch(psub)
    taking = asyncio.create_task(compensation.take(reader, SUBJECTS))
    await asyncio.wait_for(reader.waiting.wait(), 5)
    taking.cancel()
    with pytest.raises(asyncio.CancelledError):
        await taking
    again = await psub.fetch(3, timeout=2.0)  # given back: all three now, not one
    assert sorted(m.metadata.num_delivered for m in again) == [1, 2, 2]


async def test_a_take_whose_second_fetch_fails_gives_back_what_it_fetched(
    nc: NATS, broker_factory: BrokerFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A round whose fetch fails (JetStream away) after a first batch came gives that batch
    back at once; before, it was held until the consumer's ack_wait (60 s here; nemesis
    seed 74: 36 submits ran 15 s late, rounds failing "503")."""
    psub = await three_queued(nc, broker_factory, monkeypatch, "take.fails")
    with pytest.raises(NoRespondersError):
        await compensation.take(SecondFetch(psub, fails=True), SUBJECTS)
    again = await psub.fetch(3, timeout=2.0)  # given back: all three now, not one
    assert sorted(m.metadata.num_delivered for m in again) == [1, 2, 2]


async def test_client_counts_what_its_submits_became(
    nats_server: NatsServer, broker_factory: BrokerFactory
) -> None:
    await broker_factory(compensation__max_entries=2)
    metrics = ClientMetrics()
    async with Client(nats_server.url, metrics=metrics) as client:
        first = await client.submit("nobody.counts", {"n": 1})
        await client.submit("nobody.counts", {"n": 1}, request_id=first)
        await client.submit("nobody.counts", {"n": 2})
        with pytest.raises(CompensationFull):
            await client.submit("nobody.counts", {"n": 3})
    counted = {k: metrics.compensation.labels(k)._value.get()
               for k in ("enqueued", "duplicate", "refused")}  # fmt: skip
    assert counted == {"enqueued": 2, "duplicate": 1, "refused": 1}


async def test_a_submit_before_any_broker_provisioned_the_queue_is_refused_retryably(
    nats_server: NatsServer,
) -> None:
    metrics = ClientMetrics()
    async with Client(nats_server.url, metrics=metrics) as client:
        with pytest.raises(StoreUnavailable) as refused:
            await client.submit("nobody.yet", {"n": 1}, request_id="early-1")
    assert refused.value.retryable and refused.value.code == "STORE_UNAVAILABLE"
    assert refused.value.message == (
        "no JetStream stream REACH_COMPENSATION answers on reach.comp.nobody.yet (is a broker "
        "with JetStream provisioned?); request_id 'early-1' may not be queued: submit it again "
        "with the same request_id (a repeat is not stored twice)")  # fmt: skip
    assert metrics.compensation.labels("unavailable")._value.get() == 1


async def test_expired_entries_are_recorded_failed_and_removed(
    nc: NATS, broker_factory: BrokerFactory
) -> None:
    broker = await broker_factory(compensation__sweep_interval_s=0.1)
    rid = await durable.submit(nc, "nobody.serves", {"n": 1}, ttl=0.2)
    keep = await durable.submit(nc, "nobody.serves", {"n": 2}, ttl=600)
    record = await durable.wait(nc, rid, timeout=10)
    assert (record.state, record.request_id, record.capability) == ("failed", rid, "nobody.serves")
    assert record.agent_id == broker.broker_id
    assert record.error is not None
    assert (record.error["code"], record.error["reason"]) == ("TIMEOUT", "expired")
    await wait_for(lambda: broker.replayer.sender.expired == 1, what="expired count")
    for _ in range(100):  # the record is stored first, then the entry removed
        left = [e.request_id for e in await compensation.scan(nc, subjects=SUBJECTS)]
        if left == [keep]:
            break
        await asyncio.sleep(0.05)
    assert left == [keep]
    assert broker.metrics.compensation_result["expired"]._value.get() == 1
    await wait_for(lambda: broker.metrics.compensation_depth._value.get() == 1, what="depth")


async def test_an_entry_whose_claim_cannot_be_read_is_not_expired_on_a_guess(
    nc: NATS, broker_factory: BrokerFactory
) -> None:
    broker = await broker_factory(compensation__sweep_interval_s=0.1)
    await nc.jetstream().delete_stream("KV_reach_claims")  # the claims cannot be read
    rid = await durable.submit(nc, "nobody.claims", {"n": 1}, ttl=0.2)
    lookups = broker.metrics.store_errors.labels("claims", "lookup")._value.get
    await wait_for(lambda: lookups() >= 3, 10, what="sweeps that could not read the claim")
    assert broker.replayer.sender.expired == 0  # it may be running somewhere: not expired blind
    assert [e.request_id for e in await compensation.scan(nc, subjects=SUBJECTS)] == [rid]
    claims_def = [d for d in load_definitions() if d["name"] == "KV_reach_claims"]
    await provision(nc, claims_def)  # the bucket says "unclaimed" again: now it expires
    record = await durable.wait(nc, rid, timeout=10)
    assert (record.state, record.error and record.error["reason"]) == ("failed", "expired")
    await wait_for(lambda: broker.replayer.sender.expired == 1, what="expired count")


# --- acks -------------------------------------------------------------------------------------


def ack(rid: str, state: str) -> schema.AckRecord:
    return schema.AckRecord(request_id=rid, agent_id="a1", capability="cap", state=state,
                            at_ms=1, result=None)  # fmt: skip


async def test_ack_writer_stores_records_and_wait_returns_the_final_one(
    nc: NATS, broker: Broker, tmp_path: Path, nats_server
) -> None:
    rid = str(uuid.uuid4())
    waiter = asyncio.create_task(durable.wait(nc, rid, timeout=10, agent_id="a1"))
    async with acks.AckWriter(
        tmp_path / "wal",
        author="a1",
        connect=connect_options("test-acks", nats_server.url),
        subjects=SUBJECTS,
    ) as writer:
        await writer.record(ack(rid, "received"))
        assert await writer.flush(5)  # stored before the run ends: not folded (below)
        await writer.record(ack(rid, "completed"))
        assert await writer.flush(5)
        assert writer.stored == 2
    record = await waiter
    assert (record.request_id, record.state) == (rid, "completed")
    # Later (e.g. after the caller restarted) the stored record answers at once.
    again = await durable.wait(nc, rid, timeout=2, agent_id="a1")
    assert again.state == "completed"
    states = [r.state for r in await ackreads.all_records(nc, rid, subjects=SUBJECTS)]
    assert states == ["received", "completed"]
    assert not list((tmp_path / "wal").glob("*.wal"))  # all stored: the WAL is gone
    with pytest.raises(Timeout):
        await durable.wait(nc, str(uuid.uuid4()), timeout=0.3, agent_id="a1")
    # Without anyone to say who took the request, no record is believed.
    with pytest.raises(Timeout, match="no taker known"):
        await durable.wait(nc, rid, timeout=0.3)


async def test_a_short_runs_received_is_folded_into_its_final_record(
    nc: NATS, broker: Broker, tmp_path: Path, nats_server
) -> None:
    """Both records unsent when the final one is written: one JetStream write, the final
    record carrying the received time; a received already sent is not folded."""
    short, long = str(uuid.uuid4()), str(uuid.uuid4())
    async with acks.AckWriter(
        tmp_path / "wal", author="a1", connect=connect_options("test-acks", nats_server.url),
        subjects=SUBJECTS, linger_s=0.2,
    ) as writer:  # fmt: skip
        received = schema.AckRecord(request_id=short, agent_id="a1", capability="cap",
                                    state="received", at_ms=7)  # fmt: skip
        await writer.record(received)
        await writer.record(ack(short, "completed"))
        assert await writer.flush(5)
        assert (writer.stored, writer.folded) == (1, 1)
        await writer.record(ack(long, "received"))
        assert await writer.flush(5)
        await writer.record(ack(long, "completed"))
        assert await writer.flush(5)
        assert (writer.stored, writer.folded) == (3, 1)
    [final] = await ackreads.all_records(nc, short, subjects=SUBJECTS)
    record = schema.decode_ack_record(final.data)
    assert (record.state, record.received_ms, record.at_ms) == ("completed", 7, 1)
    states = [r.state for r in await ackreads.all_records(nc, long, subjects=SUBJECTS)]
    assert states == ["received", "completed"]
    assert not list((tmp_path / "wal").glob("*.wal"))  # the folded line is marked stored


async def test_a_record_sent_ahead_goes_over_the_callers_connection_and_back_to_the_sender(
    nc: NATS, broker: Broker, tmp_path: Path, nats_server: NatsServer, plain_server: str
) -> None:
    """``record_ahead``: the final record in the WAL, published on the caller's connection
    (folding its unsent received), stored once confirmed; a record whose PubAck does not come
    goes back to the sender, which stores it over its own connection, as does one that
    could not be sent."""
    ahead, lost, closed = (str(uuid.uuid4()) for _ in range(3))
    async with acks.AckWriter(
        tmp_path / "wal", author="a1", connect=connect_options("test-acks", nats_server.url),
        subjects=SUBJECTS, linger_s=0.2, publish_timeout_s=0.5,
    ) as writer:  # fmt: skip
        await writer.record(schema.AckRecord(request_id=ahead, agent_id="a1", capability="cap",
                                             state="received", at_ms=7))  # fmt: skip
        confirm = await writer.record_ahead(ack(ahead, "completed"), nc.jetstream())
        assert confirm is not None and writer.pending == 1
        assert await confirm() is True
        assert (writer.pending, writer.stored, writer.folded) == (0, 1, 1)
        [final] = await ackreads.all_records(nc, ahead, subjects=SUBJECTS)
        record = schema.decode_ack_record(final.data)
        assert (final.author, record.state, record.received_ms) == ("a1", "completed", 7)

        # A server without JetStream: no PubAck (no responders), the sender stores it.
        elsewhere = await nats.connect(plain_server)
        try:
            confirm = await writer.record_ahead(ack(lost, "completed"), elsewhere.jetstream())
            assert confirm is not None
            assert await confirm() is False
        finally:
            await elsewhere.close()
        # A closed connection: not sent at all, the sender stores it.
        confirm = await writer.record_ahead(ack(closed, "completed"), elsewhere.jetstream())
        assert confirm is not None
        assert await confirm() is False
        assert await writer.flush(5)
        assert (writer.pending, writer.stored, writer.retries) == (0, 3, 1)
    for rid in (lost, closed):
        [stored] = await ackreads.all_records(nc, rid, subjects=SUBJECTS)
        assert (stored.author, stored.state) == ("a1", "completed")
    assert not list((tmp_path / "wal").glob("*.wal"))


async def test_ack_writer_replays_an_orphaned_wal_and_resends_are_deduplicated(
    nc: NATS, broker: Broker, tmp_path: Path, nats_server
) -> None:
    wal = tmp_path / "wal"
    wal.mkdir()
    stored_rid, lost_rid, sent_rid = (str(uuid.uuid4()) for _ in range(3))
    lines = []
    for rid in (stored_rid, lost_rid):  # as an older writer left them: <rid>.<state>
        record = jwal.entry(f"reach.ack.{rid}", schema.encoder.encode(ack(rid, "completed")))
        lines.append(jwal.added(f"{rid}.completed", record))
    lines.append(jwal.stored([f"{stored_rid}.completed"]))
    # Stored by JetStream, but the process died before its D line: adopted and sent again.
    sent_id = acks.ack_msg_id("a1", sent_rid, "completed")
    sent = jwal.entry(
        SUBJECTS.ack("a1", sent_rid), schema.encoder.encode(ack(sent_rid, "completed"))
    )
    lines.append(jwal.added(sent_id, sent))
    lines.append(b"A torn-line-without-data")  # a crash mid-write
    (wal / "acks-999999-dead.wal").write_bytes(b"".join(lines))
    await nc.jetstream().publish(sent.subject, sent.data, headers={"Nats-Msg-Id": sent_id})
    async with acks.AckWriter(
        wal,
        author="a1",
        connect=connect_options("test-acks", nats_server.url),
        subjects=SUBJECTS,
    ) as writer:
        assert await writer.flush(5)
        assert (writer.stored, writer.duplicates) == (2, 1)
    # The old-format record went out under this writer's author and message id format.
    rec = await durable.wait(nc, lost_rid, timeout=2, agent_id="a1")
    assert (rec.request_id, rec.state) == (lost_rid, "completed")
    [lost] = await ackreads.all_records(nc, lost_rid, subjects=SUBJECTS)
    assert (lost.subject, lost.author, lost.msg_id.split(".")[:3]) == (
        f"reach.ack.a1.{lost_rid}",
        "a1",
        ["a1", lost_rid, "completed"],
    )
    assert not (wal / "acks-999999-dead.wal").exists()
    # The re-send was dropped by the duplicate window: one record.
    assert len(await ackreads.all_records(nc, sent_rid, subjects=SUBJECTS)) == 1


async def test_ack_writer_keeps_retrying_until_jetstream_has_the_stream(
    nc: NATS, tmp_path: Path, nats_server
) -> None:
    rid = str(uuid.uuid4())
    async with acks.AckWriter(
        tmp_path / "wal", author="a1", connect=connect_options("test-acks", nats_server.url),
        subjects=SUBJECTS,
        publish_timeout_s=0.2, retry_max_s=0.2,
    ) as writer:  # fmt: skip
        await writer.record(ack(rid, "completed"))
        await wait_for(lambda: writer.retries >= 2, what="retries while REACH_ACKS is absent")
        assert writer.pending == 1
        await provision(nc)
        assert await writer.flush(10)
    assert (await durable.wait(nc, rid, timeout=2, agent_id="a1")).state == "completed"


async def test_reach_ack_cli_shows_the_stored_record(
    nc: NATS, broker: Broker, tmp_path: Path, nats_server
) -> None:
    import subprocess
    import sys

    rid = str(uuid.uuid4())
    async with acks.AckWriter(
        tmp_path / "wal",
        author="a1",
        connect=connect_options("test-acks", nats_server.url),
        subjects=SUBJECTS,
    ) as writer:
        await writer.record(ack(rid, "received"))
        assert await writer.flush(5)  # stored before the run ends: not folded
        await writer.record(schema.AckRecord(
            request_id=rid, agent_id="a1", capability="cap", state="completed", at_ms=5,
            result=msgspec.Raw(b'{"chars": 2}')))  # fmt: skip
        assert await writer.flush(5)

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "reach_broker.cli", "ack", "--server", nats_server.url, *args],
            capture_output=True, text=True, timeout=30, check=False,
        )  # fmt: skip

    out = await asyncio.to_thread(cli, rid, "--json")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == {"request_id": rid, "agent_id": "a1", "capability": "cap",
                                      "state": "completed", "at_ms": 5,
                                      "result": {"chars": 2}}  # fmt: skip
    out = await asyncio.to_thread(cli, rid, "--all", "--json")
    assert [r["state"] for r in json.loads(out.stdout)] == ["received", "completed"]
    out = await asyncio.to_thread(cli, rid)
    assert out.returncode == 0
    assert "completed" in out.stdout and '{"chars": 2}' in out.stdout
    missing = await asyncio.to_thread(cli, str(uuid.uuid4()))
    assert missing.returncode == 1
    assert "no ack record for request_id" in missing.stderr
