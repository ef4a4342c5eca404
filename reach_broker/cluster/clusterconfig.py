"""The config of every node of a reach NATS cluster, from one template.

:func:`render_config` renders the config of the launcher's nodes (``reach dev-cluster``, the
tests' cluster) and the files in ``configs/cluster/`` (a test keeps them equal to it): the APP
and SYS accounts of ``configs/nats-server.conf`` with the advisory export, JetStream, one
cluster block. :func:`plan` lays out the nodes and their ports.
"""

from __future__ import annotations

import json
import random
import socket
from dataclasses import dataclass
from pathlib import Path

from reach_agent.wire.subjects import Subjects
from reach_broker.config import FleetSection

from .natsserver import NatsServerError

CLUSTER_NAME = "reach"
PARTITIONS = FleetSection().partitions
"""The partition count the nodes' subject mappings use: ``[fleet] partitions``' default."""


class ClusterError(NatsServerError):
    """The cluster could not be started or did not become ready; the message says why."""


class PortInUse(ClusterError):
    """A node's port is taken by another process."""

    def __init__(self, host: str, port: int, what: str) -> None:
        super().__init__(f"port {port} ({what}) on {host} is in use")
        self.port = port


# --- the config template ------------------------------------------------------------------


@dataclass(frozen=True)
class NodeConfig:
    """Everything that differs between two nodes' configs."""

    name: str
    """``server_name`` (the JetStream peer name); ``$VAR`` takes it from the environment."""
    host: str
    """Address every listener binds to."""
    client_port: int
    cluster_port: int
    monitor_port: int
    routes: tuple[str, ...]
    """``host:port`` of the peers' cluster listeners (a route to itself is ignored)."""
    store_dir: str
    """JetStream store directory (relative paths are relative to the server's cwd)."""
    sys_password: str | None = None
    """Password of the ``sys`` user; ``None``: the system account has no login at all."""
    no_advertise: bool = False
    """Do not tell clients the peers' addresses (behind NAT, e.g. Docker)."""

    @property
    def url(self) -> str:
        return f"nats://{self.host}:{self.client_port}"

    @property
    def monitor_url(self) -> str:
        return f"http://{self.host}:{self.monitor_port}"


_TEMPLATE = """\
# reach: NATS cluster node {name}.
# Rendered by reach_broker.cluster.clusterconfig.render_config(); tests/test_dev_cluster.py keeps
# configs/cluster/ equal to it: edit the template, then
# `python -m reach_broker.cluster.clusterconfig configs/cluster`.
#
# The accounts of configs/nats-server.conf: APP (agents, callers, brokers; no_auth_user) and
# SYS, which exports APP's connect/disconnect advisories and its CONNZ request. The export is
# response_type: stream, so a CONNZ request gets one reply from every node of the cluster.
# {sys_note}

server_name: {name}
listen: {client}
http: {monitor}
ping_interval: "2s"
ping_max: 2
max_payload: 8MB

# A write is fsynced on every replica that acknowledges it (the second line below; the
# server's default fsyncs every 2 minutes). The cost: docs/operations.md, "Durability".
jetstream {{
  store_dir: {store_dir}
  sync_interval: always
  max_memory_store: 256MB
  max_file_store: 4GB
}}

cluster {{
  name: {cluster_name}
  listen: {cluster}{no_advertise}
  routes: [
{routes}
  ]
}}

accounts {{
  SYS {{{sys_users}
    exports: [
      {{stream: "$SYS.ACCOUNT.APP.>"}}
      {{service: "$SYS.REQ.ACCOUNT.APP.>", response_type: stream}}
    ]
  }}
  APP {{
    jetstream: enabled
    users: [{{user: app, password: app}}]
    imports: [
      {{stream: {{account: SYS, subject: "$SYS.ACCOUNT.APP.>"}}}}
      {{service: {{account: SYS, subject: "$SYS.REQ.ACCOUNT.APP.>"}}}}
    ]
    # The fleet's partitions (docs/protocol.md, "Partitions"): the agent subjects mapped to
    # reach.part.<n>.…, n the agent id's partition of {partitions} ([fleet] partitions).
    mappings: {{
{mappings}
    }}
  }}
}}
system_account: SYS
no_auth_user: app
"""


def render_config(node: NodeConfig) -> str:
    """The nats-server config of one node."""
    if node.sys_password is None:
        sys_note = "The system account has no user: nobody can log in to it."
        sys_users = ""
    else:
        sys_note = "The sys user's password was generated for this cluster (see cluster.json)."
        sys_users = f"\n    users: [{{user: sys, password: {json.dumps(node.sys_password)}}}]"
    return _TEMPLATE.format(
        name=node.name,
        client=f"{node.host}:{node.client_port}",
        monitor=f"{node.host}:{node.monitor_port}",
        cluster=f"{node.host}:{node.cluster_port}",
        store_dir=json.dumps(node.store_dir),
        cluster_name=CLUSTER_NAME,
        no_advertise="\n  no_advertise: true" if node.no_advertise else "",
        routes="\n".join(f"    nats-route://{r}" for r in node.routes),
        sys_note=sys_note,
        sys_users=sys_users,
        partitions=PARTITIONS,
        mappings=render_mappings(Subjects().mappings(PARTITIONS), indent=6),
    )


