"""What each kind of identity may do on the bus: one table, expanded into JWT permissions.

nats-server enforces these: a publish outside ``publish`` (and not a permitted reply) is
dropped by the server and answered with ``-ERR 'Permissions Violation for Publish to "…"'``,
a subscription outside ``subscribe`` likewise, before any reach process sees the message.

Each cell names a subject the way :class:`reach_agent.wire.subjects.Subjects` builds it (``Of``:
a builder applied to the identity's own name; ``Every``: a wildcard of the grammar), or is a
subject outside reach's grammar (``Raw``: JetStream's API, the system account's services,
the identity's private inbox). :func:`permissions` turns a row into the ``nats`` part of a
user JWT. The ``ROLES`` table is the one place to change what a role may do; a change takes
effect for credentials issued afterwards (re-issue to apply it to existing ones).

Every identity gets a private inbox prefix, ``_INBOX.<role>.<name>``, and may subscribe only
below it: nobody reads another's replies (task results, JetStream answers). The client must
connect with that prefix (nats-py ``connect(inbox_prefix=…)``); :func:`inbox_prefix_of` reads
it back from a user JWT.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, NamedTuple

from jetstream.names import ACK_STREAM, CLAIMS_BUCKET, CLAIMS_STREAM, TABLES_STREAM
from reach_agent.wire.subjects import BROKER_ACK_AUTHOR, INBOX_ROOT, Subjects

from .claims import Permission, ResponsePermission, User

RoleName = Literal["agent", "caller", "broker"]


class Of(NamedTuple):
    """``Subjects.<builder>(name)``: a subject of the identity's own name."""

    builder: str


class Every(NamedTuple):
    """``Subjects.<attr>``: a subject (often a wildcard) that is the same for everyone."""

    attr: str


class Raw(NamedTuple):
    """A subject outside reach's grammar; ``{inbox}``, ``{account}`` and ``{p}`` (the subject
    prefix) are filled in."""

    template: str


class OwnAcks(NamedTuple):
    """Ack records attributed to the identity: ``<p>.ack.<name>.>`` (``author`` replaces the
    name when set, as for the broker)."""

    author: str = ""


Cell = Of | Every | Raw | OwnAcks


@dataclass(frozen=True)
class Responses:
    """``allow_responses``: publish to the reply subject of a message received, at most
    ``max_msgs`` times within ``ttl_s`` of receiving it."""

    max_msgs: int
    ttl_s: float


@dataclass(frozen=True)
class Role:
    name: RoleName
    description: str
    publish: tuple[Cell, ...]
    subscribe: tuple[Cell, ...]
    responses: Responses | None = None


INBOX = Raw("{inbox}.>")

AGENT_REPLY_WINDOW_S = 3660.0
"""How long after receiving a task (or probe) an agent may still reply to it. Must exceed the
longest task deadline (``ClientConfig.max_timeout_s``, 3600 s by default): a result published
later is refused by the server. Replies are unlimited in number within the window (a
streamed answer is one message per chunk), so the server keeps one entry per task received
for the whole window: about ``tasks per second * window`` entries per agent connection.
Lower it (``issue_agent(..., reply_window_s=...)``) where tasks are short and many."""

