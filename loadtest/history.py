"""The history checker of ``loadtest.nemesis``: every breach of the delivery guarantee
(docs/protocol.md, "The delivery guarantee") found in what a run wrote down.

Pure: :func:`check` takes a :class:`History` — the callers' operations, the handlers' runs,
the agent processes, the ack records of ``REACH_ACKS``, the brokers' events, the faults,
the proxied links, the heartbeats an independent monitor saw, the entries left in the
compensation queue — and returns a :class:`Verdict`. The ``parse_*`` functions turn the
run's JSON-lines logs into those records; the I/O is ``loadtest.nemesis``'s. All times are
Unix seconds (``time.time()``: the handlers, callers, proxies and the monitor stamp with it,
the brokers' events carry it in ms), so records of different processes compare.

What is a violation (``Violation.kind``), exactly as the guarantee states it:

- ``run_after_final`` — a run of a request id starts after another run of it ended in a
  final state (its handler returned, or refused with a non-retryable error);
- ``overlapping_runs`` — two runs of one request id overlap in time;
- neither counts when the first run's process was killed before the second began (a
  crash: the run never finished), when the first run ended with a retryable error (its
  holder released the claim), or when a broker released the first run's claim (its
  ``released`` event for the request id, naming the holder: the claim was still
  ``running``, the holder's end of it not stored) before the second began, on a declaration
  a fault explains — a fault on the holder's own path (its process killed or stopped, its
  link cut or stalled, the NATS node it was linked to killed or stopped) within
  ``Rules.offline_window_s`` before the release, or its process killed for good — and, when
  the first run had ended, within ``Rules.end_pending_s`` of its end (the holder retries its
  claim's end until it is stored: a release long after means the end was left unstored).
  Those second runs are counted in ``Verdict.excused``;
- ``completed_without_ack`` — the caller got a run's result and ``REACH_ACKS`` holds no
  ``completed`` record of that run by its agent (or the run it names never completed);
  ``failed_without_ack`` — the same for a run's own error (``BIZ_REJECT``), and a
  ``CANCELLED`` answer with no ``failed`` record saying ``CANCELLED`` (by any author: a copy
  of a request its agent had been told to cancel ends so without running its handler);
- ``no_final_state`` — a call whose caller, sending it again with the same request id once
  every fault was healed, never got its final answer (a result, or the run's own error), or
  a submitted task whose final record the caller's ``Client.wait`` never got;
  ``call_never_returned`` — an operation that never returned;
  ``run_never_ended`` — a run that neither ended nor had its process killed;
- ``submit_lost`` — of those, a submit the queue acknowledged whose task never ran, has no
  final record and is no longer queued;
- ``offline_while_healthy`` — a broker declared an agent ``offline`` although, for the
  whole detection window before (``Rules.offline_window_s``), no fault touched its process,
  its link or the NATS node it was linked to, and the monitor saw its heartbeats reach the
  cluster with no gap longer than ``Rules.beat_gap_s``: it was healthy and reachable.
"""

from __future__ import annotations

import bisect
import itertools
import json
from collections import defaultdict
from collections.abc import Iterable, Iterator
from typing import Any

import msgspec

AGENT_FAULTS = ("agent_kill", "agent_stop", "agent_cut", "agent_stall")
NODE_FAULTS = ("node_kill", "node_stop")
BROKER_ACK_AUTHOR = "_broker"
RETRYABLE_CODES = frozenset({"DRAINING", "TARGET_BUSY", "OVERLOADED", "TIMEOUT"})
"""A run that ends with one of these releases its claim itself: another may run it."""
RUN_ERROR_CODES = frozenset({"BIZ_REJECT", "CANCELLED"})
"""A call's error that only a run produces (the handler refused; a run stopped by a cancel,
or the brokers settling a cancel no agent answered): it needs its record."""
FINAL_CODES = frozenset({
    "BIZ_REJECT", "INVALID_REQUEST", "INVALID_CAPABILITY", "LOOP_DETECTED", "INTERNAL",
    "STREAM_BROKEN", "FLOW_FAILED", "FORBIDDEN", "IDEMPOTENCY_MISMATCH", "CANCELLED",
})  # fmt: skip
"""A call's error that is the run's own answer (or the caller's own mistake): its final
state. ``CANCELLED`` is one: a call whose deadline passed while its agent held the request
tells that agent to stop, and a cancelled request id never runs again (docs/protocol.md,
Cancellation), so a recall gets ``CANCELLED`` for ever — and a ``failed`` record with it
must be stored (:data:`RUN_ERROR_CODES`; a ``CANCELLED`` answer where a run completed is
``failed_without_ack``). Any other (``TIMEOUT``, ``NO_REACHABLE_AGENT``, ``OVERLOADED``,
``IN_PROGRESS``, a connection error, ...) means the caller gave up without learning the
request's fate."""
REFUSED_CODES = frozenset({"COMPENSATION_FULL", "INVALID_REQUEST", "INVALID_CAPABILITY"})
"""A submit's error that says the entry was not stored: final, nothing to wait for."""