def render_mappings(mappings: dict[str, str], *, indent: int) -> str:
    """The lines of an account's ``mappings`` block (source: destination, quoted)."""
    pad = " " * indent
    return "\n".join(f"{pad}{json.dumps(src)}: {json.dumps(dst)}" for src, dst in mappings.items())


def plan(
    count: int,
    base_port: int | None,
    store_root: Path,
    *,
    host: str = "127.0.0.1",
    sys_password: str | None = None,
) -> list[NodeConfig]:
    """Configs of nodes ``n1``…``nN``. With ``base_port`` P node i listens on P+i (clients),
    P+2000+i (routes) and P+4000+i (monitoring), so P=4222 gives NATS's usual 4222/6222/8222;
    without it every port is a free one the OS picks."""
    if count < 1:
        raise ClusterError(f"nodes must be at least 1, got {count}")
    if base_port is not None:
        top = base_port + 4000 + count - 1
        if base_port < 1 or top > 65535:
            raise ClusterError(f"base_port {base_port} gives ports up to {top}, outside 1-65535")
        ports = [(base_port + i, base_port + 2000 + i, base_port + 4000 + i) for i in range(count)]
    else:
        free = free_ports(3 * count, host)
        ports = [(free[3 * i], free[3 * i + 1], free[3 * i + 2]) for i in range(count)]
    routes = tuple(f"{host}:{cluster}" for _, cluster, _ in ports)
    return [
        NodeConfig(
            name=f"n{i + 1}",
            host=host,
            client_port=client,
            cluster_port=cluster,
            monitor_port=monitor,
            routes=routes[:i] + routes[i + 1 :],
            store_dir=str(store_root / f"n{i + 1}"),
            sys_password=sys_password,
        )
        for i, (client, cluster, monitor) in enumerate(ports)
    ]


EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
"""The ports the kernel hands out itself: to a bind to port 0 and to every outgoing
connection."""
CHOSEN_PORTS = 10_000
"""How many ports below the ephemeral range :func:`free_ports` chooses among."""


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """``count`` distinct ports free right now (all held open together while chosen).

    They are chosen below the kernel's ephemeral range, which no outgoing connection takes
    a local port from: a node killed and restarted on its ports (``Cluster.restart``) finds
    them free again, where a port from a bind to port 0 could meanwhile have become the
    local end of some connection. Without a readable range (not Linux), port 0 it is."""
    try:
        low = int(EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 0
    socks: list[socket.socket] = []
    try:
        if low - CHOSEN_PORTS < 1024:
            for _ in range(count):
                socks.append(s := socket.socket())
                s.bind((host, 0))
        else:
            candidates = random.sample(range(low - CHOSEN_PORTS, low), CHOSEN_PORTS)
            for port in candidates:
                if len(socks) == count:
                    break
                s = socket.socket()
                try:
                    s.bind((host, port))
                except OSError:
                    s.close()
                    continue
                socks.append(s)
            if len(socks) < count:
                raise OSError(f"fewer than {count} free ports on {host} in "
                              f"{low - CHOSEN_PORTS}-{low - 1}")  # fmt: skip
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for s in socks:
            s.close()


def check_ports_free(node: NodeConfig) -> None:
    """Raise :class:`PortInUse` naming the first of the node's ports that is taken."""
    for port, what in ((node.client_port, "client"), (node.cluster_port, "cluster"),
                       (node.monitor_port, "monitor")):  # fmt: skip
        with socket.socket() as s:
            # as nats-server binds: a port held only by TIME_WAIT sockets is free
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((node.host, port))
            except OSError:
                raise PortInUse(node.host, port, f"{node.name} {what}") from None


# --- the files in configs/cluster/ --------------------------------------------------------

DOCKER_NODES = ("nats-1", "nats-2", "nats-3")
"""The Compose services of ``docker-compose.cluster.yml``."""


def shipped_configs() -> dict[str, str]:
    """File name → text of ``configs/cluster/``: ``n1``…``n3.conf`` for one machine (ports
    4222-4224, 6222-6224, 8222-8224; stores under ``data/cluster/`` of the working directory)
    and ``docker.conf``, one file for every Compose node (its name from ``NATS_SERVER_NAME``).
    Neither has a system-account login."""
    local = plan(3, 4222, Path("data/cluster"))
    files = {f"{n.name}.conf": render_config(n) for n in local}
    docker = NodeConfig(
        name="$NATS_SERVER_NAME",
        host="0.0.0.0",
        client_port=4222,
        cluster_port=6222,
        monitor_port=8222,
        routes=tuple(f"{name}:6222" for name in DOCKER_NODES),
        store_dir="/data",
        no_advertise=True,
    )
    files["docker.conf"] = render_config(docker)
    return files


if __name__ == "__main__":  # python -m reach_broker.cluster.clusterconfig configs/cluster
    import sys

    out = Path(sys.argv[1])
    for file_name, text in shipped_configs().items():
        (out / file_name).write_text(text)
