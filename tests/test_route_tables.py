"""Route tables (issue 23): the shares a broker publishes of the partitions it leases, the
whole table in one request, deltas that follow each other, and a caller's copy that sees a gap."""

from __future__ import annotations

import asyncio
import math
from typing import Any

import msgspec
from nats.aio.client import Client as NATS
from nats.js.errors import KeyNotFoundError

import reach_agent
from jetstream.names import TABLES_BUCKET
from reach_agent.client.config import ClientConfig
from reach_agent.client.tables import TableFollower
from reach_agent.connection import flush_subscriptions
from reach_agent.routing.table import RouteTable, TableMember, partition
from reach_agent.wire import schema
from reach_agent.wire.schema import Table, TableDelta, TableEntry, TableRouting, TableShare
from reach_agent.wire.subjects import Subjects
from reach_broker.broker import Broker
from reach_broker.cluster.natsserver import NatsServer
from reach_broker.config import Config
from reach_broker.core.registry import Registry
from reach_broker.core.tables import TableBook
from reach_broker.core.tokens import TokenSigner
from reach_broker.service import tables as tables_service

from .conftest import BrokerFactory, wait_for
from .test_sdk_failover import healthy


def echo(agent_id: str, cap: str = "tab") -> reach_agent.Agent:
    agent = reach_agent.Agent(agent_id, [cap], heartbeat_interval=0.1, max_concurrency=2)

    @agent.handler(cap)
    async def run(task: reach_agent.Task) -> Any:
        return task.payload

    return agent


async def table_of(nc: NATS, capability: str) -> schema.Table:
    reply = await nc.request(f"reach.tables.{capability}", b"", timeout=2)
    return schema.decode(schema.table_decoder, reply.data, "table")


# --- the partition hash --------------------------------------------------------------------


def test_the_partition_is_nats_servers_fnv1a_32() -> None:
    """The values nats-server's partition(32, 1) maps these tokens to (FNV-1a 32 mod 32)."""
    assert partition("", 32) == 0x811C9DC5 % 32
    assert partition("a", 32) == 0xE40C292C % 32
    assert partition("foobar", 32) == 0xBF9CF968 % 32
    assert {partition(f"agent-{i}", 8) for i in range(200)} == set(range(8))


# --- the book: what a broker publishes -----------------------------------------------------


def book_world() -> tuple[Registry, TableBook]:
    cfg = Config()
    reg = Registry(
        cfg.detection,
        cfg.scoring,
        TokenSigner(b"k" * 32, 3600.0, wall=lambda: 1_000_000.0),
        interval_ms=cfg.broker.interval_ms,
    )
    book = TableBook(4, cfg.routing, lambda cap: (True, None))
    return reg, book


def announce(reg: Registry, agent_id: str, caps: list[str], now: float) -> None:
    reg.announce(schema.Announce(agent_id=agent_id, capabilities=caps, max_concurrency=2,
                                 heartbeat_interval_ms=1000), now, 0)  # fmt: skip


def test_a_share_moves_version_by_version_and_a_new_owner_starts_an_epoch() -> None:
    reg, book = book_world()
    for a in ("a", "b", "c", "d", "e"):
        announce(reg, a, ["x"], 0.0)
    for p in range(4):
        book.own(p, 10 + p, reg.agents, 0.0)
    reg.changed.clear()
    assert {a for s in book.of("x") for a in s.entries} == {"a", "b", "c", "d", "e"}
    p = book.partition_of("c")
    before = book.shares[(p, "x")].version
    reg.disconnected("c", 1.0)  # suspect: a change of state
    deltas = book.changes(reg.changed, reg.agents.get, 1.0)
    assert [(d.partition, d.epoch, d.prev, d.version) for d in deltas] == [
        (p, 10 + p, before, before + 1)]  # fmt: skip
    assert [(e.agent_id, e.state) for e in deltas[0].upserts] == [("c", "suspect")]
    assert book.changes({"c"}, reg.agents.get, 1.0) == []  # nothing new: no delta
    announce(reg, "c", ["y"], 2.0)  # c leaves x for y
    deltas = book.changes({"c"}, reg.agents.get, 2.0)
    assert {(d.capability, tuple(d.removed), len(d.upserts)) for d in deltas} == {
        ("x", ("c",), 0), ("y", (), 1)}  # fmt: skip
    book.own(p, 99, reg.agents, 3.0)  # a new owner (here: a new lease) starts over
    assert book.shares[(p, "y")].version == 1 and book.epochs[p] == 99
    book.disown(p)
    assert book.changes({"c"}, reg.agents.get, 4.0) == []  # not ours: not published


