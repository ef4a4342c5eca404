"""Agent Cards: what the registry knows of each agent, and of reach, as A2A describes agents.

A card follows A2A 1.0 (the JSON of the protocol's ``AgentCard`` message: camelCase names,
``supportedInterfaces``) and carries the three fields an A2A 0.3 reader needs besides
(``url``, ``preferredTransport``, ``protocolVersion``), so both generations of clients read
it, as the a2a-sdk's own servers do. The cards are built here from the broker's records — no
protocol SDK at run time, a few microseconds a card — and ``tests/test_a2a_cards.py`` holds
every shape against the a2a-sdk's types (the 1.0 protobuf parsed strictly, its REQUIRED
fields, and the 0.3 model).

**Availability** is a card extension (A2A's ``capabilities.extensions``), URI
:data:`AVAILABILITY_URI`, whose ``params`` are what reach measured, not what the agent says:
its state, score, load, ``last_seen_ms`` (the broker's clock at the agent's last heartbeat)
and ``updated_at`` (when this card was made). Skills are the agent's capabilities; an
announce's ``metadata`` may describe them (:func:`skill_hints`).
"""

from __future__ import annotations

import time
from typing import Any

import msgspec

from reach_agent.wire.errors import ReachError
from reach_agent.wire.schema import AgentState, RouteRequest
from reach_broker.core.records import AgentRecord
from reach_broker.core.registry import Registry
from reach_broker.core.routing import Router

AVAILABILITY_URI = "urn:reach:a2a:availability:v1"
"""The availability extension of an agent's card (its ``params``: :class:`Availability`)."""
FLEET_URI = "urn:reach:a2a:fleet:v1"
"""The fleet extension of reach's own card and of a capability's (its ``params``:
:class:`Fleet`: the whole fleet's, or the capability's agents)."""
PROTOCOL_VERSION = "1.0"
"""The A2A protocol version the cards and the JSON-RPC endpoints follow."""
COMPAT_PROTOCOL_VERSION = "0.3"
"""The older version served beside it (same URL; the card's 0.3 fields name it)."""
BINDING = "JSONRPC"
INPUT_MODES = ["application/json", "text/plain"]
OUTPUT_MODES = ["application/json", "text/plain"]


class _Card(msgspec.Struct, kw_only=True, omit_defaults=True, rename="camel"):
    """Shared options: A2A's JSON names are camelCase; unset optional fields are left out."""


class Interface(_Card):
    url: str
    protocol_binding: str
    protocol_version: str


class Availability(msgspec.Struct, kw_only=True):
    """``params`` of the availability extension (snake_case, every field always present)."""

    state: AgentState
    """reach's state of the agent: only ``healthy`` agents are routed."""
    score: float
    """reach's score in [0, 100] (liveness, latency, load, success)."""
    load: float
    """active / max_concurrency as last reported, in [0, 1]."""
    updated_at: str
    """When these figures were read (ISO 8601, UTC): the card's freshness."""
    last_seen_ms: int
    """The broker's wall-clock time of the agent's last heartbeat or announce (Unix ms)."""
    active: int
    max_concurrency: int
    success_rate: float


class Fleet(msgspec.Struct, kw_only=True):
    """``params`` of the fleet extension on reach's own card."""

    agents: int
    by_state: dict[str, int]
    skills_reachable: int
    updated_at: str


class Extension(_Card):
    uri: str
    description: str
    params: Availability | Fleet
    required: bool = False


class Capabilities(_Card):
    streaming: bool
    extensions: list[Extension] = []


class Skill(_Card):
    id: str
    name: str
    description: str
    tags: list[str]
    examples: list[str] = []
    input_modes: list[str] = []
    output_modes: list[str] = []


class AgentCard(_Card, kw_only=True):
    name: str
    description: str
    supported_interfaces: list[Interface]
    version: str
    capabilities: Capabilities
    default_input_modes: list[str]
    default_output_modes: list[str]
    skills: list[Skill]
    documentation_url: str | None = None
    security_schemes: dict[str, Any] | None = None
    security_requirements: list[Any] | None = None
    # The A2A 0.3 reading of the same card: its first interface, as 0.3 named it.
    url: str
    preferred_transport: str
    protocol_version: str


class Cards(msgspec.Struct, kw_only=True):
    """The body of ``GET /agents``."""

    agents: list[AgentCard]


encoder = msgspec.json.Encoder()


