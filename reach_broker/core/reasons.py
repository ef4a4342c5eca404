"""Why an agent is not among a route's candidates: the reason codes, in one table.

The route walk (:mod:`reach_broker.core.routing`) counts the filter each agent fails under one of
these codes; the explanation (:mod:`reach_broker.core.explain`) names the same code for each agent
left out and renders its sentence. A new filter adds its code here, its check to the walk and
its sentence to ``explain.DETAILS`` (a test keeps the three together). The codes are on the
wire (``Exclusion.reason``, ``AgentExplain.kept``) and listed in docs/protocol.md.
"""

from __future__ import annotations

# --- left out by a filter of the walk, in the order the walk applies them ---------------------
STATE = "state"
LOAD = "load"
REGION = "region"
TAGS = "tags"
REQUIRED = "required"
SPLIT = "split"
REQUIRES = "requires"
CONTEXT = "context"
EXCLUDE = "exclude"

WALK_FILTERS = (STATE, REGION, TAGS, REQUIRED, SPLIT, REQUIRES, CONTEXT, EXCLUDE, LOAD)
"""The walk's filters in the order it applies them: an agent is reported under the first
one it fails."""

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
    STATE: "not healthy (suspect agents only with allow_suspect, when no healthy one passes)",
    LOAD: "full: the tasks believed running (the last heartbeat's active and the routes handed "
    "out since) / max_concurrency at or above routing.load_watermark",
    REGION: "its region is not the request's region",
    TAGS: "a tag of the request is missing or different",
    REQUIRED: "lacks a tag the capability's route rule requires (reach rules --require)",
    SPLIT: "its version (or tag) is not the split arm this request was given",
    REQUIRES: "does not hold a permission the request requires",
    CONTEXT: "its context headroom is below the request's min_context_tokens",
    EXCLUDE: "named in the request's exclude",
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
