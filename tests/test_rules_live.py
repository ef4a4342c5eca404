"""Live route rules and quotas on a real nats-server: ``reach rules`` writes KV reach_rules,
two broker replicas apply the change within a second, the change is audited once in
REACH_AUDIT; required tags and splits hold on the wire; a caller over its quota gets
OVERLOADED with retry_after_ms while another is served; the in-flight ceiling answers; the
stored rules are read whole also when the server answers a consumer info before them."""

from __future__ import annotations

import asyncio
import json
import time

import nats
from nats.aio.client import Client as NATS

from jetstream import audit
from jetstream import rules as bucket
from jetstream.names import RULES_STREAM
from jetstream.provision import load_definitions, provision
from reach_agent.routing.rules import build, rule_encoder
from reach_agent.wire import schema
from reach_agent.wire.errors import Overloaded, from_reply
from reach_broker.cluster.natsserver import NatsServer

from .conftest import BrokerFactory, wait_for
from .infofirst import InfoFirstProxy
from .test_broker_wire import heartbeat
from .test_cli import QUIET, announce, reach

CAP = "summarize"


async def route(nc: NATS, body: dict[str, object] | None = None,
                headers: dict[str, str] | None = None) -> list[str]:  # fmt: skip
    # A look (peek): no task follows, so the broker counts no hand-out.
    look = {"peek": True, **(body or {})}
    reply = await nc.request(f"reach.route.{CAP}", json.dumps(look).encode(), timeout=2,
                             headers=headers)  # fmt: skip
    err = from_reply(reply.headers, reply.data)
    if err is not None:
        raise err
    return [c["agent_id"] for c in json.loads(reply.data)["candidates"]]


