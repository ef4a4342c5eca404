"""A2A task records without a server: a task's state from its turns, the page tokens, when
a request without a final record is lost, and a record as an A2A ``Task``."""

from __future__ import annotations

import pytest

pytest.importorskip("a2a.types", reason="needs the extra 'a2a'")

from a2a.types import a2a_pb2 as pb
from a2a.utils.errors import InvalidParamsError

from reach_agent.wire.schema import Claim
from reach_broker.interop.a2a import tasks
from reach_broker.interop.a2a.tasks import TaskRecord, Turn


def turn(rid: str, state: str, at_ms: int, text: str | None = None) -> Turn:
    return Turn(request_id=rid, state=f"TASK_STATE_{state}", at_ms=at_ms, text=text)


def record(*turns: Turn, history: int = 1) -> TaskRecord:
    messages = [{"messageId": f"m{i}", "role": "ROLE_USER", "parts": [{"text": f"t{i}"}]}
                for i in range(history)]  # fmt: skip
    return TaskRecord(id="t-1", context_id="c-1", capability="cap", created_ms=1,
                      turns=list(turns), history=messages)  # fmt: skip


def test_a_task_works_while_any_turn_does_else_it_is_its_last_turns_state() -> None:
    done = turn("t-1", "COMPLETED", 10)
    assert record(done).state == pb.TASK_STATE_COMPLETED
    both = record(done, turn("t-1-2", "WORKING", 20))
    assert (both.state, both.text, both.updated_ms) == (pb.TASK_STATE_WORKING, None, 20)
    first_runs = record(
        turn("t-1", "SUBMITTED", 30), turn("t-1-2", "REJECTED", 25, "BIZ_REJECT: no")
    )
    assert (first_runs.state, first_runs.updated_ms) == (pb.TASK_STATE_WORKING, 30)
    asked = record(done, turn("t-1-2", "INPUT_REQUIRED", 40, "INPUT_REQUIRED: which?"))
    assert (asked.state, asked.text) == (pb.TASK_STATE_INPUT_REQUIRED, "INPUT_REQUIRED: which?")
    assert asked.state not in tasks.TERMINAL
    assert [tasks.state_of_code(c) for c in ("CANCELLED", "BIZ_REJECT", "INPUT_REQUIRED",
                                             "INTERNAL", "TIMEOUT")] == [
        pb.TASK_STATE_CANCELED, pb.TASK_STATE_REJECTED, pb.TASK_STATE_INPUT_REQUIRED,
        pb.TASK_STATE_FAILED, pb.TASK_STATE_FAILED]  # fmt: skip


def test_a_record_is_a_task_with_its_status_history_and_artifacts() -> None:
    rec = record(turn("t-1", "FAILED", 1_700_000_000_123, "INTERNAL: boom"), history=3)
    task = tasks.task_of(rec)
    assert (task.id, task.context_id, task.status.state) == ("t-1", "c-1", pb.TASK_STATE_FAILED)
    assert task.status.timestamp.ToMilliseconds() == 1_700_000_000_123
    assert task.status.message.parts[0].text == "INTERNAL: boom"
    assert [m.message_id for m in task.history] == ["m0", "m1", "m2"]
    assert [m.message_id for m in tasks.task_of(rec, history_length=2).history] == ["m1", "m2"]
    assert list(tasks.task_of(rec, history_length=0).history) == []
    two = record(turn("t-1", "COMPLETED", 1), turn("t-1-2", "COMPLETED", 2))
    assert [tasks.artifact_id(two, r) for r in ("t-1", "t-1-2")] == ["result", "result-2"]


def test_page_tokens_name_a_position_and_anything_else_is_refused() -> None:
    rec = record(turn("t-1", "WORKING", 1234))
    token = tasks.page_token(rec)
    assert tasks.read_page_token(token) == (1234, "t-1")
    for bad in ("invalid-token-xyz", "p1.!!!", "p1." + "eA", token + "x" * 3, "p1.MTp4Lnk"):
        with pytest.raises(InvalidParamsError, match="is not a page token of this gateway"):
            tasks.read_page_token(bad)
    newer, older = record(turn("a", "WORKING", 20)), record(turn("b", "WORKING", 10))
    assert sorted([older, newer], key=tasks.order_key) == [newer, older]


def claim(state: str, at_ms: int, reason: str | None = None) -> Claim:
    return Claim(request_id="t-1", agent_id="alpha", instance="i", capability="cap",
                 state=state, at_ms=at_ms, ack_subject="reach.ack.alpha.t-1",
                 reason=reason)  # type: ignore[arg-type]  # fmt: skip


def test_a_request_without_a_final_record_is_lost_only_when_its_claim_says_so() -> None:
    now = 100_000
    assert tasks.lost_reason(None, now) is None
    assert tasks.lost_reason(claim("running", 1), now) is None
    assert tasks.lost_reason(claim("released", 1, "offline"), now) == (
        "LOST: agent alpha went offline before it finished (offline); nothing runs it now"
    )
    assert tasks.lost_reason(claim("completed", now - 1_000), now) is None  # record on its way
    assert tasks.lost_reason(claim("completed", now - 31_000), now) == (
        "LOST: agent alpha ended it (completed) but stored no ack record: its result is not "
        "kept (an agent without durable acks)")  # fmt: skip


def test_the_owner_is_anonymous_or_a_digest_of_the_token() -> None:
    assert tasks.owner_of(None) == "anon"
    owner = tasks.owner_of("a-test-token-0123456789")
    assert owner.startswith("t") and len(owner) == 17 and "token" not in owner
    assert owner != tasks.owner_of("another-token-0123456789")
