"""Streamed answers: chunks in order under credit, joined for call(), broken loudly."""

from __future__ import annotations

import asyncio
import signal
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
from nats.aio.client import Client as NATS

import reach_agent
from reach_agent.client.calls import Call, StreamStart
from reach_agent.client.streaming import read
from reach_agent.wire import schema
from reach_agent.wire.errors import InternalError, StreamBroken
from reach_agent.wire.streams import Joined, join
from reach_broker.broker import Broker
from reach_broker.cluster.natsserver import NatsServer

from .conftest import wait_for
from .test_sdk_failover import healthy, lines, worker

# --- joining, and reading a stream (fed by hand) ---------------------------------------------


def test_joined_is_the_concatenation_of_strings_otherwise_the_list() -> None:
    assert join(["a", "b", "c"]) == "abc"
    assert join([1, "b"]) == [1, "b"]
    assert join([]) == []
    assert join([{"t": 1}]) == [{"t": 1}]
    for chunks in (["a", "b"], [1, {"x": [2]}, "c"], []):
        joined = Joined()
        for c in chunks:
            joined.add(c, msgspec.json.encode(c))
        assert msgspec.json.decode(joined.encode()) == join(chunks)


class FakeMsg:
    def __init__(self, headers: dict[str, str], data: bytes = b"", reply: str = "") -> None:
        self.headers, self.data, self.reply, self.subject = headers, data, reply, "x"


class FakeNats:
    def __init__(self) -> None:
        self.sent: list[tuple[str, dict[str, str]]] = []

    async def publish(self, subject: str, data: bytes, headers: dict[str, str]) -> None:
        self.sent.append((subject, headers))


def chunk(seq: int, value: Any) -> FakeMsg:
    return FakeMsg({schema.H_STATUS: "chunk", schema.H_SEQ: str(seq)},
                   msgspec.json.encode(value), reply="_INBOX.agent.a.1")  # fmt: skip


def end(count: int) -> FakeMsg:
    return FakeMsg({schema.H_STATUS: "completed", schema.H_CHUNKS: str(count)})


async def consume(msgs: list[FakeMsg], window: int = 4) -> tuple[list[Any], Any, FakeNats]:
    call = Call("1", "cap", b"", None, request_id="r", traceparent=None, ack_mode="completed",
                deadline=asyncio.get_running_loop().time() + 5, stream=window)  # fmt: skip
    call.attempt, call.agents[1] = 1, "a"  # its first attempt, to agent a
    for m in msgs[1:]:
        call.deliver("1", m)
    nc = FakeNats()
    got: list[Any] = []
    error = None
    try:
        async for value in read(nc, call, StreamStart(1, msgs[0]),  # type: ignore[arg-type]
                                asyncio.get_running_loop().time):  # fmt: skip
            got.append(value)
    except Exception as exc:  # noqa: BLE001 - the test looks at it
        error = exc
    return got, error, nc


async def test_a_reader_yields_in_order_drops_repeats_and_credits_every_half_window() -> None:
    got, error, nc = await consume([chunk(1, "a"), chunk(2, "b"), chunk(2, "b"), chunk(3, "c"),
                                    chunk(4, "d"), end(4)], window=4)  # fmt: skip
    assert (got, error) == (["a", "b", "c", "d"], None)
    assert [h[schema.H_SEQ] for _, h in nc.sent] == ["2", "4"]  # credit after chunks 2 and 4
    assert {s for s, _ in nc.sent} == {"_INBOX.agent.a.1"}


async def test_a_gap_or_a_short_count_is_stream_broken_with_the_delivered_count() -> None:
    got, error, nc = await consume([chunk(1, "a"), chunk(2, "b"), chunk(4, "d"), end(4)])
    assert got == ["a", "b"]
    assert isinstance(error, StreamBroken) and error.delivered == 2
    assert "chunk 3 of agent 'a' is missing" in error.message
    assert nc.sent[-1][1] == {schema.H_STREAM: "cancel", schema.H_SEQ: "2"}  # the agent stops
    got, error, _ = await consume([chunk(1, "a"), end(2)])
    assert got == ["a"] and isinstance(error, StreamBroken) and error.delivered == 1
    assert error.code == "STREAM_BROKEN"


async def test_credits_go_only_to_inboxes() -> None:
    forged = FakeMsg({schema.H_STATUS: "chunk", schema.H_SEQ: "1"}, b'"a"', reply="reach.hb.x")
    got, error, nc = await consume([forged, chunk(2, "b"), end(2)], window=2)
    assert (got, error) == (["a", "b"], None)
    assert [s for s, _ in nc.sent] == ["_INBOX.agent.a.1"]  # chunk 2's credit; none to hb