async def test_a_rule_change_reaches_a_second_replica_within_a_second_and_is_audited(
    nats_server: NatsServer, nc: NATS, broker_factory: BrokerFactory
) -> None:
    # `one` holds every partition until a replica joins: the routes below are its answers.
    # Every broker of the test runs the same lease (the bucket's max age is every broker's
    # lease time): 600 s, so only a join, a hand-back or a leave runs a round.
    one = await broker_factory(**QUIET, fleet__lease_ttl_s=600)
    tokens = {"prod-1": await announce(nc, "prod-1", [CAP], tags={"env": "prod"}),
              "untagged": await announce(nc, "untagged", [CAP])}  # fmt: skip
    await wait_for(lambda: len(one.registry.agents) == 2, what="both agents")
    t0 = time.monotonic()
    code, out, err = await reach("rules", "set", CAP, "--require", "env=prod", "--json",
                                 "--server", nats_server.url)  # fmt: skip
    assert code == 0, err
    assert json.loads(out)["rule"]["require"] == {"env": "prod"}
    await wait_for(lambda: CAP in one.rules, timeout=5.0, what="rule")
    applied_s = time.monotonic() - t0
    for _ in range(20):
        assert await route(nc, {"limit": 3}) == ["prod-1"]
    assert await route(nc, {"tags": {"env": "prod"}}) == ["prod-1"]
    # A second replica follows the bucket: the stored rule in force before it serves, and a
    # change written to the bucket directly in force on both within a second.
    two = await broker_factory(**QUIET, fleet__lease_ttl_s=600)
    assert CAP in two.rules
    before = [b.rulebook.applied for b in (one, two)]
    rule = build(split="version=1:95,2:5", require=["env=prod"])
    await bucket.put(nc, CAP, rule_encoder.encode(rule))
    await wait_for(lambda: all(b.rulebook.applied == n + 1 for b, n in zip((one, two), before,
                                                                          strict=True)),
                   timeout=1.0, what="the change on both replicas within 1 s")  # fmt: skip
    assert all(b.rules[CAP].arms == ("1", "2") for b in (one, two))
    # A replica started now has the stored rule in force before it serves; its audit of
    # the catch-up is the same message id, stored once.
    three = await broker_factory(**QUIET, fleet__lease_ttl_s=600)
    assert three.rules[CAP].arms == ("1", "2")
    await three.stop()  # its agents came from the snapshot, suspect until they beat again
    # Audited: one event of kind `rule` in REACH_AUDIT, however many replicas published it.
    stored = await audit.read_events(nc, subjects=one.subjects)
    events = [schema.event_decoder.decode(e.data) for e in stored]
    rules = [e for e in events if e.kind == "rule"]
    assert [(e.capability, e.agent_id) for e in rules] == [(CAP, "_rules")] * 2
    assert rules[0].reason.startswith("summarize: set require env=prod by ")
    assert rules[1].reason == "summarize: set split version=1:95,2:5; require env=prod"
    # The CLI shows it; clearing puts the untagged agent back.
    code, out, _ = await reach("rules", "show", "--json", "--server", nats_server.url)
    assert (code, list(json.loads(out))) == (0, [CAP])
    code, out, _ = await reach("rules", "clear", CAP, "--server", nats_server.url)
    assert (code, out.strip()) == (0, f"{CAP}: rule cleared")
    await wait_for(lambda: all(CAP not in b.rules for b in (one, two)), what="cleared")
    # `one` alone again: it takes back the partitions `two` hands back (warm), their agents
    # restored in their stored states: `offline` by now (silent since they announced), or
    # `suspect`. Their heartbeats bring them back (offline -> recovering -> healthy after
    # RECOVER_HEARTBEATS on time; suspect -> healthy at the first).
    await two.stop()
    await wait_for(lambda: len(one.tables.book.epochs) == one.cfg.fleet.partitions
                   and all(a in one.registry.agents for a in tokens),
                   what="`one` owning every partition again, both agents restored")  # fmt: skip
    deadline = time.monotonic() + 5.0
    seq = 1
    while not all(one.registry.agents[a].state == "healthy" for a in tokens):
        assert time.monotonic() < deadline, "both agents heard by `one` within 5 s"
        seq += 1
        for agent_id, token in tokens.items():
            await heartbeat(nc, agent_id, token, seq, active=1)
        await nc.flush()
        await asyncio.sleep(0.1)
    assert sorted(await route(nc, {"limit": 3})) == ["prod-1", "untagged"]
    # The time is reported, not asserted beyond the contract's second (it includes a CLI
    # process start).
    print(f"rule applied {applied_s:.3f}s after `reach rules set` began")


async def test_a_split_set_by_the_cli_holds_on_the_wire(
    nats_server: NatsServer, nc: NATS, broker_factory: BrokerFactory
) -> None:
    broker = await broker_factory(**QUIET)
    await announce(nc, "v1", [CAP], version="1")
    await announce(nc, "v2", [CAP], version="2")
    await wait_for(lambda: len(broker.registry.agents) == 2, what="two agents")
    code, _, err = await reach("rules", "set", CAP, "--split", "version=1:90,2:10",
                               "--server", nats_server.url)  # fmt: skip
    assert code == 0, err
    await wait_for(lambda: CAP in broker.rules, what="rule")
    firsts = [(await route(nc, {"limit": 1}))[0] for _ in range(200)]
    assert (firsts.count("v1"), firsts.count("v2")) == (180, 20)
    assert await route(nc, {"canary": "2", "limit": 2}) == ["v2"]
    code, out, err = await reach("route", CAP, "--canary", "2", "--explain", "--json",
                                 "--server", nats_server.url)  # fmt: skip
    assert code == 0, err
    reply = json.loads(out)
    assert [c["agent_id"] for c in reply["candidates"]] == ["v2"]
    assert reply["explain"]["counts"] == {"split": 1}
    code, _, err = await reach("rules", "set", CAP, "--split", "version=1", "--server",
                               nats_server.url)  # fmt: skip
    assert code == 2
    assert "split arm '1' is not VALUE:WEIGHT" in err


