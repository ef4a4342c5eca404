"""The nemesis's menu of faults and its schedule, drawn from a seed (pure).

:func:`schedule` lays out one fault every ``interval`` seconds (±20 %, jittered from the
seed) from ``warmup`` until the run's end: a kind from the menu, a target free for the
fault's whole hold, and how long it holds. The same seed and options give the same
schedule; what the system does under it is what a run finds out.

| kind | what | healed by |
| --- | --- | --- |
| ``agent_kill``, ``broker_kill``, ``node_kill`` | SIGKILL | a start (same id, same store) |
| ``agent_stop``, ``broker_stop``, ``node_stop`` | SIGSTOP | SIGCONT |
| ``agent_cut``, ``broker_cut`` | its proxies close every link, refuse new ones | restore |
| ``agent_stall``, ``broker_stall`` | its proxies forward nothing (a partition) | restore |
| ``broker_restart`` | SIGTERM, then a start at once | — |

At most one NATS node and one broker are under a fault at a time (so the cluster keeps its
quorum and one broker serves), and at most half of the agents.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import msgspec

KINDS = (
    "agent_kill", "agent_stop", "agent_cut", "agent_stall",
    "broker_kill", "broker_stop", "broker_cut", "broker_stall", "broker_restart",
    "node_kill", "node_stop",
)  # fmt: skip
HOLD_S = {"kill": (1.0, 6.0), "stop": (1.0, 8.0), "cut": (1.0, 8.0), "stall": (2.0, 8.0),
          "restart": (0.0, 0.0)}  # fmt: skip
"""How long each kind of fault holds (uniform between the two), by its verb."""
RECOVERY_S = 3.0
"""A target is left alone this long after a fault is healed (a restart, a reconnect)."""
JITTER = 0.2


class Planned(msgspec.Struct, frozen=True, kw_only=True):
    at: float
    """Seconds after the run's start."""
    kind: str
    target: str
    hold: float

    @property
    def group(self) -> str:
        return self.kind.split("_", 1)[0]

    @property
    def verb(self) -> str:
        return self.kind.split("_", 1)[1]


def schedule(
    seed: int,
    *,
    duration: float,
    interval: float,
    warmup: float,
    agents: Sequence[str],
    brokers: Sequence[str],
    nodes: Sequence[str],
    kinds: Sequence[str] = KINDS,
) -> list[Planned]:
    """The faults of a run of ``duration`` seconds, in start order; each is healed by
    ``duration`` (a hold that would outlast the run is cut short)."""
    unknown = sorted(set(kinds) - set(KINDS))
    if unknown:
        raise ValueError(f"unknown fault kinds {unknown} (known: {', '.join(KINDS)})")
    rng = random.Random(seed)
    targets = {"agent": list(agents), "broker": list(brokers), "node": list(nodes)}
    at_most = {"agent": max(len(agents) // 2, 1), "broker": 1, "node": 1}
    busy: dict[str, float] = {}
    """target → when it is free again."""
    plan: list[Planned] = []
    t = warmup
    while t < duration - 1.0:
        free = {g: [tg for tg in ts if busy.get(tg, 0.0) <= t] for g, ts in targets.items()}
        options = [k for k in kinds if free[k.split("_", 1)[0]]
                   and len(targets[k.split("_", 1)[0]]) - len(free[k.split("_", 1)[0]])
                   < at_most[k.split("_", 1)[0]]]  # fmt: skip
        if options:
            kind = options[rng.randrange(len(options))]
            choices = free[kind.split("_", 1)[0]]
            target = choices[rng.randrange(len(choices))]
            lo, hi = HOLD_S[kind.split("_", 1)[1]]
            hold = round(min(rng.uniform(lo, hi), max(duration - 0.5 - t, 0.0)), 2)
            plan.append(Planned(at=round(t, 2), kind=kind, target=target, hold=hold))
            busy[target] = t + hold + RECOVERY_S
        t += interval * (1.0 + rng.uniform(-JITTER, JITTER))
    return plan
