"""The subject grammar of the wire contract: every subject reach uses is built and parsed here.

One :class:`Subjects` per prefix (``reach`` unless configured). Builders return the subject a
message goes to; wildcards return what a subscriber listens on; ``*_of`` parsers take a
received subject back to its variable token(s), without validating it (the caller checks an
``agent_id`` or capability with :mod:`reach_agent.wire.schema`'s own checks). Nothing else in the
project spells ``f"{prefix}.hb.…"``; :mod:`jetstream` is handed the subjects it needs.

Replies go to inboxes: every reach process answers only a reply subject under
:data:`INBOX_ROOT` (:func:`is_inbox`), because nats-server never checks the reply subject a
sender names against the sender's permissions (see docs/protocol.md, "Reply subjects").

    <p>.announce.<agent_id>          agent → every broker (request-reply)
    <p>.hb.<agent_id>                agent → every broker
    <p>.leave.<agent_id>             agent → every broker (request-reply)
    <p>.probe.<agent_id>             broker/caller → agent (request-reply)
    <p>.reannounce.<agent_id>        broker → agent: announce again
    <p>.route.<capability>           caller → one broker (queue group)
    <p>.agents                       CLI → one broker (queue group): its whole registry
    <p>.agents.<partition>           CLI/console → the partition's owner: a page of its agents
    <p>.task.<agent_id>.<capability> caller → agent (request-reply)
    <p>.cancel.<agent_id>            caller/broker → agent: stop running a request
    <p>.cancel._broker               caller → one broker (queue group): cancel a request
                                     nobody runs (its claim made final, a queued entry removed)
    <p>.ack.<author>.<request_id>    agent (author: its id) or broker (``_broker``) → REACH_ACKS
    <p>.comp.<capability>            caller → REACH_COMPENSATION → broker
    <p>.event.<kind>.<agent_id>      broker → anyone; kept by REACH_AUDIT
    <p>.event.rule._rules            broker → anyone: a route rule set or cleared (audited)
    <p>.outcome.<agent_id>           caller → the agent's owner: what it saw of the agent
    <p>.table.<partition>.<capability>  broker (the share's owner) → callers: a route-table delta
    <p>.tables.<capability>          caller → every broker: the route table now (request-reply)
    <p>.part.<n>.announce.<agent_id> the server's mapping of <p>.announce.<agent_id> (n: the
    <p>.part.<n>.hb.<agent_id>       agent id's partition, ``partition()``): what the
    <p>.part.<n>.leave.<agent_id>    partition's owner subscribes to (:meth:`Subjects.mappings`)
    <p>.part.<n>.outcome.<agent_id>  (and <p>.outcome.<agent_id>, mapped the same way)
    <p>.partcheck.<token>            broker → itself: is the server mapping, with which count?
    <p>.part.<n>.check.<token>       (the same mapping, for that question alone)
    <p>.forward.<broker>.<capability>  broker → the capability's owner: a route request forwarded
                                     with its caller (``Reach-Caller``; only brokers may publish)

The Synadia Agent Protocol's subjects (theirs, never prefixed) are built by
:class:`AgentsProtocol` (``AGENTS``): reach reads and calls those agents as they are.
"""

from __future__ import annotations

DEFAULT_PREFIX = "reach"

INBOX_ROOT = "_INBOX"
"""Where every reply subject lives (nats-py's default inbox prefix, and the root of every
identity's private ``_INBOX.<role>.<name>`` prefix under reach's credentials)."""
_INBOX_DOT = INBOX_ROOT + "."

BROKER_ACK_AUTHOR = "_broker"
"""Author token of the ack records brokers write (``<p>.ack._broker.<request_id>``): not a
valid agent id (those start with a letter or digit), so no agent can be taken for the broker,
nor the broker for an agent."""


CANCEL_BROKER = BROKER_ACK_AUTHOR
"""The holder token of ``<p>.cancel._broker``, where brokers take the cancel of a request no
agent runs (not a valid agent id, so no agent subscribes there)."""


RULES_AUTHOR = "_rules"
"""The agent-id token of route-rule events (``<p>.event.rule._rules``): no agent's id (those
start with a letter or digit), so no agent's event subscription receives them."""


