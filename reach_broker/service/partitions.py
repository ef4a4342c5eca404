"""Which partitions of the fleet this broker owns: a lease each, in KV ``reach_partitions``.

A partition's owner is whoever holds its key (``<partition>``, value: the owner's broker id).
A free key is taken with a create (``Nats-Expected-Last-Subject-Sequence: 0``: one broker
wins); the owner renews it by compare-and-set on the revision it holds every third of the
lease's time to live (``[fleet] lease_ttl_s``, the bucket's ``max_age``), so a broker that
dies stops renewing and its keys age out: another broker takes them at its next round. A
broker that stops hands its leases back (a value naming no owner, which any broker may take
at once); a lease it could not hand back in time (a busy JetStream) is taken at once all the
same by a broker that saw it leave (its presence key deleted: only a stop deletes one). The
revision a lease was taken at is its **epoch**: everything the owner publishes
for the partition carries it, so a reader can tell one owner's versions from the next's.

Without JetStream there is nothing to lease: the broker owns every partition (a deployment
without JetStream runs one broker).

**Fair shares.** Every broker announces its presence in the same bucket (key
``_b.<broker_id>``, renewed every round, aging out with the leases' time to live, deleted at a
clean stop) and holds at most its fair share, ``ceil(partitions / live brokers)``: it takes
free partitions only up to it, and hands back what it holds beyond it (a broker joined). A
broker that left or died stops counting once its presence key is gone (at once, or within the
time to live), and its partitions are taken by the others as they fall free.

**Rebalancing at once.** Every broker follows the presence keys (a
:class:`~jetstream.follow.Follower` named ``presence``) and runs a round at once, instead of
at its next one, when another broker's key appears (it joined), is deleted (it stopped, its
leases handed back first) or is written with the partitions it just handed back
(``{"freed": [...]}``, right after a hand-back). So a broker joining gets its share within a
few round trips, not two rounds (up to ``2/3 lease_ttl_s``, the handed-back partitions
without an owner for up to a third of it: neither heard nor routed to, the route requests of
their capabilities refused); each such round is logged (``partitions.rebalance``). A round
woken while the last one's hand-backs and takes are still under way runs again once they
end: what woke it (partitions just freed) may have come after they looked.

The owner is told (``on_own(partition, epoch, warm)``: the partition's agents restored, its
subjects heard, its route-table shares published: :mod:`.takeover`; ``on_lose(partition)``:
dropped). A takeover runs on a task of its own, so the rounds renew every lease on time while
partitions are restored (a restore of thousands of agents takes longer than a short lease);
the first round's takeovers are awaited at start. A partition whose taking fails is released.

**Warm or cold.** A partition taken is *warm* when a live broker held it until moments ago,
so its agents were heard until then and keep the states stored for them: a take while
another broker's presence key is counted, a take by a broker that still holds partitions of
its own (it was hearing all along: a lease lapsed or handed back under a running fleet), and
any partition handed back (its lease names no owner: written within the lease's time to
live, since the bucket ages every value out). It is *cold* when this broker counts no other
broker and holds no partition when it takes (it is alone: a single broker's start, the first
of a fleet's after an outage, or a lone broker whose every lease lapsed while its link was
down; a count that failed counts none): nobody heard the agents meanwhile, perhaps for hours,
so they are restored ``suspect`` and routed only once heard.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import re
import secrets
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
from nats.aio.msg import Msg

from jetstream import lastvalues
from jetstream.claims import ClaimStore, ClaimsUnavailable
from jetstream.follow import UNCOUNTED, Follower, FollowMetrics, Start
from jetstream.names import PARTITIONS_BUCKET, PARTITIONS_STREAM
from jetstream.tasks import raise_if_cancelled
from reach_agent.aio import stop_loops, wait_event
from reach_broker.config import FleetSection

from .context import BrokerContext

log = logging.getLogger(__name__)


class Lease(msgspec.Struct, kw_only=True, omit_defaults=True):
    """A lease's value: who owns the partition (None: handed back, free to take)."""

    broker_id: str | None = None
    at_ms: int = 0


class Presence(msgspec.Struct, kw_only=True, omit_defaults=True):
    """A presence key's value when it says more than "here" (an empty value): the partitions
    its broker just handed back (the others take them at once)."""

    freed: list[int] = []


