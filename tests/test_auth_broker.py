"""A broker and SDK agents on a real nats-server in operator mode, each with the credential
``reach auth`` issues for it: what one agent cannot do to another, what the server's
permissions cannot stop and reach's receivers must, and whose ack records a caller believes.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
from nats.js.api import StreamInfo
from nats.js.errors import NotFoundError

import reach_agent
from jetstream import ackreads
from jetstream import rules as rules_kv
from jetstream.names import ACK_STREAM, AUDIT_STREAM
from reach_agent.client import durable
from reach_agent.client.tables import TableRoutes
from reach_agent.connection import flush_subscriptions
from reach_agent.routing.rules import RouteRule, rule_encoder
from reach_agent.wire import schema
from reach_broker.auth import AuthDir, init, issue_agent, issue_caller
from reach_broker.broker import Broker
from reach_broker.service.metrics import Metrics

from .auth_helpers import AuthServer, Inbox, auth_server, connect, violation
from .conftest import fast_config, wait_for

CAP = "secure.echo"


@pytest.fixture
def auth(tmp_path: Path) -> AuthDir:
    d = init(tmp_path / "auth")
    for agent in ("alpha", "beta"):
        issue_agent(d, agent)
    issue_caller(d, "ops")
    return d


@pytest.fixture
def server(auth: AuthDir, tmp_path: Path) -> Iterator[AuthServer]:
    with auth_server(auth, tmp_path / "nats") as s:
        yield s


@pytest.fixture
async def broker(auth: AuthDir, server: AuthServer) -> AsyncIterator[Broker]:
    b = Broker(fast_config(server.url, nats__creds=str(auth.broker_creds)), metrics=Metrics())
    await asyncio.wait_for(b.start(), 20)
    try:
        yield b
    finally:
        await b.stop()


class Gate:
    """Holds the handler of every task until released."""

    def __init__(self) -> None:
        self.open = asyncio.Event()


def agent(d: AuthDir, agent_id: str, gate: Gate | None = None, **kw: Any) -> reach_agent.Agent:
    a = reach_agent.Agent(agent_id, [CAP], heartbeat_interval=0.1,
                          creds=str(d.creds("agent", agent_id)), **kw)  # fmt: skip

    @a.handler(CAP)
    async def echo(task: reach_agent.Task) -> dict[str, Any]:
        if gate is not None:
            await gate.open.wait()
        return {"by": agent_id, "got": task.payload}

    return a


def healthy(b: Broker, agent_id: str) -> bool:
    rec = b.registry.agents.get(agent_id)
    return rec is not None and rec.state == "healthy"


async def audit_info(d: AuthDir, url: str) -> StreamInfo:
    async with connect(url, d.broker_creds, "reader", "_INBOX.broker.broker") as (nc, _):
        return await nc.jetstream(timeout=5).stream_info(AUDIT_STREAM)


def dropped(b: Broker, kind: str, reason: str) -> float:
    return float(b.metrics.refused.labels(kind, reason)._value.get())


async def test_alpha_cannot_act_for_beta_against_a_running_broker(
    auth: AuthDir, server: AuthServer, broker: Broker
) -> None:
    beta = agent(auth, "beta")
    await asyncio.wait_for(beta.start(server.url), 20)
    try:
        await wait_for(lambda: healthy(broker, "beta"), 10, what="beta healthy")
        rec = broker.registry.agents["beta"]
        token, before = rec.token, await audit_info(auth, server.url)
        announces = broker.metrics.announce_result["ok"]._value.get()
        leaves = broker.metrics.leaves.labels("ok")._value.get()
        async with connect(server.url, auth.creds("agent", "alpha"), "alpha",
                           "_INBOX.agent.alpha") as (alpha, errors):  # fmt: skip
            tasks = Inbox()
            await alpha.subscribe("reach.task.beta.>", cb=tasks.record)
            hb = schema.Heartbeat(agent_id="beta", token=beta.token or "", seq=10**6,
                                  status="draining")  # fmt: skip
            await alpha.publish("reach.hb.beta", schema.encoder.encode(hb))
            inbox = alpha.new_inbox()
            await alpha.publish("reach.leave.beta", b"{}", reply=inbox)
            await alpha.publish("reach.announce.beta", schema.encoder.encode(beta.announcement),
                                reply=inbox)  # fmt: skip
            offline = schema.Event(kind="state", agent_id="beta", reason="forged", at_ms=1,
                                   broker_id="x", to="offline", from_="healthy")  # fmt: skip
            await alpha.publish("reach.event.state.beta", schema.encoder.encode(offline))
            # A barrier on the same connection: alpha's own (unknown) heartbeat reaches the
            # broker after everything above that the server would have let through.
            await alpha.publish("reach.hb.alpha", b'{"agent_id":"alpha","token":"x","seq":1}')
            await wait_for(lambda: dropped(broker, "heartbeat", "unknown") == 1, 5,
                           what="alpha's own heartbeat, counted unknown")  # fmt: skip
            for action, subject in (("subscription", "reach.task.beta.>"),
                                    ("publish", "reach.hb.beta"),
                                    ("publish", "reach.leave.beta"),
                                    ("publish", "reach.announce.beta"),
                                    ("publish", "reach.event.state.beta")):  # fmt: skip
                await errors.wait(violation(action, subject))
            # A task for beta reaches beta, not alpha's refused subscription.
            async with reach_agent.Client(server.url, creds=str(auth.creds("caller", "ops"))) as c:
                assert await c.call(CAP, {"n": 1}, timeout=10) == {"by": "beta", "got": {"n": 1}}
            await alpha.flush()
            assert tasks.msgs == []
            assert len(errors.seen) == 5, errors.seen
        after = await audit_info(auth, server.url)
        assert (after.state.messages, after.state.last_seq) == (
            before.state.messages,
            before.state.last_seq,
        )
        rec = broker.registry.agents["beta"]
        assert (rec.state, rec.token, rec.seq < 10**6) == ("healthy", token, True)
        assert broker.metrics.announce_result["ok"]._value.get() == announces
        assert broker.metrics.leaves.labels("ok")._value.get() == leaves
        assert broker.metrics.heartbeat_result["forged"].value == 0
        assert broker.metrics.auth_enabled._value.get() == 1
    finally:
        await asyncio.wait_for(beta.stop(grace=2), 20)


async def test_replies_the_server_lets_through_are_refused_by_reach(
    auth: AuthDir, server: AuthServer, broker: Broker
) -> None:
    """nats-server checks where a message goes, never the reply subject it names: whoever
    answers publishes there with the answerer's rights. reach's receivers refuse the ones
    that would land on reach's subjects or the JetStream API."""
    beta = agent(auth, "beta")
    await asyncio.wait_for(beta.start(server.url), 20)
    caller = str(auth.creds("caller", "ops"))
    try:
        await wait_for(lambda: healthy(broker, "beta"), 10, what="beta healthy")
        async with reach_agent.Client(server.url, creds=caller) as client:  # a few ack records
            rid = str(uuid.uuid4())
            await client.call(CAP, {"n": 1}, request_id=rid, timeout=10)
            await client.wait(rid, 10)
        async with connect(server.url, caller, "ops", "_INBOX.caller.ops") as (ops, errors):
            js = ops.jetstream(timeout=5)
            acks_before = (await js.stream_info(ACK_STREAM)).state.messages
            assert acks_before == 1  # beta's completed (its received folded into it: one write)
            # JetStream's answers (a PubAck, a message get) land on reach.leave.beta; every
            # field of a leave is optional, so both decode as one, without a token. The server
            # maps some answers into beta's partition (the broker hears those) and delivers
            # others on the plain subject (no broker subscribes there while the server maps):
            # every one the broker hears is refused.
            async with connect(server.url, auth.broker_creds, "watch", "_INBOX.broker.broker") as (
                watch,
                _,
            ):
                seen = Inbox()
                await watch.subscribe("reach.leave.*", cb=seen.record)
                await watch.subscribe("reach.part.*.leave.*", cb=seen.record)
                await flush_subscriptions(watch)  # one flush() may overtake the SUBs
                await ops.publish("reach.comp.nobody", b"{}", reply="reach.leave.beta")
                await ops.publish(f"$JS.API.STREAM.MSG.GET.{ACK_STREAM}", b'{"seq":1}',
                                  reply="reach.leave.beta")  # fmt: skip
                await wait_for(lambda: seen.subjects == ["reach.leave.beta"] * 2, 5,
                               what="both answers")  # fmt: skip
            heard = sum(m.subject.startswith("reach.part.") for m in seen.msgs)
            await wait_for(lambda: dropped(broker, "leave", "no_token") == heard, 5,
                           what=f"the {heard} tokenless leaves it heard refused")  # fmt: skip
            # beta is asked to answer onto the JetStream API (a purge of the ack records).
            await ops.publish(f"reach.task.beta.{CAP}", b"{}",
                              reply=f"$JS.API.STREAM.PURGE.{ACK_STREAM}")  # fmt: skip
            # The broker is asked to answer a route onto the API (a stream deletion) and onto
            # an agent's task subject.
            await ops.publish(f"reach.route.{CAP}", b"",
                              reply=f"$JS.API.STREAM.DELETE.{ACK_STREAM}")  # fmt: skip
            await ops.publish(f"reach.route.{CAP}", b"", reply=f"reach.task.beta.{CAP}")
            await wait_for(lambda: dropped(broker, "route", "reply_subject") == 2, 5,
                           what="two routes with a non-inbox reply dropped")  # fmt: skip
            await ops.flush()
            await asyncio.sleep(0.2)  # beta's refusal is local: nothing to wait on
            info = await js.stream_info(ACK_STREAM)
            assert info.state.messages == acks_before  # neither purged nor deleted
            assert errors.seen == []
        assert healthy(broker, "beta")
        assert (beta.ok_total, beta.fail_total) == (1, 0)  # beta ran the one real call
    finally:
        await asyncio.wait_for(beta.stop(grace=2), 20)