class Op(msgspec.Struct, frozen=True, kw_only=True):
    """One caller operation: ``call``, ``recall`` (an unresolved call sent again),
    ``repeat`` (an earlier request id, whatever became of it, sent again), ``submit``,
    ``resubmit``, ``wait`` (a submitted task's final record, read)."""

    caller: str
    op: str
    rid: str
    invoked: float
    returned: float | None = None
    ok: bool | None = None
    code: str | None = None
    agent: str | None = None
    run: str | None = None
    state: str | None = None


class Run(msgspec.Struct, frozen=True, kw_only=True):
    """One handler run, from the agent's own log."""

    rid: str
    agent: str
    instance: str
    run: str
    start: float
    end: float | None = None
    outcome: str | None = None
    """``ok``, ``error`` (``code``) or ``cancelled``; None: no end was written."""
    code: str | None = None


class Proc(msgspec.Struct, frozen=True, kw_only=True):
    """One agent process: its instance (random per start) and, if it was, when it was
    SIGKILLed."""

    agent: str
    instance: str
    pid: int
    started: float
    killed: float | None = None


class Ack(msgspec.Struct, frozen=True, kw_only=True):
    """One attributed ack record of ``REACH_ACKS``."""

    author: str
    rid: str
    agent: str
    state: str
    run: str | None = None
    code: str | None = None


class Event(msgspec.Struct, frozen=True, kw_only=True):
    """A broker's event: ``state`` (``to``) or ``released`` (``rid``)."""

    kind: str
    agent: str
    at: float
    broker: str = ""
    to: str | None = None
    rid: str | None = None
    silence_s: float | None = None
    """The silence the broker gave as its reason ("no heartbeat for 3.09s"), when it gave
    one: the span its own evidence covers."""


class Fault(msgspec.Struct, frozen=True, kw_only=True):
    """A fault as injected: from ``start`` until it was healed at ``end``."""

    kind: str
    target: str
    start: float
    end: float


class Link(msgspec.Struct, frozen=True, kw_only=True):
    """One proxied connection of ``owner`` (an agent or broker) to NATS node ``node``."""

    owner: str
    node: str
    opened: float
    closed: float | None = None


class History(msgspec.Struct, kw_only=True):
    ops: list[Op] = msgspec.field(default_factory=list)
    runs: list[Run] = msgspec.field(default_factory=list)
    procs: list[Proc] = msgspec.field(default_factory=list)
    acks: list[Ack] = msgspec.field(default_factory=list)
    events: list[Event] = msgspec.field(default_factory=list)
    faults: list[Fault] = msgspec.field(default_factory=list)
    links: list[Link] = msgspec.field(default_factory=list)
    beats: dict[str, list[float]] = msgspec.field(default_factory=dict)
    """Agent id → when the monitor saw each of its heartbeats (any node)."""
    queued: list[str] = msgspec.field(default_factory=list)
    """Request ids still in the compensation queue at the end."""
    ended: float = 0.0
    """When the history was closed (the run's last record)."""


class Rules(msgspec.Struct, frozen=True, kw_only=True):
    offline_window_s: float = 6.0
    """How long before an ``offline`` declaration the agent must have been healthy and
    reachable for the declaration to be false (the broker's slowest silence rule:
    ``offline_after`` x the heartbeat interval)."""
    beat_gap_s: float = 2.0
    """Longest gap between heartbeats seen by the monitor that still counts as a steady
    flow (2 heartbeat intervals: no correct detector declares offline on it)."""
    end_pending_s: float = 60.0
    """Longest time a run's claim end may stay unstored while it is retried (the claims
    store unavailable, e.g. electing a leader): a release later than that after the run
    ended means the end was abandoned, not pending."""
    slack_s: float = 0.5
    """Tolerance between clocks of one machine's processes (a claim is taken a little
    before its handler's start line is written)."""


