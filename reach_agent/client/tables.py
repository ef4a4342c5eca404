"""The client's routes made here: it follows the route tables of the capabilities it calls
(:class:`TableFollower`, which a broker also uses for the shares other brokers own) and
chooses with the broker's own code (docs/protocol.md, "Route tables").

:class:`TableRoutes` is the client's default :class:`~reach_agent.client.routes.RouteSource`.
A capability is followed on its first call (its deltas subscribed, then its table asked of
the brokers in one request, or read from KV ``reach_tables`` when none answers), applied as
deltas come (:class:`~reach_agent.routing.table.RouteTable`; a gap: the table asked again),
asked whole again every ``table_resync_s``, and no longer followed after ``table_idle_s``
unused. A call routes from it with :meth:`reach_agent.routing.choice.Chooser.pick` — the
filters, the rule's split, the ranking and the draw the broker would apply — and counts what
it sends (:meth:`sent`, :meth:`ended`). It asks a broker instead (:class:`Routes`) for a look
(``Client.route``, a ``peek``), for a capability whose table says ``local: false`` (a quota
applies), when it holds no table, and when its table has nobody reachable (the broker may know
better; it also answers with its cache when no broker is left).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import time
from collections.abc import Callable, Sequence
from typing import Any

import msgspec
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.errors import Error as NatsError

from jetstream.names import TABLES_STREAM
from reach_agent import trace
from reach_agent.metrics import ClientMetrics
from reach_agent.routing.choice import Chooser
from reach_agent.routing.table import RouteTable, TableMember
from reach_agent.wire import schema
from reach_agent.wire.errors import NoReachableAgent
from reach_agent.wire.schema import NO_FILTERS, Candidate, Filters, TableRouting, TableShare
from reach_agent.wire.subjects import Subjects

from .config import ClientConfig
from .routes import Routes

log = trace.logger(__name__)

_API = "$JS.API"
REFETCH_S = 1.0
"""A table that could not be had is asked for again at most this often (calls meanwhile ask
a broker)."""
_KV_OP = "KV-Operation"


class _StreamState(msgspec.Struct, frozen=True):
    subjects: dict[str, int] = {}


class _StreamInfo(msgspec.Struct):
    state: _StreamState = _StreamState()


class _StoredMsg(msgspec.Struct):
    data: str = ""
    hdrs: str = ""


class _MsgGet(msgspec.Struct):
    message: _StoredMsg | None = None


_stream_info = msgspec.json.Decoder(_StreamInfo)
_msg_get = msgspec.json.Decoder(_MsgGet)


class Followed:
    """One capability followed: its table, its deltas' subscription, when it was used."""

    __slots__ = ("asked_again", "covered", "fetching", "pending", "resync", "retry", "sub",
                 "synced_at", "table", "used_at")  # fmt: skip

    def __init__(self, table: RouteTable, now: float) -> None:
        self.table = table
        self.sub: Any = None
        self.used_at = now
        self.synced_at = now
        self.fetching: asyncio.Task[bool] | None = None
        """The table being asked for (deltas meanwhile wait in ``pending``)."""
        self.pending: list[schema.TableDelta] = []
        self.resync = False
        """A gap was seen while a fetch ran: fetch again after it."""
        self.asked_again = 0
        """Fetches in a row that left partitions unseen (``unseen``, a broker's shares)."""
        self.retry: asyncio.TimerHandle | None = None
        """The next of those fetches, scheduled."""
        self.covered: set[int] = set()
        """The partitions the last fetch saw answered for by their owner or read from the
        store, with a share of the capability or none (no agent of it there)."""


