"""Replayed entries an agent has taken but not finished: held in the queue until it does.

A replayed task's entry is not removed at the agent's receipt: the replica that delivered it
holds it (un-acked, kept alive with ``in_progress`` every third of the consumer's
``ack_wait``) until the taker's own final ack record (``completed`` or ``failed``) arrives on
``<p>.ack.>``. Should the taker be declared ``offline`` (or evicted) first, or its claim be
released (by any broker), the entry is given back (``nak``): its claim is released by then
or shortly after
(:mod:`reach_broker.service.releases`), and the redelivery runs the task once elsewhere. A submitted
task thus completes at least once even when its agent dies mid-task. Should the replica
itself die, JetStream redelivers its held entries after ``ack_wait`` to another replica,
which holds them again while their claim says a live agent is running them. An entry held
longer than ``ack_wait`` is checked against its claim at each keepalive, so a final record
this replica missed (a leader change, an ack lost) never keeps it in the queue: removed once
the claim says completed or failed (or there is no claim), given back once it is released or
its holder is offline.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, NamedTuple

from jetstream.claims import ClaimsUnavailable
from jetstream.compensation import Entry, give_back
from jetstream.tasks import raise_if_cancelled
from reach_agent.aio import stop_loops
from reach_broker.service.releases import ClaimView

log = logging.getLogger(__name__)

EARLY_MAX = 4096
"""Final records remembered for entries not held yet (the record can arrive on ``<p>.ack.>``
before the receipt that makes the entry held is read); releases likewise."""
EARLY_RELEASE_S = 5.0
"""How long a claim's release heard before its entry was held here still gives the entry
back when it is held for that holder."""


class _Held(NamedTuple):
    entry: Entry
    agent_id: str
    since: float


async def _no_claims(request_id: str) -> ClaimView | None:
    return None


class Taken:
    """The entries this replica delivered and holds until their taker finishes."""

    def __init__(
        self,
        ack_wait_s: float,
        claim_of: Callable[[str], Awaitable[ClaimView | None]] = _no_claims,
        record_of: Callable[[str], Any] = lambda _: None,
        clock: Callable[[], float] = time.monotonic,
        on_returned: Callable[[], object] = lambda: None,
        owns_agent: Callable[[str], bool] = lambda _: True,
        again: Callable[[str], object] = lambda capability: None,
    ) -> None:
        self.ack_wait_s = ack_wait_s
        self.claim_of = claim_of
        """A request id's claim (holder, state), None when unclaimed (the replay's); raises
        ``ClaimsUnavailable`` when the bucket cannot say."""
        self.record_of = record_of
        self.owns_agent = owns_agent
        """Whether this broker holds an agent's partition (its registry knows the agent if
        anyone here does); always, for a broker that owns the whole fleet."""
        self.clock = clock
        self.on_returned = on_returned
        """Told of each entry given back (``reach_compensation_total{result="requeued"}``)."""
        self._held: dict[str, _Held] = {}
        self._by_agent: dict[str, set[str]] = {}
        self.again = again
        """Told the capability of an entry given back at its hold (replayed again)."""
        self._early: dict[str, str] = {}
        self._early_released: dict[str, tuple[str, float]] = {}
        """Claims released while no entry of theirs was held here: request id → (holder,
        when), oldest first, at most :data:`EARLY_MAX`."""
        self._task: asyncio.Task[None] | None = None
        self.finished = 0
        """Entries removed at their taker's final record."""
        self.returned = 0
        """Entries given back because their taker went offline before finishing."""

    def __len__(self) -> int:
        return len(self._held)

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._keepalive(), name="reach-replay-taken")

    async def stop(self) -> None:
        """Stop the keepalive; held entries stay un-acked (redelivered after ``ack_wait``)."""
        if self._task is not None:
            await stop_loops(self._task)
            self._task = None

    async def hold(self, entry: Entry, agent_id: str) -> bool:
        """``agent_id`` runs ``entry``'s request: keep the entry until it finishes (removed
        now when its final record came first; given back now when its claim's release came
        first, within :data:`EARLY_RELEASE_S`). Whether it is held."""
        rid = entry.request_id
        if self._early.get(rid) == agent_id:
            del self._early[rid]
            await self._remove(entry)
            return False
        early = self._early_released.get(rid)
        if early is not None:
            del self._early_released[rid]
            if early[0] == agent_id and self.clock() - early[1] <= EARLY_RELEASE_S:
                await self._give_back(entry, agent_id)
                self.again(entry.capability)
                return False
        old = self._held.get(rid)
        if old is not None:
            self._by_agent.get(old.agent_id, set()).discard(rid)
        self._held[rid] = _Held(entry, agent_id, self.clock())
        self._by_agent.setdefault(agent_id, set()).add(rid)
        return True

    def holds(self, request_id: str) -> bool:
        return request_id in self._held

    def held_by(self, agent_id: str) -> bool:
        """Whether ``agent_id`` holds an entry (O(1): asked on every agent's way offline)."""
        return agent_id in self._by_agent

    async def done(self, request_id: str, author: str) -> bool:
        """The final record of ``request_id`` by ``author`` arrived: remove the entry when
        ``author`` is its taker (any other author's record is not the result)."""
        held = self._held.get(request_id)
        if held is None:
            if len(self._early) >= EARLY_MAX:
                self._early.pop(next(iter(self._early)))
            self._early[request_id] = author
            return False
        if held.agent_id != author:
            return False
        self._forget(request_id)
        await self._remove(held.entry)
        return True

    async def _remove(self, entry: Entry) -> None:
        assert entry.msg is not None
        try:  # a lost ack redelivers it, and its claim says it is done
            await entry.msg.ack_sync()
        except Exception as exc:  # noqa: BLE001
            log.info("replay.taken_ack_failed request_id=%s error=%r", entry.request_id, exc)
        self.finished += 1

    async def taker_gone(self, agent_id: str) -> list[str]:
        """``agent_id`` went offline: give back every entry it held unfinished; their
        capabilities (to replay again)."""
        caps: list[str] = []
        for rid in list(self._by_agent.pop(agent_id, ())):
            held = self._held.pop(rid, None)
            if held is None:
                continue
            assert held.entry.msg is not None
            with contextlib.suppress(Exception):  # else redelivered after ack_wait anyway
                await give_back(held.entry.msg)
            self.returned += 1
            self.on_returned()
            caps.append(held.entry.capability)
            log.warning("replay.taker_gone request_id=%s capability=%s agent=%s: queued "
                        "again, to run elsewhere", rid, caps[-1], agent_id)  # fmt: skip
        return caps

    async def released(self, request_id: str, agent_id: str) -> str | None:
        """``request_id``'s claim by ``agent_id`` was released (by any broker: the one that
        owns the agent's partition declared it offline, or the holder gave it up): give
        the entry back when ``agent_id`` took it here; its capability (to replay again).
        Without this, a broker that handed the agent's partition over heard no offline
        transition and held the entry until its claim check, one ``ack_wait`` later
        (nemesis seed 48: two entries ran 19.4 and 24.0 s after their submit)."""
        held = self._held.get(request_id)
        if held is None or held.agent_id != agent_id:
            return None
        self._forget(request_id)
        await self._give_back(held.entry, agent_id)
        return held.entry.capability

    def released_before(self, request_id: str, agent_id: str) -> None:
        """``request_id``'s claim by ``agent_id`` was released while no entry of it is held
        here: remembered a moment, for the entry held just after (its hold registered after
        the release arrived: nemesis seed 71, c1-000540 held 20 s, until its claim check,
        for a claim released in the second it was held)."""
        early = self._early_released
        if len(early) >= EARLY_MAX:
            del early[next(iter(early))]
        early[request_id] = (agent_id, self.clock())

    async def _give_back(self, entry: Entry, agent_id: str) -> None:
        """``entry``, held for ``agent_id`` whose claim was released, given back."""
        assert entry.msg is not None
        with contextlib.suppress(Exception):  # else redelivered after ack_wait anyway
            await give_back(entry.msg)
        self.returned += 1
        self.on_returned()
        log.warning("replay.taken_released request_id=%s capability=%s agent=%s: its claim was "
                    "released; queued again, to run elsewhere", entry.request_id,
                    entry.capability, agent_id)  # fmt: skip

    def _forget(self, request_id: str) -> None:
        held = self._held.pop(request_id, None)
        if held is not None:
            rids = self._by_agent.get(held.agent_id)
            if rids is not None:
                rids.discard(request_id)
                if not rids:
                    del self._by_agent[held.agent_id]

    async def _keepalive(self) -> None:
        while True:
            raise_if_cancelled()
            await asyncio.sleep(self.ack_wait_s / 3)
            old = self.clock() - self.ack_wait_s
            for held in list(self._held.values()):
                try:
                    if held.since < old and not await self._still_running(held):
                        continue
                    assert held.entry.msg is not None
                    await held.entry.msg.in_progress()
                except Exception as exc:  # noqa: BLE001 - redelivered after ack_wait anyway
                    log.debug("replay.keepalive_failed request_id=%s error=%r",
                              held.entry.request_id, exc)  # fmt: skip

    def alive(self, agent_id: str) -> bool:
        """Whether ``agent_id`` may still run what its claim says: known here and not
        ``offline``, or of a partition another broker holds. That broker releases its claims
        once it goes offline, and the releases reach this one (:meth:`released`). Judged dead
        here, a claim running on another broker's agent bounced its entry every half second
        for as long as the task ran, and a held one was given back at its first claim
        check."""
        rec = self.record_of(agent_id)
        if rec is not None:
            return bool(rec.state != "offline")
        return not self.owns_agent(agent_id)

    async def _still_running(self, held: _Held) -> bool:
        """Whether a long-held entry's claim still says its taker runs it; if not, the entry
        is removed (finished, or no claim to go by) or given back (released, holder gone)."""
        rid = held.entry.request_id
        try:
            claim = await self.claim_of(rid)
        except ClaimsUnavailable:  # cannot say now (counted): keep holding it, never a guess
            return True
        if claim is not None and claim[1] == "running" and self.alive(claim[0]):
            return True
        if self._held.get(rid) is not held:
            return False  # finished or given back meanwhile
        self._forget(rid)
        assert held.entry.msg is not None
        if claim is None or claim[1] in ("completed", "failed"):
            log.info("replay.taken_settled request_id=%s claim=%s: removed", rid,
                     claim[1] if claim else "none")  # fmt: skip
            await self._remove(held.entry)
        else:
            self.returned += 1
            self.on_returned()
            log.warning("replay.taken_returned request_id=%s claim=%s: queued again", rid,
                        claim[1])  # fmt: skip
            await give_back(held.entry.msg)
        return False
