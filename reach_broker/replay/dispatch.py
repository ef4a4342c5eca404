"""Exactly-once replay across a leader change: which agent a queued entry was sent to.

Replication keeps the compensation queue's entries, but not the promise that each runs once:
when the stream (or its consumer) changes leader, an ack in flight can be lost, and the
entry is redelivered after ``ack_wait`` — maybe to another replica, which would route it to
another agent. So before sending an entry the replayer writes a **dispatch marker** — the
agent it chose — under ``_replay.<digest of request id>`` in KV ``reach_registry``
(replicated like everything else, with a per-message TTL so markers clean themselves up).
A redelivered entry (``num_delivered > 1``) is looked up first:

- a broker's own ack record of the request id already stored on ``REACH_ACKS``
  (``reach.ack._broker.<request_id>``: the ``received`` naming the agent whose receipt came
  back, or a final ``failed``): the task reached an agent; the entry is acked and not sent
  again;
- else a marker: the entry goes to the **same** agent while the registry knows it and it is
  not ``offline``; that agent's de-duplication by request id answers a second delivery with
  its first result (or its receipt while it still runs), so the handler runs once;
- else, or when the marked agent is gone, the entry is routed as new (at least once: the
  marked agent may have run it without its records reaching the stream yet — the gap the
  fleet-wide claims of issue 14 close).

**With the fleet-wide claims** (KV ``reach_claims``, issue 14: an agent claims the request id
before its handler runs): the replayer first asks who holds the claim and removes a claimed
entry without sending it, and an agent answers a duplicate ``IN_PROGRESS``; so a delivery to
any agent is safe and the claim, not the marker, decides correctness. The marker stays as
what it costs little to keep: the redelivery goes where the result already is, and the
ack-record check saves a send when no claim is visible (an agent without claims, e.g. an
older SDK, or a capability declared idempotent).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import msgspec
from nats.aio.client import Client as NATS
from nats.js.errors import KeyNotFoundError

from jetstream import ackreads
from jetstream.names import REGISTRY_BUCKET, dispatch_key
from reach_agent.wire.subjects import BROKER_ACK_AUTHOR, Subjects
from reach_broker.core.records import AgentRecord

log = logging.getLogger(__name__)

MARKER_TTL_S = 24 * 3600.0
"""A marker outlives any redelivery of its entry (entries default to an hour)."""
MIN_TTL_S = 1.0


class Marker(msgspec.Struct, frozen=True, kw_only=True):
    """The value of a dispatch marker."""

    agent_id: str
    broker_id: str
    at_ms: int


_marker_decoder = msgspec.json.Decoder(Marker)
_encoder = msgspec.json.Encoder()


class Dispatches:
    """The replayer's record of where each queued request went."""

    def __init__(
        self,
        nc: NATS,
        subjects: Subjects,
        broker_id: str,
        record_of: Callable[[str], AgentRecord | None],
    ) -> None:
        self.nc = nc
        self.subjects = subjects
        self.broker_id = broker_id
        self.record_of = record_of
        self.resent_same = 0
        """Redelivered entries sent again to the agent of their marker."""
        self.already = 0
        """Redelivered entries acked without a send: an ack record was stored."""
        self._kv: Any = None

    async def _bucket(self) -> Any:
        if self._kv is None:
            self._kv = await self.nc.jetstream(timeout=2.0).key_value(REGISTRY_BUCKET)
        return self._kv

    async def mark(self, request_id: str, agent_id: str, at_ms: int, ttl_s: float) -> None:
        """Record that ``request_id`` is being sent to ``agent_id`` (before the send)."""
        body = _encoder.encode(Marker(agent_id=agent_id, broker_id=self.broker_id, at_ms=at_ms))
        subject = f"$KV.{REGISTRY_BUCKET}.{dispatch_key(request_id)}"
        ttl = max(MIN_TTL_S, min(ttl_s, MARKER_TTL_S))
        await self.nc.jetstream(timeout=2.0).publish(subject, body, msg_ttl=ttl)

    async def marked(self, request_id: str) -> str | None:
        """The agent ``request_id`` was last sent to, if any."""
        kv = await self._bucket()
        try:
            entry = await kv.get(dispatch_key(request_id))
        except KeyNotFoundError:
            return None
        if not entry.value:
            return None
        try:
            return _marker_decoder.decode(entry.value).agent_id
        except msgspec.DecodeError:
            return None

    async def delivered(self, request_id: str) -> bool:
        """Whether a broker's own record of ``request_id`` is stored: its ``received``
        (written when an agent's receipt came back) or its final ``failed``. Not any
        author's: an agent may write records of any request id under its own name."""
        try:
            rec = await ackreads.last_record(self.nc, request_id, subjects=self.subjects,
                                             author=BROKER_ACK_AUTHOR)  # fmt: skip
        except ValueError:  # not a request id acks can hold: nothing was recorded
            return False
        return rec is not None

    async def redelivery(self, request_id: str) -> tuple[bool, str | None]:
        """For a redelivered entry: (already delivered?, the only agent to send it to)."""
        if await self.delivered(request_id):
            self.already += 1
            return True, None
        agent_id = await self.marked(request_id)
        if agent_id is None:
            return False, None
        rec = self.record_of(agent_id)
        if rec is None:  # another broker's partition (a partitioned fleet), or gone
            log.info("replay.marked_agent_unknown request_id=%s agent=%s: not held by this "
                     "broker, routed again (its claim keeps it from running twice)",
                     request_id, agent_id)  # fmt: skip
            return False, None
        if rec.state == "offline":
            log.warning("replay.marked_agent_gone request_id=%s agent=%s: routed again "
                        "(at least once)", request_id, agent_id)  # fmt: skip
            return False, None
        self.resent_same += 1
        return False, agent_id
