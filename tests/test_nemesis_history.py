"""The nemesis's history checker (loadtest/history.py), on synthetic histories: each kind of
violation of the delivery guarantee is found, each exception the guarantee states is
excused (and counted), and a clean history has none. Pure: no server, no clock."""

from __future__ import annotations

import json

from loadtest import nemesis
from loadtest.faults import KINDS, schedule
from loadtest.history import (
    Ack,
    Event,
    Fault,
    History,
    Link,
    Op,
    Proc,
    Run,
    Violation,
    check,
    parse_agent_log,
    parse_caller_log,
    parse_links,
)
from reach_broker.core import states

A1, A2 = "a1", "a2"


def proc(agent: str = A1, instance: str = "i1", killed: float | None = None) -> Proc:
    return Proc(agent=agent, instance=instance, pid=100, started=0.0, killed=killed)


def run(rid: str, start: float, end: float | None, *, agent: str = A1, instance: str = "i1",
        n: int = 1, outcome: str | None = "ok", code: str | None = None) -> Run:  # fmt: skip
    return Run(rid=rid, agent=agent, instance=instance, run=f"{instance}-{rid}-{n}", start=start,
               end=end, outcome=outcome if end is not None else None, code=code)  # fmt: skip


def called(rid: str, r: Run | None, t: float = 0.0, code: str | None = None,
           op: str = "call") -> Op:  # fmt: skip
    if r is None:
        return Op(caller="c1", op=op, rid=rid, invoked=t, returned=t + 1, ok=False, code=code)
    return Op(caller="c1", op=op, rid=rid, invoked=t, returned=t + 1, ok=True, agent=r.agent,
              run=r.run)  # fmt: skip


def completed(r: Run) -> Ack:
    return Ack(author=r.agent, rid=r.rid, agent=r.agent, state="completed", run=r.run)


def clean_call(rid: str, start: float = 1.0) -> tuple[Run, Op, Ack]:
    r = run(rid, start, start + 0.5)
    return r, called(rid, r, start - 0.1), completed(r)


def history(*items: object, **kw: object) -> History:
    h = History(ended=100.0, procs=[proc(), proc(A2, "i2")], **kw)  # type: ignore[arg-type]
    for item in items:
        {Run: h.runs, Op: h.ops, Ack: h.acks, Event: h.events, Fault: h.faults, Link: h.links}[
            type(item)
        ].append(item)  # type: ignore[attr-defined]
    return h


def kinds(violations: list[Violation]) -> list[tuple[str, str | None]]:
    return [(v.kind, v.request_id or v.agent) for v in violations]


def test_a_clean_history_has_no_violation_and_counts_what_it_checked() -> None:
    r1, o1, k1 = clean_call("c1-1")
    r2, o2, k2 = clean_call("c1-2", 3.0)
    reject = run("c1-3", 5.0, 5.2, outcome="error", code="BIZ_REJECT")
    sub = run("c1-4", 7.0, 7.5, agent=A2, instance="i2")
    h = history(
        r1, o1, k1, r2, o2, k2, reject, called("c1-3", None, 4.9, "BIZ_REJECT"),
        Ack(author=A1, rid="c1-3", agent=A1, state="failed", code="BIZ_REJECT"),
        Op(caller="c1", op="submit", rid="c1-4", invoked=6.0, returned=6.1, ok=True),
        sub, completed(sub),
        Op(caller="c1", op="wait", rid="c1-4", invoked=8.0, returned=8.1, ok=True,
           state="completed", agent=A2, run=sub.run),
        called("c1-1", r1, 20.0, op="repeat"),
    )  # fmt: skip
    verdict = check(h)
    assert verdict.violations == []
    assert (verdict.calls, verdict.submits, verdict.resolved, verdict.unresolved) == (3, 1, 4, [])
    assert verdict.runs == 4