_NOT_IN_TOKEN = str.maketrans({c: "_" for c in ".*> \t\r\n"})


def broker_token(broker_id: str) -> str:
    """``broker_id`` as one subject token (``.``, ``*``, ``>`` and blanks become ``_``): where
    route requests forwarded to that broker go (:meth:`Subjects.forward`)."""
    return broker_id.translate(_NOT_IN_TOKEN)


def is_inbox(subject: str) -> bool:
    """Whether ``subject`` is a reply subject reach answers (``_INBOX.…``)."""
    return subject.startswith(_INBOX_DOT)


class Subjects:
    """Builders and parsers of every subject under one prefix. Immutable, cheap to share."""

    __slots__ = (
        "_ack",
        "_announce",
        "_cancel",
        "_comp",
        "_cuts",
        "_event",
        "_forward",
        "_hb",
        "_leave",
        "_outcome",
        "_pages",
        "_part",
        "_probe",
        "_reannounce",
        "_route",
        "_table",
        "_tables",
        "_task",
        "prefix",
    )

    def __init__(self, prefix: str = DEFAULT_PREFIX) -> None:
        if not prefix or any(c in prefix for c in " *>\t\r\n") or prefix.endswith("."):
            raise ValueError(f"prefix {prefix!r} is not a valid subject prefix (e.g. 'reach')")
        self.prefix = prefix
        self._announce = f"{prefix}.announce."
        self._hb = f"{prefix}.hb."
        self._leave = f"{prefix}.leave."
        self._probe = f"{prefix}.probe."
        self._reannounce = f"{prefix}.reannounce."
        self._route = f"{prefix}.route."
        self._task = f"{prefix}.task."
        self._cancel = f"{prefix}.cancel."
        self._ack = f"{prefix}.ack."
        self._comp = f"{prefix}.comp."
        self._event = f"{prefix}.event."
        self._outcome = f"{prefix}.outcome."
        self._table = f"{prefix}.table."
        self._tables = f"{prefix}.tables."
        self._part = f"{prefix}.part."
        self._pages = f"{prefix}.agents."
        self._forward = f"{prefix}.forward."
        # Parsers run per message (heartbeats): slice at precomputed lengths.
        self._cuts = (
            len(self._announce), len(self._hb), len(self._leave), len(self._probe),
            len(self._route), len(self._task), len(self._ack), len(self._comp),
            len(self._event),
        )  # fmt: skip

    def __repr__(self) -> str:
        return f"Subjects({self.prefix!r})"

    # --- builders -------------------------------------------------------------------------

    def announce(self, agent_id: str) -> str:
        return self._announce + agent_id

    def heartbeat(self, agent_id: str) -> str:
        return self._hb + agent_id

    def leave(self, agent_id: str) -> str:
        return self._leave + agent_id

    def probe(self, agent_id: str) -> str:
        return self._probe + agent_id

    def reannounce(self, agent_id: str) -> str:
        return self._reannounce + agent_id

    def route(self, capability: str) -> str:
        return self._route + capability

    @property
    def agents(self) -> str:
        return f"{self.prefix}.agents"

    def agent_page(self, partition: int) -> str:
        """Where the owner of ``partition`` answers pages of its agents."""
        return f"{self._pages}{partition}"

    def task(self, agent_id: str, capability: str) -> str:
        return f"{self._task}{agent_id}.{capability}"

    def cancel(self, agent_id: str) -> str:
        """Where the agent ``agent_id`` takes cancels of the requests it runs."""
        return self._cancel + agent_id

    @property
    def cancel_broker(self) -> str:
        """Where brokers (queue group) take the cancel of a request no agent runs."""
        return self._cancel + CANCEL_BROKER

    def ack(self, author: str, request_id: str) -> str:
        """The ack records of ``request_id`` written by ``author`` (an agent id, or
        :data:`BROKER_ACK_AUTHOR`): only that author may publish there."""
        return f"{self._ack}{author}.{request_id}"

    def comp(self, capability: str) -> str:
        return self._comp + capability

    def event(self, kind: str, agent_id: str) -> str:
        return f"{self._event}{kind}.{agent_id}"

    @property
    def rule_event(self) -> str:
        """Where route-rule changes are published (and audited)."""
        return f"{self._event}rule.{RULES_AUTHOR}"

    def outcome(self, agent_id: str) -> str:
        """A caller's outcome summary of one agent."""
        return self._outcome + agent_id

    def table(self, partition: int, capability: str) -> str:
        """The deltas of one share of a capability's route table (its owner publishes)."""
        return f"{self._table}{partition}.{capability}"

    def tables(self, capability: str) -> str:
        """Where a caller asks the brokers for a capability's route table (every broker
        answers with the shares it owns)."""
        return self._tables + capability

    def forward(self, broker: str, capability: str) -> str:
        """A route request forwarded to the broker that owns the capability (``broker``: its
        :func:`broker_token`)."""
        return f"{self._forward}{broker}.{capability}"

    def forwards_to(self, broker: str) -> str:
        """Every route request forwarded to one broker (``<p>.forward.<broker>.>``: a
        capability may have dots)."""
        return f"{self._forward}{broker}.>"

    # --- what subscribers listen on --------------------------------------------------------

    @property
    def all_announces(self) -> str:
        return self._announce + "*"

    @property
    def all_heartbeats(self) -> str:
        return self._hb + "*"

    @property
    def all_leaves(self) -> str:
        return self._leave + "*"

    @property
    def all_probes(self) -> str:
        return self._probe + "*"

    @property
    def all_reannounces(self) -> str:
        return self._reannounce + "*"

    @property
    def all_routes(self) -> str:
        return self._route + ">"

    @property
    def all_agent_pages(self) -> str:
        """Every partition's page subject (``<p>.agents.*``)."""
        return self._pages + "*"

    def tasks_of(self, agent_id: str) -> str:
        """Every task subject of one agent (``<p>.task.<agent_id>.>``)."""
        return f"{self._task}{agent_id}.>"

    @property
    def all_tasks(self) -> str:
        return self._task + ">"

    @property
    def all_cancels(self) -> str:
        """Every agent's cancel subject, and the brokers' (``<p>.cancel.*``)."""
        return self._cancel + "*"

    @property
    def all_acks(self) -> str:
        return self._ack + ">"

    def acks_of(self, request_id: str) -> str:
        """Every author's ack records of one request (``<p>.ack.*.<request_id>``)."""
        return f"{self._ack}*.{request_id}"

    def acks_by(self, author: str) -> str:
        """Every ack record one author writes (``<p>.ack.<author>.>``)."""
        return f"{self._ack}{author}.>"

    @property
    def all_comp(self) -> str:
        return self._comp + ">"

    @property
    def all_events(self) -> str:
        return self._event + ">"

    @property
    def all_outcomes(self) -> str:
        return self._outcome + "*"

    @property
    def all_forwards(self) -> str:
        """Every forwarded route request (``<p>.forward.>``: brokers only)."""
        return self._forward + ">"

    def table_of(self, capability: str) -> str:
        """Every share's deltas of one capability's table (``<p>.table.*.<capability>``)."""
        return f"{self._table}*.{capability}"

    @property
    def all_tables(self) -> str:
        """Every table request (``<p>.tables.>``)."""
        return self._tables + ">"

    @property
    def all_table_deltas(self) -> str:
        """Every share's deltas of every capability (``<p>.table.>``)."""
        return self._table + ">"

    def partition_of_agent_page(self, subject: str) -> str:
        return subject[len(self._pages) :]

    def capability_of_tables(self, subject: str) -> str:
        return subject[len(self._tables) :]

    # --- partitions (the server's subject mapping) -----------------------------------------

    def partition_announces(self, partition: int | str) -> str:
        """The announces of one partition as the server maps them (``<p>.part.<n>.announce.*``;
        ``n`` may be ``*``)."""
        return f"{self._part}{partition}.announce.*"

    def partition_heartbeats(self, partition: int | str) -> str:
        """The heartbeats of one partition as the server maps them (``<p>.part.<n>.hb.*``)."""
        return f"{self._part}{partition}.hb.*"

    def partition_leaves(self, partition: int | str) -> str:
        """The leaves of one partition as the server maps them (``<p>.part.<n>.leave.*``)."""
        return f"{self._part}{partition}.leave.*"

    def mapped_announce(self, agent_id: str) -> str:
        """``<p>.part.*.announce.<agent_id>``: what the server checks an agent's announce
        against once it maps it (its publish right)."""
        return f"{self._part}*.announce.{agent_id}"

    def mapped_heartbeat(self, agent_id: str) -> str:
        """``<p>.part.*.hb.<agent_id>``: the mapped heartbeat's publish right."""
        return f"{self._part}*.hb.{agent_id}"

    def mapped_leave(self, agent_id: str) -> str:
        """``<p>.part.*.leave.<agent_id>``: the mapped leave's publish right."""
        return f"{self._part}*.leave.{agent_id}"

    def partition_outcomes(self, partition: int | str) -> str:
        """The callers' outcome summaries of one partition's agents as the server maps them
        (``<p>.part.<n>.outcome.*``; ``n`` may be ``*``)."""
        return f"{self._part}{partition}.outcome.*"

    @property
    def mapped_outcomes(self) -> str:
        """``<p>.part.*.outcome.*``: the mapped outcome summary's publish right (a caller
        reports on any agent it called)."""
        return f"{self._part}*.outcome.*"

    @property
    def all_partitioned(self) -> str:
        """Every mapped subject (``<p>.part.>``): the brokers' subscribe right."""
        return self._part + ">"

    def partition_check(self, token: str) -> str:
        """Where a broker asks whether the server maps, and with which partition count."""
        return f"{self.prefix}.partcheck.{token}"

    @property
    def all_partition_checks(self) -> str:
        """``<p>.partcheck.*``: where the check arrives when the server does not map."""
        return f"{self.prefix}.partcheck.*"

    @property
    def mapped_checks(self) -> str:
        """``<p>.part.*.check.*``: where the check arrives when the server maps."""
        return f"{self._part}*.check.*"

    def partition_of_mapped(self, subject: str) -> int:
        """``n`` of a mapped subject ``<p>.part.<n>.<kind>.<token>``."""
        return int(subject[len(self._part) :].partition(".")[0])

    def mappings(self, partitions: int) -> dict[str, str]:
        """The server's subject mappings of the agent subjects into ``partitions`` partitions
        (source → destination, nats-server's ``partition()``: FNV-1a 32 of the agent id modulo
        ``partitions``, as :func:`reach_agent.routing.table.partition` computes it)."""
        p = self.prefix
        out = {}
        for kind in ("announce", "hb", "leave", "outcome", "check"):
            source = f"{p}.partcheck.*" if kind == "check" else f"{p}.{kind}.*"
            into = f"{{{{partition({partitions},1)}}}}"
            out[source] = f"{self._part}{into}.{kind}.{{{{wildcard(1)}}}}"
        return out

    def events_of(self, agent_id: str) -> str:
        """Every event about one agent (``<p>.event.*.<agent_id>``)."""
        return f"{self._event}*.{agent_id}"

    # --- parsers (received subject → its variable part; no validation) ---------------------

    # Announce, heartbeat, leave and outcome arrive plain (``<p>.hb.<id>``) or as the server
    # maps them (``<p>.part.<n>.hb.<id>``): the agent id is the last token of either (no agent
    # id holds a dot).

    def agent_of_announce(self, subject: str) -> str:
        return subject[subject.rfind(".") + 1 :]

    def agent_of_heartbeat(self, subject: str) -> str:
        return subject[subject.rfind(".") + 1 :]

    def agent_of_leave(self, subject: str) -> str:
        return subject[subject.rfind(".") + 1 :]

    def agent_of_probe(self, subject: str) -> str:
        return subject[self._cuts[3] :]

    def agent_of_reannounce(self, subject: str) -> str:
        return subject[len(self._reannounce) :]

    def capability_of_route(self, subject: str) -> str:
        return subject[self._cuts[4] :]

    def capability_of_forward(self, subject: str) -> str:
        """The capability of ``<p>.forward.<broker>.<capability>``."""
        return subject[len(self._forward) :].partition(".")[2]

    def capability_of_task(self, subject: str, agent_id: str) -> str:
        """The capability of ``<p>.task.<agent_id>.<capability>`` for a known ``agent_id``."""
        return subject[self._cuts[5] + len(agent_id) + 1 :]

    def ack_of(self, subject: str) -> tuple[str, str]:
        """``(author, request_id)`` of ``<p>.ack.<author>.<request_id>``."""
        author, _, request_id = subject[self._cuts[6] :].partition(".")
        return author, request_id

    def capability_of_comp(self, subject: str) -> str:
        return subject[self._cuts[7] :]

    def agent_of_outcome(self, subject: str) -> str:
        return subject[subject.rfind(".") + 1 :]  # plain or mapped: the last token

    def event_of(self, subject: str) -> tuple[str, str]:
        """``(kind, agent_id)`` of ``<p>.event.<kind>.<agent_id>``."""
        kind, _, agent_id = subject[self._cuts[8] :].partition(".")
        return kind, agent_id


