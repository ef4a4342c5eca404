"""Reading the audit trail (jetstream/audit.py) on a real server: history, then live, with
neither a gap nor a duplicate at the seam; the last n; an empty trail; no stream; no
JetStream."""

from __future__ import annotations

import asyncio

import nats
import pytest
from nats.aio.client import Client as NATS

from jetstream import audit
from jetstream.names import AUDIT_STREAM
from jetstream.provision import load_definitions, provision
from reach_agent.wire.subjects import Subjects
from reach_broker.cluster.natsserver import NatsServer

from .conftest import wait_for

SUBJECTS = Subjects()


def audit_definition(**overrides: object) -> list[dict[str, object]]:
    """The REACH_AUDIT definition alone (``overrides`` applied), for ``provision``."""
    defs = load_definitions(overrides={AUDIT_STREAM: overrides})
    return [d for d in defs if d["name"] == AUDIT_STREAM]


AUDIT = audit_definition()


async def publish(nc: NATS, *names: str) -> None:
    js = nc.jetstream()
    for name in names:
        await js.publish(SUBJECTS.event("state", name), name.encode())


class Kept:
    """A follow callback that keeps what it is handed."""

    def __init__(self) -> None:
        self.events: list[audit.StoredEvent] = []

    async def __call__(self, event: audit.StoredEvent) -> None:
        self.events.append(event)

    @property
    def data(self) -> list[bytes]:
        return [e.data for e in self.events]


async def test_follow_hands_over_the_history_then_live_events_in_order(nc: NATS) -> None:
    await provision(nc, AUDIT)
    await publish(nc, "e1", "e2", "e3")
    kept = Kept()
    follow = await audit.follow_events(nc, kept, subjects=SUBJECTS, timeout_s=2)
    try:
        assert await asyncio.wait_for(follow.until_caught_up(2), 10)
        assert kept.data == [b"e1", b"e2", b"e3"]
        assert [(e.seq, e.pending) for e in kept.events] == [(1, 2), (2, 1), (3, 0)]
        assert kept.events[0].subject == "reach.event.state.e1"
        await publish(nc, "e4", "e5")
        await wait_for(lambda: len(kept.events) == 5, 10, what="two live events")
    finally:
        await follow.stop()
    assert kept.data == [b"e1", b"e2", b"e3", b"e4", b"e5"]
    assert [e.seq for e in kept.events] == [1, 2, 3, 4, 5]


async def test_follow_started_while_events_are_stored_misses_and_repeats_none(nc: NATS) -> None:
    await provision(nc, AUDIT)
    total = 300
    started = asyncio.Event()

    async def writer() -> None:
        for i in range(total):
            await publish(nc, f"w{i}")
            if i == total // 3:
                started.set()

    task = asyncio.create_task(writer())
    await asyncio.wait_for(started.wait(), 10)
    kept = Kept()
    follow = await audit.follow_events(nc, kept, subjects=SUBJECTS, timeout_s=2)
    try:
        await asyncio.wait_for(task, 30)
        await publish(nc, "end")  # delivered in stream order: after any repeat of an earlier one
        await wait_for(lambda: kept.data[-1:] == [b"end"], 20, what=f"{total} events and the end")
    finally:
        await follow.stop()
    assert [e.seq for e in kept.events] == list(range(1, total + 2))
    assert kept.data == [f"w{i}".encode() for i in range(total)] + [b"end"]


async def test_follow_last_n_then_live_and_read_of_the_last_n(nc: NATS) -> None:
    await provision(nc, AUDIT)
    await publish(nc, "a", "b", "c", "d")
    kept = Kept()
    follow = await audit.follow_events(nc, kept, subjects=SUBJECTS, last=2, timeout_s=2)
    try:
        assert await asyncio.wait_for(follow.until_caught_up(2), 10)
        assert kept.data == [b"c", b"d"]
        await publish(nc, "e")
        await wait_for(lambda: len(kept.events) == 3, 10, what="the live event")
    finally:
        await follow.stop()
    assert kept.data == [b"c", b"d", b"e"]
    read = await audit.read_events(nc, subjects=SUBJECTS, last=3, timeout_s=2)
    assert [e.data for e in read] == [b"c", b"d", b"e"]
    assert [e.data for e in await audit.read_events(nc, subjects=SUBJECTS, limit=2)] == [
        b"a",
        b"b",
    ]
    assert await audit.read_events(nc, subjects=SUBJECTS, last=0, timeout_s=2) == []


async def test_follow_on_an_empty_trail_is_caught_up_at_once_and_stays_live(nc: NATS) -> None:
    # Purgeable here, so each round starts empty: new, then emptied (first_seq > last_seq).
    await provision(nc, audit_definition(deny_purge=False))
    for n, start in enumerate(({"last": 8}, {"last": 0}, {"since_s": 3600.0}, {}), 1):
        kept = Kept()
        follow = await audit.follow_events(nc, kept, subjects=SUBJECTS, timeout_s=2, **start)
        try:
            assert follow.caught_up.is_set(), start
            await publish(nc, "first")
            await wait_for(lambda k=kept: k.data == [b"first"], 10, what=f"live event {start}")
        finally:
            await follow.stop()
        assert [(e.seq, e.pending) for e in kept.events] == [(n, 0)], start
        await nc.jetstream().purge_stream(AUDIT_STREAM)


async def test_without_the_stream_or_jetstream_the_follow_says_which(
    nc: NATS, nats_server: NatsServer
) -> None:
    async def ignore(event: audit.StoredEvent) -> None:
        raise AssertionError(event)

    with pytest.raises(audit.NoAuditStream, match=f"stream {AUDIT_STREAM} not found"):
        await audit.follow_events(nc, ignore, subjects=SUBJECTS, since_s=60, timeout_s=2)
    # The system account of configs/nats-server.conf has no JetStream.
    sys_nc = await nats.connect(nats_server.url, user="sys", password=nats_server.system_password)
    try:
        with pytest.raises(audit.NoJetStream):
            await audit.follow_events(sys_nc, ignore, subjects=SUBJECTS, timeout_s=1)
        live = Kept()
        follow = await audit.live_events(sys_nc, live, subjects=SUBJECTS)
        await sys_nc.flush()
        await sys_nc.publish(SUBJECTS.event("left", "x"), b"live")
        await wait_for(lambda: live.data == [b"live"], 10, what="the live event")
        await follow.stop()
        assert live.events[0] == audit.StoredEvent("reach.event.left.x", b"live", 0, None, 0)
    finally:
        await sys_nc.close()
