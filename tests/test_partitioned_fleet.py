"""Two broker processes over one nats-server whose config maps the agent subjects into 8
partitions (the shipped ``configs/nats-server.conf``, its partition count set to 8): each
broker hears the heartbeats of the partitions it owns, and a SIGKILLed broker's partitions are
taken over by the other without an agent going offline or a route going unanswered.

The agents are raw NATS clients (announce once, then a heartbeat every second, as the SDK
sends them); the brokers run ``python -m reach_broker broker --server URL --config T``.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import nats
import pytest

from reach_agent.routing.table import partition
from reach_agent.wire import schema
from reach_broker.cluster.natsserver import NatsServer

from .conftest import wait_for

ROOT = Path(__file__).resolve().parent.parent
P = 8
AGENTS = [f"pf-{i:03d}" for i in range(120)]
CAPABILITY = "pf_cap"


@pytest.fixture
def mapped_server(tmp_path: Path) -> Iterator[NatsServer]:
    """The shipped server config, mapping into P partitions."""
    text = (ROOT / "configs" / "nats-server.conf").read_text()
    assert text.count("partition(32,1)") == 5
    conf = tmp_path / "nats-server.conf"
    conf.write_text(text.replace("partition(32,1)", f"partition({P},1)"))
    server = NatsServer(port=0, store_dir=tmp_path / "nats", config=conf)
    server.start()
    try:
        yield server
    finally:
        server.stop()


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class BrokerProc:
    def __init__(self, url: str, tmp: Path, name: str) -> None:
        self.port = free_port()
        conf = tmp / f"{name}.toml"
        conf.write_text(
            f'[broker]\nbroker_id = "{name}"\nmin_heartbeat_interval_ms = 100\n'
            f"[fleet]\npartitions = {P}\nlease_ttl_s = 2.0\n"
        )
        env = {k: v for k, v in os.environ.items() if k != "NATS_URL"}
        self.log_path = tmp / f"{name}.log"
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "reach_broker", "broker", "--server", url, "--config",
             str(conf), "--metrics-port", str(self.port), "--log-level", "info"],
            stdout=self.log, stderr=subprocess.STDOUT, env=env,
        )  # fmt: skip

    def metrics(self) -> dict[str, float]:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=2) as r:
                text = r.read().decode()
        except OSError:
            return {}
        out = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                out[name] = float(value)
        return out

    def value(self, name: str) -> float:
        return self.metrics().get(name, 0.0)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.log.close()


@pytest.fixture
def two_brokers(mapped_server: NatsServer, tmp_path: Path) -> Iterator[list[BrokerProc]]:
    brokers = [BrokerProc(mapped_server.url, tmp_path, f"b{i}") for i in (1, 2)]
    try:
        yield brokers
    finally:
        for b in brokers:
            b.stop()


OWNED = "reach_partitions_owned"
BEATS = 'reach_heartbeats_total{result="accepted"}'
OUTCOMES = "reach_outcomes_total"


class Fleet:
    """Raw agents as the SDK runs them: a connection each, named by the agent id (the
    server's disconnect advisories name it), announced once, a heartbeat each every
    ``beat()``, probes answered."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.conns: dict[str, Any] = {}
        self.tokens: dict[str, str] = {}
        self.seq = 0
        self.sent = 0

    async def start(self) -> None:
        async def one(agent_id: str) -> None:
            nc = self.conns[agent_id] = await nats.connect(self.url, name=agent_id)

            async def on_probe(msg: Any) -> None:
                reply = schema.ProbeReply(agent_id=agent_id, active=0, seq=self.seq)
                await nc.publish(msg.reply, schema.encoder.encode(reply))

            await nc.subscribe(f"reach.probe.{agent_id}", cb=on_probe)
            body = {"agent_id": agent_id, "capabilities": [CAPABILITY], "max_concurrency": 4,
                    "heartbeat_interval_ms": 1000}  # fmt: skip
            reply = await nc.request(f"reach.announce.{agent_id}", json.dumps(body).encode(),
                                     timeout=5)  # fmt: skip
            self.tokens[agent_id] = json.loads(reply.data)["token"]

        await asyncio.gather(*(one(a) for a in AGENTS))

    async def beat(self) -> None:
        self.seq += 1
        for agent_id, token in self.tokens.items():
            hb = {"agent_id": agent_id, "token": token, "seq": self.seq}
            await self.conns[agent_id].publish(f"reach.hb.{agent_id}", json.dumps(hb).encode())
        await asyncio.gather(*(nc.flush() for nc in self.conns.values()))
        self.sent += len(self.tokens)

    async def close(self) -> None:
        await asyncio.gather(*(nc.close() for nc in self.conns.values()))


@pytest.fixture
async def fleet(mapped_server: NatsServer) -> AsyncIterator[Fleet]:
    f = Fleet(mapped_server.url)
    try:
        yield f
    finally:
        await f.close()


@pytest.fixture
async def client(mapped_server: NatsServer) -> AsyncIterator[Any]:
    nc = await nats.connect(mapped_server.url, name="pf-test")
    try:
        yield nc
    finally:
        await nc.close()


async def settled(brokers: list[BrokerProc]) -> None:
    """Each broker owns P / 2 partitions."""

    def even() -> bool:
        return [b.value(OWNED) for b in brokers] == [P / 2, P / 2]

    await asyncio.to_thread(lambda: None)
    await wait_for(even, 30, interval=0.2, what="the partitions split 4/4")


async def test_two_brokers_share_the_heartbeats_by_partition(
    two_brokers: list[BrokerProc], client: Any, fleet: Fleet
) -> None:
    await settled(two_brokers)
    await fleet.start()
    await fleet.beat()
    await wait_for(lambda: sum(b.value(BEATS) for b in two_brokers) == len(AGENTS), 10,
                   interval=0.1, what="the first heartbeats")  # fmt: skip
    before = [b.value(BEATS) for b in two_brokers]
    for _ in range(5):
        await fleet.beat()
        await asyncio.sleep(0.2)
    sent = 5 * len(AGENTS)

    def counted() -> list[float]:
        return [b.value(BEATS) - x for b, x in zip(two_brokers, before, strict=True)]

    await wait_for(
        lambda: sum(counted()) == sent, 10, interval=0.1, what=f"every heartbeat: {counted()}"
    )
    got = counted()
    # Each broker counted exactly the heartbeats of its agents (no copies, none lost) ...
    assert sum(got) == sent
    for share in got:
        assert 0.35 <= share / sent <= 0.65, got
    # ... and per partition: the partitions' counters add up to what it accepted, and name
    # only partitions it owns.
    for b in two_brokers:
        m = b.metrics()
        per = {k: v for k, v in m.items() if k.startswith("reach_partition_heartbeats_total")}
        every = sum(v for k, v in m.items() if k.startswith("reach_heartbeats_total{"))
        assert sum(per.values()) == every
        assert len(per) == P / 2
        assert m.get('reach_partition_mapping{mode="mapped"}') == 1.0
    expected = [0, 0]
    owners = await agents_by_broker(client)
    for agent_id in AGENTS:
        expected[owners[partition(agent_id, P)]] += 5
    assert got == expected
    # A caller's outcome summaries go to each agent's owner alone (mapped as the heartbeats
    # are): each broker judges exactly its agents' and hears none of the other's.
    summary = schema.encoder.encode(schema.OutcomeSummary(caller="pf-test", attempts=1, ok=1,
                                                          interval_ms=1000))  # fmt: skip
    for agent_id in AGENTS:
        await client.publish(f"reach.outcome.{agent_id}", summary)
    await client.flush()

    def judged() -> list[tuple[float, float]]:
        return [(b.value(f'{OUTCOMES}{{result="accepted"}}'),
                 b.value(f'{OUTCOMES}{{result="unknown"}}')) for b in two_brokers]  # fmt: skip

    await wait_for(lambda: sum(a for a, _ in judged()) == len(AGENTS), 10, interval=0.1,
                   what=f"every summary: {judged()}")  # fmt: skip
    assert judged() == [(n / 5, 0.0) for n in expected]
    assert not any("outcomes_unmapped" in b.log_path.read_text() for b in two_brokers)


async def agents_by_broker(nc: Any) -> dict[int, int]:
    """Partition -> 0 or 1 (the index of its owner among b1, b2), from KV reach_partitions."""
    kv = await nc.jetstream().key_value("reach_partitions")
    out = {}
    for p in range(P):
        entry = await kv.get(str(p))
        out[p] = 0 if json.loads(entry.value)["broker_id"] == "b1" else 1
    return out


async def test_sigkill_of_one_broker_the_other_takes_over(
    two_brokers: list[BrokerProc], client: Any, fleet: Fleet
) -> None:
    await settled(two_brokers)
    await fleet.start()
    offline: list[str] = []

    async def on_event(msg: Any) -> None:
        if json.loads(msg.data).get("to") == "offline":
            offline.append(msg.subject)

    await client.subscribe("reach.event.>", cb=on_event)
    stop = asyncio.Event()

    async def beats() -> None:
        while not stop.is_set():
            await fleet.beat()
            await asyncio.sleep(1.0)

    sent: list[tuple[float, bool]] = []  # (when a route request went out, answered in 1 s)

    async def one_route() -> None:
        t0 = time.monotonic()
        try:
            await client.request(f"reach.route.{CAPABILITY}", b"", timeout=1.0)
        except Exception:  # noqa: BLE001 - counted: a request with no answer within 1 s
            sent.append((t0, False))
        else:
            sent.append((t0, True))

    async def routes() -> None:
        pending = []
        while not stop.is_set():
            pending.append(asyncio.create_task(one_route()))  # one every 0.1 s, not waited
            await asyncio.sleep(0.1)
        await asyncio.gather(*pending)

    tasks = [asyncio.create_task(beats()), asyncio.create_task(routes())]
    try:
        # Every agent heard by its owner once before the kill.
        await wait_for(lambda: fleet.seq >= 3, 10, what="three rounds of heartbeats")
        survivor, victim = two_brokers
        victim.proc.send_signal(signal.SIGKILL)
        victim.proc.wait(5)
        killed = time.monotonic()
        await wait_for(lambda: survivor.value(OWNED) == P, 5, interval=0.1,
                       what="the survivor owning every partition within 5 s")  # fmt: skip
        took = time.monotonic() - killed
        # Then every agent healthy at the survivor, heard over several heartbeats.
        await asyncio.sleep(3.0)

        async def states() -> dict[str, str]:
            reply = await client.request("reach.agents", b"{}", timeout=5)
            return {v["agent_id"]: v["state"] for v in json.loads(reply.data)}

        got = await states()
        assert sorted(got) == AGENTS
        assert set(got.values()) == {"healthy"}
    finally:
        stop.set()
        for t in tasks:
            await t
    assert offline == []
    # A request sent to the killed broker as it died is lost (its requester retries), but
    # never for more than a second: an answered request follows every unanswered one within
    # 1 s.
    sent.sort()
    lost = [t for t, ok in sent if not ok]
    for t in lost:
        assert any(ok and t < u <= t + 1.0 for u, ok in sent), (t - killed, sent)
    print(f"takeover {took:.2f}s; routes answered {len(sent) - len(lost)} of {len(sent)}")
