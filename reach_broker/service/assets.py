"""The broker's JetStream assets at start: provisioned with their replica count, and the
token secret all replicas share.

``[jetstream] replicas`` sets ``num_replicas`` of every stream and of the KV bucket; unset,
it is 3 when the server reports a cluster of three or more nodes
(:func:`reach_broker.service.clusterinfo.cluster_size`), else 1. Provisioning
(:mod:`jetstream.provision`) moves an existing asset to that count in place: the server
copies its data to the new peers, nothing is re-created.

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
    ProvisionTimeout,
    load_definitions,
    provision,
)
from reach_agent.wire.subjects import Subjects

from .clusterinfo import account_of, cluster_size

log = logging.getLogger(__name__)

SECRET_TRIES = 20
SECRET_RETRY_S = 0.25
START_RETRY_S = (0.5, 1.0, 2.0, 4.0, 8.0, 8.0, 8.0)
"""The waits between start attempts while JetStream is not ready: 31.5 s in all (a
restarted node rejoins and a meta leader is elected well within it, even on a busy
machine), then the start fails."""


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


async def replicas(nc: NATS, plan: Provisioning) -> int:
    """``[jetstream] replicas``, else 3 on a cluster of three or more nodes, else 1."""
    if plan.replicas is not None:
        return plan.replicas
    account = plan.advisory_account or await account_of(nc)
    size = await cluster_size(nc, account)
    n = 3 if size >= 3 else 1
    log.info("jetstream.replicas %d (cluster of %d node(s); set [jetstream] replicas to "
             "choose)", n, size)  # fmt: skip
    return n


async def provision_assets(
    nc: NATS, plan: Provisioning, subjects: Subjects, *, short: Any = None
) -> int | None:
    """Create or update the JetStream assets (jetstream/definitions) before any use; the
    replica count, or None when the server has no JetStream (the broker then runs without
    snapshot and replay). A definition that would lose data if applied raises. The count
    worked out from the nodes answering (``[jetstream] replicas`` unset) never lowers a
    stream's: a node down at a start must not take R3 assets to R1. A raise the cluster
    cannot place now is left for a later start, and ``short``
    (``reach_jetstream_replicas_short{stream}``) says by how much."""
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
        for outcome in outcomes:
            if short is not None:
                lacks = outcome.short[1] - outcome.short[0] if outcome.short else 0
                short.labels(outcome.name).set(lacks)
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