async def test_a_stored_copy_is_not_a_control_message(
    auth: AuthDir, server: AuthServer, broker: Broker
) -> None:
    """A direct get answered onto reach.leave.beta (only the broker's credential may ask one):
    the copy carries JetStream's Nats-Stream header and is dropped."""
    beta = agent(auth, "beta")
    await asyncio.wait_for(beta.start(server.url), 20)
    try:
        await wait_for(lambda: healthy(broker, "beta"), 10, what="beta healthy")
        async with connect(server.url, auth.broker_creds, "b2", "_INBOX.broker.broker") as (
            nc,
            _,
        ):
            seen = Inbox()
            await nc.subscribe("reach.leave.*", cb=seen.record)
            await nc.subscribe("reach.part.*.leave.*", cb=seen.record)
            await flush_subscriptions(nc)
            await nc.publish(f"$JS.API.DIRECT.GET.{AUDIT_STREAM}", b'{"seq":1}',
                             reply="reach.leave.beta")  # fmt: skip
            await nc.flush()
            # Delivered mapped into beta's partition (the broker hears it: dropped) or on the
            # plain subject (no broker subscribes there while the server maps).
            await wait_for(lambda: seen.subjects == ["reach.leave.beta"], 5, what="the copy")
        heard = sum(m.subject.startswith("reach.part.") for m in seen.msgs)
        await wait_for(lambda: dropped(broker, "leave", "stored_copy") == heard, 5,
                       what="the copy dropped if heard")  # fmt: skip
        assert healthy(broker, "beta")
    finally:
        await asyncio.wait_for(beta.stop(grace=2), 20)