def test_a_heartbeat_that_moves_only_the_load_goes_out_as_a_load_not_an_entry() -> None:
    """An agent of two capabilities whose heartbeat moved its ``active``: each share's delta
    carries one ``TableLoad`` (no entry), the share holds the entry with the new figures, and
    the next delta of a real change carries the whole entry again."""
    reg, book = book_world()
    announce(reg, "a", ["x", "y"], 0.0)
    p = book.partition_of("a")
    book.own(p, 1, reg.agents, 0.0)
    reg.changed.clear()
    before = book.shares[(p, "x")].entries["a"]
    reg.agents["a"].set_load(2, 1)
    deltas = book.changes({"a"}, reg.agents.get, 1.0)
    score = reg.agents["a"].score
    assert sorted((d.capability, d.upserts, d.removed, d.loads) for d in deltas) == [
        ("x", [], [], [schema.TableLoad("a", 2, 1, score)]),
        ("y", [], [], [schema.TableLoad("a", 2, 1, score)]),
    ]
    held = book.shares[(p, "x")].entries["a"]
    assert held is book.shares[(p, "y")].entries["a"]  # one entry for both shares
    assert (held.active, held.queue_depth, held.state) == (2, 1, "healthy")
    assert msgspec.structs.replace(held, active=0, queue_depth=0) == before
    assert book.changes({"a"}, reg.agents.get, 1.5) == []  # nothing moved since
    reg.disconnected("a", 2.0)
    deltas = book.changes({"a"}, reg.agents.get, 2.0)
    assert [(d.loads, [(e.state, e.active) for e in d.upserts]) for d in deltas] == [
        ([], [("suspect", 2)])] * 2  # fmt: skip


def test_agents_taken_in_bit_by_bit_are_cut_as_one_and_a_lost_partition_drops_its_part() -> None:
    """Agents taken in over several touches make one delta per share at the cut, each agent
    once, the version advanced by one; what was taken in for a partition lost before the cut
    is not said."""
    reg, book = book_world()
    ids = [f"a{i}" for i in range(40)]
    for a in ids:
        announce(reg, a, ["x"], 0.0)
    for p in range(4):
        book.own(p, 1, reg.agents, 0.0)
    reg.changed.clear()
    versions = {p: book.shares[(p, "x")].version for p in range(4)}
    for a in ids:
        reg.agents[a].set_load(1, 0)
    book.touch(ids[:15], reg.agents.get, 1.0)
    book.touch(ids[15:], reg.agents.get, 1.0)
    deltas = book.cut()
    assert sorted((d.partition, d.prev, d.version) for d in deltas) == [
        (p, versions[p], versions[p] + 1) for p in range(4)]  # fmt: skip
    assert sorted(load.agent_id for d in deltas for load in d.loads) == sorted(ids)
    assert book.cut() == []  # nothing taken in since
    for a in ids:
        reg.agents[a].set_load(2, 0)
    book.touch(ids, reg.agents.get, 2.0)
    book.disown(0)
    assert sorted(d.partition for d in book.cut()) == [1, 2, 3]


# --- a caller's copy ---------------------------------------------------------------------------


