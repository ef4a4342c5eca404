"""The fault helpers the HA tests stand on, against real servers: the N-node cluster
(tests/cluster.py) forms, keeps an R3 stream through the SIGKILL of its leader and takes a
restarted node back; the TCP proxy (loadtest/tcpproxy.py) forwards a nats-py connection, and
its cut and blackhole do to that connection what a broken and a partitioned link do."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import nats
import pytest
from nats.aio.client import Client as NATS

from loadtest.tcpproxy import TcpProxy
from reach_agent.connection import flush_subscriptions
from reach_broker.cluster.natsserver import NatsServer

from .cluster import add_stream, nats_cluster
from .conftest import wait_for

# --- the cluster ----------------------------------------------------------------------------


@pytest.mark.slow
async def test_three_nodes_form_one_cluster(tmp_path: Path) -> None:
    async with nats_cluster(tmp_path / "cluster", nodes=3) as cluster:
        assert cluster.names == ["n1", "n2", "n3"]
        assert len(set(cluster.urls)) == 3
        assert all(cluster.running(name) for name in cluster.names)
        assert await cluster.wait_meta_leader() in cluster.names
        # routed: a message published on n3 reaches a subscriber on n1
        conns = [await nats.connect(url, name=f"form-{i}") for i, url in enumerate(cluster.urls)]
        try:
            sub = await conns[0].subscribe("helpers.form.routed")
            await flush_subscriptions(conns[0])
            # the SUB reaches n3 over a route a little later: publish until one arrives
            for attempt in range(50):
                await conns[2].publish("helpers.form.routed", b"%d" % attempt)
                try:
                    msg = await sub.next_msg(timeout=0.1)
                except TimeoutError:
                    continue
                assert msg.data == b"%d" % attempt
                break
            else:
                raise AssertionError("nothing published on n3 reached n1 within 5 s")
        finally:
            for nc in conns:
                await nc.close()


@pytest.mark.slow
async def test_r3_stream_survives_the_sigkill_of_its_leader(tmp_path: Path) -> None:
    async with nats_cluster(tmp_path / "cluster", nodes=3) as cluster:
        nc = await nats.connect(cluster.urls, name="failover", reconnect_time_wait=0.1,
                                max_reconnect_attempts=-1)  # fmt: skip
        try:
            js = nc.jetstream(timeout=5)
            await add_stream(js, name="HELPERS_FAILOVER", subjects=["helpers.failover.>"],
                             num_replicas=3)  # fmt: skip
            for i in range(50):
                ack = await js.publish(f"helpers.failover.{i}", b"%d" % i)
                assert ack.seq == i + 1
            leader = await cluster.wait_stream_leader(nc, "HELPERS_FAILOVER", current=True)
            assert await cluster.stream_leader(nc, "HELPERS_FAILOVER") == leader

            await cluster.kill(leader)
            assert not cluster.running(leader)
            successor = await cluster.wait_stream_leader(nc, "HELPERS_FAILOVER", not_on={leader})
            assert successor in set(cluster.names) - {leader}
            # the successor answers STREAM.INFO before it takes publishes: sent again on no
            # responders, under one Nats-Msg-Id so that it is stored once
            ack = await cluster.publish(nc, "helpers.failover.50", b"50", msg_id="failover-50")
            assert (ack.stream, ack.seq) == ("HELPERS_FAILOVER", 51)
            info = await js.stream_info("HELPERS_FAILOVER")
            assert (info.state.first_seq, info.state.last_seq, info.state.messages) == (1, 51, 51)
            for seq in (1, 25, 50, 51):
                msg = await js.get_msg("HELPERS_FAILOVER", seq)
                assert (msg.subject, msg.data) == (f"helpers.failover.{seq - 1}", b"%d" % (seq - 1))

            # back on its ports and store: it rejoins and catches up
            old_url = cluster.url(leader)
            await cluster.restart(leader)
            assert cluster.url(leader) == old_url
            info = await cluster.wait_stream_info(nc, "HELPERS_FAILOVER", current=True)
            assert info.cluster is not None
            peers = {info.cluster.leader} | {p.name for p in info.cluster.replicas or []}
            assert peers == set(cluster.names)
            assert all(p.current for p in info.cluster.replicas or [])
            assert (info.state.first_seq, info.state.last_seq, info.state.messages) == (1, 51, 51)
            # its own store, not the leader's answer: current is "in its log", applied a moment
            # later
            state = await cluster.wait_stored(leader, "HELPERS_FAILOVER", 51)
            assert (state["first_seq"], state["last_seq"], state["messages"]) == (1, 51, 51)
            # STREAM.INFO asked of the rejoined server: the leader answers, through its routes
            direct = await nats.connect(old_url, name="rejoined")
            try:
                assert (
                    await direct.jetstream().stream_info("HELPERS_FAILOVER")
                ).state.messages == 51
            finally:
                await direct.close()
        finally:
            await nc.close()


# --- the TCP proxy --------------------------------------------------------------------------


class Watched:
    """A nats-py connection through the proxy, with its disconnect/reconnect callbacks."""

    def __init__(self) -> None:
        self.disconnected = asyncio.Event()
        self.reconnected = asyncio.Event()
        self.errors: list[Exception] = []
        self.nc = NATS()

    async def connect(self, url: str, **options: Any) -> NATS:
        async def on_disconnect() -> None:
            self.disconnected.set()

        async def on_reconnect() -> None:
            self.reconnected.set()

        async def on_error(exc: Exception) -> None:
            self.errors.append(exc)  # e.g. the refused reconnects of a cut

        await self.nc.connect(url, name="proxied", disconnected_cb=on_disconnect,
                              reconnected_cb=on_reconnect, error_cb=on_error,
                              reconnect_time_wait=0.05, max_reconnect_attempts=-1,
                              **options)  # fmt: skip
        return self.nc


@pytest.fixture
async def proxy(nats_server: NatsServer) -> AsyncIterator[TcpProxy]:
    async with TcpProxy.to_url(nats_server.url) as p:
        yield p


@pytest.fixture
async def watched() -> AsyncIterator[Watched]:
    w = Watched()
    try:
        yield w
    finally:
        await w.nc.close()


async def round_trip(proxied: NATS, direct: NATS, subject: str) -> bytes:
    """A request from the proxied connection to a responder on a direct one."""

    async def echo(msg: Any) -> None:
        await msg.respond(b"echo:" + msg.data)

    sub = await direct.subscribe(subject, cb=echo)
    await flush_subscriptions(direct)
    try:
        reply = await proxied.request(subject, b"ping", timeout=2)
        return bytes(reply.data)
    finally:
        await sub.unsubscribe()


async def test_proxy_forwards_a_nats_connection(
    proxy: TcpProxy, watched: Watched, nc: NATS
) -> None:
    proxied = await watched.connect(proxy.url)
    assert (proxy.accepted, proxy.connections) == (1, 1)
    assert await round_trip(proxied, nc, "helpers.proxy.forward") == b"echo:ping"
    sub = await proxied.subscribe("helpers.proxy.forward.down")
    await flush_subscriptions(proxied)
    await nc.publish("helpers.proxy.forward.down", b"x" * 200_000)  # several chunks
    msg = await sub.next_msg(timeout=2)
    assert msg.data == b"x" * 200_000


async def test_a_cut_disconnects_and_a_restore_reconnects(
    proxy: TcpProxy, watched: Watched, nc: NATS
) -> None:
    proxied = await watched.connect(proxy.url)
    await proxy.cut()
    await asyncio.wait_for(watched.disconnected.wait(), 5)
    await wait_for(lambda: any(isinstance(e, ConnectionRefusedError) for e in watched.errors),
                   what="a reconnect refused while cut")  # fmt: skip
    assert proxy.state == "cut"
    assert not proxied.is_connected
    assert proxy.connections == 0

    await proxy.restore()
    await asyncio.wait_for(watched.reconnected.wait(), 5)
    assert proxied.is_connected
    assert await round_trip(proxied, nc, "helpers.proxy.cut") == b"echo:ping"


async def test_a_short_blackhole_holds_bytes_and_delivers_them_on_restore(
    proxy: TcpProxy, watched: Watched, nc: NATS
) -> None:
    proxied = await watched.connect(proxy.url, ping_interval=30)
    sub = await proxied.subscribe("helpers.proxy.held")
    await flush_subscriptions(proxied)
    await proxy.blackhole()
    await nc.publish("helpers.proxy.held", b"sent during the blackhole")
    await nc.flush()
    await wait_for(lambda: proxy.held >= 1, what="bytes held by the blackhole")
    assert sub.pending_msgs == 0  # held in the proxy, so not delivered
    assert proxy.connections == 1

    await proxy.restore()
    msg = await sub.next_msg(timeout=2)
    assert msg.data == b"sent during the blackhole"
    assert not watched.disconnected.is_set()
    assert await round_trip(proxied, nc, "helpers.proxy.held.after") == b"echo:ping"


async def test_a_long_blackhole_is_seen_by_pings_and_healed_by_restore(
    proxy: TcpProxy, watched: Watched, nc: NATS
) -> None:
    proxied = await watched.connect(proxy.url, ping_interval=0.2, max_outstanding_pings=2,
                                    connect_timeout=0.5)  # fmt: skip
    await proxy.blackhole()
    await asyncio.wait_for(watched.disconnected.wait(), 5)  # stale: pings unanswered
    await wait_for(lambda: any(isinstance(e, ConnectionRefusedError) for e in watched.errors),
                   what="a reconnect refused during the blackhole")  # fmt: skip
    assert not watched.reconnected.is_set()

    await proxy.restore()
    await asyncio.wait_for(watched.reconnected.wait(), 10)
    assert proxied.is_connected
    assert await round_trip(proxied, nc, "helpers.proxy.stale") == b"echo:ping"