async def test_a_forged_ack_record_is_never_returned_by_wait(
    auth: AuthDir, server: AuthServer, broker: Broker
) -> None:
    gate = Gate()
    beta = agent(auth, "beta", gate)
    await asyncio.wait_for(beta.start(server.url), 20)
    caller = str(auth.creds("caller", "ops"))
    try:
        await wait_for(lambda: healthy(broker, "beta"), 10, what="beta healthy")
        async with reach_agent.Client(server.url, creds=caller) as client:
            rid = str(uuid.uuid4())
            receipt = await client.call(CAP, {"n": 7}, request_id=rid, ack_mode="received",
                                        timeout=10)  # fmt: skip
            assert (receipt.request_id, receipt.agent_id) == (rid, "beta")
            waiter = asyncio.create_task(client.wait(rid, 20))
            forged = schema.AckRecord(request_id=rid, agent_id="beta", capability=CAP,
                                      state="completed", at_ms=1,
                                      result=msgspec.Raw(b'"forged"'))  # fmt: skip
            body = schema.encoder.encode(forged)
            async with connect(server.url, auth.creds("agent", "alpha"), "alpha",
                               "_INBOX.agent.alpha") as (alpha, errors):  # fmt: skip
                ajs = alpha.jetstream(timeout=5)
                # On beta's subject: refused by the server.
                await alpha.publish(f"reach.ack.beta.{rid}", body)
                await errors.wait(violation("publish", f"reach.ack.beta.{rid}"))
                # On its own subject, claiming beta in the body and in every message id it
                # could guess for beta's record (the old form, and the new one's prefix).
                for msg_id in (f"{rid}.completed", f"beta.{rid}.completed",
                               f"beta.{rid}.completed.000000000000"):  # fmt: skip
                    ack = await ajs.publish(f"reach.ack.alpha.{rid}", body,
                                            headers={"Nats-Msg-Id": msg_id})  # fmt: skip
                    assert not ack.duplicate
                # One without a message id, to be copied below (a copy keeps the original's
                # id, and a duplicate id would not be stored).
                await alpha.publish(f"reach.ack.alpha.{rid}", body)
                await alpha.flush()
                # A copy of it onto beta's subject (a direct get answered there: only a broker
                # credential may ask one; any copy JetStream makes looks the same).
                async with connect(server.url, auth.broker_creds, "b2",
                                   "_INBOX.broker.broker") as (b2, _):  # fmt: skip
                    js = b2.jetstream(timeout=5)
                    seq = (await js.get_last_msg(ACK_STREAM, f"reach.ack.alpha.{rid}")).seq
                    await b2.publish(f"$JS.API.DIRECT.GET.{ACK_STREAM}",
                                     msgspec.json.encode({"seq": seq}),
                                     reply=f"reach.ack.beta.{rid}")  # fmt: skip
                    await b2.flush()
                    # Stored next to beta's own `received` record (in either order).
                    copies = await _until_copied(js, f"reach.ack.beta.{rid}")
                    assert [c.data for c in copies] == [body]
                # alpha's record of its own, honest about its author: alpha never took it.
                own = msgspec.structs.replace(forged, agent_id="alpha")
                await ajs.publish(f"reach.ack.alpha.{rid}", schema.encoder.encode(own),
                                  headers={"Nats-Msg-Id": f"alpha.{rid}.completed.t1"})  # fmt: skip
            await asyncio.sleep(0.3)  # every forgery is stored and was seen by the waiter
            assert not waiter.done()
            gate.open.set()
            record = await asyncio.wait_for(waiter, 20)
            assert (record.agent_id, record.state, record.result) == (
                "beta",
                "completed",
                {"by": "beta", "got": {"n": 7}},  # decoded, as wait() returns it
            )
            # A caller that did not make the call believes the request's claim: beta holds it.
            async with reach_agent.Client(server.url, creds=caller) as other:
                by_claim = await other.wait(rid, 5)
                assert (by_claim.agent_id, by_claim.result) == (
                    "beta",
                    {"by": "beta", "got": {"n": 7}},
                )
                told = await other.wait(rid, 5, agent_id="beta")
                assert told.result == {"by": "beta", "got": {"n": 7}}
                mine = await other.wait(rid, 5, agent_id="alpha")  # alpha's own, as alpha's
                assert (mine.agent_id, mine.result) == ("alpha", "forged")
                last = await durable.last(other, rid)
                assert last is not None and last.agent_id in ("alpha", "beta")
    finally:
        gate.open.set()
        await asyncio.wait_for(beta.stop(grace=2), 20)


