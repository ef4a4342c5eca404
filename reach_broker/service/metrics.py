"""Prometheus metrics of the broker: one :class:`Metrics` object over a ``CollectorRegistry``.

Every metric's name, help and labels are here, once. A component is handed only what it
counts (by the one place the broker is built, :mod:`reach_broker.broker`): a metric or two as
arguments, or, for the handlers and the replay, a view of their own (:class:`HandlerMetrics`,
:class:`ReplayMetrics`). Children of labelled metrics that sit on hot paths are bound once
here, so a heartbeat or a route request costs an ``inc()``/``observe()`` and no label
lookup. Gauges that mirror the registry (agents by state) are read at scrape time by a
collector, not updated per message.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from reach_agent.wire.schema import AGENT_STATES

HEARTBEAT_RESULTS = ("accepted", "stale", "forged", "invalid", "unknown")
ROUTE_RESULTS = ("ok", "no_agent", "invalid", "overloaded", "error")
ANNOUNCE_RESULTS = ("ok", "invalid", "error", "conflict")
DROP_KINDS = ("announce", "heartbeat", "leave", "route", "agents", "advisory", "ack")
"""``kind`` of ``reach_dropped_total``: the inbound subject family a refusal was on."""
DROP_REASONS = ("invalid", "forbidden", "forged", "stale", "unknown", "no_token",
                "stored_copy", "reply_subject", "name_mismatch", "error")  # fmt: skip
"""``reason`` of ``reach_dropped_total`` (see docs/operations.md, Securing reach)."""

COMPENSATION_RESULTS = ("enqueued", "replayed", "expired", "refused", "claimed", "requeued",
                        "cancelled", "mismatch", "deferred")  # fmt: skip
"""``result`` of ``reach_compensation_total`` on the broker."""

ROUTE_BUCKETS = (0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5)


class _StateCollector(Collector):
    def __init__(self, counts: Callable[[], dict[str, int]]) -> None:
        self._counts = counts

    def collect(self) -> Iterable[GaugeMetricFamily]:
        counts = self._counts()
        agents = GaugeMetricFamily(
            "reach_agents", "Registered agents by reach state", labels=["state"]
        )
        for state in AGENT_STATES:
            agents.add_metric([state], counts.get(state, 0))
        yield agents
        unhealthy = sum(n for s, n in counts.items() if s in ("suspect", "offline", "recovering"))
        yield GaugeMetricFamily(
            "reach_agent_unhealthy",
            "Agents that are suspect, offline or recovering",
            value=unhealthy,
        )

    def describe(self) -> Iterable[GaugeMetricFamily]:
        return []


class Tally:
    """A count that only the event loop adds to, exposed by a collector
    (:func:`_tallied`).

    The route and heartbeat paths count with it rather than prometheus_client's Counter and
    Histogram, which take a lock per ``inc``/``observe``: the two cost 1.8-1.9 µs of a route
    request's 9.6 µs in process (``loadtest/README.md``, "The route path's metrics"); a
    heartbeat's ``inc`` 0.30 µs against 0.03 µs (timeit)."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0.0

    def inc(self, amount: float = 1.0) -> None:
        self.value += amount


class Timings:
    """A histogram that only the event loop observes (see :class:`Tally`): a count per
    bucket (``le`` bound, then +Inf) and the sum, exposed by :class:`_RouteCollector`."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0

    def observe(self, seconds: float) -> None:
        self.counts[bisect_left(self.bounds, seconds)] += 1  # the first bound >= seconds
        self.sum += seconds


def _tallied(name: str, documentation: str, label: str,
             tallies: dict[str, Tally]) -> CounterMetricFamily:  # fmt: skip
    """A counter ``name`` (without ``_total``) by ``label``, from :class:`Tally` counts."""
    family = CounterMetricFamily(name, documentation, labels=[label])
    for value, tally in tallies.items():
        family.add_metric([value], tally.value)
    return family


class _HeartbeatCollector(Collector):
    """``reach_heartbeats_total{result}`` from the heartbeat path's :class:`Tally` counts."""

    def __init__(self, results: dict[str, Tally]) -> None:
        self._results = results

    def collect(self) -> Iterable[Metric]:
        yield _tallied("reach_heartbeats", "Heartbeats received by result", "result",
                       self._results)  # fmt: skip

    def describe(self) -> Iterable[Metric]:
        return []