class Violation(msgspec.Struct, frozen=True, kw_only=True):
    kind: str
    request_id: str | None = None
    agent: str | None = None
    seen: str
    """What the records show, in words."""


class Verdict(msgspec.Struct, kw_only=True):
    violations: list[Violation]
    calls: int
    """Request ids the callers issued with ``Client.call``."""
    submits: int
    """Request ids the callers issued with ``Client.submit``."""
    refused: int
    """Submits the queue refused (``COMPENSATION_FULL``): nothing to resolve."""
    runs: int
    resolved: int
    unresolved: list[str]
    """Request ids of calls and submits whose caller never learnt their final state."""
    excused: dict[str, int]
    """Second runs the guarantee allows, by why (``after_crash``, ``after_release``,
    ``after_retryable_end``)."""
    declarations: int
    """``offline`` declarations checked."""


# --- parsing the run's logs (pure: text in, records out) ---------------------------------


def _lines(text: str) -> Iterator[dict[str, Any]]:
    for line in text.splitlines():
        try:
            item = json.loads(line)
        except ValueError:
            continue  # a line cut short by a SIGKILL mid-write
        if isinstance(item, dict):
            yield item


def parse_caller_log(caller: str, text: str) -> list[Op]:
    """A caller's log: each ``invoke`` paired with the next answer of the same request id
    and operation; an invoke without one is an operation that never returned."""
    ops: list[Op] = []
    open_: dict[tuple[str, str], dict[str, Any]] = {}
    for item in _lines(text):
        key = (str(item.get("rid")), str(item.get("op")))
        if item.get("ev") == "invoke":
            open_[key] = item
        elif item.get("ev") in ("ok", "fail") and key in open_:
            inv = open_.pop(key)
            ops.append(Op(caller=caller, op=key[1], rid=key[0], invoked=float(inv["t"]),
                          returned=float(item["t"]), ok=item["ev"] == "ok",
                          code=item.get("code"), agent=item.get("agent"), run=item.get("run"),
                          state=item.get("state")))  # fmt: skip
    for (rid, op), inv in open_.items():
        ops.append(Op(caller=caller, op=op, rid=rid, invoked=float(inv["t"])))
    return ops


def parse_agent_log(text: str, killed: dict[int, float]) -> tuple[list[Proc], list[Run]]:
    """An agent's run log (every process of it appends to one file); ``killed`` maps the
    PIDs the nemesis SIGKILLed to when."""
    procs: list[Proc] = []
    starts: dict[str, dict[str, Any]] = {}
    runs: list[Run] = []
    instance_agent: dict[str, str] = {}
    for item in _lines(text):
        ev = item.get("ev")
        if ev == "process":
            pid = int(item["pid"])
            procs.append(Proc(agent=item["agent"], instance=item["instance"], pid=pid,
                              started=float(item["t"]), killed=killed.get(pid)))  # fmt: skip
            instance_agent[item["instance"]] = item["agent"]
        elif ev == "start":
            starts[item["run"]] = item
        elif ev == "end" and item.get("run") in starts:
            st = starts.pop(item["run"])
            runs.append(_run(st, instance_agent, end=item))
    runs.extend(_run(st, instance_agent) for st in starts.values())
    return procs, runs


def _run(start: dict[str, Any], agents: dict[str, str],
         end: dict[str, Any] | None = None) -> Run:  # fmt: skip
    instance = str(start["run"]).rsplit("-", 1)[0]
    return Run(rid=start["rid"], agent=agents.get(instance, "?"), instance=instance,
               run=start["run"], start=float(start["t"]),
               end=float(end["t"]) if end else None,
               outcome=end.get("outcome") if end else None,
               code=end.get("code") if end else None)  # fmt: skip


def parse_links(text: str) -> list[Link]:
    """The proxy's link log: proxy names are ``<owner>.<node>``."""
    opened: dict[tuple[str, int], float] = {}
    links: list[Link] = []
    for item in _lines(text):
        key = (str(item.get("name")), int(item.get("link", 0)))
        if item.get("ev") == "open":
            opened[key] = float(item["t"])
        elif item.get("ev") == "close" and key in opened:
            owner, _, node = key[0].partition(".")
            links.append(Link(owner=owner, node=node, opened=opened.pop(key),
                              closed=float(item["t"])))  # fmt: skip
    for (name, _), t in opened.items():
        owner, _, node = name.partition(".")
        links.append(Link(owner=owner, node=node, opened=t))
    return links


