"""A request's result as agents and callers find it: where a claim's result is, and which
stored ack record is believed.

The agent answering a duplicate (:mod:`reach_agent.agent.claiming`), the caller waiting out
another's claim (:mod:`reach_agent.client.holder`) and ``Client.wait``
(:mod:`reach_agent.client.durable`) all read the holder's own record, so they share this one
rule: the location follows from the holder (a claim naming another subject is not believed),
and a record counts only when its body agrees with its subject.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any, Literal

import msgspec
from nats.aio.client import Client as NATS
from nats.errors import Error as NatsError

from jetstream import ackreads
from jetstream.acks import FINAL_STATES
from jetstream.claims import ClaimsUnavailable
from reach_agent import trace
from reach_agent.wire import schema
from reach_agent.wire.errors import error_for
from reach_agent.wire.schema import AckRecord, decode_ack_record
from reach_agent.wire.subjects import BROKER_ACK_AUTHOR, Subjects

log = trace.logger(__name__)

_result_decoder = msgspec.json.Decoder()


def result_location(claim: schema.Claim, subjects: Subjects) -> str:
    """Where a claim's result is: its holder's ack subject of the request. A claim's own
    ``ack_subject`` is written by whoever wrote the claim, so it is only compared."""
    location = subjects.ack(claim.agent_id, claim.request_id)
    if claim.ack_subject and claim.ack_subject != location:
        log.warning("claims.foreign_location request_id=%s holder=%s ack_subject=%s: using %s",
                    claim.request_id, claim.agent_id, claim.ack_subject, location)  # fmt: skip
    return location


def attributed(stored: ackreads.StoredAck) -> AckRecord | None:
    """The record ``stored`` holds, if its body agrees with its subject: the same request id,
    and (for an agent's record) the same agent id as the subject's author. Else None, logged."""
    try:
        rec = decode_ack_record(stored.data)
    except msgspec.MsgspecError as exc:
        log.warning("acks.ignored subject=%s reason=undecodable (%s)", stored.subject, exc)
        return None
    if rec.request_id != stored.request_id or (
        stored.author != BROKER_ACK_AUTHOR and rec.agent_id != stored.author
    ):
        log.warning("acks.ignored subject=%s reason=body names %s/%s", stored.subject,
                    rec.agent_id, rec.request_id)  # fmt: skip
        return None
    return rec


def ends_claim(rec: AckRecord) -> bool:
    """Whether an agent's final record ``rec`` ends the request's claim whatever the claim
    says: a ``completed`` record (an SDK agent's claim of a run with a result stays
    ``running``), or a ``failed`` one whose error is not retryable, which its holder ends
    ``failed`` too, by a compare-and-set of its own: should that set be lost (the holder
    gone before the store took it), the record still says the request is answered for good,
    and a release would run it again. A retryable error's record does not: its holder
    released the claim, for another agent to run it."""
    if rec.state == "completed":
        return True
    failure = rec.error or {}
    return rec.state == "failed" and not error_for(failure.get("code", "INTERNAL"), "").retryable


async def ended_by_record(nc: NATS, claim: schema.Claim, subjects: Subjects) -> AckRecord | None:
    """The first stored agent's record of ``claim``'s request that ends the claim whatever
    the claim's state says (:func:`ends_claim`; docs/protocol.md, Claims), when there is
    one: its holder's, or that of an agent that held it before — declared offline while it
    still ran, its claim released and taken over by another, and finished after all (nemesis
    seed 59: a request released twice ran a third time 170 s after its first run's result
    was stored, since only the holder's records were read). The broker's own records are
    not runs. None when there is none (the claim says how far the request got).
    ``ClaimsUnavailable`` when the ack store cannot say: never a guess, since a take-over,
    a release or a cancel on a wrong "no" lets a finished request run again."""
    try:
        found = await ackreads.all_records(nc, claim.request_id, subjects=subjects)
    except Exception as exc:  # noqa: BLE001 - a timeout, no stream: cannot decide now
        raise ClaimsUnavailable(
            f"the ack record of request {claim.request_id!r} could not be read: "
            f"{type(exc).__name__}: {exc}"
        ) from None
    for stored in found:
        if stored.state in FINAL_STATES and stored.author != BROKER_ACK_AUTHOR:
            rec = attributed(stored)
            if rec is not None and ends_claim(rec):
                return rec
    return None


async def wait_final(
    nc: NATS, request_id: str, authors: Sequence[str], subjects: Subjects, timeout_s: float,
    digest: str | None = None,
) -> AckRecord | None:  # fmt: skip
    """The first final record (``completed``/``failed``) of ``request_id`` that one of
    ``authors`` stores within ``timeout_s`` — or any agent's record that ends the request's
    claim (:func:`ends_claim`: a repeat of a request another agent finished, read once the
    store answers again), for a body of ``digest`` (when given) —, stored already or yet to
    come (:func:`jetstream.ackreads.wait_for`: it listens, and reads again while the store
    does not answer); None when none does by then or the store could not be read at all
    (said at debug)."""
    wanted = frozenset(authors)

    def accept(stored: ackreads.StoredAck) -> ackreads.StoredAck | None:
        if stored.state not in FINAL_STATES or stored.author == BROKER_ACK_AUTHOR:
            return None
        rec = attributed(stored)
        if rec is None or (digest and rec.body_digest and rec.body_digest != digest):
            return None
        return stored if stored.author in wanted or ends_claim(rec) else None

    try:
        stored = await ackreads.wait_for(nc, request_id, timeout_s, subjects=subjects,
                                         accept=accept)  # fmt: skip
    except (NatsError, TimeoutError) as exc:
        log.debug("acks.final_unheard request_id=%s authors=%s error=%r", request_id,
                  ",".join(authors), exc)  # fmt: skip
        return None
    return attributed(stored)


def answer_of(rec: AckRecord) -> tuple[Literal["ok", "error"], Any]:
    """What a call answered by the final record ``rec`` returns: ``("ok", result)``, its
    result decoded, for ``completed``; ``("error", ReachError)`` for ``failed``."""
    if rec.state == "completed":
        raw = bytes(rec.result) if rec.result is not None else b""
        return "ok", _result_decoder.decode(raw) if raw else None
    failure = rec.error or {}
    return "error", error_for(failure.get("code", "INTERNAL"), failure.get("message", ""))


async def stored_final(
    nc: NATS, request_id: str, authors: Sequence[str], subjects: Subjects, timeout_s: float
) -> AckRecord | None:
    """The final record (``completed``/``failed``) of ``request_id`` stored by the first of
    ``authors`` (in their order) that stored one, their subjects read together within
    ``timeout_s``; None when none did or the store did not answer (said at debug)."""

    async def one(author: str) -> AckRecord | None:
        try:
            stored = await ackreads.final_at(nc, subjects.ack(author, request_id),
                                             subjects=subjects, timeout_s=timeout_s)  # fmt: skip
        except (NatsError, TimeoutError) as exc:
            log.debug("acks.final_unread request_id=%s author=%s error=%r", request_id, author,
                      exc)  # fmt: skip
            return None
        return attributed(stored) if stored is not None else None

    found = await asyncio.gather(*(one(a) for a in authors))
    return next((rec for rec in found if rec is not None), None)
