"""The agent's fleet-wide claim of a request id: decide, then claim, then answer.

Before a handler runs, the agent creates the request id's claim in KV ``reach_claims``
(:mod:`jetstream.claims`). Exactly one create succeeds across the fleet; an agent whose
create finds a claim decides with :func:`decide` (pure) what the stored claim means:

    released (its holder went offline)           → take it over (compare-and-set), run
    running, held by this agent's id              → take it over (its earlier process died,
                                                    or this process's create landed unseen), run
    running, held by anyone else                  → IN_PROGRESS, naming the holder
    completed / failed                            → answer the stored result (the holder's
                                                    final ack record), never run again

So an agent's first lookup for a request id, also right after a restart, is the claim and
the ack store, not its memory. The holder ends its claim (``completed``/``failed``) ahead of
its reply, or hands it back (``released``) when the task ended in a retryable error, so
another agent may run it; an end the store did not confirm is retried until it is stored
(or the claim moved on), so a finished run never leaves its claim ``running``.

A claimed capability never runs unclaimed. While the bucket cannot be used — no JetStream,
no ``reach_claims`` bucket yet (agents started before the broker that provisions it), its
stream without a leader (an election after a node died), a store that does not answer in
time — every task is refused with ``STORE_UNAVAILABLE`` (retryable: callers ask again within
their deadline), counted, and logged with what to do (at most every ``WARN_EVERY_S``); the
refusal and the log say which it is (a missing bucket wants creating, an election wants
nothing but time). Nothing is cached but that diagnosis, for a second at most and never past
a write taken: the next task asks the store again, so claims work from the first task after
the bucket appears.

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

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Literal

import msgspec
from nats.aio.client import Client as NATS
from nats.errors import Error as NatsError

from jetstream import ackreads
from jetstream.claims import (
    ClaimStore,
    ClaimsUnavailable,
    NoClaimsBucket,
    NoClaimsLeader,
    Stored,
    claim_key,
)
from jetstream.names import H_REQUEST_ID
from reach_agent import trace
from reach_agent.aio import TaskSet
from reach_agent.metrics import AgentMetrics
from reach_agent.results import attributed, ended_by_record, ends_claim, result_location
from reach_agent.wire import schema
from reach_agent.wire.errors import (
    Cancelled,
    IdempotencyMismatch,
    InProgress,
    ReachError,
    StoreUnavailable,
    Timeout,
    error_for,
    to_reply,
)
from reach_agent.wire.subjects import Subjects

from .dedup import Reply

log = trace.logger(__name__)

Verdict = Literal["take_over", "in_progress", "stored", "mismatch"]

STORED_WAIT_S = 2.0
"""How long an agent waits for the final ack record of a claim that says it is finished
(the holder ends its claim just before its ack writer stores the record)."""
RETRY_AFTER_MS = 500
"""The ``retry_after_ms`` of a ``STORE_UNAVAILABLE`` refusal: about a leader election."""
WARN_EVERY_S = 30.0
"""At most one ``claims.unavailable`` warning per this many seconds (with the count since)."""
END_RETRY_MAX_S = 5.0
"""The longest pause between two tries of a claim's end the store did not confirm."""
LANDING_WATCH_S = 30.0
"""How long after a create nobody confirmed the agent looks for it to land: a publish a
JetStream cluster took before a leader election can be stored seconds after its answer was
given up (nemesis seed 20: a claim left ``running`` for a task its agent had refused)."""


def decide(
    claim: schema.Claim, *, agent_id: str, instance: str, digest: str | None = None
) -> Verdict:
    """What a stored claim means to the agent ``agent_id`` (process ``instance``) that just
    failed to create it for a body of ``digest``: a claim made for another body is another
    request (``mismatch``), whatever its state; one without a digest (written before digests
    were) is taken as this body's."""
    if claim.body_digest is not None and digest is not None and claim.body_digest != digest:
        return "mismatch"
    if claim.state == "released":
        return "take_over"
    if claim.state != "running":
        return "stored"
    if claim.agent_id == agent_id:
        # This agent's, running, yet this process runs nothing under the request id (a copy
        # of a task it runs is answered from its duplicate window before it claims): its
        # previous process died holding it, or this process's own create landed while its
        # answer was lost (the task was refused retryably). Take it over.
        return "take_over"
    return "in_progress"


