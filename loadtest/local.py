"""A local stack for the in-process benchmarks (``once``, ``gateway``, ``tracecost``): a
``nats-server`` with JetStream on a free loopback port, its store in a temporary directory
removed after, and a broker ``Config`` pointed at it (no metrics port). The server runs the
shipped ``configs/nats-server.conf`` with the ``sync_interval`` asked for (the shipped
``always``, or the server's default), rendered as ``loadtest.calls`` renders it."""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Iterator
from pathlib import Path

from reach_broker.cluster.natsserver import NatsServer
from reach_broker.config import Config

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
