"""``jetstream.roundtrip.round_trip`` against a real server through a TCP proxy: a round
trip whose connection is replaced while it waits answers on the new one."""

from __future__ import annotations

import asyncio
from typing import Any

import nats

from jetstream.roundtrip import round_trip
from loadtest.tcpproxy import TcpProxy
from reach_broker.cluster.natsserver import NatsServer

from .conftest import wait_for


async def test_a_round_trip_across_a_reconnect_is_answered_on_the_new_connection(
    nats_server: NatsServer,
) -> None:
    """The PING goes out into a stalled link, which then drops; the client reconnects at
    once. nats-py's reconnect forgets the PONG futures of the old connection, so the round
    trip waited out its whole timeout and raised ``FlushTimeoutError`` (nemesis seed 61: a
    takeover's subscription flush waited 10 s after a reconnect of 0.5 s, and the broker
    dropped the partitions). It is now asked again on the new connection."""
    reconnected = asyncio.Event()

    async def on_reconnect() -> None:
        reconnected.set()

    async with TcpProxy.to_url(nats_server.url) as proxy:
        nc: Any = await nats.connect(proxy.url, reconnect_time_wait=0.05,
                                     max_reconnect_attempts=-1,
                                     reconnected_cb=on_reconnect)  # fmt: skip
        try:
            await round_trip(nc, 2.0)  # the link works
            await proxy.blackhole()
            held = proxy.held
            waiting = asyncio.create_task(round_trip(nc, 30.0))
            await wait_for(lambda: proxy.held > held, what="the PING held by the link")
            await proxy.cut()
            await proxy.restore()
            await asyncio.wait_for(reconnected.wait(), 10)
            # On the parent the PONG future was dropped with the old connection: the round
            # trip raised FlushTimeoutError after its 30 s.
            await asyncio.wait_for(waiting, 10)
            assert nc.is_connected
        finally:
            await nc.close()