async def test_a_submitted_task_is_waited_for_through_the_brokers_word(
    auth: AuthDir, server: AuthServer, broker: Broker
) -> None:
    caller = str(auth.creds("caller", "ops"))
    async with reach_agent.Client(server.url, creds=caller) as client:
        rid = await client.submit(CAP, {"n": 3})
        beta = agent(auth, "beta")
        await asyncio.wait_for(beta.start(server.url), 20)
        try:
            record = await client.wait(rid, 20)
            assert (record.agent_id, record.state) == ("beta", "completed")
            async with connect(server.url, caller, "ops2", "_INBOX.caller.ops") as (nc, _):
                stored = await ackreads.all_records(nc, rid, subjects=client.subjects)
            authors = {(s.author, s.state) for s in stored}
            assert ("_broker", "received") in authors and ("beta", "completed") in authors
        finally:
            await asyncio.wait_for(beta.stop(grace=2), 20)


async def test_cancels_pass_under_the_roles(
    auth: AuthDir, server: AuthServer, broker: Broker
) -> None:
    """A caller's cancel reaches the agent running the request (``reach.cancel.ID``) and,
    for a request nobody runs, a broker (``reach.cancel._broker``): the roles allow both."""
    caller = str(auth.creds("caller", "ops"))
    gate = Gate()
    alpha = agent(auth, "alpha", gate)
    await asyncio.wait_for(alpha.start(server.url), 20)
    try:
        await wait_for(lambda: healthy(broker, "alpha"), 10, what="alpha healthy")
        async with reach_agent.Client(server.url, creds=caller) as client:
            call = asyncio.create_task(client.call(CAP, {"n": 1}, request_id="rid-sec",
                                                   timeout=30))  # fmt: skip
            await wait_for(lambda: alpha.active == 1, 10, what="alpha runs it")
            reply = await client.cancel("rid-sec")
            assert (reply.state, reply.agent_id) == ("cancelled", "alpha")
            with pytest.raises(reach_agent.Cancelled):
                await asyncio.wait_for(call, 10)
            await wait_for(lambda: alpha.active == 0, 10, what="alpha's slot free")
            rec = await client.wait("rid-sec", 10)
            assert (rec.agent_id, rec.error["code"]) == ("alpha", "CANCELLED")
            queued = await client.submit("secure.nobody", {"n": 2})
            reply = await client.cancel(queued)
            assert (reply.state, reply.agent_id) == ("cancelled", "_broker")
            assert not alpha.watch.violations
    finally:
        gate.open.set()
        await asyncio.wait_for(alpha.stop(grace=2), 20)