# --- the check ----------------------------------------------------------------------------


def _overlaps(a0: float, a1: float, b0: float, b1: float) -> bool:
    return a0 <= b1 and b0 <= a1


class _Index:
    """The history, looked up by request id, agent, target."""

    def __init__(self, h: History, rules: Rules) -> None:
        self.h = h
        self.rules = rules
        self.runs: dict[str, list[Run]] = defaultdict(list)
        for r in h.runs:
            self.runs[r.rid].append(r)
        for runs in self.runs.values():
            runs.sort(key=lambda r: r.start)
        self.run_by_id = {r.run: r for r in h.runs}
        self.acks: dict[str, list[Ack]] = defaultdict(list)
        for a in h.acks:
            self.acks[a.rid].append(a)
        self.ops: dict[str, list[Op]] = defaultdict(list)
        for o in h.ops:
            self.ops[o.rid].append(o)
        self.procs = {p.instance: p for p in h.procs}
        self.faults: dict[str, list[Fault]] = defaultdict(list)
        for f in h.faults:
            self.faults[f.target].append(f)
        self.links: dict[str, list[Link]] = defaultdict(list)
        for link in h.links:
            self.links[link.owner].append(link)
        self.released_events: dict[str, list[Event]] = defaultdict(list)
        for e in h.events:
            if e.kind == "released" and e.rid:
                self.released_events[e.rid].append(e)
        self.beats = {a: sorted(ts) for a, ts in h.beats.items()}
        self.queued = set(h.queued)

    def end_of(self, run: Run) -> tuple[float, str]:
        """When a run stopped running, and how: ``ended``, ``killed`` or ``never``."""
        if run.end is not None:
            return run.end, "ended"
        proc = self.procs.get(run.instance)
        if proc is not None and proc.killed is not None and proc.killed >= run.start:
            return proc.killed, "killed"
        return self.h.ended, "never"

    def cut_off(self, agent: str, instance: str | None = None) -> list[tuple[float, float]]:
        """When ``agent`` was cut off by a fault on its own path — its process killed or
        stopped, its link cut or stalled, the NATS node it was linked to when that failed
        killed or stopped — as merged intervals; with ``instance``, that process is cut off
        for good from its kill on (a restart is another process)."""
        spans = [(f.start, f.end) for f in self.faults.get(agent, ()) if f.kind in AGENT_FAULTS]
        proc = self.procs.get(instance) if instance is not None else None
        if proc is not None and proc.killed is not None:
            spans.append((proc.killed, float("inf")))
        for f in self.h.faults:
            if f.kind in NODE_FAULTS and any(
                link.node == f.target and link.opened <= f.start
                and (link.closed is None or link.closed >= f.start - self.rules.slack_s)
                for link in self.links.get(agent, ())
            ):  # fmt: skip
                spans.append((f.start, f.end))
        merged: list[tuple[float, float]] = []
        for lo, hi in sorted(spans):
            if merged and lo <= merged[-1][1] + self.rules.slack_s:
                merged[-1] = (merged[-1][0], max(merged[-1][1], hi))
            else:
                merged.append((lo, hi))
        return merged

    def faulted_near(
        self, agent: str, t: float, instance: str | None = None, window: float | None = None
    ) -> bool:
        """Was ``agent`` (``instance``) cut off at some time within the detection window
        (``window``, else the rules') before ``t``: a declaration of it ``offline`` at ``t``
        that a fault explains?"""
        span = self.rules.offline_window_s if window is None else window
        lo, hi = t - span, t + self.rules.slack_s
        return any(_overlaps(a, b, lo, hi) for a, b in self.cut_off(agent, instance))

    def released(self, run: Run, t0: float, t1: float) -> float | None:
        """When a broker released ``run``'s claim (its ``released`` event naming the request
        id and the run's holder) in ``[t0, t1]``, if it did: proof that the claim was still
        ``running`` then — the holder's end of it had not been stored."""
        times = [e.at for e in self.released_events.get(run.rid, ()) if e.agent == run.agent]
        inside = sorted(t for t in times if t0 <= t <= t1)
        return inside[0] if inside else None

    def final_records(self, rid: str) -> list[Ack]:
        """Final records of ``rid`` by an agent that ran it, or a broker's own."""
        ran = {r.agent for r in self.runs.get(rid, ())}
        return [a for a in self.acks.get(rid, ()) if a.state in ("completed", "failed")
                and (a.author in ran or a.author == BROKER_ACK_AUTHOR)]  # fmt: skip


