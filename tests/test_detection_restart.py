"""A broker restarted with its snapshot judges the agents it restored only on a silence it
could hear: its start takes seconds between reading the snapshot and subscribing to
heartbeats (the components start in between; starved of CPU, or waiting on a server, far
longer), and that wait is not the agents' silence (the nemesis's offline_while_healthy).

The rule, pure and on a fake clock: :meth:`Registry.listening` counts a restored agent's
window again from when the broker can hear it, plus one interval of grace. A warm restore (a
partition a live broker held until moments ago) keeps the state its snapshot holds, which
its first heartbeat confirms without a move; a cold one (a broker's own start, alone) starts
it ``suspect``, routable once heard. Then the restart against a real nats-server, its start
held up past the restored agents' window: at once (the leases handed back: warm), and after
the leases aged out (cold)."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from reach_agent.connection import flush_subscriptions
from reach_agent.wire.schema import AgentState, Announce, Event, Heartbeat
from reach_agent.wire.subjects import AGENTS as SYNADIA_AGENTS
from reach_broker.broker import Broker
from reach_broker.cluster.natsserver import NatsServer
from reach_broker.config import Config
from reach_broker.core.records import Transition
from reach_broker.core.registry import Registry
from reach_broker.core.tokens import TokenSigner
from reach_broker.service.metrics import Metrics

from .conftest import BrokerFactory, fast_config, leases_aged_out, wait_for
from .detection_agents import Transitions, agents

SUSPECT_S = 2.4030003110436975
"""A young agent's suspect window at a 1 s interval: phi 8 over the prior of five 1 s
samples (mean 1 s, std floored at 0.25 s), below the fixed 3 intervals."""
OFFLINE_S = 3.0555205540326087
"""Its offline window: phi 16 over the same prior, below the fixed 6 intervals."""


def restored(*agent_ids: str, state: AgentState = "healthy", warm: bool = True) -> Registry:
    """A registry that restored ``agent_ids`` (``state`` in the snapshot, 1 s interval) at
    0.0, warm or cold."""
    cfg = Config()
    reg = Registry(
        cfg.detection,
        cfg.scoring,
        TokenSigner(b"k" * 32, 3600.0, wall=lambda: 1_000_000.0),
        interval_ms=cfg.broker.interval_ms,
    )
    for agent_id in agent_ids:
        ann = Announce(agent_id=agent_id, capabilities=["summarize"], max_concurrency=4,
                       heartbeat_interval_ms=1000)  # fmt: skip
        assert reg.restore(ann, state, 0.0, 0, warm=warm) is not None
    reg.restored(0.0)
    return reg


def moves(ts: list[Transition]) -> list[tuple[str, str | None, str | None, str]]:
    return [(t.agent_id, t.from_, t.to, t.reason) for t in ts]


def beat(reg: Registry, agent_id: str, seq: int, now: float) -> list[Transition]:
    hb = Heartbeat(agent_id=agent_id, token=reg.signer.issue(agent_id), seq=seq)
    result, ts = reg.heartbeat(hb, now, 0)
    assert result == "accepted"
    return ts


def test_a_restored_agent_is_judged_from_when_the_broker_listens_plus_an_interval() -> None:
    reg = restored("alpha")
    assert reg.agents["alpha"].state == "healthy"  # warm: as the snapshot holds it
    # The start took 5 s (past the window counted from the restore): nobody is judged yet.
    assert reg.listening(5.0) == 1
    assert reg.expire(5.0) == []
    assert reg.expire(5.0 + 1.0 + SUSPECT_S - 0.01) == []
    # Silent through its whole window from then on: it moves as any silent agent does.
    assert moves(reg.expire(5.0 + 1.0 + SUSPECT_S + 0.01)) == [
        ("alpha", "healthy", "suspect", "no heartbeat for 3.41s (interval 1s)")
    ]
    assert reg.expire(5.0 + 1.0 + OFFLINE_S - 0.01) == []
    assert moves(reg.expire(5.0 + 1.0 + OFFLINE_S + 0.01)) == [
        ("alpha", "suspect", "offline", "no heartbeat for 4.07s (interval 1s)")
    ]
    assert reg.listening(20.0) == 0  # once per restore


def test_a_cold_restored_agent_is_suspect_and_judged_from_when_the_broker_listens() -> None:
    reg = restored("alpha", warm=False)
    rec = reg.agents["alpha"]
    assert (rec.state, reg.counts["suspect"], reg.counts["healthy"]) == ("suspect", 1, 0)
    # The start took 5 s (past the window counted from the restore): nobody is judged yet.
    assert reg.listening(5.0) == 1
    assert reg.expire(5.0) == []
    assert reg.expire(5.0 + 1.0 + OFFLINE_S - 0.01) == []
    assert moves(reg.expire(5.0 + 1.0 + OFFLINE_S + 0.01)) == [
        ("alpha", "suspect", "offline", "no heartbeat for 4.07s (interval 1s)")
    ]
    assert reg.listening(20.0) == 0  # once per restore


@pytest.mark.parametrize("warm", [True, False], ids=["warm", "cold"])
def test_the_first_heartbeat_after_listening_confirms_and_is_not_a_sample(warm: bool) -> None:
    reg = restored("alpha", warm=warm)
    reg.listening(5.0)
    confirmed = [] if warm else [("alpha", "suspect", "healthy", "heartbeat resumed")]
    assert moves(beat(reg, "alpha", 1, 5.9)) == confirmed
    rec = reg.agents["alpha"]
    assert rec.state == "healthy"
    assert len(rec.window) == 0  # restore -> first beat measured the broker's start
    assert rec.resync is False
    assert beat(reg, "alpha", 2, 6.9) == []
    assert list(rec.window._samples) == [1.0]


@pytest.mark.parametrize(
    ("warm", "stored", "restored_as", "first", "second"),
    [
        (True, "healthy", "healthy", [], []),
        (True, "suspect", "suspect", [("suspect", "healthy", "heartbeat resumed")], []),
        (True, "recovering", "recovering", [], [("recovering", "healthy", "heartbeats on time")]),
        (True, "offline", "offline", [("offline", "recovering", "heartbeat resumed")], []),
        (True, "draining", "draining", [], []),
        (False, "healthy", "suspect", [("suspect", "healthy", "heartbeat resumed")], []),
        (False, "suspect", "suspect", [("suspect", "healthy", "heartbeat resumed")], []),
        (False, "recovering", "suspect", [("suspect", "healthy", "heartbeat resumed")], []),
        (False, "offline", "offline", [("offline", "recovering", "heartbeat resumed")], []),
        (False, "draining", "draining", [], []),
    ],
)
def test_a_restored_agent_starts_as_its_restore_says_and_moves_only_as_it_would_have(
    warm: bool,
    stored: AgentState,
    restored_as: AgentState,
    first: list[tuple[str, str, str]],
    second: list[tuple[str, str, str]],
) -> None:
    """Warm: the stored state, and what the previous owner would have made of the same
    heartbeats (a transition only where the stored state itself moves). Cold: ``suspect``
    until heard (``offline`` and ``draining`` kept)."""
    reg = restored("alpha", state=stored, warm=warm)
    assert reg.agents["alpha"].state == restored_as
    assert reg.counts[restored_as] == 1
    reg.listening(1.0)
    assert [m[1:] for m in moves(beat(reg, "alpha", 1, 1.5))] == first
    assert [m[1:] for m in moves(beat(reg, "alpha", 2, 2.5))] == second


@pytest.mark.parametrize("warm", [True, False], ids=["warm", "cold"])
def test_an_agent_heard_before_the_broker_listens_keeps_its_own_clock(warm: bool) -> None:
    reg = restored("alpha", "beta", warm=warm)
    confirmed = [] if warm else [("alpha", "suspect", "healthy", "heartbeat resumed")]
    assert moves(beat(reg, "alpha", 1, 0.5)) == confirmed
    suspect_at = reg.agents["alpha"].suspect_at
    assert reg.listening(5.0) == 1  # beta only
    assert reg.agents["alpha"].suspect_at == suspect_at
    assert reg.agents["beta"].last_seen == 5.0


# --- the restart, against a real nats-server ------------------------------------------------

HEARTBEAT_MS = 500
"""The agents' interval: their window (1.53 s, phi over the prior) is shorter than the
held-up start below."""
AGENT_IDS = ("r1", "r2")


async def never_answer(msg: Msg) -> None:
    """A Synadia agent's service that takes the discovery request and never answers: the
    restarted broker's start waits its whole 2 s between the restore and its heartbeat
    subscription, as a start starved of CPU or waiting on a slow cluster does."""


@pytest.mark.parametrize("warm", [True, False], ids=["warm", "cold"])
async def test_a_restarted_broker_declares_no_heartbeating_restored_agent_offline(
    nats_server: NatsServer, nc: NATS, broker_factory: BrokerFactory, warm: bool
) -> None:
    """Warm: started at once, the first broker's leases handed back. Cold: started alone
    once they aged out (an outage longer than their 2 s time to live)."""
    # share 1.0: the observer never holds, so a wrong offline shows rather than being held.
    overrides: dict[str, Any] = {"detection__observer_suspect_share": 1.0}
    if not warm:
        overrides["fleet__lease_ttl_s"] = 2.0
    first = await broker_factory(**overrides)
    specs = ((a, ["--heartbeat-ms", str(HEARTBEAT_MS)]) for a in AGENT_IDS)
    async with agents(nats_server.url, *specs):
        reg = first.registry
        await wait_for(lambda: all(a in reg.agents and reg.agents[a].state == "healthy"
                                   for a in AGENT_IDS), 10, what="agents healthy")  # fmt: skip
        await wait_for(lambda: first.snapshot.writes >= len(AGENT_IDS), 10, what="snapshot")
        await first.stop()
        if not warm:
            await leases_aged_out(nc)

        await nc.subscribe(SYNADIA_AGENTS.info, cb=never_answer)
        await flush_subscriptions(nc)
        events: list[Event] = []

        async def on_event(msg: Msg) -> None:
            events.append(msgspec.json.decode(msg.data, type=Event))

        await nc.subscribe("reach.event.state.*", cb=on_event)
        await flush_subscriptions(nc)
        seen = Transitions()
        second = Broker(fast_config(nats_server.url, **overrides), metrics=Metrics(),
                        watchers=[seen])  # fmt: skip
        clock = second.clock
        await second.start()
        try:
            began = clock()
            assert second.snapshot.restored == len(AGENT_IDS)
            restored_at = min(r.state_since for r in second.registry.agents.values())
            # The start was held up past the window counted from the restore.
            assert began - restored_at > 1.6, began - restored_at
            assert second.partitions.cold == (0 if warm else 32)
            if warm:
                await warm_restart_judged(second, seen, events)
            else:
                await cold_restart_judged(second, seen, events)
        finally:
            await second.stop()


async def warm_restart_judged(second: Broker, seen: Transitions, events: list[Event]) -> None:
    """Restored as the snapshot holds them (healthy), each then confirmed by its first
    heartbeat (its resync consumed), and none declared offline."""
    agents_of = second.registry.agents
    await wait_for(lambda: not any(agents_of[a].resync for a in AGENT_IDS), 5,
                   what="every restored agent heard")  # fmt: skip
    # Two more windows of 1.53 s: no heartbeating agent is declared offline (a starved agent
    # process may still be suspected: that is detection at work, and its first move then
    # starts from healthy, for silence).
    clock = second.clock
    deadline = clock() + 3.2
    await wait_for(lambda: clock() >= deadline, 5)
    for agent_id in AGENT_IDS:
        moves = seen.of(agent_id)
        assert [m for m in moves if m[1] == "offline"] == [], moves
        if moves:
            assert moves[0][:2] == ("healthy", "suspect"), moves
            assert moves[0][2].startswith("no heartbeat for "), moves
    # No event the restart made by itself: the events are exactly those moves.
    made = sum(len(seen.of(a)) for a in AGENT_IDS)
    await wait_for(lambda: len(events) == made, 5, what=f"{made} events")
    for agent_id in AGENT_IDS:
        got = [(e.from_, e.to, e.reason) for e in events if e.agent_id == agent_id]
        assert got == seen.of(agent_id)


async def cold_restart_judged(second: Broker, seen: Transitions, events: list[Event]) -> None:
    """Restored ``suspect`` at a cold start, each made ``healthy`` by its first heartbeat,
    and none declared offline."""
    await wait_for(lambda: all(seen.of(a) for a in AGENT_IDS), 5, what="judged")
    # Two more windows of 1.53 s: no heartbeating agent is declared offline (a starved agent
    # process may still be suspected again: that is detection at work).
    clock = second.clock
    deadline = clock() + 3.2
    await wait_for(lambda: clock() >= deadline, 5)
    for agent_id in AGENT_IDS:
        moves = seen.of(agent_id)
        assert moves[0] == ("suspect", "healthy", "heartbeat resumed"), moves
        assert [m for m in moves if m[1] == "offline"] == [], moves
    await wait_for(lambda: {e.agent_id for e in events} == set(AGENT_IDS), 5, what="events")
    first_moves = {e.agent_id: (e.from_, e.to) for e in reversed(events)}
    assert first_moves == dict.fromkeys(AGENT_IDS, ("suspect", "healthy"))
    assert [e for e in events if e.to == "offline"] == []
