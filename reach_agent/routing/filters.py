"""The route filters, each in one place: who may take a route request's task, and why not.

Every filter is one row of :data:`FILTERS`: its reason code (on the wire, see
:mod:`reach_agent.routing.reasons`), when a request uses it, the test an agent passes, and the
sentence an explained route gives for an agent it keeps out. The route walk, the question
"which filter keeps this agent out?" (:meth:`Walk.first_failed`, what an explained route asks
agent by agent) and the explanation's sentences all read that one table, so they cannot
disagree, and adding a filter is adding a row (its request field aside: that is the wire's,
:class:`reach_agent.wire.schema.Filters`).

**Compiled once.** A request's filters become one predicate: the walk over a ranking that
tests, in the table's order, only the filters the request uses, and counts each agent it
keeps out under the first filter it fails. The walks are generated from the rows' test
expressions (as ``dataclasses`` and ``namedtuple`` generate their methods), one per set of
filters in use, compiled on first use and kept: a request pays neither a call per filter
per agent nor a test it does not use. :func:`walk_source` shows one.

Load is tested last, so an agent counted under ``load`` passed every other filter: the
route answers ``OVERLOADED`` (wait), not ``NO_REACHABLE_AGENT`` (elsewhere), when nothing
but load kept everyone out.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from reach_agent.wire.schema import RouteRequest

from .member import M, Member
from .rules import Rule
from .settings import Settings

Policy = tuple[Rule | None, str | None]
"""What a capability's route rule asks of one request: (the rule, the split arm it got)."""
NO_POLICY: Policy = (None, None)

_NO_PAIRS: frozenset[tuple[str, str]] = frozenset()
_NO_VALUES: frozenset[str] = frozenset()


class Seen(Protocol):
    """What a filter's sentence reads: the agent left out, the request, the walk."""

    @property
    def rec(self) -> Member: ...
    @property
    def req(self) -> RouteRequest: ...
    @property
    def policy(self) -> Policy: ...
    @property
    def walked(self) -> str:
        """The state the walk wanted (``healthy``; ``suspect`` when it fell back to them)."""

    @property
    def now(self) -> float: ...
    @property
    def cfg(self) -> Settings: ...


@dataclass(frozen=True)
class Filter:
    """One route filter."""

    code: str
    """Its reason code: on the wire (``Exclusion.reason``), listed in docs/protocol.md."""
    meaning: str
    """What the code means (:data:`reach_agent.routing.reasons.EXCLUSIONS`)."""
    applies: str
    """When a request uses it: a Python expression over the walk's values (:data:`VALUES`)."""
    keeps: str
    """The test an agent ``rec`` passes: a Python expression over ``rec``, ``state`` (the
    state the walk wants), ``now``, ``watermark`` and the walk's values."""
    detail: Callable[[Seen], str]
    """Why it kept ``rec`` out, with the figures, for people (an explained route)."""


# --- the sentences ---------------------------------------------------------------------------


def _state(c: Seen) -> str:
    rec = c.rec
    since = f" for {max(c.now - rec.state_since, 0.0):.1f}s"
    if rec.state == "suspect":
        if not c.req.allow_suspect:
            return f"suspect{since}: routed only with allow_suspect"
        if c.walked == "healthy":
            return f"suspect{since}: allow_suspect takes suspects only when no healthy one passes"
    if rec.state == "healthy":  # changed since the ranking the walk read
        return f"was {c.walked} at the last ranking"
    return f"{rec.state}{since}"


def _region(c: Seen) -> str:
    region = repr(c.rec.region) if c.rec.region is not None else "none"
    return f"region {region}, the request asks {c.req.region!r}"


def _tags(c: Seen) -> str:
    tags = c.rec.tags
    for key, want in c.req.tags.items():
        have = tags.get(key)
        if have != want:
            has = f"is {have!r}" if have is not None else "is missing"
            return f"tag {key} {has}, the request asks {want!r}"
    return "tags differ from the request's"


def _required(c: Seen) -> str:
    rule = c.policy[0]
    for key, want in rule.require if rule is not None else ():
        if key not in c.req.tags and c.rec.tags.get(key) != want:
            have = c.rec.tags.get(key)
            has = f"is {have!r}" if have is not None else "is missing"
            return f"tag {key} {has}; the capability's rule requires {want!r}"
    return "lacks a tag the capability's rule requires"


def _split(c: Seen) -> str:
    rule, arm = c.policy
    if rule is None or not rule.listed:
        return f"version {c.rec.version!r}, the request's canary asks {arm!r}"
    key = rule.split_by
    value = rule.value_of(c.rec)
    if arm is None:
        arms = ", ".join(sorted(rule.listed))
        return f"{key} {value!r} is in no arm of the split ({arms})"
    return f"{key} {value!r}; this request's split arm is {arm!r}"


