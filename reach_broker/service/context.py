"""What a broker component is handed instead of the broker: :class:`BrokerContext`.

The context holds only what every component shares: the connection, the clocks, subjects,
the broker's id, a task spawner, where transitions go (``emit``: the broker's one
:class:`~reach_broker.service.fanout.Fanout`) and the broker's own :class:`Link`. Its own
config section, its own metrics and exactly the collaborators it uses (the registry, the
router, the prober) a component gets beside it, from the one place the broker is built
(:mod:`reach_broker.broker`). None of them sees the broker, so each can be built and tested
on its own.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from nats.aio.client import Client as NATS

from reach_agent.wire.subjects import Subjects
from reach_broker.core.records import Transition

Emit = Callable[[list[Transition]], None]
"""Hands registry changes to the broker's pipeline (events, counts, log, consumers)."""


class Tasks:
    """Short background tasks the broker owns (event publishes, a reconcile): spawned
    without being awaited, waited for (then cancelled) at stop."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[Any]] = set()

    def spawn(self, coro: Awaitable[Any], name: str) -> None:
        task = asyncio.ensure_future(coro)
        task.set_name(name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def settle(self, grace_s: float) -> None:
        """Wait up to ``grace_s`` for the running tasks, then cancel what is left."""
        if not self._tasks:
            return
        await asyncio.wait(self._tasks, timeout=grace_s)
        for task in list(self._tasks):
            task.cancel()


class Link:
    """The broker's own link to NATS as its components see it: whether the server enforces
    identities on it (set by the broker once connected), whether it is up (set by the
    observer from the connection's callbacks)."""

    __slots__ = ("connected", "epoch", "secured", "since")

    def __init__(self) -> None:
        self.connected = True
        """False from the connection's loss to its return."""
        self.epoch = 0
        """Outages so far: a measurement spanning a change of epoch spans an outage."""
        self.since = 0.0
        """Monotonic time of the last loss or return."""
        self.secured = False
        """The server enforces identities and the broker authenticated with a user JWT
        (``reach_auth_enabled``): reach's roles are the server's permissions."""

    def opened(self, secured: bool) -> None:
        """Connected: whether the server enforces identities on this link."""
        self.secured = secured

    def lost(self, now: float) -> None:
        self.connected = False
        self.epoch += 1
        self.since = now

    def regained(self, now: float) -> None:
        self.connected = True
        self.epoch += 1
        self.since = now


@dataclass(frozen=True, kw_only=True, slots=True)
class BrokerContext:
    """The broker's shared parts, as one component sees them."""

    nc: NATS
    """The broker's connection (connected before any component starts)."""
    subjects: Subjects
    broker_id: str
    clock: Callable[[], float]
    """Monotonic seconds: every deadline and duration."""
    wall: Callable[[], float]
    """Unix seconds: timestamps that leave the process."""
    spawn: Callable[[Awaitable[Any], str], None]
    """Run a short task in the background; the broker waits for it at stop."""
    emit: Emit
    """Where the registry changes a component makes go (the broker's pipeline)."""
    link: Link
    """The broker's own link: a measurement across its outage is not the agent's."""
    spans: Any = None
    """OpenTelemetry spans of route requests (:mod:`reach_agent.otel`; None: off)."""

    def wall_ms(self) -> int:
        return int(self.wall() * 1000)