def test_a_copy_applies_loads_to_the_entries_it_holds() -> None:
    """A load replaces the figures of the entry held (once for an agent of two tables: the
    second table's copy of the same load is no new report); a load for an agent the table
    does not hold says the copy missed something (ask again)."""
    members: dict[str, TableMember] = {}
    x, y = RouteTable("x", TableRouting()), RouteTable("y", TableRouting())
    for table in (x, y):
        table.load(TableShare(capability=table.capability, partition=1, epoch=5, version=3,
                              entries=[entry("a", tags={"gpu": "a100"})]), members,
                   0.0)  # fmt: skip
    a = members["a"]
    reports = a.report
    load = schema.TableLoad("a", 1, 0, 80.0, 120.0)
    for table in (x, y):
        assert table.apply(TableDelta(capability=table.capability, partition=1, epoch=5,
                                      version=4, prev=3, loads=[load]), members,
                           1.0)  # fmt: skip
    assert (a.active, a.score, a.stats.task_ewma_ms, a.tags) == (1, 80.0, 120.0, {"gpu": "a100"})
    assert a.entry == entry("a", tags={"gpu": "a100"}, active=1, score=80.0, task_ms=120.0)
    assert a.report == reports + 1
    assert x.shares[1] == (5, 4) and y.shares[1] == (5, 4)
    stray = TableDelta(capability="x", partition=1, epoch=5, version=5, prev=4,
                       loads=[schema.TableLoad("b", 1, 0, 80.0)])  # fmt: skip
    assert not x.apply(stray, members, 2.0)
    assert x.shares[1] == (5, 4)


def test_a_copy_fades_an_unmoved_load_from_the_agents_last_heartbeat_not_its_last_report() -> None:
    """An owner publishes a report only when it moved the share: an agent with a task time
    heard at every heartbeat saying the same ``active`` is not published again, and a copy
    fades that ``active`` from the last heartbeat interval since the report (as the owner
    does from the heartbeat itself), not towards idle; this caller's calls sent count on
    top, unfaded."""
    a = TableMember(entry("a", active=2, task_ms=100.0, interval_ms=1000), 0.0)
    assert a.heard_at(0.25) == 0.0 and a.heard_at(5.25) == 5.0
    assert a.in_flight(0.25) == a.in_flight(5.25) == 2.0 * math.exp(-2.5)  # not 2 e^-52.5
    a.handed_out(5.25)
    assert a.in_flight(5.25) == 2.0 * math.exp(-2.5) + 1.0


def entry(agent_id: str, **kw: Any) -> TableEntry:
    return TableEntry(agent_id=agent_id, state=kw.pop("state", "healthy"),
                      score=kw.pop("score", 90.0), max_concurrency=2, **kw)  # fmt: skip


def test_a_copy_follows_deltas_and_says_when_one_does_not_follow() -> None:
    members: dict[str, TableMember] = {}
    table = RouteTable("x", TableRouting())
    table.load(TableShare(capability="x", partition=1, epoch=5, version=3,
                          entries=[entry("a"), entry("b")]), members, 0.0)  # fmt: skip
    assert set(table.index.members) == {"a", "b"} and table.local
    nxt = TableDelta(capability="x", partition=1, epoch=5, version=4, prev=3,
                     upserts=[entry("a", state="suspect")], removed=["b"])  # fmt: skip
    assert table.apply(nxt, members, 1.0)
    assert set(table.index.members) == {"a"} and members["a"].state == "suspect"
    assert "b" not in members
    assert table.apply(nxt, members, 1.0)  # a repeat is harmless
    gap = TableDelta(capability="x", partition=1, epoch=5, version=6, prev=5)
    assert not table.apply(gap, members, 2.0)
    other_epoch = TableDelta(capability="x", partition=1, epoch=6, version=1, prev=0)
    assert not table.apply(other_epoch, members, 2.0)
    unknown_share = TableDelta(capability="x", partition=2, epoch=6, version=1, prev=0)
    assert not table.apply(unknown_share, members, 2.0)
    table.load(TableShare(capability="x", partition=1, epoch=6, version=1,
                          entries=[entry("c")]), members, 3.0)  # fmt: skip
    assert set(table.index.members) == {"c"} and set(members) == {"c"}
    quota = TableDelta(capability="x", partition=1, epoch=6, version=2, prev=1, local=False)
    assert table.apply(quota, members, 4.0) and not table.local
    unreadable = TableDelta(capability="x", partition=1, epoch=6, version=3, prev=2,
                            rule=msgspec.Raw(b'{"split_by": "version", "wat": 1}'))  # fmt: skip
    assert table.apply(unreadable, members, 4.0) and not table.local and table.rule is None