def test_a_run_after_a_completed_run_unless_its_holder_was_cut_off_and_released() -> None:
    first, op, rec = clean_call("c1-1")  # runs 1.0 - 1.5
    second = run("c1-1", 4.0, 4.5, agent=A2, instance="i2")
    verdict = check(history(first, op, rec, second))
    assert kinds(verdict.violations) == [("run_after_final", "c1-1")]
    assert "no broker released the first run's claim" in verdict.violations[0].seen

    # Released, but nothing was wrong with the holder: a false declaration.
    released = Event(kind="released", agent=A1, at=3.0, rid="c1-1", broker="b1")
    verdict = check(history(first, op, rec, second, released))
    assert kinds(verdict.violations) == [("run_after_final", "c1-1")]
    assert "no fault on its holder's path explains" in verdict.violations[0].seen

    # Its link stalled as its handler returned, until after the release: the claim's end
    # could not be stored, and the guarantee lets the request run again.
    stalled = Fault(kind="agent_stall", target=A1, start=1.4, end=3.5)
    verdict = check(history(first, op, rec, second, released, stalled))
    assert verdict.violations == []
    assert verdict.excused == {"after_release": 1}

    # Its process was killed while the end was retried, and the store (electing a leader)
    # took the broker's release only 20 s later: that process never stores the end.
    killed = run("c1-2", 1.0, 1.5, instance="i9")
    later = run("c1-2", 40.0, 40.5, agent=A2, instance="i2", n=2)
    slow = Event(kind="released", agent=A1, at=21.5, rid="c1-2", broker="b1")
    h = history(killed, later, slow)
    h.procs.append(proc(A1, "i9", killed=2.0))
    assert check(h).violations == []

    # A release long after the run ended, even on an honest declaration: the claim's end was
    # left unstored (a retried end is stored once the store answers).
    late = Event(kind="released", agent=A1, at=100.0, rid="c1-1", broker="b1")
    cut = Fault(kind="agent_cut", target=A1, start=98.0, end=101.0)
    third = run("c1-1", 101.0, 101.5, agent=A2, instance="i2", n=3)
    verdict = check(history(first, op, rec, third, late, cut))
    assert kinds(verdict.violations) == [("run_after_final", "c1-1")]
    assert "98.5 s after the run ended: its end was left unstored" in verdict.violations[0].seen


def test_a_run_after_a_refused_run_is_a_violation() -> None:
    first = run("c1-1", 1.0, 1.2, outcome="error", code="BIZ_REJECT")
    second = run("c1-1", 2.0, 2.2, agent=A2, instance="i2")
    verdict = check(history(first, second))
    assert kinds(verdict.violations) == [("run_after_final", "c1-1")]


def test_a_run_after_a_retryable_end_or_a_crash_is_allowed() -> None:
    drained = run("c1-1", 1.0, 1.2, outcome="cancelled")
    again = run("c1-1", 2.0, 2.2, agent=A2, instance="i2")
    crashed = run("c1-2", 3.0, None, instance="i3")
    rerun = run("c1-2", 6.0, 6.5, agent=A2, instance="i2", n=2)
    h = history(drained, again, crashed, rerun)
    h.procs.append(proc(A1, "i3", killed=4.0))
    verdict = check(h)
    assert verdict.violations == []
    assert verdict.excused == {"after_retryable_end": 1, "after_crash": 1}


def test_overlapping_runs_unless_the_first_holder_was_cut_off_and_released() -> None:
    first = run("c1-1", 1.0, 5.0)
    second = run("c1-1", 3.0, 3.5, agent=A2, instance="i2")
    verdict = check(history(first, second))
    assert kinds(verdict.violations) == [("overlapping_runs", "c1-1")]

    released = Event(kind="released", agent=A1, at=2.5, rid="c1-1", broker="b2")
    cut = Fault(kind="agent_cut", target=A1, start=1.5, end=4.0)
    verdict = check(history(first, second, released, cut))
    assert verdict.violations == []
    assert verdict.excused == {"after_release": 1}
    # A declaration without the claim's release proves nothing about the claim.
    offline = Event(kind="state", agent=A1, at=2.5, to="offline", broker="b2")
    assert kinds(check(history(first, second, offline, cut)).violations) == [
        ("overlapping_runs", "c1-1")
    ]

    # The node the holder was linked to was stopped: a partition too.
    node = Fault(kind="node_stop", target="n2", start=1.5, end=4.0)
    on_n2 = Link(owner=A1, node="n2", opened=0.0, closed=1.8)
    assert check(history(first, second, released, node, on_n2)).violations == []
    on_n3 = Link(owner=A1, node="n3", opened=0.0)
    assert kinds(check(history(first, second, released, node, on_n3)).violations) == [
        ("overlapping_runs", "c1-1")
    ]


