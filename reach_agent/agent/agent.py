"""The agent side: an identity with capabilities and handlers, wired to NATS.

One NATS connection named after the agent id (the broker keys the server's disconnect
advisories on it, and with reach's credentials takes a connection as the agent's only when
its user JWT was issued for that id; what its callbacks tell is
:class:`~reach_agent.agent.connwatch.ConnectionWatch`'s). Two parts do the work:
:class:`~reach_agent.agent.presence.Presence` (announce, heartbeat, probe answers, leave) and
:class:`~reach_agent.agent.serving.TaskServer` (admission, execution, replies, ack records; the
decision itself is :mod:`~reach_agent.agent.admission`'s, the duplicate window
:mod:`~reach_agent.agent.dedup`'s, the fleet-wide claim of a request id
:mod:`~reach_agent.agent.claiming`'s). This module validates the agent,
registers handlers and runs the lifecycle: start (connect, subscribe, announce) and stop
(drain: refuse new tasks, leave, finish in-flight ones within the grace period, close).

The durable-ack hook: ``Agent(ack_sink=...)`` takes any object with
``async def record(rec: schema.AckRecord) -> None`` (and optional ``async start()`` /
``async stop()``, called when the agent starts and after it drained); see
:mod:`~reach_agent.agent.serving` for what it receives. Without one the agent uses the JetStream
``AckWriter`` (:func:`reach_agent.agent.ackwriter.default_ack_writer`), with the agent's servers and
credentials; ``durable_acks=False`` turns acks off.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from typing import Any, Unpack

from nats.aio.client import Client as NATS

from reach_agent import otel
from reach_agent.connection import (
    CredentialOptions,
    Credentials,
    connect,
    connect_options,
    drain_or_close,
    flush_subscriptions,
    resolve,
)
from reach_agent.metrics import AgentMetrics
from reach_agent.wire import schema
from reach_agent.wire.errors import InvalidRequest
from reach_agent.wire.subjects import DEFAULT_PREFIX, Subjects

from . import ackwriter
from .claiming import Claimer
from .connwatch import ConnectionWatch
from .dedup import DedupCache
from .handling import Handler, kind_of
from .presence import READINESS_INTERVAL_S, Presence
from .serving import CANCEL_GRACE_S, AckSink, TaskServer

log = logging.getLogger(__name__)

__all__ = ["AckSink", "Agent", "Handler"]

FIRST_ANNOUNCE_WAIT_S = 2.0
"""How long ``start()`` waits for the first announce attempt (one request) to end."""


class Agent:
    """An agent: its identity and capabilities, its handlers, and the wiring to NATS.

    ``heartbeat_interval`` and ``timeout_hint`` are seconds; ``grace`` is how long a drain
    waits for in-flight tasks; ``dedup_size``/``dedup_ttl`` bound the cache of recent
    results that makes a repeated request id answer with the first result (the duplicate
    window: 2 min by default). Across the fleet a request id runs once: each task is claimed
    in KV ``reach_claims`` first, and refused (``STORE_UNAVAILABLE``, retryable) while the
    bucket is missing or does not answer, never run unclaimed (``claims=False`` turns claims
    off for the whole agent; capabilities in ``idempotent``, or handlers registered with
    ``idempotent=True``, skip them because their duplicates are harmless; ``claim_timeout``
    bounds the claim's round trip). ``creds``,
    ``nkey_seed``, ``user``/``password``, ``token``
    and ``tls_ca``/``tls_cert``/``tls_key`` are the connection's credentials (see
    :class:`~reach_agent.connection.Credentials`; ``token`` is the NATS auth token, not the
    broker's heartbeat token :attr:`token`). A file that does not exist is a ``ValueError``.
    ``permissions`` (what callers may ``require``) and ``context_window`` (tokens) are
    announced; set :attr:`context_usage_pct` as the window fills. ``readiness`` (an
    adapter's check of the service it fronts, ``async () -> bool``) is asked every
    ``readiness_interval`` seconds: while it says False the agent reports ``draining`` and
    refuses tasks with ``DRAINING`` (see :mod:`~reach_agent.agent.presence`). A cancelled
    request's handler sees ``asyncio.CancelledError`` and has ``cancel_grace`` seconds to
    clean up before it is cancelled again (see :mod:`~reach_agent.agent.serving`).
    """

    def __init__(
        self,
        agent_id: str,
        capabilities: Sequence[str],
        max_concurrency: int = 8,
        *,
        region: str | None = None,
        tags: dict[str, str] | None = None,
        version: str | None = None,
        heartbeat_interval: float = 5.0,
        timeout_hint: float | None = None,
        agent_type: str | None = None,
        metadata: dict[str, Any] | None = None,
        prefix: str = DEFAULT_PREFIX,
        grace: float = 30.0,
        dedup_size: int = 10_000,
        dedup_ttl: float = 120.0,
        announce_refresh: float = 600.0,
        ack_sink: AckSink | None = None,
        metrics: AgentMetrics | None = None,
        durable_acks: bool = True,
        ack_wal_dir: str | None = None,
        idempotent: Iterable[str] = (),
        claims: bool = True,
        claim_timeout: float = 2.0,
        permissions: Iterable[str] = (),
        context_window: int | None = None,
        readiness: Callable[[], Awaitable[bool]] | None = None,
        readiness_interval: float = READINESS_INTERVAL_S,
        cancel_grace: float = CANCEL_GRACE_S,
        **credentials: Unpack[CredentialOptions],
    ) -> None:
        schema.check_agent_id(agent_id)
        caps = list(capabilities)
        if not caps:
            raise InvalidRequest("capabilities is empty: an agent needs at least one")
        for i, cap in enumerate(caps):
            schema.check_capability(cap, f"capabilities[{i}]")
        if len(set(caps)) != len(caps):
            raise InvalidRequest(f"capabilities {caps!r} lists a capability twice")
        if max_concurrency < 1:
            raise InvalidRequest(f"max_concurrency {max_concurrency!r} must be at least 1")
        if heartbeat_interval < 0.05:
            raise InvalidRequest(f"heartbeat_interval {heartbeat_interval!r} is below 0.05 s")
        idem = {idempotent} if isinstance(idempotent, str) else set(idempotent)
        unknown = sorted(idem - set(caps))
        if unknown:
            raise InvalidRequest(f"idempotent {unknown!r} are not among the capabilities {caps!r}")
        if not cancel_grace >= 0:
            raise InvalidRequest(f"cancel_grace {cancel_grace!r} must be 0 or more seconds")
        if not readiness_interval > 0:
            raise InvalidRequest(f"readiness_interval {readiness_interval!r} must be positive")
        if not claim_timeout > 0:
            raise InvalidRequest(f"claim_timeout {claim_timeout!r} must be a positive number")
        self.credentials = Credentials(**credentials).check()
        """How the agent's connections (its own, its ack writer's) authenticate; unset
        fields come from the environment (``NATS_CREDS``, ...) at connect time."""
        self.agent_id = agent_id
        self.capabilities = caps
        self.max_concurrency = max_concurrency
        self.prefix = prefix
        self.subjects = Subjects(prefix)
        self.grace = grace
        self.dedup_size = dedup_size
        self.dedup_ttl = dedup_ttl
        self.announce_refresh = announce_refresh
        self.metrics = metrics
        # Without an explicit ack_sink, acks go to REACH_ACKS through a write-ahead
        # AckWriter (WAL in ack_wal_dir, else $REACH_ACK_DIR/<agent_id> or
        # ~/.cache/reach/<agent_id>), created at start with the agent's servers.
        self.durable_acks = durable_acks
        self.ack_wal_dir = ack_wal_dir
        self.claims = claims
        self.claim_timeout = claim_timeout
        self.instance = secrets.token_hex(8)
        """This process (random per process): its announces' ``instance_id`` and the claims
        it holds name it, so a restart of the agent knows which claims its dead predecessor
        left running, and a broker that accepts the restart releases them. (Two randoms
        before: a broker never matched a replaced process's claims to its announce, and
        such a claim learnt after the restart stayed running: nemesis seed 46, 60 s.)"""
        self.announcement = schema.Announce(
            agent_id=agent_id,
            capabilities=caps,
            max_concurrency=max_concurrency,
            heartbeat_interval_ms=int(heartbeat_interval * 1000),
            agent_type=agent_type,
            version=version,
            region=region,
            tags=dict(tags or {}),
            timeout_hint_ms=int(timeout_hint * 1000) if timeout_hint else None,
            metadata=dict(metadata or {}),
            instance_id=self.instance,  # its claims name the same process (protocol.md)
            permissions=list(permissions),
            context_window=context_window,
        )
        schema.validate_announce(self.announcement, agent_id)
        self.ack_sink = ack_sink
        """Where ack records go: the one given, else (``durable_acks``) the JetStream writer
        made at the first start."""
        self.tasks = TaskServer(
            agent_id, max_concurrency, self.subjects, dedup=DedupCache(dedup_size, dedup_ttl),
            metrics=metrics, spans=otel.spans("reach-agent"), cancel_grace=cancel_grace,
        )  # fmt: skip
        """The task side: admission, claims, execution, replies, ack records (and, with
        ``OTEL_EXPORTER_OTLP_ENDPOINT`` set, their spans: :mod:`.otel`)."""
        self.tasks.idempotent |= idem
        self.presence = Presence(
            self.announcement, self.subjects, self.tasks,
            heartbeat_interval=heartbeat_interval, announce_refresh=announce_refresh,
            readiness=readiness, readiness_interval=readiness_interval,
        )  # fmt: skip
        """Announce, heartbeats, probe answers, leave."""
        self.nc: NATS | None = None
        self._started = False
        self.watch = ConnectionWatch(agent_id, self.subjects, metrics, lambda: self._started,
                                     self.presence.reannounce)  # fmt: skip
        """The connection's callbacks: grants, permission violations, a close for good
        (``watch.closed``, ``watch.closed_reason``: :func:`reach_agent.run` then exits),
        reconnect."""

    # --- what the parts know ------------------------------------------------------------

    @property
    def token(self) -> str | None:
        """The heartbeat token of the last announce reply (None until a broker answered)."""
        return self.presence.token

    @property
    def broker_id(self) -> str | None:
        return self.presence.broker_id

    @property
    def heartbeat_interval(self) -> float:
        return self.presence.heartbeat_interval

    @property
    def seq(self) -> int:
        return self.presence.seq

    @property
    def draining(self) -> bool:
        return self.tasks.draining

    @property
    def active(self) -> int:
        return self.tasks.active

    @property
    def ok_total(self) -> int:
        return self.tasks.ok_total

    @property
    def fail_total(self) -> int:
        return self.tasks.fail_total

    def status(self) -> schema.AgentStatus:
        return self.tasks.status()

    def queue_depth(self) -> int:
        """Task messages received by the connection but not yet looked at."""
        return self.tasks.queue_depth()

    def load_figures(self) -> tuple[int | None, int | None]:
        """(median task duration ms of the tasks finished since the last heartbeat — else
        the previous heartbeat's —, age ms of the oldest running task)."""
        return self.tasks.load_figures()

    @property
    def context_usage_pct(self) -> float | None:
        """How full the context window is (0-100), sent with every heartbeat: brokers route
        ``min_context_tokens`` requests by the headroom ``context_window x (1 - usage)``."""
        return self.presence.context_usage_pct

    @context_usage_pct.setter
    def context_usage_pct(self, value: float | None) -> None:
        if value is not None and not 0 <= value <= 100:
            raise InvalidRequest(f"context_usage_pct {value!r} is not between 0 and 100")
        self.presence.context_usage_pct = value

    def heartbeat(self) -> schema.Heartbeat:
        """The next heartbeat (advances ``seq``)."""
        return self.presence.heartbeat()

    # --- handlers ---------------------------------------------------------------------

    def handler(
        self, capability: str, *, idempotent: bool | None = None
    ) -> Callable[[Handler], Handler]:
        """Register the handler of ``capability``: ``async def f(task) -> result``, a plain
        function (run in a worker thread), or an async generator (``async def f(task):
        yield chunk``: a streamed answer). Results and chunks must be JSON-serializable.
        ``idempotent=True`` runs it without a fleet-wide claim (``False``: with one, also
        when the agent's ``idempotent`` names it)."""
        if capability not in self.capabilities:
            raise InvalidRequest(
                f"capability {capability!r} is not among this agent's {self.capabilities!r}"
            )

        def register(fn: Handler) -> Handler:
            self.tasks.handlers[capability] = (fn, kind_of(fn))
            if idempotent is not None:
                (self.tasks.idempotent.add if idempotent else self.tasks.idempotent.discard)(
                    capability
                )
            return fn

        return register

    # --- lifecycle ----------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def serve(
        self, servers: str | Sequence[str] | None = None, credentials: Credentials | None = None
    ) -> AsyncIterator[Agent]:
        """``async with agent.serve():`` serves until the block ends, then drains."""
        await self.start(servers, credentials)
        try:
            yield self
        finally:
            await self.stop()

    async def start(
        self,
        servers: str | Sequence[str] | None = None,
        credentials: Credentials | None = None,
        *,
        stop: asyncio.Event | None = None,
    ) -> None:
        """Connect, subscribe, start announcing. ``servers`` defaults to ``NATS_URL`` or
        ``nats://127.0.0.1:4222``; ``credentials`` set here win over the agent's own. The
        first connect waits for a server as long as it takes, logging each failed attempt
        (``agent.connect_failed``); ``stop`` set meanwhile (a signal) ends the wait with
        :class:`~reach_agent.connection.NotConnected`."""
        if self._started:
            return
        missing = [c for c in self.capabilities if c not in self.tasks.handlers]
        if missing:
            raise InvalidRequest(f"capabilities {missing!r} have no handler")
        if self.ack_sink is None and self.durable_acks:
            ackwriter.check_ack_dir(self.agent_id, self.ack_wal_dir)  # one clear error, now
        cred = self.credentials if credentials is None else credentials.over(self.credentials)
        servers, cred = resolve(servers, cred)  # explicit, NATS_* and the NATS context
        options = connect_options(self.agent_id, servers, cred)
        writes_acks = self.ack_sink is None and self.durable_acks
        self.watch.check_grants(cred, self.capabilities, writes_acks=writes_acks)
        self.watch.violations.clear()
        self.tasks.draining = False
        nc = NATS()
        await connect(nc, {**options, **self.watch.callbacks()}, what=f"agent {self.agent_id!r}",
                      stop=stop)  # fmt: skip
        self.nc = self.watch.nc = nc
        try:
            await self._setup(nc, servers, cred)
        except BaseException:
            self.tasks.forget_subscriptions()
            await nc.close()
            raise
        self._started = True
        await self._first_announce()
        log.info("agent.started agent=%s capabilities=%s", self.agent_id, self.capabilities)

    async def _first_announce(self) -> None:
        """Wait for the first announce attempt; a CONFLICT (another live process holds this
        agent_id) is a start error. No broker yet is not: announcing goes on meanwhile."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.presence.first_answer.wait(), FIRST_ANNOUNCE_WAIT_S)
        conflict = self.presence.conflict
        if conflict is not None:
            await self.stop(grace=0.0)
            raise conflict

    async def _setup(self, nc: NATS, servers: list[str], cred: Credentials) -> None:
        if self.ack_sink is None and self.durable_acks:
            self.ack_sink = ackwriter.default_ack_writer(
                self.agent_id, servers, prefix=self.prefix, credentials=cred,
                wal_dir=self.ack_wal_dir,
            )  # fmt: skip
        sink = self.ack_sink
        if sink is not None and hasattr(sink, "start"):
            await sink.start()
        claimer = None
        if self.claims:
            claimer = Claimer(nc, self.agent_id, self.instance, self.subjects,
                              timeout_s=self.claim_timeout, metrics=self.metrics,
                              unsent=getattr(sink, "final_unsent", lambda rid: None))  # fmt: skip
            await claimer.start()
        await self.presence.subscribe(nc)
        await self.tasks.subscribe(nc, self.capabilities, claimer=claimer, ack_sink=sink,
                                   cancels=self.watch.takes_cancels)  # fmt: skip
        await flush_subscriptions(nc)  # a refused SUB is reported before the PONG
        self.watch.check_subscriptions()
        await self.presence.start()

    async def stop(self, grace: float | None = None) -> None:
        """Drain: answer DRAINING to new tasks, leave, finish in-flight tasks within
        ``grace`` (default: the agent's), then close the connection."""
        if not self._started:
            return
        self._started = False
        grace = self.grace if grace is None else grace
        nc = self.nc
        assert nc is not None
        self.tasks.draining = True
        await self.presence.leave()
        await self.tasks.drain(grace)
        if self.tasks.claimer is not None:
            await self.tasks.claimer.stop()  # claim ends the store has not confirmed yet
        await self.presence.stop()
        sink = self.ack_sink
        if sink is not None and hasattr(sink, "stop"):
            try:
                # Bounded: acks not yet stored stay in the sink's write-ahead file.
                async with asyncio.timeout(10.0):
                    await sink.stop()
            except Exception:  # closing must go on
                log.exception("agent.ack_sink_stop_failed agent=%s", self.agent_id)
        await drain_or_close(nc, 5.0)
        self.tasks.close()
        if self.tasks.spans is not None:
            await asyncio.to_thread(self.tasks.spans.flush)
        log.info("agent.stopped agent=%s ok=%d fail=%d", self.agent_id, self.ok_total,
                 self.fail_total)  # fmt: skip