def test_a_rule_travels_in_shares_and_deltas_and_its_absence_too() -> None:
    """Off the wire: a share and a delta carrying a rule decode (a ``Raw | None`` field
    decoded only ``null``: any rule made them undecodable, and callers kept the old rule)."""
    split = msgspec.Raw(b'{"split_by":"version","split":{"1":90,"2":10}}')
    share = TableShare(capability="x", partition=1, epoch=5, version=1, entries=[entry("a")],
                       rule=split)  # fmt: skip
    body = schema.encoder.encode(Table(capability="x", partitions=4, owned=[1], shares=[share]))
    got = schema.table_decoder.decode(body).shares[0]
    assert bytes(got.rule) == bytes(split)
    members: dict[str, TableMember] = {}
    table = RouteTable("x", TableRouting())
    table.load(got, members, 0.0)
    assert table.local and table.rule is not None and table.rule.stored.split == {"1": 90, "2": 10}
    cleared = TableDelta(capability="x", partition=1, epoch=5, version=2, prev=1)
    body = schema.encoder.encode(cleared)
    assert b"rule" not in body
    assert table.apply(schema.table_delta_decoder.decode(body), members, 1.0)
    assert table.local and table.rule is None
    quota = TableDelta(capability="x", partition=1, epoch=5, version=3, prev=2, local=False,
                       rule=msgspec.Raw(b'{"quota_rate":1.0}'))  # fmt: skip
    assert table.apply(schema.table_delta_decoder.decode(schema.encoder.encode(quota)),
                       members, 2.0)  # fmt: skip
    assert not table.local and table.rule is not None and table.rule.stored.quota_rate == 1.0


# --- on NATS -------------------------------------------------------------------------------


async def test_a_newcomer_gets_the_whole_table_in_one_request(
    nats_server: NatsServer, broker: Broker, agents: Any, nc: NATS
) -> None:
    for a in ("t1", "t2", "t3"):
        await agents(echo(a))
    await wait_for(lambda: all(healthy(broker, a) for a in ("t1", "t2", "t3")))
    await wait_for(lambda: broker.metrics.partitions_owned._value.get() == 32)
    table = await table_of(nc, "tab")
    assert (table.partitions, table.owned, table.broker_id) == (32, list(range(32)),
                                                                broker.broker_id)  # fmt: skip
    entries = {e.agent_id: e for s in table.shares for e in s.entries}
    assert set(entries) == {"t1", "t2", "t3"}
    assert {e.state for e in entries.values()} == {"healthy"}
    assert all(s.partition == partition(e.agent_id, 32) for s in table.shares for e in s.entries)
    assert all(s.epoch > 0 and s.version >= 1 and s.local for s in table.shares)
    empty = await table_of(nc, "nobody.has.this")
    assert (empty.owned, empty.shares) == (list(range(32)), [])


async def test_each_share_is_stored_in_kv_as_it_stands_when_written(
    nats_server: NatsServer, broker: Broker, agents: Any, nc: NATS
) -> None:
    for a in ("k1", "k2"):
        await agents(echo(a, "kvtab"))
    await wait_for(lambda: healthy(broker, "k1") and healthy(broker, "k2"))
    kv = await nc.jetstream().key_value(TABLES_BUCKET)
    stored: dict[str, schema.TableShare] = {}

    async def read() -> bool:
        for a in ("k1", "k2"):
            try:
                entry = await kv.get(f"{partition(a, 32)}.kvtab")
            except KeyNotFoundError:
                return False
            assert entry.value is not None
            stored[a] = schema.decode(schema.table_share_decoder, entry.value, "share")
        return all(a in {e.agent_id for e in stored[a].entries} for a in ("k1", "k2"))

    loop = asyncio.get_running_loop()
    deadline = loop.time() + 5.0
    while not await read():
        assert loop.time() < deadline, f"both agents' shares in KV reach_tables: {stored}"
        await asyncio.sleep(0.05)
    for a, share in stored.items():
        assert (share.capability, share.partition) == ("kvtab", partition(a, 32))
        assert share.epoch > 0 and share.version >= 1
        assert [e.state for e in share.entries if e.agent_id == a] == ["healthy"]
        assert share.version <= broker.tables.book.shares[(share.partition, "kvtab")].version