def test_a_run_that_neither_ended_nor_was_killed_is_a_violation() -> None:
    verdict = check(history(run("c1-1", 1.0, None)))
    assert kinds(verdict.violations) == [("run_never_ended", "c1-1")]


def test_an_answer_without_its_stored_record_is_a_violation() -> None:
    r, op, _ = clean_call("c1-1")
    verdict = check(history(r, op))
    assert kinds(verdict.violations) == [("completed_without_ack", "c1-1")]
    assert "REACH_ACKS has no completed record" in verdict.violations[0].seen

    ghost = Op(caller="c1", op="call", rid="c1-2", invoked=1.0, returned=2.0, ok=True,
               agent=A1, run="i1-99")  # fmt: skip
    verdict = check(history(ghost))
    assert kinds(verdict.violations) == [("completed_without_ack", "c1-2")]
    assert verdict.violations[0].seen.endswith("which is no run")

    rejected = run("c1-3", 1.0, 1.1, outcome="error", code="BIZ_REJECT")
    verdict = check(history(rejected, called("c1-3", None, 0.9, "BIZ_REJECT")))
    assert kinds(verdict.violations) == [("failed_without_ack", "c1-3")]


def test_a_call_whose_caller_never_got_its_final_answer_is_unresolved() -> None:
    r, _, rec = clean_call("c1-1")
    gave_up = [called("c1-1", None, 0.9, "TIMEOUT"), called("c1-1", None, 30.0, "TIMEOUT",
                                                          op="recall")]  # fmt: skip
    verdict = check(history(r, rec, *gave_up))
    assert kinds(verdict.violations) == [("no_final_state", "c1-1")]
    assert verdict.unresolved == ["c1-1"]
    assert "recall TIMEOUT" in verdict.violations[0].seen

    resolved = [*gave_up, called("c1-1", r, 40.0, op="recall")]
    assert check(history(r, rec, *resolved)).violations == []

    hung = Op(caller="c1", op="call", rid="c1-2", invoked=1.0)
    assert kinds(check(history(hung)).violations) == [
        ("call_never_returned", "c1-2"), ("no_final_state", "c1-2")]  # fmt: skip


def test_a_call_cancelled_at_its_deadline_is_resolved_by_its_cancelled_record() -> None:
    """The caller's deadline passes while its agent holds the request: the agent is told to
    stop, the run ends ``CANCELLED`` and its ``failed`` record says so; every recall gets
    ``CANCELLED`` (a cancelled request id never runs again): resolved, not ``no_final_state``
    (c3-000297 of a CI run, 93 recalls). A ``CANCELLED`` answer whose request completed
    instead is ``failed_without_ack``."""
    stopped = run("c1-1", 1.0, 12.0, outcome="cancelled", code="CANCELLED")
    record = Ack(author=A1, rid="c1-1", agent=A1, state="failed", run=stopped.run,
                 code="CANCELLED")  # fmt: skip
    answers = [
        called("c1-1", None, 0.9, "TIMEOUT"),
        *(called("c1-1", None, 30.0 + i, "CANCELLED", op="recall") for i in range(3)),
    ]
    verdict = check(history(stopped, record, *answers))
    assert (verdict.violations, verdict.unresolved) == ([], [])

    done, _, stored = clean_call("c1-2")
    wrong = [called("c1-2", None, 0.9, "TIMEOUT"), called("c1-2", None, 30.0, "CANCELLED",
                                                          op="recall")]  # fmt: skip
    verdict = check(history(done, stored, *wrong))
    assert kinds(verdict.violations) == [("failed_without_ack", "c1-2")]


