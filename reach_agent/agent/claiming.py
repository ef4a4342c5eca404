"""The agent's fleet-wide claim of a request id: decide, then claim, then answer.

Before a handler runs, the agent creates the request id's claim in KV ``reach_claims``
(:mod:`jetstream.claims`). Exactly one create succeeds across the fleet; an agent whose
create finds a claim decides with :func:`decide` (pure) what the stored claim means:

    released (its holder went offline)           → take it over (compare-and-set), run
    running, held by this agent's earlier process → take it over (that process died), run
    running, held by anyone else                  → IN_PROGRESS, naming the holder
    completed / failed                            → answer the stored result (the holder's
                                                    final ack record), never run again

So an agent's first lookup for a request id, also right after a restart, is the claim and
the ack store, not its memory. The holder ends its claim (``completed``/``failed``) ahead of
its reply, or hands it back (``released``) when the task ended in a retryable error, so
another agent may run it. Without JetStream or without the bucket (open dev mode) claims
are off: the per-process duplicate window alone applies, logged once, re-checked every
``recheck_s``. A claim store that exists but does not answer in time refuses the task with a
retryable ``TIMEOUT`` rather than run it unclaimed.

Claims go over the agent's own connection, not the ack writer's: the claim must be stored
before the receipt leaves (the receipt means "this agent holds it"), and the ack writer's
connection batches and retries asynchronously behind a write-ahead log — a claim queued
there would wait behind acks, and its ordering against the receipt would need a second
connection's PubAck anyway. On the agent's connection it is one round trip before the
receipt; the claim's end is sent just before the result on the same connection (so the
server has it first) and confirmed after, costing no second wait; and an agent cut off from
NATS cannot claim at all (exactly when it could not reply either).
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Literal

import msgspec
from nats.aio.client import Client as NATS

from jetstream import ackreads
from jetstream.claims import ClaimStore, ClaimsUnavailable, NoClaimsBucket, Stored, claim_key
from jetstream.names import H_REQUEST_ID
from reach_agent import trace
from reach_agent.results import attributed, result_location
from reach_agent.wire import schema
from reach_agent.wire.errors import Cancelled, InProgress, ReachError, Timeout, error_for, to_reply
from reach_agent.wire.subjects import Subjects

from .dedup import Reply

log = trace.logger(__name__)

Verdict = Literal["take_over", "in_progress", "stored"]

STORED_WAIT_S = 2.0
"""How long an agent waits for the final ack record of a claim that says it is finished
(the holder ends its claim just before its ack writer stores the record)."""


def decide(claim: schema.Claim, *, agent_id: str, instance: str) -> Verdict:
    """What a stored claim means to the agent ``agent_id`` (process ``instance``) that just
    failed to create it."""
    if claim.state == "released":
        return "take_over"
    if claim.state != "running":
        return "stored"
    if claim.agent_id == agent_id and claim.instance != instance:
        return "take_over"  # this agent's previous process died holding it
    return "in_progress"


class Held:
    """A claim this process holds: what it must end before replying."""

    __slots__ = ("claim", "key", "revision")

    def __init__(self, key: str, revision: int, claim: schema.Claim) -> None:
        self.key = key
        self.revision = revision
        self.claim = claim


class Claimed:
    """The result of claiming: ``held`` (ours: run it) or the stored claim and its verdict."""

    __slots__ = ("existing", "held", "verdict")

    def __init__(
        self,
        held: Held | None = None,
        verdict: Verdict | None = None,
        existing: schema.Claim | None = None,
    ) -> None:
        self.held = held
        self.verdict = verdict
        self.existing = existing


class Claimer:
    """Claims request ids for one agent process, over the agent's own connection."""

    def __init__(
        self,
        nc: NATS,
        agent_id: str,
        instance: str,
        subjects: Subjects,
        *,
        timeout_s: float = 2.0,
        recheck_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.nc = nc
        self.store = ClaimStore(nc, timeout_s=timeout_s)
        self.agent_id = agent_id
        self.instance = instance
        self.subjects = subjects
        self.recheck_s = recheck_s
        self.clock = clock
        self.enabled = False
        """Whether claims are taken (the bucket exists)."""
        self._checked = float("-inf")
        self._warned = False

    async def start(self) -> None:
        """Look for the bucket once; without it claims are off until a later check."""
        await self._check()

    async def _check(self) -> None:
        self._checked = self.clock()
        try:
            found = await self.store.exists()
        except ClaimsUnavailable as exc:
            log.warning("claims.check_failed agent=%s error=%s: trying again later",
                        self.agent_id, exc)  # fmt: skip
            return
        self._turn(found)

    def _turn(self, on: bool) -> None:
        if on and not self.enabled:
            log.info("claims.on agent=%s bucket=%s", self.agent_id, self.store.bucket)
            self._warned = False
        elif not on and not self._warned:
            self._warned = True
            log.warning(
                "claims.off agent=%s: no JetStream bucket %r on this server; duplicates are "
                "caught by this process's window only (checked again every %gs)",
                self.agent_id, self.store.bucket, self.recheck_s,
            )  # fmt: skip
        self.enabled = on

    async def claim(self, request_id: str, capability: str) -> Claimed | None:
        """Claim ``request_id``; None when claims are off (run under the local window only).
        Raises ``ClaimsUnavailable`` when the store does not answer (refuse, retryably)."""
        if not self.enabled:
            if self.clock() - self._checked < self.recheck_s:
                return None
            await self._check()
            if not self.enabled:
                return None
        key = claim_key(request_id)
        mine = schema.Claim(
            request_id=request_id, agent_id=self.agent_id, instance=self.instance,
            capability=capability, state="running", at_ms=int(time.time() * 1000),
            ack_subject=self.subjects.ack(self.agent_id, request_id),
        )  # fmt: skip
        data = schema.encoder.encode(mine)
        try:
            created, stored = await self.store.create(key, data)
            for _ in range(4):
                if created:
                    return Claimed(Held(key, stored.revision, mine))
                existing = _decode(stored)
                verdict = decide(existing, agent_id=self.agent_id, instance=self.instance)
                if verdict != "take_over":
                    return Claimed(verdict=verdict, existing=existing)
                revision = await self.store.swap(key, data, stored.revision)
                if revision is not None:
                    log.info("claims.taken_over request_id=%s from=%s/%s state=%s", request_id,
                             existing.agent_id, existing.instance, existing.state)  # fmt: skip
                    return Claimed(Held(key, revision, mine))
                again = await self.store.get(key)  # it moved under us: look again
                if again is None:
                    created, stored = await self.store.create(key, data)
                else:
                    created, stored = False, again
        except NoClaimsBucket:
            self._checked = self.clock()
            self._turn(False)
            return None
        raise ClaimsUnavailable(f"claim {key!r} kept changing while being taken over")

    async def finish(
        self, held: Held, state: schema.ClaimState, reason: str | None = None
    ) -> Callable[[], Awaitable[None]]:
        """End our claim as ``state`` (compare-and-set). On return the change is on the
        connection ahead of whatever is published next (the reply); await the returned
        function afterwards for the outcome: a claim that moved on (a broker released it
        while we ran) is logged, never overwritten."""
        done = msgspec.structs.replace(held.claim, state=state, at_ms=int(time.time() * 1000),
                                       reason=reason)  # fmt: skip
        request_id = held.claim.request_id
        try:
            confirm = await self.store.swap_soon(held.key, schema.encoder.encode(done),
                                                 held.revision)  # fmt: skip
        except ClaimsUnavailable as exc:
            return _failed(request_id, state, exc)

        async def confirmed() -> None:
            try:
                revision = await confirm()
            except ClaimsUnavailable as exc:
                await _failed(request_id, state, exc)()
                return
            if revision is None:
                log.warning("claims.lost request_id=%s agent=%s: the claim was released while "
                            "the task ran (the agent was declared offline)", request_id,
                            self.agent_id)  # fmt: skip
                return
            held.revision = revision

        return confirmed

    async def take(
        self, request_id: str, capability: str
    ) -> tuple[Held | None, tuple[str, Reply] | None]:
        """A task's claim as the run needs it: (our claim, or None when claims are off), or
        the answer for a claim of another, labelled (``in_progress``, ``duplicate``, or
        ``unclaimed``: the store did not answer, and the task is not run unclaimed)."""
        try:
            claimed = await self.claim(request_id, capability)
        except ClaimsUnavailable as exc:
            err = Timeout(f"agent {self.agent_id!r} could not claim request_id {request_id!r} "
                          f"({exc}): not run unclaimed, try again")  # fmt: skip
            return None, ("unclaimed", _error_reply(err, request_id))
        if claimed is None or claimed.held is not None:
            return (claimed.held if claimed else None), None
        label = "in_progress" if claimed.verdict == "in_progress" else "duplicate"
        return None, (label, await self.answer(claimed, request_id))

    async def end(self, held: Held, error: ReachError | None) -> Callable[[], Awaitable[None]]:
        """How a run ends its claim: ``completed``; ``released`` after a retryable error
        (another agent may run it); else ``failed`` (a duplicate gets the stored error;
        reason ``cancelled`` for a cancelled run: no retry or replay runs it again)."""
        if error is None:
            return await self.finish(held, "completed")
        if error.retryable:
            return await self.finish(
                held, "released", f"{self.agent_id} ended it with {error.code}"
            )
        return await self.finish(
            held, "failed", schema.CLAIM_CANCELLED if isinstance(error, Cancelled) else None
        )

    async def answer(self, claimed: Claimed, request_id: str) -> Reply:
        """The reply to a request whose claim is someone else's (or already finished)."""
        existing = claimed.existing
        assert existing is not None
        if claimed.verdict == "in_progress":
            err: ReachError = InProgress(
                f"request_id {request_id!r} is running on agent {existing.agent_id!r} "
                f"(claimed at {existing.at_ms} ms): wait for its result",
                holder=existing.agent_id,
            )
            return _error_reply(err, request_id)
        # The result is the holder's own record: its location follows from the holder (a
        # claim naming another subject is not believed), and its author must be the holder.
        location = result_location(existing, self.subjects)
        rec = None
        try:
            stored = await ackreads.wait_final_at(self.nc, location, STORED_WAIT_S,
                                                  subjects=self.subjects)  # fmt: skip
            rec = attributed(stored)
        except TimeoutError:
            pass
        if rec is None:
            err = Timeout(
                f"request_id {request_id!r} already {existing.state} on agent "
                f"{existing.agent_id!r}, but its result is not in REACH_ACKS "
                f"({location}): not run again"
            )
            return _error_reply(err, request_id)
        if rec.state == "completed":
            body = bytes(rec.result) if rec.result is not None else b"null"
            return {H_REQUEST_ID: request_id, schema.H_STATUS: "completed"}, body
        failure = rec.error or {}
        return _error_reply(
            error_for(failure.get("code", "INTERNAL"), failure.get("message", "")), request_id
        )


def _failed(request_id: str, state: str, exc: Exception) -> Callable[[], Awaitable[None]]:
    async def log_it() -> None:
        log.warning("claims.finish_failed request_id=%s state=%s error=%s", request_id, state,
                    exc)  # fmt: skip

    return log_it


def _decode(stored: Stored) -> schema.Claim:
    try:
        return schema.claim_decoder.decode(stored.data)
    except msgspec.MsgspecError as exc:
        raise ClaimsUnavailable(f"stored claim is not a Claim ({exc})") from None


def _error_reply(err: ReachError, request_id: str) -> Reply:
    headers, body = to_reply(err)
    headers[H_REQUEST_ID] = request_id
    return headers, body
