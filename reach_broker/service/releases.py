"""The claims of agents declared offline are released, so their requests can run elsewhere.

An agent claims each request id in KV ``reach_claims`` before it runs it. If the agent
dies holding a claim, nobody else may run the request until the claim is released, and
only a broker may decide that the holder is gone: when a transition puts an agent
``offline`` (or evicts it), the :class:`Releaser` compare-and-sets each claim that agent
still holds as ``running`` to ``released`` and publishes an ``Event`` of kind ``released``
on ``<prefix>.event.released.<agent_id>`` naming the request id. Callers waiting for that
holder (``IN_PROGRESS``) then try again, and the next agent that gets the request takes the
released claim over: the work runs at least once overall and never on two live agents at
once (a holder declared offline while it still runs — a partition longer than the offline
threshold — is the exception the protocol states).

Which claims an agent holds is learnt by following the bucket (:func:`jetstream.claims.follow`,
a :class:`~jetstream.follow.Follower`) from ``claims.scan_window_s`` before the broker
started: memory holds only the claims running now. Every replica does the same; the
compare-and-set lets exactly one of them release a claim, and only that one publishes the
event. A claim arriving for an agent already ``offline`` is released on arrival: the broker
catching up after its start, or after its follow lost its consumer (a node loss, a
reconnect) and rebuilt it from the claim after the last one it had. The same holds for a
process replaced by a new one of the same agent id (:meth:`Releaser.replaced`: the first
process is gone, the agent id stays healthy): its running claims are released at once, and
one learnt later — the follow behind the announce (a stalled broker, a lost consumer, the
catch-up at start) — on arrival, since the replaced process is remembered
(``RETIRED_MAX``). While the follow is
lost, claims written meanwhile are unknown here, so an agent declared offline then keeps
them until the follow is back and delivers them; none is forgotten
(``reach_follow_down{follow="claims"}`` is 1 meanwhile).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any, NamedTuple

import msgspec

from jetstream import ackreads, claims
from jetstream.claims import ClaimStore, ClaimsUnavailable
from jetstream.follow import UNCOUNTED, Follower, FollowMetrics
from reach_agent.results import ended_by_record
from reach_agent.wire import schema
from reach_agent.wire.schema import Claim, Event
from reach_broker.config import ClaimsSection
from reach_broker.core.records import AgentRecord, Transition

from .context import BrokerContext

log = logging.getLogger(__name__)


class ClaimView(NamedTuple):
    """What the replay needs of a request id's claim."""

    holder: str
    state: str
    """``running``, ``completed``, ``failed`` or ``released``."""
    body_digest: str | None = None
    """The digest of the body it was claimed for (None: written before digests were)."""


RUNNING_MAX = 1_000_000
"""Running claims remembered at most (the oldest are forgotten first beyond it)."""
COMPLETED_MAX = 100_000
"""Completed records remembered at most while their claim has not come (oldest first out;
one forgotten too early leaves its finished claim remembered as running: memory, never a
release, which reads the record first)."""
RETIRED_MAX = 100_000
"""Replaced processes (agent id, instance) remembered, so that a claim of one learnt after
its replacement is released on arrival (the oldest forgotten first)."""
RELEASE_FAILED_SHOWN = 5
"""Request ids a ``claims.release_failed`` line names at most."""
RECHECK_S = 5.0
"""A claim an agent made after this broker declared it offline is released this much later,
if the agent is offline still (it lived when it claimed; its heartbeats may be behind the
claim in this broker's backlog)."""
RELEASE_RETRY_S = 0.5
RELEASE_RETRY_MAX_S = 10.0
"""First and longest pause before a release the bucket did not take is tried again."""


