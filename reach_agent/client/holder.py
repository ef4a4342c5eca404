"""The caller's side of ``IN_PROGRESS``: ask the agent holding the claim, then wait for it;
never run the task elsewhere.

An agent answers ``IN_PROGRESS`` (naming the holder) when another agent holds the request
id's claim. Running the task on another agent would run it twice, so the call first sends
it, once, to the holder itself (:meth:`Holders.target`): a holder that runs the request
answers the copy from its duplicate window with that run's result, and a new process of
the holder — its predecessor died holding the claim and, being replaced at once, was never
declared offline — takes the claim over and runs it (the claim names the holder's agent id,
which the new process shares). Without that ask such a claim stays ``running`` for nobody:
no broker releases the claim of an agent that stays healthy. When the holder answered
``IN_PROGRESS`` itself or cannot be reached, the call waits (:func:`held`), fed by a
:class:`HolderWatch`:

* the holder's final ack record, on the holder's own ack subject of the request (subscribed
  first, then read from ``REACH_ACKS``, so none is missed), attributed to the holder
  (:func:`reach_agent.results.attributed`) — or another agent's record of the request that
  ends the claim (:func:`reach_agent.results.ends_claim`: an earlier holder, its claim
  released and taken over, that finished after all);
* the claim itself, read every ``poll_s``: ``released`` (the broker declared the holder
  offline before it finished) or gone means "try again" — as does the broker's
  ``released`` event for the request id, which :class:`reach_agent.Client` hands to
  :meth:`HolderWatch.released` at once.

A late result of one of the call's own attempts (the holder was tried earlier) also ends
the wait: it goes through the call's queue like every reply.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Any, Literal

import msgspec
from nats.aio.client import Client as NATS

from jetstream import ackreads, acks
from jetstream.claims import ClaimStore, ClaimsUnavailable, claim_key
from jetstream.tasks import raise_if_cancelled
from reach_agent import trace
from reach_agent.results import answer_of, attributed, ended_by_record, ends_claim, result_location
from reach_agent.wire import schema
from reach_agent.wire.errors import InternalError, Timeout, from_reply
from reach_agent.wire.subjects import BROKER_ACK_AUTHOR, Subjects

from .calls import CANCELLED, CLOSED, LOST, Call, Stored, StreamStart, is_no_responders

log = trace.logger(__name__)

HeldEnd = Literal["ok", "error", "released", "timeout", "closed"]
"""How waiting for a claim's holder ends: its result or error, the claim released (try
again), the deadline, or the client closing."""

_RELEASED = object()

FREE_READ_S = 0.5
"""How long :meth:`Holders.until_free` gives one read of a claim."""
FREE_REREAD_S = 0.1
"""How soon :meth:`Holders.until_free` reads a claim again after a read that failed."""


_UNKNOWN = schema.Claim(request_id="", agent_id="", instance="", capability="", state="running",
                        at_ms=0)  # fmt: skip
"""What :func:`claim_at` says of a claim it cannot read now (running: keep waiting)."""


async def claim_at(
    store: ClaimStore, key: str, timeout_s: float | None = None
) -> schema.Claim | None:
    """The claim at ``key`` (None: none, or not a claim); :data:`_UNKNOWN` when the store
    does not say within ``timeout_s`` (default: the store's)."""
    try:
        stored = await store.get(key, timeout_s)
    except ClaimsUnavailable as exc:
        log.debug("holder.claim_unreadable key=%s error=%s", key, exc)
        return _UNKNOWN
    if stored is None:
        return None
    try:
        return schema.claim_decoder.decode(stored.data)
    except msgspec.MsgspecError:
        return None


class HolderWatch:
    """Feeds one waiting call with what its holder does."""

    def __init__(
        self, nc: NATS, store: ClaimStore, call: Call, *, poll_s: float, subjects: Subjects
    ) -> None:
        self.nc = nc
        self.store = store
        self.call = call
        self.subjects = subjects
        self.poll_s = poll_s
        self._key = claim_key(call.request_id)
        self._sub: Any = None
        self._poller: asyncio.Task[None] | None = None
        self._done = False
        self._holder: str | None = None
        """The agent the claim names (its records are the answer, whatever they say)."""

    async def start(self) -> None:
        """Look at the claim; subscribe to the request's records (every author's: an earlier
        holder's record that ends the claim answers too); read them; start polling."""
        claim = await self._read()
        if claim is None or claim.state == "released":
            self.released()
            return
        if claim.agent_id:
            self._holder = claim.agent_id
            subject = result_location(claim, self.subjects)

            async def on_record(msg: Any) -> None:
                stored = ackreads.attribute(msg.subject, msg.headers, msg.data, None,
                                            self.subjects)  # fmt: skip
                if isinstance(stored, ackreads.StoredAck):
                    self._final(stored)

            self._sub = await self.nc.subscribe(self.subjects.acks_of(self.call.request_id),
                                                cb=on_record)  # fmt: skip
            with contextlib.suppress(Exception):  # the subscription still catches it
                found = await ackreads.final_at(self.nc, subject, subjects=self.subjects)
                if found is not None:
                    self._final(found)
                elif (ended := await ended_by_record(self.nc, claim, self.subjects)) is not None:
                    self._ended(ended)
        self._poller = asyncio.create_task(self._poll(), name="reach-holder-poll")

    async def stop(self) -> None:
        self._done = True
        if self._poller is not None:
            self._poller.cancel()
            await asyncio.wait({self._poller}, timeout=2.0)
        if self._sub is not None:
            with contextlib.suppress(Exception):
                await self._sub.unsubscribe()

    def released(self) -> None:
        """The claim was released (event or poll): the call tries again."""
        if not self._done:
            self._done = True
            self.call.queue.put_nowait((self.call.attempt, _RELEASED))

    def _final(self, stored: ackreads.StoredAck) -> None:
        """A final record of the request: the holder's is the answer; another agent's only
        when it ends the claim (an earlier holder that finished after all: nemesis seed 82,
        c3-000638 waited for a4, which had taken over a2's released claim, while a2's
        completed record was stored 1.07 s before its deadline, and ended TIMEOUT)."""
        if stored.state not in acks.FINAL_STATES or self._done:
            return
        record = attributed(stored)
        if record is None:
            return
        if stored.author != self._holder and (
            stored.author == BROKER_ACK_AUTHOR or not ends_claim(record)
        ):
            return
        self._ended(record)

    def _ended(self, record: schema.AckRecord) -> None:
        if not self._done:
            self._done = True
            self.call.stored(record)

    async def _read(self) -> schema.Claim | None:
        return await claim_at(self.store, self._key)

    async def _poll(self) -> None:
        while not self._done:
            raise_if_cancelled()
            await asyncio.sleep(self.poll_s)
            claim = await self._read()
            if claim is None or claim.state == "released":
                self.released()
            elif claim.state != "running" and claim.agent_id:
                with contextlib.suppress(Exception):
                    subject = result_location(claim, self.subjects)
                    found = await ackreads.final_at(self.nc, subject, subjects=self.subjects)
                    if found is not None:
                        self._final(found)


class _FreeWatch:
    """What :meth:`Holders.until_free` is told meanwhile."""

    __slots__ = ("released", "wake")

    def __init__(self) -> None:
        self.released = False
        """The broker's ``released`` event for the request came."""
        self.wake = asyncio.Event()


class Holders:
    """One client's calls waiting for the holder of their request id's claim."""

    def __init__(self, nc: NATS, *, poll_s: float, subjects: Subjects,
                 store: ClaimStore | None = None) -> None:  # fmt: skip
        self.nc = nc
        self.poll_s = poll_s
        self.subjects = subjects
        self.store = store or ClaimStore(nc)
        self._waiting: dict[str, HolderWatch] = {}
        self._free: dict[str, _FreeWatch] = {}
        """Calls waiting for a record, watching whether anybody runs their request
        (:meth:`until_free`)."""

    def target(self, holder: str, capability: str) -> schema.Candidate:
        """The holder of a claim as a call's next target: its own task subject (a claim is
        only ever held by a reach agent; Synadia agents do not claim)."""
        return schema.Candidate(agent_id=holder, subject=self.subjects.task(holder, capability),
                                score=0.0, state="healthy", load=0.0)  # fmt: skip

    def released(self, request_id: str) -> None:
        """A broker's ``released`` event for ``request_id``."""
        watch = self._waiting.get(request_id)
        if watch is not None:
            watch.released()
        free = self._free.get(request_id)
        if free is not None:
            free.released = True
            free.wake.set()

    async def wait(
        self, call: Call, holder: str, clock: Callable[[], float]
    ) -> tuple[HeldEnd, Any]:
        """Wait for the holder's answer to ``call`` (see :func:`held`)."""
        watch = HolderWatch(self.nc, self.store, call, poll_s=self.poll_s,
                            subjects=self.subjects)  # fmt: skip
        self._waiting[call.request_id] = watch
        log.info("call.in_progress request_id=%s holder=%s: waiting for its result",
                 call.request_id, holder)  # fmt: skip
        try:
            await watch.start()
            return await held(call, holder, clock)
        finally:
            if self._waiting.get(call.request_id) is watch:
                del self._waiting[call.request_id]
            await watch.stop()

    async def until_free(self, request_id: str, within_s: float) -> str | None:
        """Why nobody runs ``request_id`` once that is so, within ``within_s``: its claim is
        ``released`` (the broker's event, or the claim read so), or there is none
        (``unclaimed``: an agent running a claimed request holds its claim, and one taking
        it later finds the claim of whoever ran it again first); None once ``within_s``
        passed. The claim is read now and every ``poll_s``; running or finished, waited on;
        unreadable, read again :data:`FREE_REREAD_S` (doubling up to ``poll_s`` while it
        stays so) after a read given at most :data:`FREE_READ_S` (nemesis seed 79: c3-000709's one read, made as the claims
        stream elected a leader, took its whole 2 s, and the next came too late to leave
        room for an attempt: TIMEOUT)."""
        free = self._free[request_id] = _FreeWatch()
        loop = asyncio.get_running_loop()
        end = loop.time() + within_s
        key = claim_key(request_id)
        reread = FREE_REREAD_S
        try:
            while not free.released:
                free.wake.clear()
                claim = await claim_at(self.store, key, FREE_READ_S)
                if claim is None or claim.state == "released":
                    return "unclaimed" if claim is None else "released"
                left = end - loop.time()
                if left <= 0:
                    return None
                pause = self.poll_s
                if claim is _UNKNOWN:
                    pause, reread = min(reread, self.poll_s), reread * 2
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(min(pause, left)):  # a cancel is never lost
                        await free.wake.wait()
            return "released"
        finally:
            if self._free.get(request_id) is free:
                del self._free[request_id]


async def held(call: Call, holder: str, clock: Callable[[], float]) -> tuple[HeldEnd, Any]:
    """Wait for the result of the agent ``holder`` that holds ``call``'s claim: a reply to
    any attempt (a late one of ours), its final ack record, the claim's release, or the
    deadline."""
    while True:
        got = await call.next_reply(call.deadline, clock)
        if got is None:
            # Said as known: the claim still said running, and no result came; the run may
            # have ended with its record held up (nemesis: a stalled link).
            return "timeout", Timeout(
                f"request_id {call.request_id!r}: agent {holder!r} holds its claim, and no "
                "result of it had come by the call's deadline (still running, or its result "
                "held up)"
            )
        a, msg = got
        if msg is CLOSED:
            return "closed", InternalError("client closed while the call was in flight")
        if msg is CANCELLED:
            return "closed", call.cancelled
        if msg is _RELEASED:
            return "released", None
        if msg is LOST:
            continue  # the holder's liveness: its claim's release is what counts
        if isinstance(msg, Stored):
            call.taker = msg.record.agent_id or holder  # (an earlier holder's that ends it)
            return answer_of(msg.record)
        hdrs = msg.headers
        if is_no_responders(msg) or from_reply(hdrs, msg.data):
            continue  # errors (another IN_PROGRESS, no responders) change nothing
        status = hdrs.get(schema.H_STATUS) if hdrs else None
        if status == "received" or (
            status is None and schema.is_body_receipt(msg.data, call.request_id)
        ):
            continue
        if status == "chunk" or (status == "completed" and schema.H_CHUNKS in hdrs):
            if call.stream:
                return "ok", StreamStart(a, msg)
            continue
        call.taker = call.agents.get(a, holder)
        outcome, value = call.result(msg, holder)
        return ("ok" if outcome == "ok" else "error"), value
