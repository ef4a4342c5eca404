"""What callers saw of each agent, folded into the delivery term D of the score.

Callers' SDKs publish outcome summaries (``<p>.outcome.<agent_id>``: attempts, not delivered,
lost, timeouts, rejections, answers) every few seconds. Each broker keeps them per agent
and per caller over the last ``outcomes.window_s`` (a minute) and judges, with the clock as
an argument (pure):

- **failure share** of a caller: (not delivered + lost + timeouts) / attempts, for callers
  that sent at least ``min_attempts``. Business rejections are answers, not failures.
- **distinct callers**: the agent's failure share is that of the ``min_callers``-th worst
  caller (the second worst by default), so one caller alone — whose deadlines are too short,
  whose network is bad, or who lies — moves nothing: D = 1 - that share.
- **the outlier rule**: above ``max_failure_share`` (5 %) over the window, D = 0: the agent
  scores 0 and is ejected, within the ejection cap (``routing.max_eject_share``; nothing in
  panic), like any low scorer.
- **the unanswered rule**: at least ``unanswered_after`` (N, 3 by default) receipted calls
  without a result (lost + timeouts, any callers) in the window, while no caller got any
  answer from the agent, its heartbeats reported no finished task since the first of them
  and they reported tasks running meanwhile (``active`` > 0 at a judgement since the first
  of them: the receipted tasks were in its hands, even if their callers' deadlines have
  cancelled them since): D = 0, for everyone, after at most N calls. The agent's own
  heartbeats corroborate the callers: an agent that is merely slow still finishes tasks (its
  ``ok_total`` moves), and an idle one runs nothing, so neither a caller with too short a
  deadline nor one that makes reports up can eject it this way.

The window slides: once the reports are a minute old, D returns to 1 (the agent is tried
again, and judged afresh).
"""

from __future__ import annotations

from collections import deque
from typing import NamedTuple

from reach_agent.wire.schema import OutcomeSummary
from reach_broker.config import OutcomesSection

OUTLIER = "outlier"
UNANSWERED = "unanswered"


class Seen(NamedTuple):
    """One summary's counts, as kept."""

    at: float
    attempts: int
    failures: int
    """not delivered + lost + timeouts."""
    unanswered: int
    """lost + timeouts: receipted, no result."""
    answers: int
    """ok + rejected."""


class Verdict(NamedTuple):
    delivery: float
    """D in [0, 1]."""
    rule: str | None
    """``outlier`` or ``unanswered`` when D is 0 by a rule."""
    share: float
    """The failure share counted (the min_callers-th worst caller's)."""
    callers: int
    """Callers with reports in the window."""


CLEAN = Verdict(1.0, None, 0.0, 0)


class Reports:
    """One caller's summaries about one agent within the window, with their sums kept as
    they come and go (O(1) a summary, however many the window holds)."""

    __slots__ = ("answers", "attempts", "failures", "seen", "unanswered")

    def __init__(self) -> None:
        self.seen: deque[Seen] = deque()
        self.attempts = self.failures = self.unanswered = self.answers = 0

    def add(self, seen: Seen) -> None:
        self.seen.append(seen)
        self.attempts += seen.attempts
        self.failures += seen.failures
        self.unanswered += seen.unanswered
        self.answers += seen.answers

    def drop_before(self, horizon: float) -> None:
        q = self.seen
        while q and q[0].at < horizon:
            old = q.popleft()
            self.attempts -= old.attempts
            self.failures -= old.failures
            self.unanswered -= old.unanswered
            self.answers -= old.answers


class AgentOutcomes:
    """The reports about one agent: per caller, the summaries within the window."""

    __slots__ = ("baseline", "busy", "by_caller", "verdict")

    def __init__(self) -> None:
        self.by_caller: dict[str, Reports] = {}
        self.baseline: int | None = None
        """The agent's finished tasks (heartbeat ok + fail) when the first unanswered call
        of the window was reported: if it moves, the agent is finishing tasks."""
        self.busy = False
        """Whether its heartbeats reported tasks running at a judgement since then: the
        receipted calls were in its hands, even if their deadlines have since cancelled
        them (the agent then reports none running by the time the last report comes)."""
        self.verdict = CLEAN


