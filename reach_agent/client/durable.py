"""Durable delivery for callers: ``submit`` to the compensation queue, ``wait`` for the ack.

``Client.submit`` and ``Client.wait`` delegate here. ``submit`` enqueues a task on
``reach.comp.<capability>`` (``REACH_COMPENSATION``) with ``Nats-Msg-Id`` = request id, a
priority and an expiry; the broker replays it, with the same request id, as soon as an
agent for the capability is reachable (at once when one already is). ``wait`` returns the
final ``AckRecord`` (``completed`` or ``failed``) from ``REACH_ACKS``, whether it was stored
long ago (also after the caller itself restarted) or arrives while waiting, and only the
record of the agent that took the task (see :func:`wait`).
"""

from __future__ import annotations

import logging
import time
import uuid
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from typing import Any

import msgspec
from nats.aio.client import Client as NATS
from nats.errors import ConnectionClosedError, NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js.errors import ServiceUnavailableError

from jetstream import ackreads, acks, compensation
from jetstream.claims import ClaimStore, ClaimsUnavailable, claim_key
from jetstream.names import H_REQUEST_ID
from reach_agent import trace
from reach_agent.results import attributed
from reach_agent.wire import schema
from reach_agent.wire.errors import (
    CompensationFull,
    IdempotencyMismatch,
    InvalidRequest,
    StoreUnavailable,
    Timeout,
)
from reach_agent.wire.schema import AckRecord, body_digest, check_capability, encoder
from reach_agent.wire.subjects import BROKER_ACK_AUTHOR, DEFAULT_PREFIX, Subjects

log = trace.logger(__name__)

STORE_ERRORS = (NatsTimeoutError, NoRespondersError, ConnectionClosedError, ServiceUnavailableError)
"""What nats-py raises when the ack store does not answer (no answer in time, no responders,
JetStream's 503 while it starts or elects, the connection closed): ``STORE_UNAVAILABLE``."""

DEFAULT_TTL_S = 3600.0
"""Expiry of a queued entry when ``ttl`` is not given (the broker's default_ttl_s)."""
MAX_PRIORITY = 1_000_000


class Submitted(str):
    """The request id of a submitted task; ``duplicate`` is True when it was already queued
    (the same request id within the queue's duplicate window): nothing new was stored."""

    duplicate: bool
    seq: int

    def __new__(cls, request_id: str, *, duplicate: bool, seq: int) -> Submitted:
        obj = super().__new__(cls, request_id)
        obj.duplicate = duplicate
        obj.seq = seq
        return obj


def connection_of(client: Any) -> NATS:
    """The NATS connection of a ``reach_agent.Client`` (or a raw connection)."""
    if isinstance(client, NATS):
        return client
    nc = getattr(client, "nc", None)
    if nc is None:
        raise InvalidRequest(f"{type(client).__name__} has no NATS connection (not connected?)")
    return nc  # type: ignore[no-any-return]


async def submit(
    client: Any,
    capability: str,
    payload: Any,
    *,
    deliver: str = "eventually",
    priority: int = 0,
    ttl: float | None = None,
    request_id: str | None = None,
    headers: Mapping[str, str] | None = None,
    prefix: str = DEFAULT_PREFIX,
) -> Submitted:
    """Queue a task for eventual delivery; returns its request id.

    Raises ``IdempotencyMismatch`` when ``request_id`` was already used with another body
    (its claim, or the entry queued under it, says so: nothing new was stored),
    ``CompensationFull`` when the queue is at its bound (nothing was stored),
    ``StoreUnavailable`` (retryable) when no stream took it (none provisioned yet, or no
    PubAck in time: submit again with the same request id), ``InvalidRequest``/
    ``InvalidCapability`` for bad arguments. Higher ``priority`` replays
    first; ``ttl`` (seconds) is how long the entry may wait before it is recorded as
    ``failed`` with reason ``expired``.
    """
    if deliver != "eventually":
        raise InvalidRequest(f"deliver {deliver!r} is not supported by submit (use 'eventually')")
    check_capability(capability)
    if not -MAX_PRIORITY <= priority <= MAX_PRIORITY:
        raise InvalidRequest(f"priority {priority!r} is outside ±{MAX_PRIORITY}")
    ttl_s = DEFAULT_TTL_S if ttl is None else ttl
    if not ttl_s > 0:
        raise InvalidRequest(f"ttl {ttl!r} must be a positive number of seconds")
    rid = request_id or str(uuid.uuid4())
    try:
        acks.check_request_id(rid)
    except acks.InvalidRequestId as exc:
        raise InvalidRequest(str(exc)) from None
    data = bytes(payload) if isinstance(payload, bytes | bytearray) else encoder.encode(payload)
    digest = body_digest(data)
    hdrs = dict(headers or {})
    hdrs[H_REQUEST_ID] = rid
    nc = connection_of(client)
    claim = await read_claim(nc, rid) if request_id else None  # a fresh uuid4 was never used
    if claim is not None and claim.body_digest is not None and claim.body_digest != digest:
        _count(client, "mismatch")
        raise IdempotencyMismatch.reused(
            rid, claim.body_digest, digest, seen=f"its claim, held by agent {claim.agent_id!r}"
        )
    try:
        res = await compensation.enqueue(
            nc,
            capability,
            data,
            request_id=rid,
            priority=priority,
            expires_at_ms=int((time.time() + ttl_s) * 1000),
            headers=hdrs,
            subjects=Subjects(prefix),
            body_digest=digest,
        )
    except compensation.QueueFull as exc:
        _count(client, "refused")
        raise CompensationFull(f"{exc}; request_id {rid!r} was not queued") from None
    except compensation.QueueError as exc:  # no stream (no broker yet), no PubAck in time
        _count(client, "unavailable")
        raise StoreUnavailable(f"{exc}; request_id {rid!r} may not be queued: submit it again "
                               "with the same request_id (a repeat is not stored twice)",
                               retry_after_ms=1000) from None  # fmt: skip
    if res.duplicate:
        first = await compensation.digest_at(nc, res.seq)
        if first is not None and first != digest:
            _count(client, "mismatch")
            raise IdempotencyMismatch.reused(rid, first, digest, seen="the compensation queue")
        log.info("submit.duplicate request_id=%s capability=%s seq=%d", rid, capability, res.seq)
    _count(client, "duplicate" if res.duplicate else "enqueued")
    return Submitted(rid, duplicate=res.duplicate, seq=res.seq)


