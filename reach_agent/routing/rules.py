"""Route rules: per capability, a traffic split by ``version`` or a tag, required tags, a quota.

A rule comes from ``broker.toml`` (``[rules."<capability>"]``) or, live, from KV
``reach_rules`` (key = the capability; ``reach rules set|clear``), the bucket's rule taking
the place of the file's while it is set. :class:`RouteRule` is the stored form (the KV value,
JSON); :class:`Rule` the compiled one the route walk reads:

- **split** ``version=1:95,2:5`` (or ``TAG=a:90,b:10``): each route request is given one arm
  by smooth weighted round robin — deterministic, exactly 95 of every 100 requests a replica
  answers go to arm ``1`` — or by the hash of its ``sticky_key`` (a key keeps its arm), or by
  the request's ``canary`` (the caller names the arm). Only agents whose ``version`` (tag)
  is that arm's value pass; when none of them does, an arm drawn by weight falls back to the
  other arms (a canary with no agent left does not fail 5 % of the calls), a named canary
  does not. Agents whose value is in no arm are never routed while the rule is set.
- **require** ``env=prod``: agents without that tag value are never offered, unless the
  request asks for that tag itself (``RouteRequest.tags``).
- **quota** ``rate[:burst]``: route requests per second per caller for this capability
  (:mod:`reach_broker.core.quotas`): enforced by brokers only, so a caller routing from its
  route table asks a broker for a capability whose rule sets one.
"""

from __future__ import annotations

from typing import Annotated

import msgspec
from msgspec import Meta

from reach_agent.wire.errors import InvalidRequest
from reach_agent.wire.schema import RouteRequest, check_capability, check_tags

from .hashing import hash64
from .member import Member

VERSION = "version"
"""The split key that means the agent's announced ``version`` (any other key is a tag)."""

Weight = Annotated[int, Meta(ge=0, le=1_000_000)]


class RouteRule(msgspec.Struct, kw_only=True, omit_defaults=True, forbid_unknown_fields=True):
    """One capability's rule as stored (KV ``reach_rules`` value, or ``[rules."<cap>"]``)."""

    split_by: str | None = None
    """``version``, or the tag key the split is by."""
    split: dict[str, Weight] = {}
    """Arm value → weight (relative: 95 and 5 are 95 % and 5 %)."""
    require: dict[str, str] = {}
    """Tags every routed agent must carry (unless the request asks for the tag itself)."""
    quota_rate: Annotated[float, Meta(gt=0)] | None = None
    """Route requests per second each caller may make for this capability."""
    quota_burst: Annotated[int, Meta(ge=1)] | None = None
    """The bucket size of that quota (unset: ``max(1, quota_rate)``)."""
    updated_ms: int = 0
    """When it was set (Unix ms)."""
    updated_by: str | None = None
    """Who set it (``reach rules set``: the user and host)."""


rule_decoder = msgspec.json.Decoder(RouteRule)
rule_encoder = msgspec.json.Encoder()


def parse_split(text: str) -> tuple[str, dict[str, int]]:
    """``version=1:95,2:5`` → ``("version", {"1": 95, "2": 5})``; InvalidRequest naming
    what is wrong otherwise."""
    key, sep, arms = text.partition("=")
    key = key.strip()
    if not sep or not key or not arms.strip():
        raise InvalidRequest(f"split {text!r} is not KEY=VALUE:WEIGHT,... (e.g. version=1:95,2:5)")
    if key != VERSION:
        check_tags({key: ""}, "split key")
    out: dict[str, int] = {}
    for part in arms.split(","):
        value, sep, weight = part.strip().rpartition(":")
        if not sep or not value:
            raise InvalidRequest(f"split arm {part.strip()!r} is not VALUE:WEIGHT (e.g. 2:5)")
        try:
            w = int(weight)
        except ValueError:
            raise InvalidRequest(f"split arm {part.strip()!r}: weight {weight!r} is not an "
                                 "integer") from None  # fmt: skip
        if w < 0:
            raise InvalidRequest(f"split arm {part.strip()!r}: weight {w} is negative")
        if value in out:
            raise InvalidRequest(f"split {text!r} names the value {value!r} twice")
        out[value] = w
    if sum(out.values()) <= 0:
        raise InvalidRequest(f"split {text!r}: the weights add up to 0")
    return key, out


def parse_require(items: list[str]) -> dict[str, str]:
    """``["env=prod", "tier=gold"]`` → ``{"env": "prod", "tier": "gold"}``."""
    out: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key or not value:
            raise InvalidRequest(f"require {item!r} is not TAG=VALUE (e.g. env=prod)")
        check_tags({key: value}, "require")
        out[key] = value
    return out


def parse_quota(text: str) -> tuple[float, int | None]:
    """``50`` or ``50:100`` → (rate per second, burst or None)."""
    rate, _, burst = text.partition(":")
    try:
        r = float(rate)
        b = int(burst) if burst else None
    except ValueError:
        raise InvalidRequest(f"quota {text!r} is not RATE[:BURST] (e.g. 50:100)") from None
    if r <= 0 or (b is not None and b < 1):
        raise InvalidRequest(f"quota {text!r}: the rate must be above 0 and the burst at least 1")
    return r, b


