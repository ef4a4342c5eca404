"""Every nats-server config reach ships fsyncs each acknowledged JetStream write
(``sync_interval: always``): a real server started from each reports ``sync_always`` in
``/varz``.

The configs: ``configs/nats-server.conf`` (the embedded server's, the tests', and
``docker-compose.nats.yml``'s), ``configs/cluster/*.conf`` (the local cluster and
``docker-compose.cluster.yml``'s ``docker.conf``), the operator-mode ``server.conf`` that
``reach auth init`` writes. (``reach dev-cluster``'s generated configs come from the same
template as ``configs/cluster/``; tests/test_dev_cluster.py reads their ``/varz`` too.)

Each server runs on free loopback ports given on the command line, which wins over the
file's ``listen``/``http``/``cluster``/``routes`` (a shipped node's routes name the usual
ports, where another cluster may be running); a ``store_dir`` the file names is started from
the test's tmp dir (relative), or rewritten into it (``docker.conf``'s ``/data``). The
``jetstream`` block is otherwise the file's, as shipped.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from reach_broker.auth.bootstrap import init as auth_init
from reach_broker.cluster.natsserver import SYSTEM_PASSWORD_ENV, find_binary

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = ROOT / "configs"
SHIPPED = ["nats-server.conf", *sorted(p.name for p in (CONFIGS / "cluster").glob("*.conf"))]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def varz(
    port: int, proc: subprocess.Popen[bytes], deadline_s: float = 15.0
) -> dict[str, Any] | None:
    """The server's /varz; None when the server exited first (a port it was given was taken
    meanwhile: :func:`free_port` only finds one free at the time it asks)."""
    deadline = time.monotonic() + deadline_s
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/varz", timeout=1) as r:
                return json.loads(r.read())  # type: ignore[no-any-return]
        except OSError:
            if proc.poll() is not None:
                return None
            assert time.monotonic() < deadline, f"no /varz on port {port}"
            time.sleep(0.05)


@pytest.fixture
def server_from(tmp_path: Path) -> Iterator[Any]:
    """start(config) → its /varz; every server started is stopped at teardown."""
    procs: list[subprocess.Popen[bytes]] = []

    def start(config: Path, *, cluster: bool = False) -> dict[str, Any]:
        log = tmp_path / "server.log"
        for _ in range(3):  # fresh ports when one was taken between finding and binding it
            found = attempt(config, cluster=cluster)
            if found is not None:
                return found
        raise AssertionError(f"nats-server exited 3 times: {log.read_text()[-2000:]}")

    def attempt(config: Path, *, cluster: bool) -> dict[str, Any] | None:
        text = config.read_text()
        store = re.search(r'^\s*store_dir:\s*"([^"]*)"', text, re.M)
        monitor = free_port()
        argv = [find_binary(), "-c", str(config), "-a", "127.0.0.1", "-p", str(free_port()),
                "-m", str(monitor), "-l", str(tmp_path / "server.log")]  # fmt: skip
        if store is None:  # the launcher gives the store (-sd), as `reach broker` and compose do
            argv += ["-sd", str(tmp_path / "store")]
        elif store.group(1).startswith("/") and not store.group(1).startswith(str(tmp_path)):
            config = tmp_path / config.name  # docker.conf's /data: into tmp
            config.write_text(text.replace(store.group(0), f'  store_dir: "{tmp_path / "store"}"'))
            argv[2] = str(config)
        if cluster:
            argv += ["--cluster", f"nats://127.0.0.1:{free_port()}",
                     "--routes", f"nats://127.0.0.1:{free_port()}"]  # fmt: skip
        env = {**os.environ, SYSTEM_PASSWORD_ENV: "sys-test-password-1", "NATS_SERVER_NAME": "t1"}
        quiet = subprocess.DEVNULL
        proc = subprocess.Popen(argv, cwd=tmp_path, env=env, stdin=quiet, stdout=quiet,
                                stderr=quiet)  # fmt: skip
        procs.append(proc)
        return varz(monitor, proc)

    try:
        yield start
    finally:
        for proc in procs:
            proc.kill()
            proc.wait(10)


@pytest.mark.parametrize("name", SHIPPED)
def test_a_server_from_every_shipped_config_syncs_every_write(server_from: Any, name: str) -> None:
    path = CONFIGS / name if name == "nats-server.conf" else CONFIGS / "cluster" / name
    config = server_from(path, cluster=name != "nats-server.conf")["jetstream"]["config"]
    assert config["sync_always"] is True


def test_the_operator_mode_config_reach_auth_init_writes_syncs_every_write(
    server_from: Any, tmp_path: Path
) -> None:
    d = auth_init(tmp_path / "auth")
    assert server_from(d.server_conf)["jetstream"]["config"]["sync_always"] is True


def test_the_compose_files_run_the_shipped_configs() -> None:
    """What docker compose runs is what the tests above start."""
    single = (ROOT / "docker-compose.nats.yml").read_text()
    assert "./configs/nats-server.conf:/etc/nats/nats-server.conf:ro" in single
    assert "nats-server -c /etc/nats/nats-server.conf" in single
    cluster = (ROOT / "docker-compose.cluster.yml").read_text()
    assert cluster.count("./configs/cluster/docker.conf:/etc/nats/docker.conf:ro") == 3
    assert cluster.count('command: ["-c", "/etc/nats/docker.conf"]') == 3