async def test_a_leaving_agent_reaches_a_subscribed_caller_as_the_next_delta(
    nats_server: NatsServer, broker: Broker, agents: Any, nc: NATS
) -> None:
    agent = await agents(echo("going"))
    await agents(echo("staying"))
    await wait_for(lambda: healthy(broker, "going") and healthy(broker, "staying"))
    deltas: asyncio.Queue[TableDelta] = asyncio.Queue()

    async def on_delta(msg: Any) -> None:
        deltas.put_nowait(schema.table_delta_decoder.decode(msg.data))

    await nc.subscribe("reach.table.*.tab", cb=on_delta)
    await flush_subscriptions(nc)
    table = await table_of(nc, "tab")
    held = {s.partition: (s.epoch, s.version) for s in table.shares}
    p = partition("going", 32)
    await agent.stop(grace=1)  # leave: draining, out of the routes
    while True:
        d = await asyncio.wait_for(deltas.get(), 5)
        if d.partition != p:
            continue
        if d.version <= held[p][1]:
            continue  # made before the table was read
        assert (d.epoch, d.prev) == held[p]
        held[p] = (d.epoch, d.version)
        states = {e.agent_id: e.state for e in d.upserts}
        # Out of the routes either way: draining, or already evicted (a draining agent that
        # disconnects is; both may fall in one flush).
        if states.get("going") == "draining" or "going" in d.removed:
            assert "staying" not in d.removed
            break


async def test_two_brokers_share_the_partitions_and_one_stopping_hands_its_own_over(
    broker_factory: BrokerFactory, nats_server: NatsServer
) -> None:
    first = await broker_factory(fleet__lease_ttl_s=3.0)
    second = await broker_factory(fleet__lease_ttl_s=3.0)
    owned = [first.partitions.held, second.partitions.held]
    await wait_for(lambda: len(owned[0]) + len(owned[1]) == 32, what="every partition owned")
    assert set(owned[0]).isdisjoint(owned[1])
    await first.stop()
    await wait_for(lambda: len(second.partitions.held) == 32, timeout=5,
                   what="the second broker owns every partition")  # fmt: skip


def test_a_share_says_whether_its_agents_moved_or_only_their_load() -> None:
    """What decides how soon a share is stored again: a join, a leave or a state move makes
    it ``moved``; a heartbeat that only moves load or score does not."""
    reg, book = book_world()
    announce(reg, "a", ["x"], 0.0)
    book.own(book.partition_of("a"), 1, reg.agents, 0.0)
    share = book.shares[(book.partition_of("a"), "x")]
    assert share.moved  # new
    share.moved = False
    rec = reg.agents["a"]
    rec.set_load(1, 0)
    assert [(len(d.upserts), len(d.loads)) for d in book.changes({"a"}, reg.agents.get, 1.0)] == [
        (0, 1)]  # fmt: skip
    assert not share.moved  # only its load
    reg.disconnected("a", 2.0)  # suspect
    assert [d.upserts[0].state for d in book.changes({"a"}, reg.agents.get, 2.0)] == ["suspect"]
    assert share.moved
    share.moved = False
    announce(reg, "a", ["y"], 3.0)  # leaves x
    book.changes({"a"}, reg.agents.get, 3.0)
    assert share.moved and share.entries == {}