def _requires(c: Seen) -> str:
    missing = sorted(set(c.req.requires) - c.rec.permissions)
    return f"lacks the permission(s) {', '.join(missing)} the request requires"


def _context(c: Seen) -> str:
    rec = c.rec
    if not rec.context_window:
        return (f"announces no context_window; the request asks {c.req.min_context_tokens} "
                "tokens of headroom")  # fmt: skip
    used = rec.context_usage_pct or 0.0
    return (f"context headroom {rec.headroom} tokens ({rec.context_window} x {100 - used:g}% "
            f"free), below the request's min_context_tokens "
            f"{c.req.min_context_tokens}")  # fmt: skip


def _exclude(c: Seen) -> str:
    return "named in the request's exclude"


def _load(c: Seen) -> str:
    rec = c.rec
    watermark = f"at or above the watermark {c.cfg.load_watermark:g}"
    if rec.handed_at <= rec.last_seen and rec.busy == rec.load:  # as the agent reported it
        return f"load {rec.active}/{rec.max_concurrency} = {rec.load:.2f}, {watermark}"
    since = "and the routes handed out since" if rec.handed_at > rec.last_seen else "fading"
    return (f"load {rec.busy:.2f} (reported {rec.active}/{rec.max_concurrency}, {since}), "
            f"{watermark}")  # fmt: skip


# --- the table -------------------------------------------------------------------------------

STATE = "state"
LOAD = "load"
"""The two filters every walk applies (the others apply when a request or rule asks)."""

FILTERS: tuple[Filter, ...] = (
    Filter(STATE, "not healthy (suspect agents only with allow_suspect, when no healthy one "
           "passes)",
           "True", "rec.state == state", _state),
    Filter("region", "its region is not the request's region",
           "region is not None", "rec.region == region", _region),
    Filter("tags", "a tag of the request is missing or different",
           "tags", "rec.tags.items() >= tags", _tags),
    Filter("required", "lacks a tag the capability's route rule requires (reach rules "
           "--require)",
           "required", "rec.tags.items() >= required", _required),
    Filter("split", "its version (or tag) is not the split arm this request was given",
           "splitting",
           "(rec.version if split_tag is None else rec.tags.get(split_tag)) in arm_values",
           _split),
    Filter("requires", "does not hold a permission the request requires",
           "requires", "rec.permissions >= requires", _requires),
    Filter("context", "its context headroom is below the request's min_context_tokens",
           "min_context is not None", "rec.headroom >= min_context", _context),
    Filter("exclude", "named in the request's exclude",
           "exclude", "rec.agent_id not in exclude", _exclude),
    # Last: an agent counted here passed every other filter. One that looks full (the last
    # report plus the hand-outs since) gets a second look as of now, unless that look
    # already said how long it stays full (full_until).
    Filter(LOAD, "full: the tasks believed running (the last heartbeat's active and the "
           "routes handed out since) / max_concurrency at or above routing.load_watermark",
           "True",
           "rec.busy < watermark or (rec.full_until <= now "
           "and rec.busy_at(now, watermark) < watermark)", _load),
)  # fmt: skip
"""Every route filter, in the order the walk applies them: an agent is reported under the
first one it fails."""

DETAILS: dict[str, Callable[[Seen], str]] = {f.code: f.detail for f in FILTERS}
"""The sentence of each filter's reason code."""


# --- compiling ---------------------------------------------------------------------------------

VALUES: dict[str, str] = {
    "region": "req.region",
    "tags": "frozenset(req.tags.items()) if req.tags else NO_PAIRS",
    "required": "rule.required_for(req.tags) if rule is not None else NO_PAIRS",
    "splitting": "arm is not None or (rule is not None and bool(rule.listed))",
    "split_tag": "rule.tag if rule is not None and rule.listed else None",
    "arm_values": "frozenset((arm,)) if arm is not None else rule.listed if rule is not None "
    "else NO_VALUES",
    "requires": "frozenset(req.requires) if req.requires else NO_VALUES",
    "min_context": "req.min_context_tokens",
    "exclude": "req.exclude",
}
"""What a walk prepares once from the request (``req``) and its capability's rule and split
arm (``rule``, ``arm``), for the filters' ``applies`` and ``keeps`` to read: the request's
tags as pairs (``rec.tags.items() >= tags`` is the test), the tags the rule requires that
the request does not name, whether a split applies, its tag key (None: by ``version``) and
the values of the split key that pass (the arm's, or with no arm every listed one)."""


# --- compiling ---------------------------------------------------------------------------------

WalkFn = Callable[..., Any]
"""A compiled walk: (walk, ranked, state, want, [why,] now, watermark) -> the agents passing
(a list of the ranking's kind of member), at most ``want``, best ranked first (the counting
one: each agent kept out counted in ``why`` under its filter's code)."""


