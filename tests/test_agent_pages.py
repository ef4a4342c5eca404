"""``<p>.agents.<partition>``: the fleet paged through its partitions' owners, and ``reach
agents`` (the real CLI process) listing 50,000 simulated agents through it."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable

from nats.aio.client import Client as NATS

from reach_agent.client.listing import agent_pages
from reach_agent.wire import schema
from reach_agent.wire.errors import from_reply
from reach_agent.wire.subjects import Subjects
from reach_broker.broker import Broker
from reach_broker.service.listing import PAGE_BYTES

from .conftest import BrokerFactory, wait_for
from .test_cli import QUIET, reach

S = Subjects()


LONG = [f"capability-{i:02d}-of-a-simulated-agent-listed-by-reach-agents" for i in range(3)]
"""Three long capability names: 50,000 views of agents with them pass 8 MB."""


async def simulate(
    nc: NATS, broker: Broker, n: int, caps: Callable[[int], list[str]] = lambda i: ["sim"]
) -> None:
    """``n`` agents announced straight on NATS (no agent processes), known to ``broker``."""
    for start in range(0, n, 500):
        batch = [f"sim-{i:05d}" for i in range(start, min(start + 500, n))]
        replies = await asyncio.gather(*(
            nc.request(S.announce(a), schema.encoder.encode(schema.Announce(
                agent_id=a, capabilities=caps(i), max_concurrency=4,
                heartbeat_interval_ms=600_000)), timeout=30)
            for i, a in enumerate(batch, start)
        ))  # fmt: skip
        assert all(r.headers is None for r in replies)
    await wait_for(lambda: len(broker.registry.agents) == n, timeout=30)


async def test_reach_agents_pages_through_50000_agents(
    nc: NATS, broker_factory: BrokerFactory
) -> None:
    broker = await broker_factory(**QUIET, detection__suspect_after=1000)
    await simulate(nc, broker, 50_000, lambda i: LONG)

    code, out, err = await reach("agents", "--json", "-s", broker.cfg.nats.url, limit_s=120)
    assert (code, err) == (0, "")
    ids = [v["agent_id"] for v in json.loads(out)]
    assert len(ids) == 50_000
    assert len(set(ids)) == 50_000
    assert ids == sorted(ids)

    # Every page stays bounded, whatever the limit asked; the one-reply list refuses clearly.
    sizes, agents, p, cursor = [], 0, 0, None
    while True:
        body = schema.encoder.encode(schema.AgentsRequest(limit=5000, cursor=cursor))
        msg = await nc.request(S.agent_page(p), body, timeout=10)
        assert msg.headers is None
        sizes.append(len(msg.data))
        page = schema.agents_page_decoder.decode(msg.data)
        agents += len(page.agents)
        if page.cursor is None:
            break
        cursor = page.cursor
        p = int(cursor.split(".")[0])
    assert agents == 50_000
    assert max(sizes) <= PAGE_BYTES + 4096
    msg = await nc.request(S.agents, b"{}", timeout=30)
    err = from_reply(msg.headers, msg.data)
    assert err is not None and err.code == "INVALID_REQUEST"
    assert "50000 agents make a" in err.message and "page through reach.agents.0" in err.message


async def test_pages_filter_and_only_owners_answer(nc: NATS, broker_factory: BrokerFactory) -> None:
    brokers = [await broker_factory(**QUIET), await broker_factory(**QUIET)]
    ids = await settled(nc, brokers, 300, lambda i: ["odd" if i % 2 else "even"])

    pages = [pg async for pg in agent_pages(nc, S, capability="odd", limit=7)]
    odd = sorted(a.agent_id for pg in pages for a in pg.agents)
    assert odd == ids[1::2]
    for pg in pages:
        owner = owner_of(brokers, pg.partition)
        assert owner is not None and pg.broker_id == owner.broker_id
    assert [pg.partition for pg in pages] == sorted(pg.partition for pg in pages)
    assert {pg.partition for pg in pages} == set(range(brokers[0].cfg.fleet.partitions))

    # A broker that does not own a partition stays silent on its subject.
    silent = [(b, p) for b in brokers for p in range(b.cfg.fleet.partitions)
              if p not in b.partitions.held]  # fmt: skip
    assert silent
    for b, p in silent:
        assert b.pages.page(S.agent_page(p), b"{}") is None
        owner = owner_of(brokers, p)
        assert owner is not None and owner.pages.page(S.agent_page(p), b"{}") is not None

    async def refusal(subject: str, body: bytes) -> str:
        msg = await nc.request(subject, body, timeout=2)
        err = from_reply(msg.headers, msg.data)
        assert err is not None and err.code == "INVALID_REQUEST"
        return err.message

    assert "not a partition of this fleet (0 to 31)" in await refusal("reach.agents.32", b"{}")
    assert "limit 5001 is above" in await refusal(S.agent_page(1), b'{"limit": 5001}')
    assert "continues partition 2: ask reach.agents.2, not reach.agents.1" in await refusal(
        S.agent_page(1), b'{"cursor": "2.x"}'
    )
    assert "is not a cursor of this fleet" in await refusal(S.agent_page(1), b'{"cursor": "x"}')
    assert "page with limit and cursor on reach.agents.0" in await refusal(
        S.agents, b'{"limit": 10}'
    )


async def test_with_the_route_tables_off_a_lone_broker_answers_every_partition(
    nc: NATS, broker_factory: BrokerFactory
) -> None:
    """(Without the tables' leases it owns nothing by lease, and answers for every one.)"""
    broker = await broker_factory(**QUIET, fleet__tables=False)
    await simulate(nc, broker, 40)
    pages = [pg async for pg in agent_pages(nc, S, limit=100)]
    assert len(pages) == broker.cfg.fleet.partitions
    assert sorted(a.agent_id for pg in pages for a in pg.agents) == [
        f"sim-{i:05d}" for i in range(40)
    ]


async def test_two_brokers_each_page_comes_from_its_partitions_owner(
    nc: NATS, broker_factory: BrokerFactory
) -> None:
    """Whichever broker owns which partitions (one all of them, or each a share when ingest
    is partitioned), each page comes from its partition's owner and the walk lists the whole
    fleet once, through the real CLI too."""
    brokers = [await broker_factory(**QUIET), await broker_factory(**QUIET)]
    ids = await settled(nc, brokers, 300, lambda i: ["sim"])
    pages = [pg async for pg in agent_pages(nc, S, limit=50)]
    for pg in pages:
        owner = owner_of(brokers, pg.partition)
        assert owner is not None and pg.broker_id == owner.broker_id
    assert sorted(a.agent_id for pg in pages for a in pg.agents) == ids
    code, out, err = await reach("agents", "--json", "-s", brokers[0].cfg.nats.url)
    assert (code, err) == (0, "")
    assert [v["agent_id"] for v in json.loads(out)] == ids


def owner_of(brokers: list[Broker], p: int) -> Broker | None:
    """The one broker leasing partition ``p`` (None: none, or more than one)."""
    owners = [b for b in brokers if p in b.partitions.held]
    return owners[0] if len(owners) == 1 else None


async def settled(
    nc: NATS, brokers: list[Broker], n: int, caps: Callable[[int], list[str]]
) -> list[str]:
    """``n`` agents announced straight on NATS once every partition has one owner, and held
    by the owner of their partition (every broker holds them all unless ingest is
    partitioned); their ids."""
    partitions = brokers[0].cfg.fleet.partitions
    await wait_for(lambda: all(owner_of(brokers, p) is not None for p in range(partitions)),
                   what="one owner for every partition")  # fmt: skip
    ids = [f"sim-{i:05d}" for i in range(n)]
    replies = await asyncio.gather(*(
        nc.request(S.announce(a), schema.encoder.encode(schema.Announce(
            agent_id=a, capabilities=caps(i), max_concurrency=4,
            heartbeat_interval_ms=600_000)), timeout=10)
        for i, a in enumerate(ids)
    ))  # fmt: skip
    assert all(r.headers is None for r in replies)
    listing = brokers[0].registry.listing

    def held_by_owners() -> bool:
        owners = [owner_of(brokers, listing.partition_of(a)) for a in ids]
        return all(
            o is not None and a in o.registry.agents for a, o in zip(ids, owners, strict=True)
        )

    await wait_for(held_by_owners, what="every agent at its partition's owner")
    return ids
