"""Two brokers over one server, P = 8 (issue 24, "Tables merged, not fleets copied"): a
capability's route requests are answered by one broker, its owner, whichever broker they
reach (the others forward them), so a caller's quota and an agent's slots are counted once;
and a route lists the agents of every partition, whichever broker owns it."""

from __future__ import annotations

import asyncio
import random
import time
from typing import Any

import msgspec
import pytest
from nats.aio.client import Client as NATS

import reach_agent
from jetstream.claims import ClaimStore
from jetstream.names import PARTITIONS_BUCKET
from reach_agent.connection import flush_subscriptions
from reach_agent.routing.table import RouteTable, SharedMember, TableMember, partition
from reach_agent.wire import schema
from reach_agent.wire.errors import NoReachableAgent, Overloaded, from_reply
from reach_agent.wire.schema import (
    H_CALLER,
    Announce,
    RouteRequest,
    Table,
    TableEntry,
    TableRouting,
    TableShare,
)
from reach_broker.broker import Broker
from reach_broker.config import Config
from reach_broker.core.registry import Registry
from reach_broker.core.routing import Router
from reach_broker.core.tokens import TokenSigner
from reach_broker.service.partitions import Lease

from .conftest import BrokerFactory, wait_for
from .test_sdk_failover import healthy

P = 8


def worker(agent_id: str, cap: str, *, slots: int = 100, every: float = 0.1) -> reach_agent.Agent:
    agent = reach_agent.Agent(agent_id, [cap], heartbeat_interval=every, max_concurrency=slots)

    @agent.handler(cap)
    async def run(task: reach_agent.Task) -> Any:
        return task.payload

    return agent


# --- the merge, pure -----------------------------------------------------------------------


class Merge:
    """A broker's registry holding ``own`` and the other owners' share (partition 7) of
    ``theirs``, routed with ``choice``."""

    def __init__(self, own: str, theirs: str, *, choice: str = "ranked", slots: int = 4) -> None:
        cfg = Config()
        cfg.routing.rank_refresh_ms = 0
        cfg.routing.inflight_share = 10.0
        cfg.routing.choice = choice  # type: ignore[assignment]
        self.reg = reg = Registry(
            cfg.detection,
            cfg.scoring,
            TokenSigner(b"k" * 32, 3600.0, wall=lambda: 1e6),
            interval_ms=cfg.broker.interval_ms,
        )
        for agent_id in own:
            ann = Announce(agent_id=agent_id, capabilities=["cap"], max_concurrency=slots,
                           heartbeat_interval_ms=1000)  # fmt: skip
            reg.announce(ann, 0.0, 0)
        self.table = RouteTable("cap", TableRouting(), SharedMember)
        self.members: dict[str, TableMember] = {}
        score = next(iter(reg.agents.values())).score if own else 80.0  # the same for all
        entries = [TableEntry(agent_id=a, state="healthy", score=score, max_concurrency=slots)
                   for a in theirs]  # fmt: skip
        self.table.load(TableShare(capability="cap", partition=7, epoch=1, version=1,
                                   entries=entries), self.members, 0.0)  # fmt: skip
        self.router = Router(cfg.routing, reg.indexes, lambda a, c: f"reach.task.{a}.{c}",
                             inflight=lambda: reg.inflight, capacity=lambda: reg.capacity,
                             rng=random.Random(5), foreign=lambda cap: self.table)  # fmt: skip

    def route(self, req: RouteRequest, now: float = 1.0) -> list[str]:
        body = self.router.route_reply("cap", req, now, 0)
        return [c.agent_id for c in schema.route_reply_decoder.decode(body).candidates]


@pytest.mark.parametrize("choice", ["ranked", "weighted", "p2c"])
def test_a_route_merges_the_registry_and_the_other_owners_shares(choice: str) -> None:
    m = Merge("ab", "cd", choice=choice)
    assert set(m.route(RouteRequest(limit=10, peek=True))) == {"a", "b", "c", "d"}
    assert len(m.route(RouteRequest(limit=3, peek=True))) == 3


def test_the_two_pools_are_ranked_together_and_drawn_from_once() -> None:
    # Equal scores: ranked by id across both sides, not one side's best then the other's.
    m = Merge("bdf", "ace")
    assert m.route(RouteRequest(limit=4, peek=True)) == ["a", "b", "c", "d"]


