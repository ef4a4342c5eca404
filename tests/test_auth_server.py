"""Credentials issued by reach_broker.auth, enforced by a real nats-server in operator mode.

Plain nats-py connections with the issued credentials prove what each role may and may not
do; every refusal is the server's own (a permissions violation reaching the client's error
callback, naming the subject), so a forged message never reaches any subscriber.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
from nats.errors import NoRespondersError
from nats.js.api import StreamConfig

from reach_agent.connection import flush_subscriptions
from reach_agent.routing.table import partition
from reach_broker.auth import AuthDir, claims, init, issue_agent, issue_caller, push_account, revoke
from reach_broker.auth.claims import UserClaims

from .auth_helpers import HEARD, AuthServer, Inbox, auth_server, connect, mapped, violation
from .conftest import wait_for


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


def agent_creds(d: AuthDir, agent: str) -> Path:
    return d.creds("agent", agent)


async def store_ack(d: AuthDir, url: str, agent: str, request_id: str) -> int:
    """An ack record written by ``agent`` itself (nobody else may); its stream sequence."""
    async with connect(url, agent_creds(d, agent), agent, f"_INBOX.agent.{agent}") as (nc, _):
        ack = await nc.jetstream(timeout=5).publish(
            f"reach.ack.{agent}.{request_id}", b'{"state":"completed"}'
        )
        return int(ack.seq)


async def test_agent_cannot_act_for_another_agent(auth: AuthDir, server: AuthServer) -> None:
    async with (
        connect(server.url, auth.broker_creds, "broker", "_INBOX.broker.broker") as (broker, _),
        connect(server.url, agent_creds(auth, "alpha"), "alpha", "_INBOX.agent.alpha") as (
            alpha,
            errors,
        ),
    ):
        seen = Inbox()
        for subject in (HEARD, "reach.event.>"):
            await broker.subscribe(subject, cb=seen.record)
        await flush_subscriptions(broker)  # one flush() may overtake the SUBs (nats-py)
        beta_tasks = Inbox()
        await alpha.subscribe("reach.task.beta.>", cb=beta_tasks.record)
        forged = (
            "reach.hb.beta",
            "reach.leave.beta",
            "reach.announce.beta",
            "reach.event.state.beta",
        )
        for subject in forged:
            await alpha.publish(subject, b'{"agent_id":"beta"}')
        # alpha's own heartbeat goes out after the forgeries on the same connection: once the
        # broker has it, anything the server let through would already be there.
        await alpha.publish("reach.hb.alpha", b"{}")
        await seen.wait("reach.hb.alpha")
        assert seen.subjects == ["reach.hb.alpha"]
        for subject in forged:
            await errors.wait(violation("publish", mapped(subject)))
        await errors.wait(violation("subscription", "reach.task.beta.>"))
        # A task for beta does not reach alpha's refused subscription.
        async with connect(server.url, auth.creds("caller", "ops"), "ops", "_INBOX.caller.ops") as (
            ops,
            _,
        ):
            await ops.publish("reach.task.beta.echo", b"secret")
            await ops.flush()
        await alpha.flush()
        assert beta_tasks.msgs == []
        assert len(errors.seen) == len(forged) + 1, errors.seen


async def test_agent_uses_its_own_subjects(auth: AuthDir, server: AuthServer) -> None:
    async with (
        connect(server.url, auth.broker_creds, "broker", "_INBOX.broker.broker") as (broker, _),
        connect(server.url, agent_creds(auth, "alpha"), "alpha", "_INBOX.agent.alpha") as (
            alpha,
            errors,
        ),
        connect(server.url, auth.creds("caller", "ops"), "ops", "_INBOX.caller.ops") as (ops, _),
    ):
        js = broker.jetstream(timeout=5)
        await js.add_stream(
            StreamConfig(name="REACH_ACKS", subjects=["reach.ack.>"], allow_direct=True)
        )
        seen = Inbox()
        for subject in (HEARD,):
            await broker.subscribe(subject, cb=seen.record)
        await flush_subscriptions(broker)  # one flush() may overtake the SUBs (nats-py)

        async def on_task(msg: object) -> None:
            reply = msg.reply  # type: ignore[attr-defined]
            await alpha.publish(reply, b"receipt")
            await alpha.publish(reply, b"chunk")
            await alpha.publish(reply, b"result")
            await alpha.publish(reply + "x", b"not a reply subject it received")

        async def on_probe(msg: object) -> None:
            await alpha.publish(msg.reply, b'{"ok":true}')  # type: ignore[attr-defined]

        events = Inbox()
        await alpha.subscribe("reach.task.alpha.>", cb=on_task)
        await alpha.subscribe("reach.probe.alpha", cb=on_probe)
        await alpha.subscribe("reach.event.*.alpha", cb=events.record)
        await alpha.subscribe("reach.reannounce.alpha", cb=events.record)
        await alpha.flush()
        await alpha.flush()

        for subject in ("reach.announce.alpha", "reach.hb.alpha", "reach.leave.alpha"):
            await alpha.publish(subject, b"{}")
            await seen.wait(subject)
        # Replies to the requests it received: a probe from the broker, a task from a caller
        # (receipt, streamed chunks, result: any number within the reply window); a subject it
        # never received as a reply subject is refused.
        probe = await broker.request("reach.probe.alpha", b"{}", timeout=5)
        assert probe.data == b'{"ok":true}'
        replies = Inbox()
        inbox = ops.new_inbox()
        assert inbox.startswith("_INBOX.caller.ops.")
        await ops.subscribe(inbox, cb=replies.record)
        await flush_subscriptions(ops)
        await ops.publish("reach.task.alpha.echo", b"hi", reply=inbox)
        await errors.wait(violation("publish", inbox + "x"))
        await wait_for(lambda: len(replies.msgs) == 3, 5, what="receipt, chunk and result")
        assert [m.data for m in replies.msgs] == [b"receipt", b"chunk", b"result"]
        # Its ack records, stored by JetStream under its own name only.
        ajs = alpha.jetstream(timeout=5)
        ack = await ajs.publish(
            "reach.ack.alpha.r1",
            b'{"state":"completed"}',
            headers={"Nats-Msg-Id": "alpha.r1.completed"},
        )
        assert (ack.stream, ack.seq, ack.duplicate) == ("REACH_ACKS", 1, None)
        await alpha.publish("reach.ack.beta.r1", b'{"state":"completed"}')
        await errors.wait(violation("publish", "reach.ack.beta.r1"))
        # Events about itself.
        await broker.publish("reach.event.state.alpha", b'{"to":"healthy"}')
        await events.wait("reach.event.state.alpha")
        # A broker's request to announce again.
        await broker.publish("reach.reannounce.alpha", b"{}")
        await events.wait("reach.reannounce.alpha")
        assert len(errors.seen) == 2, errors.seen


async def test_caller_permissions(auth: AuthDir, server: AuthServer) -> None:
    async with (
        connect(server.url, auth.broker_creds, "broker", "_INBOX.broker.broker") as (broker, _),
        connect(server.url, auth.creds("caller", "ops"), "ops", "_INBOX.caller.ops") as (
            ops,
            errors,
        ),
    ):
        bjs = broker.jetstream(timeout=5)
        for name, subject in (
            ("REACH_ACKS", "reach.ack.>"),
            ("REACH_AUDIT", "reach.event.>"),
            ("REACH_COMPENSATION", "reach.comp.>"),
        ):
            await bjs.add_stream(StreamConfig(name=name, subjects=[subject], allow_direct=True))
        assert await store_ack(auth, server.url, "beta", "r1") == 1
        seen = Inbox()
        for subject in (HEARD, "reach.event.>"):
            await broker.subscribe(subject, cb=seen.record)
        await flush_subscriptions(broker)  # one flush() may overtake the SUBs (nats-py)

        refused = (
            "reach.hb.alpha",
            "reach.announce.alpha",
            "reach.leave.alpha",
            "reach.event.state.alpha",
            "reach.ack.alpha.r2",
        )
        for subject in refused:
            await ops.publish(subject, b"{}")
        tasks = Inbox()
        await ops.subscribe("reach.task.>", cb=tasks.record)
        for subject in refused:
            await errors.wait(violation("publish", mapped(subject)))
        await errors.wait(violation("subscription", "reach.task.>"))
        # Route (nobody answers here: the broker is not running), call, submit, wait.
        with pytest.raises(NoRespondersError):
            await ops.request("reach.route.text.summarize", b"{}", timeout=2)
        with pytest.raises(NoRespondersError):
            await ops.request("reach.agents", b"{}", timeout=2)
        with pytest.raises(NoRespondersError):
            await ops.request("reach.task.alpha.echo", b"{}", timeout=2)
        js = ops.jetstream(timeout=5)
        queued = await js.publish("reach.comp.text.summarize", b"{}")
        assert (queued.stream, queued.seq) == ("REACH_COMPENSATION", 1)
        last = await js.get_last_msg("REACH_ACKS", "reach.ack.beta.r1")
        assert (last.seq, last.data) == (1, b'{"state":"completed"}')
        assert (await js.stream_info("REACH_ACKS")).state.messages == 1
        first = await js.get_msg("REACH_ACKS", seq=1, subject="reach.ack.beta.r1", next=True)
        assert first.seq == 1
        acks, events = Inbox(), Inbox()
        await ops.subscribe("reach.ack.>", cb=acks.record)
        await ops.subscribe("reach.event.>", cb=events.record)
        await ops.flush()
        await ops.flush()
        await store_ack(auth, server.url, "beta", "r2")
        # An outcome summary: mapped into the agent's partition, and allowed there.
        await ops.publish("reach.outcome.alpha", b"{}")
        await seen.wait("reach.outcome.alpha")
        await broker.publish("reach.event.state.beta", b"{}")
        await acks.wait("reach.ack.beta.r2")
        await events.wait("reach.event.state.beta")
        # No other stream's contents, no consumers (a push consumer's deliver subject is not
        # checked against its creator's permissions).
        # No direct get either (its answer is the stored message itself, published to any
        # reply subject the requester names).
        for subject in (
            "$JS.API.DIRECT.GET.REACH_ACKS",
            "$JS.API.DIRECT.GET.REACH_COMPENSATION",
            "$JS.API.CONSUMER.CREATE.REACH_AUDIT",
        ):
            await ops.publish(subject, b"{}")
            await errors.wait(violation("publish", subject))
        # The broker's event, not the caller's; the summary as the server mapped it.
        assert seen.subjects == ["reach.outcome.alpha", "reach.event.state.beta"]
        assert seen.msgs[0].subject == f"reach.part.{partition('alpha', 32)}.outcome.alpha"
        assert tasks.msgs == []


async def test_connection_without_credentials_is_refused(auth: AuthDir, server: AuthServer) -> None:
    with pytest.raises(Exception) as refused:
        async with connect(server.url, None, "anonymous"):
            pass
    assert "Authorization Violation" in str(refused.value)


async def test_revoked_agent_is_disconnected_and_refused(auth: AuthDir, server: AuthServer) -> None:
    pid = server.pid
    kept = auth.root / "alpha-kept.creds"
    kept.write_bytes(agent_creds(auth, "alpha").read_bytes())
    closed = asyncio.Event()

    async def on_closed() -> None:
        closed.set()

    async with (
        connect(
            server.url,
            agent_creds(auth, "alpha"),
            "alpha",
            "_INBOX.agent.alpha",
            allow_reconnect=True,
            closed_cb=on_closed,
        ) as (alpha, _),
        connect(server.url, agent_creds(auth, "beta"), "beta", "_INBOX.agent.beta") as (beta, _),
    ):
        assert revoke(auth, "alpha").revoked_at is not None
        assert await push_account(auth, server.url) == "jwt updated"
        await asyncio.wait_for(closed.wait(), 5)
        # The server sent -ERR 'User Authentication Revoked' and closed the connection;
        # nats-py takes that error as final: no reconnect.
        assert str(alpha.last_error) == "nats: user authentication revoked"
        assert alpha.is_closed
        await beta.publish("reach.hb.beta", b"{}")
        await beta.flush(timeout=2)  # the others keep working
        assert beta.is_connected
    # The revoked credential (a copy kept from before) is refused on connect.
    with pytest.raises(Exception) as refused:
        async with connect(server.url, kept, "alpha"):
            pass
    assert "Authorization Violation" in str(refused.value)
    # A credential issued now needs no server change.
    async with connect(server.url, issue_agent(auth, "gamma"), "gamma", "_INBOX.agent.gamma") as (
        gamma,
        _,
    ):
        await gamma.publish("reach.hb.gamma", b"{}")
        await gamma.flush(timeout=2)
    assert server.pid == pid  # never restarted


async def test_revocation_holds_across_a_restart(auth: AuthDir, tmp_path: Path) -> None:
    """Revoked while the server is down: the resolver dir it loads at start has it."""
    alpha = agent_creds(auth, "alpha")
    kept = tmp_path / "alpha.creds"
    kept.write_bytes(alpha.read_bytes())
    revoke(auth, "alpha")
    with auth_server(auth, tmp_path / "nats") as server:
        with pytest.raises(Exception) as refused:
            async with connect(server.url, kept, "alpha"):
                pass
        assert "Authorization Violation" in str(refused.value)
        async with connect(server.url, agent_creds(auth, "beta"), "beta") as (beta, _):
            await beta.flush(timeout=2)


async def test_broker_sees_disconnect_advisories(auth: AuthDir, server: AuthServer) -> None:
    account = auth.meta().account
    async with connect(server.url, auth.broker_creds, "broker", "_INBOX.broker.broker") as (
        broker,
        errors,
    ):
        info = json.loads((await broker.request("$SYS.REQ.USER.INFO", b"", timeout=5)).data)
        assert (info["data"]["account"], info["data"]["user_name"]) == (account, "broker")
        seen = Inbox()
        await broker.subscribe(f"$SYS.ACCOUNT.{account}.CONNECT", cb=seen.record)
        await broker.subscribe(f"$SYS.ACCOUNT.{account}.DISCONNECT", cb=seen.record)
        await broker.flush()
        await broker.flush()
        async with connect(server.url, agent_creds(auth, "alpha"), "alpha"):
            connz = await broker.request(
                f"$SYS.REQ.ACCOUNT.{account}.CONNZ", b'{"auth": true}', timeout=5
            )
            conns = {c["name"]: c for c in json.loads(connz.data)["data"]["connections"]}
            alpha_key = claims.read_creds(agent_creds(auth, "alpha"))[0]
            assert conns["alpha"]["jwt"] == alpha_key
            ping = await broker.request("$SYS.REQ.SERVER.PING.CONNZ", b"", timeout=5)
            names = {c["name"] for c in json.loads(ping.data)["data"]["connections"]}
            assert names == {"broker", "alpha"}
        await seen.wait(f"$SYS.ACCOUNT.{account}.DISCONNECT")
        advisory = json.loads(seen.msgs[-1].data)
        assert advisory["type"] == "io.nats.server.advisory.v1.client_disconnect"
        client = advisory["client"]
        alpha_user = claims.decode(client["jwt"], UserClaims)
        assert (client["name"], alpha_user.name, client["acc"]) == ("alpha", "alpha", account)
        assert client["user"] == alpha_user.sub
        # The connection name is the client's word; the user JWT's name (the agent id it was
        # issued for) is the server's. A broker must take a disconnect as an agent's only
        # when the two agree.
        async with connect(server.url, agent_creds(auth, "alpha"), "beta"):
            pass
        await wait_for(lambda: len(seen.msgs) == 4, 5, what="impostor connect + disconnect")
        impostor = json.loads(seen.msgs[-1].data)["client"]
        assert (impostor["name"], claims.decode(impostor["jwt"], UserClaims).name) == (
            "beta",
            "alpha",
        )
        assert errors.seen == []


async def test_server_does_not_check_reply_subjects(auth: AuthDir, server: AuthServer) -> None:
    """What permissions cannot do, pinned so reach's receivers keep checking content.

    The server never checks a message's *reply* subject against its sender's permissions:
    whoever answers publishes there with the answerer's rights. JetStream answers every API
    request and every publish; an agent may answer what it receives (``allow_responses``).
    So whoever may read a stream can have a stored message copied onto ``reach.event.*`` (and
    captured by the audit stream): verbatim, ``Nats-Stream`` header added, with a direct get
    (only the broker's credential has it), wrapped in JSON with a message get (callers); and
    a PubAck ``{"stream":…,"seq":…}`` lands on any subject named as reply.
    """
    async with (
        connect(server.url, auth.broker_creds, "broker", "_INBOX.broker.broker") as (broker, _),
        connect(server.url, auth.creds("caller", "ops"), "ops", "_INBOX.caller.ops") as (ops, _),
    ):
        bjs = broker.jetstream(timeout=5)
        await bjs.add_stream(
            StreamConfig(name="REACH_ACKS", subjects=["reach.ack.>"], allow_direct=True)
        )
        await bjs.add_stream(StreamConfig(name="REACH_COMPENSATION", subjects=["reach.comp.>"]))
        await store_ack(auth, server.url, "beta", "r1")
        seen = Inbox()
        await broker.subscribe("reach.event.>", cb=seen.record)
        await broker.subscribe("reach.leave.*", cb=seen.record)
        await broker.flush()
        await broker.flush()
        await broker.publish(
            "$JS.API.DIRECT.GET.REACH_ACKS", b'{"seq":1}', reply="reach.event.state.beta"
        )
        await ops.publish(
            "$JS.API.STREAM.MSG.GET.REACH_ACKS", b'{"seq":1}', reply="reach.event.state.gamma"
        )
        await ops.publish("reach.comp.x", b"{}", reply="reach.leave.beta")
        await wait_for(lambda: len(seen.msgs) == 3, 5, what="the three laundered messages")
        copy = next(m for m in seen.msgs if m.subject == "reach.event.state.beta")
        assert (copy.data, copy.headers["Nats-Stream"]) == (b'{"state":"completed"}', "REACH_ACKS")
        wrapped = next(m for m in seen.msgs if m.subject == "reach.event.state.gamma")
        assert msgspec.json.decode(wrapped.data)["message"]["subject"] == "reach.ack.beta.r1"
        assert wrapped.headers is None
        pub_ack = next(m for m in seen.msgs if m.subject == "reach.leave.beta")
        assert msgspec.json.decode(pub_ack.data) == {"stream": "REACH_COMPENSATION", "seq": 1}
