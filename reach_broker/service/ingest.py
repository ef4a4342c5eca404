"""What this broker hears: the announces, heartbeats and leaves of the partitions it owns.

The server maps the agent subjects into partitions (``<p>.hb.<id>`` is delivered as
``<p>.part.<n>.hb.<id>``, ``n`` the agent id's partition: docs/protocol.md, "Partitions"), so
the owner of partition ``n`` subscribes to its three mapped subjects when it takes the
partition and unsubscribes when it loses it: every other broker's work for it is zero.

At start the broker asks the server how it maps (:meth:`Ingest.check`): it publishes a few
tokens on ``<p>.partcheck.<token>`` (mapped like the agent subjects) and listens both where
the server would map them and where they arrive unmapped. The tokens are chosen so that any
partition count other than ``[fleet] partitions`` puts one of them elsewhere (see
:func:`check_tokens`), so the answer is exact:

- ``mapped``: every token arrived mapped, in the partition ``[fleet] partitions`` gives it.
- ``plain``: the server does not map (a bare nats-server, an older config, another prefix):
  the broker subscribes to the plain subjects and keeps what its partitions hold (the agent
  id's partition computed here, cached; with every partition owned, nothing is dropped).
- ``mismatch``: the server maps into another count of partitions. The broker refuses to
  partition by it (logged as an error, ``reach_partition_mapping{mode="mismatch"}``,
  ``/readyz`` not ready) and hears every mapped subject, keeping its own partitions by its
  own count: no agent is mis-partitioned, but nothing is saved either.

``reach_partition_heartbeats_total{partition}`` counts the heartbeats each owned partition
brings (``reach_heartbeats_total`` still counts them by result).
"""

from __future__ import annotations

import asyncio
import contextlib
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
    """Broker component: the subscriptions of announce, heartbeat and leave, per partition
    owned (:meth:`own`, :meth:`lose`), and the check of the server's mapping at start."""

    def __init__(
        self, ctx: BrokerContext, partitions: int, *, heartbeat: Callback, announce: Callback,
        leave: Callback, mapping: Any,
    ) -> None:  # fmt: skip
        self.ctx = ctx
        self.partitions = partitions
        self._heartbeat, self._announce, self._leave = heartbeat, announce, leave
        self.beats = [0] * partitions
        self._handled = 0
        """Heartbeats handled (every :data:`YIELD_EVERY`th lets the loop run)."""
        """Heartbeats heard per partition (``reach_partition_heartbeats_total``)."""
        self._mapping = mapping
        """``reach_partition_mapping`` (by mode)."""
        self.mode: str | None = None
        """How the server maps (:data:`MODES`), once checked."""
        self.live: set[int] = set()
        """Partitions heard: subscribed (mapped) or kept (plain, mismatch)."""
        self._subs: dict[int, list[Any]] = {}
        self._wide: list[Any] = []
        """The subscriptions of the plain and mismatch modes (every partition's subjects)."""
        self._cache: dict[str, int] = {}

    # --- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        """Check the server's mapping; in the plain and mismatch modes subscribe at once (each
        partition is kept from when it is owned)."""
        if self.mode is not None:
            return
        self.mode = mode = await self.check()
        for m in MODES:
            self._mapping.labels(m).set(int(m == mode))
        if mode == "mapped":
            return
        nc, s = self.ctx.nc, self.ctx.subjects
        kinds = ((s.all_heartbeats, s.all_announces, s.all_leaves) if mode == "plain" else
                 (s.partition_heartbeats("*"), s.partition_announces("*"),
                  s.partition_leaves("*")))  # fmt: skip
        msgs, size = HEARTBEAT_PENDING
        self._wide = [
            await nc.subscribe(kinds[0], cb=self._kept_heartbeat,
                               pending_msgs_limit=msgs, pending_bytes_limit=size),
            await nc.subscribe(kinds[1], cb=self._kept(self._announce),
                               pending_msgs_limit=msgs, pending_bytes_limit=size),
            await nc.subscribe(kinds[2], cb=self._kept(self._leave)),
        ]  # fmt: skip
        await flush_subscriptions(nc)

    async def stop(self) -> None:
        for sub in [*self._wide, *(s for subs in self._subs.values() for s in subs)]:
            with contextlib.suppress(NatsError, asyncio.CancelledError):
                await sub.unsubscribe()
        self._wide = []
        self._subs = {}
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
        if self.mode == "mapped":
            nc, s = self.ctx.nc, self.ctx.subjects
            msgs, size = HEARTBEAT_PENDING
            self._subs[p] = [
                await nc.subscribe(s.partition_heartbeats(p), cb=self._counted(p),
                                   pending_msgs_limit=msgs, pending_bytes_limit=size),
                await nc.subscribe(s.partition_announces(p), cb=self._announce,
                                   pending_msgs_limit=msgs, pending_bytes_limit=size),
                await nc.subscribe(s.partition_leaves(p), cb=self._leave),
            ]  # fmt: skip
            await flush_subscriptions(nc)
        self.live.add(p)

    def hears(self, agent_id: str) -> bool:
        """Whether ``agent_id``'s partition is heard here: from :meth:`own`'s return (the
        partition taken: its agents restored, its subjects subscribed) until :meth:`lose`. What
        the server does not map into partitions (the Synadia agents' subjects, heard by every
        broker) is kept or left by it."""
        return partition(agent_id, self.partitions) in self.live

    async def lose(self, p: int) -> None:
        """Stop hearing partition ``p``."""
        self.live.discard(p)
        for sub in self._subs.pop(p, ()):
            with contextlib.suppress(NatsError):
                await sub.unsubscribe()

    # --- the callbacks -----------------------------------------------------------------------

    def _counted(self, p: int) -> Callback:
        """The heartbeat callback of partition ``p``'s mapped subscription."""
        heartbeat, beats = self._heartbeat, self.beats

        async def on_heartbeat(msg: Msg) -> None:
            beats[p] += 1
            await heartbeat(msg)
            self._handled += 1
            if self._handled % YIELD_EVERY == 0:
                await asyncio.sleep(0)

        return on_heartbeat

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
