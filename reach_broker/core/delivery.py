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
  and they do report tasks running (``active`` > 0: the receipted tasks are still in its
  hands): D = 0, for everyone, after at most N calls. The agent's own heartbeats corroborate
  the callers: an agent that is merely slow still finishes tasks (its ``ok_total`` moves),
  and an idle one runs nothing, so neither a caller with too short a deadline nor one that
  makes reports up can eject it this way.

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


class AgentOutcomes:
    """The reports about one agent: per caller, the summaries within the window."""

    __slots__ = ("baseline", "by_caller", "verdict")

    def __init__(self) -> None:
        self.by_caller: dict[str, deque[Seen]] = {}
        self.baseline: int | None = None
        """The agent's finished tasks (heartbeat ok + fail) when the first unanswered call
        of the window was reported: if it moves, the agent is finishing tasks."""
        self.verdict = CLEAN


class DeliveryBook:
    """Every agent's reports and verdict."""

    def __init__(self, cfg: OutcomesSection) -> None:
        self.cfg = cfg
        self.agents: dict[str, AgentOutcomes] = {}

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
        book.by_caller.setdefault(s.caller, deque()).append(seen)
        if seen.unanswered and book.baseline is None:
            book.baseline = finished
        return self.judge(agent_id, now, finished, busy)

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
            q = book.by_caller[caller]
            while q and q[0].at < horizon:
                q.popleft()
            if not q:
                del book.by_caller[caller]
                continue
            attempts = sum(x.attempts for x in q)
            if attempts >= cfg.min_attempts:
                shares.append(sum(x.failures for x in q) / attempts)
            unanswered += sum(x.unanswered for x in q)
            answers += sum(x.answers for x in q)
        if not book.by_caller:
            del self.agents[agent_id]
            return CLEAN
        if unanswered == 0:
            book.baseline = None
        shares.sort(reverse=True)
        k = cfg.min_callers
        share = shares[k - 1] if len(shares) >= k else 0.0
        callers = len(book.by_caller)
        if (
            unanswered >= cfg.unanswered_after and answers == 0 and busy
            and book.baseline is not None and finished <= book.baseline
        ):  # fmt: skip
            verdict = Verdict(0.0, UNANSWERED, share, callers)
        elif share > cfg.max_failure_share:
            verdict = Verdict(0.0, OUTLIER, share, callers)
        else:
            verdict = Verdict(1.0 - share, None, share, callers)
        book.verdict = verdict
        return verdict

    def forget(self, agent_id: str) -> None:
        self.agents.pop(agent_id, None)