class Where(msgspec.Struct, frozen=True, kw_only=True):
    """How the cards of one request are addressed and secured."""

    base_url: str
    """The gateway's base URL, without a trailing slash."""
    token: bool = False
    """Requests need ``Authorization: Bearer``: the cards declare it."""
    streaming: bool = True

    def interfaces(self, path: str) -> list[Interface]:
        url = f"{self.base_url}{path}"
        return [Interface(url=url, protocol_binding=BINDING, protocol_version=v)
                for v in (PROTOCOL_VERSION, COMPAT_PROTOCOL_VERSION)]  # fmt: skip

    def card(self, **fields: Any) -> AgentCard:
        """A card with this address's interfaces (the first one also as the 0.3 ``url``)."""
        interfaces: list[Interface] = fields.pop("supported_interfaces")
        security: dict[str, Any] = {}
        if self.token:
            security = {
                "security_schemes": {"bearer": {"httpAuthSecurityScheme": {
                    "scheme": "Bearer",
                    "description": "the gateway's token (--a2a-token, else the console's)"}}},
                "security_requirements": [{"schemes": {"bearer": {"list": []}}}],
            }  # fmt: skip
        return AgentCard(
            supported_interfaces=interfaces, url=interfaces[0].url,
            preferred_transport=BINDING, protocol_version=f"{COMPAT_PROTOCOL_VERSION}.0",
            default_input_modes=INPUT_MODES, default_output_modes=OUTPUT_MODES,
            **security, **fields,
        )  # fmt: skip


def iso_utc(wall_ms: int) -> str:
    """``2026-12-01T12:00:00.123Z``."""
    seconds, ms = divmod(wall_ms, 1000)
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(seconds)) + f".{ms:03d}Z"


def skill_hints(metadata: dict[str, Any], capability: str) -> dict[str, Any]:
    """What an announce's ``metadata`` says of one capability: ``metadata["skills"][cap]``
    (``description``: str, ``tags`` and ``examples``: lists of str). Values of another type
    are left out: metadata is free-form and a card is still served without them."""
    skills = metadata.get("skills")
    hint = skills.get(capability) if isinstance(skills, dict) else None
    if not isinstance(hint, dict):
        return {}
    out: dict[str, Any] = {}
    if isinstance(hint.get("description"), str) and hint["description"]:
        out["description"] = hint["description"]
    for key in ("tags", "examples"):
        values = hint.get(key)
        if isinstance(values, list):
            out[key] = [v for v in values if isinstance(v, str) and v]
    return out


def agent_skill(rec: AgentRecord, capability: str) -> Skill:
    hint = skill_hints(rec.announce.metadata, capability)
    tags = ["reach"]
    if rec.region is not None:
        tags.append(f"region:{rec.region}")
    tags += [f"{k}:{v}" for k, v in sorted(rec.tags.items())]
    tags += [t for t in hint.get("tags", ()) if t not in tags]
    return Skill(
        id=capability, name=capability,
        description=hint.get("description") or f"{capability}, served by {rec.agent_id}",
        tags=tags, examples=hint.get("examples", []),
    )  # fmt: skip


def availability(rec: AgentRecord, updated_at: str) -> Extension:
    return Extension(
        uri=AVAILABILITY_URI,
        description="reach's measure of this agent: state, score and load now",
        params=Availability(
            state=rec.state, score=rec.score, load=round(rec.load, 3), updated_at=updated_at,
            last_seen_ms=rec.last_seen_wall_ms, active=rec.active,
            max_concurrency=rec.max_concurrency,
            success_rate=round(rec.stats.success_rate, 4),
        ),
    )  # fmt: skip


def agent_card(rec: AgentRecord, where: Where, updated_at: str) -> AgentCard:
    """One agent's card: its capabilities as skills, reach's availability, and the gateway's
    per-agent endpoint (messages go to this agent only)."""
    ann = rec.announce
    name = ann.metadata.get("name")
    description = ann.metadata.get("description")
    if not isinstance(description, str) or not description:
        kind = f" ({ann.agent_type})" if ann.agent_type else ""
        description = f"reach agent {rec.agent_id}{kind}"
    return where.card(
        name=name if isinstance(name, str) and name else rec.agent_id,
        description=description,
        supported_interfaces=where.interfaces(f"/agents/{rec.agent_id}/a2a"),
        version=rec.version or "unversioned",
        capabilities=Capabilities(streaming=where.streaming,
                                  extensions=[availability(rec, updated_at)]),
        skills=[agent_skill(rec, cap) for cap in rec.capabilities],
    )  # fmt: skip


