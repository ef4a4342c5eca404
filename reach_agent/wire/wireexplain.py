"""The explained route's Structs (``RouteRequest.explain``): each candidate's score terms
and standing, every agent left out and why, how the choice was made.

Its own module because these answer "why", apart from the route itself in ``schema``
(``Candidate.explain``, ``RouteReply.explain``), which re-exports every name here.
"""

from __future__ import annotations

from .wiretypes import AgentState, Base


class ScoreTerms(Base, frozen=True):
    """The factors of an agent's score, each in [0, 1]: score = 100 x the product of each
    term raised to its weight (``scoring.weight_*``); ``stuck`` is 1 or the stuck penalty."""

    liveness: float
    latency: float
    load: float
    success: float
    stuck: float
    delivery: float = 1.0
    """What callers saw (``<p>.outcome.<agent_id>`` summaries): 1, or 1 - the failure share
    that at least ``outcomes.min_callers`` callers report; 0 when ejected by the outlier or
    the unanswered rule."""


class AgentExplain(Base, frozen=True):
    """Why an agent scores what it scores, and where it stands in the capability's routing
    (with ``RouteRequest.explain``)."""

    terms: ScoreTerms
    weakest: str | None = None
    """The term that pulls the score down most (None: every term is 1)."""
    slow_start: float = 1.0
    """The slow-start factor on its weight (below 1 for a while after recovering)."""
    weight: float = 0.0
    """Its weight in the weighted draw: score x free capacity x slow start."""
    rank: int = 0
    """Its place in the capability's ranking, 1 the best; 0: not ranked."""
    kept: str | None = None
    """Why it is routed although below the minimum score (``eject_cap``, ``panic``) or
    although suspect (``allow_suspect``)."""
    task_ms: float | None = None
    """Task duration EWMA (from heartbeats)."""
    rtt_ms: float | None = None
    """Probe round-trip EWMA."""
    success_rate: float = 1.0
    ok_total: int = 0
    fail_total: int = 0
    active: int = 0
    queue_depth: int = 0
    max_concurrency: int = 0
    oldest_task_ms: int | None = None
    timeout_hint_ms: int | None = None
    probe_failures: int = 0
    """Probes unanswered in a row."""


class Exclusion(Base, frozen=True):
    """An agent of the capability that is not among the candidates, and why."""

    agent_id: str
    reason: str
    """A reason code (``state``, ``load``, ``score``, ...; the table in docs/protocol.md)."""
    detail: str
    """The reason in one sentence, with the figures."""
    state: AgentState
    score: float
    load: float
    explain: AgentExplain | None = None


class RouteExplain(Base, frozen=True):
    """How a route request was decided (with ``RouteRequest.explain``)."""

    members: int
    """Agents with the capability, in any state."""
    healthy: int
    ranked: int
    """Healthy agents in the ranking (not ejected for their score)."""
    choice: str
    min_reach_score: float
    load_watermark: float
    ejected: int = 0
    panic: bool = False
    pool: int = 0
    """Agents that passed every filter and made the pool the choice was made from."""
    counts: dict[str, int] = {}
    """Agents left out, by reason code: all of them, also beyond the ``excluded`` listed."""
    excluded: list[Exclusion] = []
    """The agents left out (at most 100: the best ranked and scored first), with why."""