HAND_BACK_S = 1.0
"""How long a stopping broker spends handing its leases back (they lapse anyway)."""
LEAVE_S = 0.25
"""Of :data:`HAND_BACK_S`, the part kept for the presence key's delete: said even when the
hand-backs ran out of time, or the others would round only a third of a lease later."""
RETAKE_S = 1.0
"""How soon a round comes again when the leases' store did not answer a take (a busy
JetStream), rather than a third of the lease's time to live later."""
PRESENCE = "_b."
"""The presence keys' prefix (``_b.<broker_id>``): never a partition's key."""
_KV_PRE = f"$KV.{PARTITIONS_BUCKET}."
_KV_OP = "KV-Operation"
_DELETED = ("DEL", "PURGE")

_lease = msgspec.json.Decoder(Lease)
_encode = msgspec.json.Encoder().encode


def presence_key(broker_id: str) -> str:
    """The presence key of ``broker_id`` (characters a key may not hold become ``_``)."""
    return PRESENCE + re.sub(r"[^-_=a-zA-Z0-9]", "_", broker_id)


def fair_share(partitions: int, live: int) -> int:
    """The most partitions one of ``live`` brokers holds."""
    return math.ceil(partitions / max(live, 1))


class Partitions:
    """This broker's leases: taken up to its fair share, renewed, handed back; the owner told
    of each change."""

    def __init__(
        self,
        ctx: BrokerContext,
        cfg: FleetSection,
        on_own: Callable[[int, int, bool], Awaitable[None]],
        on_lose: Callable[[int], Awaitable[None]],
        *,
        jetstream: Callable[[], bool],
        owned: Any,
        follow: FollowMetrics = UNCOUNTED,
        store: ClaimStore | None = None,
    ) -> None:
        self.ctx = ctx
        self.cfg = cfg
        self.on_own = on_own
        self.on_lose = on_lose
        self.jetstream = jetstream
        """Whether the server has JetStream (known once the broker has provisioned)."""
        self.owned = owned
        """``reach_partitions_owned``: the partitions this broker holds."""
        if store is None:
            store = ClaimStore(ctx.nc, bucket=PARTITIONS_BUCKET,
                               timeout_s=min(2.0, cfg.lease_ttl_s / 3))  # fmt: skip
        self.store = store
        """The leases' bucket (by default over the broker's connection, answering within a
        third of the lease's time to live, 2 s at most; a test hands in one holding answers)."""
        self.held: dict[int, tuple[int, int, float]] = {}
        """Each partition owned: (its epoch, the revision last written, when)."""
        self.live = 1
        """Brokers present at the last round (this one among them)."""
        self.cold = 0
        """Partitions taken cold (alone, holding none: their agents ``suspect``)."""
        self._pending: set[asyncio.Task[None]] = set()
        """Takeovers under way."""
        self._counted_at = -math.inf
        """When :attr:`live` was last counted."""
        self._kv: Any = None
        self._task: asyncio.Task[None] | None = None
        self._balancing: asyncio.Task[None] | None = None
        """The hand-backs and takes of the last round, under way."""
        self._follow = follow
        """``reach_follow_*{follow="presence"}``: the presence keys' follow."""
        self._presence: Follower | None = None
        self._seen: dict[str, float] = {}
        """The other brokers' presence keys followed, and when each was last written."""
        self._left: dict[str, float] = {}
        """The presence keys of brokers that stopped (deleted: only a stop deletes one), and
        when; forgotten after the lease's time to live (their leases have lapsed by then) or
        when written again."""
        self._wake = asyncio.Event()
        """Set when another broker joined, left or handed partitions back: a round now."""
        self._soon: asyncio.TimerHandle | None = None
        """The round :meth:`_again_soon` asked for, pending (one at most)."""

    @property
    def share(self) -> int:
        """This broker's fair share of the partitions now."""
        return fair_share(self.cfg.partitions, self.live)

    async def start(self) -> None:
        """Take up to a fair share of what is free (every partition, without JetStream), then
        keep the leases."""
        if self._task is not None:
            return
        if not self.jetstream():
            epoch = secrets.randbits(31)
            for p in range(self.cfg.partitions):
                self._own(p, epoch, 0, warm=False)  # alone, by definition
            await self.settled()
            return
        self._kv = await self.ctx.nc.jetstream(timeout=self.store.timeout_s).key_value(
            PARTITIONS_BUCKET
        )
        await self._follow_presence()
        await self.round()
        await self.settled()
        log.info("partitions.owned count=%d of %d brokers=%d cold=%d", len(self.held),
                 self.cfg.partitions, self.live, self.cold)  # fmt: skip
        self._task = asyncio.create_task(self._loop(), name="reach-partitions")

    async def stop(self) -> None:
        """Stop renewing, leave (the presence key deleted) and hand every lease back (so
        another broker takes them at once), within a second in all: a lease not handed back
        lapses by itself."""
        if self._presence is not None:
            await self._presence.stop()
            self._presence = None
        if self._task is not None:
            await stop_loops(self._task)
            self._task = None
            if self._balancing is not None:
                await stop_loops(self._balancing)
                self._balancing = None
            await self.settled()
            free = _encode(Lease(at_ms=self.ctx.wall_ms()))
            backs = [self.store.swap(str(p), free, rev) for p, (_, rev, _at) in self.held.items()]
            if self.ctx.link.connected:
                # The leases first: the others take them as they see the presence key go.
                # The key goes also when the hand-backs ran out of time (a busy JetStream):
                # the others take what was handed back at once, the rest once it lapses.
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(HAND_BACK_S - LEAVE_S):
                        await asyncio.gather(*backs, return_exceptions=True)
                with contextlib.suppress(Exception):
                    async with asyncio.timeout(LEAVE_S):
                        await self._kv.delete(presence_key(self.ctx.broker_id))
            for back in backs:
                back.close()  # those never awaited (the link was down)
        for p in list(self.held):
            await self._lose(p)
        if self._soon is not None:  # (last: a balance stopped above may have asked for one)
            self._soon.cancel()
            self._soon = None

    async def round(self) -> None:
        """Say this broker is present and count the brokers while every lease held is
        renewed (all at once: one round trip for the lot, not held up by the count, so a busy
        broker still renews well within the time to live); hand back what exceeds the fair
        share, or take free partitions up to it: cold when it counted no other broker just
        now and holds none after the renewals (its start, or every lease lost)."""
        began = self.ctx.clock()
        mine = await self.renew()
        await self.balance(mine, warm=self._warm(began))

    def _warm(self, began: float) -> bool:
        """Whether what a round begun at ``began`` takes is warm: it counted another broker
        present, or this broker still holds partitions after its renewals (it was hearing
        all along). Alone and holding none, nobody heard the agents meanwhile: cold."""
        others = self.live > 1 and self._counted_at >= began
        return others or bool(self.held)

    async def renew(self) -> bytes:
        """Say this broker is present and count the brokers while every lease held is renewed;
        the lease value written."""
        mine = _encode(Lease(broker_id=self.ctx.broker_id, at_ms=self.ctx.wall_ms()))
        # Together: on a busy JetStream the count (a put and a watch) took up to 5.7 s, and
        # renewals waiting behind it came up to 9.3 s apart, leases of 10 s aging out under
        # their living owner (loadtest --brokers 4 --agents 100000 --kill).
        notes: dict[str, list[int]] = {}
        await asyncio.gather(self._count(),
                             *(self._renew(p, mine, notes) for p in list(self.held)))  # fmt: skip
        # Said once a round, naming the partitions: the renewals run together, and one line
        # each came 16 at once when a JetStream stalled (a nemesis run).
        if landed := notes.get("landed"):
            log.info("partitions.renewal_landed partitions=%s: renewals whose confirmation "
                     "timed out were written after all", sorted(landed))  # fmt: skip
        if lapsed := notes.get("lapsed"):
            log.warning("partitions.lapsed partitions=%s: not renewed within the lease's time "
                        "to live (another broker's by now, maybe)", sorted(lapsed))  # fmt: skip
        if lost := notes.get("lost"):
            log.warning("partitions.lost partitions=%s: another broker holds them now",
                        sorted(lost))  # fmt: skip
        return mine

    async def balance(self, mine: bytes, *, warm: bool) -> None:
        """Hand back what exceeds the fair share, or take free partitions up to it (the lease
        value ``mine``; ``warm``: their agents keep their stored states, as a handed-back
        partition's always do)."""
        share = self.share
        excess = len(self.held) - share
        if excess > 0:
            back = sorted(self.held)[-excess:]
            log.info("partitions.hand_back partitions=%s brokers=%d share=%d", back, self.live,
                     share)  # fmt: skip
            free = _encode(Lease(at_ms=self.ctx.wall_ms()))
            await asyncio.gather(*(self._hand_back(p, free) for p in back))
            try:  # the others take them at once (they follow the presence keys)
                await self._kv.put(presence_key(self.ctx.broker_id),
                                   _encode(Presence(freed=back)))  # fmt: skip
            except Exception as exc:  # noqa: BLE001 - taken at their next round instead
                log.debug("partitions.freed_unsaid error=%r", exc)
            return
        unheld = [p for p in range(self.cfg.partitions) if p not in self.held]
        if not unheld:
            return
        start = secrets.randbelow(len(unheld))  # brokers starting together try different ones
        candidates = unheld[start:] + unheld[:start]
        unanswered = 0
        while candidates and len(self.held) < share:
            need = share - len(self.held)
            batch, candidates = candidates[:need], candidates[need:]
            answered = await asyncio.gather(*(self._take(p, mine, warm) for p in batch))
            unanswered += answered.count(False)
        if unanswered and len(self.held) < share:
            # Free partitions may be left untaken for want of an answer: tried again soon
            # (with a lease of 600 s a third of it was 200 s without an owner).
            log.info("partitions.retake unanswered=%d held=%d share=%d in=%gs", unanswered,
                     len(self.held), share, RETAKE_S)  # fmt: skip
            self._again_soon()

    def _again_soon(self) -> None:
        """A round RETAKE_S from now, unless one is pending already: each failed round used to
        add a timer of its own (a failed count and unanswered takes two a round), and each
        timer's round more, so a struggling JetStream got rounds at a growing rate (3, 6, 10
        a second in nemesis seed 29)."""
        if self._soon is None:
            self._soon = asyncio.get_running_loop().call_later(RETAKE_S, self._soon_due)

    def _soon_due(self) -> None:
        self._soon = None
        self._wake.set()

    def _alone(self, now: float) -> bool:
        """Whether this broker counted itself alone within the lease's time to live (a count
        that failed, or none yet, says nothing)."""
        return self.live == 1 and now - self._counted_at < self.cfg.lease_ttl_s

    async def _count(self) -> None:
        """Write this broker's presence key, and count the keys present."""
        try:
            await self._kv.put(presence_key(self.ctx.broker_id), b"")
            # Not nats-py's KV watch: it can end before its first key (jetstream/lastvalues.py),
            # which counted this broker alone in a running fleet.
            stored = await lastvalues.messages(self.ctx.nc, PARTITIONS_STREAM,
                                               f"{_KV_PRE}{PRESENCE}*", name="presence-count",
                                               timeout_s=self.store.timeout_s)  # fmt: skip
            live = sum((msg.headers or {}).get(_KV_OP) not in _DELETED for msg in stored)
            self.live = max(live, 1)
            self._counted_at = self.ctx.clock()
        except Exception as exc:  # noqa: BLE001 - the last count stands, for RETAKE_S
            # Counted again soon: a round woken by a broker leaving whose count failed (a
            # busy JetStream) kept the share of two and took nothing, until the next round
            # (a third of the lease later: 200 s with a lease of 600 s).
            log.info("partitions.count_failed error=%r: counted again in %gs", exc, RETAKE_S)
            self._again_soon()

    async def _renew(self, p: int, mine: bytes, notes: dict[str, list[int]]) -> None:
        """Renew partition ``p``'s lease (unless handed back meanwhile: the hand-backs run
        beside the renewals); ``notes`` gathers what the round says (``lapsed``, ``lost``,
        ``landed``: partitions by what befell their lease)."""
        held = self.held.get(p)
        if held is None:
            return
        now = self.ctx.clock()
        try:
            revision = await self.store.swap(str(p), mine, held[1])
        except ClaimsUnavailable as exc:
            log.debug("partitions.renew_failed partition=%d error=%s", p, exc)
            if p in self.held and now - held[2] >= self.cfg.lease_ttl_s and not self._alone(now):
                # Not renewed within its time: it may be another broker's by now. (A broker
                # alone keeps hearing it: nobody else would; its next renewal that gets
                # through tells whether someone took it meanwhile.)
                notes.setdefault("lapsed", []).append(p)
                await self._lose(p)
            return
        if p not in self.held:
            return  # handed back meanwhile (stop)
        if revision is None:
            try:
                revision = await self._landed_after_all(p, mine, notes)
            except ClaimsUnavailable as exc:  # the next round tries again
                log.debug("partitions.renew_failed partition=%d error=%s", p, exc)
                return
            if p not in self.held:
                return
        if revision is None:  # it lapsed and someone took it
            notes.setdefault("lost", []).append(p)
            await self._lose(p)
        else:
            self.held[p] = (held[0], revision, now)

    async def _landed_after_all(self, p: int, mine: bytes,
                                notes: dict[str, list[int]]) -> int | None:  # fmt: skip
        """A renewal of ``p`` found another revision than the one it last confirmed: when
        the lease stored still names this broker, it is one of this broker's own renewals,
        whose confirmation timed out here while the server wrote it (a busy JetStream), and
        the lease is renewed again over it (its new revision); None when another broker's."""
        stored = await self.store.get(str(p))
        if stored is None:
            return None
        try:
            if _lease.decode(stored.data).broker_id != self.ctx.broker_id:
                return None
        except msgspec.MsgspecError:
            return None
        notes.setdefault("landed", []).append(p)
        return await self.store.swap(str(p), mine, stored.revision)

    async def _take(self, p: int, mine: bytes, warm: bool) -> bool:
        """Take partition ``p`` if free (never written, lapsed, or handed back: then warm);
        False when the store did not answer (whether it is free is not known)."""
        key = str(p)
        try:
            ours, stored = await self.store.create(key, mine)
            if ours:
                self._own(p, stored.revision, stored.revision, warm=warm)
            elif self._free(_lease.decode(stored.data).broker_id, p):
                revision = await self.store.swap(key, mine, stored.revision)
                if revision is not None:
                    self._own(p, revision, revision, warm=True)
        except ClaimsUnavailable as exc:
            log.debug("partitions.take_failed partition=%d error=%s", p, exc)
            return False
        except msgspec.MsgspecError as exc:  # not a lease: not ours to take
            log.debug("partitions.take_failed partition=%d error=%s", p, exc)
        return True

    def _free(self, owner: str | None, p: int) -> bool:
        """Whether a lease naming ``owner`` may be taken now: handed back (no owner), or held
        by a broker that stopped (its presence key deleted) without handing it back — its
        hand-backs ran out of time on a busy JetStream. A stopped broker renews nothing, so
        waiting for the lease to lapse left the partition unowned for up to a lease's time to
        live (and, with rounds a third of a lease apart, longer: found by a CI run of
        test_rules_live)."""
        if owner is None:
            return True
        if owner == self.ctx.broker_id or presence_key(owner) not in self._left:
            return False
        log.info("partitions.take_left partition=%d broker=%s: it stopped without handing "
                 "the lease back", p, owner)  # fmt: skip
        return True

    async def _hand_back(self, p: int, free: bytes) -> None:
        """Give partition ``p`` up (beyond the fair share): dropped here, then marked free."""
        held = self.held.get(p)
        if held is None:
            return
        await self._lose(p)
        try:
            await self.store.swap(str(p), free, held[1])
        except ClaimsUnavailable as exc:  # it lapses by itself
            log.debug("partitions.hand_back_failed partition=%d error=%s", p, exc)

    def _own(self, p: int, epoch: int, revision: int, *, warm: bool) -> None:
        """Partition ``p`` is held: its takeover starts on a task of its own."""
        self.held[p] = (epoch, revision, self.ctx.clock())
        self.owned.set(len(self.held))
        self.cold += not warm
        task = asyncio.create_task(self._take_over(p, epoch, warm), name=f"reach-takeover-{p}")
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    async def _take_over(self, p: int, epoch: int, warm: bool) -> None:
        try:
            await self.on_own(p, epoch, warm)
        except Exception:  # noqa: BLE001 - not heard: not kept (its lease lapses)
            log.exception("partitions.own_failed partition=%d: released", p)
            if p in self.held:
                await self._lose(p)

    async def settled(self) -> None:
        """Wait for the takeovers under way."""
        while self._pending:
            await asyncio.gather(*list(self._pending), return_exceptions=True)

    async def _lose(self, p: int) -> None:
        if self.held.pop(p, None) is None:
            return
        self.owned.set(len(self.held))
        await self.on_lose(p)

    async def _loop(self) -> None:
        """A round every third of the lease's time to live, and at once when woken."""
        every = self.cfg.lease_ttl_s / 3
        started = self.ctx.clock()
        while True:
            raise_if_cancelled()
            # Rounds start every third of the time to live, however long the last one took
            # (a slow round does not push the next renewal later by its own length).
            await wait_event(self._wake, max(started + every - self.ctx.clock(), 0.0))
            self._wake.clear()
            started = self.ctx.clock()
            try:
                mine = await self.renew()
                warm = self._warm(started)
                # The hand-backs and takes on a task of their own: taking after a broker
                # died tries every partition not held, a write and a read each, and on a
                # busy JetStream that took longer than a lease's time to live, the next
                # renewals waiting behind it. One at a time.
                if self._balancing is None or self._balancing.done():
                    balancing = self._balance(mine, warm)
                    self._balancing = asyncio.create_task(balancing, name="reach-balance")
                else:
                    # A balance is under way: another round once it ends, for this round
                    # may have been woken by what it could not see (partitions another
                    # broker freed after it tried them: left unheld for a third of the
                    # lease's time to live, found by a CI run of test_partition_leases).
                    log.debug("partitions.balance_under_way: a round again once it ends")
                    self._balancing.add_done_callback(lambda _: self._wake.set())
            except Exception:  # noqa: BLE001 - the loop body never dies
                log.exception("partitions.round failed")

    async def _balance(self, mine: bytes, warm: bool) -> None:
        try:
            await self.balance(mine, warm=warm)
        except Exception:  # noqa: BLE001 - the next round balances again
            log.exception("partitions.balance failed")

    # --- the other brokers' presence -----------------------------------------------------------

    async def _follow_presence(self) -> None:
        """Follow the presence keys (the last of each, then every change); without it (the
        server refused the consumer) the rounds alone rebalance, a third of the lease's time
        to live apart."""
        follower = Follower(self.ctx.nc, self._on_presence, name="presence",
                            stream=PARTITIONS_STREAM, subject=f"{_KV_PRE}{PRESENCE}*",
                            start=Start.last_per_subject(), metrics=self._follow,
                            timeout_s=self.store.timeout_s)  # fmt: skip
        try:
            await follower.start()
        except Exception as exc:  # noqa: BLE001 - the rounds still rebalance
            log.warning("partitions.presence_unfollowed error=%r: brokers joining or leaving "
                        "are seen at the next round only", exc)  # fmt: skip
            return
        self._presence = follower

    async def _on_presence(self, msg: Msg) -> None:
        """Another broker's presence key written or deleted: wake a round when it joined
        (a key not written within the lease's time to live), left, or freed partitions."""
        key = msg.subject[len(_KV_PRE) :]
        if key == presence_key(self.ctx.broker_id):
            return
        now = self.ctx.clock()
        ttl = self.cfg.lease_ttl_s
        for gone in [k for k, at in self._left.items() if now - at > ttl]:
            del self._left[gone]  # its leases have lapsed by now
        if (msg.headers or {}).get(_KV_OP) in _DELETED:
            self._left[key] = now
            reason = "left" if self._seen.pop(key, None) is not None else None
        else:
            self._left.pop(key, None)
            last = self._seen.get(key)
            self._seen[key] = now
            reason = ("joined" if last is None or now - last > self.cfg.lease_ttl_s
                      else "freed" if msg.data else None)  # fmt: skip
        if reason is not None:
            log.info("partitions.rebalance reason=%s broker=%s", reason, key[len(PRESENCE) :])
            self._wake.set()