def test_an_agent_in_both_is_taken_from_the_share_and_its_hand_outs_counted_there() -> None:
    # Until brokers ingest only what they own, the registry holds the other owners' agents
    # too: the share's copy is the one routed (its owner's word), listed once.
    m = Merge("ac", "c", slots=1)
    req = RouteRequest(limit=10, exclude=["a"])
    assert m.route(req) == ["c"]
    assert m.members["c"].handed == 1.0 and m.reg.agents["c"].handed == 0.0
    with pytest.raises(Overloaded):  # its one slot is handed out
        m.route(req)


def test_a_sticky_key_wins_the_same_agent_whichever_side_holds_it() -> None:
    m = Merge("abcd", "efgh")
    firsts = {m.route(RouteRequest(sticky_key=f"user-{i}", peek=True))[0] for i in range(40)}
    assert firsts & set("abcd") and firsts & set("efgh")
    again = {m.route(RouteRequest(sticky_key=f"user-{i}", peek=True))[0] for i in range(40)}
    assert again == firsts


def test_nothing_on_either_side_says_both_reasons() -> None:
    m = Merge("a", "b")
    with pytest.raises(NoReachableAgent) as exc:
        m.route(RouteRequest(exclude=["a", "b"]))
    assert exc.value.message == (
        "this broker's partitions: no reachable agent for 'cap' among 1: 1 filtered by "
        "exclude; the other owners' partitions: no reachable agent for 'cap' among 1: 1 "
        "filtered by exclude"
    )


def test_without_shares_a_route_is_the_registrys_alone() -> None:
    m = Merge("ab", "cd")
    m.router.foreign = lambda cap: None
    assert set(m.route(RouteRequest(limit=10, peek=True))) == {"a", "b"}


# --- two brokers on NATS -------------------------------------------------------------------


async def two_brokers(broker_factory: BrokerFactory, **overrides: Any) -> tuple[Broker, Broker]:
    """Two brokers of P partitions, every partition owned by one of them."""
    pair = (await broker_factory(fleet__partitions=P, **overrides),
            await broker_factory(fleet__partitions=P, **overrides))  # fmt: skip
    await wait_for(lambda: sum(len(b.tables.book.epochs) for b in pair) == P,
                   what="every partition owned")  # fmt: skip
    return pair


def forwards(broker: Broker, result: str) -> float:
    value: float = broker.metrics.route_forwards.labels(result)._value.get()
    return value


def owner_and_other(pair: tuple[Broker, Broker], capability: str) -> tuple[Broker, Broker]:
    p = partition(capability, P)
    first, second = pair
    return (first, second) if p in first.tables.book.epochs else (second, first)


async def wait_owners_read(pair: tuple[Broker, Broker], capability: str) -> None:
    """The broker that does not own ``capability`` has read who does (its leases' round)."""
    owner, other = owner_and_other(pair, capability)
    p = partition(capability, P)
    await wait_for(lambda: other.forwarder.owners.of[p] == owner.forwarder.token,
                   what="the other broker knows the capability's owner")  # fmt: skip


async def test_a_callers_quota_is_counted_once_by_two_brokers(
    broker_factory: BrokerFactory, agents: Any, nc: NATS
) -> None:
    cap = "quota.cap"
    pair = await two_brokers(broker_factory, quotas__rate=10.0, quotas__burst=10)
    await agents(worker("q-agent", cap))
    await wait_for(lambda: all(healthy(b, "q-agent") for b in pair))
    await wait_owners_read(pair, cap)
    owner, other = owner_and_other(pair, cap)
    peek = schema.encoder.encode(schema.RouteRequest(peek=True))
    admitted = refused = 0
    start = time.monotonic()
    while time.monotonic() - start < 3.0:
        msg = await nc.request(f"reach.route.{cap}", peek, timeout=2, headers={H_CALLER: "q1"})
        err = from_reply(msg.headers, msg.data)
        if err is None:
            admitted += 1
        else:
            assert err.code == "OVERLOADED" and "over its quota" in err.message, err.message
            refused += 1
    elapsed = time.monotonic() - start
    # A token bucket of 10/s holding 10: at most 10 + 10/s over the run, and (requests
    # never stop for long) at least 90 % of 10/s. Two brokers each counting would admit twice.
    assert 0.9 * 10 * elapsed <= admitted <= 10 + 10 * elapsed + 1, (admitted, elapsed)
    assert refused > 0
    # The queue group spread the requests: the other broker forwarded, the owner answered.
    assert forwards(other, "ok") > 0
    assert forwards(owner, "answered") == forwards(other, "ok")
    assert forwards(owner, "ok") == 0


