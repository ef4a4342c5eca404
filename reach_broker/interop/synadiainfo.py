"""Synadia Agent Protocol agents as the broker reads them: their registration (``$SRV.INFO``
replies) and heartbeats, the reach ``agent_id`` of an instance, and the ``Announce`` the broker
registers for it. Pure: no I/O.

Their protocol (v0.3): each instance is a NATS micro service named ``agents`` whose metadata
names ``agent``, ``owner``, ``session`` and ``protocol_version``, with a ``prompt`` endpoint on
``agents.prompt.<agent>.<owner>.<session>`` and a ``status`` endpoint beside it (both in
queue group ``agents``); the micro service id is the instance id, also in every heartbeat.
Everything here reads them leniently (unknown fields ignored) and refuses what cannot be
routed with a message naming the field.
"""

from __future__ import annotations

import hashlib
import re

import msgspec

from reach_agent.wire.errors import InvalidCapability, InvalidRequest
from reach_agent.wire.schema import PROTOCOL_SYNADIA, Announce, check_capability
from reach_agent.wire.subjects import AGENTS

DEFAULT_INTERVAL_S = 30
"""Their heartbeat interval unless a heartbeat says otherwise."""

_TOKEN = re.compile(r"^[A-Za-z0-9_-]+$")
_NOT_TOKEN = re.compile(r"[^A-Za-z0-9_-]")
AGENT_ID_MAX = 128
INSTANCE_MAX = 64


class Endpoint(msgspec.Struct):
    name: str = ""
    subject: str = ""
    queue_group: str | None = None
    metadata: dict[str, str] | None = None


class ServiceInfo(msgspec.Struct):
    """A ``$SRV.INFO`` reply (``io.nats.micro.v1.info_response``), the fields reach reads."""

    id: str = ""
    name: str = ""
    version: str = ""
    description: str = ""
    metadata: dict[str, str] | None = None
    endpoints: list[Endpoint] | None = None


class Beat(msgspec.Struct):
    """A heartbeat on ``agents.hb.<agent>.<owner>.<session>``, the fields reach reads."""

    agent: str
    owner: str
    instance_id: str
    interval_s: int = DEFAULT_INTERVAL_S
    session: str | None = None


class _Sub(msgspec.Struct):
    subject: str = ""


class _Conn(msgspec.Struct):
    cid: int = 0
    subscriptions_list_detail: list[_Sub] | None = None


class _Connz(msgspec.Struct):
    connections: list[_Conn] = []


class _ConnzReply(msgspec.Struct):
    data: _Connz | None = None


class _Status(msgspec.Struct):
    instance_id: str = ""


connz_decoder = msgspec.json.Decoder(_ConnzReply)
status_decoder = msgspec.json.Decoder(_Status)
"""A ``CONNZ`` reply with subscription details, and a ``status`` reply: the fields read."""

info_decoder = msgspec.json.Decoder(ServiceInfo)
beat_decoder = msgspec.json.Decoder(Beat)


def agent_id_of(agent: str, owner: str, session: str, instance_id: str) -> str:
    """The reach agent id of one instance: ``<agent>_<owner>_<session>_<instance_id>``.

    Characters outside ``[A-Za-z0-9_-]`` become ``-``; the first three parts are cut so the
    whole fits in 128 characters; an instance id that is not such a token, or is longer than
    64, is replaced by ``h`` and the 16 hex digits of its BLAKE2b-64. The instance id (the
    micro service id, unique per process) makes it unique; the rest makes it readable.
    """
    inst = instance_id
    if not _TOKEN.match(inst) or len(inst) > INSTANCE_MAX:
        inst = "h" + hashlib.blake2b(instance_id.encode(), digest_size=8).hexdigest()
    head = _NOT_TOKEN.sub("-", f"{agent}_{owner}_{session}")[: AGENT_ID_MAX - 1 - len(inst)]
    if not head[:1].isalnum():
        head = "a" + head[1:] if head else "a"
    return f"{head}_{inst}"


def capabilities_of(agent: str, listed: str | None) -> tuple[list[str], list[str]]:
    """(capabilities, refused entries): the agent token, then each comma-separated entry of
    the service metadata key ``capabilities``; an entry that is not a valid capability name
    (or a repeat) is refused, not guessed at."""
    caps: list[str] = []
    refused: list[str] = []
    for i, raw in enumerate([agent, *(listed or "").split(",")]):
        cap = raw.strip()
        if not cap and i > 0:
            continue
        try:
            check_capability(cap, "agent" if i == 0 else "metadata capabilities entry")
        except InvalidCapability as exc:
            refused.append(exc.message)
            continue
        if cap not in caps:
            caps.append(cap)
    return caps, refused


def announce_of(
    info: ServiceInfo, *, interval_s: int, max_concurrency: int
) -> tuple[Announce, list[str]]:
    """The announce the broker registers for one instance, and the capability entries it
    refused; raises :class:`InvalidRequest` (naming the field) for a registration reach
    cannot route: not the ``agents`` service, no ``agent``/``owner``, no ``prompt``
    endpoint, no usable capability."""
    if info.name != AGENTS.service:
        raise InvalidRequest(f"service name {info.name[:80]!r} is not {AGENTS.service!r}")
    meta = info.metadata or {}
    agent, owner = meta.get("agent", ""), meta.get("owner", "")
    if not agent or not owner:
        raise InvalidRequest(f"instance {info.id[:80]!r}: metadata lacks 'agent' or 'owner'")
    if not info.id:
        raise InvalidRequest(f"agent {agent[:80]!r}: the service has no id (instance id)")
    endpoints = {e.name: e.subject for e in info.endpoints or () if e.subject}
    prompt = endpoints.get("prompt")
    if prompt is None:
        raise InvalidRequest(f"instance {info.id[:80]!r} ({agent[:80]}): no 'prompt' endpoint")
    tokens = prompt.split(".")
    session = meta.get("session") or (tokens[4] if len(tokens) == 5 else "") or "default"
    caps, refused = capabilities_of(agent, meta.get("capabilities"))
    if not caps:
        raise InvalidRequest(
            f"instance {info.id[:80]!r}: no valid capability ({'; '.join(refused)})"
        )
    ann = Announce(
        agent_id=agent_id_of(agent, owner, session, info.id),
        capabilities=caps[:256],
        max_concurrency=max_concurrency,
        heartbeat_interval_ms=min(max(interval_s, 1), 3600) * 1000,
        agent_type=PROTOCOL_SYNADIA,
        version=info.version[:256] or None,
        region=meta.get("region", "")[:256] or None,
        metadata={
            "agent": agent,
            "owner": owner,
            "session": session,
            "instance_id": info.id,
            "prompt": prompt,
            "status": endpoints.get("status") or AGENTS.status(agent, owner, session),
            "protocol_version": meta.get("protocol_version", ""),
        },
    )
    return ann, refused