def routes_answered(b: Broker) -> float:
    return float(b.metrics.route_result["ok"].value)


async def test_a_caller_routes_from_its_table_under_its_role_until_a_quota_sends_it_to_a_broker(
    auth: AuthDir, server: AuthServer, broker: Broker
) -> None:
    """Secured mode: the caller role may follow the route tables, so a call asks no broker;
    a quota set live (KV ``reach_rules``) is said in the table (``local: false``) and the
    caller's next calls ask a broker, which enforces it on the caller's verified identity."""
    beta = agent(auth, "beta")
    await asyncio.wait_for(beta.start(server.url), 20)
    try:
        await wait_for(lambda: healthy(broker, "beta"), 10, what="beta healthy")
        caller = str(auth.creds("caller", "ops"))
        async with reach_agent.Client(server.url, creds=caller) as client:
            assert await client.call(CAP, {"n": 0}, timeout=10) == {"by": "beta", "got": {"n": 0}}
            routes = client.routes
            assert isinstance(routes, TableRoutes)
            table = routes.follower.followed[CAP].table
            assert table.local is True
            assert routes_answered(broker) == 0
            quota = RouteRule(quota_rate=1.0, quota_burst=2)
            async with connect(server.url, auth.broker_creds, "ops-rules",
                               "_INBOX.broker.broker") as (nc, _):  # fmt: skip
                await rules_kv.put(nc, CAP, rule_encoder.encode(quota))
            await wait_for(lambda: table.local is False, 10, what="the table says: ask a broker")
            for n in range(1, 4):  # a burst of 2: the third is refused once, waited out
                got = await asyncio.wait_for(client.call(CAP, {"n": n}, timeout=10), 15)
                assert got == {"by": "beta", "got": {"n": n}}
        assert routes_answered(broker) == 3
        assert broker.metrics.quota_refused.labels(CAP, "other")._value.get() == 1
    finally:
        await asyncio.wait_for(beta.stop(grace=2), 20)


