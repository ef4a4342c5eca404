"""The system under test: a ``nats-server`` (unless ``--server``), the broker as a child
process (unless ``--no-broker``), and the run's own control connection.

:meth:`Infra.start` returns a :class:`System`, what the phases need of it; :meth:`Infra.close`
ends everything the run started (the control connection, every child, the server, the
temporary broker config), whether the run finished or not.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import tempfile
import time
from typing import Any, NamedTuple

import nats
from msgspec import UNSET, UnsetType

from reach_agent.connection import connect_options
from reach_agent.wire.subjects import Subjects
from reach_broker.cluster.natsserver import NatsServer

from .children import Children, free_port
from .observe import Observer
from .report import Figures

log = logging.getLogger(__name__)


class BrokerSetup(Figures, frozen=True, kw_only=True):
    broker_config: dict[str, int] | UnsetType = UNSET
    """What differs from the broker's defaults (absent when ``--broker-config`` or
    ``--no-broker`` decides the broker's settings)."""


class System(NamedTuple):
    """The running system, as the phases see it."""

    url: str
    broker_pid: int | None
    """None with ``--no-broker``: no CPU or RSS figures then."""
    server_pid: int | None
    """None with ``--server``: the server is not ours to measure."""
    observer: Observer
    setup: BrokerSetup


class Infra:
    """Starts and ends the server, the broker and the control connection of one run."""

    def __init__(self, args: argparse.Namespace, children: Children) -> None:
        self.args = args
        self.children = children
        self.server: NatsServer | None = None
        self.nc: Any = None
        self._tmp: tempfile.TemporaryDirectory[str] | None = None

    def _broker_toml(self) -> tuple[str, dict[str, int]]:
        """Defaults, except the fleet-wide in-flight ceiling: 5000 (the default) is for fleets
        far smaller than 10,000 agents each reporting a few running tasks."""
        ceiling = max(5000, 20 * self.args.agents)
        self._tmp = tempfile.TemporaryDirectory(prefix="reach-loadtest-")
        path = os.path.join(self._tmp.name, "broker.toml")
        with open(path, "w") as f:
            f.write(f"[routing]\ninflight_ceiling = {ceiling}\n")
        return path, {"routing.inflight_ceiling": ceiling}

    async def start(self) -> System:
        a = self.args
        url = a.server or ""
        monitor_url: str | None = None
        if not url:
            # The monitoring port tells whether the server itself dropped messages (slow
            # consumers): drops the broker cannot see or count.
            monitor_url = f"http://127.0.0.1:{free_port()}"
            self.server = NatsServer(port=0, extra_args=["-m", monitor_url.rsplit(":", 1)[1]])
            await asyncio.to_thread(self.server.start)
            url = self.server.url
            log.info("nats-server %s pid %s", url, self.server.pid)
        metrics_url = a.metrics_url
        broker = None
        setup = BrokerSetup()
        if not a.no_broker:
            port = free_port()
            metrics_url = f"http://127.0.0.1:{port}/metrics"
            config = a.broker_config
            if not config:
                config, changed = self._broker_toml()
                setup = BrokerSetup(broker_config=changed)
            broker = await self.children.broker(
                url, a.prefix, port, config, profile=a.profile_broker, verbose=a.verbose
            )
            log.info("broker pid %s, metrics %s", broker.pid, metrics_url)
        subjects = Subjects(a.prefix)
        self.nc = await nats.connect(**connect_options("loadtest-control", url))
        observer = Observer(self.nc, subjects, metrics_url, monitor_url)
        deadline = time.monotonic() + 30
        while True:  # the broker answers reach.agents once it is up
            try:
                await self.nc.request(subjects.agents, b"{}", timeout=1)
                await observer.metrics()
                break
            except Exception:
                if time.monotonic() > deadline or (broker and not broker.alive()):
                    raise RuntimeError("the broker did not come up within 30 s") from None
                await asyncio.sleep(0.2)
        return System(
            url=url,
            broker_pid=broker.pid if broker else None,
            server_pid=self.server.pid if self.server else None,
            observer=observer,
            setup=setup,
        )

    def pids(self) -> dict[str, int]:
        """Every process this run started (the report lists them; none outlives the run)."""
        out = self.children.pids()
        if self.server is not None and self.server.pid is not None:
            out["nats-server"] = self.server.pid
        return out

    async def close(self) -> None:
        """The control connection, every child (last started first), the server, the tmp dir."""
        if self.nc is not None:
            with contextlib.suppress(Exception):
                await self.nc.close()
        await self.children.stop_all()
        if self.server is not None:
            await asyncio.to_thread(self.server.stop)
        if self._tmp is not None:
            self._tmp.cleanup()
