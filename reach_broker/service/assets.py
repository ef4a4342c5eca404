"""The broker's JetStream assets: provisioned with their replica count at start, their
replicas kept while it runs, and the token secret all replicas share.

``[jetstream] replicas`` sets ``num_replicas`` of every stream and of the KV bucket; unset,
it is 3 when the server reports a cluster of three or more nodes
(:func:`reach_broker.service.clusterinfo.cluster_size`), else 1. Provisioning
(:mod:`jetstream.provision`) moves an existing asset to that count in place: the server
copies its data to the new peers, nothing is re-created.

**Replicas kept** (:class:`ReplicaKeeper`). A count worked out from the nodes answering never
lowers a stream's, and a raise the cluster cannot place is left short
(``reach_jetstream_replicas_short{stream}``): both keep the broker serving while a node is
down. So every :data:`KEEP_EVERY_S` the broker works the count out again and raises each
stream that has fewer, as soon as the cluster can place them: a cluster first provisioned
while one of its three nodes was down (counted as two: R1 assets) gets R3 assets once the
node is back, and a stream left short is raised without waiting for a broker's next start.
It never lowers one while it runs.

Right after an R3 asset is created its Raft group elects a leader; until then a request on
it may meet "no responders" or a timeout. The token secret is therefore read or created
with a few retries rather than replaced by a random one at the first refusal, which would
leave replicas unable to verify each other's tokens.

Right after a server (re)starts, or while a cluster has no meta leader, JetStream answers
503 "temporarily unavailable" or not at all: the broker's start is then tried again after
each wait of :data:`START_RETRY_S` (:func:`jetstream_not_ready` says which errors), and
fails with the last error only when JetStream is still not ready after them all.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from dataclasses import dataclass
from typing import Any

from nats.aio.client import Client as NATS
from nats.js.errors import ServiceUnavailableError

from jetstream.names import (
    COMP_STREAM,
    PARTITIONS_STREAM,
    REGISTRY_BUCKET,
    STREAM_NAMES,
    TOKEN_SECRET_KEY,
)
from jetstream.provision import (
    JetStreamUnavailable,
    Outcome,
    ProvisionTimeout,
    ensure_stream,
    load_definitions,
    provision,
    say_replicas,
)
from reach_agent.aio import stop_loops
from reach_agent.wire.subjects import Subjects

from .clusterinfo import account_of, cluster_size

log = logging.getLogger(__name__)

SECRET_TRIES = 20
SECRET_RETRY_S = 0.25
START_RETRY_S = (0.5, 1.0, 2.0, 4.0, 8.0, 8.0, 8.0)
"""The waits between start attempts while JetStream is not ready: 31.5 s in all (a
restarted node rejoins and a meta leader is elected well within it, even on a busy
machine), then the start fails."""
KEEP_EVERY_S = 30.0
"""How often a running broker works the replica count out again and raises a stream that has
fewer (:class:`ReplicaKeeper`)."""
SHORT_UNTIL = f"until the cluster can place them (tried again every {KEEP_EVERY_S:g}s)"
"""Until when a stream left short keeps what it has (:func:`jetstream.provision.say_replicas`)."""


@dataclass(frozen=True, kw_only=True)
class Provisioning:
    """What the start-up reads of the config, each value from its own section."""

    replicas: int | None
    """``[jetstream] replicas`` (None: 3 on a cluster of three or more nodes, else 1)."""
    advisory_account: str | None
    """``[detection] advisory_account``: the account whose cluster is counted (None: ours)."""
    max_entries: int
    """``[compensation] max_entries``: the compensation stream's bound."""
    lease_ttl_s: float
    """``[fleet] lease_ttl_s``: the partition leases' max age."""
    token_secret: str | None
    """``[broker] token_secret`` (None: one shared through KV ``reach_registry``)."""


def jetstream_not_ready(exc: BaseException) -> bool:
    """Whether ``exc`` says JetStream is not ready yet rather than absent or refusing: its
    503 (nats-py also raises it for "no responders" on the JetStream API once connected),
    a request not answered in time, a provisioning timeout (:class:`NotReady`, no peer for
    a replica yet). "Not enabled" (:class:`JetStreamUnavailable`) is not: the broker then
    runs without JetStream, as it says."""
    return isinstance(exc, (ServiceUnavailableError, TimeoutError, ProvisionTimeout))


