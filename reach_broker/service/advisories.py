"""The server's connect/disconnect advisories: a ``kill -9`` noticed in milliseconds.

nats-server publishes ``$SYS.ACCOUNT.<acc>.DISCONNECT`` the moment a client connection closes
(socket closed, or ``ping_max`` pings unanswered), with ``client.name`` = the agent's
connection name = ``agent_id``. ``configs/nats-server.conf`` exports these (and the account's
``CONNZ`` request) from the system account to the application account, so the broker sees
them as an ordinary user. The account name is discovered with ``$SYS.REQ.USER.INFO`` (every
user may ask), or taken from ``detection.advisory_account``.

- DISCONNECT of a known agent → ``Registry.disconnected``: ``suspect`` at once; the prober
  then settles it (``no responders`` → ``offline`` at once; no answer → ``offline`` after
  ``probe_timeout_s``; an answer → back to ``healthy``, e.g. a second connection lives).
- CONNECT of a known ``offline``/``suspect`` agent → probe it 250 ms later (its heartbeat
  may be seconds away).
- At start and after the broker reconnects: reconcile with ``CONNZ``: known agents with no
  connection become ``suspect`` (and are probed), e.g. agents restored from a snapshot. On a
  cluster every node answers about its own connections and every answer is gathered
  (:func:`reach_broker.service.clusterinfo.gather`). A partial list would make the agents of
  a node that did not answer look disconnected (a raw agent, which answers no probe, would go
  offline at once): a CONNZ answered by fewer servers than the last one, than the
  connection's server advertises, or (before any whole answer) than hold the replicas of the
  acks stream, is asked again, and if it stays partial nothing is
  reconciled (``advisories.connz_partial``); heartbeats decide. The count to expect is
  lowered only once every CONNZ has been short for a minute (a node removed for good,
  ``clusterinfo.servers_lowered``: :class:`~.clusterinfo.ServerCount`), never by one stopped
  for a while.

Connections that are not named after an agent (Synadia Agent Protocol agents, whose
connections are usually unnamed) are matched by the component that knows them, handed in at
construction (:class:`Unnamed`): every DISCONNECT is also handed to it as (server name,
client id), and the agents it follows are left out of the reconcile.

A server without the import answers ``CONNZ`` with no responders: the broker then says once
in its log that it runs on heartbeats alone, and sets ``reach_disconnect_advisories`` to 0.

The connection name is the client's word; nats-server cannot enforce it. With reach's
credentials the user JWT's ``name`` is the agent id it was issued for, and the server reports
that JWT in every advisory (``client.jwt``) and in ``CONNZ`` (``{"auth": true}``): a
connection is taken as agent X's only when its name and its JWT's name are both X. One that
claims a known agent's name with another's JWT is ignored and counted
(``reach_dropped_total{kind="advisory",reason="name_mismatch"}``).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Protocol

import msgspec
from nats.aio.msg import Msg
from nats.errors import NoRespondersError

from jetstream.names import ACK_STREAM
from reach_agent.connection import flush_subscriptions
from reach_agent.grants import jwt_name
from reach_broker.config import DetectionSection
from reach_broker.core.registry import Registry

from .clusterinfo import Account, ServerCount, connz_subject, gather, server_of
from .context import BrokerContext
from .probes import Prober

log = logging.getLogger(__name__)


def disconnect_subject(account: str) -> str:
    return f"$SYS.ACCOUNT.{account}.DISCONNECT"


def connect_subject(account: str) -> str:
    return f"$SYS.ACCOUNT.{account}.CONNECT"


CONNZ_PAGE = 1024
"""Connections per CONNZ page (the server's default limit)."""

CONNZ_MAX_PAGES = 1000
"""Bound of the reconcile loop (a million connections)."""

REQUEST_TIMEOUT_S = 2.0

PARTIAL_TRIES = 3
"""A CONNZ that a server of the cluster did not answer is asked this many times in all
(a server just started or reconnected may not route every account's replies yet)."""
PARTIAL_PAUSE_S = 1.0
"""Between those tries."""

CONNECT_PROBE_DELAY_S = 0.25
"""A known offline agent that connects is probed this long after its CONNECT advisory."""

CLOSED_MAX = 10_000
"""Closed connections of agents this broker does not hold, remembered (the oldest forgotten
beyond): about 1 MB."""


class _Client(msgspec.Struct):
    name: str = ""
    acc: str = ""
    id: int = 0
    """The connection's client id (cid) on its server."""
    jwt: str = ""


class _Server(msgspec.Struct):
    name: str = ""
    id: str = ""


class _Advisory(msgspec.Struct):
    client: _Client = msgspec.field(default_factory=_Client)
    server: _Server = msgspec.field(default_factory=_Server)
    reason: str = ""


class Unnamed(Protocol):
    """The connections not named after an agent, followed by another component (the Synadia
    Agent Protocol agents')."""

    def on_closed(self, server: str, cid: int) -> None:
        """A DISCONNECT: (server name, client id) of the connection that closed."""

    def followed(self) -> set[str]:
        """The agents whose connections it follows (not judged by name)."""


class _NoneUnnamed:
    def on_closed(self, server: str, cid: int) -> None:
        return None

    def followed(self) -> set[str]:
        return set()


class _Conn(msgspec.Struct):
    name: str = ""
    jwt: str = ""


class _Connz(msgspec.Struct):
    total: int = 0
    offset: int = 0
    num_connections: int = 0
    connections: list[_Conn] = []


class _ConnzReply(msgspec.Struct):
    data: _Connz | None = None


_advisory_decoder = msgspec.json.Decoder(_Advisory)
_connz_decoder = msgspec.json.Decoder(_ConnzReply)
_encoder = msgspec.json.Encoder()


class Advisories:
    """Subscribes to the advisories and reconciles the registry with the server's view."""

    def __init__(self, ctx: BrokerContext, registry: Registry, prober: Prober, account: Account,
                 cfg: DetectionSection, *, unnamed: Unnamed | None = None, closed_kept_s: float,
                 seen: Any, dropped: Any, refused: Any) -> None:  # fmt: skip
        """``closed_kept_s``: how long a closed connection of an agent this broker does not
        hold is remembered (:meth:`restored`); ``seen``: ``reach_disconnect_advisories``;
        ``dropped``, ``refused``: ``reach_dropped_messages_total``,
        ``reach_dropped_total``."""
        self.ctx, self.cfg = ctx, cfg
        self.registry = registry
        self.prober = prober
        self.account = account
        """The account whose advisories are followed (learnt at start)."""
        self.unnamed: Unnamed = unnamed or _NoneUnnamed()
        """Who follows the connections that are not named after an agent."""
        self._seen, self._dropped, self._refused = seen, dropped, refused
        self.available = False
        """True once the server answered CONNZ for our account (or an advisory arrived)."""
        self.disconnects = 0
        self.closed: dict[str, float] = {}
        """Agents this broker did not hold whose connection closed (a DISCONNECT), when, and
        not connected since (no CONNECT): oldest first, at most :data:`CLOSED_MAX`. Their
        owner judged them; but one whose partition had no owner then (its broker gone, its
        lease not yet lapsed; a hand-over under way) is judged by whoever takes it here."""
        self.closed_kept_s = closed_kept_s
        self.count = ServerCount(ACK_STREAM)
        """Servers that answered the last whole CONNZ (every node of a cluster): the next
        one answered by fewer is partial, until answers have been short for a minute."""
        self.answers = 0
        """CONNZ lists obtained (the observer's proof that the broker's link works)."""
        self._subs: list[Any] = []
        self._started = False
        self._said_unavailable = False

    async def start(self) -> None:
        if self._started:
            return
        self._started = True
        cfg = self.cfg
        self._seen.set(0)
        if not cfg.advisories:
            log.info("advisories.disabled detection.advisories=false: heartbeats alone")
            return
        nc = self.ctx.nc
        acc = await self.account.learn(nc, cfg.advisory_account) or "*"
        self._subs = [
            await nc.subscribe(disconnect_subject(acc), cb=self._on_disconnect),
            await nc.subscribe(connect_subject(acc), cb=self._on_connect),
        ]
        await flush_subscriptions(nc)  # a single flush() may overtake the SUBs (nats-py)
        await self.reconcile()

    async def stop(self) -> None:
        if not self._started:
            return
        self._started = False
        for sub in self._subs:
            try:
                await sub.unsubscribe()
            except Exception:  # a closed connection must not block shutdown
                log.debug("advisories.stop unsubscribe failed", exc_info=True)
        self._subs = []

    # --- reconcile -----------------------------------------------------------------------

    async def reconcile(self) -> int:
        """Known agents without a connection become suspect; returns how many. Idempotent."""
        if not self._started or not self._subs:
            return 0
        names = await self._connection_names()
        if names is None:
            return 0
        transitions = self.registry.reconcile(names | self.unnamed.followed(), self.ctx.clock())
        if transitions:
            log.info("advisories.reconciled connected=%d suspect=%d", len(names), len(transitions))
            self.ctx.emit(transitions)
        return len(transitions)

    async def _connection_names(self) -> set[str] | None:
        """Names of the account's live connections on every server of the cluster, or None
        when no server will say or some server did not answer (asked again
        ``PARTIAL_TRIES`` times first)."""
        account = self.account.name
        if account is None:
            self._unavailable("account unknown ($SYS.REQ.USER.INFO did not answer)")
            return None
        subject = connz_subject(account)
        for attempt in range(1, PARTIAL_TRIES + 1):
            listed = await self._listed(subject)
            if listed is None:
                return None
            names, servers = listed
            missing = await self.count.missing(self.ctx.nc, len(servers))
            if not missing:
                break
            if attempt < PARTIAL_TRIES:
                await asyncio.sleep(PARTIAL_PAUSE_S)
        self.answers += 1
        self._available()
        if not self.count.settle(len(servers), missing, self.ctx.clock()):
            # The agents of a server that did not answer would look disconnected: a raw agent
            # (no probe responder) would go offline at once. Not reconciled; their heartbeats
            # decide.
            log.warning("advisories.connz_partial %s answered by %d of %d servers (%s) in %d "
                        "tries: not reconciled", subject, len(servers), len(servers) + missing,
                        ",".join(sorted(servers)), PARTIAL_TRIES)  # fmt: skip
            return None
        return names

    async def _listed(self, subject: str) -> tuple[set[str], set[str]] | None:
        """One CONNZ, every page: (connection names, servers that answered its first page),
        or None when no server will say."""
        names: set[str] = set()
        first: set[str] | None = None
        offset = 0
        for _ in range(CONNZ_MAX_PAGES):
            body = _encoder.encode({"offset": offset, "limit": CONNZ_PAGE, "auth": True})
            try:
                replies = await gather(self.ctx.nc, subject, body, timeout_s=REQUEST_TIMEOUT_S)
            except NoRespondersError:
                replies, why = [], "NoRespondersError"
            else:
                why = "TimeoutError"
            if not replies and why == "TimeoutError":
                # Slow is not missing: the server (or this broker) is busy; asked again at
                # the next reconcile, and the advisories themselves may well flow.
                log.warning("advisories.connz_timeout %s not answered within %g s: "
                            "reconciled later", subject, REQUEST_TIMEOUT_S)  # fmt: skip
                return None
            if not replies:
                self._unavailable(f"{subject} not answered ({why})")
                return None
            more = False
            servers = set()
            for msg in replies:
                try:
                    data = _connz_decoder.decode(msg.data).data
                except msgspec.DecodeError as exc:
                    self._unavailable(f"{subject} answered something else ({exc})")
                    return None
                if data is None:
                    continue
                servers.add(server_of(msg))
                names.update(c.name for c in data.connections if self._is_named(c.name, c.jwt))
                # Each server pages its own list: ask again while any has more.
                more = more or (
                    bool(data.connections) and offset + len(data.connections) < data.total
                )
            if not servers:
                self._unavailable(f"{subject} answered without data")
                return None
            if first is None:
                first = servers
            if not more:
                break
            offset += CONNZ_PAGE
        return names, first or set()

    def _available(self) -> None:
        if not self.available:
            self.available = True
            self._seen.set(1)
            log.info("advisories.enabled account=%s: disconnects detected at once",
                     self.account.name)  # fmt: skip

    def _unavailable(self, why: str) -> None:
        if not self._said_unavailable:
            self._said_unavailable = True
            log.warning(
                "advisories.unavailable %s: the server does not export connect/disconnect "
                "advisories to this account; failure detection runs on heartbeats alone "
                "(see configs/nats-server.conf)",
                why,
            )

    # --- advisories ----------------------------------------------------------------------

    def _is_named(self, name: str, jwt: str) -> bool:
        """Whether a connection called ``name`` may be taken as agent ``name``'s: no user JWT
        (open mode), or one issued for that name."""
        if not name:
            return False
        if not jwt or jwt_name(jwt) == name:
            return True
        if name in self.registry.agents:
            self._refused.labels("advisory", "name_mismatch").inc()
            log.warning("advisories.name_mismatch connection=%s jwt_name=%s: not taken as the "
                        "agent's connection", name, jwt_name(jwt))  # fmt: skip
        return False

    def _advisory(self, msg: Msg) -> _Advisory | None:
        """The advisory; a broken one is dropped and counted."""
        try:
            adv = _advisory_decoder.decode(msg.data)
        except msgspec.DecodeError:
            self._dropped.labels("advisory", "invalid").inc()
            self._refused.labels("advisory", "invalid").inc()
            return None
        self._available()
        return adv

    def _client_name(self, msg: Msg) -> str | None:
        """The agent an advisory is about, if any (None: unnamed, a name its JWT does not
        bear, or broken)."""
        adv = self._advisory(msg)
        return self._named(adv) if adv is not None else None

    def _named(self, adv: _Advisory) -> str | None:
        client = adv.client
        return client.name if self._is_named(client.name, client.jwt) else None

    async def _on_disconnect(self, msg: Msg) -> None:
        adv = self._advisory(msg)
        if adv is None:
            return
        try:
            self.unnamed.on_closed(adv.server.name or adv.server.id, adv.client.id)
        except Exception:  # noqa: BLE001 - it never breaks the broker
            log.exception("advisories.unnamed failed cid=%d", adv.client.id)
        name = self._named(adv)
        if name is None:
            return
        now = self.ctx.clock()
        transitions = self.registry.disconnected(name, now)
        if transitions:
            self.disconnects += 1
            self.ctx.emit(transitions)
        elif name not in self.registry.agents:
            closed = self.closed
            closed.pop(name, None)  # (to the end: oldest first)
            closed[name] = now
            if len(closed) > CLOSED_MAX:
                del closed[next(iter(closed))]

    def restored(self, agent_ids: list[str]) -> None:
        """Agents a takeover restored, now heard: one whose connection closed while this
        broker did not hold it, within ``closed_kept_s`` and with no CONNECT since, is
        disconnected now, as if told then (suspect, and the prober settles it). Its stored
        state said nothing of it: an agent killed while its partition changed hands was
        restored ``healthy`` and judged by no broker until its silence ran out. O(restored)."""
        closed = self.closed
        if not closed:
            return
        now = self.ctx.clock()
        transitions = []
        for agent_id in agent_ids:
            at = closed.pop(agent_id, None)
            if at is not None and now - at <= self.closed_kept_s:
                transitions += self.registry.disconnected(
                    agent_id, now, "connection closed while its partition changed owner"
                )
        if transitions:
            self.disconnects += len(transitions)
            log.info("advisories.closed_at_takeover agents=%d: their connections closed "
                     "while no broker here held them", len(transitions))  # fmt: skip
            self.ctx.emit(transitions)

    async def _on_connect(self, msg: Msg) -> None:
        name = self._client_name(msg)
        if name is None:
            return
        self.closed.pop(name, None)
        rec = self.registry.agents.get(name)
        if rec is not None and rec.state in ("offline", "suspect"):
            # A moment's grace: the agent subscribes to its probe subject after connecting.
            self.prober.schedule(name, self.ctx.clock() + CONNECT_PROBE_DELAY_S)

    def on_reconnected(self) -> None:
        """The broker's own connection came back: advisories may have been missed."""
        if self._started and self._subs:
            self.ctx.spawn(self.reconcile(), "advisories-reconcile")