def test_a_cancelled_copy_that_never_ran_is_backed_by_its_agents_record() -> None:
    """Seed 20's c2-000051: a4's claim was stored unconfirmed, so it refused the task; the
    caller's deadline told a4 to cancel (a note: it ran nothing); the recall reached a4, which
    took its own claim over and ended it ``CANCELLED`` without a handler run. Its record, by
    an agent with no run of the request, backs the recall's ``CANCELLED``."""
    noted = Ack(author="a4", rid="c2-51", agent="a4", state="failed", run=None,
                code="CANCELLED")  # fmt: skip
    answers = [called("c2-51", None, 0.9, "TIMEOUT"),
               called("c2-51", None, 30.0, "CANCELLED", op="recall")]  # fmt: skip
    verdict = check(history(noted, *answers))
    assert (verdict.violations, verdict.unresolved) == ([], [])
    assert kinds(check(history(*answers)).violations) == [("failed_without_ack", "c2-51")]


def test_a_submitted_task_lost_or_left_queued_is_a_violation() -> None:
    queued = Op(caller="c1", op="submit", rid="c1-1", invoked=1.0, returned=1.1, ok=True)
    waited = Op(caller="c1", op="wait", rid="c1-1", invoked=9.0, returned=19.0, ok=False,
                code="TIMEOUT")  # fmt: skip
    verdict = check(history(queued, waited))
    assert kinds(verdict.violations) == [("submit_lost", "c1-1")]
    verdict = check(history(queued, waited, queued=["c1-1"]))
    assert kinds(verdict.violations) == [("no_final_state", "c1-1")]
    assert verdict.violations[0].seen.endswith("still queued")

    full = Op(caller="c1", op="submit", rid="c1-2", invoked=1.0, returned=1.1, ok=False,
              code="COMPENSATION_FULL")  # fmt: skip
    verdict = check(history(full))
    assert (verdict.violations, verdict.refused) == ([], 1)


def beats(agent: str, t0: float, t1: float, every: float = 1.0) -> dict[str, list[float]]:
    return {agent: [t0 + i * every for i in range(int((t1 - t0) / every) + 1)]}


def test_an_agent_declared_offline_while_its_heartbeats_flowed_and_nothing_touched_it() -> None:
    offline = Event(kind="state", agent=A1, at=20.0, to="offline", broker="b1")
    verdict = check(history(offline, beats=beats(A1, 0.0, 30.0)))
    assert kinds(verdict.violations) == [("offline_while_healthy", A1)]
    assert "broker b1 declared a1 offline at 20.000" in verdict.violations[0].seen
    assert verdict.declarations == 1

    # A 3 s gap in what reached the cluster: not healthy and reachable.
    gap = {A1: [t for t in beats(A1, 0.0, 30.0)[A1] if not 15.0 < t < 18.0]}
    assert check(history(offline, beats=gap)).violations == []
    # Its link was cut within the detection window.
    cut = Fault(kind="agent_cut", target=A1, start=15.0, end=16.0)
    assert check(history(offline, cut, beats=beats(A1, 0.0, 30.0))).violations == []
    # The node its connection was on was killed a moment before (its heartbeats had not
    # missed a beat yet): it was not reachable then.
    node = Fault(kind="node_kill", target="n2", start=19.7, end=22.0)
    on_n2 = Link(owner=A1, node="n2", opened=0.0, closed=19.8)
    assert check(history(offline, node, on_n2, beats=beats(A1, 0.0, 30.0))).violations == []
    # A fault on a broker excuses nothing.
    stopped = Fault(kind="broker_stop", target="b1", start=12.0, end=19.0)
    assert kinds(check(history(offline, stopped, beats=beats(A1, 0.0, 30.0))).violations) == [
        ("offline_while_healthy", A1)
    ]
    # The broker named a 3 s silence ("no heartbeat for 3.00s"): a cut 5 s before explains
    # nothing (nemesis seed 43: the 6 s window excused such a declaration); within the 3 s
    # (and the slack) it does.
    named = Event(kind="state", agent=A1, at=20.0, to="offline", broker="b1", silence_s=3.0)
    early = Fault(kind="agent_cut", target=A1, start=14.0, end=15.0)
    assert kinds(check(history(named, early, beats=beats(A1, 0.0, 30.0))).violations) == [
        ("offline_while_healthy", A1)
    ]
    assert check(history(offline, early, beats=beats(A1, 0.0, 30.0))).violations == []
    late = Fault(kind="agent_cut", target=A1, start=16.6, end=17.0)
    assert check(history(named, late, beats=beats(A1, 0.0, 30.0))).violations == []


