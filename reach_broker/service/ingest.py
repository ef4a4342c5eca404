"""What this broker hears: the announces, heartbeats and leaves of the partitions it owns, and
the callers' outcome summaries of their agents.

The server maps the agent subjects into partitions (``<p>.hb.<id>`` is delivered as
``<p>.part.<n>.hb.<id>``, ``n`` the agent id's partition: docs/protocol.md, "Partitions"), so
the owner of partition ``n`` subscribes to its mapped subjects when it takes the partition
and unsubscribes when it loses it: every other broker's work for it is zero. The callers'
outcome summaries (``<p>.outcome.<agent_id>``) are mapped the same way, since only an agent's
owner judges it. A server whose mapping predates theirs (an older config or account JWT)
delivers them unmapped: every broker in the mapped mode also listens there, keeps its own
partitions' summaries and logs once (``ingest.outcomes_unmapped``) that every broker is
hearing every summary.

At start the broker asks the server how it maps (:meth:`Ingest.check`): it publishes a few
tokens on ``<p>.partcheck.<token>`` (mapped like the agent subjects) and listens both where
the server would map them and where they arrive unmapped. The tokens are chosen so that any
partition count other than ``[fleet] partitions`` puts one of them elsewhere (see
:func:`check_tokens`), so the answer is exact:

- ``mapped``: every token arrived mapped, in the partition ``[fleet] partitions`` gives it.
- ``plain``: the server does not map (a bare nats-server, an older config, another prefix):
  the broker subscribes to the plain subjects and keeps what its partitions hold (the agent
  id's partition computed here, cached; with every partition owned, nothing is dropped).
  The outcome summaries likewise.
- ``mismatch``: the server maps into another count of partitions. The broker refuses to
  partition by it (logged as an error, ``reach_partition_mapping{mode="mismatch"}``,
  ``/readyz`` not ready) and hears every mapped subject, keeping its own partitions by its
  own count: no agent is mis-partitioned, but nothing is saved either.

``reach_partition_heartbeats_total{partition}`` counts the heartbeats each owned partition
brings (``reach_heartbeats_total`` still counts them by result).

**One heartbeat subscription while every partition is owned.** In the mapped mode a broker
that owns every partition (a lone broker, as by default) hears the heartbeats on one
subscription (``<p>.part.*.hb.*``) instead of one a partition: nats-py runs each
subscription's callbacks on a task of its own, woken per message, and 32 of them cost a lone
broker's route requests about a tenth of their throughput at 10,000 agents a second
(``loadtest/README.md``, "One heartbeat subscription"). Announces and leaves keep one a
partition. When it owns one partition less (another broker joined), it goes back to one
heartbeat subscription a partition, and to the one again when it owns all. Each switch
subscribes the new subscriptions before it drains the old ones (nats-py's ``drain``: the server
stops sending, every message already sent is handled), so no heartbeat goes unheard; one the
server sent to both meanwhile is handled once: while a switch is under way, a heartbeat whose
subject and body were already handled is left out, until the subscriptions kept have handled
everything delivered to them before the old ones were drained.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import math
import secrets
from collections.abc import Awaitable, Callable
from typing import Any

from nats.aio.msg import Msg
from nats.errors import Error as NatsError

from reach_agent.connection import flush_subscriptions
from reach_agent.routing.table import partition

from .context import BrokerContext

log = logging.getLogger(__name__)

HEARTBEAT_PENDING = 1_000_000, 512 * 1024 * 1024
"""Pending limits (messages, bytes) of the announce and heartbeat subscriptions: a storm of
heartbeats must queue, not drop."""
CHECK_WAIT_S = 1.0
"""How long one round of the mapping check waits for its tokens."""
CHECK_ROUNDS = 3
"""Rounds of the check before the broker settles for ``plain`` (logged)."""
YIELD_EVERY = 16
"""Heartbeats handled in a row before the heartbeat callback lets the loop run the rest: a
socket read of heartbeats (hundreds at 10,000 agents a second) is otherwise handled whole
before the route requests read with it are answered."""
SWITCH_TIMEOUT_S = 5.0
"""How long a switch of heartbeat subscriptions waits for the kept ones to catch up before it
stops telling duplicates apart (logged: one handled twice is then refused as ``stale``)."""
CACHE_MAX = 1_000_000
"""Agent ids whose partition the plain mode remembers (then the memory is renewed)."""

Callback = Callable[[Msg], Awaitable[None]]

MODES = ("mapped", "plain", "mismatch")


def check_tokens(partitions: int, salt: str) -> list[str]:
    """Tokens whose partitions tell ``partitions`` from every other count: each token's hash
    ``h`` has ``h % partitions == partitions - 1``, and the gcd of the ``h - (partitions - 1)``
    is ``partitions``. A server counting ``q < partitions`` puts every token below
    ``partitions - 1``; one counting ``q > partitions`` agrees on all of them only if ``q``
    divides that gcd, which is ``partitions``: impossible. So the tokens arrive where
    ``partitions`` puts them exactly when the server counts ``partitions``."""
    want = partitions - 1
    tokens: list[str] = []
    g = 0
    k = 0
    while g != partitions or not tokens:
        token = f"{salt}x{k}"
        k += 1
        h = partition(token, 2**32)
        if h % partitions != want or h == want:
            continue
        tokens.append(token)
        g = math.gcd(g, h - want)
    return tokens


class Ingest:
    """Broker component: the subscriptions of announce, heartbeat, leave and outcome, per
    partition owned (:meth:`own`, :meth:`lose`), and the check of the server's mapping at
    start."""

    def __init__(
        self, ctx: BrokerContext, partitions: int, *, heartbeat: Callback, announce: Callback,
        leave: Callback, mapping: Any, outcome: Callback | None = None,
    ) -> None:  # fmt: skip
        """``outcome``: the callers' outcome summaries (None: not heard, outcomes off)."""
        self.ctx = ctx
        self.partitions = partitions
        self._heartbeat, self._announce, self._leave = heartbeat, announce, leave
        self._outcome = outcome
        self.unmapped_outcomes = False
        """Whether a summary arrived unmapped while the server maps the agent subjects (its
        mapping predates the outcomes': logged once)."""
        self.beats = [0] * partitions
        """Heartbeats heard per partition (``reach_partition_heartbeats_total``)."""
        self._handled = 0
        """Heartbeats handled (every :data:`YIELD_EVERY`th lets the loop run)."""
        self._mapping = mapping
        """``reach_partition_mapping`` (by mode)."""
        self.mode: str | None = None
        """How the server maps (:data:`MODES`), once checked."""
        self.live: set[int] = set()
        """Partitions heard: subscribed (mapped) or kept (plain, mismatch)."""
        self._subs: dict[int, list[Any]] = {}
        """Per partition owned (mapped mode): its announce, leave and outcome subscriptions."""
        self._beats: dict[int, Any] = {}
        """Per partition owned (mapped mode, not every one owned): its heartbeat subscription."""
        self._all_beats: Any = None
        """Every partition's heartbeats (mapped mode, every partition owned)."""
        self._done = [0] * partitions
        """Messages handled by each partition's heartbeat subscription since it was made (a
        switch waits on them)."""
        self._all_done = 0
        """Messages handled by :attr:`_all_beats` since it was made."""
        self._twice: set[tuple[str, bytes]] | None = None
        """While a switch is under way: (subject, body) of each heartbeat handled once."""
        self._held: tuple[str, asyncio.Event] | None = None
        """While a switch is under way: which side is new (``one`` or ``partitions``), and set
        once the old side is drained: the new side handles nothing before (an agent's
        heartbeats are handled in the order it sent them)."""
        self.copies = 0
        """Heartbeats the server sent to both the old and the new subscriptions of a switch,
        handled once (the other copy left out)."""
        self._switch = asyncio.Lock()
        """One change of the mapped subscriptions at a time."""
        self._wide: list[Any] = []
        """The subscriptions of the plain and mismatch modes (every partition's subjects), and
        the unmapped outcome summaries' (every mode)."""
        self._cache: dict[str, int] = {}
        self._partition_of_mapped = ctx.subjects.partition_of_mapped

    # --- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        """Check the server's mapping; in the plain and mismatch modes subscribe at once (each
        partition is kept from when it is owned)."""
        if self.mode is not None:
            return
        self.mode = mode = await self.check()
        for m in MODES:
            self._mapping.labels(m).set(int(m == mode))
        nc, s = self.ctx.nc, self.ctx.subjects
        msgs, size = HEARTBEAT_PENDING
        if self._outcome is not None:
            # Unmapped summaries: those of a plain server, or of a mapping that predates the
            # outcomes' (every broker hears them: each keeps its partitions').
            kept = self._kept(self._outcome)
            unmapped = kept if mode != "mapped" else self._said_once(kept)
            self._wide.append(await nc.subscribe(s.all_outcomes, cb=unmapped,
                                                 pending_msgs_limit=msgs,
                                                 pending_bytes_limit=size))  # fmt: skip
            if mode == "mismatch":
                self._wide.append(await nc.subscribe(s.partition_outcomes("*"), cb=kept,
                                                     pending_msgs_limit=msgs,
                                                     pending_bytes_limit=size))  # fmt: skip
        if mode != "mapped":
            kinds = ((s.all_heartbeats, s.all_announces, s.all_leaves) if mode == "plain" else
                     (s.partition_heartbeats("*"), s.partition_announces("*"),
                      s.partition_leaves("*")))  # fmt: skip
            self._wide += [
                await nc.subscribe(kinds[0], cb=self._kept_heartbeat,
                                   pending_msgs_limit=msgs, pending_bytes_limit=size),
                await nc.subscribe(kinds[1], cb=self._kept(self._announce),
                                   pending_msgs_limit=msgs, pending_bytes_limit=size),
                await nc.subscribe(kinds[2], cb=self._kept(self._leave)),
            ]  # fmt: skip
        await flush_subscriptions(nc)

    async def stop(self) -> None:
        subs = [*self._wide, *(s for subs in self._subs.values() for s in subs),
                *self._beats.values(), *([self._all_beats] if self._all_beats else [])]  # fmt: skip
        for sub in subs:
            with contextlib.suppress(NatsError, asyncio.CancelledError):
                await sub.unsubscribe()
        self._wide = []
        self._subs = {}
        self._beats = {}
        self._all_beats = None
        self.live = set()
        self.mode = None

    def not_ready(self) -> str | None:
        """Why ``/readyz`` says 503 on this account, or None."""
        if self.mode == "mismatch":
            return (f"the NATS server maps the agent subjects into another count of partitions "
                    f"than [fleet] partitions = {self.partitions}: every broker hears every "
                    "agent (configs/nats-server.conf and broker.toml must agree)")  # fmt: skip
        return None

    # --- ownership ---------------------------------------------------------------------------

    async def own(self, p: int) -> None:
        """Hear partition ``p`` from now on (on return its subscriptions are live at the
        server)."""
        if p in self.live:
            return
        if self.mode != "mapped":
            self.live.add(p)
            return
        nc, s = self.ctx.nc, self.ctx.subjects
        msgs, size = HEARTBEAT_PENDING
        async with self._switch:  # the subscriptions made here; their round trip is not
            if p in self.live or p in self._subs:  # held (partitions are taken concurrently)
                return
            self._subs[p] = [
                await nc.subscribe(s.partition_announces(p), cb=self._announce,
                                   pending_msgs_limit=msgs, pending_bytes_limit=size),
                await nc.subscribe(s.partition_leaves(p), cb=self._leave),
            ]  # fmt: skip
            if self._outcome is not None:
                self._subs[p].append(await nc.subscribe(
                    s.partition_outcomes(p), cb=self._outcome, pending_msgs_limit=msgs,
                    pending_bytes_limit=size))  # fmt: skip
            if self._all_beats is None:
                self._beats[p] = await self._hear_beats_of(p)
        await flush_subscriptions(nc)
        self.live.add(p)
        if len(self.live) == self.partitions:
            async with self._switch:
                if len(self.live) == self.partitions and self._all_beats is None:
                    await self._beats_on_one()

    @property
    def heartbeat_subscriptions(self) -> int:
        """The heartbeat subscriptions of the mapped mode: 1 while every partition is owned,
        else one a partition owned."""
        return len(self._beats) + (self._all_beats is not None)

    def hears(self, agent_id: str) -> bool:
        """Whether ``agent_id``'s partition is heard here: from :meth:`own`'s return (the
        partition taken: its agents restored, its subjects subscribed) until :meth:`lose`. What
        the server does not map into partitions (the Synadia agents' subjects, heard by every
        broker) is kept or left by it."""
        return partition(agent_id, self.partitions) in self.live

    async def lose(self, p: int) -> None:
        """Stop hearing partition ``p``."""
        self.live.discard(p)
        async with self._switch:
            subs = self._subs.pop(p, [])
            beats = self._beats.pop(p, None)
            for sub in [*subs, *([beats] if beats is not None else [])]:
                with contextlib.suppress(NatsError):
                    await sub.unsubscribe()
            if self._all_beats is not None:
                await self._beats_by_partition()

    # --- the heartbeat subscriptions (mapped mode) --------------------------------------------

    async def _hear_beats_of(self, p: int) -> Any:
        msgs, size = HEARTBEAT_PENDING
        self._done[p] = 0  # partition p has no other heartbeat subscription of its own
        return await self.ctx.nc.subscribe(
            self.ctx.subjects.partition_heartbeats(p), cb=self._counted(p),
            pending_msgs_limit=msgs, pending_bytes_limit=size,
        )  # fmt: skip

    async def _beats_on_one(self) -> None:
        """Every partition owned: one heartbeat subscription for all of them."""
        nc = self.ctx.nc
        msgs, size = HEARTBEAT_PENDING
        self._twice = set()
        self._all_done = 0
        drained = asyncio.Event()
        self._held = ("one", drained)
        try:
            self._all_beats = await nc.subscribe(
                self.ctx.subjects.partition_heartbeats("*"), cb=self._any_heartbeat,
                pending_msgs_limit=msgs, pending_bytes_limit=size,
            )  # fmt: skip
            await flush_subscriptions(nc)
            old, self._beats = self._beats, {}
            await self._drain(list(old.values()))
            drained.set()
            await self._caught_up([(self._all_beats, lambda: self._all_done)])
        finally:
            drained.set()
            self._held = None
            self._twice = None
        log.info("ingest.heartbeats subscriptions=1 partitions=%d", len(self.live))

    async def _beats_by_partition(self) -> None:
        """A partition handed over: one heartbeat subscription a partition owned again."""
        self._twice = set()
        drained = asyncio.Event()
        self._held = ("partitions", drained)
        try:
            done = self._done
            for p in sorted(self.live):
                self._beats[p] = await self._hear_beats_of(p)
            await flush_subscriptions(self.ctx.nc)
            old, self._all_beats = self._all_beats, None
            await self._drain([old])
            drained.set()
            await self._caught_up([(sub, functools.partial(done.__getitem__, p))
                                   for p, sub in self._beats.items()])  # fmt: skip
        finally:
            drained.set()
            self._held = None
            self._twice = None
        log.info("ingest.heartbeats subscriptions=%d", len(self._beats))

    @staticmethod
    async def _drain(subs: list[Any]) -> None:
        """Stop ``subs`` once every message the server sent them is handled."""
        for sub in subs:
            with contextlib.suppress(NatsError):
                await sub.drain()

    async def _caught_up(self, kept: list[tuple[Any, Callable[[], int]]]) -> None:
        """Wait until each of ``kept`` (a subscription, and how many of its messages were
        handled) has handled what was delivered to it by now: then no copy of a heartbeat the
        drained subscriptions had is still to come."""
        loop = asyncio.get_running_loop()
        due = [(sub.delivered, handled) for sub, handled in kept]
        deadline = loop.time() + SWITCH_TIMEOUT_S
        while any(handled() < n for n, handled in due):
            if loop.time() > deadline:
                log.warning("ingest.switch_slow: the heartbeats delivered during the switch "
                            "were not all handled within %gs; one sent to both subscriptions "
                            "may be refused as stale", SWITCH_TIMEOUT_S)  # fmt: skip
                return
            await asyncio.sleep(0.001)

    def _again(self, msg: Msg) -> bool:
        """During a switch: whether this heartbeat was already handled (its other copy)."""
        twice = self._twice
        assert twice is not None
        key = (msg.subject, msg.data)
        if key in twice:
            twice.discard(key)
            self.copies += 1
            return True
        twice.add(key)
        return False

    # --- the callbacks -----------------------------------------------------------------------

    def _counted(self, p: int) -> Callback:
        """The heartbeat callback of partition ``p``'s mapped subscription."""
        heartbeat, beats, done = self._heartbeat, self.beats, self._done

        async def on_heartbeat(msg: Msg) -> None:
            if self._twice is not None:
                if self._held is not None and self._held[0] == "partitions":
                    await self._held[1].wait()
                if self._again(msg):
                    done[p] += 1
                    return
            done[p] += 1
            beats[p] += 1
            await heartbeat(msg)
            self._handled += 1
            if self._handled % YIELD_EVERY == 0:
                await asyncio.sleep(0)

        return on_heartbeat

    async def _any_heartbeat(self, msg: Msg) -> None:
        """The callback of the one heartbeat subscription of every partition."""
        if self._twice is not None:
            if self._held is not None and self._held[0] == "one":
                await self._held[1].wait()
            if self._again(msg):
                self._all_done += 1
                return
        self._all_done += 1
        try:
            p = self._partition_of_mapped(msg.subject)
        except ValueError:
            return  # not a partition's subject: one subscription a partition hears none such
        if p not in self.live:
            return  # handed over since the server sent it: its new owner hears it
        self.beats[p] += 1
        await self._heartbeat(msg)
        self._handled += 1
        if self._handled % YIELD_EVERY == 0:
            await asyncio.sleep(0)

    def partition_of(self, subject: str) -> int:
        """The partition of the agent a plain subject names (remembered)."""
        agent_id = subject[subject.rfind(".") + 1 :]
        p = self._cache.get(agent_id)
        if p is None:
            if len(self._cache) >= CACHE_MAX:
                self._cache.clear()
            p = self._cache[agent_id] = partition(agent_id, self.partitions)
        return p

    async def _kept_heartbeat(self, msg: Msg) -> None:
        p = self.partition_of(msg.subject)
        if p in self.live:
            self.beats[p] += 1
            await self._heartbeat(msg)
            self._handled += 1
            if self._handled % YIELD_EVERY == 0:
                await asyncio.sleep(0)

    def _kept(self, cb: Callback) -> Callback:
        """``cb`` for the messages of the partitions heard (plain and mismatch modes)."""

        async def kept(msg: Msg) -> None:
            if self.partition_of(msg.subject) in self.live:
                await cb(msg)

        return kept

    def _said_once(self, kept: Callback) -> Callback:
        """``kept`` for the outcome summaries a mapping server did not map (its mapping
        predates theirs), saying so once: every broker hears every one of them."""

        async def unmapped(msg: Msg) -> None:
            if not self.unmapped_outcomes:
                self.unmapped_outcomes = True
                log.warning("ingest.outcomes_unmapped subject=%s: the server maps the agent "
                            "subjects but not %s, so every broker hears every outcome "
                            "summary (each keeps its own partitions'); add its mapping "
                            "(docs/protocol.md, Partitioned ingest)", msg.subject,
                            self.ctx.subjects.all_outcomes)  # fmt: skip
            await kept(msg)

        return unmapped

    # --- the check ---------------------------------------------------------------------------

    async def check(self) -> str:
        """How the server maps (see the module docstring)."""
        nc, s, count = self.ctx.nc, self.ctx.subjects, self.partitions
        tokens = check_tokens(count, secrets.token_hex(4))
        want = count - 1
        seen: dict[str, int | None] = {}
        done = asyncio.Event()

        async def heard(msg: Msg) -> None:
            token = msg.subject[msg.subject.rfind(".") + 1 :]
            if token in tokens and token not in seen:
                plain = msg.subject.startswith(s.partition_check(""))
                seen[token] = None if plain else s.partition_of_mapped(msg.subject)
                if len(seen) == len(tokens):
                    done.set()

        subs = [await nc.subscribe(s.all_partition_checks, cb=heard),
                await nc.subscribe(s.mapped_checks, cb=heard)]  # fmt: skip
        try:
            await flush_subscriptions(nc)
            for _ in range(CHECK_ROUNDS):
                for token in tokens:
                    if token not in seen:
                        await nc.publish(s.partition_check(token), b"")
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(CHECK_WAIT_S):
                        await done.wait()
                if done.is_set():
                    break
        finally:
            for sub in subs:
                with contextlib.suppress(NatsError):
                    await sub.unsubscribe()
        if not done.is_set():
            log.warning("ingest.check_unanswered partitions=%d: the server's mapping is "
                        "unknown (no right to publish %s?); hearing the plain subjects",
                        count, s.all_partition_checks)  # fmt: skip
            return "plain"
        where = set(seen.values())
        if where == {None}:
            log.info(
                "ingest.mode mode=plain partitions=%d: the server does not map the "
                "agent subjects; each broker hears them all, keeps its own",
                count,
            )
            return "plain"
        if where == {want}:
            log.info("ingest.mode mode=mapped partitions=%d", count)
            return "mapped"
        log.error("ingest.mode mode=mismatch partitions=%d: the server maps the agent subjects "
                  "into another count of partitions (a check token arrived in partition(s) %s, "
                  "expected %d); hearing every partition and keeping this broker's own by "
                  "[fleet] partitions: not ready", count, sorted(p for p in where if p is not None),
                  want)  # fmt: skip
        return "mismatch"