async def test_an_agents_slots_are_handed_out_once_by_two_brokers(
    broker_factory: BrokerFactory, agents: Any, nc: NATS
) -> None:
    cap = "slots.cap"
    pair = await two_brokers(broker_factory)
    # A long heartbeat interval: no report resets the brokers' hand-out count meanwhile.
    await agents(worker("four-slots", cap, slots=4, every=20.0))
    # Its first heartbeat (right after the announce) heard by both: none comes meanwhile.
    await wait_for(lambda: all(healthy(b, "four-slots")
                               and b.metrics.heartbeat_result["accepted"]._value.get() == 1
                               for b in pair))  # fmt: skip
    await wait_owners_read(pair, cap)
    owner, other = owner_and_other(pair, cap)
    handed = overloaded = 0
    for _ in range(40):  # spread over both brokers by the queue group
        msg = await nc.request(f"reach.route.{cap}", b"", timeout=2)
        err = from_reply(msg.headers, msg.data)
        if err is None:
            reply = schema.route_reply_decoder.decode(msg.data)
            assert reply.candidates[0].agent_id == "four-slots"
            handed += 1
        else:
            assert err.code == "OVERLOADED", err.message
            overloaded += 1
    assert (handed, overloaded) == (4, 36)
    assert forwards(other, "ok") > 0
    assert owner.registry.agents["four-slots"].handed == 4.0


async def test_a_route_lists_the_agents_of_every_partition(
    broker_factory: BrokerFactory, agents: Any, nc: NATS
) -> None:
    """Every partition has an agent of the capability; a route (limit 100) lists them all,
    whichever broker owns their partitions. (Until brokers ingest only the partitions they
    own, each also holds every agent itself; then the owner's own registry covers only its
    partitions and the rest come from the other's shares.)"""
    cap = "spread.cap"
    pair = await two_brokers(broker_factory)
    ids: dict[int, str] = {}
    n = 0
    while len(ids) < P:
        agent_id = f"spread-{n}"
        ids.setdefault(partition(agent_id, P), agent_id)
        n += 1
    for agent_id in ids.values():
        await agents(worker(agent_id, cap))
    await wait_for(lambda: all(healthy(b, a) for b in pair for a in ids.values()))
    await wait_owners_read(pair, cap)
    body = schema.encoder.encode(schema.RouteRequest(peek=True, limit=100))
    for _ in range(10):  # both brokers, by the queue group
        msg = await nc.request(f"reach.route.{cap}", body, timeout=2)
        assert from_reply(msg.headers, msg.data) is None
        reply = schema.route_reply_decoder.decode(msg.data)
        listed = {c.agent_id for c in reply.candidates}
        assert listed == set(ids.values())
        assert {partition(a, P) for a in listed} == set(range(P))
    owned = [set(b.tables.book.epochs) for b in pair]
    assert owned[0] | owned[1] == set(range(P)) and owned[0].isdisjoint(owned[1])


# --- another owner that is no broker -------------------------------------------------------