def _count(client: Any, result: str) -> None:
    """``reach_compensation_total{result}`` of the client's metrics, when it has them."""
    metrics = getattr(client, "metrics", None)
    if metrics is not None:
        metrics.compensation.labels(result).inc()


TAKERS_MAX = 10_000
"""Request ids a client remembers the taker of."""


class Takers:
    """request id → the agent that took it (its receipt or result reached this client), for
    the last :data:`TAKERS_MAX` calls."""

    def __init__(self, size: int = TAKERS_MAX) -> None:
        self.size = size
        self._by_request: OrderedDict[str, str] = OrderedDict()

    def remember(self, request_id: str, agent_id: str) -> None:
        by = self._by_request
        by[request_id] = agent_id
        by.move_to_end(request_id)
        if len(by) > self.size:
            by.popitem(last=False)

    def get(self, request_id: str) -> str | None:
        return self._by_request.get(request_id)


class _Taken:
    """Which agents took a request, and the first final record each wrote: the rule of
    :func:`wait`, fed the request's attributed records in stream order."""

    def __init__(self, takers: set[str]) -> None:
        self.takers = takers
        self.finals: dict[str, tuple[ackreads.StoredAck, AckRecord]] = {}
        self.answer: AckRecord | None = None

    def accept(self, stored: ackreads.StoredAck) -> ackreads.StoredAck | None:
        rec = attributed(stored)
        if rec is None:
            return None
        if stored.author == BROKER_ACK_AUTHOR:
            if stored.state in acks.FINAL_STATES:  # expired, finally refused, or the answer
                self.answer = rec  # of an agent that writes no records (a Synadia agent)
                return stored
            if stored.state == "received":  # "I handed the task to <agent_id>"
                self.takers.add(rec.agent_id)
                return self._final_of(rec.agent_id)
            return None
        if stored.state in acks.FINAL_STATES:
            self.finals.setdefault(stored.author, (stored, rec))
        return self._final_of(stored.author) if stored.author in self.takers else None

    def taken_by(self, agent_id: str) -> ackreads.StoredAck | None:
        """``agent_id`` took it too (learnt since): its final record told earlier, if any."""
        self.takers.add(agent_id)
        return self._final_of(agent_id)

    def _final_of(self, agent_id: str) -> ackreads.StoredAck | None:
        found = self.finals.get(agent_id)
        if found is None:
            return None
        self.answer = found[1]
        return found[0]