async def test_an_agent_with_another_agents_credentials_fails_at_start(
    auth: AuthDir, server: AuthServer
) -> None:
    creds = str(auth.creds("agent", "beta"))
    impostor = reach_agent.Agent("alpha", [CAP], creds=creds)
    impostor.handler(CAP)(lambda task: None)
    with pytest.raises(reach_agent.Forbidden) as refused:
        await asyncio.wait_for(impostor.start(server.url), 10)
    assert str(refused.value) == (
        f"agent 'alpha': credentials {creds} (user 'beta') do not allow publishing to "
        "'reach.announce.alpha': issue this identity its own credentials (for an agent: "
        "`reach auth agent <agent_id> --dir DIR`)"
    )
    caller = reach_agent.Agent("ops", [CAP], creds=str(auth.creds("caller", "ops")))
    caller.handler(CAP)(lambda task: None)
    with pytest.raises(reach_agent.Forbidden, match=r"'reach\.announce\.ops'"):
        await asyncio.wait_for(caller.start(server.url), 10)


async def test_a_connection_named_after_another_agent_is_not_taken_for_it(
    auth: AuthDir, server: AuthServer, broker: Broker, caplog: pytest.LogCaptureFixture
) -> None:
    beta = agent(auth, "beta")
    await asyncio.wait_for(beta.start(server.url), 20)
    try:
        await wait_for(lambda: healthy(broker, "beta"), 10, what="beta healthy")
        caplog.set_level(logging.WARNING, "reach_broker.service.advisories")
        # alpha's credential, connection name "beta": its disconnect is not beta's.
        async with connect(server.url, auth.creds("agent", "alpha"), "beta"):
            pass
        await wait_for(lambda: dropped(broker, "advisory", "name_mismatch") == 2, 5,
                       what="connect and disconnect ignored")  # fmt: skip
        await asyncio.sleep(0.2)
        assert healthy(broker, "beta")
        assert "advisories.name_mismatch connection=beta jwt_name=alpha" in caplog.text
        assert await broker.advisories.reconcile() == 0  # beta's own connection counts
    finally:
        await asyncio.wait_for(beta.stop(grace=2), 20)


async def test_a_connection_without_credentials_is_refused(
    auth: AuthDir, server: AuthServer
) -> None:
    with pytest.raises(reach_agent.Forbidden) as refused:
        async with reach_agent.Client(server.url, name="anon"):
            pass
    assert str(refused.value) == (
        f"client 'anon': the server at {server.url} refused the "
        "credentials (none): nats: 'Authorization Violation'"
    )
    anon = reach_agent.Agent("alpha", [CAP])
    anon.handler(CAP)(lambda task: None)
    with pytest.raises(reach_agent.Forbidden, match=r"agent 'alpha': the server at .* refused"):
        await asyncio.wait_for(anon.start(server.url), 10)


async def test_no_read_a_role_may_do_answers_onto_the_jetstream_api(
    auth: AuthDir, server: AuthServer, broker: Broker
) -> None:
    """Any agent may store a claim, `{}` included; a direct get of it answered onto
    `$JS.API.STREAM.DELETE.<stream>` would be an empty request there, and delete the stream.
    Agents and callers read claims and ack records with message gets: their answers are
    wrapped in JSON, never such a request."""
    async with (
        connect(server.url, auth.creds("agent", "alpha"), "alpha", "_INBOX.agent.alpha") as (
            alpha, alpha_errors,
        ),
        connect(server.url, auth.creds("caller", "ops"), "ops", "_INBOX.caller.ops") as (
            ops, ops_errors,
        ),
    ):  # fmt: skip
        await alpha.publish("$KV.reach_claims.empty", b"{}")
        await alpha.publish("reach.ack.alpha.empty", b"{}")
        await alpha.flush()
        for nc, target in ((ops, AUDIT_STREAM), (alpha, ACK_STREAM)):
            await nc.publish("$JS.API.DIRECT.GET.KV_reach_claims.$KV.reach_claims.empty", b"",
                             reply=f"$JS.API.STREAM.DELETE.{target}")  # fmt: skip
            for stream, subject in (("KV_reach_claims", "$KV.reach_claims.empty"),
                                    (ACK_STREAM, "reach.ack.alpha.empty")):  # fmt: skip
                await nc.publish(f"$JS.API.STREAM.MSG.GET.{stream}",
                                 msgspec.json.encode({"last_by_subj": subject}),
                                 reply=f"$JS.API.STREAM.DELETE.{target}")  # fmt: skip
                await nc.publish(f"$JS.API.STREAM.MSG.GET.{stream}",
                                 msgspec.json.encode({"last_by_subj": subject}),
                                 reply=f"$JS.API.STREAM.PURGE.{target}")  # fmt: skip
            await nc.flush()
        direct = "$js.api.direct.get.kv_reach_claims.$kv.reach_claims.empty"
        await ops_errors.wait(violation("publish", direct))
        await alpha_errors.wait(violation("publish", direct))
        async with connect(server.url, auth.broker_creds, "b2", "_INBOX.broker.broker") as (
            b2,
            _,
        ):
            js = b2.jetstream(timeout=5)
            names = {i.config.name for i in await js.streams_info()}
            assert {AUDIT_STREAM, ACK_STREAM, "KV_reach_claims"} <= names
            assert (await js.stream_info(ACK_STREAM)).state.messages == 1  # alpha's `{}`