class DeliveryBook:
    """Every agent's reports and verdict.

    A summary costs O(callers of its agent) (the sums are kept per caller). Which agents to
    judge again as time passes (:meth:`due`) costs O(1) a summary: every report leaves the
    window ``window_s`` after it came, in the order they came, so one queue of (when, agent)
    says whose reports have left; beside those, only the agents with unanswered calls in
    the window (whose verdict also follows their heartbeats) are judged every round."""

    def __init__(self, cfg: OutcomesSection) -> None:
        self.cfg = cfg
        self.agents: dict[str, AgentOutcomes] = {}
        self.ejected = {OUTLIER: 0, UNANSWERED: 0}
        """Agents whose verdict is D = 0 by each rule, kept as verdicts change."""
        self._leaving: deque[tuple[float, str]] = deque()
        """(when a report leaves the window, its agent), in the order the reports came."""
        self._unanswered: set[str] = set()
        """The agents with unanswered calls in the window (a ``baseline``)."""

    def add(
        self, agent_id: str, s: OutcomeSummary, now: float, finished: int, busy: bool
    ) -> Verdict:
        """Keep one summary (``finished``: the agent's heartbeat ok + fail totals now;
        ``busy``: its heartbeats report tasks running); returns the agent's verdict."""
        book = self.agents.get(agent_id)
        if book is None:
            book = self.agents[agent_id] = AgentOutcomes()
        seen = Seen(now, s.attempts, s.not_delivered + s.lost + s.timeouts, s.lost + s.timeouts,
                    s.ok + s.rejected)  # fmt: skip
        reports = book.by_caller.get(s.caller)
        if reports is None:
            reports = book.by_caller[s.caller] = Reports()
        reports.add(seen)
        self._leaving.append((now + self.cfg.window_s, agent_id))
        if seen.unanswered and book.baseline is None:
            book.baseline = finished
            self._unanswered.add(agent_id)
        return self.judge(agent_id, now, finished, busy)

    def due(self, now: float) -> set[str]:
        """The agents to judge again at ``now``: those some of whose reports have left the
        window since, and those with unanswered calls in it."""
        out = set()
        leaving = self._leaving
        while leaving and leaving[0][0] < now:
            out.add(leaving.popleft()[1])
        return out | self._unanswered

    def judge(self, agent_id: str, now: float, finished: int, busy: bool) -> Verdict:
        """The agent's verdict over the window ending ``now`` (old reports dropped)."""
        book = self.agents.get(agent_id)
        if book is None:
            return CLEAN
        cfg = self.cfg
        horizon = now - cfg.window_s
        shares: list[float] = []
        unanswered = answers = 0
        for caller in list(book.by_caller):
            reports = book.by_caller[caller]
            reports.drop_before(horizon)
            if not reports.seen:
                del book.by_caller[caller]
                continue
            if reports.attempts >= cfg.min_attempts:
                shares.append(reports.failures / reports.attempts)
            unanswered += reports.unanswered
            answers += reports.answers
        if not book.by_caller:
            self.forget(agent_id)
            return CLEAN
        if unanswered == 0:
            book.baseline = None
            book.busy = False
            self._unanswered.discard(agent_id)
        elif busy:
            book.busy = True
        shares.sort(reverse=True)
        k = cfg.min_callers
        share = shares[k - 1] if len(shares) >= k else 0.0
        callers = len(book.by_caller)
        if (
            unanswered >= cfg.unanswered_after and answers == 0 and book.busy
            and book.baseline is not None and finished <= book.baseline
        ):  # fmt: skip
            verdict = Verdict(0.0, UNANSWERED, share, callers)
        elif share > cfg.max_failure_share:
            verdict = Verdict(0.0, OUTLIER, share, callers)
        else:
            verdict = Verdict(1.0 - share, None, share, callers)
        self._set(book, verdict)
        return verdict

    def _set(self, book: AgentOutcomes, verdict: Verdict) -> None:
        if book.verdict.rule is not None:
            self.ejected[book.verdict.rule] -= 1
        if verdict.rule is not None:
            self.ejected[verdict.rule] += 1
        book.verdict = verdict

    def forget(self, agent_id: str) -> None:
        book = self.agents.pop(agent_id, None)
        self._unanswered.discard(agent_id)
        if book is not None:
            self._set(book, CLEAN)
