"""Every JetStream name reach uses, in one place: streams, the KV bucket, consumers, headers.

Stream names do not move with the subject prefix (their subjects do, see
:mod:`jetstream.provision`). The definitions themselves live as data in ``definitions/``.
"""

from __future__ import annotations

import hashlib
from typing import Protocol

ACK_STREAM = "REACH_ACKS"
"""Durable ack records, ``<prefix>.ack.>``."""
COMP_STREAM = "REACH_COMPENSATION"
"""The bounded compensation queue (work queue, discard new), ``<prefix>.comp.>``."""
AUDIT_STREAM = "REACH_AUDIT"
"""The audit trail of broker events, ``<prefix>.event.>``; delete and purge denied."""
REGISTRY_BUCKET = "reach_registry"
"""KV bucket: one key per agent (the broker's snapshot) and ``_broker.*`` private keys."""
REGISTRY_STREAM = f"KV_{REGISTRY_BUCKET}"
"""The stream behind :data:`REGISTRY_BUCKET`."""
CLAIMS_BUCKET = "reach_claims"
"""KV bucket: one create-only claim per request id (who runs it, its state, where its result
is), kept as long as the ack records (its ``max_age`` is ``REACH_ACKS``'s)."""
CLAIMS_STREAM = f"KV_{CLAIMS_BUCKET}"
"""The stream behind :data:`CLAIMS_BUCKET`."""
RULES_BUCKET = "reach_rules"
"""KV bucket: one route rule per capability (key = the capability), watched by every broker."""
RULES_STREAM = f"KV_{RULES_BUCKET}"
"""The stream behind :data:`RULES_BUCKET`."""
PARTITIONS_BUCKET = "reach_partitions"
"""KV bucket: one lease per partition of the fleet (key = the partition number), naming the
broker that owns it; its ``max_age`` is the lease's time to live."""
PARTITIONS_STREAM = f"KV_{PARTITIONS_BUCKET}"
"""The stream behind :data:`PARTITIONS_BUCKET`."""
TABLES_BUCKET = "reach_tables"
"""KV bucket: each route-table share (key = ``<partition>.<capability>``) as its owner last
wrote it, for callers that find no broker."""
TABLES_STREAM = f"KV_{TABLES_BUCKET}"
"""The stream behind :data:`TABLES_BUCKET`."""
A2A_TASKS_BUCKET = "reach_a2a_tasks"
"""KV bucket of the A2A gateway's tasks: one key per task, ``<owner>.<task id>``
(reach_broker/interop/a2a/tasks.py), kept as long as the ack records their results live in.
Not among :data:`STREAM_NAMES`: a gateway provisions it when it starts."""
A2A_TASKS_STREAM = f"KV_{A2A_TASKS_BUCKET}"
"""The stream behind :data:`A2A_TASKS_BUCKET`."""
STREAM_NAMES = (ACK_STREAM, COMP_STREAM, AUDIT_STREAM, REGISTRY_STREAM, CLAIMS_STREAM,
                RULES_STREAM, PARTITIONS_STREAM, TABLES_STREAM)  # fmt: skip
"""Every asset provisioned at broker start, in order."""

TOKEN_SECRET_KEY = "_broker.token_secret"
"""Key in :data:`REGISTRY_BUCKET` of the heartbeat-token secret shared by broker replicas."""


def dispatch_key(request_id: str) -> str:
    """Key in :data:`REGISTRY_BUCKET` naming the agent a queued request was replayed to
    (a digest: request ids may hold characters KV keys may not)."""
    digest = hashlib.blake2b(request_id.encode(), digest_size=12).hexdigest()
    return f"_replay.{digest}"


def replay_consumer(capability: str) -> str:
    """Durable consumer replaying one capability (consumer names cannot hold dots)."""
    digest = hashlib.blake2b(capability.encode(), digest_size=8).hexdigest()
    return f"reach_replay_{digest}"


# --- headers ---------------------------------------------------------------------------

