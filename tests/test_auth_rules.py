"""The pure rules of secured mode: what a credential allows, which ack records are
attributable, and whose final record ``wait`` believes."""

from __future__ import annotations

import base64
import json

import pytest

from jetstream import ackreads, acks
from reach_agent import grants
from reach_agent.client.durable import _Taken
from reach_agent.wire import schema
from reach_agent.wire.subjects import BROKER_ACK_AUTHOR, Subjects, is_inbox

SUBJECTS = Subjects()


def jwt(name: str, pub: list[str], sub: list[str]) -> str:
    claims = {"name": name, "nats": {"pub": {"allow": pub}, "sub": {"allow": sub}}}
    body = base64.urlsafe_b64encode(json.dumps(claims).encode()).rstrip(b"=").decode()
    return f"eyJ0eXAiOiJKV1QifQ.{body}.c2ln"


def test_subject_matching_follows_nats() -> None:
    assert grants.matches("reach.task.alpha.>", "reach.task.alpha.text")
    assert grants.matches("reach.task.alpha.>", "reach.task.alpha.>")
    assert not grants.matches("reach.task.alpha.>", "reach.task.alpha")
    assert grants.matches("reach.event.*.alpha", "reach.event.state.alpha")
    assert grants.matches("reach.event.*.alpha", "reach.event.*.alpha")
    assert not grants.matches("reach.event.state.alpha", "reach.event.*.alpha")
    assert not grants.matches("reach.hb.alpha", "reach.hb.beta")
    assert not grants.matches("reach.ack.alpha.>", "reach.ack.beta.r1")
    assert grants.matches(">", "anything.at.all")


def test_a_credential_names_the_subject_it_refuses() -> None:
    token = jwt("alpha", ["reach.announce.alpha", "reach.hb.alpha"],
                ["reach.task.alpha.>", "_INBOX.agent.alpha.>"])  # fmt: skip
    g = grants.decode_jwt(token)
    assert (g.name, g.inbox_prefix) == ("alpha", "_INBOX.agent.alpha")
    assert grants.jwt_name(token) == "alpha"
    grants.check(g, "/x/alpha.creds", publish=["reach.hb.alpha"],
                 subscribe=["reach.task.alpha.cap"])  # fmt: skip
    with pytest.raises(grants.GrantError) as refused:
        grants.check(g, "/x/alpha.creds", publish=["reach.hb.alpha", "reach.hb.beta"])
    assert str(refused.value).startswith(
        "credentials /x/alpha.creds (user 'alpha') do not allow publishing to 'reach.hb.beta'"
    )
    with pytest.raises(grants.GrantError, match=r"subscribing to 'reach\.task\.beta\.cap'"):
        grants.check(g, "/x/alpha.creds", subscribe=["reach.task.beta.cap"])
    # No list of its own: no limit of its own.
    open_grants = grants.decode_jwt(jwt("any", [], []))
    assert open_grants.may_publish("reach.hb.beta") and open_grants.inbox_prefix is None
    assert grants.jwt_name("not-a-jwt") is None
    with pytest.raises(grants.GrantError, match="not a user JWT"):
        grants.decode_jwt("x.!!!.y")


def test_permission_violations_are_parsed() -> None:
    exc = Exception('nats: permissions violation for publish to "reach.hb.beta"')
    assert grants.violation_of(exc) == grants.Violation("publish", "reach.hb.beta")
    sub = Exception('nats: permissions violation for subscription to "reach.task.beta.>"')
    assert grants.violation_of(sub) == grants.Violation("subscription", "reach.task.beta.>")
    assert grants.violation_of(Exception("nats: stale connection")) is None


def test_replies_go_to_inboxes_only() -> None:
    assert is_inbox("_INBOX.caller.ops.abc.1.1")
    assert is_inbox("_INBOX.abc")
    for subject in ("reach.leave.beta", "$JS.API.STREAM.PURGE.REACH_ACKS", "_INBOX", "x_INBOX.a"):
        assert not is_inbox(subject), subject