async def test_a_new_owners_delta_that_comes_during_a_fetch_has_the_table_asked_again(
    nats_server: NatsServer, nc: NATS
) -> None:
    """A fetch answered with the old owner's share of partition 5 (epoch 1), while the new
    owner's first delta (epoch 2) came in the meantime: the delta does not follow what was
    fetched, so the table is asked for again (not the delta dropped, the old share held
    until the next resync), and the new owner's share is held."""
    entry = TableEntry(agent_id="moved", state="healthy", score=90.0, max_concurrency=4)

    def table(epoch: int, version: int) -> bytes:
        share = TableShare(capability="handover", partition=5, epoch=epoch, version=version,
                           entries=[entry])  # fmt: skip
        return schema.encoder.encode(Table(capability="handover", partitions=8,
                                           owned=list(range(8)), shares=[share],
                                           broker_id="fake"))  # fmt: skip

    asked = 0

    async def answer(msg: Any) -> None:
        nonlocal asked
        asked += 1
        if asked == 1:  # the handover happens while the first answer is on its way
            delta = TableDelta(capability="handover", partition=5, epoch=2, version=2, prev=1,
                               upserts=[entry])  # fmt: skip
            await nc.publish("reach.table.5.handover", schema.encoder.encode(delta))
            await nc.flush()
            await asyncio.sleep(0.05)
            await nc.publish(msg.reply, table(1, 3))
        else:
            await nc.publish(msg.reply, table(2, 2))

    await nc.subscribe("reach.tables.handover", cb=answer)
    await flush_subscriptions(nc)
    follower = TableFollower(nc, Subjects(), ClientConfig(table_wait_s=1.0))
    await follower.start()
    try:
        held = await follower.table("handover")
        assert held is not None
        await wait_for(lambda: held.shares == {5: (2, 2)}, 5,
                       what="the new owner's share held")  # fmt: skip
        assert asked == 2
    finally:
        await follower.stop()


async def test_a_flush_takes_the_changed_agents_in_a_chunk_at_a_time_and_a_request_finishes_it(
    broker: Broker, nc: NATS
) -> None:
    """2,000 agents changed at once: the flush lets the event loop run after every
    ``TOUCH_CHUNK`` of them (it took them all in one callback: every route request waited
    behind it). A request for the table while the flush is under way answers with every
    agent, and the deltas that follow each other in each share say each agent once."""
    n = 2_000
    deltas: list[TableDelta] = []

    async def on_delta(msg: Any) -> None:
        deltas.append(schema.table_delta_decoder.decode(msg.data))

    await nc.subscribe("reach.table.*.chunked", cb=on_delta)
    await flush_subscriptions(nc)
    known, chunk = broker.tables.book.known, tables_service.TOUCH_CHUNK
    before = len(known)
    now = broker.clock()
    for i in range(n):
        announce(broker.registry, f"chunk-{i:04d}", ["chunked"], now)
    steps: list[int] = []  # agents taken in between two turns of the loop
    last = before
    asked: asyncio.Task[Any] | None = None
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 5.0
    while len(known) < before + n:
        assert loop.time() < deadline, f"{len(known) - before} of {n} agents taken in"
        await asyncio.sleep(0)
        if asked is None and len(known) > last:
            steps.append(len(known) - last)
            if len(known) - before >= 2 * chunk:  # under way: ask for the table now
                asked = asyncio.create_task(nc.request("reach.tables.chunked", b"", timeout=5))
        last = len(known)
    assert steps and max(steps) <= chunk, steps
    assert len(steps) >= 2
    assert asked is not None
    table = schema.table_decoder.decode((await asked).data)  # 200 kB: past a body's limit
    assert sorted(e.agent_id for s in table.shares for e in s.entries) == sorted(
        f"chunk-{i:04d}" for i in range(n))  # fmt: skip
    versions = {s.partition: s.version for s in table.shares}

    def upto() -> list[TableDelta]:  # later deltas: the agents' silence (they never beat)
        return [d for d in deltas if d.version <= versions[d.partition]]

    await wait_for(
        lambda: {d.partition: d.version for d in upto()} == versions,
        what="the deltas up to the table's versions",
    )
    by_share: dict[int, list[TableDelta]] = {}
    for d in upto():
        by_share.setdefault(d.partition, []).append(d)
    for p, seq in by_share.items():
        assert [d.prev for d in seq] == [0, *[d.version for d in seq[:-1]]], (p, seq)
    said = sorted(e.agent_id for d in upto() for e in d.upserts)
    assert said == sorted(f"chunk-{i:04d}" for i in range(n))