class Releaser:
    """Broker component: knows the running claims per holder and releases those of agents
    declared offline. Started only when the server has JetStream."""

    def __init__(self, ctx: BrokerContext, state_of: Callable[[str], str | None],
                 cfg: ClaimsSection, *, released: Any, store_errors: Any,
                 follow: FollowMetrics = UNCOUNTED,
                 on_released: Callable[[str, str], object] = lambda rid, agent: None,
                 instance_of: Callable[[str], str | None] = lambda agent: None,
                 unseen: Callable[[str, str, str], object] = lambda agent, now, old: None,
                 offline_at_ms: Callable[[str], int | None] = lambda agent: None,
                 recheck_s: float = RECHECK_S,
                 ) -> None:  # fmt: skip
        """``released``, ``store_errors``: ``reach_claims_released_total``,
        ``reach_store_errors_total``; ``follow``: what the claims follow counts into;
        ``on_released``: told (request id, holder) of each claim the bucket says is
        released, by this broker or another (the replay gives back an entry it holds for
        it); ``instance_of``: the process of an agent the registry holds (its announce's
        ``instance_id``); ``unseen``: told (agent id, that process, another) of a running
        claim of another process than that one (the announces' check asks whether it still
        answers); ``offline_at_ms``: when (wall ms) the registry declared an agent offline
        (None: it is not offline)."""
        self.ctx, self.cfg, self._released = ctx, cfg, released
        self.on_released = on_released
        self.instance_of = instance_of
        self.unseen = unseen
        self.offline_at_ms = offline_at_ms
        self.recheck_s = recheck_s
        self._follow = follow
        self._store_errors = store_errors
        self.state_of = state_of
        """The registry's state of an agent (None: unknown)."""
        self.store = ClaimStore(ctx.nc)
        self.released = 0
        self._running: dict[str, dict[str, tuple[int, Claim]]] = {}
        """holder agent id → claim key → (revision, claim)."""
        self._holder_of: dict[str, str] = {}
        """claim key → the holder under which it is remembered."""
        self._completed: dict[str, str] = {}
        """claim key → the author of a completed record heard of before its claim."""
        self._retired: dict[tuple[str, str], None] = {}
        """(agent id, instance) of each process replaced by a new one (oldest first)."""
        self._arrived: dict[str, set[str]] = {}
        """agent id → keys of its claims that arrived while it was offline, not yet in a
        release pass: one pass takes all that came meanwhile (:meth:`_release_arrived`)."""
        self.follower: Follower | None = None
        """The follow of ``reach_claims`` (None: not started)."""
        self._catch_up: ackreads.CatchUp | None = None

    @property
    def running(self) -> int:
        return len(self._holder_of)

    def held_by(self, agent_id: str) -> list[str]:
        """The request ids ``agent_id`` holds running claims for (as far as known)."""
        return [c.request_id for _, c in self._running.get(agent_id, {}).values()]

    async def start(self) -> None:
        if self.follower is not None or not self.cfg.release:
            return
        since = self.ctx.wall() - self.cfg.scan_window_s
        self.follower = await claims.follow(self.ctx.nc, self._on_claim, since=since,
                                            metrics=self._follow)  # fmt: skip
        # The completed records of the same window: each ends a claim that stays ``running``
        # in the bucket, so the claims caught up above are not kept as running (later
        # records come through the ack watch, as they are published).
        self._catch_up = ackreads.CatchUp(self.ctx.nc, self.finished, since=since,
                                          subjects=self.ctx.subjects)  # fmt: skip
        self._catch_up.start()

    async def stop(self) -> None:
        follower, self.follower = self.follower, None  # not running: transitions ignored
        if self._catch_up is not None:
            await self._catch_up.stop()
            self._catch_up = None
        if follower is not None:
            await follower.stop()

    async def claim_of(self, request_id: str) -> ClaimView | None:
        """``request_id``'s claim (holder, state, body digest); None when it is unclaimed.
        Raises ``ClaimsUnavailable`` (counted) when the bucket cannot say now, or holds what
        is not a claim: "unclaimed" is never a guess, since the replay sends, removes or
        expires an entry on it."""
        try:
            stored = await self.store.get(claims.claim_key(request_id))
            if stored is None:
                return None
            try:
                claim = schema.claim_decoder.decode(stored.data)
            except msgspec.MsgspecError as exc:
                raise ClaimsUnavailable(f"claim of {request_id!r} is not a Claim ({exc})") from None
            state = claim.state
            if state in ("running", "released") and (
                ended := await ended_by_record(self.ctx.nc, claim, self.ctx.subjects)
            ):
                # Its holder's final record ended it: also a claim released while its
                # holder, declared offline, still ran and then finished (else a replay
                # gives the entry back at every check, for ever: found by loadtest.nemesis).
                if state == "running":  # learnt here, if the ack watch missed the record:
                    self.finished(request_id, claim.agent_id)  # not read again to release
                state = "completed" if ended.state == "completed" else "failed"
        except ClaimsUnavailable:
            self._store_errors.labels("claims", "lookup").inc()
            raise
        return ClaimView(claim.agent_id, state, claim.body_digest)

    def finished(self, request_id: str, author: str) -> None:
        """``author`` stored its ``completed`` record of ``request_id``: a running claim it
        holds is finished, nothing to release (told by the ack watch, which may hear of the
        record before the claims' consumer delivers the claim: then the claim is not
        remembered when it comes)."""
        key = claims.claim_key(request_id)
        if self._holder_of.get(key) != author:
            if len(self._completed) >= COMPLETED_MAX:
                del self._completed[next(iter(self._completed))]
            self._completed[key] = author
            return
        del self._holder_of[key]
        held = self._running.get(author)
        if held is not None:
            held.pop(key, None)
            if not held:
                del self._running[author]

    # --- what the bucket says -----------------------------------------------------------

    async def _on_claim(self, key: str, revision: int, data: bytes) -> None:
        try:
            claim = schema.claim_decoder.decode(data)
        except msgspec.MsgspecError:
            log.warning("claims.undecodable key=%s revision=%d", key, revision)
            return
        old = self._holder_of.pop(key, None)
        if old is not None:
            held = self._running.get(old)
            if held is not None:
                held.pop(key, None)
                if not held:
                    del self._running[old]
        if claim.state == "released":
            self.on_released(claim.request_id, claim.agent_id)
        if claim.state != "running":
            return
        if self._completed.get(key) == claim.agent_id:
            del self._completed[key]  # its completed record came first: it is finished
            return
        if len(self._holder_of) >= RUNNING_MAX:
            self._forget_oldest()
        self._running.setdefault(claim.agent_id, {})[key] = (revision, claim)
        self._holder_of[key] = claim.agent_id
        # This claim alone: a catch-up delivering an offline agent's n claims must not start
        # n releases of all of them (n² reads of the ack store, retried while it is slow).
        if self.state_of(claim.agent_id) == "offline":
            offline_at = self.offline_at_ms(claim.agent_id)
            if offline_at is not None and claim.at_ms > offline_at:
                # Claimed after this broker declared it offline: it lived then. Released on
                # arrival, a live agent's fresh claims were run a second time elsewhere
                # (nemesis seed 68: b2, out of a stall, released five claims a2 had taken
                # 1-4 ms before, its heartbeats still behind them in b2's backlog).
                self.ctx.spawn(self._release_if_offline(claim.agent_id, key, claim.request_id),
                               "claims-release")  # fmt: skip
            else:
                self._arrive(claim.agent_id, key)
        elif (claim.agent_id, claim.instance) in self._retired:
            why = (f"its process {claim.instance} had been replaced by a new one when the "
                   "broker learnt of the claim")  # fmt: skip
            self.ctx.spawn(self.release(claim.agent_id, why, only=claim.instance,
                                        keys=frozenset((key,))),
                           "claims-release")  # fmt: skip
        elif (now := self.instance_of(claim.agent_id)) is not None and now != claim.instance:
            # Another process's claim than the one the registry knows: a process replaced
            # before this broker learnt of its claims (its read of the bucket behind the
            # new process's announce: a restart, a takeover) unless it still answers.
            self.unseen(claim.agent_id, now, claim.instance)

    def _arrive(self, agent_id: str, key: str) -> None:
        """A claim of ``agent_id``, offline, arrived: released in the agent's next pass."""
        pending = self._arrived.get(agent_id)
        if pending is not None:
            pending.add(key)
            return
        self._arrived[agent_id] = {key}
        self.ctx.spawn(self._release_arrived(agent_id), "claims-release")

    async def _release_arrived(self, agent_id: str) -> None:
        """Release the claims of ``agent_id`` that arrived while it was offline, those that
        came during a pass in the next: a catch-up delivering hundreds of an agent's claims
        while the store did not answer made as many passes, each a read of the ack store,
        each failure a warning (nemesis seed 75: 366 ``claims.release_failed`` lines from
        one broker in 4 s)."""
        try:
            while pending := self._arrived.get(agent_id):
                self._arrived[agent_id] = set()
                await self.release(agent_id, "it was offline when the broker learnt of the "
                                   "claim", keys=frozenset(pending))  # fmt: skip
        finally:
            self._arrived.pop(agent_id, None)

    async def _release_if_offline(self, agent_id: str, key: str, request_id: str) -> None:
        """A claim ``agent_id`` made after it was declared offline here: released
        :attr:`recheck_s` later if the agent is offline still (heard again, it is not)."""
        log.info("claims.offline_claimed request_id=%s agent=%s: claimed after the agent was "
                 "declared offline; released in %gs if it is offline still", request_id,
                 agent_id, self.recheck_s)  # fmt: skip
        await asyncio.sleep(self.recheck_s)
        if self.follower is None or key not in self._running.get(agent_id, {}):
            return  # stopped; or it ended, or moved on
        if self.state_of(agent_id) not in ("offline", None):
            log.info("claims.offline_claim_kept request_id=%s agent=%s: the agent was heard "
                     "again", request_id, agent_id)  # fmt: skip
            return
        await self.release(agent_id, "offline still, after a claim it made once declared so",
                           keys=frozenset((key,)))  # fmt: skip

    def _forget_oldest(self) -> None:
        key = next(iter(self._holder_of))
        holder = self._holder_of.pop(key)
        held = self._running.get(holder, {})
        held.pop(key, None)
        if not held:
            self._running.pop(holder, None)
        log.warning("claims.forgotten key=%s holder=%s: more than %d running claims known",
                    key, holder, RUNNING_MAX)  # fmt: skip

    # --- releasing ----------------------------------------------------------------------

    def on_transition(self, t: Transition, rec: AgentRecord | None) -> None:
        """Consumer: an agent declared offline (or evicted) has its claims released
        (ignored while not running)."""
        if self.follower is None:
            return
        if (t.to == "offline" or t.kind == "evicted") and t.agent_id in self._running:
            self.ctx.spawn(self.release(t.agent_id, t.reason), "claims-release")

    def claiming(self, agent_id: str) -> set[str]:
        """The instances of ``agent_id`` that hold running claims, as the bucket said."""
        return {claim.instance for _, claim in self._running.get(agent_id, {}).values()}

    def replaced(self, agent_id: str, instance: str, old: str) -> None:
        """A new process of ``agent_id`` (``instance``) was accepted over an old one
        (``old``): the old one is gone, as if declared offline, so the claims its instances
        hold are released (not the new one's), and a claim of ``old`` learnt later is
        released on arrival (remembered even before the follow starts: its catch-up
        delivers them)."""
        retired = self._retired
        if len(retired) >= RETIRED_MAX:
            del retired[next(iter(retired))]
        retired[(agent_id, old)] = None
        if self.follower is None:
            return
        if any(c.instance != instance for _, c in self._running.get(agent_id, {}).values()):
            why = f"a new process of it announced (instance {instance})"
            self.ctx.spawn(self.release(agent_id, why, keep=instance), "claims-release")

    async def release(self, agent_id: str, why: str, pause_s: float = RELEASE_RETRY_S, *,
                      keep: str | None = None, only: str | None = None,
                      keys: frozenset[str] | None = None) -> int:  # fmt: skip
        """Release every running claim ``agent_id`` holds (but those of instance ``keep``;
        with ``only``, those of that instance alone; with ``keys``, those claims alone);
        returns how many this replica released (another replica, or the holder finishing,
        may have been first). A release the store did not take ends the pass: the claims
        not tried yet count as failed with it (a store that does not answer one read would
        make each of them wait its timeout in turn), and all of them are tried again (after
        ``pause_s``, doubling) while the agent stays gone: a claim left ``running`` would
        keep its request from ever running."""
        done = 0
        failed: list[str] = []
        error: ClaimsUnavailable | None = None
        held = self._running.get(agent_id, {})
        chosen = held.items() if keys is None else [(k, held[k]) for k in keys if k in held]
        targets = [(k, v) for k, v in chosen
                   if (keep is None or v[1].instance != keep)
                   and (only is None or v[1].instance == only)]  # fmt: skip
        for held_key, (revision, claim) in targets:
            if error is not None:  # the store did not answer: not tried in this pass
                failed.append(claim.request_id)
                continue
            reason = (f"claim of request {claim.request_id} released: holder {agent_id!r} "
                      f"declared offline before finishing ({why})")  # fmt: skip
            released = msgspec.structs.replace(claim, state="released", at_ms=self.ctx.wall_ms(),
                                               reason=reason[:512])  # fmt: skip
            try:
                if await ended_by_record(self.ctx.nc, claim, self.ctx.subjects):
                    self.finished(claim.request_id, agent_id)  # it finished: not released
                    continue
                won = await self.store.swap(held_key, schema.encoder.encode(released),
                                            revision)  # fmt: skip
            except ClaimsUnavailable as exc:
                failed.append(claim.request_id)
                error = error or exc
                self._store_errors.labels("claims", "release").inc()
                continue
            if won is None:
                continue  # it moved on: finished, taken over, or released by another replica
            done += 1
            self.released += 1
            self._released.inc()
            log.info("claims.released request_id=%s agent=%s capability=%s reason=%s",
                     claim.request_id, agent_id, claim.capability, why)  # fmt: skip
            event = Event(kind="released", agent_id=agent_id, reason=reason,
                          at_ms=self.ctx.wall_ms(), broker_id=self.ctx.broker_id,
                          request_id=claim.request_id)  # fmt: skip
            subject = self.ctx.subjects.event("released", agent_id)
            self.ctx.spawn(self.ctx.nc.publish(subject, schema.encoder.encode(event)), "event")
        if failed:
            # One line a pass, not one a claim (nemesis seed 39: 50 in one second for an agent
            # declared offline while JetStream answered 503).
            shown = ",".join(failed[:RELEASE_FAILED_SHOWN]) + (
                ",..." if len(failed) > RELEASE_FAILED_SHOWN else ""
            )
            log.warning("claims.release_failed agent=%s failed=%d of %d request_ids=%s "
                        "error=%s: tried again in %.1fs", agent_id, len(failed), len(targets),
                        shown, error, pause_s)  # fmt: skip
            self.ctx.spawn(self._release_later(agent_id, why, pause_s, keep, only, keys),
                           "claims-release")  # fmt: skip
        return done

    async def _release_later(self, agent_id: str, why: str, pause_s: float,
                             keep: str | None, only: str | None,
                             keys: frozenset[str] | None) -> None:  # fmt: skip
        """Try a release the bucket did not take again: while the agent stays gone, or, for
        an old process replaced (by ``keep``, or ``only`` itself), in any case (the new
        process being healthy does not bring the old one's claims back)."""
        await asyncio.sleep(pause_s)
        if self.follower is None:
            return
        if keep is not None or only is not None or self.state_of(agent_id) in ("offline", None):
            await self.release(agent_id, why, min(pause_s * 2, RELEASE_RETRY_MAX_S), keep=keep,
                               only=only, keys=keys)  # fmt: skip