def check(h: History, rules: Rules | None = None) -> Verdict:
    """Every violation of the delivery guarantee in ``h`` (see the module doc)."""
    rules = rules or Rules()
    ix = _Index(h, rules)
    out: list[Violation] = []
    excused: dict[str, int] = defaultdict(int)
    for rid, runs in ix.runs.items():
        out.extend(_runs_of(ix, rid, runs, excused))
    out.extend(_answers(ix))
    unresolved, refused, resolved = _resolution(ix, out)
    declarations = len([e for e in h.events if e.kind == "state" and e.to == "offline"])
    out.extend(_declarations(ix))
    return Verdict(
        violations=out,
        calls=len({o.rid for o in h.ops if o.op == "call"}),
        submits=len({o.rid for o in h.ops if o.op == "submit"}),
        refused=refused,
        runs=len(h.runs),
        resolved=resolved,
        unresolved=unresolved,
        excused=dict(excused),
        declarations=declarations,
    )


def _runs_of(ix: _Index, rid: str, runs: list[Run],
             excused: dict[str, int]) -> Iterable[Violation]:  # fmt: skip
    slack, pending_s = ix.rules.slack_s, ix.rules.end_pending_s
    for i, first in enumerate(runs):
        end, how = ix.end_of(first)
        if how == "never":
            seen = (f"run {first.run} on {first.agent} started at {first.start:.3f}, never "
                    "ended, its process not killed")  # fmt: skip
            yield Violation(kind="run_never_ended", request_id=rid, agent=first.agent, seen=seen)
        for second in runs[i + 1 :]:
            if how == "killed" and end <= second.start + slack:
                excused["after_crash"] += 1
                continue
            retryable = first.outcome == "cancelled" or first.code in RETRYABLE_CODES
            if how == "ended" and retryable and end <= second.start + slack:
                excused["after_retryable_end"] += 1
                continue
            released = ix.released(first, first.start - slack, second.start + slack)
            overlap = second.start < end
            # A broker released the claim (so its end was not stored) on an honest
            # declaration — a fault on the holder's path explains it — and, for a run that
            # had ended, while an end retried until stored could still be pending.
            honest = released is not None and ix.faulted_near(first.agent, released,
                                                              first.instance)  # fmt: skip
            pending = released is not None and (overlap or released - end <= pending_s)
            if honest and pending:
                excused["after_release"] += 1
                continue
            what = (f"run {first.run} on {first.agent} [{first.start:.3f} - {end:.3f} "
                    f"{first.outcome or how}] and run {second.run} on {second.agent} from "
                    f"{second.start:.3f}")  # fmt: skip
            if released is None:
                why = "; no broker released the first run's claim"
            elif not honest:
                why = (
                    f"; a broker released the first run's claim at {released:.3f} although "
                    "no fault on its holder's path explains declaring it offline"
                )
            else:
                why = (f"; a broker released the first run's claim at {released:.3f}, "
                       f"{released - end:.1f} s after the run ended: its end was left "
                       "unstored, not pending")  # fmt: skip
            kind = "overlapping_runs" if overlap else "run_after_final"
            yield Violation(kind=kind, request_id=rid, agent=second.agent, seen=what + why)


