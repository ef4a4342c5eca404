"""A frozen agent (SIGSTOP: alive to the kernel, silent on the bus) leaves the routes on
heartbeat silence (phi / missed intervals) and comes back when it thaws (SIGCONT)."""

from __future__ import annotations

import os
import signal

from nats.aio.client import Client as NATS

from reach_agent.schema import RouteRequest
from reach_broker.natsserver import NatsServer

from .conftest import BrokerFactory, wait_for
from .detection_agents import Transitions, agents

HB = ["--heartbeat-ms", "300"]


async def test_frozen_agent_leaves_the_routes_and_returns_on_sigcont(
    nats_server: NatsServer, nc: NATS, broker_factory: BrokerFactory
) -> None:
    broker = await broker_factory()
    seen = Transitions(broker)
    reg = broker.registry

    def routed() -> list[str]:
        got = broker.router.route("summarize", RouteRequest(limit=3), broker.clock())
        return sorted(c.agent_id for c in got)

    async with agents(nats_server.url, ("cold", HB), ("warm", HB)) as procs:
        # Enough heartbeats for phi to have a history of its own.
        await wait_for(lambda: len(reg.agents["cold"].window) >= 6, 10, what="cold history")
        assert routed() == ["cold", "warm"]
        os.kill(procs["cold"].pid, signal.SIGSTOP)
        try:
            await wait_for(lambda: seen.reached("cold", "suspect"), 5.0, what="cold suspect")
            assert routed() == ["warm"]
            frm, to, reason = seen.of("cold")[0]
            assert (frm, to) == ("healthy", "suspect")
            assert reason.startswith("no heartbeat for "), reason
            assert reason.endswith(" (interval 0.3s)"), reason
            # The deadline that fired: phi's, bounded by the fixed ceiling of 3 intervals.
            rec = reg.agents["cold"]
            assert rec.suspect_at - rec.last_seen <= 3 * 0.3 + 1e-9
        finally:
            os.kill(procs["cold"].pid, signal.SIGCONT)
        await wait_for(lambda: reg.agents["cold"].state == "healthy", 5.0, what="cold healthy")
        assert seen.of("cold")[-1][1:] in {("healthy", "heartbeat resumed"),
                                           ("healthy", "probe answered"),
                                           ("healthy", "heartbeats on time")}  # fmt: skip
        assert routed() == ["cold", "warm"]
        assert seen.of("warm") == []