class Ghost:
    """The owner of partitions 4-7 without being a broker: it holds their leases (renewed
    every second) and answers table requests with a share of one made-up agent each
    (``ghost-<p>``, healthy); it takes no forwarded route request."""

    OWNED = (4, 5, 6, 7)

    def __init__(self, nc: NATS) -> None:
        self.nc = nc
        self.store = ClaimStore(nc, bucket=PARTITIONS_BUCKET)
        self.revisions: dict[int, int] = {}
        self.task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        lease = msgspec.json.encode(Lease(broker_id="ghost"))
        for p in self.OWNED:
            ours, stored = await self.store.create(str(p), lease)
            assert ours
            self.revisions[p] = stored.revision
        await self.nc.subscribe("reach.tables.>", cb=self.answer)
        await flush_subscriptions(self.nc)
        self.task = asyncio.create_task(self.renew(lease))

    async def renew(self, lease: bytes) -> None:
        while True:
            await asyncio.sleep(1.0)
            for p in self.OWNED:
                revision = await self.store.swap(str(p), lease, self.revisions[p])
                assert revision is not None
                self.revisions[p] = revision

    async def answer(self, msg: Any) -> None:
        cap = msg.subject.removeprefix("reach.tables.")
        if cap.startswith("silent."):
            return  # a table it never answers (nor stores)
        shares = [TableShare(capability=cap, partition=p, epoch=1, version=1, entries=[
            TableEntry(agent_id=f"ghost-{p}", state="healthy", score=90.0, max_concurrency=4)])
            for p in self.OWNED]  # fmt: skip
        table = Table(capability=cap, partitions=P, owned=list(self.OWNED), shares=shares,
                      broker_id="ghost")  # fmt: skip
        await self.nc.publish(msg.reply, schema.encoder.encode(table))

    async def stop(self) -> None:
        if self.task is not None:
            self.task.cancel()
            await asyncio.wait({self.task})


def capability_in(partitions: tuple[int, ...], stem: str) -> str:
    return next(f"{stem}{i}" for i in range(1000) if partition(f"{stem}{i}", P) in partitions)


async def test_a_route_merges_the_shares_of_another_owner_and_explain_says_what_it_saw(
    provisioned: Any, broker_factory: BrokerFactory, agents: Any, nc: NATS
) -> None:
    ghost = Ghost(nc)
    await ghost.start()
    try:
        broker = await broker_factory(fleet__partitions=P)
        assert sorted(broker.tables.book.epochs) == [0, 1, 2, 3]
        cap = capability_in((0, 1, 2, 3), "merged.")  # this broker's: answered here
        await agents(worker("real-a", cap))
        await wait_for(lambda: healthy(broker, "real-a"))
        look = schema.encoder.encode(RouteRequest(peek=True, limit=100))
        explain = schema.encoder.encode(RouteRequest(explain=True, limit=100))

        async def route(body: bytes) -> schema.RouteReply:
            msg = await nc.request(f"reach.route.{cap}", body, timeout=2)
            assert from_reply(msg.headers, msg.data) is None
            return schema.route_reply_decoder.decode(msg.data)

        # The first request waits for the other owner's shares (one round trip), then
        # lists its agents with this broker's own; explained, it says what it did not explain.
        merged = await route(look)
        assert {c.agent_id for c in merged.candidates} == {"real-a", "ghost-4", "ghost-5",
                                                           "ghost-6", "ghost-7"}  # fmt: skip
        explained = await route(explain)
        assert explained.explain is not None
        assert (explained.explain.shared, explained.explain.unseen_partitions) == (4, [])

        # A capability whose shares the other owner never gives: the registry answers, and
        # an explanation names the partitions it could not see.
        silent = capability_in((0, 1, 2, 3), "silent.")
        await agents(worker("real-b", silent))
        await wait_for(lambda: healthy(broker, "real-b"))
        msg = await nc.request(f"reach.route.{silent}", explain, timeout=2)
        alone = schema.route_reply_decoder.decode(msg.data)
        assert [c.agent_id for c in alone.candidates] == ["real-b"]
        assert alone.explain is not None and alone.explain.shared == 0
        assert alone.explain.unseen_partitions == sorted({4, 5, 6, 7} - {partition("real-b", P)})

        # A capability of the other owner's partitions: forwarded to it; it takes none, so
        # the request is refused, retryable, and counted.
        theirs = capability_in(Ghost.OWNED, "theirs.")
        p = partition(theirs, P)
        await wait_for(lambda: broker.forwarder.owners.of[p] == "ghost",
                       what="the owner read")  # fmt: skip
        msg = await nc.request(f"reach.route.{theirs}", b"", timeout=2)
        err = from_reply(msg.headers, msg.data)
        assert err is not None and err.code == "OVERLOADED"
        assert err.message == (
            f"route requests for {theirs!r} are answered by the owner of partition {p} "
            "(ghost), which is not there; retry in 2000 ms"
        )
        assert forwards(broker, "no_owner") == 1
    finally:
        await ghost.stop()
