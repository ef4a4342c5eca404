"""Why an agent is not among a route's candidates: the reason codes, in one table.

The route walk counts the filter each agent fails under that filter's code (the rows of
:data:`reach_agent.routing.filters.FILTERS`, each with its meaning); an agent the walk did not
keep out is left out by the ranking or the choice (the codes below). An explained route
(the broker's ``explain``) names one code for each agent left out and renders its sentence.
The codes are on the wire (``Exclusion.reason``, ``AgentExplain.kept``) and listed in
docs/protocol.md.
"""

from __future__ import annotations

from .filters import FILTERS, STATE

__all__ = ["EXCLUSIONS", "KEPT", "STATE"]

# --- left out by the ranking, or by the choice ------------------------------------------------
SCORE = "score"
UNRANKED = "unranked"
POOL = "pool"
DRAW = "draw"

# --- why an agent is routed although the rules would keep it out (AgentExplain.kept) ----------
EJECT_CAP = "eject_cap"
PANIC = "panic"
ALLOW_SUSPECT = "allow_suspect"

EXCLUSIONS: dict[str, str] = {
    **{f.code: f.meaning for f in FILTERS},
    SCORE: "ejected: score below routing.min_reach_score (the weakest term named)",
    UNRANKED: "healthy since the capability was last ranked (re-ranked within rank_refresh_ms)",
    POOL: "passed every filter, ranked below the pool the choice draws from",
    DRAW: "in the pool, not drawn (weighted draw, p2c or ranked order took others)",
}
"""Every exclusion reason and what it means."""

KEPT: dict[str, str] = {
    EJECT_CAP: "below the minimum score, kept in: at most routing.max_eject_share is ejected",
    PANIC: "below the minimum score, kept in: the capability is in panic (nothing ejected)",
    ALLOW_SUSPECT: "suspect, routed: no healthy agent passed and the request allows suspects",
}
"""Every reason an agent is routed against a rule, and what it means."""