class _RouteCollector(Collector):
    """``reach_route_requests_total{result}`` and ``reach_route_duration_seconds`` from the
    route path's :class:`Tally` counts and :class:`Timings`."""

    def __init__(self, results: dict[str, Tally], times: Timings) -> None:
        self._results, self._times = results, times

    def collect(self) -> Iterable[Metric]:
        yield _tallied("reach_route_requests", "Route requests by result", "result",
                       self._results)  # fmt: skip
        times = self._times
        les = [*(floatToGoString(b) for b in times.bounds), "+Inf"]
        cumulative, buckets = 0, []
        for le, n in zip(les, times.counts, strict=True):
            cumulative += n
            buckets.append((le, float(cumulative)))
        duration = HistogramMetricFamily(
            "reach_route_duration_seconds", "Time to answer a route request inside the broker"
        )
        duration.add_metric([], buckets, sum_value=times.sum)
        yield duration

    def describe(self) -> Iterable[Metric]:
        return []


class _PartitionBeats(Collector):
    """``reach_partition_heartbeats_total{partition}`` from the ingest's own counts (a list
    item incremented per heartbeat: no lock, no label lookup on the hot path)."""

    def __init__(self, counts: list[int]) -> None:
        self._counts = counts

    def collect(self) -> Iterable[CounterMetricFamily]:
        beats = CounterMetricFamily(
            "reach_partition_heartbeats",
            "Heartbeats received per partition this broker owns or owned (any result; "
            "reach_heartbeats_total counts them by result)", labels=["partition"],
        )  # fmt: skip
        for p, n in enumerate(self._counts):
            if n:
                beats.add_metric([str(p)], n)
        yield beats

    def describe(self) -> Iterable[CounterMetricFamily]:
        return []


class Metrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.route_result = {k: Tally() for k in ROUTE_RESULTS}
        """``reach_route_requests_total`` by result."""
        self.route_duration = Timings(ROUTE_BUCKETS)
        """``reach_route_duration_seconds``."""
        r.register(_RouteCollector(self.route_result, self.route_duration))
        self.heartbeat_result = {k: Tally() for k in HEARTBEAT_RESULTS}
        """``reach_heartbeats_total`` by result."""
        r.register(_HeartbeatCollector(self.heartbeat_result))
        self.announces = Counter(
            "reach_announces_total", "Announce requests by result", ["result"], registry=r
        )
        self.announce_result = {k: self.announces.labels(k) for k in ANNOUNCE_RESULTS}
        self.leaves = Counter(
            "reach_leaves_total", "Leave requests by result", ["result"], registry=r
        )
        self.registry_changes = Counter(
            "reach_registry_change_total",
            "Registry transitions by event kind",
            ["kind"],
            registry=r,
        )
        self.state_changes = Counter(
            "reach_state_transitions_total", "State transitions by target state", ["to"], registry=r
        )
        self.probes = Counter("reach_probes_total", "Probes sent by result", ["result"], registry=r)
        self.probe_rtt = Histogram(
            "reach_probe_rtt_seconds",
            "Round trip of answered probes",
            buckets=ROUTE_BUCKETS,
            registry=r,
        )
        self.dropped = Counter(
            "reach_dropped_messages_total",
            "Messages dropped without a reply, by subject kind and reason",
            ["kind", "reason"],
            registry=r,
        )
        self.refused = Counter(
            "reach_dropped_total",
            "Inbound messages the broker refused (announces, heartbeats, leaves, requests, "
            "advisories, ack records), by kind and reason",
            ["kind", "reason"],
            registry=r,
        )
        self.auth_enabled = Gauge(
            "reach_auth_enabled",
            "1 when the server requires credentials and the broker authenticated with a user "
            "JWT (reach's roles apply); 0 in open mode, where anyone can act for any agent",
            registry=r,
        )
        self.nats_errors = Counter(
            "reach_nats_errors_total", "NATS client errors by kind", ["kind"], registry=r
        )
        self.panic = Gauge(
            "reach_capability_panic", "1 while a capability has too few healthy agents",
            ["capability"], registry=r,
        )  # fmt: skip
        self.advisories = Gauge(
            "reach_disconnect_advisories", "1 when the server's disconnect advisories are seen",
            registry=r,
        )  # fmt: skip
        # High availability (issue 13): the broker's doubt about its own link.
        self.observer_suspect = Gauge(
            "reach_observer_suspect",
            "1 while the broker doubts its own view (too much of the fleet silent at once, "
            "nothing heard from the server for 1.5 s as a silence came due, or its NATS link "
            "down) and holds every state",
            registry=r,
        )
        self.observer_gaps = Counter(
            "reach_observer_gaps_total",
            "Outages of the broker's own NATS link (every agent's clock rebased after each)",
            registry=r,
        )
        self.reannounce_requests = Counter(
            "reach_reannounce_requests_total",
            "Agents asked to announce again (heartbeat from an agent the broker does not know)",
            registry=r,
        )
        self.synadia_agents = Gauge(
            "reach_synadia_agents",
            "Synadia Agent Protocol instances this broker holds: those of the partitions it "
            "owns (every broker discovers all of them on $SRV.INFO.agents)",
            registry=r,
        )
        self.replicas_short = Gauge(
            "reach_jetstream_replicas_short",
            "Replicas a stream lacks of those this broker wants: the cluster could not place "
            "them (a node down); tried again every 30 s, 0 once placed",
            ["stream"],
            registry=r,
        )
        self.replica_checks = Counter(
            "reach_jetstream_replica_checks_total",
            "A running broker's checks of a stream's replicas (every 30 s) by result: ok, "
            "raised, short (the cluster could not place them), failed (JetStream did not say)",
            ["result"],
            registry=r,
        )
        # JetStream (issue 4): compensation queue and durable acks.
        self.compensation_depth = Gauge(
            "reach_compensation_depth", "Entries in REACH_COMPENSATION (read periodically)",
            registry=r,
        )  # fmt: skip
        self.compensation = Counter(
            "reach_compensation_total",
            "Compensation entries by result (replayed/expired/claimed/requeued/cancelled/"
            "mismatch by brokers; enqueued/refused by clients)",
            ["result"],
            registry=r,
        )
        self.compensation_result = {k: self.compensation.labels(k) for k in COMPENSATION_RESULTS}
        self.ack_records = Counter(
            "reach_ack_records_total", "Ack records published on reach.ack.> by state",
            ["state"], registry=r,
        )  # fmt: skip
        self.ack_record_state = {
            k: self.ack_records.labels(k) for k in ("received", "completed", "failed")
        }
        self.claims_released = Counter(
            "reach_claims_released_total",
            "Running claims (KV reach_claims) released because their agent was declared "
            "offline, so the request can run elsewhere",
            registry=r,
        )
        self.store_errors = Counter(
            "reach_store_errors_total",
            "Claim reads and writes, and the broker's own ack records, that JetStream did not "
            "take, by store and operation (claims/lookup: a compensation entry waits instead "
            "of being sent, removed or expired on a guess; claims/release: a release tried "
            "again; acks/taker, acks/answer: a record tried again until stored)",
            ["store", "op"], registry=r,
        )  # fmt: skip
        # The broker's follows of JetStream (jetstream.follow): claims, rules, the console's
        # audit trail. A lost consumer is rebuilt; until then what relies on it waits.
        self.follow_rebuilds = Counter(
            "reach_follow_rebuilds_total",
            "Consumers of a follow (claims, rules, presence, audit) made again after a loss, by "
            "why it was lost (stall: heartbeats missed; gap: a message lost; reconnect; "
            "deleted)",
            ["follow", "reason"], registry=r,
        )  # fmt: skip
        self.follow_rebuild_failures = Counter(
            "reach_follow_rebuild_failures_total",
            "Attempts to make a follow's lost consumer again that failed (each tried again "
            "with backoff until one succeeds)",
            ["follow"], registry=r,
        )  # fmt: skip
        self.follow_down = Gauge(
            "reach_follow_down",
            "1 while a follow (claims, rules, presence, audit) has lost its consumer and "
            "delivers nothing",
            ["follow"], registry=r,
        )  # fmt: skip
        self.ack_latency = Histogram(
            "reach_ack_latency_seconds",
            "Task sent (replay) or received (agent ack) to its completed/failed ack",
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300),
            registry=r,
        )

        # Routing policy (issue 18): quotas, route rules, what callers saw.
        self.quota_refused = Counter(
            "reach_quota_refused_total",
            "Route requests refused OVERLOADED for a caller's quota, by capability and caller "
            "(callers not listed in quotas.callers are 'other')",
            ["capability", "caller"], registry=r,
        )  # fmt: skip
        self.rule_changes = Counter(
            "reach_rule_changes_total", "Route rule changes applied (KV reach_rules), by action",
            ["action"], registry=r,
        )  # fmt: skip
        self.outcomes = Counter(
            "reach_outcomes_total", "Caller outcome summaries (reach.outcome.*) by result",
            ["result"], registry=r,
        )  # fmt: skip
        self.delivery_ejected = Gauge(
            "reach_delivery_ejected",
            "Agents whose delivery term is 0 (outlier or unanswered rule), by rule",
            ["rule"], registry=r,
        )  # fmt: skip
        self.partitions_owned = Gauge(
            "reach_partitions_owned", "Partitions of the fleet whose lease this broker holds",
            registry=r,
        )  # fmt: skip
        self.partition_mapping = Gauge(
            "reach_partition_mapping",
            "How this broker hears the agent subjects (1 for the mode in force): mapped (the "
            "server maps them into partitions: each owner hears its own), plain (no mapping: "
            "every broker hears all and keeps its own), mismatch (the server's partition "
            "count differs from [fleet] partitions: not ready)", ["mode"], registry=r,
        )  # fmt: skip
        self.takeovers = Histogram(
            "reach_partition_takeover_seconds",
            "Time to take a partition over: its agents restored from its snapshot keys and "
            "its subjects heard", buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5), registry=r,
        )  # fmt: skip
        self.partition_restores = Counter(
            "reach_partition_restores_total",
            "Partitions taken whose agents were read from their snapshot keys, by result: ok "
            "(at the first try), retried (at the second), failed (not read: taken without its "
            "agents, who are asked to announce again as they are heard)",
            ["result"], registry=r,
        )  # fmt: skip
        self.rtt_sample_every = Gauge(
            "reach_rtt_sample_interval_seconds",
            "How often each healthy agent this broker holds gets an RTT sample: "
            "[detection] rtt_sample_interval_s while probe_budget_per_s allows it, else "
            "healthy agents / probe_budget_per_s (0: sampling off, or no healthy agent)",
            registry=r,
        )  # fmt: skip
        self.snapshot_reads = Counter(
            "reach_snapshot_reads_total",
            "Partitions restored from KV reach_registry, by how they were read: direct (batched "
            "direct get) or watch (a consumer of the keys' last values, what a KV watch reads: "
            "the stream answers no direct get, slower)",
            ["by"], registry=r,
        )  # fmt: skip
        self.route_forwards = Counter(
            "reach_route_forwards_total",
            "Route requests forwarded to their capability's owner, by result: ok (relayed), "
            "timeout, no_owner, not_owner, stopped (refused, retryable); answered (received as "
            "owner); stand_in (answered for a gone owner)",
            ["result"], registry=r,
        )  # fmt: skip
        self.tables = Counter(
            "reach_tables_total",
            "Route-table work by kind: delta (published), request (a table asked for and "
            "answered), stored (a share written to KV reach_tables), store_failed, unseen (a "
            "table of the other owners' shares asked for again: partitions neither answered "
            "for nor stored)",
            ["kind"], registry=r,
        )  # fmt: skip

    def watch_states(self, counts: Callable[[], dict[str, int]]) -> None:
        self.registry.register(_StateCollector(counts))

    def watch_partition_beats(self, counts: list[int]) -> None:
        """``reach_partition_heartbeats_total``: the ingest's counts, read at each scrape."""
        self.registry.register(_PartitionBeats(counts))

    def follow(self, name: str) -> FollowCounters:
        """What the follow ``name`` (``claims``, ``rules``, ``presence``, ``audit``,
        ``acks``) counts into."""
        return FollowCounters(self, name)


