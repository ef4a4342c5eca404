"""A partition's lease renewed through a busy JetStream (a real nats-server): a renewal whose
confirmation timed out at the broker but which the server wrote after all is the broker's own,
and the partition is kept; a lease another broker wrote is lost; a read of the leases from
before a partition was handed back does not make its old owner answer for it; the brokers
present are counted also when the server answers a consumer info before the keys it sent;
partitions handed back while a balance that already tried them is under way are taken as soon
as it ends; free partitions whose takes went unanswered are tried again within RETAKE_S; a
stopping broker says it left even when its hand-backs go unanswered."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import msgspec
import nats
import pytest
from nats.aio.client import Client as NATS

from jetstream import lastvalues
from jetstream.claims import ClaimStore, ClaimsUnavailable, Stored
from jetstream.names import PARTITIONS_BUCKET, PARTITIONS_STREAM
from jetstream.provision import load_definitions, provision
from reach_agent.routing.table import partition
from reach_agent.wire.subjects import Subjects
from reach_broker.cluster.natsserver import NatsServer
from reach_broker.config import Config
from reach_broker.service.context import BrokerContext, Link, Tasks
from reach_broker.service.metrics import Metrics
from reach_broker.service.partitions import (
    RETAKE_S,
    Lease,
    Partitions,
    Presence,
    presence_key,
)

from .conftest import BrokerFactory, wait_for
from .infofirst import InfoFirstProxy


def takes_into(
    taken: list[tuple[int, bool]],
) -> tuple[Callable[[int, int, bool], Awaitable[None]], Callable[[int], Awaitable[None]]]:
    """A bare Partitions' own and lose: each partition taken noted in ``taken`` as
    (partition, warm); a loss ignored."""

    async def own(p: int, epoch: int, warm: bool) -> None:
        taken.append((p, warm))

    async def lose(p: int) -> None:
        pass

    return own, lose


def bare_partitions(nc: NATS, broker_id: str, ttl_s: float, taken: list[tuple[int, bool]],
                    store: ClaimStore | None = None) -> Partitions:  # fmt: skip
    """A Partitions of its own over ``nc`` (``store``: the leases' store, or the default),
    each partition it takes noted in ``taken``."""
    own, lose = takes_into(taken)
    cfg = Config()
    cfg.fleet.lease_ttl_s = ttl_s
    ctx = BrokerContext(nc=nc, subjects=Subjects(), broker_id=broker_id,
                        clock=time.monotonic, wall=time.time, spawn=Tasks().spawn,
                        emit=lambda _: None, link=Link())  # fmt: skip
    return Partitions(ctx, cfg.fleet, own, lose, jetstream=lambda: True,
                      owned=Metrics().partitions_owned, store=store)  # fmt: skip


async def provision_leases(nc: NATS, ttl_s: float) -> None:
    """The leases' bucket, its keys kept ``ttl_s``."""
    leases = {PARTITIONS_STREAM: {"max_age": int(ttl_s * 1e9)}}
    await provision(nc, load_definitions(names=(PARTITIONS_STREAM,), overrides=leases))


def said(caplog: pytest.LogCaptureFixture, prefix: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith(prefix)]


async def test_a_renewal_the_server_wrote_after_its_timeout_keeps_the_partition(
    nc: NATS, broker_factory: BrokerFactory, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="reach_broker.service.partitions")
    # Rounds every 200 s: the test drives the one that matters.
    b = await broker_factory(fleet__lease_ttl_s=600)
    assert len(b.partitions.held) == 32
    kv = await nc.jetstream().key_value(PARTITIONS_BUCKET)
    epoch, revision, _ = b.partitions.held[5]
    # What the server holds after one of b's renewals timed out at b and was written anyway.
    late = await kv.update("5", msgspec.json.encode(Lease(broker_id=b.broker_id, at_ms=1)),
                           last=revision)  # fmt: skip
    _, revision_9, _ = b.partitions.held[9]
    await kv.update("9", msgspec.json.encode(Lease(broker_id=b.broker_id, at_ms=1)),
                    last=revision_9)  # fmt: skip
    await b.partitions.round()
    assert 5 in b.partitions.held and 9 in b.partitions.held
    assert len(b.partitions.held) == 32
    assert said(caplog, "partitions.renewal_landed") == [
        "partitions.renewal_landed partitions=[5, 9]: renewals whose confirmation timed out "
        "were written after all"]  # fmt: skip
    stored = await kv.get("5")
    assert stored.revision is not None and stored.value is not None
    assert stored.revision > late
    assert b.partitions.held[5][:2] == (epoch, stored.revision)
    assert msgspec.json.decode(stored.value, type=Lease).broker_id == b.broker_id


async def test_a_lease_another_broker_wrote_is_lost(
    nc: NATS, broker_factory: BrokerFactory, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="reach_broker.service.partitions")
    b = await broker_factory(fleet__lease_ttl_s=600)
    assert len(b.partitions.held) == 32
    kv = await nc.jetstream().key_value(PARTITIONS_BUCKET)
    for p in (12, 5):
        _, revision, _ = b.partitions.held[p]
        theirs = await kv.update(str(p), msgspec.json.encode(Lease(broker_id="another", at_ms=1)),
                                 last=revision)  # fmt: skip
    await b.partitions.round()
    assert sorted(b.partitions.held) == [p for p in range(32) if p not in (5, 12)]
    # One line for the round, naming both (one line each came 16 at once).
    assert said(caplog, "partitions.lost") == [
        "partitions.lost partitions=[5, 12]: another broker holds them now"]  # fmt: skip
    stored = await kv.get("5")
    assert stored.revision == theirs and stored.value is not None
    assert msgspec.json.decode(stored.value, type=Lease).broker_id == "another"


async def test_a_stale_read_naming_this_broker_is_not_taken_for_ownership(
    broker_factory: BrokerFactory,
) -> None:
    b1 = await broker_factory(fleet__lease_ttl_s=600)
    b2 = await broker_factory(fleet__lease_ttl_s=600)
    await wait_for(lambda: (len(b1.partitions.held), len(b2.partitions.held)) == (16, 16), 5,
                   what="the two brokers' fair shares")  # fmt: skip
    capability = next(c for c in (f"cap{i}" for i in range(100))
                      if partition(c, 32) in b2.partitions.held)  # fmt: skip
    p = partition(capability, 32)
    # What b1 read of the leases before it handed p back.
    b1.forwarder.owners.of[p] = b1.forwarder.token
    b1.forwarder.owners._wake.clear()
    assert b1.forwarder.owner_of(capability) == (p, None)
    assert b1.forwarder.owners._wake.is_set()  # read again at once


async def test_a_lease_shorter_than_the_default_duplicate_window_is_provisioned(
    nc: NATS, broker_factory: BrokerFactory
) -> None:
    """``[fleet] lease_ttl_s`` may be 1 s: the bucket's duplicate window is cut to its max
    age (the server refuses a longer one: "duplicates window can not be larger then max
    age"), and the broker starts holding every partition."""
    b = await broker_factory(fleet__lease_ttl_s=1.0)
    assert len(b.partitions.held) == 32
    info = await nc.jetstream().stream_info(PARTITIONS_STREAM)
    assert (info.config.max_age, info.config.duplicate_window) == (1.0, 1.0)


async def test_the_brokers_present_are_counted_when_the_info_overtakes_their_keys(
    nats_server: NatsServer, nc: NATS
) -> None:
    """Two other brokers' presence keys: a broker starting counts three, and takes its fair
    share of the 32 free partitions, 11 (nats-py's KV watch, which the count read by, could
    say "no more" before the first key when the server answered its consumer info first:
    the broker then counted itself alone and took all 32, cold)."""
    await provision(nc, load_definitions(names=(PARTITIONS_STREAM,)))
    kv = await nc.jetstream().key_value(PARTITIONS_BUCKET)
    for other in ("other-1", "other-2"):
        await kv.put(presence_key(other), b"")
    taken: list[tuple[int, bool]] = []
    own, lose = takes_into(taken)

    cfg = Config()
    async with InfoFirstProxy(nats_server.port) as proxy:
        proxied = await nats.connect(proxy.url, name="test-proxied")
        ctx = BrokerContext(nc=proxied, subjects=Subjects(), broker_id="counting",
                            clock=time.monotonic, wall=time.time, spawn=Tasks().spawn,
                            emit=lambda _: None, link=Link())  # fmt: skip
        parts = Partitions(ctx, cfg.fleet, own, lose, jetstream=lambda: True,
                           owned=Metrics().partitions_owned)  # fmt: skip
        try:
            await parts.start()
            assert parts.live == 3
            assert len(parts.held) == len(taken) == 11
            assert {warm for _, warm in taken} == {True}  # others present: warm
        finally:
            await parts.stop()
            await proxied.close()


class HeldAnswers(ClaimStore):
    """The leases' store on the real server, whose creates, once :meth:`hold` is called, are
    written and read at once but answered only when :meth:`let_go` is: takes that looked
    before another broker's hand-back and hear back after it (a busy JetStream)."""

    def __init__(self, nc: NATS) -> None:
        super().__init__(nc, bucket=PARTITIONS_BUCKET)
        self.held: list[int] = []
        """The partitions whose create answers are held, in the order they came."""
        self._holding = False
        self._go = asyncio.Event()

    def hold(self) -> None:
        self._holding = True

    def let_go(self) -> None:
        self._holding = False
        self._go.set()

    async def create(self, key: str, data: bytes) -> tuple[bool, Stored]:
        answer = await super().create(key, data)
        if self._holding:
            self.held.append(int(key))
            async with asyncio.timeout(30):
                await self._go.wait()
        return answer


async def test_partitions_freed_while_a_balance_is_under_way_are_taken_when_it_ends(
    nats_server: NatsServer, nc: NATS, caplog: pytest.LogCaptureFixture
) -> None:
    """Another broker hands back the partitions a joining broker's balance has just tried
    (their answers, naming the other, still on their way): the round that hand-back wakes
    finds the balance under way, and once it ends another round takes them, all 16, at once
    (it used to skip its balance: they stayed unheld until the next round, a third of the
    lease's time to live later, here 200 s)."""
    caplog.set_level(logging.DEBUG, logger="reach_broker.service.partitions")
    ttl_s = 600.0  # rounds every 200 s: only the wakes run rounds within the test
    await provision_leases(nc, ttl_s)
    kv = await nc.jetstream().key_value(PARTITIONS_BUCKET)
    # The other broker, played here: present, holding all 32 partitions.
    await kv.put(presence_key("other"), b"")
    theirs = msgspec.json.encode(Lease(broker_id="other", at_ms=1))
    revisions = {p: await kv.create(str(p), theirs) for p in range(32)}
    taken: list[tuple[int, bool]] = []
    joining = await nats.connect(nats_server.url, name="test-joining")
    store = HeldAnswers(joining)
    parts = bare_partitions(joining, "joining", ttl_s, taken, store)
    try:
        await parts.start()  # its first round: every partition the other's
        assert (parts.live, parts.held, taken) == (2, {}, [])
        # The round the other's presence wakes ("joined") tries 16 partitions, its share.
        store.hold()
        await wait_for(lambda: len(store.held) == 16, 5, what="the balance's first 16 takes")
        looked = sorted(store.held)
        # The other hands those 16 back, and says so. (Those, not its highest 16 as a broker
        # would: the balance's next 16 are tried only once these answer, after the hand-back,
        # and would see any of them free.)
        free = msgspec.json.encode(Lease(at_ms=2))
        for p in looked:
            await kv.update(str(p), free, last=revisions[p])
        await kv.put(presence_key("other"), msgspec.json.encode(Presence(freed=looked)))
        await wait_for(lambda: any(r.getMessage().startswith("partitions.balance_under_way")
                                   for r in caplog.records), 5,
                       what="the round it woke finding the balance under way")  # fmt: skip
        store.let_go()  # the takes hear back: the other's, as they were when they looked
        await wait_for(lambda: sorted(parts.held) == looked, 5,
                       what="the 16 handed back taken")  # fmt: skip
        assert sorted(taken) == [(p, True) for p in looked]  # handed back: warm
        assert sorted(store.held) == looked  # none held once let go
        for p in looked:
            stored = await kv.get(str(p))
            assert stored.value is not None
            assert msgspec.json.decode(stored.value, type=Lease).broker_id == "joining"
    finally:
        store.let_go()
        await parts.stop()
        await joining.close()


class FirstCreatesUnanswered(ClaimStore):
    """The leases' store on the real server, whose first create of each key is not answered
    (:class:`ClaimsUnavailable`, as a busy JetStream's timeout), written nowhere."""

    def __init__(self, nc: NATS) -> None:
        super().__init__(nc, bucket=PARTITIONS_BUCKET)
        self.unanswered: list[int] = []

    async def create(self, key: str, data: bytes) -> tuple[bool, Stored]:
        if int(key) not in self.unanswered:
            self.unanswered.append(int(key))
            raise ClaimsUnavailable(f"create of {key}: no answer (the test's)")
        return await super().create(key, data)


async def test_free_partitions_whose_takes_were_not_answered_are_taken_again_within_seconds(
    nats_server: NatsServer, nc: NATS, caplog: pytest.LogCaptureFixture
) -> None:
    """A broker alone whose every take went unanswered holds nothing after its first round;
    it tries again RETAKE_S later and holds all 32 (it used to wait for the next round, a
    third of the lease's time to live: here 200 s)."""
    caplog.set_level(logging.INFO, logger="reach_broker.service.partitions")
    ttl_s = 600.0  # rounds every 200 s: only a retake can run one within the test
    await provision_leases(nc, ttl_s)
    taken: list[tuple[int, bool]] = []
    store = FirstCreatesUnanswered(nc)
    parts = bare_partitions(nc, "alone", ttl_s, taken, store)
    try:
        await parts.start()
        assert (parts.live, parts.held, sorted(store.unanswered)) == (1, {}, list(range(32)))
        assert [r.getMessage() for r in caplog.records
                if r.getMessage().startswith("partitions.retake")] == [
            f"partitions.retake unanswered=32 held=0 share=32 in={RETAKE_S:g}s"]  # fmt: skip
        await wait_for(lambda: len(parts.held) == 32, RETAKE_S + 5, what="all 32 taken again")
        assert sorted(taken) == [(p, False) for p in range(32)]  # alone, holding none: cold
        kv = await nc.jetstream().key_value(PARTITIONS_BUCKET)
        for p in range(32):
            stored = await kv.get(str(p))
            assert stored.value is not None
            assert msgspec.json.decode(stored.value, type=Lease).broker_id == "alone"
    finally:
        await parts.stop()


class SwapsUnanswered(ClaimStore):
    """The leases' store on the real server, whose swaps, once :attr:`hang` is set, are
    never answered (a JetStream too busy to answer within a stopping broker's time)."""

    def __init__(self, nc: NATS) -> None:
        super().__init__(nc, bucket=PARTITIONS_BUCKET)
        self.hang = False
        self.hung = 0

    async def swap(self, key: str, data: bytes, revision: int) -> int | None:
        if self.hang:
            self.hung += 1
            await asyncio.Event().wait()  # cancelled by the caller's time limit
        return await super().swap(key, data, revision)


async def test_a_stopping_broker_whose_hand_backs_go_unanswered_still_says_it_left(
    nats_server: NatsServer, nc: NATS
) -> None:
    """The hand-backs take all of HAND_BACK_S but LEAVE_S, and the presence key is deleted
    in what is left: the others round at once (it used to be skipped with the hand-backs'
    time out, and the others learnt of the leave only a third of a lease later). (How long
    the stop takes is not asserted: a test never times anything.)"""
    ttl_s = 600.0  # rounds every 200 s: none runs within the test
    await provision_leases(nc, ttl_s)
    taken: list[tuple[int, bool]] = []
    leaving = await nats.connect(nats_server.url, name="test-leaving")
    store = SwapsUnanswered(leaving)
    parts = bare_partitions(leaving, "leaving", ttl_s, taken, store)
    try:
        await parts.start()
        assert len(parts.held) == 32
        kv = await nc.jetstream().key_value(PARTITIONS_BUCKET)
        present = await kv.get(presence_key("leaving"))  # raises once deleted
        assert (present.key, present.operation) == (presence_key("leaving"), None)
        store.hang = True
        await parts.stop()  # bounded by HAND_BACK_S: the hand-backs' time, then the delete's
        assert store.hung == 32 and parts.held == {}
        with pytest.raises(nats.js.errors.KeyNotFoundError):  # deleted
            await kv.get(presence_key("leaving"))
        for p in range(32):  # not handed back: they lapse by themselves
            stored = await kv.get(str(p))
            assert msgspec.json.decode(stored.value, type=Lease).broker_id == "leaving"
    finally:
        await parts.stop()
        await leaving.close()


@contextlib.asynccontextmanager
async def staying_and_leaving(
    nats_server: NatsServer, nc: NATS, store: Callable[[NATS], ClaimStore] | None = None
) -> AsyncIterator[tuple[Partitions, list[tuple[int, bool]], Partitions]]:
    """Two bare Partitions with a 600 s lease (rounds 200 s apart: only a wake runs one),
    ``staying`` on ``nc`` and ``leaving`` on a connection of its own (its leases' store made
    by ``store``), holding 16 partitions each; the partitions ``staying`` takes from then on
    noted in the list (warm or not)."""
    ttl_s = 600.0
    await provision_leases(nc, ttl_s)
    staying_taken: list[tuple[int, bool]] = []
    staying = bare_partitions(nc, "staying", ttl_s, staying_taken)
    leaving_nc = await nats.connect(nats_server.url, name="test-leaving")
    leaving = bare_partitions(leaving_nc, "leaving", ttl_s, [],
                              store(leaving_nc) if store is not None else None)  # fmt: skip
    try:
        await staying.start()
        await leaving.start()
        await wait_for(lambda: (len(staying.held), len(leaving.held)) == (16, 16),
                       what="16 partitions each")  # fmt: skip
        staying_taken.clear()
        yield staying, staying_taken, leaving
    finally:
        await leaving.stop()
        await staying.stop()
        await leaving_nc.close()


async def test_the_leases_of_a_broker_that_stopped_without_handing_them_back_are_taken_at_once(
    nats_server: NatsServer, nc: NATS, caplog: pytest.LogCaptureFixture
) -> None:
    """A broker stops and its hand-backs go unanswered (a busy JetStream): its leases still
    name it. The other broker, woken by its presence key's delete (only a stop deletes one),
    takes them at once, warm; it used to wait for them to lapse and for its next round (here
    200 s: a CI run of test_rules_live waited in vain)."""
    caplog.set_level(logging.INFO, logger="reach_broker.service.partitions")
    async with staying_and_leaving(nats_server, nc, SwapsUnanswered) as (
        staying, staying_taken, leaving
    ):  # fmt: skip
        theirs = sorted(leaving.held)
        assert isinstance(leaving.store, SwapsUnanswered)
        leaving.store.hang = True
        await leaving.stop()  # none handed back: they name "leaving" (take_left says so)
        await wait_for(lambda: len(staying.held) == 32, 5, what="all 32 held by staying")
        assert sorted(staying_taken) == [(p, True) for p in theirs]
        kv = await nc.jetstream().key_value(PARTITIONS_BUCKET)
        for p in theirs:
            stored = await kv.get(str(p))
            assert msgspec.json.decode(stored.value, type=Lease).broker_id == "staying"
        assert sorted(r.getMessage() for r in caplog.records
                      if r.getMessage().startswith("partitions.take_left")) == sorted(
            f"partitions.take_left partition={p} broker=leaving: it stopped without handing "
            "the lease back" for p in theirs)  # fmt: skip


async def test_a_count_that_failed_is_made_again_soon(
    nats_server: NatsServer, nc: NATS, caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    """A broker leaves and the rounds it wakes at the other one cannot count the brokers (a
    busy JetStream: the read of the presence keys times out; the first two counts that would
    see the leave fail, whichever rounds make them). The last count stood (two brokers: a
    share of 16), nothing was taken, and the next count came a third of a lease later (200 s
    here); now it comes RETAKE_S later and the share of one is taken."""
    caplog.set_level(logging.INFO, logger="reach_broker.service.partitions")
    real = lastvalues.messages
    failing: list[bool] = []

    async def messages(conn: NATS, *args: Any, **kwargs: Any) -> Any:
        stored = await real(conn, *args, **kwargs)
        left = any(m.subject.endswith(presence_key("leaving"))
                   and (m.headers or {}).get("KV-Operation") == "DEL" for m in stored)  # fmt: skip
        if conn is nc and left and failing:  # the first count at staying after the leave
            failing.pop()
            raise TimeoutError("presence keys not read in time (the test's)")
        return stored

    monkeypatch.setattr(lastvalues, "messages", messages)
    async with staying_and_leaving(nats_server, nc) as (staying, staying_taken, leaving):
        theirs = sorted(leaving.held)
        failing.extend((True, True))
        await leaving.stop()
        await wait_for(lambda: len(staying.held) == 32, 2 * RETAKE_S + 5, what="all 32 held")
        assert (failing, sorted(staying_taken)) == ([], [(p, True) for p in theirs])
        assert [r.getMessage() for r in caplog.records
                if r.getMessage().startswith("partitions.count_failed")] == [
            "partitions.count_failed error=TimeoutError(\"presence keys not read in time (the "
            f"test's)\"): counted again in {RETAKE_S:g}s"] * 2  # fmt: skip


class CreatesUnanswered(ClaimStore):
    """The leases' store on the real server, whose creates are never answered
    (:class:`ClaimsUnavailable`, as a busy JetStream's timeout), written nowhere."""

    def __init__(self, nc: NATS) -> None:
        super().__init__(nc, bucket=PARTITIONS_BUCKET)

    async def create(self, key: str, data: bytes) -> tuple[bool, Stored]:
        raise ClaimsUnavailable(f"create of {key}: no answer (the test's)")


async def test_rounds_that_keep_failing_are_tried_again_once_a_retake_not_more(
    nats_server: NatsServer, nc: NATS, caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    """Nemesis seed 29: while JetStream failed every count and take, a broker ran rounds at a
    growing rate (3, 6, 10 a second): each failed count and each unanswered take added a
    timer of its own, and each timer's round added two more. A round is now asked for once
    at a time: at most one a RETAKE_S, however many parts of a round failed."""
    caplog.set_level(logging.INFO, logger="reach_broker.service.partitions")

    async def messages(conn: NATS, *args: Any, **kwargs: Any) -> Any:
        raise TimeoutError("presence keys not read in time (the test's)")

    monkeypatch.setattr(lastvalues, "messages", messages)
    ttl_s = 600.0  # rounds every 200 s: only the retries run one within the test
    await provision_leases(nc, ttl_s)
    parts = bare_partitions(nc, "failing", ttl_s, [], CreatesUnanswered(nc))
    window_s = 4 * RETAKE_S + 0.5
    try:
        await parts.start()
        await asyncio.sleep(window_s)  # a window to watch rounds in, not a wait for a state
        at = [r.created for r in caplog.records
              if r.getMessage().startswith("partitions.count_failed")]  # fmt: skip
        # The start's round, then one a RETAKE_S (4 in the window; a slow machine fewer),
        # never two together (the parent's came in pairs from the second second on).
        assert len(at) >= 2, at
        gaps = [b - a for a, b in itertools.pairwise(at)]
        assert min(gaps) >= 0.9 * RETAKE_S, gaps
        assert parts.held == {}
    finally:
        await parts.stop()


async def test_a_broker_that_changes_the_lease_time_says_so(
    nc: NATS, broker_factory: BrokerFactory, caplog: pytest.LogCaptureFixture
) -> None:
    """The leases bucket's max age is every broker's lease time: a broker started with
    another ``lease_ttl_s`` changes it for all, and one with a longer value then loses its
    leases while it still serves them. The broker that changes it warns, naming both."""
    caplog.set_level(logging.WARNING, logger="reach_broker.service.assets")
    await broker_factory(fleet__lease_ttl_s=600)
    assert not [r for r in caplog.records if "lease_ttl_changed" in r.getMessage()]
    await broker_factory(fleet__lease_ttl_s=6)
    assert [r.getMessage() for r in caplog.records if "lease_ttl_changed" in r.getMessage()] == [
        "partitions.lease_ttl_changed max_age: 600s -> 6s: the leases bucket now ages every "
        "lease out after this broker's [fleet] lease_ttl_s (6s); every broker of a fleet must "
        "run the same lease_ttl_s, or one with a longer one loses its partitions to the others "
        "while it still serves them"]  # fmt: skip