class AgentsProtocol:
    """The subjects of the Synadia Agent Protocol for NATS (v0.3), as its agents use them.

    $SRV.INFO.agents                 discovery: every instance of the micro service
    $SRV.INFO.agents.<instance_id>   one instance's registration
    $SRV.PING.agents.<instance_id>   one instance alive?
    agents.hb.<agent>.<owner>.<session>      an instance's heartbeat (every 30 s)
    agents.prompt.<agent>.<owner>.<session>  the prompt endpoint (queue group agents)
    agents.status.<agent>.<owner>.<session>  the status endpoint (queue group agents)
    """

    __slots__ = ()

    service = "agents"
    """The micro service name every such agent registers."""
    info = "$SRV.INFO.agents"
    ping = "$SRV.PING.agents"
    """Every instance subscribes to it: the server's CONNZ filters their connections on it."""
    all_heartbeats = "agents.hb.*.*.*"

    def info_of(self, instance_id: str) -> str:
        return f"{self.info}.{instance_id}"

    def ping_of(self, instance_id: str) -> str:
        return f"{self.ping}.{instance_id}"

    def prompt(self, agent: str, owner: str, session: str) -> str:
        return f"agents.prompt.{agent}.{owner}.{session}"

    def status(self, agent: str, owner: str, session: str) -> str:
        return f"agents.status.{agent}.{owner}.{session}"

    def of_heartbeat(self, subject: str) -> tuple[str, str, str] | None:
        """``(agent, owner, session)`` of ``agents.hb.<agent>.<owner>.<session>``."""
        parts = subject.split(".")
        if len(parts) != 5 or parts[0] != "agents" or parts[1] != "hb":
            return None
        return parts[2], parts[3], parts[4]

    def instance_of_info(self, subject: str) -> str | None:
        """The instance id of ``$SRV.INFO.agents.<instance_id>`` (a subscription subject)."""
        head = self.info + "."
        if not subject.startswith(head) or "." in subject[len(head) :]:
            return None
        return subject[len(head) :] or None


AGENTS = AgentsProtocol()
"""The Synadia Agent Protocol's subjects."""


class ReplyInbox:
    """The reply subjects of one client: ``<inbox>.<call>.<attempt>`` under its own inbox.

    Every attempt of a call replies to a subject of its own, so the receipt and the result
    are both received and a late reply is known to answer an earlier attempt. Not part of
    the wire contract (an agent replies to whatever reply subject a task carries).
    """

    __slots__ = ("_cut", "inbox", "wildcard")

    def __init__(self, inbox: str) -> None:
        self.inbox = inbox
        self.wildcard = f"{inbox}.*.*"
        """What the client subscribes to: every attempt of every call."""
        self._cut = len(inbox) + 1

    def reply(self, call_id: str, attempt: int) -> str:
        return f"{self.inbox}.{call_id}.{attempt}"

    def parse(self, subject: str) -> tuple[str, str]:
        """``(call_id, attempt)`` of a reply subject (the attempt as received: a string)."""
        call_id, _, attempt = subject[self._cut :].partition(".")
        return call_id, attempt