async def wait(
    client: Any,
    request_id: str,
    timeout: float,  # noqa: ASYNC109 - the SDK's public signature
    *,
    agent_id: str | None = None,
    prefix: str = DEFAULT_PREFIX,
) -> AckRecord:
    """The final ack record (``completed``/``failed``) of ``request_id``, written by the agent
    that took the task, its ``result`` decoded (the handler's return value, as
    ``Client.call`` would have returned it).

    Who took it: ``agent_id`` when given; else the agent whose receipt or result ``client``
    received for it (``Client.call``); else the holder of the request id's claim (KV
    ``reach_claims``, when there is one; read again every ``ackreads.REREAD_S`` while no
    taker is known: the claim of a task not yet handed over is written after the wait
    began); and an agent a broker names in its own ``received`` record
    (``reach.ack._broker.<request_id>``, written when it hands a submitted task over).
    A final record of the broker (``failed``: expired, or finally refused; ``completed`` or
    ``failed``: the answer of a Synadia agent, which writes none) is final too. Records of
    any other author, copies of stored messages and records whose body disagrees with their
    subject are ignored. Raises ``Timeout`` when none is stored within ``timeout`` seconds,
    ``StoreUnavailable`` (retryable) when no read of ``REACH_ACKS`` succeeded within them (a
    read that fails is tried again: :func:`jetstream.ackreads.wait_for`) or the connection
    is closed (:data:`STORE_ERRORS`).
    """
    takers = {agent_id} if agent_id else set()
    remembered = getattr(client, "takers", None)
    known = remembered.get(request_id) if isinstance(remembered, Takers) else None
    if known:
        takers.add(known)
    taken = _Taken(takers)

    async def claimed(again: bool = True) -> ackreads.StoredAck | None:
        """While nobody is known to have taken it, the claim's holder: read at the start, and
        again before each re-read of the stream (a broker that handed the task over and died
        before its ``received`` record, or a replica that found the request claimed and sent
        it no more, names no taker: nemesis seed 32)."""
        if taken.takers:
            return None
        holder = await _claim_holder(connection_of(client), request_id, again=again)
        return taken.taken_by(holder) if holder else None

    await claimed(again=False)  # nothing told yet: it only names the taker
    try:
        await ackreads.wait_for(connection_of(client), request_id, timeout,
                            subjects=Subjects(prefix), accept=taken.accept,
                            again=claimed)  # fmt: skip
    except acks.InvalidRequestId as exc:
        _count_wait(client, "invalid")
        raise InvalidRequest(str(exc)) from None
    except STORE_ERRORS as exc:  # before TimeoutError: nats-py's timeout is one
        _count_wait(client, "unavailable")
        raise StoreUnavailable(f"REACH_ACKS could not be read for request_id {request_id!r} "
                               f"({type(exc).__name__}: {exc}): wait for it again",
                               retry_after_ms=1000) from None  # fmt: skip
    except TimeoutError:
        _count_wait(client, "timeout")
        who = f" by {', '.join(sorted(takers))}" if takers else " (no taker known yet)"
        raise Timeout(
            f"no completed or failed record for request_id {request_id!r}{who} within {timeout}s"
        ) from None
    assert taken.answer is not None
    _count_wait(client, taken.answer.state)
    return _decoded(taken.answer)


def _count_wait(client: Any, result: str) -> None:
    """``reach_wait_total{result}`` of the client's metrics, when it has them."""
    metrics = getattr(client, "metrics", None)
    if metrics is not None:
        metrics.waits.labels(result).inc()


def final_of(stored: Iterable[ackreads.StoredAck], takers: Iterable[str]) -> AckRecord | None:
    """The record :func:`wait` answers with among ``stored`` (one request's attributed
    records, oldest first) when ``takers`` took it, its ``result`` decoded; None while there
    is none (a reader that already holds the records: the A2A gateway's tasks)."""
    taken = _Taken(set(takers))
    for rec in stored:
        if taken.accept(rec) is not None:
            assert taken.answer is not None
            return _decoded(taken.answer)
    return None


async def read_claim(nc: NATS, request_id: str, *, again: bool = False) -> schema.Claim | None:
    """``request_id``'s claim, if the claims bucket has one and says so now (a bucket that
    cannot say is logged, at debug when read ``again``: the agents check the claim again
    anyway)."""
    try:
        stored = await ClaimStore(nc).get(claim_key(request_id))
        return schema.claim_decoder.decode(stored.data) if stored is not None else None
    except (ClaimsUnavailable, msgspec.MsgspecError) as exc:
        log.log(logging.DEBUG if again else logging.INFO,
                "claims.unreadable request_id=%s error=%s", request_id, exc)  # fmt: skip
        return None


async def _claim_holder(nc: NATS, request_id: str, *, again: bool = False) -> str | None:
    """The agent holding ``request_id``'s claim, if the claims bucket has one (its holder's
    records are the result; a released claim names nobody)."""
    claim = await read_claim(nc, request_id, again=again)
    return claim.agent_id if claim is not None and claim.state != "released" else None


async def last(
    client: Any, request_id: str, *, agent_id: str | None = None, prefix: str = DEFAULT_PREFIX
) -> AckRecord | None:
    """The latest attributed ack record of ``request_id`` (any state; by ``agent_id`` only
    when given), or None. Its ``agent_id`` is the author the server let write it."""
    try:
        stored = await ackreads.all_records(connection_of(client), request_id,
                                        subjects=Subjects(prefix), author=agent_id)  # fmt: skip
    except acks.InvalidRequestId as exc:
        raise InvalidRequest(str(exc)) from None
    for rec in reversed(stored):
        body = attributed(rec)
        if body is not None:
            return _decoded(body)
    return None


def _decoded(rec: AckRecord) -> AckRecord:
    """``rec`` with its ``result`` (``msgspec.Raw`` as stored) decoded."""
    if isinstance(rec.result, msgspec.Raw):
        return msgspec.structs.replace(rec, result=msgspec.json.decode(rec.result))
    return rec
