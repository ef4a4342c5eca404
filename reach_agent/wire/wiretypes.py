"""The vocabulary every wire Struct is built from: the shared ``Base``, the id and
capability patterns (and the checks of one value against them), the bounded field types
and the literal states.

Its own module so the Structs of ``schema`` and ``wirerecords`` share one base without
importing each other; ``schema`` re-exports every name here.
"""

from __future__ import annotations

import re
from typing import Annotated, Literal

import msgspec
from msgspec import Meta

from .errors import InvalidCapability, InvalidRequest

PROTOCOL_VERSION = 1

AGENT_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_-]{0,127}$"
CAPABILITY_TOKEN = r"[a-z0-9][a-z0-9_-]*"
CAPABILITY_PATTERN = rf"^{CAPABILITY_TOKEN}(\.{CAPABILITY_TOKEN})*$"
CAPABILITY_MAX_LEN = 128
TAG_KEY_PATTERN = r"^[a-z0-9_]+$"

_AGENT_ID_RE = re.compile(AGENT_ID_PATTERN)
_CAPABILITY_RE = re.compile(CAPABILITY_PATTERN)
_TAG_KEY_RE = re.compile(TAG_KEY_PATTERN)

MAX_BODY_BYTES = 64 * 1024
"""Largest control-plane body (announce, heartbeat, route) the broker decodes."""

AgentId = Annotated[str, Meta(pattern=AGENT_ID_PATTERN)]
Capability = Annotated[str, Meta(max_length=CAPABILITY_MAX_LEN)]
ShortText = Annotated[str, Meta(max_length=256)]
Count = Annotated[int, Meta(ge=0, le=2**53)]
Millis = Annotated[int, Meta(ge=0, le=7 * 24 * 3600 * 1000)]
IntervalMs = Annotated[int, Meta(ge=50, le=3600 * 1000)]
Concurrency = Annotated[int, Meta(ge=1, le=100_000)]
Percent = Annotated[float, Meta(ge=0, le=100)]

AgentState = Literal["healthy", "suspect", "offline", "recovering", "draining"]
AGENT_STATES: tuple[AgentState, ...] = ("healthy", "suspect", "offline", "recovering", "draining")
AgentStatus = Literal["idle", "busy", "draining"]
EventKind = Literal["registered", "state", "left", "evicted", "released", "rule"]
AckState = Literal["received", "completed", "failed"]
PROTOCOL_REACH = "reach"
PROTOCOL_SYNADIA = "synadia-agents"
"""How a candidate is spoken to: reach's task protocol, or the Synadia Agent Protocol's
prompt protocol (an agent the broker discovered on ``$SRV.INFO.agents``)."""
ClaimState = Literal["running", "completed", "failed", "released"]


class Base(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """Shared options of every wire type."""


# --- checks of one value that msgspec cannot express --------------------------------------


def is_agent_id(value: str) -> bool:
    return _AGENT_ID_RE.match(value) is not None


def check_agent_id(value: str, field: str = "agent_id") -> str:
    if not is_agent_id(value):
        raise InvalidRequest(
            f"{field} {value[:160]!r} is not a valid agent id "
            "(one subject token: [A-Za-z0-9][A-Za-z0-9_-]{0,127})"
        )
    return value


def check_capability(value: str, field: str = "capability") -> str:
    if len(value) > CAPABILITY_MAX_LEN:
        raise InvalidCapability(
            f"{field} {value[:40]!r}... is {len(value)} chars, longer than {CAPABILITY_MAX_LEN}"
        )
    if _CAPABILITY_RE.match(value) is None:
        raise InvalidCapability(
            f"{field} {value!r} is not a valid capability "
            "(dot-separated lowercase tokens [a-z0-9][a-z0-9_-]*)"
        )
    return value


def check_tags(tags: dict[str, str], field: str = "tags") -> None:
    for key in tags:
        if _TAG_KEY_RE.match(key) is None:
            raise InvalidRequest(f"{field} key {key[:80]!r} is not lowercase [a-z0-9_]+")
