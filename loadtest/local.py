"""A local stack for the in-process benchmarks (``once``, ``gateway``, ``tracecost``,
``callcost``): a ``nats-server`` with JetStream on a free loopback port, its store in a
temporary directory removed after, and a broker ``Config`` pointed at it (no metrics port);
and on it, :func:`echo_stack`: a broker, one echo agent and a warm client. The server runs
the shipped ``configs/nats-server.conf`` with the ``sync_interval`` asked for (the shipped
``always``, or the server's default), rendered as ``loadtest.calls`` renders it."""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import reach_agent
from reach_broker.broker import Broker
from reach_broker.cluster.natsserver import NatsServer
from reach_broker.config import Config
from reach_broker.service.metrics import Metrics

from .calls import SYNC_MODES, server_config


@contextlib.contextmanager
def local_stack(prefix: str, sync: str = "always") -> Iterator[tuple[Path, NatsServer, Config]]:
    """(the temporary directory, the running server, a broker config for it); the server is
    stopped and the directory removed on the way out. ``sync``: JetStream's
    ``sync_interval``, one of :data:`loadtest.calls.SYNC_MODES` (the shipped ``always``, or
    the server's ``default``)."""
    if sync not in SYNC_MODES:
        raise ValueError(f"sync {sync!r} is not one of {', '.join(SYNC_MODES)}")
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        config = Path(tmp) / f"nats-server-sync-{sync}.conf"
        config.write_text(server_config(sync))
        server = NatsServer(port=0, store_dir=Path(tmp) / "nats", config=config)
        server.start()
        try:
            cfg = Config()
            cfg.nats.url = server.url
            cfg.broker.metrics_port = 0
            yield Path(tmp), server, cfg
        finally:
            server.stop()


@contextlib.asynccontextmanager
async def echo_stack(prefix: str, capability: str, warm: int = 50) -> AsyncIterator[
    reach_agent.Client
]:  # fmt: skip
    """A local stack with an in-process broker and one in-process agent (``echo``, no
    claims, no durable acks: the lightest call path) answering ``capability``; yields a
    client that has made ``warm`` calls (route cached, connections hot)."""
    with local_stack(prefix) as (_, server, cfg):
        broker = Broker(cfg, metrics=Metrics())
        await broker.start()
        agent = reach_agent.Agent("echo", [capability], durable_acks=False, claims=False)

        @agent.handler(capability)
        async def echo(task: reach_agent.Task) -> int:
            return 1

        await agent.start(server.url)
        try:
            async with reach_agent.Client(server.url) as client:
                for _ in range(warm):
                    await client.call(capability, {}, timeout=10)
                yield client
        finally:
            await agent.stop(grace=1)
            await broker.stop()