H_MSG_ID = "Nats-Msg-Id"
"""JetStream's de-duplication id: ``<author>.<request_id>.<state>.<tag>`` on acks (see
:func:`jetstream.acks.ack_msg_id`), the request id on compensation entries."""
H_STREAM = "Nats-Stream"
"""Set by JetStream on a stored message it hands out (a direct get's answer): a message that
carries it is a *copy* of something stored, published by the server to whatever reply subject
the requester named. reach drops control messages, events and ack records that carry it."""
H_SUBJECT = "Nats-Subject"
"""The original subject of such a copy."""
H_NUM_PENDING = "Nats-Num-Pending"
"""On a batched direct get's answers: how many messages of the request are left after this one
(on its end-of-batch status, after the page)."""
H_LAST_SEQUENCE = "Nats-Last-Sequence"
"""On a batched direct get's end-of-batch status: the stream sequence of the page's last
message (the next page starts after it)."""
H_STATUS = "Status"
"""Where nats-py puts a status message's code (``204`` end of batch, ``404``, ``503``)."""
H_KV_OPERATION = "KV-Operation"
"""On a KV bucket's message: ``DEL`` or ``PURGE`` for a deleted key (absent on a value)."""
H_REQUEST_ID = "Reach-Request-Id"
"""The task's request id (also a task header of the wire contract)."""
H_PRIORITY = "Reach-Priority"
"""Compensation entry priority (int, higher first)."""
H_EXPIRES_MS = "Reach-Expires-Ms"
"""Compensation entry expiry (absolute Unix ms)."""
H_ENQUEUED_MS = "Reach-Enqueued-Ms"
"""When a compensation entry was enqueued (Unix ms)."""
H_BODY_DIGEST = "Reach-Body-Digest"
"""The digest of a compensation entry's body (``reach_agent.wire.schema.body_digest``): the
request id reused with another body is refused (IDEMPOTENCY_MISMATCH)."""
QUEUE_HEADERS = (H_MSG_ID, H_PRIORITY, H_EXPIRES_MS, H_ENQUEUED_MS, H_BODY_DIGEST)
"""The queue's own headers, stripped before an entry is replayed as a task."""
H_EXPECTED_LAST_SUBJECT_SEQ = "Nats-Expected-Last-Subject-Sequence"
"""JetStream's compare-and-set: store only if the subject's last sequence is this (0: none),
how a claim is created only once and changed only by whoever read its current revision."""

# --- JetStream API error codes we act on -------------------------------------------------

JS_NOT_ENABLED = 10039
"""``jetstream not enabled for account``."""
JS_NOT_READY = 10008
"""``JetStream system temporarily unavailable`` (503): a server just (re)started, or a
cluster without a meta leader yet."""
STREAM_NOT_FOUND = 10059
STREAM_EXISTS = 10058
"""``stream name already in use``: another replica created it first."""
NO_SUITABLE_PEERS = 10005
"""``no suitable peers for placement``: too few cluster peers can take a replica now (one
still joining after a start or a restart; or, lasting, too little storage)."""
MSG_DELETE_FAILED = 10057
"""``message delete failed``: e.g. the entry was already removed."""
MAX_MSGS_EXCEEDED = 10077
"""``maximum messages exceeded``: the compensation queue is at its bound."""
NO_MESSAGE_FOUND = 10037
"""``no message found``: a direct/last-by-subject get on an empty subject."""
WRONG_LAST_SEQUENCE = (10071, 10164)
"""``wrong last sequence``: the compare-and-set of a claim lost (someone wrote it first)."""


class StreamSubjects(Protocol):
    """The subjects of reach's streams, as :class:`reach_agent.wire.subjects.Subjects` builds them.

    jetstream/ is handed an object with these members instead of spelling subjects itself,
    so the subject grammar has one address (and this floor imports no floor above it).
    """

    def ack(self, author: str, request_id: str) -> str: ...
    @property
    def all_acks(self) -> str: ...
    def acks_of(self, request_id: str) -> str: ...
    def ack_of(self, subject: str) -> tuple[str, str]: ...
    def comp(self, capability: str) -> str: ...
    def capability_of_comp(self, subject: str) -> str: ...
    @property
    def all_comp(self) -> str: ...
    @property
    def all_events(self) -> str: ...
