"""Two brokers over one server, P = 8 (issue 24, "Tables merged, not fleets copied"): a
capability's route requests are answered by one broker, its owner, whichever broker they
reach (the others forward them), so a caller's quota and an agent's slots are counted once;
and a route lists the agents of every partition, whichever broker owns it."""

from __future__ import annotations

import asyncio
import math
import random
import time
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
import pytest
from nats.aio.client import Client as NATS
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError

import reach_agent
from jetstream.claims import ClaimStore
from jetstream.names import PARTITIONS_BUCKET
from reach_agent.connection import flush_subscriptions
from reach_agent.routing.table import RouteTable, SharedMember, TableMember, partition
from reach_agent.wire import schema
from reach_agent.wire.errors import NoReachableAgent, Overloaded, ReachError, from_reply
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
from reach_broker.cli.route import print_explain
from reach_broker.config import Config
from reach_broker.core.registry import Registry
from reach_broker.core.routing import Router
from reach_broker.core.tokens import TokenSigner
from reach_broker.service.partitions import Lease, presence_key

from .conftest import BrokerFactory, wait_for
from .test_sdk_failover import healthy

P = 8


def worker(agent_id: str, cap: str, *, slots: int = 100, every: float = 1.0) -> reach_agent.Agent:
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


def test_an_agent_in_both_is_taken_from_the_registry_and_its_hand_outs_counted_there() -> None:
    # Until brokers ingest only what they own, the registry holds the other owners' agents
    # too: its record is the one routed (as fresh as the share, and still moving when the
    # share's owner dies), listed once.
    m = Merge("ac", "c", slots=1)
    req = RouteRequest(limit=10, exclude=["a"])
    assert m.route(req) == ["c"]
    assert m.reg.agents["c"].handed == 1.0 and m.members["c"].handed == 0.0
    with pytest.raises(Overloaded):  # its one slot is handed out
        m.route(req)


def test_an_agent_of_another_owner_whose_load_never_moves_sheds_the_hand_outs() -> None:
    """A broker counts its hand-outs of another owner's agent until the agent's next report,
    which it sees only when the report moved the share (nothing else is published): without
    a task time each counts one to two heartbeat intervals (1 s here), not for good."""
    m = Merge("", "c", slots=4)  # the share loaded at 0.0
    req = RouteRequest(limit=1)
    assert [m.route(req, now=1.0) for _ in range(4)] == [["c"]] * 4
    for now in (1.5, 2.0, 2.9):  # its four slots handed out: full until two intervals on
        with pytest.raises(Overloaded):
            m.route(req, now=now)
    assert m.members["c"].in_flight(2.9) == 4.0
    assert m.members["c"].in_flight(3.0) == 0.0
    assert m.route(req, now=3.0) == ["c"]
    # A report (a delta of its entry) replaces the count at once, as the registry's do.
    entry = TableEntry(agent_id="c", state="healthy", score=80.0, max_concurrency=4, active=1)
    assert m.table.apply(schema.TableDelta(capability="cap", partition=7, epoch=1, version=2,
                                           prev=1, upserts=[entry]), m.members, 3.1)  # fmt: skip
    assert m.members["c"].in_flight(3.1) == 1.0


