"""The client's pure parts: the retry rule, the route cache (fake clock) and how one attempt
of a call ends (replies fed to its queue, no server)."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import pytest
from nats.aio.msg import Msg

from jetstream.claims import ClaimsUnavailable
from jetstream.names import H_REQUEST_ID
from reach_agent.client.calls import Call, encode_payload
from reach_agent.client.holder import Holders
from reach_agent.client.routes import RouteCache
from reach_agent.wire import schema
from reach_agent.wire.errors import (
    BizReject,
    CompensationFull,
    Draining,
    InternalError,
    InvalidRequest,
    LoopDetected,
    NoReachableAgent,
    Overloaded,
    ReachError,
    StoreUnavailable,
    TargetBusy,
    Timeout,
    from_reply,
    to_reply,
)
from reach_agent.wire.retry import full_wait, merely_full, retryable, should_retry
from reach_agent.wire.subjects import Subjects

# --- the retry rule ---------------------------------------------------------------------


def test_error_replies_are_retried_exactly_when_the_error_says_so() -> None:
    yes = [TargetBusy("x"), Draining("x"), Overloaded("x"), Timeout("x")]
    no = [BizReject("x"), LoopDetected("x"), InternalError("x"), NoReachableAgent("x"),
          CompensationFull("x"), ReachError("x", code="SOMETHING_NEW")]  # fmt: skip
    assert [retryable("error", e) for e in yes] == [True] * 4
    assert [retryable("error", e) for e in no] == [False] * 6
    assert [retryable(o) for o in ("not_delivered", "no_responders", "timeout", "lost")] == [
        True, True, True, True,
    ]  # fmt: skip
    assert (retryable("closed"), retryable("ok"), retryable("error")) == (False, False, False)


def test_should_retry_needs_retries_left_and_time_for_one_more_attempt() -> None:
    draining = Draining("bye")
    common: dict[str, Any] = {"max_retries": 2, "min_attempt_s": 0.05}
    assert should_retry("error", draining, retries_done=1, time_left_s=1.0, **common) is True
    assert should_retry("error", draining, retries_done=2, time_left_s=1.0, **common) is False
    assert should_retry("lost", Timeout("x"), retries_done=2, time_left_s=1.0, **common) is False
    assert should_retry("error", draining, retries_done=0, time_left_s=0.05, **common) is False
    assert should_retry("error", BizReject("no"), retries_done=0, time_left_s=9, **common) is False


def test_merely_full_is_waited_out_until_the_deadline_not_counted() -> None:
    common: dict[str, Any] = {"max_retries": 2, "min_attempt_s": 0.05}
    for full in (TargetBusy("full"), Overloaded("all full", retry_after_ms=20)):
        assert merely_full("error", full) is True
        assert should_retry("error", full, retries_done=2, time_left_s=1.0, **common) is True
        assert should_retry("error", full, retries_done=9, time_left_s=0.05, **common) is False
    assert [merely_full("error", e) for e in (Draining("x"), Timeout("x"), BizReject("x"))] == [
        False, False, False]  # fmt: skip
    assert merely_full("lost", TargetBusy("x")) is False
    # The wait: the hint (else the default), times 0.5 + rand, at most the cap.
    hinted = Overloaded("all full", retry_after_ms=20)
    assert [full_wait(hinted, 0.05, 10.0, r) for r in (0.0, 0.5)] == [0.01, 0.02]
    assert full_wait(TargetBusy("full"), 0.05, 10.0, 0.5) == 0.05
    assert full_wait(Overloaded("x", retry_after_ms=60_000), 0.05, 10.0, 0.9) == 10.0


def test_retry_after_ms_travels_in_the_error_body_and_a_bad_one_is_no_hint() -> None:
    headers, body = to_reply(Overloaded("every agent is full", retry_after_ms=20))
    assert headers == {"Nats-Service-Error": "every agent is full",
                       "Nats-Service-Error-Code": "429"}  # fmt: skip
    assert json.loads(body) == {"error": {"code": "OVERLOADED", "message": "every agent is full",
                                          "retry_after_ms": 20}}  # fmt: skip
    err = from_reply(headers, body)
    assert (type(err), err.code, err.retry_after_ms) == (Overloaded, "OVERLOADED", 20)
    assert b"retry_after_ms" not in to_reply(NoReachableAgent("none"))[1]
    for hint, read in (("20.7", 20), ('"soon"', None), ("-1", None), ("true", None)):
        data = b'{"error": {"code": "OVERLOADED", "message": "m", "retry_after_ms": %s}}'
        err = from_reply(headers, data % hint.encode())
        assert (err.code, err.retry_after_ms) == ("OVERLOADED", read)


# --- the route cache --------------------------------------------------------------------


def cand(agent_id: str, score: float = 1.0) -> schema.Candidate:
    return schema.Candidate(agent_id=agent_id, subject=f"reach.task.{agent_id}.cap",
                            score=score, state="healthy", load=0.0)  # fmt: skip


def test_route_cache_falls_back_prunes_bounds_and_lists_stale_routes() -> None:
    now = [0.0]
    cache = RouteCache(2, lambda: now[0])
    f1 = schema.Filters(tags={"b": "2", "a": "1"})
    k1 = RouteCache.key("cap", f1)
    assert k1 == RouteCache.key("cap", schema.RouteRequest(tags={"a": "1", "b": "2"}, limit=7))
    assert k1 == RouteCache.key("cap", schema.Filters(tags={"a": "1", "b": "2"}, sticky_key="k"))
    # Every other filter tells routes apart (a cached route answers only its own filters).
    for other in (schema.Filters(tags={"a": "1"}), schema.Filters(tags=f1.tags, region="eu"),
                  schema.Filters(tags=f1.tags, canary="2"),
                  schema.Filters(tags=f1.tags, requires=["pii"]),
                  schema.Filters(tags=f1.tags, min_context_tokens=1),
                  schema.Filters(tags=f1.tags, allow_suspect=True)):  # fmt: skip
        assert RouteCache.key("cap", other) != k1, other
    cache.store(
        k1, schema.RouteRequest(tags=f1.tags, limit=3), [cand("x"), cand("y"), cand("z")], 3
    )
    assert cache.fallback(RouteCache.key("other", schema.NO_FILTERS), 3, []) == []
    picked = cache.fallback(k1, 2, ["y"], rand=lambda: 0.5)
    assert len(picked) == 2 and {c.agent_id for c in picked} <= {"x", "z"}
    cache.drop_agent("x")
    assert [c.agent_id for r in cache.routes() for c in r.candidates] == ["y", "z"]
    assert cache.fallback(k1, 3, ["y", "z"]) == []
    now[0] = 10.0
    assert [(k, r.filters) for k, r in cache.stale(10.0)] == [(k1, f1)]  # asked again as f1
    now[0] = 400.0  # unused for 30 refresh periods: no longer refreshed
    assert cache.stale(10.0) == []
    k2, k3 = (RouteCache.key(c, schema.NO_FILTERS) for c in ("c2", "c3"))
    cache.store(k2, schema.NO_FILTERS, [cand("a")], 1)
    cache.store(
        k3, schema.NO_FILTERS, [cand("b")], 1
    )  # size 2: the least recently stored (k1) goes
    assert [c.agent_id for r in cache.routes() for c in r.candidates] == ["a", "b"]


# --- how an attempt ends ----------------------------------------------------------------


def call(ack_mode: Any = "completed", deadline_s: float = 5.0) -> Call:
    c = Call("1", "cap", b"{}", {"x-custom": "v"}, request_id="r-1", traceparent=None,
             ack_mode=ack_mode, deadline=time.monotonic() + deadline_s)  # fmt: skip
    c.attempt, c.agent_id = 2, "a1"
    return c


def reply(data: bytes, **headers: str) -> Msg:
    return Msg(_client=None, subject="_INBOX.x.1.2", data=data, headers=headers or None)  # type: ignore[arg-type]


def receipt() -> Msg:
    return reply(b'{"request_id":"r-1","status":"received"}', **{schema.H_STATUS: "received"})


async def outcome(c: Call, ack_timeout_s: float = 1.0) -> tuple[str, Any]:
    return await asyncio.wait_for(c.outcome(time.monotonic(), ack_timeout_s, time.monotonic), 5)


async def test_headers_of_a_call_and_of_each_attempt() -> None:
    c = call(ack_mode="received")
    # Outside any task a call starts a trace: a new traceparent, Reach-Trace-Id its trace id.
    traceparent = c.headers[schema.H_TRACEPARENT]
    assert c.headers == {"x-custom": "v", H_REQUEST_ID: "r-1", schema.H_RECEIPT: "1",
                         schema.H_ACK_MODE: "received", schema.H_TRACEPARENT: traceparent,
                         schema.H_TRACE_ID: traceparent[3:35]}  # fmt: skip
    assert c.attempt_headers(c.deadline - 1.5)[schema.H_TIMEOUT_MS] == "1500"


async def test_receipt_then_result_and_a_late_result_of_an_earlier_attempt_wins() -> None:
    c = call()
    c.deliver("2", receipt())
    c.deliver("2", reply(b'{"y": 1}'))
    assert await outcome(c) == ("ok", {"y": 1})
    c = call()
    c.deliver("1", reply(b'{"late": true}'))  # attempt 1 answers after all
    assert await outcome(c) == ("ok", {"late": True})


async def test_only_the_current_attempt_decides_errors_and_receipt_mode_returns_the_receipt() -> (
    None
):
    c = call()
    headers, body = to_reply(TargetBusy("full"))
    c.deliver("1", reply(body, **headers))  # an earlier attempt's error: ignored
    c.deliver("2", reply(body, **headers))
    kind, err = await outcome(c)
    assert (kind, err.code) == ("error", "TARGET_BUSY")
    c = call(ack_mode="received")
    c.deliver("2", receipt())
    # The receipt names the agent the answered attempt went to (the caller's word, not the
    # body's), and that agent is the call's taker.
    assert await outcome(c) == ("ok", schema.Receipt(request_id="r-1", agent_id="a1"))
    assert c.taker == "a1"


async def test_no_receipt_no_responders_lost_and_closed() -> None:
    kind, err = await outcome(call(), ack_timeout_s=0.05)
    assert kind == "not_delivered"
    assert err.message == "not delivered: no receipt from agent 'a1' within 0.05s"
    c = call()
    c.subject = "reach.task.a1.cap"  # where Attempts.send sent it
    c.deliver("2", reply(b"", Status="503"))
    kind, err = await outcome(c)
    assert (kind, err.code) == ("no_responders", "NO_REACHABLE_AGENT")
    # The agent's subject, not the reply's (nemesis seed 34: it named the caller's own inbox).
    assert err.message == "no responders: agent 'a1' is not subscribed to 'reach.task.a1.cap'"
    c = call()
    c.deliver("2", receipt())
    c.lose()
    kind, err = await outcome(c)
    assert (kind, err.message) == ("lost", "agent 'a1' was lost while running the task")
    c = call()
    c.lose()  # before any receipt (nemesis seed 58: c1-001197, which a1 never received)
    kind, err = await outcome(c)
    assert (kind, err.message) == ("lost", "agent 'a1' was lost before its receipt")
    c = call()
    c.close()
    assert (await outcome(c))[0] == "closed"


async def test_only_agents_that_may_have_taken_the_request_are_its_runners() -> None:
    """An agent whose attempt met no responders, or that refused before any receipt, never
    took the request: a timed-out call waits for no record of it (nemesis seeds 69-71: 12
    calls waited until their deadlines for such agents). One that sent its receipt, then an
    error, did take it."""
    c = call()
    c.agents = {1: "deaf", 2: "a1"}
    c.attempt, c.agent_id = 1, "deaf"
    c.deliver("1", reply(b"", Status="503"))
    assert (await outcome(c))[0] == "no_responders"
    c.attempt, c.agent_id = 2, "a1"
    headers, body = to_reply(StoreUnavailable("its claim was not confirmed"))
    c.deliver("2", reply(body, **headers))
    assert (await outcome(c))[0] == "error"
    assert (c.untaken, c.runners()) == ((1, 2), set())
    c.agents[3] = "a2"
    c.attempt, c.agent_id = 3, "a2"
    c.deliver("3", receipt())
    headers, body = to_reply(TargetBusy("full"))
    c.deliver("3", reply(body, **headers))
    assert (await outcome(c))[0] == "error"
    assert (c.untaken, c.runners()) == ((1, 2), {"a2"})
    # Refusals that come late, during a later attempt: a3's attempt had ended with no
    # receipt (it never took the request: an agent that could not confirm its claim refuses
    # after its claim timeout), a4's after its receipt (it did take it).
    c.agents.update({4: "a3", 5: "a4", 6: "a5"})
    c.attempt, c.agent_id = 4, "a3"
    assert (await outcome(c, ack_timeout_s=0.05))[0] == "not_delivered"
    c.attempt, c.agent_id = 5, "a4"
    c.deliver("5", receipt())
    c.lose()
    assert (await outcome(c))[0] == "lost"
    c.attempt, c.agent_id = 6, "a5"
    c.deliver("4", reply(body, **headers))
    c.deliver("5", reply(body, **headers))
    c.deliver("6", reply(b'{"ok": 1}'))
    assert await outcome(c) == ("ok", {"ok": 1})
    assert (c.untaken, c.runners()) == ((1, 2, 4), {"a2", "a4", "a5"})


def test_a_reply_naming_no_attempt_made_is_dropped() -> None:
    """Attempt numbers are bits of ``Call.received``: a reply naming one not made yet (a
    forged or garbled reply subject) never reaches the call, so no huge number is a shift."""
    c = call()
    for attempt in ("3", "0", "-1", "99999999999", "x"):
        c.deliver(attempt, receipt())
    assert c.queue.qsize() == 0
    c.deliver("2", receipt())
    c.deliver("1", receipt())
    assert c.queue.qsize() == 2


async def test_accepted_but_no_result_by_the_deadline_is_a_timeout() -> None:
    c = call(deadline_s=0.1)
    c.deliver("2", receipt())
    kind, err = await outcome(c)
    assert (kind, err.code) == ("timeout", "TIMEOUT")


def test_deliver_ignores_a_reply_subject_that_is_not_ours() -> None:
    c = call()
    c.deliver("not-a-number", reply(b"{}"))
    assert c.queue.empty()


def test_payload_encoding_and_a_clear_error_for_what_is_not_json() -> None:
    assert (encode_payload(None), encode_payload(b"raw"), encode_payload({"a": 1})) == (
        b"", b"raw", b'{"a":1}',
    )  # fmt: skip
    with pytest.raises(InvalidRequest) as info:
        encode_payload(object())
    assert info.value.message.startswith("payload is not JSON-serializable")


class SlowThenEmpty:
    """A claims store whose first read is not answered within the time it is given (the
    claims stream electing a leader), and which holds no claim after."""

    def __init__(self) -> None:
        self.reads: list[float | None] = []

    async def get(self, key: str, timeout_s: float | None = None) -> None:
        self.reads.append(timeout_s)
        if len(self.reads) == 1:
            assert timeout_s is not None
            await asyncio.sleep(timeout_s)
            raise ClaimsUnavailable(f"JetStream did not return the claim {key!r}")


async def test_a_watch_for_nobody_running_a_request_reads_again_soon_after_a_failed_read() -> None:
    """``Holders.until_free`` gives a read 0.5 s and reads again 0.1 s after one that
    failed, not after ``claim_poll_s``: the one read of nemesis seed 79's c3-000709 took
    its whole 2 s as the claims stream elected a leader, the next came 2 s later, with no
    room left for an attempt (on the parent: None at the end of the 1.5 s window here)."""
    store = SlowThenEmpty()
    holders = Holders(None, poll_s=2.0, subjects=Subjects(), store=store)  # type: ignore[arg-type]
    # Within the window: read, failed after 0.5 s, read again 0.1 s later (the parent's
    # next read, 2 s on, fell after the window's end).
    assert await asyncio.wait_for(holders.until_free("r-free", 1.5), 5) == "unclaimed"
    assert store.reads == [0.5, 0.5]