class FollowCounters:
    """:class:`jetstream.follow.FollowMetrics` on these metrics, for one follow."""

    __slots__ = ("_down", "_failures", "_metrics", "_name")

    def __init__(self, metrics: Metrics, name: str) -> None:
        self._metrics = metrics
        self._name = name
        self._down = metrics.follow_down.labels(name)
        self._failures = metrics.follow_rebuild_failures.labels(name)
        self._down.set(0)

    def lost(self, reason: str) -> None:
        self._down.set(1)

    def rebuilt(self, reason: str) -> None:
        self._down.set(0)
        self._metrics.follow_rebuilds.labels(self._name, reason).inc()

    def failed(self) -> None:
        self._failures.inc()

    def stopped(self) -> None:
        self._down.set(0)


@dataclass(frozen=True, slots=True)
class HandlerMetrics:
    """What the message handlers count: results per inbound kind, refusals, route time."""

    route_result: dict[str, Tally]
    route_duration: Timings
    quota_refused: Counter
    heartbeat_result: dict[str, Tally]
    announce_result: dict[str, Any]
    leaves: Counter
    refused: Counter
    """``reach_dropped_total``, by kind and reason."""

    @classmethod
    def of(cls, m: Metrics) -> HandlerMetrics:
        return cls(m.route_result, m.route_duration, m.quota_refused, m.heartbeat_result,
                   m.announce_result, m.leaves, m.refused)  # fmt: skip


@dataclass(frozen=True, slots=True)
class ReplayMetrics:
    """What the compensation replay counts: how entries ended, the queue's depth, and the
    ack records it watches."""

    results: dict[str, Any]
    """``reach_compensation_total`` by result."""
    depth: Gauge
    ack_states: dict[str, Any]
    """``reach_ack_records_total`` by state."""
    ack_latency: Histogram
    refused: Counter
    """``reach_dropped_total``, by kind and reason (unattributable ack records)."""

    @classmethod
    def of(cls, m: Metrics) -> ReplayMetrics:
        return cls(m.compensation_result, m.compensation_depth, m.ack_record_state,
                   m.ack_latency, m.refused)  # fmt: skip