async def _until_copied(js: Any, subject: str, timeout_s: float = 5.0) -> list[Any]:
    """The messages on ``subject`` that are copies JetStream made (a ``Nats-Stream`` header),
    once there is one."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        found, seq = [], 1
        while True:
            try:
                msg = await js.get_msg(ACK_STREAM, seq=seq, subject=subject, next=True)
            except NotFoundError:
                break
            if (msg.headers or {}).get("Nats-Stream") == ACK_STREAM:
                found.append(msg)
            seq = msg.seq + 1
        if found or loop.time() > deadline:
            return found
        await asyncio.sleep(0.02)


async def test_two_brokers_count_a_callers_quota_by_its_credential_and_only_brokers_forward(
    auth: AuthDir, server: AuthServer
) -> None:
    """Secured mode, two brokers, P = 8: the broker that receives a route request for a
    capability it does not own forwards it with the caller named by the private inbox, so
    a ``Reach-Caller`` header naming someone else changes nothing; and a caller may not
    publish on ``reach.forward.>`` (where a broker's word on the caller is trusted)."""
    cfg = {"nats__creds": str(auth.broker_creds), "fleet__partitions": 8,
           "quotas__rate": 0.1, "quotas__burst": 2}  # fmt: skip
    pair = [Broker(fast_config(server.url, **cfg), metrics=Metrics()) for _ in range(2)]
    for b in pair:
        await asyncio.wait_for(b.start(), 20)
    beta = agent(auth, "beta")
    await asyncio.wait_for(beta.start(server.url), 20)
    try:
        p = pair[0].forwarder.owner_of(CAP)[0]
        owner, other = pair if p in pair[0].tables.book.epochs else pair[::-1]
        beta_p = owner.forwarder.owner_of("beta")[0]  # the partition of beta's id
        beta_at = owner if beta_p in owner.tables.book.epochs else other
        await wait_for(lambda: healthy(beta_at, "beta"), 10, what="beta healthy")
        await wait_for(lambda: other.forwarder.owners.of[p] == owner.forwarder.token, 10,
                       what="the owner read")  # fmt: skip
        admitted = refused = 0
        async with connect(server.url, auth.creds("caller", "ops"), "ops",
                           "_INBOX.caller.ops") as (nc, errors):  # fmt: skip
            for i in range(20):  # a new name each time: each would get a fresh bucket
                msg = await nc.request(f"reach.route.{CAP}", b"", timeout=5,
                                       headers={schema.H_CALLER: f"someone-{i}"})  # fmt: skip
                if msg.headers and msg.headers.get("Nats-Service-Error-Code"):
                    assert msg.headers["Nats-Service-Error-Code"] == "429", msg.headers
                    refused += 1
                else:
                    admitted += 1
            forward = f"reach.forward.{owner.forwarder.token}.{CAP}"
            await nc.publish(forward, b"", headers={schema.H_CALLER: "someone-else"})
            await errors.wait(violation("publish", forward))
        assert (admitted, refused) == (2, 18)
        assert other.metrics.route_forwards.labels("ok")._value.get() > 0
        assert owner.metrics.quota_refused.labels(CAP, "other")._value.get() == 18
    finally:
        await asyncio.wait_for(beta.stop(grace=2), 20)
        for b in reversed(pair):
            await b.stop()
