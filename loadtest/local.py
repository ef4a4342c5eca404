"""A local stack for the in-process benchmarks (``once``, ``gateway``, ``tracecost``): a
``nats-server`` with JetStream on a free loopback port, its store in a temporary directory
removed after, and a broker ``Config`` pointed at it (no metrics port)."""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Iterator
from pathlib import Path

from reach_broker.cluster.natsserver import NatsServer
from reach_broker.config import Config


@contextlib.contextmanager
def local_stack(prefix: str) -> Iterator[tuple[Path, NatsServer, Config]]:
    """(the temporary directory, the running server, a broker config for it); the server is
    stopped and the directory removed on the way out."""
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        server = NatsServer(port=0, store_dir=Path(tmp) / "nats")
        server.start()
        try:
            cfg = Config()
            cfg.nats.url = server.url
            cfg.broker.metrics_port = 0
            yield Path(tmp), server, cfg
        finally:
            server.stop()
