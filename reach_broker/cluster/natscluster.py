"""N ``nats-server`` processes routed into one JetStream cluster on loopback.

Used by ``reach dev-cluster`` (:mod:`reach_broker.cluster.devcluster`) and by the tests' cluster
fixture. Every node's config comes from one template (:mod:`reach_broker.cluster.clusterconfig`).

The cluster is *ready* when every running node's ``/jsz`` (monitoring port) names the same
meta leader, that leader sees every other running node as a current peer, and every running
node's ``/healthz`` answers 200 (its JetStream is current with the meta leader). An R3 stream
can be created at once after that. See :func:`meta_leader`.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .clusterconfig import (
    ClusterError,
    NodeConfig,
    PortInUse,
    check_ports_free,
    plan,
    render_config,
)
from .natsserver import find_binary

log = logging.getLogger(__name__)

NODE_READY_TIMEOUT_S = 10.0
STOP_GRACE_S = 10.0
_READY_LINE = "Server is ready"
_IN_USE_RE = re.compile(r"listen tcp ([^ ]+?):(\d+): bind: address already in use")
_FATAL_RE = re.compile(r"\[FTL\] (.*)")


# --- one node -----------------------------------------------------------------------------


def die_with_parent() -> Callable[[], None] | None:
    """A ``preexec_fn`` that has the child SIGTERMed when this process dies (Linux
    ``PR_SET_PDEATHSIG``); ``None`` elsewhere, where ``--stop`` and the PIDs in the state file
    are the fallback. Linux sends the signal when the *thread* that forked exits: fork from
    the main thread (or one that lives as long as the children)."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    parent = os.getpid()

    def preexec() -> None:
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
        if os.getppid() != parent:  # the parent died before prctl took effect
            os._exit(1)

    return preexec


