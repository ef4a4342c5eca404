"""The followers that start at a point in time — the broker's claims follower
(``jetstream.claims.follow``, which its releases stand on) and the audit trail's
``follow_events(since_s=…)`` — go on delivering after nats-py recreates their ordered
consumer (here: the server lost it). nats-py 2.16 recreates it by start sequence but keeps
the first start time, which the server refuses (10094), and the follower went silent for
good (found by loadtest.nemesis: a broker stopped learning claims after a NATS node was
killed, so an agent declared offline kept its requests claimed)."""

from __future__ import annotations

import asyncio
import datetime as dt
from typing import Any

import pytest
from nats.aio.client import Client as NATS

from jetstream import audit, claims
from jetstream.names import AUDIT_STREAM, CLAIMS_STREAM
from jetstream.ordered import start_at
from jetstream.provision import load_definitions, provision
from reach_agent.wire.subjects import Subjects

from .conftest import wait_for

SUBJECTS = Subjects()

pytestmark = pytest.mark.slow


async def drop_consumers(nc: NATS, stream: str) -> int:
    """Delete every consumer of ``stream`` (what a server that lost them does to us)."""
    js = nc.jetstream()
    infos = await js.consumers_info(stream)
    for info in infos:
        await js.delete_consumer(stream, info.name)
    return len(infos)


async def test_followers_from_a_time_resume_after_their_consumer_is_recreated(nc: NATS) -> None:
    await provision(nc, [d for d in load_definitions()
                         if d["name"] in (AUDIT_STREAM, CLAIMS_STREAM)])  # fmt: skip
    js = nc.jetstream()
    await js.publish(SUBJECTS.event("state", "before"), b"before")
    await js.publish("$KV.reach_claims.before", b"{}")
    events: list[bytes] = []
    stored: list[str] = []

    async def on_event(event: audit.StoredEvent) -> None:
        events.append(event.data)

    async def on_claim(key: str, revision: int, data: bytes) -> None:
        stored.append(key)

    follow = await audit.follow_events(nc, on_event, subjects=SUBJECTS, since_s=3600.0)
    sub: Any = await claims.follow(nc, on_claim, since=0.0)
    try:
        await wait_for(lambda: events == [b"before"] and stored == ["before"], 10,
                       what="the history")  # fmt: skip
        assert await drop_consumers(nc, AUDIT_STREAM) == 1
        assert await drop_consumers(nc, CLAIMS_STREAM) == 1
        await js.publish(SUBJECTS.event("state", "after"), b"after")
        await js.publish("$KV.reach_claims.after", b"{}")
        # nats-py notices the lost consumer by its missing idle heartbeats (2 x 5 s)
        await wait_for(lambda: events == [b"before", b"after"] and stored == ["before", "after"],
                       40, what="what was stored after the consumers were lost")  # fmt: skip
    finally:
        await follow.stop()
        await sub.unsubscribe()


async def test_a_start_time_becomes_the_first_sequence_stored_at_or_after_it(nc: NATS) -> None:
    await provision(nc, [d for d in load_definitions() if d["name"] == AUDIT_STREAM])
    js = nc.jetstream()
    await js.publish(SUBJECTS.event("state", "e1"), b"e1")
    await asyncio.sleep(0.2)
    between = dt.datetime.now(dt.UTC)
    await asyncio.sleep(0.2)
    await js.publish(SUBJECTS.event("state", "e2"), b"e2")
    await asyncio.sleep(0.2)
    later = dt.datetime.now(dt.UTC)
    starts = [await start_at(js, AUDIT_STREAM, SUBJECTS.all_events, when)
              for when in (between - dt.timedelta(hours=1), between, later)]  # fmt: skip
    assert [(c.deliver_policy, c.opt_start_seq, c.opt_start_time) for c in starts] == [
        ("by_start_sequence", 1, None), ("by_start_sequence", 2, None),
        ("by_start_sequence", 3, None),
    ]  # fmt: skip
    assert await js.consumers_info(AUDIT_STREAM) == []  # the throwaway consumers are gone
