"""The A2A gateway's pure parts against the a2a-sdk's own types: every card shape parses
strictly as the 1.0 ``AgentCard`` with its REQUIRED fields set and as the 0.3 model; skills
follow the announce's metadata; messages become payloads and results become parts; reach
errors become the A2A answer the handler docs promise; the binding rule and the token."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

pytest.importorskip("a2a.types", reason="needs the extra 'a2a'")

from a2a.compat.v0_3 import types as v03
from a2a.types import a2a_pb2 as pb
from a2a.utils.errors import ContentTypeNotSupportedError, InternalError, InvalidParamsError
from a2a.utils.proto_utils import validate_proto_required_fields
from google.protobuf.json_format import MessageToDict, ParseDict

from reach_agent.wire import errors
from reach_agent.wire.errors import (
    BizReject,
    Cancelled,
    InputRequired,
    InvalidCapability,
    NoReachableAgent,
    StreamBroken,
    TargetBusy,
)
from reach_agent.wire.schema import Announce, Heartbeat
from reach_broker.config import A2ASection, Config, ConfigError, a2a_token
from reach_broker.core.registry import Registry
from reach_broker.core.routing import Router
from reach_broker.core.tokens import TokenSigner
from reach_broker.interop.a2a import cards
from reach_broker.interop.a2a.binding import binding_error, is_loopback
from reach_broker.interop.a2a.handler import (
    check_required,
    json_of,
    outcome_of,
    part_of,
    payload_of,
)

COMPAT_KEYS = ("url", "preferredTransport", "protocolVersion")
WHERE = cards.Where(base_url="http://127.0.0.1:8080")
WALL_MS = 1_796_000_000_123


def fleet(*announces: Announce) -> tuple[Registry, Router]:
    cfg = Config()
    reg = Registry(
        cfg.detection,
        cfg.scoring,
        TokenSigner(b"k" * 32, 3600.0, wall=lambda: 1_000_000.0),
        interval_ms=cfg.broker.interval_ms,
    )
    for ann in announces:
        reg.announce(ann, 0.0, WALL_MS - 500)
    router = Router(cfg.routing, reg.indexes, lambda a, c: f"reach.task.{a}.{c}",
                    inflight=lambda: reg.inflight, capacity=lambda: reg.capacity)  # fmt: skip
    return reg, router


def announce(agent_id: str, *caps: str, **fields: Any) -> Announce:
    return Announce(agent_id=agent_id, capabilities=list(caps), max_concurrency=4,
                    heartbeat_interval_ms=1000, **fields)  # fmt: skip


def as_json(card: cards.AgentCard) -> dict[str, Any]:
    out: dict[str, Any] = msgspec.json.decode(cards.encoder.encode(card))
    return out


def valid_1_0(data: dict[str, Any]) -> pb.AgentCard:
    """The card as A2A 1.0: parsed with unknown fields refused, REQUIRED fields set."""
    card = ParseDict({k: v for k, v in data.items() if k not in COMPAT_KEYS}, pb.AgentCard())
    validate_proto_required_fields(card)
    return card


def test_an_agent_card_is_a_valid_1_0_and_0_3_card_with_reachs_availability() -> None:
    reg, _ = fleet(announce("alpha", "summarize", "translate", version="1.2.0", region="eu",
                            tags={"tier": "gold"}))  # fmt: skip
    data = as_json(cards.agent_card(reg.agents["alpha"], WHERE, cards.iso_utc(WALL_MS)))
    card = valid_1_0(data)
    assert card.name == "alpha"
    assert card.version == "1.2.0"
    assert [(i.url, i.protocol_binding, i.protocol_version) for i in card.supported_interfaces] == [
        ("http://127.0.0.1:8080/agents/alpha/a2a", "JSONRPC", "1.0"),
        ("http://127.0.0.1:8080/agents/alpha/a2a", "JSONRPC", "0.3"),
    ]
    assert [s.id for s in card.skills] == ["summarize", "translate"]
    assert list(card.skills[0].tags) == ["reach", "region:eu", "tier:gold"]
    [ext] = card.capabilities.extensions
    assert ext.uri == cards.AVAILABILITY_URI
    assert ext.required is False
    params = data["capabilities"]["extensions"][0]["params"]
    assert params == {
        "state": "healthy", "score": 100.0, "load": 0.0, "updated_at": "2026-11-30T00:53:20.123Z",
        "last_seen_ms": WALL_MS - 500, "active": 0, "max_concurrency": 4, "success_rate": 1.0,
    }  # fmt: skip
    assert isinstance(params["last_seen_ms"], int)
    old = v03.AgentCard.model_validate(data)
    assert (old.url, old.preferred_transport, old.protocol_version) == (
        "http://127.0.0.1:8080/agents/alpha/a2a", "JSONRPC", "0.3.0",
    )  # fmt: skip
    assert [s.id for s in old.skills] == ["summarize", "translate"]
    assert old.capabilities.extensions is not None
    assert old.capabilities.extensions[0].params == params


def test_availability_follows_the_registry() -> None:
    reg, _ = fleet(announce("alpha", "summarize"))
    hb = Heartbeat(agent_id="alpha", token=reg.agents["alpha"].token, seq=1, active=3)
    reg.heartbeat(hb, 0.5, WALL_MS)
    reg.disconnected("alpha", 0.6)
    reg.probe_result("alpha", False, None, 0.7)
    data = as_json(cards.agent_card(reg.agents["alpha"], WHERE, cards.iso_utc(WALL_MS)))
    params = data["capabilities"]["extensions"][0]["params"]
    assert (params["state"], params["last_seen_ms"], params["active"]) == ("offline", WALL_MS, 0)
    valid_1_0(data)


def test_skills_come_from_the_announce_metadata_and_bad_hints_are_left_out() -> None:
    meta = {"name": "Alpha summarizer", "description": "Summarizes long texts",
            "skills": {"summarize": {"description": "Summary of a text", "tags": ["nlp", 3],
                                     "examples": ["summarize this"]},
                       "translate": "not a dict"}}  # fmt: skip
    reg, _ = fleet(announce("alpha", "summarize", "translate", metadata=meta))
    card = valid_1_0(as_json(cards.agent_card(reg.agents["alpha"], WHERE, "t")))
    assert (card.name, card.description, card.version) == (
        "Alpha summarizer", "Summarizes long texts", "unversioned",
    )  # fmt: skip
    first, second = card.skills
    assert (first.description, list(first.tags), list(first.examples)) == (
        "Summary of a text", ["reach", "nlp"], ["summarize this"],
    )  # fmt: skip
    assert (second.description, list(second.tags)) == ("translate, served by alpha", ["reach"])


def test_a_token_is_declared_as_a_bearer_scheme() -> None:
    reg, _ = fleet(announce("alpha", "summarize"))
    where = cards.Where(base_url="https://gw.example", token=True)
    card = valid_1_0(as_json(cards.agent_card(reg.agents["alpha"], where, "t")))
    assert card.security_schemes["bearer"].http_auth_security_scheme.scheme == "Bearer"
    assert list(card.security_requirements[0].schemes) == ["bearer"]


def test_agent_cards_filter_by_capability_and_state() -> None:
    reg, _ = fleet(announce("beta", "summarize"), announce("alpha", "summarize", "translate"),
                   announce("gamma", "translate"))  # fmt: skip
    reg.disconnected("gamma", 0.1)
    names = lambda **kw: [c.name for c in cards.agent_cards(reg, WHERE, WALL_MS, **kw).agents]  # noqa: E731
    assert names() == ["alpha", "beta", "gamma"]
    assert names(capability="translate") == ["alpha", "gamma"]
    assert names(state="suspect") == ["gamma"]
    assert names(capability="translate", state="healthy") == ["alpha"]
    assert names(capability="unknown") == []


def test_reachs_card_lists_the_capabilities_routable_now() -> None:
    reg, router = fleet(announce("alpha", "summarize"), announce("gamma", "translate"))
    reg.disconnected("gamma", 0.1)
    data = as_json(cards.reach_card(reg, router, WHERE, "0.1.0", 0.2, WALL_MS))
    card = valid_1_0(data)
    assert (card.name, card.version) == ("reach", "0.1.0")
    assert card.supported_interfaces[0].url == "http://127.0.0.1:8080/a2a"
    assert [s.id for s in card.skills] == ["summarize"]
    assert card.skills[0].description == (
        "summarize: 1 of 1 agents healthy; routed by reach (also POST "
        "http://127.0.0.1:8080/a2a/summarize)"
    )
    assert data["capabilities"]["extensions"][0] == {
        "uri": cards.FLEET_URI, "description": "the fleet as reach sees it now",
        "params": {"agents": 2, "skills_reachable": 1, "updated_at": "2026-11-30T00:53:20.123Z",
                   "by_state": {"healthy": 1, "suspect": 1, "offline": 0, "recovering": 0,
                                "draining": 0}},
    }  # fmt: skip
    assert v03.AgentCard.model_validate(data).url == "http://127.0.0.1:8080/a2a"


def message(*parts: dict[str, Any]) -> pb.Message:
    return ParseDict({"messageId": "m1", "role": "ROLE_USER", "parts": list(parts)}, pb.Message())


def test_payloads_of_messages() -> None:
    assert payload_of(message({"data": {"n": 4, "x": [1.5, 2]}})) == {"n": 4, "x": [1.5, 2]}
    assert payload_of(message({"text": "hello"}, {"text": "world"})) == {"text": "hello\nworld"}
    assert payload_of(message({"data": "just a string"})) == "just a string"
    assert payload_of(message({"text": "see"}, {"data": {"n": 1}}, {"text": "this"})) == {
        "text": "see\nthis", "data": [{"n": 1}]}  # fmt: skip
    assert payload_of(message({"data": 1}, {"data": 2})) == {"data": [1, 2]}
    with pytest.raises(ContentTypeNotSupportedError) as url_part:
        payload_of(message({"text": "look"}, {"url": "https://x/y.png", "mediaType": "image/png"}))
    assert url_part.value.message == (
        "message.parts[1] is a url part (image/png): the gateway forwards text and data parts "
        "(text/plain, application/json) to reach agents"
    )
    with pytest.raises(InvalidParamsError) as blank:
        payload_of(message({}))
    assert blank.value.message == (
        "message.parts[0] is empty: a part holds text, data, raw bytes or a URL"
    )
    with pytest.raises(InvalidParamsError) as empty:
        payload_of(message())
    assert empty.value.message == "message.parts is empty: nothing to send"


def test_a_request_without_a_required_field_is_refused_naming_it() -> None:
    cases = [
        ({}, "params.message is required"),
        ({"message": {"role": "ROLE_USER", "parts": [{"text": "x"}]}},
         "params.message.messageId is required"),
        ({"message": {"messageId": "m", "parts": [{"text": "x"}]}},
         "params.message.role is required (ROLE_USER)"),
    ]  # fmt: skip
    for params, why in cases:
        with pytest.raises(InvalidParamsError) as refused:
            check_required(ParseDict(params, pb.SendMessageRequest()))
        assert refused.value.message == why
    check_required(ParseDict({"message": {"messageId": "m", "role": "ROLE_USER"}},
                             pb.SendMessageRequest()))  # fmt: skip


def test_results_become_parts() -> None:
    assert MessageToDict(part_of("done")) == {"text": "done", "mediaType": "text/plain"}
    assert MessageToDict(part_of({"n": 4})) == {"data": {"n": 4.0}, "mediaType": "application/json"}
    assert json_of(MessageToDict(part_of({"n": 4, "f": 0.5}))["data"]) == {"n": 4, "f": 0.5}


def test_reach_errors_become_task_states_or_a2a_errors() -> None:
    assert outcome_of(BizReject("text is empty")) == (
        pb.TASK_STATE_REJECTED, "BIZ_REJECT: text is empty")  # fmt: skip
    assert outcome_of(InputRequired("which language?")) == (
        pb.TASK_STATE_INPUT_REQUIRED, "INPUT_REQUIRED: which language?")  # fmt: skip
    assert outcome_of(Cancelled("by its caller")) == (
        pb.TASK_STATE_CANCELED, "CANCELLED: by its caller")  # fmt: skip
    assert outcome_of(errors.InternalError("handler raised ValueError: x")) == (
        pb.TASK_STATE_FAILED, "INTERNAL: handler raised ValueError: x")  # fmt: skip
    assert outcome_of(StreamBroken("agent lost", delivered=2)) == (
        pb.TASK_STATE_FAILED, "STREAM_BROKEN: agent lost")  # fmt: skip
    with pytest.raises(InternalError) as unreachable:
        outcome_of(NoReachableAgent("no agent has the capability 'x'"))
    assert unreachable.value.message == "NO_REACHABLE_AGENT: no agent has the capability 'x'"
    assert unreachable.value.data == {"code": "NO_REACHABLE_AGENT"}
    with pytest.raises(InternalError) as busy:
        outcome_of(TargetBusy("agent at max_concurrency"))
    assert busy.value.data == {"code": "TARGET_BUSY"}
    with pytest.raises(InvalidParamsError) as invalid:
        outcome_of(InvalidCapability("capability 'A B' is not valid"))
    assert invalid.value.message == "INVALID_CAPABILITY: capability 'A B' is not valid"


def test_beyond_loopback_needs_a_token() -> None:
    assert [is_loopback(h) for h in ("127.0.0.1", "::1", "localhost", "0.0.0.0", "10.1.2.3")] == [
        True, True, True, False, False,
    ]  # fmt: skip
    assert binding_error(A2ASection(port=8080)) is None
    assert binding_error(A2ASection(port=0, host="0.0.0.0")) is None  # off
    assert binding_error(A2ASection(port=8080, host="0.0.0.0")) == (
        "--a2a-host 0.0.0.0 listens beyond loopback: give a token with --a2a-token or "
        "REACH_A2A_TOKEN, or the console's --console-token (16 or more characters)"
    )
    assert binding_error(A2ASection(port=8080, host="0.0.0.0", token="t" * 16)) is None


def test_a_token_is_16_to_256_safe_characters() -> None:
    assert a2a_token("abcdefghijklmnop", "--a2a-token") == "abcdefghijklmnop"
    with pytest.raises(ConfigError) as short:
        a2a_token("short", "--a2a-token")
    assert str(short.value) == (
        "--a2a-token: an A2A token is 16 to 256 of the characters A-Z a-z 0-9 . _ ~ + / = - "
        "(got 5 characters)"
    )