def _reads(exprs: list[str]) -> list[str]:
    """The walk's values (:data:`VALUES`) that ``exprs`` read, in the table's order."""
    names: set[str] = set()
    for expr in exprs:
        names |= set(compile(expr, "<filter>", "eval").co_names)
    return [name for name in VALUES if name in names]


def init_source() -> str:
    """The source of :class:`Walk`'s ``__init__``: each value prepared, the filters the
    request uses as bits (``shape``), and the walk compiled for them."""
    bits = " | ".join(f"({1 << i} if ({f.applies}) else 0)" for i, f in enumerate(FILTERS))
    return "\n".join([
        "def __init__(self, req, policy=NO_POLICY):",
        "    rule, arm = policy",
        *[f"    self.{name} = {name} = {expr}" for name, expr in VALUES.items()],
        f"    self.shape = shape = {bits}",
        "    passing = WALKS.get((shape, False))",
        "    self.passing = walk_of(shape, False) if passing is None else passing",
    ])  # fmt: skip


def walk_source(shape: int, count: bool = True) -> str:
    """The source of the walk that applies the filters whose bits are set in ``shape``;
    ``count``: counting each agent kept out in ``why`` under its filter's code (the route
    path's walks do not; they walk again counting only when nothing passed)."""
    used = [f for i, f in enumerate(FILTERS) if shape >> i & 1]
    args = (
        "v, ranked, state, want, why, now, watermark"
        if count
        else "v, ranked, state, want, now, watermark"
    )
    lines = [f"def walk({args}):",
             *[f"    {name} = v.{name}" for name in _reads([f.keeps for f in used])],
             "    out = []",
             "    for rec in ranked:"]  # fmt: skip
    for f in used:
        lines.append(f"        if not ({f.keeps}):")
        if count:
            lines.append(f"            why[{f.code!r}] = why.get({f.code!r}, 0) + 1")
        lines.append("            continue")
    lines += ["        out.append(rec)", "        if len(out) >= want:", "            break",
              "    return out"]  # fmt: skip
    return "\n".join(lines)


WALKS: dict[tuple[int, bool], WalkFn] = {}
"""The walks compiled so far, by (shape, counting)."""


def _compile(source: str, name: str, scope: dict[str, object]) -> Callable[..., object]:
    exec(compile(source, f"<reach_agent.routing.filters.{name}>", "exec"), scope)
    fn = scope[name]
    assert callable(fn)
    return fn


def walk_of(shape: int, count: bool) -> WalkFn:
    """The walk of ``shape`` (compiled on first use)."""
    fn = WALKS.get((shape, count))
    if fn is None:
        fn = WALKS[shape, count] = _compile(walk_source(shape, count), "walk", {})  # type: ignore[assignment]
    return fn  # type: ignore[return-value]


class Walk:
    """One request's filters compiled into one predicate: the walk over a ranking, with the
    request's values prepared once for its tests (:data:`VALUES`). ``__init__`` is
    generated from the tables (:func:`init_source`): ``Walk(req, (rule, arm))``."""

    __slots__ = ("passing", "shape", *VALUES)

    if TYPE_CHECKING:

        def __init__(self, req: RouteRequest, policy: Policy = NO_POLICY) -> None:
            self.shape = 0
            """The filters this request uses, as bits (one per row of :data:`FILTERS`)."""
            self.passing: WalkFn = walk_of(0, False)
            """The walk: ``walk.passing(walk, ranked, state, want, now, watermark)``, the
            agents of ``ranked`` (best first) in ``state`` that pass, at most ``want`` (a
            generated function given its walk for the values: no wrapper on the route
            path)."""

    def counting(
        self, ranked: list[M], state: str, want: int, why: dict[str, int], now: float,
        watermark: float,
    ) -> list[M]:  # fmt: skip
        """:attr:`passing`, counting every agent kept out in ``why`` under the code of the
        first filter it fails."""
        fn = walk_of(self.shape, True)
        passed: list[M] = fn(self, ranked, state, want, why, now, watermark)
        return passed

    def first_failed(self, rec: Member, state: str, now: float, watermark: float) -> str | None:
        """The code of the first filter ``rec`` fails when the walk wants ``state``; None
        when it passes them all."""
        why: dict[str, int] = {}
        if self.counting([rec], state, 1, why, now, watermark):
            return None
        return next(iter(why))


# The generated __init__ goes onto the class as it is built (as dataclasses does its own).
Walk.__init__ = _compile(init_source(), "__init__", {  # type: ignore[method-assign,assignment]
    "NO_POLICY": NO_POLICY, "NO_PAIRS": _NO_PAIRS, "NO_VALUES": _NO_VALUES, "WALKS": WALKS,
    "walk_of": walk_of,
})  # fmt: skip