class TableRoutes:
    """Routes from the route tables, a broker's when they cannot say (a ``RouteSource``)."""

    def __init__(
        self,
        nc: NATS,
        subjects: Subjects,
        config: ClientConfig,
        broker: Routes,
        metrics: ClientMetrics | None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.subjects = subjects
        self.config = config
        self.broker = broker
        """Route requests to a broker, and their cache."""
        self.metrics = metrics
        self.clock = clock
        self.follower = TableFollower(nc, subjects, config, clock)
        """The tables of the capabilities this caller calls."""
        self.chooser: Chooser[TableMember] = Chooser(TableRouting())
        self._sent: dict[object, tuple[TableMember, int]] = {}

    # --- lifecycle ------------------------------------------------------------------------

    async def start(self) -> None:
        await self.broker.start()
        await self.follower.start()

    async def stop(self) -> None:
        await self.follower.stop()
        await self.broker.stop()

    def agent_gone(self, agent_id: str) -> None:
        """An event said the agent is out: its tables will say so too; the cache forgets it."""
        self.broker.agent_gone(agent_id)

    # --- routing --------------------------------------------------------------------------

    async def route(
        self, capability: str, filters: Filters = NO_FILTERS, *, limit: int | None = None,
        exclude: Sequence[str] = (), peek: bool = False, deadline: float | None = None,
        headers: dict[str, str] | None = None,
    ) -> list[Candidate]:  # fmt: skip
        """The candidates of ``capability`` from its table; a broker's when the table cannot
        say (see the module docstring; ``headers``, a call's trace, go with a request)."""
        if peek:
            return await self.broker.route(capability, filters, limit=limit, exclude=exclude,
                                           peek=True, deadline=deadline,
                                           headers=headers)  # fmt: skip
        table = await self.follower.table(capability) if self.config.local_routing else None
        if table is None or not table.local:
            return await self.broker.route(capability, filters, limit=limit, exclude=exclude,
                                           deadline=deadline, headers=headers)  # fmt: skip
        schema.check_capability(capability)
        if filters.tags:
            schema.check_tags(filters.tags)
        req = schema.route_request(filters, limit or self.config.route_limit, list(exclude))
        chooser = self.chooser
        chooser.cfg = table.settings
        try:
            chosen = chooser.pick(table.index, req, table.rule, self.clock())
        except NoReachableAgent:
            # Nobody here: the broker may know an agent this table does not have yet.
            return await self.broker.route(capability, filters, limit=limit, exclude=exclude,
                                           deadline=deadline, headers=headers)  # fmt: skip
        task = self.subjects.task
        return [m.candidate(task(m.agent_id, capability)) for m in chosen]

    def sent(self, agent_id: str, call: object) -> None:
        """Attempt ``call`` is being sent to ``agent_id``: counted on its load until it ends
        (:meth:`ended`) or the agent's next report counts it."""
        m = self.follower.members.get(agent_id)
        if m is not None:
            m.handed_out(self.clock())
            self._sent[call] = (m, m.report)

    def ended(self, call: object, busy: bool) -> None:
        """Attempt ``call`` ended; ``busy``: the agent answered ``TARGET_BUSY``."""
        sent = self._sent.pop(call, None)
        if sent is None:
            return
        m, report = sent
        now = self.clock()
        m.handed_back(now, report)
        if busy:
            m.refused(now)


class TableFollower:
    """The route tables of the capabilities asked for, followed (a caller's, for its own
    routes; a broker's, for the shares of the partitions other brokers own).

    ``skip``: partitions whose shares are not held (a broker holds its own partitions' agents
    itself); their deltas are ignored and what the brokers answer of them is left out."""

    def __init__(
        self,
        nc: NATS,
        subjects: Subjects,
        config: ClientConfig,
        clock: Callable[[], float] = time.monotonic,
        *,
        skip: Callable[[int], bool] | None = None,
        member: type[TableMember] = TableMember,
        unseen: Callable[[str, list[int], int], None] | None = None,
        partitions: int = 0,
    ) -> None:
        self.nc = nc
        self.member = member
        """What the tables' agents are made as (a broker's count hand-outs as its own)."""
        self.subjects = subjects
        self.config = config
        self.clock = clock
        self.skip = skip
        self.members: dict[str, TableMember] = {}
        """Every agent of the tables followed (one per agent: its load counts every call)."""
        self.followed: dict[str, Followed] = {}
        self.partitions = partitions
        """The fleet's partitions, as the brokers last said (0: none said yet)."""
        self.unseen = unseen
        """Told ``(capability, partitions, fetches)`` when a table was fetched and partitions
        not skipped are unseen (no broker answered as their owner, KV holds no share of
        them): the table is then asked for again after ``REFETCH_S``, doubling up to
        ``table_resync_s``, until none is (then told once with no partition). None: a
        caller's follower, which asks again only a table holding no share at all."""
        self._loop: asyncio.Task[None] | None = None

    async def start(self) -> None:
        if self._loop is None:
            self._loop = asyncio.create_task(self._upkeep(), name="reach-tables")

    async def stop(self) -> None:
        if self._loop is not None:
            self._loop.cancel()
            await asyncio.wait({self._loop}, timeout=2.0)
            self._loop = None
        for cap in list(self.followed):
            await self._unfollow(cap)

    def refetch(self) -> None:
        """Ask for every table followed again (the partitions skipped changed)."""
        skip = self.skip
        for f in self.followed.values():
            if skip is not None:
                for p in [p for p in f.table.shares if skip(p)]:
                    f.table.clear(p, self.members)
            self._fetch(f)

    async def table(self, capability: str) -> RouteTable | None:
        """The table of ``capability`` (followed from now on), or None when none could be
        had within ``table_wait_s`` (a broker is asked meanwhile)."""
        now = self.clock()
        f = self.followed.get(capability)
        if f is None:
            table = RouteTable(capability, TableRouting(), self.member)
            f = self.followed[capability] = Followed(table, now)
            try:
                f.sub = await self.nc.subscribe(self.subjects.table_of(capability),
                                                cb=self._on_delta)  # fmt: skip
            except NatsError:
                del self.followed[capability]
                return None
            self._fetch(f)
        f.used_at = now
        if f.table.shares:
            return f.table
        if f.fetching is None and now - f.synced_at >= REFETCH_S:
            self._fetch(f)  # none came last time: a broker may be there now
        if f.fetching is not None:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.config.table_wait_s * 2):
                    await asyncio.shield(f.fetching)
        return f.table if f.table.shares else None

    async def _unfollow(self, capability: str) -> None:
        f = self.followed.pop(capability, None)
        if f is None:
            return
        if f.fetching is not None:
            f.fetching.cancel()
        if f.retry is not None:
            f.retry.cancel()
        f.table.drop(self.members)
        if f.sub is not None:
            with contextlib.suppress(NatsError):
                await f.sub.unsubscribe()

    def _fetch(self, f: Followed) -> None:
        """Ask for ``f``'s table whole (once at a time; a gap meanwhile: again after)."""
        if f.fetching is not None:
            f.resync = True
            return
        f.fetching = asyncio.create_task(self._fetched(f), name="reach-table-fetch")

    async def _fetched(self, f: Followed) -> bool:
        cap = f.table.capability
        seen: set[int] = set()
        try:
            shares, covered = await self._ask(cap)
            if not covered or len(covered) < self.partitions:
                stored = await self._read_store(cap, covered)
                shares += stored
                covered |= {s.partition for s in stored}
            seen = f.covered = covered
            skip = self.skip
            if skip is not None:
                shares = [s for s in shares if not skip(s.partition)]
            now = self.clock()
            table = f.table
            for share in shares:
                table.load(share, self.members, now)
            for p in covered - {s.partition for s in shares}:
                table.clear(p, self.members)
            for delta in f.pending:
                if not table.apply(delta, self.members, now):
                    # Made after what was fetched, and not following it (a new owner's
                    # share, one the answers said nothing of, a gap): the table again.
                    f.resync = True
            return bool(shares or covered)
        except Exception:  # noqa: BLE001 - a fetch never breaks the client
            log.exception("tables.fetch_failed capability=%s", cap)
            return False
        finally:
            f.synced_at = self.clock()
            f.pending = []
            f.fetching = None
            if self.followed.get(cap) is f:
                if f.resync:
                    f.resync = False
                    self._fetch(f)
                elif self.unseen is not None:
                    self._ask_again_if_unseen(f, seen)

    def _ask_again_if_unseen(self, f: Followed, seen: set[int]) -> None:
        """After a fetch: the partitions neither skipped nor ``seen`` (answered for by their
        owner, or read from KV) told, and the table asked for again later (see
        :attr:`unseen`)."""
        assert self.unseen is not None
        skip = self.skip
        unseen = [p for p in range(self.partitions)
                  if p not in seen and (skip is None or not skip(p))]  # fmt: skip
        if f.retry is not None:
            f.retry.cancel()
            f.retry = None
        cap = f.table.capability
        if not unseen:
            if f.asked_again:
                f.asked_again = 0
                self.unseen(cap, [], 0)
            return
        wait = min(REFETCH_S * 2**f.asked_again, self.config.table_resync_s)
        f.asked_again += 1
        self.unseen(cap, unseen, f.asked_again)
        f.retry = asyncio.get_running_loop().call_later(wait, self._fetch, f)

    async def _ask(self, capability: str) -> tuple[list[TableShare], set[int]]:
        """The brokers' answers to ``<p>.tables.<capability>`` until their ``owned`` cover
        every partition, or ``table_wait_s``."""
        inbox = self.nc.new_inbox()
        got: asyncio.Queue[Msg] = asyncio.Queue()
        sub = await self.nc.subscribe(inbox, cb=got.put)
        shares: list[TableShare] = []
        covered: set[int] = set()
        partitions = 0
        try:
            await self.nc.publish(self.subjects.tables(capability), b"", reply=inbox)
            deadline = self.clock() + self.config.table_wait_s
            while partitions == 0 or len(covered) < partitions:
                try:
                    async with asyncio.timeout(max(deadline - self.clock(), 0.0)):
                        msg = await got.get()
                except TimeoutError:
                    break
                if not msg.data:
                    if msg.headers and msg.headers.get("Status") == "503":
                        break  # no responders: no broker is there
                    continue
                try:
                    answer = schema.table_decoder.decode(msg.data)
                except msgspec.MsgspecError:
                    continue  # an error reply, or not a table
                partitions = self.partitions = answer.partitions
                shares += answer.shares
                covered |= set(answer.owned)
        finally:
            with contextlib.suppress(NatsError):
                await sub.unsubscribe()
        return shares, covered

    async def _read_store(self, capability: str, covered: set[int]) -> list[TableShare]:
        """The shares of ``capability`` in KV ``reach_tables`` not in ``covered`` (what
        callers read when no broker answers)."""
        prefix = "$KV.reach_tables."
        try:
            reply = await self.nc.request(
                f"{_API}.STREAM.INFO.{TABLES_STREAM}",
                msgspec.json.encode({"subjects_filter": f"{prefix}*.{capability}"}),
                timeout=self.config.table_wait_s,
            )
            subjects = _stream_info.decode(reply.data).state.subjects
        except (NatsError, msgspec.MsgspecError):
            return []
        out = []
        for subject in subjects:
            p = int(subject[len(prefix) :].partition(".")[0])
            if p in covered:
                continue
            try:
                got = await self.nc.request(f"{_API}.STREAM.MSG.GET.{TABLES_STREAM}",
                                            msgspec.json.encode({"last_by_subj": subject}),
                                            timeout=self.config.table_wait_s)  # fmt: skip
                stored = _msg_get.decode(got.data).message
                if stored is None or _KV_OP.encode() in base64.b64decode(stored.hdrs or ""):
                    continue
                out.append(schema.table_share_decoder.decode(base64.b64decode(stored.data)))
            except (NatsError, msgspec.MsgspecError, ValueError):
                continue
        return out

    async def _on_delta(self, msg: Msg) -> None:
        try:
            delta = schema.table_delta_decoder.decode(msg.data)
        except msgspec.MsgspecError:
            log.debug("tables.delta_undecodable subject=%s", msg.subject)
            return
        f = self.followed.get(delta.capability)
        if f is None or (self.skip is not None and self.skip(delta.partition)):
            return
        if f.fetching is not None:
            f.pending.append(delta)
            return
        if not f.table.apply(delta, self.members, self.clock()):
            self._fetch(f)  # a gap (or a new owner): the table whole again

    async def _upkeep(self) -> None:
        """Tables unused for ``table_idle_s`` unfollowed; the others asked again every
        ``table_resync_s``."""
        cfg = self.config
        while True:
            await asyncio.sleep(min(cfg.table_idle_s, cfg.table_resync_s) / 2)
            now = self.clock()
            for cap, f in list(self.followed.items()):
                try:
                    if now - f.used_at >= cfg.table_idle_s:
                        await self._unfollow(cap)
                    elif now - f.synced_at >= cfg.table_resync_s:
                        self._fetch(f)
                except Exception:  # noqa: BLE001 - the loop never dies
                    log.exception("tables.upkeep_failed capability=%s", cap)
