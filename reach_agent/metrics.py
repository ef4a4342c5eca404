"""Prometheus metrics of the SDK, off by default: pass ``metrics=`` to enable them.

``ClientMetrics`` carries the names the field reports use for callers:
``reach_request_total{agent_id,result}``, ``reach_request_duration_seconds`` and
``reach_circuit_breaker_open{agent_id,capability}`` (0/1), plus
``reach_compensation_total{result=enqueued|duplicate|refused|unavailable|mismatch}`` for
``submit()`` and ``reach_wait_total{result=completed|failed|timeout|unavailable|invalid}`` for
``wait()``.
``AgentMetrics`` counts what an agent did with the tasks it was handed. Labels are bounded
(agent ids of the fleet, results, capabilities); never a request id.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

REQUEST_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 120.0)


class ClientMetrics:
    """What a :class:`reach_agent.Client` saw, per attempt and per call."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "reach_request_total",
            "Task attempts by target agent and result (ok, or the error code)",
            ["agent_id", "result"],
            registry=r,
        )
        self.duration = Histogram(
            "reach_request_duration_seconds",
            "Time from call() to its final outcome, retries included",
            buckets=REQUEST_BUCKETS,
            registry=r,
        )
        self.breaker_open = Gauge(
            "reach_circuit_breaker_open",
            "1 while the client's breaker for (agent, capability) is open or half-open",
            ["agent_id", "capability"],
            registry=r,
        )
        self.compensation = Counter(
            "reach_compensation_total",
            "Compensation queue entries by result, as the caller saw them "
            "(enqueued, duplicate, refused, unavailable, mismatch); the broker counts replayed "
            "and expired",
            ["result"],
            registry=r,
        )
        self.waits = Counter(
            "reach_wait_total",
            "Client.wait outcomes: the final record's state (completed, failed), or why none "
            "was returned (timeout, unavailable: REACH_ACKS could not be read, invalid)",
            ["result"],
            registry=r,
        )
        self.route_fallbacks = Counter(
            "reach_route_cache_fallbacks_total",
            "Route requests answered from the local cache because no broker answered",
            registry=r,
        )
        self.route_broker_waits = Counter(
            "reach_route_broker_waits_total",
            "Waits of a call for a broker: no broker answered its route request and no "
            "cached route was left (asked again within the call's deadline)",
            registry=r,
        )


class AgentMetrics:
    """What an :class:`reach_agent.Agent` did with the tasks it received."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self.tasks = Counter(
            "reach_agent_tasks_total",
            "Tasks by capability and result (ok, rejected, failed, busy, draining, duplicate, "
            "in_progress, unclaimed, unstored, mismatch, loop, invalid, bad_reply)",
            ["capability", "result"],
            registry=self.registry,
        )
        self.store_errors = Counter(
            "reach_agent_store_errors_total",
            "Failures of the stores the agent's guarantees rest on, by store (claims: KV "
            "reach_claims; acks: the ack sink) and operation (claim: a task refused "
            "STORE_UNAVAILABLE; end: a claim's end retried; orphan: a claim stored although "
            "unconfirmed, for a refused task, released; received: a task refused, its "
            "'received' record not written; final: a final record not written)",
            ["store", "op"],
            registry=self.registry,
        )
        self.nats_errors = Counter(
            "reach_agent_nats_errors_total",
            "Errors reported by the agent's NATS connection, by kind (slow_consumer, "
            "permission, ...)",
            ["kind"],
            registry=self.registry,
        )