# JetStream API subjects a caller needs to read ack records (reach_agent.client.durable's wait and
# last reads, `reach ack`): the message get (it returns a record with its stored headers, so
# a reader can tell a record from a copy) and the stream's info. No direct get: its answer is
# the stored message itself, headers and all, published to whatever reply subject the
# requester names (the server never checks reply subjects), so it would let a caller copy an
# agent-written record onto another agent's ack subject or onto an event subject. No
# consumer-create rights either: a push consumer's deliver subject is not checked against its
# creator's permissions, so a consumer would re-publish stored messages on any subject.
_ACK_READS = (
    Raw(f"$JS.API.STREAM.MSG.GET.{ACK_STREAM}"),
    Raw(f"$JS.API.STREAM.INFO.{ACK_STREAM}"),
)
# Claims (KV reach_claims, reach_agent.agent.claiming): an agent creates and ends them with plain
# JetStream publishes (compare-and-set by header) and reads them by message get; a caller
# waiting on IN_PROGRESS reads them. Any agent of the account may write any claim: the
# bucket trusts the account's agents (a forged claim can stall a request, not run it twice).
# No direct get: any agent may store `{}` as a claim, and a direct get answered onto
# `$JS.API.STREAM.DELETE.<stream>` (the server never checks reply subjects) is an empty
# request there: the stream is deleted (checked against a real server).
_CLAIM_READS = (Raw(f"$JS.API.STREAM.MSG.GET.{CLAIMS_STREAM}"),)
_CLAIM_WRITES = (Raw(f"$KV.{CLAIMS_BUCKET}.>"), Raw(f"$JS.API.STREAM.INFO.{CLAIMS_STREAM}"))
# Route tables (reach_agent.client.tables): a caller asks the brokers for a capability's
# table and follows its deltas; with no broker answering it reads the shares from KV
# reach_tables (the stream's info lists the keys, a message get reads each). Only brokers
# publish deltas and write the bucket.
_TABLE_READS = (
    Every("all_tables"),
    Raw(f"$JS.API.STREAM.INFO.{TABLES_STREAM}"),
    Raw(f"$JS.API.STREAM.MSG.GET.{TABLES_STREAM}"),
)

ROLES: dict[RoleName, Role] = {
    "agent": Role(
        name="agent",
        description="one agent process (connection name = agent id)",
        publish=(
            Of("announce"),
            Of("heartbeat"),
            Of("leave"),
            OwnAcks(),
            *_CLAIM_WRITES,
            *_CLAIM_READS,
            *_ACK_READS,
            # A server that maps the agent subjects into partitions (docs/protocol.md,
            # "Partitions") checks the mapped subject: the agent's own, in any partition.
            Of("mapped_announce"),
            Of("mapped_heartbeat"),
            Of("mapped_leave"),
        ),
        subscribe=(
            Of("tasks_of"),
            Of("probe"),
            Of("reannounce"),
            Of("cancel"),
            Of("events_of"),
            INBOX,
        ),
        # A task gets a receipt, then its result or one message per streamed chunk.
        responses=Responses(max_msgs=-1, ttl_s=AGENT_REPLY_WINDOW_S),
    ),
    "caller": Role(
        name="caller",
        description="routes, calls, submits and waits; reads ack records and events",
        publish=(
            Every("all_routes"),
            Every("agents"),
            Every("all_agent_pages"),  # pages of the fleet, each from its owner
            Every("all_tasks"),
            Every("all_comp"),
            Every("all_probes"),  # the client's liveness watch probes agents running its calls
            Every("all_outcomes"),  # what it saw of each agent it called (delivery term)
            Every("mapped_outcomes"),  # (checked where the server maps it: the agent's owner)
            Every("all_cancels"),  # stop a request: its agent's, and the brokers' (`_broker`)
            *_ACK_READS,
            *_CLAIM_READS,
            *_TABLE_READS,
        ),
        subscribe=(Every("all_acks"), Every("all_events"), Every("all_table_deltas"), INBOX),
        # Credits of a streamed answer go back to the chunks' reply subject (the agent's
        # inbox); the SDK sends them only to `_INBOX.` subjects.
        responses=Responses(max_msgs=-1, ttl_s=AGENT_REPLY_WINDOW_S),
    ),
    "broker": Role(
        name="broker",
        description="the broker (every replica shares one credential)",
        publish=(
            Every("all_events"),
            Every("all_probes"),
            Every("all_reannounces"),  # asks an agent it does not know to announce again
            Every("all_tasks"),
            Every("all_table_deltas"),  # the route tables of the partitions it owns
            Every("all_partition_checks"),  # is the server mapping the agent subjects?
            Every("mapped_checks"),  # (what the server checks once it maps the question)
            Every("all_cancels"),  # a cancel forwarded to the holder the caller did not ask
            OwnAcks(author=BROKER_ACK_AUTHOR),
            # Replies to announces, leaves, routes, `agents` and `$SRV` pings go to the
            # requester's inbox, whatever its prefix (a plain allow: no per-reply tracking).
            Raw(f"{INBOX_ROOT}.>"),
            Raw("$JS.API.>"),
            Raw("$JS.ACK.>"),
            Raw("$JS.FC.>"),
            Raw("$KV.>"),
            Raw("$SYS.REQ.USER.INFO"),
            Raw("$SYS.REQ.ACCOUNT.{account}.CONNZ"),
            Raw("$SYS.REQ.ACCOUNT.PING.CONNZ"),
            Raw("$SYS.REQ.SERVER.PING.CONNZ"),
            # The operators' view of the fleet (`reach top`, `reach events` history, the demo's
            # view) needs a consumer on REACH_AUDIT and the replicas' NATS Services stats,
            # which no other role may have: the broker's credential is the admin credential,
            # so it may also ask what a caller asks.
            Raw("$SRV.>"),
            Every("agents"),
            Every("all_agent_pages"),  # pages of the fleet, each from its owner
            Every("all_routes"),
            Every("all_forwards"),  # a route request to its capability's owner (brokers only)
        ),
        subscribe=(
            # The server maps the agent subjects into partitions (docs/protocol.md,
            # "Partitions"): the owner of a partition subscribes to its mapped subjects; the
            # plain ones are where they arrive from a server that does not map.
            Every("all_partitioned"),
            Every("all_partition_checks"),
            Every("all_announces"),
            Every("all_heartbeats"),
            Every("all_leaves"),
            Every("all_routes"),
            Every("agents"),
            Every("all_agent_pages"),  # pages of the fleet, each from its owner
            Every("all_comp"),
            Every("all_acks"),
            Every("all_events"),
            Every("all_outcomes"),
            Every("all_tables"),
            Every("cancel_broker"),  # a cancel no agent settled (queue group reach-broker)
            Raw("$SRV.>"),
            Raw("$SYS.ACCOUNT.{account}.CONNECT"),
            Raw("$SYS.ACCOUNT.{account}.DISCONNECT"),
            INBOX,
            Every("all_forwards"),  # route requests forwarded to the capability's owner
        ),
    ),
}