def agent_cards(
    registry: Registry, where: Where, wall_ms: int, *, capability: str | None = None,
    state: str | None = None,
) -> Cards:  # fmt: skip
    """The cards of every registered agent (``GET /agents``), by agent id, filtered."""
    if capability is not None:
        idx = registry.indexes.get(capability)
        recs = list(idx.members.values()) if idx else []
    else:
        recs = list(registry.agents.values())
    updated_at = iso_utc(wall_ms)
    recs.sort(key=lambda r: r.agent_id)
    return Cards(agents=[agent_card(r, where, updated_at)
                         for r in recs if state is None or r.state == state])  # fmt: skip


DEFAULT_ROUTE = RouteRequest()


def reachable(router: Router, capability: str, now: float) -> bool:
    """Whether a message for ``capability`` would be routed now (the router's own answer to
    a default route request)."""
    try:
        router.choose(capability, DEFAULT_ROUTE, now)
    except ReachError:
        return False
    return True


def capability_card(
    registry: Registry, router: Router, where: Where, capability: str, path: str,
    version: str, now: float, wall_ms: int,
) -> AgentCard:  # fmt: skip
    """A capability's card (``/a2a/<capability>``, and the origin's with ``a2a.root_skill``):
    one skill, answered by the best reachable of its agents; the fleet extension counts
    them. The skill's description, tags and examples are its best agent's (announce
    metadata, :func:`skill_hints`)."""
    idx = registry.indexes.get(capability)
    members = list(idx.members.values()) if idx is not None else []
    best = idx.ranked[0] if idx is not None and idx.ranked else (members[0] if members else None)
    hint = skill_hints(best.announce.metadata, capability) if best is not None else {}
    healthy = idx.healthy if idx is not None else 0
    by_state: dict[str, int] = {}
    for rec in members:
        by_state[rec.state] = by_state.get(rec.state, 0) + 1
    live = reachable(router, capability, now)
    fleet = Fleet(agents=len(members), by_state=by_state, skills_reachable=int(live),
                  updated_at=iso_utc(wall_ms))  # fmt: skip
    summary = (
        f"{capability}: each message goes to the best reachable of its agents "
        f"({healthy} of {len(members)} healthy), with receipts, retries and failover"
    )
    return where.card(
        name=capability,
        description=summary,
        supported_interfaces=where.interfaces(path),
        version=version,
        capabilities=Capabilities(streaming=where.streaming, extensions=[Extension(
            uri=FLEET_URI, description="the capability's agents as reach sees them now",
            params=fleet)]),
        skills=[Skill(
            id=capability, name=capability,
            description=hint.get("description") or summary,
            tags=["reach", *(t for t in hint.get("tags", ()) if t != "reach")],
            examples=hint.get("examples", []),
        )],
    )  # fmt: skip


def reach_card(
    registry: Registry, router: Router, where: Where, version: str, now: float, wall_ms: int
) -> AgentCard:
    """reach's own card: its skills are the capabilities a message would be routed for now
    (the router's own answer to a default route request)."""
    skills = []
    for cap in sorted(registry.indexes):
        idx = registry.indexes[cap]
        if not reachable(router, cap, now):
            continue
        skills.append(Skill(
            id=cap, name=cap, tags=["reach"],
            description=f"{cap}: {idx.healthy} of {len(idx.members)} agents healthy; routed "
                        f"by reach (also POST {where.base_url}/a2a/{cap})",
        ))  # fmt: skip
    fleet = Fleet(agents=len(registry.agents), by_state=dict(registry.counts),
                  skills_reachable=len(skills), updated_at=iso_utc(wall_ms))  # fmt: skip
    return where.card(
        name="reach",
        description=(
            "reach routes each message to the best reachable agent with the skill it names "
            "(message or request metadata \"skill\", or the endpoint /a2a/<skill>), with "
            "receipts, retries and failover. Its skills are the capabilities reachable now."
        ),
        supported_interfaces=where.interfaces("/a2a"),
        version=version,
        capabilities=Capabilities(streaming=where.streaming, extensions=[Extension(
            uri=FLEET_URI, description="the fleet as reach sees it now", params=fleet)]),
        skills=skills,
    )  # fmt: skip