async def counted_replicas(nc: NATS, plan: Provisioning) -> tuple[int, int]:
    """``[jetstream] replicas``, else 3 on a cluster of three or more nodes, else 1; and the
    nodes counted (0: configured, none counted)."""
    if plan.replicas is not None:
        return plan.replicas, 0
    account = plan.advisory_account or await account_of(nc)
    size = await cluster_size(nc, account)
    return (3 if size >= 3 else 1), size


async def replicas(nc: NATS, plan: Provisioning) -> int:
    """:func:`counted_replicas`, logged."""
    n, size = await counted_replicas(nc, plan)
    if size:
        log.info("jetstream.replicas %d (cluster of %d node(s); set [jetstream] replicas to "
                 "choose)", n, size)  # fmt: skip
    return n


async def provision_assets(
    nc: NATS, plan: Provisioning, subjects: Subjects, keeper: ReplicaKeeper
) -> int | None:
    """Create or update the JetStream assets (jetstream/definitions) before any use; the
    replica count, or None when the server has no JetStream (the broker then runs without
    snapshot and replay). A definition that would lose data if applied raises. The count
    worked out from the nodes answering (``[jetstream] replicas`` unset) never lowers a
    stream's: a node down at a start must not take R3 assets to R1. A raise the cluster
    cannot place now is left to ``keeper``, told of the count and of each stream's outcome
    (:meth:`ReplicaKeeper.provisioned`: said, and ``reach_jetstream_replicas_short{stream}``
    set to what a stream lacks)."""
    try:
        n = await replicas(nc, plan)
        overrides: dict[str, dict[str, object]] = {
            name: {"num_replicas": n} for name in STREAM_NAMES
        }
        overrides[COMP_STREAM]["max_msgs"] = plan.max_entries
        # The leases age out with their time to live; the server refuses a duplicate window
        # longer than the max age (a lease of less than 2 s), and leases need none beyond it.
        lease_ns = int(plan.lease_ttl_s * 1e9)
        overrides[PARTITIONS_STREAM] |= {
            "max_age": lease_ns,
            "duplicate_window": min(lease_ns, 2_000_000_000),
        }
        defs = load_definitions(subjects, overrides)
        # Idempotent: a timeout (a cluster electing) is tried again by the broker's start.
        # It logs each stream created or updated, once.
        outcomes = await provision(nc, defs, least_replicas=plan.replicas is None)
        keeper.provisioned(n, outcomes)
        for outcome in outcomes:
            changed = [c for c in outcome.changes if c.startswith("max_age")]
            if outcome.name == PARTITIONS_STREAM and changed:
                # The bucket's max age is every broker's lease time: another broker started
                # with a longer lease_ttl_s renews a third of it apart and loses its leases.
                log.warning("partitions.lease_ttl_changed %s: the leases bucket now ages every "
                            "lease out after this broker's [fleet] lease_ttl_s (%gs); every "
                            "broker of a fleet must run the same lease_ttl_s, or one with a "
                            "longer one loses its partitions to the others while it still "
                            "serves them", changed[0], plan.lease_ttl_s)  # fmt: skip
    except JetStreamUnavailable as exc:
        log.warning("broker.no_jetstream %s: running without registry snapshot, "
                    "compensation replay, durable acks and the claims bucket reach_claims; "
                    "agents refuse every task of a claimed capability (STORE_UNAVAILABLE) "
                    "until it exists: run nats-server with JetStream (-js, or `reach broker` "
                    "without --server) and restart the broker", exc)  # fmt: skip
        return None
    return n


async def token_secret(nc: NATS, plan: Provisioning, *, jetstream: bool) -> bytes:
    """The configured secret, else one shared through JetStream KV by all replicas."""
    if plan.token_secret:
        return plan.token_secret.encode()
    last: Exception | None = None
    for _ in range(SECRET_TRIES if jetstream else 1):
        try:
            return await _shared_secret(nc)
        except Exception as exc:  # noqa: BLE001 - an asset still electing: try again
            last = exc
            await asyncio.sleep(SECRET_RETRY_S)
    log.warning(
        "broker.token_secret no JetStream (%s): using a random secret; replicas will "
        "not accept each other's tokens. Set broker.token_secret or REACH_TOKEN_SECRET.",
        last,
    )
    return secrets.token_bytes(32)