def test_the_logs_parse_into_the_records_the_checker_reads() -> None:
    ops = parse_caller_log("c1", "\n".join(json.dumps(x) for x in [
        {"ev": "invoke", "op": "call", "rid": "c1-1", "t": 1.0},
        {"ev": "invoke", "op": "submit", "rid": "c1-2", "t": 1.5},
        {"ev": "ok", "op": "call", "rid": "c1-1", "t": 2.0, "agent": A1, "run": "i1-1"},
        {"ev": "fail", "op": "submit", "rid": "c1-2", "t": 2.5, "code": "TIMEOUT"},
        {"ev": "invoke", "op": "call", "rid": "c1-3", "t": 3.0},
    ]) + '\n{"ev": "ok", "op": "ca')  # fmt: skip
    assert ops == [
        Op(caller="c1", op="call", rid="c1-1", invoked=1.0, returned=2.0, ok=True, agent=A1,
           run="i1-1"),
        Op(caller="c1", op="submit", rid="c1-2", invoked=1.5, returned=2.5, ok=False,
           code="TIMEOUT"),
        Op(caller="c1", op="call", rid="c1-3", invoked=3.0),
    ]  # fmt: skip
    procs, runs = parse_agent_log("\n".join(json.dumps(x) for x in [
        {"ev": "process", "agent": A1, "instance": "i1", "pid": 7, "t": 0.5},
        {"ev": "start", "rid": "c1-1", "run": "i1-1", "t": 1.0},
        {"ev": "start", "rid": "c1-2", "run": "i1-2", "t": 1.1},
        {"ev": "end", "rid": "c1-1", "run": "i1-1", "t": 1.5, "outcome": "ok"},
    ]), killed={7: 3.0})  # fmt: skip
    assert procs == [Proc(agent=A1, instance="i1", pid=7, started=0.5, killed=3.0)]
    assert runs == [
        Run(rid="c1-1", agent=A1, instance="i1", run="i1-1", start=1.0, end=1.5, outcome="ok"),
        Run(rid="c1-2", agent=A1, instance="i1", run="i1-2", start=1.1),
    ]
    links = parse_links("\n".join(json.dumps(x) for x in [
        {"name": "a1.n2", "link": 1, "ev": "open", "t": 1.0},
        {"name": "a1.n2", "link": 2, "ev": "open", "t": 1.1},
        {"name": "a1.n2", "link": 1, "ev": "close", "t": 4.0},
    ]))  # fmt: skip
    assert links == [Link(owner=A1, node="n2", opened=1.0, closed=4.0),
                     Link(owner=A1, node="n2", opened=1.1)]  # fmt: skip


def test_the_fault_schedule_is_a_function_of_the_seed() -> None:
    options = {"duration": 60.0, "interval": 5.0, "warmup": 5.0, "agents": ["a1", "a2", "a3", "a4"],
               "brokers": ["b1", "b2"], "nodes": ["n1", "n2", "n3"]}  # fmt: skip
    plan = schedule(7, **options)  # type: ignore[arg-type]
    assert plan == schedule(7, **options)  # type: ignore[arg-type]
    assert plan != schedule(8, **options)  # type: ignore[arg-type]
    assert len(plan) >= 10 and {p.kind for p in plan} <= set(KINDS)
    assert all(p.at + p.hold <= 60.0 for p in plan)
    for group, most in (("node", 1), ("broker", 1), ("agent", 2)):
        for p in plan:
            overlapping = [q for q in plan if q.group == group and q.at <= p.at < q.at + q.hold + 3]
            assert len(overlapping) <= most


def test_the_monitor_reads_the_silence_a_broker_names_as_its_reason() -> None:
    """The nemesis's pattern and the broker's reason stay one format (the checker's window
    comes from it)."""
    reason = states.SILENCE.format(silence=3.094, interval=1.0)
    said = nemesis.SILENCE.match(reason)
    assert said is not None and float(said[1]) == 3.09
    assert nemesis.SILENCE.match("disconnected and probe unanswered") is None