@dataclass
class Node:
    """One cluster node: its config, its files, its process."""

    config: NodeConfig
    dir: Path
    """Where its config (``<name>.conf``) and log (``<name>.log``) live."""
    binary: str
    proc: subprocess.Popen[bytes] | None = field(default=None, repr=False)
    _log_offset: int = field(default=0, repr=False)

    @property
    def name(self) -> str:
        return self.config.name

    @property
    def url(self) -> str:
        return self.config.url

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    @property
    def conf_path(self) -> Path:
        return self.dir / f"{self.name}.conf"

    @property
    def log_path(self) -> Path:
        return self.dir / f"{self.name}.log"

    @property
    def argv(self) -> list[str]:
        return [self.binary, "-c", str(self.conf_path)]

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def spawn(self, *, die_with_parent_: bool = False, new_session: bool = False) -> None:
        """Write the config and start the process (not waiting for it to be ready)."""
        if self.running():
            return
        # 0600 from the start: it may carry the sys password
        fd = os.open(self.conf_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as conf:
            os.fchmod(conf.fileno(), 0o600)
            conf.write(render_config(self.config))
        with open(self.log_path, "ab") as logfile:
            self._log_offset = logfile.tell()  # a restart appends: read only its own lines
            self.proc = subprocess.Popen(
                self.argv, stdin=subprocess.DEVNULL, stdout=logfile, stderr=subprocess.STDOUT,
                start_new_session=new_session,
                preexec_fn=die_with_parent() if die_with_parent_ else None,
            )  # fmt: skip
        log.debug("cluster.node.spawned name=%s pid=%d", self.name, self.proc.pid)

    def wait_listening(self, timeout: float = NODE_READY_TIMEOUT_S) -> None:
        """Wait for the server's "ready" log line; a fatal line or an exit is an error."""
        assert self.proc is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            exited = self.proc.poll() is not None  # before reading: its last words too
            with open(self.log_path, "rb") as f:
                f.seek(self._log_offset)
                text = f.read().decode(errors="replace")
            if exited:
                self.proc = None
                raise _start_error(self.config, text)
            if _READY_LINE in text and _accepts(self.config.host, self.config.client_port):
                return
            time.sleep(0.02)
        raise ClusterError(
            f"{self.name} did not get ready within {timeout} s (see {self.log_path})"
        )

    def kill(self) -> None:
        """SIGKILL, keeping the store dir (restart with :meth:`spawn`)."""
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()

    def stop(self, grace: float = STOP_GRACE_S) -> int | None:
        """SIGTERM, then SIGKILL after ``grace``; returns the exit code (``None``: not ours)."""
        proc, self.proc = self.proc, None
        if proc is None:
            return None
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(grace)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        return proc.returncode

    def get(self, path: str, timeout: float = 1.0) -> tuple[int, Any]:
        """GET a monitoring endpoint: (status, decoded JSON body); (0, None) if unreachable."""
        try:
            with urllib.request.urlopen(self.config.monitor_url + path, timeout=timeout) as resp:
                return resp.status, json.loads(resp.read())
        except urllib.error.HTTPError as exc:
            return exc.code, None
        except (OSError, ValueError):
            return 0, None


def _start_error(config: NodeConfig, text: str) -> ClusterError:
    in_use = _IN_USE_RE.search(text)
    if in_use:
        port = int(in_use.group(2))
        role = {config.client_port: "client", config.cluster_port: "cluster",
                config.monitor_port: "monitor"}.get(port, "listen")  # fmt: skip
        return PortInUse(config.host, port, f"{config.name} {role}")
    fatal = _FATAL_RE.search(text)
    reason = fatal.group(1) if fatal else (text.strip().splitlines() or ["no output"])[-1]
    return ClusterError(f"{config.name} exited at start: {reason}")


def _accepts(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.5):
            return True
    except OSError:
        return False


# --- the readiness signal -----------------------------------------------------------------


def meta_leader(jsz: dict[str, Any]) -> str | None:
    """The meta leader the given nodes agree on, or ``None`` while they don't.

    ``jsz`` maps each *running* node's name to its ``/jsz`` body (``None``: unreachable).
    Agreement means: every node names the same leader, the leader is one of them, and the
    leader's peer list marks every other running node ``current``.
    """
    leaders = set()
    for body in jsz.values():
        if not body:
            return None
        leaders.add((body.get("meta_cluster") or {}).get("leader"))
    if len(leaders) != 1:
        return None
    (leader,) = leaders
    if not leader or leader not in jsz:
        return None
    peers = {
        p.get("name"): p.get("current") for p in jsz[leader]["meta_cluster"].get("replicas") or []
    }
    if any(peers.get(name) is not True for name in jsz if name != leader):
        return None
    return str(leader)


class Cluster:
    """Nodes ``n1``…``nN`` under ``dir`` (configs, logs, ``n<i>/`` JetStream stores).

    Not thread-safe; the methods block (tests call them through ``asyncio.to_thread``).
    """

    def __init__(self, configs: Sequence[NodeConfig], dir: Path, *, binary: str | None = None):
        self.dir = dir
        self.binary = binary or find_binary()
        self.nodes = [Node(c, dir, self.binary) for c in configs]

    @property
    def urls(self) -> list[str]:
        return [n.url for n in self.nodes]

    @property
    def pids(self) -> list[int | None]:
        return [n.pid for n in self.nodes]

    def node(self, name: str) -> Node:
        for n in self.nodes:
            if n.name == name:
                return n
        raise KeyError(f"no node named {name!r} (nodes: {[n.name for n in self.nodes]})")

    def start(self, timeout: float = 30.0, *, die_with_parent_: bool = False,
              new_session: bool = False) -> str:  # fmt: skip
        """Start every node and wait until the cluster is ready; returns the meta leader.
        Nothing is left running if it fails."""
        self.dir.mkdir(parents=True, exist_ok=True)
        try:
            for n in self.nodes:
                check_ports_free(n.config)
            for n in self.nodes:
                n.spawn(die_with_parent_=die_with_parent_, new_session=new_session)
            for n in self.nodes:
                n.wait_listening()
            return self.wait_ready(timeout)
        except BaseException:
            self.stop()
            raise

    def wait_ready(self, timeout: float = 30.0) -> str:
        """Wait until the running nodes agree on a meta leader and all are healthy."""
        deadline = time.monotonic() + timeout
        while True:
            running = [n for n in self.nodes if n.running()]
            if not running:
                raise ClusterError("no node is running")
            leader = meta_leader({n.name: n.get("/jsz")[1] for n in running})
            if leader and all(n.get("/healthz")[0] == 200 for n in running):
                return leader
            if time.monotonic() > deadline:
                raise ClusterError(
                    f"no meta leader agreed by {[n.name for n in running]} within {timeout} s "
                    f"(logs in {self.dir})"
                )
            time.sleep(0.05)

    def kill(self, name: str) -> None:
        """SIGKILL one node; its store dir and ports stay for :meth:`restart`."""
        self.node(name).kill()

    def restart(self, name: str, timeout: float = 30.0) -> str:
        """Start a stopped node again on the same ports and store dir; wait until ready."""
        node = self.node(name)
        node.spawn()
        node.wait_listening()
        return self.wait_ready(timeout)

    def stop(self) -> dict[str, int | None]:
        """SIGTERM every node (all at once), SIGKILL any left after the grace; exit codes."""
        for n in self.nodes:
            if n.running():
                assert n.proc is not None
                n.proc.terminate()
        return {n.name: n.stop() for n in self.nodes}


FREE_PORT_ATTEMPTS = 3


def launch(
    count: int,
    dir: Path,
    *,
    base_port: int | None = None,
    sys_password: str | None = None,
    timeout: float = 30.0,
    die_with_parent_: bool = False,
    new_session: bool = False,
    no_advertise: bool = False,
) -> tuple[Cluster, str]:
    """Plan and start a ``count``-node cluster under ``dir``: (cluster, meta leader).

    On free ports (no ``base_port``) a port taken between choosing and binding it is retried
    with new ports; a fixed port in use is :class:`PortInUse` at once. ``no_advertise``: the
    nodes do not tell clients of each other (a client knows only the addresses it is given).
    """
    attempts = 1 if base_port is not None else FREE_PORT_ATTEMPTS
    for attempt in range(1, attempts + 1):
        configs = plan(count, base_port, dir, sys_password=sys_password)
        if no_advertise:
            configs = [dataclasses.replace(c, no_advertise=True) for c in configs]
        cluster = Cluster(configs, dir)
        try:
            leader = cluster.start(timeout, die_with_parent_=die_with_parent_,
                                   new_session=new_session)  # fmt: skip
        except PortInUse:
            if attempt == attempts:
                raise
            continue
        return cluster, leader
    raise AssertionError("unreachable")