async def _shared_secret(nc: NATS) -> bytes:
    js = nc.jetstream(timeout=2.0)
    try:
        kv = await js.key_value(REGISTRY_BUCKET)
    except Exception:  # noqa: BLE001 - absent: create it (provisioning refines it)
        kv = await js.create_key_value(bucket=REGISTRY_BUCKET, history=1)
    fresh = secrets.token_hex(32).encode()
    try:
        await kv.create(TOKEN_SECRET_KEY, fresh)
        return fresh
    except Exception:  # noqa: BLE001 - another replica created it first (or a blip: retried)
        entry = await kv.get(TOKEN_SECRET_KEY)
        if not entry.value:
            raise RuntimeError(f"{REGISTRY_BUCKET}/{TOKEN_SECRET_KEY} is empty") from None
        return entry.value


class ReplicaKeeper:
    """Broker component (JetStream only): every :data:`KEEP_EVERY_S`, the replica count worked
    out again (:func:`counted_replicas`) and each stream with fewer raised to it
    (``reach_jetstream_replicas_short{stream}`` set to what it still lacks,
    ``reach_jetstream_replica_checks_total{result}`` counting each stream's check). It never
    lowers one: an explicit lower ``[jetstream] replicas`` is applied at start only. A
    stream's replicas kept over a lower count, or left short, are said at start and then only
    when that changes, not at every round."""

    def __init__(self, nc: NATS, plan: Provisioning, short: Any, checks: Any, *,
                 every_s: float = KEEP_EVERY_S) -> None:  # fmt: skip
        self.nc, self.plan, self.short = nc, plan, short
        self._checks = {r: checks.labels(r) for r in ("ok", "raised", "short", "failed")}
        self.every_s = every_s
        self._said: dict[str, tuple[tuple[int, int] | None, tuple[int, int] | None]] = {}
        """Each stream's replicas kept and short, as last said."""
        self._counted = 0
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._loop(), name="reach-replicas")

    async def stop(self) -> None:
        if self._task is not None:
            await stop_loops(self._task)
            self._task = None

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.every_s)
            try:
                await self.keep()
            except Exception as exc:  # noqa: BLE001 - JetStream slow or electing: next round
                log.warning("jetstream.replicas_check_failed error=%r: tried again in %gs",
                            exc, self.every_s)  # fmt: skip

    async def keep(self) -> list[Outcome]:
        """One round: the count worked out, each stream with fewer raised (or left short); a
        stream whose check failed is left as it was (logged, counted ``failed``)."""
        n, size = await counted_replicas(self.nc, self.plan)
        if size and n != self._counted:  # (size 0: the configured count, never changing)
            log.info("jetstream.replicas %d (cluster of %d node(s) now; %d counted before)",
                     n, size, self._counted)  # fmt: skip
        self._counted = n
        outcomes = []
        for name in STREAM_NAMES:
            try:
                # Only the replicas named: nothing else of the definition is applied while
                # running (another broker's config must not be flipped back every round).
                outcome = await ensure_stream(self.nc, {"name": name, "num_replicas": n},
                                              least_replicas=True, create=False)  # fmt: skip
            except Exception as exc:  # noqa: BLE001 - this stream next round; the others now
                self._checks["failed"].inc()
                log.warning("jetstream.replicas_check_failed name=%s error=%r: tried again in "
                            "%gs", name, exc, self.every_s)  # fmt: skip
                continue
            outcomes.append(outcome)
            result = ("short" if outcome.short else
                      "raised" if outcome.action == "updated" else "ok")  # fmt: skip
            if result == "raised":
                log.info("jetstream.replicas_raised name=%s replicas=%d", name, n)
            self._checks[result].inc()
            self.note(outcome)
        return outcomes

    def provisioned(self, counted: int, outcomes: list[Outcome]) -> None:
        """Told of the start's count and of each stream's outcome (each said)."""
        self._counted = counted
        self._said = {}
        for outcome in outcomes:
            self.note(outcome)

    def note(self, outcome: Outcome) -> None:
        """A stream's outcome: said when its replicas kept or short changed since last said,
        and the gauge set to what it lacks."""
        name = outcome.name
        said = (outcome.kept, outcome.short)
        if self._said.get(name, (None, None)) != said:
            say_replicas(outcome, SHORT_UNTIL)
        self._said[name] = said
        self.short.labels(name).set(outcome.short[1] - outcome.short[0] if outcome.short else 0)
