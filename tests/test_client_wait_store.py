"""``Client.wait`` when the ack store cannot answer: ``STORE_UNAVAILABLE`` (retryable, the
store named), never a raw nats-py exception and never a ``TIMEOUT`` that blames the agent;
the connection hears again as soon as the store answers; and a record stored while the
waiter's connection was down answers the wait once it is back."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, Literal

import msgspec
import pytest
from nats.aio.client import Client as NATS

import reach_agent
from jetstream.acks import ack_msg_id, publish_record
from jetstream.claims import ClaimStore, claim_key
from jetstream.names import CLAIMS_STREAM
from loadtest.tcpproxy import TcpProxy
from reach_agent.connection import flush_subscriptions
from reach_agent.wire import schema
from reach_agent.wire.errors import StoreUnavailable
from reach_agent.wire.subjects import Subjects
from reach_broker.cluster.natsserver import NatsServer

from .conftest import wait_for


async def test_wait_on_a_server_without_jetstream_is_store_unavailable(tmp_path: Path) -> None:
    """No -js: every JetStream API request meets "no responders". The wait reads again until
    its timeout, then says it could not tell (not ``TIMEOUT``, which would blame the agent)."""
    with NatsServer(store_dir=tmp_path / "nats", config=None, config_store=True) as server:
        async with reach_agent.Client(server.url) as client:
            with pytest.raises(StoreUnavailable) as err:
                await asyncio.wait_for(client.wait("r-nojs", timeout=1.5), 5)
    assert err.value.code == "STORE_UNAVAILABLE"
    assert err.value.retryable is True
    assert err.value.retry_after_ms == 1000
    assert err.value.message == (
        "REACH_ACKS could not be read for request_id 'r-nojs' (ServiceUnavailableError: "
        "nats: ServiceUnavailableError: code=None err_code=None description='None'): "
        "wait for it again"
    )


async def test_wait_on_a_closed_connection_is_store_unavailable(nats_server: NatsServer) -> None:
    async with reach_agent.Client(nats_server.url) as client:
        await client.nc.close()
        with pytest.raises(StoreUnavailable) as err:
            await asyncio.wait_for(client.wait("r-closed", timeout=5), 4)
    assert err.value.code == "STORE_UNAVAILABLE"
    assert err.value.message == (
        "REACH_ACKS could not be read for request_id 'r-closed' (ConnectionClosedError: "
        "nats: connection closed): wait for it again"
    )


def frozen(pid: int) -> bool:
    """Whether every thread of ``pid`` is stopped: ``kill`` returns before a thread running
    on another core has stopped, and such a thread still answers a PING."""
    states = [(t / "stat").read_text().rsplit(")", 1)[1].split()[0]
              for t in Path(f"/proc/{pid}/task").iterdir()]  # fmt: skip
    return all(state == "T" for state in states)


@contextlib.asynccontextmanager
async def stopped(server: NatsServer) -> AsyncIterator[None]:
    """``server`` frozen (SIGSTOP: a node stopped, as loadtest.nemesis's ``node_stop``)
    inside the block, running again after it."""
    pid = server.pid
    assert pid is not None
    os.kill(pid, signal.SIGSTOP)
    try:
        await wait_for(lambda: frozen(pid), what=f"nats-server {pid} stopped")
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


async def store_by_a1(
    nc: NATS, rid: str, capability: str, *, result: bytes | None = None,
    error: dict[str, str] | None = None, at_ms: int = 1,
) -> str:  # fmt: skip
    """Agent a1's final record of ``rid`` stored in REACH_ACKS: ``completed`` with
    ``result``, or ``failed`` with ``error``; its message id (a new one, never a
    duplicate)."""
    state: Literal["completed", "failed"] = "failed" if error is not None else "completed"
    raw = msgspec.Raw(result) if result is not None else None
    record = schema.AckRecord(request_id=rid, agent_id="a1", capability=capability, state=state,
                              at_ms=at_ms, error=error, result=raw)  # fmt: skip
    msg_id = ack_msg_id("a1", rid, state)
    data = schema.encoder.encode(record)
    assert await publish_record(nc.jetstream(), Subjects().ack("a1", rid), msg_id, data) is False
    return msg_id


async def test_a_wait_cut_short_by_a_stopped_server_leaves_the_connection_hearing(
    provisioned: NatsServer, nc: NATS
) -> None:
    """A wait whose round trip timed out while the server was stopped (SIGSTOP: a node
    frozen, as loadtest.nemesis's ``node_stop``) is refused ``STORE_UNAVAILABLE``; once the
    server runs again the next submit is stored and its PubAck read, and a wait sees a
    record stored after. With nats-py 2.16's ``flush(timeout)`` the late PONG completed the
    flush's cancelled future and killed the connection's reader (InvalidStateError): the
    client heard nothing until its pings went stale, so this submit was refused
    ``STORE_UNAVAILABLE`` (its entry stored, its PubAck never read) and waits missed
    records already in the stream (loadtest.nemesis, caller c3, seed 8)."""
    rid = "r-after-stop"
    async with reach_agent.Client(provisioned.url) as client:
        async with stopped(provisioned):
            # agent_id given: no claim read, the round trip is the first thing to wait for
            with pytest.raises(StoreUnavailable) as err:
                await asyncio.wait_for(client.wait("r-stopped", timeout=1.5, agent_id="a1"), 5)
        assert err.value.message == (
            "REACH_ACKS could not be read for request_id 'r-stopped' (FlushTimeoutError: "
            "nats: flush timeout): wait for it again"
        )
        got = await asyncio.wait_for(client.submit("nemesis", {"n": 1}), 5)
        assert (got.duplicate, got.seq) == (False, 1)
        waiting = asyncio.create_task(client.wait(rid, timeout=5, agent_id="a1"))
        await store_by_a1(nc, rid, "nemesis", result=b'{"n":1}')
        done = await asyncio.wait_for(waiting, 6)
    assert (done.state, done.agent_id, done.result) == ("completed", "a1", {"n": 1})


async def test_a_record_heard_while_a_read_of_the_store_hangs_answers_the_wait(
    tmp_path: Path,
) -> None:
    """The store takes the wait's read and does not answer (a JetStream that cannot reply:
    here a subscriber to its API that never does); a record heard live meanwhile answers the
    wait at once. The read held it up: the whole wait, 1.5 s, went by in the read, and the
    wait said the store could not tell (nemesis seed 77: c1-000380's 1.4 s wait, a4's
    completed record heard 0.39 s before its end)."""
    rid = "r-heard"
    with NatsServer(store_dir=tmp_path / "nats", config=None, config_store=True) as server:
        async with reach_agent.Client(server.url) as client:
            mute = await client.nc.subscribe("$JS.API.>")  # takes the reads, answers none
            await flush_subscriptions(client.nc)
            waiting = asyncio.create_task(client.wait(rid, timeout=1.5, agent_id="a1"))
            await mute.next_msg(timeout=5)  # the wait's read is in flight
            record = schema.AckRecord(request_id=rid, agent_id="a1", capability="heard",
                                      state="completed", at_ms=1,
                                      result=msgspec.Raw(b'{"n":5}'))  # fmt: skip
            msg_id = ack_msg_id("a1", rid, "completed")
            await client.nc.publish(Subjects().ack("a1", rid), schema.encoder.encode(record),
                                    headers={"Nats-Msg-Id": msg_id})  # fmt: skip
            done = await asyncio.wait_for(waiting, 5)
    assert (done.agent_id, done.state, done.result) == ("a1", "completed", {"n": 5})


async def test_a_wait_begun_while_the_store_cannot_answer_waits_it_out(
    provisioned: NatsServer, nc: NATS, caplog: pytest.LogCaptureFixture
) -> None:
    """A wait whose first read of REACH_ACKS fails (the server stopped: a node frozen, a
    leader being elected) goes on listening and reading within its timeout, and the record
    stored once the server runs again answers it. It used to be refused
    ``STORE_UNAVAILABLE`` at the first failure (nemesis seed 44: 34 waits)."""
    caplog.set_level(logging.DEBUG, logger="jetstream.ackreads")
    rid = "r-rides-out"

    said = f"acks.reread_failed request_id={rid} "

    def failed() -> list[str]:
        return [m for r in caplog.records if (m := r.getMessage()).startswith(said)]

    async with reach_agent.Client(provisioned.url) as client:
        async with stopped(provisioned):
            waiting = asyncio.create_task(client.wait(rid, timeout=15, agent_id="a1"))
            await wait_for(lambda: failed() or waiting.done(), 5,
                           what="the wait's first read failed")  # fmt: skip
        try:
            assert waiting.done() is False  # (on the first failure it was refused)
            await store_by_a1(nc, rid, "later", result=b'{"n":4}')
            done = await asyncio.wait_for(waiting, 15)
        finally:
            waiting.cancel()
    assert (done.agent_id, done.state, done.result) == ("a1", "completed", {"n": 4})
    assert failed()[0] == (f"acks.reread_failed request_id={rid} error=FlushTimeoutError(): "
                           "listening on")  # fmt: skip


async def wait_then_cut(
    proxy: TcpProxy, client: reach_agent.Client, rid: str, wait_s: float
) -> asyncio.Task[schema.AckRecord]:
    """``client`` waiting for ``rid`` (by a1), its link cut once the wait's read of
    REACH_ACKS was answered. agent_id given: no claim read; no broker runs, so the first
    message the connection receives is that answer (nothing stored for ``rid``): from then
    on the wait has only its subscription to hear by."""
    heard = client.nc.stats["in_msgs"]
    waiting = asyncio.create_task(client.wait(rid, timeout=wait_s, agent_id="a1"))
    try:
        await wait_for(lambda: client.nc.stats["in_msgs"] > heard,
                       what="the wait's read of REACH_ACKS answered")  # fmt: skip
        await proxy.cut()
    except BaseException:
        waiting.cancel()
        raise
    return waiting


async def rejoin(proxy: TcpProxy, client: reach_agent.Client) -> None:
    """The link restored and ``client`` reconnected (once)."""
    await proxy.restore()
    await wait_for(lambda: client.nc.stats["reconnects"] == 1, what="the waiter reconnected")


async def test_a_record_stored_while_the_waiter_was_disconnected_answers_its_wait(
    provisioned: NatsServer, nc: NATS, caplog: pytest.LogCaptureFixture
) -> None:
    """The final record stored while the waiter's connection is down (its link cut) answers
    the wait once the connection is back, not a ``TIMEOUT``: the wait's core subscription
    hears nothing published meanwhile, the record is in REACH_ACKS all the same, and the
    wait reads the stream again (``ackreads.REREAD_S``). A wait that read the stream once
    and then only listened ran to its timeout."""
    caplog.set_level(logging.DEBUG, logger="jetstream.ackreads")
    rid = "r-while-away"
    async with TcpProxy.to_url(provisioned.url) as proxy:
        async with reach_agent.Client(proxy.url) as client:
            waiting = await wait_then_cut(proxy, client, rid, 10)
            try:
                await wait_for(lambda: not client.nc.is_connected, what="the waiter cut off")
                msg_id = await store_by_a1(nc, rid, "away", result=b'{"n":2}')
                assert client.nc.is_connected is False  # stored while the waiter was away
                await rejoin(proxy, client)
                done = await asyncio.wait_for(waiting, 12)
            finally:
                waiting.cancel()
            assert proxy.accepted == 2
    got = (done.request_id, done.agent_id, done.capability, done.state, done.at_ms, done.result,
           done.error)  # fmt: skip
    assert got == (rid, "a1", "away", "completed", 1, {"n": 2}, None)
    # counted: the record the subscription missed, found by a re-read
    said = [m for r in caplog.records if (m := r.getMessage()).startswith("acks.reread_found")]
    assert len(said) == 1
    assert said[0].startswith(f"acks.reread_found request_id={rid} msg_id={msg_id} rereads=")


async def test_a_wait_whose_reread_fails_goes_on_listening(
    provisioned: NatsServer, nc: NATS, caplog: pytest.LogCaptureFixture
) -> None:
    """A re-read that cannot reach the stream (the waiter's link cut for longer than the
    read's timeout) is logged and the wait goes on: the record published once the link is
    back answers it."""
    caplog.set_level(logging.DEBUG, logger="jetstream.ackreads")
    rid = "r-reread-failed"

    def failed() -> list[str]:
        return [m for r in caplog.records
                if (m := r.getMessage()).startswith("acks.reread_failed")]  # fmt: skip

    async with TcpProxy.to_url(provisioned.url) as proxy:
        async with reach_agent.Client(proxy.url) as client:
            waiting = await wait_then_cut(proxy, client, rid, 20)
            try:
                await wait_for(failed, 10, what="a re-read failed")
                assert waiting.done() is False
                await rejoin(proxy, client)
                # a round trip on the waiter's connection: its subscription is back
                await client.nc.flush(timeout=2)
                error = {"code": "HANDLER_ERROR", "message": "no"}
                await store_by_a1(nc, rid, "away", error=error, at_ms=2)
                done = await asyncio.wait_for(waiting, 12)
            finally:
                waiting.cancel()
    assert (done.request_id, done.state, done.at_ms, done.error) == (
        rid, "failed", 2, {"code": "HANDLER_ERROR", "message": "no"})  # fmt: skip
    assert failed()[0] == (f"acks.reread_failed request_id={rid} error=TimeoutError(): "
                           "listening on")  # fmt: skip


async def test_a_wait_that_knew_no_taker_believes_the_holder_of_a_claim_written_later(
    provisioned: NatsServer, nc: NATS
) -> None:
    """Nemesis seed 32: a submitted task was handed to a1 by a broker that died before its
    ``received`` record, and the replica that found the request claimed sent it no more, so
    no broker ever named a1. The wait had read the claim once, at its start, before a1's was
    written, and timed out although a1's final record was stored. It now reads the claim
    again while no taker is known, and believes its holder's record."""
    rid = "r-claimed-later"
    claim_reads: list[bytes] = []

    async def on_get(msg: Any) -> None:  # the wait's reads of the claim, seen on the wire
        claim_reads.append(msg.data)

    sub = await nc.subscribe(f"$JS.API.STREAM.MSG.GET.{CLAIMS_STREAM}", cb=on_get)
    await flush_subscriptions(nc)
    try:
        async with reach_agent.Client(provisioned.url) as client:
            waiting = asyncio.create_task(client.wait(rid, timeout=10))
            try:
                await wait_for(lambda: claim_reads, what="the wait read the claim (none yet)")
                await store_by_a1(nc, rid, "later", result=b'{"n":3}')
                claim = schema.Claim(request_id=rid, agent_id="a1", instance="i1",
                                     capability="later", state="running", at_ms=1,
                                     ack_subject=Subjects().ack("a1", rid))  # fmt: skip
                created, _ = await ClaimStore(nc).create(claim_key(rid),
                                                         schema.encoder.encode(claim))  # fmt: skip
                assert created
                done = await asyncio.wait_for(waiting, 12)
            finally:
                waiting.cancel()
    finally:
        await sub.unsubscribe()
    assert (done.agent_id, done.state, done.result) == ("a1", "completed", {"n": 3})
    assert len(claim_reads) >= 2  # read at the start, and again once nobody was known


async def test_every_wait_outcome_is_counted(provisioned: NatsServer, nc: NATS) -> None:
    """``reach_wait_total{result}``: a record's state, a timeout, an invalid request id and
    a refusal (``STORE_UNAVAILABLE``) each move the client's counter, once."""
    metrics = reach_agent.ClientMetrics()

    def counted() -> dict[str, float]:
        return {r: v for r in ("completed", "failed", "timeout", "unavailable", "invalid")
                if (v := metrics.registry.get_sample_value(
                    "reach_wait_total", {"result": r})) is not None}  # fmt: skip

    await store_by_a1(nc, "r-ok", "c", result=b"1")
    await store_by_a1(nc, "r-bad", "c", error={"code": "BIZ_REJECT", "message": "no"})
    async with reach_agent.Client(provisioned.url, metrics=metrics) as client:
        assert (await client.wait("r-ok", timeout=5, agent_id="a1")).state == "completed"
        assert (await client.wait("r-bad", timeout=5, agent_id="a1")).state == "failed"
        with pytest.raises(reach_agent.Timeout):
            await client.wait("r-none", timeout=0.2, agent_id="a1")
        with pytest.raises(reach_agent.InvalidRequest):
            await client.wait("not a request id", timeout=1, agent_id="a1")
        await client.nc.close()
        with pytest.raises(StoreUnavailable):
            await asyncio.wait_for(client.wait("r-closed", timeout=5, agent_id="a1"), 4)
    assert counted() == {"completed": 1.0, "failed": 1.0, "timeout": 1.0, "unavailable": 1.0,
                         "invalid": 1.0}  # fmt: skip
