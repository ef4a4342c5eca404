"""A local stack for the in-process benchmarks (``once``, ``gateway``, ``tracecost``): a
``nats-server`` with JetStream on a free loopback port, its store in a temporary directory
removed after, and a broker ``Config`` pointed at it (no metrics port). The server runs the
shipped ``configs/nats-server.conf``, or (``sync="default"``) that config with nats-server's
default fsync interval instead of ``sync_interval: always``."""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Iterator
from pathlib import Path

from reach_broker.config import Config
from reach_broker.natsserver import NatsServer, default_config

SYNC_CHOICES = ("always", "default")
"""``always``: the shipped config (``sync_interval: always``: every acknowledged write
fsynced); ``default``: the same config without that line (nats-server's default, an fsync
every 2 minutes), to measure what ``always`` costs."""


@contextlib.contextmanager
def local_stack(prefix: str, sync: str = "always") -> Iterator[tuple[Path, NatsServer, Config]]:
    """(the temporary directory, the running server, a broker config for it); the server is
    stopped and the directory removed on the way out. ``sync``: see :data:`SYNC_CHOICES`."""
    if sync not in SYNC_CHOICES:
        raise ValueError(f"sync {sync!r} is not one of {', '.join(SYNC_CHOICES)}")
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        config = default_config()
        if sync == "default" and config is not None:
            lazy = Path(tmp) / "nats-server-default-sync.conf"
            text = config.read_text()
            assert "  sync_interval: always\n" in text, "the shipped config syncs always"
            lazy.write_text(text.replace("  sync_interval: always\n", ""))
            config = lazy
        server = NatsServer(port=0, store_dir=Path(tmp) / "nats", config=config)
        server.start()
        try:
            cfg = Config()
            cfg.nats.url = server.url
            cfg.broker.metrics_port = 0
            yield Path(tmp), server, cfg
        finally:
            server.stop()