# --- real servers -------------------------------------------------------------------------


def streaming_agent(agent_id: str, produced: list[int] | None = None) -> reach_agent.Agent:
    agent = reach_agent.Agent(agent_id, ["tokens", "numbers"], heartbeat_interval=0.1)

    @agent.handler("tokens")
    async def tokens(task: reach_agent.Task) -> AsyncIterator[str]:
        for i in range(int((task.payload or {}).get("chunks", 3))):
            if produced is not None:
                produced.append(i)
            yield f"t{i} "

    @agent.handler("numbers")
    async def numbers(task: reach_agent.Task) -> AsyncIterator[Any]:
        yield 1
        yield {"two": 2}
        if (task.payload or {}).get("fail"):
            raise RuntimeError("out of tokens")

    return agent


async def test_a_streamed_answer_of_1000_chunks_arrives_complete_and_in_order(
    nats_server: NatsServer, broker: Broker, agents: Any, nc: NATS
) -> None:
    await agents(streaming_agent("streamer"))
    await wait_for(lambda: healthy(broker, "streamer"))
    rid = str(uuid.uuid4())
    async with reach_agent.Client(nats_server.url) as client:
        got = [c async for c in client.stream("tokens", {"chunks": 1000}, request_id=rid)]
        assert got == [f"t{i} " for i in range(1000)]
        # The same request id again: the stored (joined) result, as one chunk, not a re-run.
        assert [c async for c in client.stream("tokens", {"chunks": 1000}, request_id=rid)] == [
            "".join(got)
        ]
        # call() on a streaming handler: the joined result.
        assert await client.call("tokens", {"chunks": 4}) == "t0 t1 t2 t3 "
        assert await client.call("numbers") == [1, {"two": 2}]
        record = await client.wait(rid, timeout=5)
        assert record.result == "".join(got)  # decoded, as wait() returns it
        # A handler failing mid-stream: the chunks so far, then its error.
        seen: list[Any] = []
        with pytest.raises(InternalError, match="out of tokens"):
            async for c in client.stream("numbers", {"fail": True}):
                seen.append(c)
        assert seen == [1, {"two": 2}]
        # A plain handler through stream(): its result is the one chunk.
        plain = reach_agent.Agent("plainer", ["plain"], heartbeat_interval=0.1)
        plain.handler("plain")(lambda task: {"whole": True})
        await agents(plain)
        await wait_for(lambda: healthy(broker, "plainer"))
        assert [c async for c in client.stream("plain")] == [{"whole": True}]


async def test_a_slow_reader_holds_the_generator_at_the_window(
    nats_server: NatsServer, broker: Broker, agents: Any
) -> None:
    produced: list[int] = []
    await agents(streaming_agent("held", produced))
    await wait_for(lambda: healthy(broker, "held"))
    async with reach_agent.Client(nats_server.url) as client:
        chunks = client.stream("tokens", {"chunks": 100}, window=8)
        assert await anext(chunks) == "t0 "
        # Eight chunks went out without credit; the ninth was made and waits for credit.
        await wait_for(lambda: len(produced) == 9, 5, what="the window filled")
        await asyncio.sleep(0.3)  # the generator stays suspended: nothing more is made
        assert len(produced) == 9
        rest = [c async for c in chunks]
        assert rest == [f"t{i} " for i in range(1, 100)]
        assert len(produced) == 100


@pytest.mark.slow
async def test_killing_the_agent_mid_stream_is_stream_broken_with_the_delivered_count(
    nats_server: NatsServer, broker: Broker, tmp_path: Path
) -> None:
    proc = worker(nats_server.url, tmp_path, "mortal-s", "tokens", "--stream", "--hb", "0.1")
    try:
        await wait_for(lambda: healthy(broker, "mortal-s"), 30, what="mortal-s healthy")
        got: list[str] = []
        async with reach_agent.Client(nats_server.url) as client:
            with pytest.raises(StreamBroken) as broken:
                async for c in client.stream("tokens", {"chunks": 1000, "sleep": 0.01},
                                             timeout=60):  # fmt: skip
                    got.append(c)
                    if len(got) == 100:
                        proc.signal(signal.SIGKILL)
        assert broken.value.code == "STREAM_BROKEN"
        assert broken.value.delivered == len(got)
        assert 100 <= len(got) < 1000
        assert got == [f"{i}," for i in range(len(got))]
        assert f"after {len(got)} chunks" in broken.value.message
        assert len(lines(tmp_path / "mortal-s.log", "start")) == 1
    finally:
        proc.stop()
