"""A partition whose restore fails is tried again, then taken without its agents, counted.

Pure: the takeover's own steps with a real registry and metrics, a fake clock, and stand-ins
for the snapshot read (failing as told) and the ingest (recording what it hears). The read
itself against a real server is tests/test_snapshot_restore.py's.
"""

from __future__ import annotations

from typing import Any, cast

from jetstream.lastvalues import ReadStalled
from reach_agent.routing.table import partition
from reach_agent.wire.schema import Announce
from reach_broker.config import Config
from reach_broker.core.registry import Registry
from reach_broker.core.tokens import TokenSigner
from reach_broker.service.context import BrokerContext, Link, Tasks
from reach_broker.service.metrics import Metrics
from reach_broker.service.takeover import RESTORE_RESULTS, RESTORE_TRIES, Takeover

P = 4


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Reads:
    """``Snapshot.restore_partition``: raises the first ``failures`` times, then restores
    ``agents`` (their partition's) into the registry as the snapshot does."""

    def __init__(self, registry: Registry, clock: Clock, failures: int, agents: list[str]):
        self.registry = registry
        self.clock = clock
        self.failures = failures
        self.agents = agents
        self.tries = 0

    async def restore_partition(self, p: int, *, warm: bool) -> list[str]:
        self.tries += 1
        if self.tries <= self.failures:
            raise ReadStalled(f"try {self.tries}: 0 of 2 came in 5.0s")
        recs = []
        for agent_id in self.agents:
            ann = Announce(agent_id=agent_id, capabilities=["job"], max_concurrency=1,
                           heartbeat_interval_ms=1000)  # fmt: skip
            rec = self.registry.restore(ann, "healthy", self.clock(), 0, warm=warm)
            assert rec is not None
            recs.append(rec)
        self.registry.restored(self.clock(), recs)
        return [rec.agent_id for rec in recs]


class Hears:
    """``Ingest``: the partitions heard, in order."""

    def __init__(self) -> None:
        self.heard: list[int] = []

    async def own(self, p: int) -> None:
        self.heard.append(p)

    async def lose(self, p: int) -> None:
        self.heard.remove(p)


def taking(failures: int, agents: list[str]) -> tuple[Takeover, Reads, Hears, Registry, Metrics]:
    cfg = Config()
    clock = Clock()
    registry = Registry(cfg.detection, cfg.scoring, TokenSigner(b"k" * 32, 3600.0),
                        interval_ms=cfg.broker.interval_ms, partitions=P)  # fmt: skip
    ctx = BrokerContext(nc=cast(Any, None), subjects=cast(Any, None), broker_id="b",
                        clock=clock, wall=lambda: 1_000_000.0, spawn=Tasks().spawn,
                        emit=lambda _: None, link=Link())  # fmt: skip
    reads, hears, metrics = Reads(registry, clock, failures, agents), Hears(), Metrics()
    shared: list[tuple[int, int]] = []
    takeover = Takeover(
        ctx, registry, cast(Any, reads), cast(Any, hears),
        shares_own=lambda p, epoch: shared.append((p, epoch)), shares_lose=lambda p: None,
        restored=lambda agents: None,
        took=metrics.takeovers, restores=metrics.partition_restores, retry_after_s=0.0,
    )  # fmt: skip
    return takeover, reads, hears, registry, metrics


def restores(metrics: Metrics) -> dict[str, float]:
    return {r: metrics.partition_restores.labels(r)._value.get() for r in RESTORE_RESULTS}


def agents_of(p: int, n: int) -> list[str]:
    ids = [f"agent-{i}" for i in range(100)]
    return sorted(a for a in ids if partition(a, P) == p)[:n]


async def test_a_restore_that_fails_once_is_tried_again_and_restores_every_agent() -> None:
    agents = agents_of(2, 3)
    takeover, reads, hears, registry, metrics = taking(1, agents)
    await takeover.own(2, epoch=7, warm=True)
    assert reads.tries == 2
    assert hears.heard == [2]
    assert sorted(registry.agents) == agents
    assert {registry.agents[a].state for a in agents} == {"healthy"}  # warm: as stored
    assert restores(metrics) == {"ok": 0.0, "retried": 1.0, "failed": 0.0}


async def test_a_restore_that_keeps_failing_takes_the_partition_without_its_agents() -> None:
    agents = agents_of(1, 3)
    takeover, reads, hears, registry, metrics = taking(RESTORE_TRIES, agents)
    await takeover.own(1, epoch=3, warm=True)
    assert reads.tries == RESTORE_TRIES
    assert hears.heard == [1]  # heard all the same: its agents announce again when asked
    assert registry.agents == {}
    assert restores(metrics) == {"ok": 0.0, "retried": 0.0, "failed": 1.0}


async def test_a_restore_at_the_first_try_is_counted_ok() -> None:
    agents = agents_of(0, 2)
    takeover, reads, hears, registry, metrics = taking(0, agents)
    await takeover.own(0, epoch=1, warm=False)
    assert (reads.tries, hears.heard, sorted(registry.agents)) == (1, [0], agents)
    assert {registry.agents[a].state for a in agents} == {"suspect"}  # cold: heard first
    assert restores(metrics) == {"ok": 1.0, "retried": 0.0, "failed": 0.0}