def _answers(ix: _Index) -> Iterable[Violation]:
    """What callers got must be a run's, stored as that run's final record."""
    for o in ix.h.ops:
        if o.returned is None:
            yield Violation(kind="call_never_returned", request_id=o.rid,
                            seen=f"{o.caller}'s {o.op} invoked at {o.invoked:.3f} never "
                                 "returned")  # fmt: skip
            continue
        if o.op not in ("call", "recall", "repeat"):
            continue
        if o.ok:
            run = ix.run_by_id.get(o.run or "")
            stored = [a for a in ix.acks.get(o.rid, ()) if a.state == "completed"
                      and a.author == o.agent and a.run == o.run]  # fmt: skip
            got = f"{o.caller}'s {o.op} returned run {o.run} of {o.agent}"
            if run is None or run.outcome != "ok" or run.rid != o.rid:
                what = "not a completed run of it" if run else "no run"
                yield Violation(kind="completed_without_ack", request_id=o.rid, agent=o.agent,
                                seen=f"{got}, which is {what}")  # fmt: skip
            elif not stored:
                yield Violation(kind="completed_without_ack", request_id=o.rid, agent=o.agent,
                                seen=f"{got}; REACH_ACKS has no completed record of it by "
                                     f"{o.agent}")  # fmt: skip
        elif o.code in RUN_ERROR_CODES:
            # A cancel an agent remembered ends a later copy of the request without a handler
            # run (docs/protocol.md, Cancellation): its agent's CANCELLED record stands alone.
            records = (ix.final_records(o.rid) if o.code != "CANCELLED"
                       else ix.acks.get(o.rid, ()))  # fmt: skip
            stored = [a for a in records if a.state == "failed" and a.code == o.code]
            if not stored:
                by = "by an agent that ran it" if o.code != "CANCELLED" else "by anyone"
                seen = (f"{o.caller}'s {o.op} got {o.code}; REACH_ACKS has no failed record "
                        f"with {o.code} {by}")  # fmt: skip
                yield Violation(kind="failed_without_ack", request_id=o.rid, seen=seen)


def _resolution(ix: _Index, out: list[Violation]) -> tuple[list[str], int, int]:
    """(unresolved request ids, refused submits, resolved) — and their violations. A call
    is resolved when its caller's last answer (after the recalls) was final; a submit when
    the caller's ``wait`` read its final record (or the queue refused it)."""
    unresolved: list[str] = []
    refused = resolved = 0
    for rid, ops in sorted(ix.ops.items()):
        kinds = {o.op for o in ops}
        if "call" in kinds:
            answers = sorted((o for o in ops if o.op in ("call", "recall")),
                             key=lambda o: o.invoked)  # fmt: skip
            last = answers[-1]
            if last.returned is not None and (last.ok or last.code in FINAL_CODES):
                resolved += 1
                continue
        elif "submit" in kinds:
            sends = [o for o in ops if o.op in ("submit", "resubmit")]
            if all(o.code in REFUSED_CODES for o in sends):
                refused += 1
                continue
            if any(o.ok for o in ops if o.op == "wait"):
                resolved += 1
                continue
        else:
            continue
        unresolved.append(rid)
        runs = ix.runs.get(rid, [])
        said = ", ".join(f"{o.op} {'ok' if o.ok else o.code}" for o in ops)
        records = [
            (a.author, a.state, a.code) if a.code else (a.author, a.state)
            for a in ix.acks.get(rid, ())
        ]
        queued = "; still queued" if rid in ix.queued else ""
        seen = (f"caller: {said}; runs: {[r.run for r in runs] or 'none'}; records: "
                f"{records or 'none'}{queued}")  # fmt: skip
        stored = any(o.ok for o in ops if o.op in ("submit", "resubmit"))
        lost = stored and not runs and not ix.final_records(rid) and rid not in ix.queued
        out.append(Violation(kind="submit_lost" if lost else "no_final_state", request_id=rid,
                             seen=seen))  # fmt: skip
    return unresolved, refused, resolved


def _declarations(ix: _Index) -> Iterable[Violation]:
    """Each ``offline`` declaration of an agent that was healthy and reachable."""
    gap = ix.rules.beat_gap_s
    for e in ix.h.events:
        if e.kind != "state" or e.to != "offline":
            continue
        # The silence the broker named (phi: about 3 s at 1 s heartbeats) is what it judged
        # on: a fault before that explains nothing.
        window = ix.rules.offline_window_s
        if e.silence_s is not None:
            window = min(window, e.silence_s + ix.rules.slack_s)
        t0, t1 = e.at - window, e.at
        if ix.faulted_near(e.agent, e.at, window=window):
            continue  # its process, its link or its node was under a fault
        beats = ix.beats.get(e.agent, [])
        lo = bisect.bisect_left(beats, t0)
        hi = bisect.bisect_right(beats, t1)
        seen = [t0, *beats[lo:hi], t1]
        widest = max(b - a for a, b in itertools.pairwise(seen))
        if widest > gap:
            continue  # its heartbeats did not reach the cluster steadily
        yield Violation(kind="offline_while_healthy", agent=e.agent,
                        seen=f"broker {e.broker} declared {e.agent} offline at {e.at:.3f}; "
                             f"no fault on it in the {window:g} s before, and the monitor saw "
                             f"{hi - lo} heartbeats there, never more than {widest:.2f} s "
                             "apart")  # fmt: skip