def test_ack_subjects_and_message_ids_name_their_author() -> None:
    assert SUBJECTS.ack("beta", "r1") == "reach.ack.beta.r1"
    assert SUBJECTS.acks_of("r1") == "reach.ack.*.r1"
    assert SUBJECTS.acks_by("beta") == "reach.ack.beta.>"
    assert SUBJECTS.ack_of("reach.ack._broker.r1") == (BROKER_ACK_AUTHOR, "r1")
    one, two = (acks.ack_msg_id("beta", "r1", "completed") for _ in range(2))
    assert one != two  # a fresh, unguessable tag per record
    assert acks.parse_msg_id(one)[:3] == ("beta", "r1", "completed")  # type: ignore[index]
    assert acks.parse_msg_id("r1.completed") is None  # an older writer's
    assert acks.state_of({"Nats-Msg-Id": one}) == "completed"


def test_only_attributable_records_are_records() -> None:
    mid = acks.ack_msg_id("beta", "r1", "completed")
    ok = ackreads.attribute("reach.ack.beta.r1", {"Nats-Msg-Id": mid}, b"{}", 3, SUBJECTS)
    assert isinstance(ok, ackreads.StoredAck)
    assert (ok.author, ok.request_id, ok.state, ok.seq) == ("beta", "r1", "completed", 3)
    hdrs = {"Nats-Msg-Id": mid, "Nats-Stream": "REACH_ACKS"}
    copy = ackreads.attribute("reach.ack.beta.r1", hdrs, b"{}", 4, SUBJECTS)
    assert copy == "a copy of a message stored in REACH_ACKS (Nats-Stream header)"
    alpha_id = {"Nats-Msg-Id": acks.ack_msg_id("alpha", "r1", "completed")}
    other = ackreads.attribute("reach.ack.beta.r1", alpha_id, b"{}", 5, SUBJECTS)
    assert isinstance(other, str) and "names alpha/r1, the subject beta/r1" in other
    assert isinstance(ackreads.attribute("reach.ack.beta.r1", None, b"{}", 6, SUBJECTS), str)


def stored(
    author: str, state: str, agent_id: str | None = None, body_rid: str = "r1"
) -> ackreads.StoredAck:
    """A record on ``reach.ack.<author>.r1`` whose body names ``agent_id`` and ``body_rid``."""
    rid = "r1"
    rec = schema.AckRecord(request_id=body_rid, agent_id=agent_id or author, capability="cap",
                           state=state, at_ms=1)  # type: ignore[arg-type]  # fmt: skip
    return ackreads.StoredAck(
        f"reach.ack.{author}.{rid}",
        author,
        rid,
        state,
        schema.encoder.encode(rec),
        acks.ack_msg_id(author, rid, state),
        None,
    )


def test_wait_believes_only_the_taker() -> None:
    taken = _Taken(set())
    # alpha's records, beta named as the agent in the body: disagree with the subject.
    assert taken.accept(stored("alpha", "completed", agent_id="beta")) is None
    # alpha's own record, but nobody says alpha took the request.
    assert taken.accept(stored("alpha", "completed")) is None
    assert taken.accept(stored("beta", "received")) is None
    real = stored("beta", "completed")
    assert taken.accept(real) is None  # kept: the taker is not known yet
    # The broker names beta as the agent it handed the task to: beta's final is the answer.
    assert taken.accept(stored(BROKER_ACK_AUTHOR, "received", agent_id="beta")) is real
    assert taken.answer is not None and taken.answer.agent_id == "beta"


def test_wait_with_a_known_taker_and_the_brokers_failure() -> None:
    taken = _Taken({"beta"})
    assert taken.accept(stored("alpha", "failed")) is None
    assert taken.accept(stored("beta", "completed", body_rid="r2")) is None  # body: r2
    done = stored("beta", "failed")
    assert taken.accept(done) is done
    expired = _Taken(set())
    broker_failed = stored(BROKER_ACK_AUTHOR, "failed", agent_id="host-1")
    assert expired.accept(broker_failed) is broker_failed
    assert expired.answer is not None and expired.answer.agent_id == "host-1"