def inbox_prefix(role: RoleName, name: str) -> str:
    """The private inbox prefix of an identity: ``_INBOX.<role>.<name>``."""
    return f"{INBOX_ROOT}.{role}.{name}"


def _expand(cell: Cell, subjects: Subjects, name: str, role: RoleName, account: str) -> str:
    match cell:
        case Of(builder):
            subject: str = getattr(subjects, builder)(name)
            return subject
        case Every(attr):
            subject = getattr(subjects, attr)
            return subject
        case OwnAcks(author):
            return subjects.acks_by(author or name)
        case Raw(template):
            return template.format(
                inbox=inbox_prefix(role, name), account=account, p=subjects.prefix
            )
    raise TypeError(f"not a permission cell: {cell!r}")


def permissions(
    role: RoleName,
    name: str,
    *,
    account: str,
    subjects: Subjects | None = None,
    reply_window_s: float | None = None,
) -> User:
    """The ``nats`` part of the user JWT of identity ``name`` in ``role``.

    ``account`` is the application account's public key (the advisory subjects carry it);
    ``reply_window_s`` overrides the role's response window.
    """
    row = ROLES[role]
    subjects = subjects or Subjects()
    pub = [_expand(c, subjects, name, role, account) for c in row.publish]
    sub = [_expand(c, subjects, name, role, account) for c in row.subscribe]
    resp = None
    if row.responses is not None:
        ttl_s = row.responses.ttl_s if reply_window_s is None else reply_window_s
        if ttl_s <= 0:
            raise ValueError(f"reply_window_s {ttl_s!r} must be > 0 (seconds)")
        resp = ResponsePermission(max=row.responses.max_msgs, ttl=int(ttl_s * 1e9))
    return User.unlimited(
        pub=Permission(allow=pub),
        sub=Permission(allow=sub),
        resp=resp,
        # Plain client connections only: the credential cannot carry a leaf node (which
        # would bridge another server's clients in under this identity) or a websocket.
        allowed_connection_types=["STANDARD"],
        tags=[f"reach-role:{role}"],
    )


def inbox_prefix_of(user: User) -> str | None:
    """The inbox prefix a user JWT's subscribe permissions grant (``_INBOX.….>``), if any.

    How a client learns the ``inbox_prefix`` to connect with from its credentials alone, also
    for credentials issued by other tools that follow the same convention.
    """
    for subject in user.sub.allow:
        if subject.startswith(INBOX_ROOT + ".") and subject.endswith(".>"):
            return subject[:-2]
    return None
