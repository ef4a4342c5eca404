"""The agent's pure parts: the admission decision (clock as argument) and the duplicate
window."""

from __future__ import annotations

from typing import Any

from reach_agent.agent.admission import admit
from reach_agent.agent.dedup import DedupCache
from reach_agent.wire import schema


def decide(headers: dict[str, str] | None = None, **kw: Any) -> Any:
    args: dict[str, Any] = {"agent_id": "a1", "duplicate": False, "draining": False,
                            "active": 0, "max_concurrency": 2, "now": 100.0}  # fmt: skip
    args.update(kw)
    return admit(headers or {}, **args)


def test_a_task_runs_with_its_deadline_and_receipt() -> None:
    d = decide({schema.H_TIMEOUT_MS: "1500", schema.H_RECEIPT: "1"})
    assert (d.verdict, d.deadline, d.receipt, d.ack_mode, d.error) == (
        "run", 101.5, True, "completed", None,
    )  # fmt: skip
    d = decide({schema.H_ACK_MODE: "received"})
    assert (d.verdict, d.deadline, d.receipt, d.ack_mode) == ("run", None, True, "received")
    assert decide().receipt is False


def test_the_checks_come_in_the_contract_order() -> None:
    # A duplicate is answered even while draining, busy and looping.
    everything = {"duplicate": True, "draining": True, "active": 2}
    hops = {schema.H_HOPS: "a1,a1,a1"}
    assert decide(hops, **everything).verdict == "duplicate"
    d = decide(hops, draining=True, active=2)
    assert (d.verdict, d.label, d.error.code) == ("refuse", "draining", "DRAINING")
    assert d.error.message == "agent 'a1' is draining: send elsewhere"
    d = decide(hops, active=2)
    assert (d.label, d.error.code) == ("loop", "LOOP_DETECTED")
    assert d.error.message == ("Reach-Hops 'a1,a1,a1' already visits agent 'a1' 3 times "
                               "(limit 3 per trace)")  # fmt: skip
    assert decide({schema.H_HOPS: "a1,x,a1"}).verdict == "run"
    d = decide({schema.H_TIMEOUT_MS: "soon"}, active=2)
    assert (d.label, d.error.code) == ("busy", "TARGET_BUSY")
    assert d.error.message == "agent 'a1' runs 2 tasks, its max_concurrency"


def test_bad_headers_are_invalid_requests_naming_the_header() -> None:
    d = decide({schema.H_TIMEOUT_MS: "-5"})
    assert (d.verdict, d.label, d.error.code) == ("refuse", "invalid", "INVALID_REQUEST")
    assert d.error.message == "header Reach-Timeout-Ms '-5' is not a non-negative integer"
    d = decide({schema.H_ACK_MODE: "whenever"})
    assert d.error.message == "header Reach-Ack-Mode 'whenever' is not 'completed' or 'received'"
    d = decide({schema.H_PARENT_ID: "run 1"})
    assert (d.label, d.error.code) == ("invalid", "INVALID_REQUEST")
    assert d.error.message == ("header Reach-Parent-Id 'run 1' is not a request id "
                               "(1-128 chars of [A-Za-z0-9_-])")  # fmt: skip
    assert decide({schema.H_PARENT_ID: "run-1"}).verdict == "run"


async def test_duplicate_window_keeps_running_entries_and_expires_finished_ones() -> None:
    cache = DedupCache(size=2, ttl=10.0)
    running = cache.begin("r1", 0.0, running=1)
    assert cache.lookup("r1", 1.0) is running
    for i, rid in enumerate(("r2", "r3", "r4")):
        cache.finish(cache.begin(rid, 1.0 + i, running=2), ({}, rid.encode()), 1.0 + i)
    assert len(cache) == 2  # size 2: the oldest finished ones made room ...
    assert cache.lookup("r1", 5.0) is running  # ... never a running one
    assert (cache.lookup("r2", 5.0), cache.lookup("r3", 5.0)) == (None, None)
    r4 = cache.lookup("r4", 5.0)
    assert r4 is not None and r4.future.result() == ({}, b"r4")
    assert cache.lookup("r4", 13.0) is None  # outside the window (finished at 3 + ttl 10)