def test_an_agent_of_another_owner_with_a_task_time_whose_load_never_moves_keeps_it() -> None:
    """With a task time, a broker's copy fades the reported ``active`` from the agent's last
    heartbeat interval, as the owner's registry fades it from each heartbeat (an unmoved
    report is not published): not towards idle once a task time has passed since the last
    published report. Its own hand-outs count on top while they are more."""
    c = SharedMember(TableEntry(agent_id="c", state="healthy", score=80.0, max_concurrency=4,
                                active=3, task_ms=100.0, interval_ms=1000), 0.0)  # fmt: skip
    assert c.in_flight(0.25) == c.in_flight(5.25) == 3.0 * math.exp(-2.5)  # not 3 e^-52.5
    c.handed_out(5.25)
    assert c.in_flight(5.25) == 3.0 * math.exp(-2.5) + 1.0
    assert c.in_flight(5.5) == (3.0 * math.exp(-2.5) + 1.0) * math.exp(-2.5)
    # A task time on, the hand-out faded below the heartbeat's count: the report's holds.
    assert c.in_flight(6.25) == 3.0 * math.exp(-2.5)


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
    # The first takes every partition, then hands half back once it sees the second's
    # presence, and the second takes them: settled when each owns its fair share.
    await wait_for(lambda: [len(b.tables.book.epochs) for b in pair] == [P // 2] * 2, 20,
                   what="each owning half the partitions")  # fmt: skip
    return pair


def forwards(broker: Broker, result: str) -> float:
    value: float = broker.metrics.route_forwards.labels(result)._value.get()
    return value


def owner_and_other(pair: tuple[Broker, Broker], capability: str) -> tuple[Broker, Broker]:
    """The broker that owns ``capability`` (its partition's lease), and the other."""
    p = partition(capability, P)
    first, second = pair
    return (first, second) if p in first.tables.book.epochs else (second, first)


def holder(pair: tuple[Broker, Broker], agent_id: str) -> Broker:
    """The broker that owns ``agent_id``'s partition (the one that surely ingests it, whether
    or not every broker still ingests every agent)."""
    return owner_and_other(pair, agent_id)[0]


def held_healthy(pair: tuple[Broker, Broker], *agent_ids: str) -> bool:
    return all(healthy(holder(pair, a), a) for a in agent_ids)


def handouts(owner: Broker, agent_id: str) -> float:
    """The hand-outs ``owner`` counts for ``agent_id``: on its registry's record, or on its
    copy from the other owner's share."""
    rec = owner.registry.agents.get(agent_id)
    if rec is not None:
        return rec.handed
    return owner.shares.follower.members[agent_id].handed


def share_settled(pair: tuple[Broker, Broker], capability: str, agent_id: str) -> bool:
    """The capability's owner holds ``agent_id``'s share as its holder last made it (nothing
    to wait for when the owner holds the agent's partition itself)."""
    owner, other = owner_and_other(pair, capability)
    p = partition(agent_id, P)
    if p in owner.tables.book.epochs:
        return True
    share = other.tables.book.shares.get((p, capability))
    followed = owner.shares.follower.followed.get(capability)
    return (
        share is not None
        and followed is not None
        and not other.registry.changed
        and followed.table.shares.get(p) == (other.tables.book.epochs[p], share.version)
    )


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
    await wait_for(lambda: held_healthy(pair, "q-agent"))
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
    # Its first heartbeat (right after the announce) heard by every broker that ingests it,
    # and (when another broker owns its partition) in the share the capability's owner
    # follows: no report resets a count meanwhile.
    await wait_for(lambda: held_healthy(pair, "four-slots") and all(
        b.metrics.heartbeat_result["accepted"].value == 1
        for b in pair if "four-slots" in b.registry.agents))  # fmt: skip
    await wait_owners_read(pair, cap)
    owner, other = owner_and_other(pair, cap)
    look = schema.encoder.encode(schema.RouteRequest(peek=True))
    assert (
        from_reply(
            *(lambda m: (m.headers, m.data))(
                await nc.request(f"reach.route.{cap}", look, timeout=2)
            )
        )
        is None
    )  # its shares followed
    await wait_for(lambda: share_settled(pair, cap, "four-slots"))
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
    assert handouts(owner, "four-slots") == 4.0


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
    await wait_for(lambda: held_healthy(pair, *ids.values()))
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


async def test_a_broker_joining_or_leaving_rebalances_the_partitions_at_once(
    broker_factory: BrokerFactory,
) -> None:
    """Lease rounds 200 s apart (``lease_ttl_s`` 600): the second broker gets half the
    partitions, and the first all of them back once the second stops, well before any round
    would (each broker follows the others' presence keys and rebalances when one joins, hands
    partitions back or leaves)."""
    first = await broker_factory(fleet__partitions=P, fleet__lease_ttl_s=600)
    assert len(first.tables.book.epochs) == P
    second = await broker_factory(fleet__partitions=P, fleet__lease_ttl_s=600)
    await wait_for(lambda: [len(b.tables.book.epochs) for b in (first, second)] == [P // 2] * 2,
                   10, what="each owning half the partitions")  # fmt: skip
    await second.stop()
    await wait_for(lambda: len(first.tables.book.epochs) == P, 10,
                   what="the first owning every partition again")  # fmt: skip


# --- another owner that is no broker -------------------------------------------------------


class Ghost:
    """The owner of partitions 4-7 without being a broker: it holds their leases (renewed
    every second) and answers table requests with a share of one made-up agent each
    (``ghost-<p>``, healthy), or with none for a capability named ``empty.*`` (it holds no
    agent of it); it takes forwarded route requests and never answers them."""

    OWNED = (4, 5, 6, 7)

    def __init__(self, nc: NATS, *, present: bool = False) -> None:
        self.nc = nc
        self.store = ClaimStore(nc, bucket=PARTITIONS_BUCKET)
        self.revisions: dict[int, int] = {}
        """The leases it renews, at the revision it holds."""
        self.present = present
        """Whether it also keeps a presence key (a broker counting it holds half the
        partitions at most, so it takes none of the ghost's)."""
        self.task: asyncio.Task[None] | None = None
        self.answering = True
        """False: it answers no table request (yet)."""

    async def start(self) -> None:
        lease = msgspec.json.encode(Lease(broker_id="ghost"))
        for p in self.OWNED:
            ours, stored = await self.store.create(str(p), lease)
            assert ours
            self.revisions[p] = stored.revision
        await self.nc.subscribe("reach.tables.>", cb=self.answer)
        await self.nc.subscribe("reach.forward.ghost.>")  # forwards taken, never answered
        await flush_subscriptions(self.nc)
        if self.present:
            await self.nc.jetstream().publish(f"$KV.{PARTITIONS_BUCKET}.{presence_key('ghost')}",
                                              b"")  # fmt: skip
        self.task = asyncio.create_task(self.renew(lease))

    async def renew(self, lease: bytes) -> None:
        while True:
            await asyncio.sleep(1.0)
            for p in list(self.revisions):
                revision = await self.store.swap(str(p), lease, self.revisions[p])
                assert revision is not None
                self.revisions[p] = revision
            if self.present:
                await self.nc.jetstream().publish(
                    f"$KV.{PARTITIONS_BUCKET}.{presence_key('ghost')}", b""
                )

    async def hand_back(self, p: int) -> None:
        """Partition ``p`` handed back (a lease naming no owner), no longer renewed."""
        revision = self.revisions.pop(p)
        assert await self.store.swap(str(p), msgspec.json.encode(Lease()), revision) is not None

    async def answer(self, msg: Any) -> None:
        cap = msg.subject.removeprefix("reach.tables.")
        if cap.startswith("silent.") or not self.answering:
            return  # a table it never answers (nor stores)
        shares = [TableShare(capability=cap, partition=p, epoch=1, version=1, entries=[
            TableEntry(agent_id=f"ghost-{p}", state="healthy", score=90.0, max_concurrency=4)])
            for p in self.OWNED if not cap.startswith("empty.")]  # fmt: skip
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
        await agents(worker("real-a", cap))  # of partition 3: this broker's
        await wait_for(lambda: healthy(broker, "real-a"), 15)
        look = schema.encoder.encode(RouteRequest(peek=True, limit=100))
        explain = schema.encoder.encode(RouteRequest(explain=True, limit=100))

        async def route(body: bytes) -> schema.RouteReply:
            msg = await nc.request(f"reach.route.{cap}", body, timeout=2)
            assert from_reply(msg.headers, msg.data) is None
            return schema.route_reply_decoder.decode(msg.data)

        # The first request waits (a bounded while: 0.4 s) for the other owner's shares; once
        # held, a route lists their agents with this broker's own; explained, it says what it
        # did not explain.
        first = await route(look)
        assert "real-a" in {c.agent_id for c in first.candidates}
        await wait_for(lambda: cap in broker.shares.follower.followed
                       and set(broker.shares.follower.followed[cap].table.shares) == {4, 5, 6, 7},
                       what="the other owner's shares followed")  # fmt: skip
        merged = await route(look)
        assert {c.agent_id for c in merged.candidates} == {"real-a", "ghost-4", "ghost-5",
                                                           "ghost-6", "ghost-7"}  # fmt: skip
        explained = await route(explain)
        assert explained.explain is not None
        assert (explained.explain.shared, explained.explain.unseen_partitions) == (4, [])
        assert {c.agent_id: c.explain is not None for c in explained.candidates} == {
            "real-a": True, "ghost-4": False, "ghost-5": False, "ghost-6": False,
            "ghost-7": False}  # the registry's explained, the shares' listed  # fmt: skip

        # A capability this broker holds no agent of: the shares' agents, explained as such.
        elsewhere = capability_in((0, 1, 2, 3), "elsewhere.")
        await nc.request(f"reach.route.{elsewhere}", look, timeout=2)  # its shares asked for
        await wait_for(lambda: elsewhere in broker.shares.follower.followed
                       and len(broker.shares.follower.followed[elsewhere].table.shares) == 4,
                       what="the shares of the capability followed")  # fmt: skip
        msg = await nc.request(f"reach.route.{elsewhere}", explain, timeout=2)
        assert from_reply(msg.headers, msg.data) is None
        only = schema.route_reply_decoder.decode(msg.data)
        assert {c.agent_id for c in only.candidates} == {"ghost-4", "ghost-5", "ghost-6",
                                                         "ghost-7"}  # fmt: skip
        assert only.explain is not None
        assert (only.explain.members, only.explain.shared, only.explain.unseen_partitions) == (
            0,
            4,
            [],
        )

        # A capability whose shares the other owner never gives: the registry answers, and
        # an explanation names the partitions it could not see.
        silent = capability_in((0, 1, 2, 3), "silent.")
        # (an agent of this broker's partitions: each broker hears its own partitions' agents)
        await agents(worker("real-c", silent))
        await wait_for(lambda: healthy(broker, "real-c"))
        msg = await nc.request(f"reach.route.{silent}", explain, timeout=2)
        alone = schema.route_reply_decoder.decode(msg.data)
        assert [c.agent_id for c in alone.candidates] == ["real-c"]
        assert alone.explain is not None and alone.explain.shared == 0
        assert alone.explain.unseen_partitions == sorted({4, 5, 6, 7} - {partition("real-c", P)})

        # A capability the other owner answers for with no agent: its partitions were seen
        # (empty), not unseen.
        empty = capability_in((0, 1, 2, 3), "empty.")
        real_e = capability_in((0, 1, 2, 3), "real-e")  # an agent of this broker's partitions
        await agents(worker(real_e, empty))
        await wait_for(lambda: healthy(broker, real_e))
        await nc.request(f"reach.route.{empty}", look, timeout=2)  # its shares asked for
        await wait_for(lambda: empty in broker.shares.follower.followed
                       and broker.shares.follower.followed[empty].covered == set(range(P)),
                       what="both owners' answers taken (the other's: no share)")  # fmt: skip
        msg = await nc.request(f"reach.route.{empty}", explain, timeout=2)
        bare = schema.route_reply_decoder.decode(msg.data)
        assert [c.agent_id for c in bare.candidates] == [real_e]
        assert bare.explain is not None
        assert (bare.explain.shared, bare.explain.unseen_partitions) == (0, [])

        # A capability of the other owner's partitions: forwarded to it; it never answers,
        # so the request is refused, retryable, and counted.
        theirs = capability_in(Ghost.OWNED, "theirs.")
        p = partition(theirs, P)
        await wait_for(lambda: broker.forwarder.owners.of[p] == "ghost",
                       what="the owner read")  # fmt: skip
        msg = await nc.request(f"reach.route.{theirs}", b"", timeout=2)
        err = from_reply(msg.headers, msg.data)
        assert err is not None and err.code == "OVERLOADED"
        assert err.message == (
            f"route requests for {theirs!r} are answered by the owner of partition {p} "
            "(ghost), which did not answer in time; retry in 100 ms"
        )
        assert forwards(broker, "timeout") == 1
    finally:
        await ghost.stop()


async def test_a_stopping_broker_answers_the_route_requests_it_forwarded(
    provisioned: Any, broker_factory: BrokerFactory, nc: NATS
) -> None:
    """Route requests forwarded to an owner that never answers (the ghost) while the broker
    stops: one still waiting when the forwarder stops is refused at once, counted
    ``stopped``; a broker that stops gracefully waits for its forwards' answers, refusing
    them at their deadline. Either way refused, retryable, never dropped unanswered."""
    ghost = Ghost(nc)
    await ghost.start()
    seen: list[str] = []

    async def taken(msg: Any) -> None:
        seen.append(msg.subject)

    await nc.subscribe("reach.forward.ghost.>", cb=taken)
    await flush_subscriptions(nc)
    try:
        broker = await broker_factory(fleet__partitions=P, fleet__forward_timeout_s=2.0)
        theirs = capability_in(Ghost.OWNED, "stopping.")
        p = partition(theirs, P)
        await wait_for(lambda: broker.forwarder.owners.of[p] == "ghost",
                       what="the owner read")  # fmt: skip

        async def ask_while(stop: Callable[[], Awaitable[None]]) -> ReachError | None:
            asked = asyncio.ensure_future(nc.request(f"reach.route.{theirs}", b"", timeout=5))
            await wait_for(lambda: len(seen) == 1, what="the forward at the owner")
            seen.clear()
            await stop()
            msg = await asyncio.wait_for(asked, 5)
            return from_reply(msg.headers, msg.data)

        err = await ask_while(broker.forwarder.stop)  # as when a start is undone
        assert err is not None and err.code == "OVERLOADED" and err.retry_after_ms == 100
        assert err.message == (
            f"route requests for {theirs!r} are answered by the owner of partition {p} "
            "(ghost), which had not answered when this broker stopped; retry in 100 ms"
        )
        assert (forwards(broker, "stopped"), forwards(broker, "timeout")) == (1, 0)

        await broker.forwarder.start()
        err = await ask_while(broker.stop)
        assert err is not None and err.code == "OVERLOADED" and err.retry_after_ms == 100
        assert err.message.endswith("(ghost), which did not answer in time; retry in 100 ms")
        assert (forwards(broker, "stopped"), forwards(broker, "timeout")) == (1, 1)
    finally:
        await ghost.stop()


async def test_shares_another_owner_did_not_give_are_asked_for_again(
    provisioned: Any, broker_factory: BrokerFactory, nc: NATS
) -> None:
    """The other owner does not answer a capability's first table request, and KV holds
    none of its shares: the broker answers without them and asks again (1 s later, then
    doubling), so its routes list the other owner's agents once it answers; meanwhile
    ``reach_tables_total{kind="unseen"}`` counts the tables asked for again."""
    ghost = Ghost(nc)
    ghost.answering = False
    await ghost.start()
    try:
        broker = await broker_factory(fleet__partitions=P)
        cap = capability_in((0, 1, 2, 3), "late.")  # this broker's: answered here
        look = schema.encoder.encode(RouteRequest(peek=True, limit=100))
        msg = await nc.request(f"reach.route.{cap}", look, timeout=2)
        err = from_reply(msg.headers, msg.data)
        assert err is not None and err.code == "NO_REACHABLE_AGENT"
        followed = broker.shares.follower.followed[cap]
        assert (followed.table.shares, followed.asked_again) == ({}, 1)
        unseen = broker.metrics.tables.labels("unseen")
        assert unseen._value.get() == 1.0
        ghost.answering = True
        await wait_for(lambda: set(followed.table.shares) == {4, 5, 6, 7}, 5,
                       what="the other owner's shares followed")  # fmt: skip
        msg = await nc.request(f"reach.route.{cap}", look, timeout=2)
        assert from_reply(msg.headers, msg.data) is None
        listed = {c.agent_id for c in schema.route_reply_decoder.decode(msg.data).candidates}
        assert listed == {"ghost-4", "ghost-5", "ghost-6", "ghost-7"}
        assert followed.asked_again == 0 and followed.retry is None
        assert unseen._value.get() == 1.0  # seen at the first fetch asked again
    finally:
        await ghost.stop()


async def test_routes_stay_answered_while_a_stopping_owners_partitions_change_hands(
    broker_factory: BrokerFactory, agents: Any, nc: NATS
) -> None:
    """The owner of every partition stops: until the other broker holds the leases, a route
    request is answered or refused OVERLOADED (retryable) within a second, never left
    unanswered; then the other broker answers every request itself."""
    cap = "handover.cap"
    pair = await two_brokers(broker_factory, fleet__lease_ttl_s=3.0)
    first, second = owner_and_other(pair, cap)  # the first stops: the capability's owner
    # An agent of a partition the first does not own, if the second owns any: it stays
    # where it is (no restore at the handover).
    agent_id = next(
        (
            f"handed-{i}"
            for i in range(1000)
            if partition(f"handed-{i}", P) in second.tables.book.epochs
        ),
        "handed",
    )
    await agents(worker(agent_id, cap))
    await wait_for(lambda: held_healthy(pair, agent_id))
    await wait_owners_read(pair, cap)
    outcomes: list[tuple[str, float]] = []
    done = asyncio.Event()

    async def ask() -> None:
        while not done.is_set():
            t0 = time.monotonic()
            msg = await nc.request(f"reach.route.{cap}", b"", timeout=2)
            err = from_reply(msg.headers, msg.data)
            outcomes.append(("ok" if err is None else err.code, time.monotonic() - t0))
            await asyncio.sleep(0.02)

    asker = asyncio.create_task(ask())
    try:
        await asyncio.sleep(0.2)
        await first.stop()
        await wait_for(lambda: second.shares.owns_all(), 5, what="the second owns all")
        seen = len(outcomes)
        await wait_for(lambda: len(outcomes) >= seen + 10, 5, what="routes after the handover")
    finally:
        done.set()
        await asyncio.wait_for(asker, 5)
    assert {code for code, _ in outcomes} <= {"ok", "OVERLOADED"}
    assert max(took for _, took in outcomes) < 1.0
    assert [code for code, _ in outcomes[-10:]] == ["ok"] * 10


def test_reach_route_explain_says_what_it_did_not_explain(
    capsys: pytest.CaptureFixture[str],
) -> None:
    ex = schema.RouteExplain(members=0, healthy=0, ranked=0, choice="weighted",
                             min_reach_score=60.0, load_watermark=0.85, shared=4,
                             unseen_partitions=[5, 6])  # fmt: skip
    shared = schema.Candidate(agent_id="ghost-4", subject="reach.task.ghost-4.cap", score=90.0,
                              state="healthy", load=0.25)  # fmt: skip
    print_explain("cap", ex, [shared])
    out = capsys.readouterr().out
    assert (
        "other brokers' partitions: 4 agents routed from their shares, not explained one "
        "by one; partitions not seen: 5, 6"
    ) in out
    row = next(line for line in out.splitlines() if "ghost-4" in line)
    assert row.split() == ["1", "ghost-4", "healthy", "90.0", "0.25", *["-"] * 10]


async def test_a_lone_broker_that_lost_a_lease_still_answers(
    broker_factory: BrokerFactory, agents: Any, nc: NATS
) -> None:
    """One broker, whose route tables stopped owning the capability's partition (as when
    its lease's renewal failed): no other broker holds a lease, nobody else counts, so it
    answers instead of refusing."""
    cap = "lone.cap"
    broker = await broker_factory(fleet__partitions=P)
    await agents(worker("lone-a", cap))
    await wait_for(lambda: healthy(broker, "lone-a"))
    broker.tables.lose(partition(cap, P))
    assert not broker.shares.owns_all()
    msg = await nc.request(f"reach.route.{cap}", b"", timeout=2)
    assert from_reply(msg.headers, msg.data) is None
    assert schema.route_reply_decoder.decode(msg.data).candidates[0].agent_id == "lone-a"
    assert forwards(broker, "no_owner") == 0


async def test_a_refusal_asks_to_retry_soon_while_a_partition_changes_hands(
    provisioned: Any, broker_factory: BrokerFactory, nc: NATS
) -> None:
    """The owner of a forwarded request's partition says it is no longer: refused, retry in
    100 ms (the partition changes hands: the leases are read again now); a lease handed
    back likewise; a lease lapsed (its owner died) in a third of the lease's time to live,
    when the others' next round takes it."""
    ghost = Ghost(nc, present=True)
    await ghost.start()
    try:
        broker = await broker_factory(fleet__partitions=P)
        assert sorted(broker.tables.book.epochs) == [0, 1, 2, 3]  # its fair half
        theirs = capability_in(Ghost.OWNED, "moving.")
        p = partition(theirs, P)
        await wait_for(lambda: broker.forwarder.owners.of[p] == "ghost",
                       what="the owner read")  # fmt: skip

        async def refusal() -> ReachError:
            msg = await nc.request(f"reach.route.{theirs}", b"", timeout=2)
            err = from_reply(msg.headers, msg.data)
            assert err is not None and err.code == "OVERLOADED"
            return err

        async def not_mine(msg: Any) -> None:
            await nc.publish(msg.reply, b"", headers={"Reach-Forward": "not_owner"})

        former = await nc.subscribe("reach.forward.ghost.>", cb=not_mine)
        await flush_subscriptions(nc)
        assert (await refusal()).retry_after_ms == 100
        assert (forwards(broker, "not_owner"), forwards(broker, "timeout")) == (1, 0)
        await former.unsubscribe()

        await ghost.hand_back(p)
        await broker.forwarder.owners.read()
        assert (broker.forwarder.owners.of[p], broker.forwarder.owners.freed) == (None, {p})
        assert (await refusal()).retry_after_ms == 100

        await nc.jetstream().publish(f"$KV.{PARTITIONS_BUCKET}.{p}", b"",
                                     headers={"KV-Operation": "PURGE"})  # fmt: skip
        await broker.forwarder.owners.read()
        assert (broker.forwarder.owners.of[p], broker.forwarder.owners.freed) == (None, set())
        assert (await refusal()).retry_after_ms == 2000  # lease_ttl_s 6.0 / 3
        assert forwards(broker, "no_owner") == 2
        assert sorted(broker.tables.book.epochs) == [0, 1, 2, 3]  # it took none of them
    finally:
        await ghost.stop()


async def wait_gone(nc: NATS, broker: Broker) -> None:
    """Wait until the server has let go of a closed broker's subscriptions (a request sent
    before that would be lost with the connection, as any in flight to a process that
    dies)."""
    deadline = time.monotonic() + 10
    while True:
        try:
            await nc.request(f"reach.forward.{broker.forwarder.token}.x", b"", timeout=1)
        except NoRespondersError:
            return
        except NatsTimeoutError:
            pass
        assert time.monotonic() < deadline, "the server kept the closed broker's subscriptions"


async def kept_agent(pair: tuple[Broker, Broker], broker: Broker, agents: Any, cap: str) -> str:
    """A worker of ``cap`` in one of ``broker``'s partitions, healthy there: its id."""
    agent_id = next(f"kept-{i}" for i in range(1000)
                    if partition(f"kept-{i}", P) in broker.tables.book.epochs)  # fmt: skip
    await agents(worker(agent_id, cap))
    await wait_for(lambda: held_healthy(pair, agent_id))
    return agent_id


async def test_a_gone_owners_successor_stands_in_until_its_lease_lapses(
    broker_factory: BrokerFactory, agents: Any, nc: NATS
) -> None:
    """The capability's owner loses its connection (as in a crash: nothing handed back):
    the server has no responder for it, so the other broker stands in at once instead of
    refusing until the lease lapses; then it owns the partition."""
    cap = "standin.cap"
    pair = await two_brokers(broker_factory, fleet__lease_ttl_s=3.0)
    owner, other = owner_and_other(pair, cap)
    await kept_agent(pair, other, agents, cap)
    await wait_owners_read(pair, cap)
    await owner.nc.close()  # its subscriptions gone with it, its leases left to lapse
    await wait_gone(nc, owner)
    answered = 0
    deadline = time.monotonic() + 20  # the lease lapses in 3 s, taken within a round more
    while not other.shares.owns_all():
        assert time.monotonic() < deadline, "the other broker never took the partitions"
        msg = await nc.request(f"reach.route.{cap}", b"", timeout=2)
        assert from_reply(msg.headers, msg.data) is None
        answered += 1
        await asyncio.sleep(0.05)
    # Every request answered; those before the other broker held the capability's partition
    # by standing in (the last few may fall between its taking that partition and the rest).
    assert answered > 0 and forwards(other, "stand_in") >= 1
    assert forwards(other, "no_owner") == 0


async def test_a_gone_owners_lapsed_lease_is_stood_in_for_until_a_broker_takes_it(
    broker_factory: BrokerFactory, agents: Any, nc: NATS
) -> None:
    """A gone owner's leases lapse one by one (as they were renewed): the other broker reads
    the capability's lapsed while the owner still holds others. Nobody holds the partition,
    and the other broker is not alone: it asks the lease's last holder, finds it gone and
    stands in, rather than refusing for a third of the lease (a CI run of the test above)."""
    cap = "lapsed.cap"
    # A lease of 60 s: the gone owner's presence counts for as long, so the other broker
    # keeps its fair half and takes nothing while the test runs.
    pair = await two_brokers(broker_factory, fleet__lease_ttl_s=60.0)
    owner, other = owner_and_other(pair, cap)
    agent_id = await kept_agent(pair, other, agents, cap)
    owners = other.forwarder.owners
    await owners.read()
    p = partition(cap, P)
    assert owners.of[p] == owner.forwarder.token
    await owner.nc.close()
    await wait_gone(nc, owner)
    await nc.jetstream().publish(f"$KV.{PARTITIONS_BUCKET}.{p}", b"",
                                 headers={"KV-Operation": "PURGE"})  # fmt: skip
    await owners.read()
    assert (owners.of[p], owners.lapsed[p], owners.freed) == (None, owner.forwarder.token, set())
    assert not owners.alone(other.forwarder.token)  # the owner's other leases still read

    msg = await nc.request(f"reach.route.{cap}", b"", timeout=2)
    assert from_reply(msg.headers, msg.data) is None
    reply = schema.route_reply_decoder.decode(msg.data)
    assert [c.agent_id for c in reply.candidates] == [agent_id]
    assert (forwards(other, "stand_in"), forwards(other, "no_owner")) == (1, 0)
    assert p not in other.tables.book.epochs  # stood in for, not taken