async def test_a_caller_over_its_quota_gets_overloaded_with_retry_after_while_another_is_served(
    nats_server: NatsServer, nc: NATS, broker_factory: BrokerFactory
) -> None:
    broker = await broker_factory(**QUIET, quotas__rate=2.0, quotas__burst=3,
                                  quotas__callers=["batch"])  # fmt: skip
    await announce(nc, "a", [CAP])
    await wait_for(lambda: len(broker.registry.agents) == 1, what="agent")
    batch = {schema.H_CALLER: "batch"}
    for _ in range(3):
        assert await route(nc, headers=batch) == ["a"]
    try:
        await route(nc, headers=batch)
    except Overloaded as exc:
        assert exc.retry_after_ms is not None and 1 <= exc.retry_after_ms <= 500
        assert exc.message.startswith("caller 'batch' is over its quota for 'summarize'")
    else:
        raise AssertionError("the fourth route of the burst was served")
    assert await route(nc, headers={schema.H_CALLER: "web"}) == ["a"]  # another caller
    refused = broker.metrics.quota_refused.labels(CAP, "batch")._value.get()
    assert refused == 1
    # The SDK honours the hint: a Client whose name is the caller waits and is served.
    import reach_agent

    async with reach_agent.Client(nats_server.url, name="batch") as client:
        got = await asyncio.wait_for(client.route(CAP), 5)
        assert [c.agent_id for c in got] == ["a"]


async def test_the_inflight_ceiling_is_reached_and_answered(
    nats_server: NatsServer, nc: NATS, broker_factory: BrokerFactory
) -> None:
    broker = await broker_factory(**QUIET)
    await announce(nc, "a", [CAP])  # max_concurrency 4, active 1: ceiling 0.9 x 4 = 3
    await wait_for(lambda: broker.registry.inflight == 1, what="heartbeat")
    assert broker.router.ceiling() == 3
    assert await route(nc) == ["a"]
    token = broker.registry.agents["a"].token
    hb = {"agent_id": "a", "token": token, "seq": 2, "active": 4}
    await nc.publish("reach.hb.a", json.dumps(hb).encode())
    await wait_for(lambda: broker.registry.inflight == 4, what="4 in flight")
    try:
        await route(nc)
    except Overloaded as exc:
        assert exc.message == "fleet in-flight tasks 4 exceed the ceiling 3"
        assert exc.retry_after_ms == 250
    else:
        raise AssertionError("routed past the ceiling")
    extra = await nats.connect(nats_server.url)
    try:
        await announce(extra, "b", [CAP])  # the fleet grows: 8 slots, ceiling 7
        await wait_for(lambda: broker.router.ceiling() == 7, what="ceiling 7")
        assert await route(nc, {"limit": 1}) == ["b"]
    finally:
        await extra.close()


async def test_the_stored_rules_are_read_whole_when_the_info_overtakes_them(
    nats_server: NatsServer, nc: NATS
) -> None:
    """``reach rules set`` builds on the stored rule (read_all): nats-py's ``KeyValue.keys``
    said there was none when the server answered its consumer info before the keys, and the
    set then overwrote the rule's other parts."""
    await provision(nc, load_definitions(names=(RULES_STREAM,)))
    stored = {cap: rule_encoder.encode(build(None, [f"env={cap}"], None))
              for cap in ("alpha", "beta", "gamma")}  # fmt: skip
    for cap, data in stored.items():
        await bucket.put(nc, cap, data)
    await bucket.delete(nc, "beta")
    async with InfoFirstProxy(nats_server.port) as proxy:
        proxied = await nats.connect(proxy.url, name="test-proxied")
        try:
            assert await bucket.read_all(proxied) == {"alpha": stored["alpha"],
                                                      "gamma": stored["gamma"]}  # fmt: skip
        finally:
            await proxied.close()