def build(
    split: str | None = None, require: list[str] | dict[str, str] | None = None,
    quota: str | None = None, base: RouteRule | None = None,
) -> RouteRule:  # fmt: skip
    """A rule from the CLI's (or broker.toml's) words, over ``base`` (what it changes)."""
    rule = base or RouteRule()
    changes: dict[str, object] = {}
    if split is not None:
        changes["split_by"], changes["split"] = parse_split(split)
    if require is not None:
        if isinstance(require, dict):
            check_tags(require, "require")
            changes["require"] = dict(require)
        else:
            changes["require"] = parse_require(require)
    if quota is not None:
        changes["quota_rate"], changes["quota_burst"] = parse_quota(quota)
    return msgspec.structs.replace(rule, **changes)


def describe(rule: RouteRule) -> str:
    """The rule in the CLI's own words (``split version=1:95,2:5; require env=prod``)."""
    parts = []
    if rule.split:
        arms = ",".join(f"{v}:{w}" for v, w in rule.split.items())
        parts.append(f"split {rule.split_by}={arms}")
    if rule.require:
        parts.append("require " + ",".join(f"{k}={v}" for k, v in rule.require.items()))
    if rule.quota_rate is not None:
        burst = f":{rule.quota_burst}" if rule.quota_burst is not None else ""
        parts.append(f"quota {rule.quota_rate:g}{burst}/s")
    return "; ".join(parts) or "no policy"


class Rule:
    """A compiled rule: what the route walk checks, and the arm each request gets."""

    __slots__ = ("arms", "by_version", "current", "listed", "require", "required", "source",
                 "split_by", "stored", "tag", "total", "weights")  # fmt: skip

    def __init__(self, stored: RouteRule, source: str) -> None:
        self.stored = stored
        self.source = source
        """``kv`` or ``config``: where it came from."""
        self.split_by = stored.split_by if stored.split else None
        self.by_version = self.split_by == VERSION
        self.arms = tuple(v for v, w in stored.split.items() if w > 0)
        self.weights = tuple(stored.split[v] for v in self.arms)
        self.total = sum(self.weights)
        self.listed = frozenset(stored.split)
        """Every value of the split, also those of weight 0 (routed only as a canary)."""
        self.current = [0] * len(self.arms)
        self.require = tuple(stored.require.items())
        self.required = frozenset(self.require)
        """The required tags as pairs: ``rec.tags.items() >= required`` is the check."""
        self.tag = stored.split_by or "" if not self.by_version else None
        """The split's tag key (None: the split is by version)."""

    def required_for(self, req_tags: dict[str, str]) -> frozenset[tuple[str, str]]:
        """The required tags a request must not lack: those whose key it does not name."""
        if not req_tags:
            return self.required
        return frozenset(p for p in self.required if p[0] not in req_tags)

    def arm(self, req: RouteRequest) -> tuple[str | None, bool]:
        """The arm of ``req`` and whether it may fall back to the others: (None, True) when
        the rule has no split."""
        if req.canary is not None:
            return req.canary, False
        if not self.arms:
            return None, True
        if req.sticky_key:
            point = hash64(req.sticky_key) % self.total
            for value, w in zip(self.arms, self.weights, strict=True):
                if point < w:
                    return value, True
                point -= w
        # Smooth weighted round robin (nginx): every arm gains its weight, the largest wins
        # and pays the total back: exact shares over each cycle of `total` requests.
        current, weights = self.current, self.weights
        best = 0
        for i, w in enumerate(weights):
            current[i] += w
            if current[i] > current[best]:
                best = i
        current[best] -= self.total
        return self.arms[best], True

    def value_of(self, rec: Member) -> str | None:
        """``rec``'s value of the split key."""
        return rec.version if self.by_version else rec.tags.get(self.split_by or "")


def decode_rule(capability: str, data: bytes) -> RouteRule:
    """A stored rule, checked: InvalidRequest naming the capability and the field."""
    check_capability(capability)
    try:
        rule = rule_decoder.decode(data)
    except msgspec.ValidationError as exc:
        raise InvalidRequest(f"rule for {capability!r}: {exc}") from None
    except msgspec.DecodeError as exc:
        raise InvalidRequest(f"rule for {capability!r}: malformed JSON ({exc})") from None
    if rule.split and not rule.split_by:
        raise InvalidRequest(f"rule for {capability!r}: split without split_by")
    return rule


class Rules(dict[str, Rule]):
    """Every capability's rule in force, by name (a ``dict``: one lookup per route)."""

    def __init__(self, configured: dict[str, RouteRule] | None = None) -> None:
        super().__init__()
        self.configured = dict(configured or {})
        """The rules of ``broker.toml``."""
        self.stored: dict[str, RouteRule] = {}
        """The rules of KV ``reach_rules``."""
        for cap, rule in self.configured.items():
            self[cap] = Rule(rule, "config")

    def put(self, capability: str, rule: RouteRule) -> None:
        """The bucket's rule for ``capability`` (in force until cleared)."""
        self.stored[capability] = rule
        self[capability] = Rule(rule, "kv")

    def unset(self, capability: str) -> RouteRule | None:
        """The bucket's rule cleared: ``broker.toml``'s applies again, if any. Returns the
        rule now in force."""
        self.stored.pop(capability, None)
        file_rule = self.configured.get(capability)
        if file_rule is None:
            self.pop(capability, None)
            return None
        self[capability] = Rule(file_rule, "config")
        return file_rule