class Held:
    """A claim this process holds: what it must end before replying."""

    __slots__ = ("claim", "key", "revision")

    def __init__(self, key: str, revision: int, claim: schema.Claim) -> None:
        self.key = key
        self.revision = revision
        self.claim = claim


class Claimed:
    """The result of claiming: ``held`` (ours: run it) or the stored claim and its verdict
    (with the holder's ``completed`` record when that is what ended it)."""

    __slots__ = ("existing", "held", "record", "verdict")

    def __init__(
        self,
        held: Held | None = None,
        verdict: Verdict | None = None,
        existing: schema.Claim | None = None,
        record: schema.AckRecord | None = None,
    ) -> None:
        self.held = held
        self.verdict = verdict
        self.existing = existing
        self.record = record


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
        metrics: AgentMetrics | None = None,
        clock: Callable[[], float] = time.monotonic,
        store: ClaimStore | None = None,
        unsent: Callable[[str], bytes | None] = lambda request_id: None,
    ) -> None:
        self.nc = nc
        self.unsent = unsent
        """This process's final record of a request id not stored yet (its durable acks'
        outbox, which holds a dead predecessor's records too), or None."""
        self.store = store if store is not None else ClaimStore(nc, timeout_s=timeout_s)
        self.agent_id = agent_id
        self.instance = instance
        self.subjects = subjects
        self.metrics = metrics
        self.clock = clock
        self.refused = 0
        """Tasks refused (``STORE_UNAVAILABLE``) because their claim could not be taken."""
        self.end_retries = 0
        """Tries of a claim's end after the store did not confirm the first."""
        self._refused_since_warning = 0
        self._warned_at = float("-inf")
        self._said_unavailable = False
        """A ``claims.unavailable`` warning said since the store last answered: the next answer
        says ``claims.available`` (once, however often the store flaps in between)."""
        self.available = False
        """Whether the store answered the last look (the start's, or the last claim's):
        informative only, every task asks the store again."""
        self._settling = TaskSet()
        self._watching = TaskSet()
        """Creates nobody confirmed, looked for until they land (then released) or
        :data:`LANDING_WATCH_S` passed."""

    async def start(self) -> None:
        """Look for the bucket once, to say at start what happens without it (nothing is
        decided here: every task asks the store)."""
        try:
            found = await self.store.exists()
        except ClaimsUnavailable as exc:
            self._warn(exc)
            return
        if found:
            self.available = True
            log.info("claims.on agent=%s bucket=%s", self.agent_id, self.store.bucket)
        else:
            self._warn(NoClaimsBucket(f"no JetStream or no {self.store.bucket} bucket on "
                                      "this server"))  # fmt: skip

    async def stop(self, timeout_s: float = 5.0) -> None:
        """Give the claim ends still being retried ``timeout_s`` to be stored; any left is
        logged (a broker releases it once this agent is declared gone). The looks for creates
        nobody confirmed stop (a broker releases one that lands, as any claim of this agent's,
        once it is declared gone)."""
        if len(self._watching):
            log.info("claims.landing_watch_stopped agent=%s count=%d", self.agent_id,
                     len(self._watching))  # fmt: skip
            self._watching.cancel()
        if len(self._settling):
            await self._settling.wait(timeout_s)
        if len(self._settling):
            log.error("claims.end_unsettled agent=%s count=%d: the store did not take these "
                      "claims' ends before the agent stopped", self.agent_id,
                      len(self._settling))  # fmt: skip
            self._settling.cancel()

    def _warn(self, exc: Exception) -> None:
        """Say (at most every ``WARN_EVERY_S``) that claimed tasks are refused, and what
        to do."""
        self.available = False
        now = self.clock()
        if now - self._warned_at < WARN_EVERY_S:
            return
        self._warned_at = now
        self._said_unavailable = True
        refused, self._refused_since_warning = self._refused_since_warning, 0
        if isinstance(exc, NoClaimsBucket):
            todo = (f"run nats-server with JetStream (-js) and start `reach broker` against "
                    f"it (the broker creates {self.store.bucket!r}), or mark capabilities "
                    "whose duplicates are harmless idempotent")  # fmt: skip
        elif isinstance(exc, NoClaimsLeader):
            todo = (f"the bucket needs no creating: most likely JetStream is electing a leader "
                    f"for {self.store.stream} (a node died or restarted) and callers ask "
                    "again; if this lasts, bring the cluster's nodes back (the stream needs a "
                    "majority of its replicas up)")  # fmt: skip
        else:
            todo = "check the server's JetStream (a cluster may be electing a leader)"
        log.warning(
            "claims.unavailable agent=%s bucket=%s error=%s refused_since_last_warning=%d: "
            "tasks of claimed capabilities are refused with STORE_UNAVAILABLE (retryable), "
            "never run unclaimed; %s", self.agent_id, self.store.bucket, exc, refused, todo,
        )  # fmt: skip

    def refusal(self, exc: ClaimsUnavailable, request_id: str) -> StoreUnavailable:
        """The refusal of a task whose claim could not be taken (counted and logged)."""
        self.refused += 1
        self._refused_since_warning += 1
        if self.metrics is not None:
            self.metrics.store_errors.labels("claims", "claim").inc()
        self._warn(exc)
        if isinstance(exc, NoClaimsBucket):
            why = (f"the claims bucket {self.store.bucket!r} does not exist on this server "
                   "(no JetStream, or no reach broker has provisioned it yet)")  # fmt: skip
        elif isinstance(exc, NoClaimsLeader):
            why = (f"the claims bucket {self.store.bucket!r} is not taking claims right now "
                   f"({exc})")  # fmt: skip
        else:
            why = f"the claims bucket {self.store.bucket!r} did not answer ({exc})"
        return StoreUnavailable(
            f"agent {self.agent_id!r} did not run request_id {request_id!r}: {why}; a claimed "
            "capability never runs unclaimed: ask again", retry_after_ms=RETRY_AFTER_MS,
        )  # fmt: skip

    async def claim(self, request_id: str, capability: str, digest: str | None = None) -> Claimed:
        """Claim ``request_id`` for a body of ``digest``. Raises ``ClaimsUnavailable``
        (``NoClaimsBucket``: there is no bucket; ``NoClaimsLeader``: its stream has no leader
        now) when the store cannot decide: the task is then refused, never run."""
        key = claim_key(request_id)
        mine = schema.Claim(
            request_id=request_id, agent_id=self.agent_id, instance=self.instance,
            capability=capability, state="running", at_ms=int(time.time() * 1000),
            ack_subject=self.subjects.ack(self.agent_id, request_id), body_digest=digest,
        )  # fmt: skip
        data = schema.encoder.encode(mine)
        try:
            created, stored = await self.store.create(key, data)
        except (NoClaimsBucket, NoClaimsLeader):
            raise  # nobody took the create: nothing can land
        except ClaimsUnavailable:  # no answer: the create may have been stored all the same
            landed = await self._landed(key, data, request_id)
            if landed is None:
                raise
            created, stored = True, landed
        if not self.available:
            self.available = True
            if self._said_unavailable:  # (nemesis seed 33: said 30 times in 5 s of flapping)
                self._said_unavailable = False
                log.info("claims.available agent=%s bucket=%s refused_in_all=%d",
                         self.agent_id, self.store.bucket, self.refused)  # fmt: skip
        for _ in range(4):
            if created:
                return Claimed(Held(key, stored.revision, mine))
            existing = _decode(stored)
            verdict = decide(existing, agent_id=self.agent_id, instance=self.instance,
                             digest=digest)  # fmt: skip
            if verdict in ("take_over", "in_progress"):
                # A claim left running (or released by a broker) whose holder (or an
                # earlier holder) stored its completed record (or a non-retryable
                # failure's) is finished: the record is the claim's end.
                ended = await ended_by_record(self.nc, existing, self.subjects)
                if ended is None and existing.agent_id == self.agent_id:
                    # Or one this process's outbox holds, not stored yet: its predecessor
                    # finished the run and died before the record was (nemesis seed 73:
                    # c3-001146 run again by a1's restart, its first result stored 1.2 s
                    # after the second run began).
                    ended = self._unsent_end(request_id)
                if ended is not None:
                    return Claimed(verdict="stored", existing=existing, record=ended)
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
        raise ClaimsUnavailable(f"claim {key!r} kept changing while being taken over")

    def _unsent_end(self, request_id: str) -> schema.AckRecord | None:
        """The final record of ``request_id`` in this process's outbox, when it ends the
        claim (:func:`~reach_agent.results.ends_claim`)."""
        data = self.unsent(request_id)
        if data is None:
            return None
        try:
            rec = schema.decode_ack_record(data)
        except msgspec.MsgspecError:
            return None
        if rec.request_id != request_id or rec.agent_id != self.agent_id or not ends_claim(rec):
            return None
        log.info("claims.ended_unsent request_id=%s agent=%s state=%s: the record of an "
                 "earlier run, not stored yet, ends the claim", request_id, self.agent_id,
                 rec.state)  # fmt: skip
        return rec

    async def _landed(self, key: str, data: bytes, request_id: str) -> Stored | None:
        """After a create nobody confirmed: our claim, if the store has it (then it is ours
        to run); None when it does not, or cannot say now — then, the task being refused, a
        claim of ours stored after all (now, or later: the create may still be on its way)
        would be left ``running`` for nobody, so it is looked for in the background for
        :data:`LANDING_WATCH_S` and released if it lands (:meth:`_release_orphan`)."""
        try:
            stored = await self.store.get(key)
        except ClaimsUnavailable:
            stored = None
        if stored is not None and stored.data == data:
            return stored
        if stored is None:
            # Said: a claim that lands later keeps its request from running anywhere until
            # it is released, and the logs must tell whether it was watched (nemesis seed
            # 63: c2-001410 held until its agent went offline; its refusal said nowhere).
            log.info("claims.unconfirmed request_id=%s agent=%s: the store did not confirm "
                     "the claim, the task is refused; released if it lands within %gs",
                     request_id, self.agent_id, LANDING_WATCH_S)  # fmt: skip
            self._watching.spawn(self._release_orphan(key, data, request_id), "reach-orphan")
        return None  # another claim (not ours to release), or ours not there (yet)

    async def _release_orphan(self, key: str, data: bytes, request_id: str) -> None:
        """Release our create of ``key`` (exactly ``data``) if it is stored, now or within
        :data:`LANDING_WATCH_S`, although its task was refused; anything else under the key
        is left alone."""
        pause = 0.1
        until = self.clock() + LANDING_WATCH_S
        while True:
            await asyncio.sleep(pause)
            pause = min(pause * 2, END_RETRY_MAX_S)
            try:
                stored = await self.store.get(key)
                if stored is None and self.clock() < until:
                    continue  # not (yet) stored: the create may still land
                if stored is None or stored.data != data:
                    return  # it was never stored, or moved on (taken over, ended)
                claim = _decode(stored)
                released = msgspec.structs.replace(
                    claim, state="released", at_ms=int(time.time() * 1000),
                    reason=f"{self.agent_id} refused the task: its claim was not confirmed",
                )  # fmt: skip
                won = await self.store.swap(key, schema.encoder.encode(released), stored.revision)
            except ClaimsUnavailable:
                continue
            if won is not None:
                if self.metrics is not None:
                    self.metrics.store_errors.labels("claims", "orphan").inc()
                log.warning("claims.orphan_released request_id=%s agent=%s: a claim stored "
                            "although the store never confirmed it, for a task this agent "
                            "refused", request_id, self.agent_id)  # fmt: skip
            return

    async def finish(
        self, held: Held, state: schema.ClaimState, reason: str | None = None
    ) -> Callable[[], Awaitable[None]]:
        """End our claim as ``state`` (compare-and-set). On return the change is on the
        connection ahead of whatever is published next (the reply); await the returned
        function afterwards for the outcome: a claim that moved on (a broker released it
        while we ran) is logged, never overwritten; an end the store did not confirm is
        retried in the background until it is stored or the claim moved on."""
        done = msgspec.structs.replace(held.claim, state=state, at_ms=int(time.time() * 1000),
                                       reason=reason)  # fmt: skip
        data = schema.encoder.encode(done)
        try:
            confirm = await self.store.swap_soon(held.key, data, held.revision)
        except ClaimsUnavailable as exc:
            return self._retry_end(held, data, state, exc)

        async def confirmed() -> None:
            try:
                revision = await confirm()
            except ClaimsUnavailable as exc:
                await self._retry_end(held, data, state, exc)()
                return
            if revision is None:
                _lost(held, self.agent_id)
                return
            held.revision = revision

        return confirmed

    def _retry_end(
        self, held: Held, data: bytes, state: str, exc: Exception
    ) -> Callable[[], Awaitable[None]]:
        async def retry() -> None:
            log.warning("claims.end_retrying request_id=%s state=%s error=%s",
                        held.claim.request_id, state, exc)  # fmt: skip
            self._settling.spawn(self._settle(held, data, state), "reach-claim-end")

        return retry

    async def _settle(self, held: Held, data: bytes, state: str) -> None:
        """Store our claim's end (``data``, ``state``) until the store takes it: read the
        claim, and compare-and-set it while it is still ours and running (a try whose answer
        was lost may have landed: then it is ours and ``state`` already)."""
        pause = 0.1
        while True:
            await asyncio.sleep(pause)
            pause = min(pause * 2, END_RETRY_MAX_S)
            self.end_retries += 1
            if self.metrics is not None:
                self.metrics.store_errors.labels("claims", "end").inc()
            try:
                stored = await self.store.get(held.key)
                current = _decode(stored) if stored is not None else None
                if current is None or current.instance != self.instance:
                    _lost(held, self.agent_id)
                    return
                if current.state == state:
                    log.info("claims.end_stored request_id=%s state=%s", held.claim.request_id,
                             state)  # fmt: skip
                    return
                if current.state != "running":
                    _lost(held, self.agent_id)
                    return
                assert stored is not None
                revision = await self.store.swap(held.key, data, stored.revision)
            except ClaimsUnavailable as exc:
                log.info("claims.end_retry request_id=%s error=%s", held.claim.request_id, exc)
                continue
            if revision is not None:
                held.revision = revision
                log.info("claims.end_stored request_id=%s state=%s", held.claim.request_id,
                         state)  # fmt: skip
                return

    async def take(
        self, request_id: str, capability: str, digest: str | None = None
    ) -> tuple[Held | None, tuple[str, Reply] | None]:
        """A task's claim as the run needs it: our claim, or the answer for a claim of
        another, labelled as :meth:`answer` labels it, or ``unclaimed``: the store could not
        decide, and the task is refused ``STORE_UNAVAILABLE``, never run unclaimed."""
        try:
            claimed = await self.claim(request_id, capability, digest)
        except ClaimsUnavailable as exc:
            return None, ("unclaimed", _error_reply(self.refusal(exc, request_id), request_id))
        if claimed.held is not None:
            return claimed.held, None
        return None, await self.answer(claimed, request_id, digest)

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

    async def answer(
        self, claimed: Claimed, request_id: str, digest: str | None = None
    ) -> tuple[str, Reply]:
        """The reply to a request whose claim is someone else's (or already finished, or for
        another body), labelled: ``in_progress`` (``IN_PROGRESS``: it runs elsewhere),
        ``mismatch`` (``IDEMPOTENCY_MISMATCH``: the request id was claimed for another body),
        ``duplicate`` (the stored result: the request's answer for good) or ``unstored``
        (finished, but its result could not be read in time: ``TIMEOUT``, or at all now:
        ``STORE_UNAVAILABLE``; retryable, and not the request's answer — the next copy reads
        the store again)."""
        existing = claimed.existing
        assert existing is not None
        if claimed.verdict == "mismatch":
            assert existing.body_digest is not None and digest is not None
            refusal = self._mismatch(request_id, existing.body_digest, digest, existing.agent_id)
            return "mismatch", _error_reply(refusal, request_id)
        if claimed.verdict == "in_progress":
            err: ReachError = InProgress(
                f"request_id {request_id!r} is running on agent {existing.agent_id!r} "
                f"(claimed at {existing.at_ms} ms): wait for its result",
                holder=existing.agent_id,
            )
            return "in_progress", _error_reply(err, request_id)
        # The result is the holder's own record: its location follows from the holder (a
        # claim naming another subject is not believed), and its author must be the holder.
        location = result_location(existing, self.subjects)
        rec = claimed.record
        if rec is None:
            try:
                stored = await ackreads.wait_final_at(self.nc, location, STORED_WAIT_S,
                                                      subjects=self.subjects)  # fmt: skip
                rec = attributed(stored)
            except TimeoutError:
                pass
            except NatsError as exc:  # JetStream's 503 while it elects, no responders
                err = StoreUnavailable(
                    f"request_id {request_id!r} already {existing.state} on agent "
                    f"{existing.agent_id!r}, but REACH_ACKS could not be read ({location}: "
                    f"{type(exc).__name__}: {exc}): not run again; ask again",
                    retry_after_ms=RETRY_AFTER_MS,
                )
                return "unstored", _error_reply(err, request_id)
        if rec is None:
            err = Timeout(
                f"request_id {request_id!r} already {existing.state} on agent "
                f"{existing.agent_id!r}, but its result is not in REACH_ACKS "
                f"({location}): not run again"
            )
            return "unstored", _error_reply(err, request_id)
        if rec.body_digest is not None and digest is not None and rec.body_digest != digest:
            # a claim written without a digest, its record with one: another body after all
            err = self._mismatch(request_id, rec.body_digest, digest, existing.agent_id)
            return "mismatch", _error_reply(err, request_id)
        # Named, so the caller's wait believes the record's author (the holder, or an agent
        # that held the claim before and finished), not us (we write none).
        if rec.state == "completed":
            body = bytes(rec.result) if rec.result is not None else b"null"
            return "duplicate", ({H_REQUEST_ID: request_id, schema.H_STATUS: "completed",
                                  schema.H_HOLDER: rec.agent_id}, body)  # fmt: skip
        failure = rec.error or {}
        headers, body = _error_reply(
            error_for(failure.get("code", "INTERNAL"), failure.get("message", "")), request_id
        )
        headers[schema.H_HOLDER] = rec.agent_id
        return "duplicate", (headers, body)

    def _mismatch(self, request_id: str, first: str, this: str, holder: str) -> ReachError:
        log.warning("claims.mismatch request_id=%s holder=%s: reused with another body",
                    request_id, holder)  # fmt: skip
        return IdempotencyMismatch.reused(
            request_id, first, this, seen=f"its claim, held by agent {holder!r}"
        )


def _lost(held: Held, agent_id: str) -> None:
    log.warning("claims.lost request_id=%s agent=%s: the claim was released before the "
                "agent's end of it was stored (declared offline while the task ran, or before "
                "its end reached the store)", held.claim.request_id, agent_id)  # fmt: skip


def _decode(stored: Stored) -> schema.Claim:
    try:
        return schema.claim_decoder.decode(stored.data)
    except msgspec.MsgspecError as exc:
        raise ClaimsUnavailable(f"stored claim is not a Claim ({exc})") from None


def _error_reply(err: ReachError, request_id: str) -> Reply:
    headers, body = to_reply(err)
    headers[H_REQUEST_ID] = request_id
    return headers, body
