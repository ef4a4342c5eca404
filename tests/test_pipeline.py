"""The broker as built, before it connects: who is told of the registry's transitions, in
which order, and the order its parts start in (reach_broker/broker.py, the one place both
are named). No NATS: building a broker does no I/O."""

from __future__ import annotations

from reach_agent.wire.schema import Announce
from reach_broker.broker import Broker
from reach_broker.config import Config
from reach_broker.console.port import HttpPort, access_of
from reach_broker.core.records import AgentRecord, Transition
from reach_broker.service.assets import Provisioning
from reach_broker.service.metrics import Metrics


class Seen:
    def __init__(self) -> None:
        self.items: list[Transition] = []

    def __call__(self, t: Transition, rec: AgentRecord | None) -> None:
        self.items.append(t)


def build(console: bool) -> tuple[Broker, Seen]:
    seen = Seen()
    cfg = Config()
    cfg.broker.broker_id = "b1"
    return Broker(cfg, metrics=Metrics(), console=console, watchers=[seen]), seen


def test_the_consumers_of_transitions_in_their_order() -> None:
    broker, seen = build(console=True)
    assert broker.feed is not None
    assert broker.fanout.consumers == (
        broker.snapshot.on_transition,
        broker.probes.on_transition,
        broker.synadia.on_transition,
        broker.releaser.on_transition,
        broker.replayer.on_transition,
        broker.tables.on_transition,
        broker.feed.on_transition,
        seen,
    )
    plain, seen = build(console=False)
    assert plain.feed is None
    assert plain.fanout.consumers[-2:] == (plain.tables.on_transition, seen)


def test_the_parts_start_in_order_and_those_on_jetstream_are_marked() -> None:
    broker, _ = build(console=True)
    assert [(type(part).__name__, js) for part, js in broker.parts] == [
        ("ReplicaKeeper", True),
        ("Snapshot", True),
        ("Rulebook", True),
        ("Tables", False),
        ("Ingest", False),
        ("Partitions", False),
        ("Forwarder", True),
        ("Shares", False),
        ("Prober", False),
        ("AgentPages", False),
        ("Advisories", False),
        ("SynadiaAgents", False),
        ("Outcomes", False),
        ("Releaser", True),
        ("Replayer", True),
        ("Canceller", True),
    ]  # then the handlers subscribe, then the console's feed (when built) starts


def test_collaborators_are_handed_in_at_construction() -> None:
    broker, _ = build(console=False)
    assert broker.handlers.on_unknown == broker.reannouncer.unknown
    assert broker.handlers.announced == broker.snapshot.on_announce
    assert broker.advisories.unnamed is broker.synadia
    assert broker.advisories.account is broker.synadia.account is broker.account
    assert broker.replayer.acks.on_final == broker.replayer.taken.done


def test_each_part_is_handed_its_own_config_sections() -> None:
    broker, _ = build(console=True)
    cfg = broker.cfg
    reg = broker.registry
    assert reg.detection is cfg.detection and reg.scoring is cfg.scoring
    assert reg.interval_ms == (100, 300_000)  # broker.min/max_heartbeat_interval_ms
    assert broker.provisioning == Provisioning(
        replicas=None, advisory_account=None, max_entries=cfg.compensation.max_entries,
        lease_ttl_s=cfg.fleet.lease_ttl_s, token_secret=None,
    )  # fmt: skip
    assert broker.feed is not None and broker.feed.cfg is cfg.console
    port = HttpPort(access_of("127.0.0.1", cfg.console), 0, broker.metrics.registry,
                    broker.not_ready, broker.feed)  # fmt: skip
    assert port.access.host == "127.0.0.1" and port.access.enabled
    assert (port.server.host, port.server.port) == ("127.0.0.1", 0)


def test_a_transition_reaches_every_consumer_and_parts_not_running_only_plan() -> None:
    broker, seen = build(console=True)
    broker.link.lost(0.0)  # not connected: the event is withheld, nothing is published
    broker.registry.signer.set_secret(b"k" * 32)  # what start() does first
    ann = Announce(agent_id="alpha", capabilities=["summarize"], max_concurrency=2,
                   heartbeat_interval_ms=1000)  # fmt: skip
    _, moved = broker.registry.announce(ann, 1.0, 1_000)
    broker.fanout.emit(moved)
    assert [(t.kind, t.agent_id, t.to) for t in seen.items] == [("registered", "alpha", "healthy")]
    assert broker.fanout.withheld == 1
    assert broker.metrics.registry_changes.labels("registered")._value.get() == 1
    # Not started: the snapshot, releases and replay ignore it; the prober takes the
    # newcomer for its first RTT sample (it sends nothing until it runs).
    assert broker.snapshot.writes == 0 and not broker.snapshot._dirty
    assert list(broker.probes.sampler.newcomers) == ["alpha"]
