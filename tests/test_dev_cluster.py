"""``reach dev-cluster`` (reach_broker.cluster.devcluster) as a real subprocess, the cluster configs
(configs/cluster/, rendered from one template and accepted by nats-server), and the compose
file docker-compose.cluster.yml (its structure, and `docker compose config` where Docker is)."""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgspec
import nats
import pytest
from nats.js.errors import NoStreamResponseError

from jetstream.names import H_MSG_ID
from reach_agent.connection import flush_subscriptions
from reach_broker.cluster import devcluster
from reach_broker.cluster.clusterconfig import (
    DOCKER_NODES,
    ClusterError,
    NodeConfig,
    PortInUse,
    free_ports,
    plan,
    render_config,
    shipped_configs,
)
from reach_broker.cluster.natscluster import _start_error, meta_leader
from reach_broker.cluster.natsserver import find_binary

from .cluster import add_stream, nats_cluster
from .conftest import wait_for

ROOT = Path(__file__).resolve().parent.parent
CLUSTER_CONFIGS = ROOT / "configs" / "cluster"
SINGLE_CONFIG = ROOT / "configs" / "nats-server.conf"
COMPOSE = ROOT / "docker-compose.cluster.yml"
LAUNCH_TIMEOUT_S = 30.0

# --- the config template and configs/cluster/ -----------------------------------------------


def test_configs_cluster_are_what_the_template_renders() -> None:
    on_disk = {p.name: p.read_text() for p in sorted(CLUSTER_CONFIGS.glob("*.conf"))}
    assert sorted(on_disk) == ["docker.conf", "n1.conf", "n2.conf", "n3.conf"]
    assert on_disk == shipped_configs()


def _block(text: str, name: str) -> str:
    """The ``name { ... }`` block of a nats-server config, braces balanced."""
    start = re.search(rf"^{name} \{{$", text, re.M)
    assert start, name
    depth, i = 0, start.end() - 1
    for i in range(start.end() - 1, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            break
    return text[start.start() : i + 1]


def _settings(text: str) -> list[str]:
    """Non-comment lines, stripped."""
    lines = (ln.strip() for ln in text.splitlines())
    return [ln for ln in lines if ln and not ln.startswith("#")]


def test_cluster_accounts_are_those_of_the_single_server_config() -> None:
    single = SINGLE_CONFIG.read_text()
    for conf in shipped_configs().values():
        ours = _settings(_block(conf, "accounts"))
        theirs = _settings(_block(single, "accounts"))
        # the two deliberate differences: the sys login (the single server's password comes
        # from REACH_NATS_SYSTEM_PASSWORD; a cluster's is generated or absent), and CONNZ
        # answered by every node
        theirs.remove("users: [{user: sys, password: $REACH_NATS_SYSTEM_PASSWORD}]")
        ours = [ln.replace(", response_type: stream", "") for ln in ours]
        assert ours == theirs
        for line in ("system_account: SYS", "no_auth_user: app", 'ping_interval: "2s"',
                     "ping_max: 2", "max_payload: 8MB", "max_memory_store: 256MB",
                     "max_file_store: 4GB"):  # fmt: skip
            assert line in _settings(single) and line in _settings(conf), line
        assert "password: sys" not in conf
        assert "{user: sys" not in conf


def test_the_local_configs_form_one_loopback_cluster_on_the_usual_ports() -> None:
    files = shipped_configs()
    for i, name in enumerate(("n1", "n2", "n3")):
        text = files[f"{name}.conf"]
        assert f"server_name: {name}\n" in text
        assert f"listen: 127.0.0.1:{4222 + i}" in text
        assert f"http: 127.0.0.1:{8222 + i}" in text
        assert f"listen: 127.0.0.1:{6222 + i}" in text
        assert f'store_dir: "data/cluster/{name}"' in text
        routes = re.findall(r"nats-route://127\.0\.0\.1:(\d+)", text)
        assert sorted(int(r) for r in routes) == sorted({6222, 6223, 6224} - {6222 + i})
    docker = files["docker.conf"]
    assert re.findall(r"nats-route://([a-z0-9-]+):6222", docker) == list(DOCKER_NODES)
    assert "server_name: $NATS_SERVER_NAME" in docker
    assert "no_advertise: true" in docker


def test_every_cluster_config_is_accepted_by_nats_server() -> None:
    binary = find_binary()
    for path in sorted(CLUSTER_CONFIGS.glob("*.conf")):
        env = {**os.environ, "NATS_SERVER_NAME": "nats-1"}
        proc = subprocess.run([binary, "-c", str(path), "-t"], capture_output=True, text=True,
                              env=env, timeout=30)  # fmt: skip
        assert proc.returncode == 0, (path.name, proc.stdout + proc.stderr)
        assert "is valid" in proc.stdout + proc.stderr


def test_a_generated_password_makes_the_only_sys_login() -> None:
    node = plan(1, 14222, Path("/tmp/x"), sys_password='p"w')[0]
    text = render_config(node)
    assert 'users: [{user: sys, password: "p\\"w"}]' in text
    assert text.count("user: sys") == 1
    assert "user: sys" not in render_config(NodeConfig(**{**node.__dict__, "sys_password": None}))


def test_plan_lays_out_ports_from_a_base() -> None:
    nodes = plan(3, 4222, Path("/d"))
    assert [(n.name, n.client_port, n.cluster_port, n.monitor_port) for n in nodes] == [
        ("n1", 4222, 6222, 8222), ("n2", 4223, 6223, 8223), ("n3", 4224, 6224, 8224),
    ]  # fmt: skip
    assert nodes[1].routes == ("127.0.0.1:6222", "127.0.0.1:6224")
    assert [n.store_dir for n in nodes] == ["/d/n1", "/d/n2", "/d/n3"]
    free = plan(3, None, Path("/d"))
    ports = [p for n in free for p in (n.client_port, n.cluster_port, n.monitor_port)]
    assert len(set(ports)) == 9
    with pytest.raises(ClusterError, match="base_port 62000 gives ports up to 66002"):
        plan(3, 62000, Path("/d"))
    with pytest.raises(ClusterError, match="nodes must be at least 1, got 0"):
        plan(0, None, Path("/d"))


def test_free_ports_are_below_the_range_outgoing_connections_take_theirs_from() -> None:
    # A node restarted on its ports must find them free: no outgoing connection made while
    # it was down can have taken one as its local port.
    low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    ports = free_ports(30)
    assert len(set(ports)) == 30
    assert all(1024 <= p < low for p in ports), (ports, low)
    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen()
        with socket.create_connection(srv.getsockname()) as out:
            assert low <= out.getsockname()[1] <= high  # the kernel's own choice, in its range
    for port in ports:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_a_start_failure_names_the_port_and_its_role() -> None:
    node = plan(1, 14222, Path("/d"))[0]
    line = ("[9] 2026/12/01 09:46:19.723106 [FTL] Error listening on router port: 16222 - "
            "listen tcp 127.0.0.1:16222: bind: address already in use")  # fmt: skip
    err = _start_error(node, line)
    assert isinstance(err, PortInUse)
    assert str(err) == "port 16222 (n1 cluster) on 127.0.0.1 is in use"
    other = _start_error(node, "[9] 2026/12/01 [FTL] Failed to create JetStream: bad store")
    assert str(other) == "n1 exited at start: Failed to create JetStream: bad store"


def _jsz(leader: str | None, peers: dict[str, bool]) -> dict[str, Any]:
    replicas = [{"name": n, "current": c} for n, c in peers.items()]
    return {"meta_cluster": {"leader": leader, "cluster_size": 3, "replicas": replicas}}


def test_meta_leader_needs_agreement_and_current_peers() -> None:
    agreed = {"n1": _jsz("n2", {"n2": True, "n3": False}),
              "n2": _jsz("n2", {"n1": True, "n3": True}),
              "n3": _jsz("n2", {"n1": False, "n2": True})}  # fmt: skip
    assert meta_leader(agreed) == "n2"  # only the leader's view of its peers counts
    assert meta_leader({**agreed, "n3": _jsz(None, {})}) is None  # n3 knows no leader yet
    assert meta_leader({**agreed, "n1": _jsz("n1", {})}) is None  # two leaders named
    assert meta_leader({**agreed, "n2": _jsz("n2", {"n1": True, "n3": False})}) is None
    assert meta_leader({**agreed, "n3": None}) is None  # unreachable
    # n3 killed: the two running nodes are enough when they agree
    assert meta_leader({"n1": agreed["n1"], "n2": _jsz("n2", {"n1": True, "n3": False})}) == "n2"
    # a leader that is not among the running nodes is not an answer
    assert meta_leader({"n1": _jsz("n3", {}), "n2": _jsz("n3", {})}) is None


# --- docker-compose.cluster.yml -----------------------------------------------------------


def read_yaml(text: str) -> Any:
    """The block YAML this compose file is written in: mappings, ``- item`` lists, scalars
    (plain strings, integers, double-quoted) and JSON-style flow lists; ``#`` comments.
    Anything else in the file fails the test, which keeps the file in this subset (no
    anchors, no tags)."""
    lines = [(len(ln) - len(ln.lstrip()), ln.strip()) for ln in text.splitlines()
             if ln.strip() and not ln.lstrip().startswith("#")]  # fmt: skip

    def scalar(raw: str) -> Any:
        if raw.startswith(("[", '"')):
            return json.loads(raw)
        assert not raw.startswith(("&", "*", "!", "{", "'", "|", ">")), raw
        assert raw not in ("true", "false", "yes", "no", "null", "~"), raw
        return int(raw) if raw.isdigit() else raw

    def block(i: int, indent: int) -> tuple[Any, int]:
        if lines[i][1].startswith("- "):
            items = []
            while i < len(lines) and lines[i][0] == indent and lines[i][1].startswith("- "):
                items.append(scalar(lines[i][1][2:]))
                i += 1
            return items, i
        mapping: dict[str, Any] = {}
        while i < len(lines) and lines[i][0] == indent:
            key, sep, rest = lines[i][1].partition(":")
            assert sep and key not in mapping, lines[i]
            i += 1
            if rest.strip():
                mapping[key] = scalar(rest.strip())
            elif i < len(lines) and lines[i][0] > indent:
                mapping[key], i = block(i, lines[i][0])
            else:
                mapping[key] = None
        return mapping, i

    doc, end = block(0, 0)
    assert end == len(lines), lines[end]
    return doc


def test_read_yaml_agrees_with_pyyaml_where_installed() -> None:
    """A full YAML parser reads the file the same way (PyYAML is no dependency of reach:
    any interpreter on this machine that has it will do)."""
    dump = "import json, sys, yaml; print(json.dumps(yaml.safe_load(open(sys.argv[1]))))"
    for python in dict.fromkeys([sys.executable, shutil.which("python3"), "/usr/bin/python3"]):
        if python is None or not Path(python).exists():
            continue
        proc = subprocess.run([python, "-c", dump, str(COMPOSE)], capture_output=True,
                              text=True, timeout=30)  # fmt: skip
        if proc.returncode == 0:
            assert read_yaml(COMPOSE.read_text()) == json.loads(proc.stdout)
            return
    pytest.skip("no Python with PyYAML on this machine")


def test_compose_has_three_nodes_and_two_brokers_on_the_cluster_config() -> None:
    doc = read_yaml(COMPOSE.read_text())
    services = doc["services"]
    assert list(services) == [*DOCKER_NODES, "broker-1", "broker-2"]
    assert list(doc["volumes"]) == [f"{n}-data" for n in DOCKER_NODES]
    published = []
    for name in DOCKER_NODES:
        node = services[name]
        assert node["command"] == ["-c", "/etc/nats/docker.conf"]
        assert node["environment"] == {"NATS_SERVER_NAME": name}
        assert node["volumes"] == ["./configs/cluster/docker.conf:/etc/nats/docker.conf:ro",
                                   f"{name}-data:/data"]  # fmt: skip
        assert "/healthz" in node["healthcheck"]["test"][-1]
        published += node["ports"]
    everywhere = ",".join(f"nats://{n}:4222" for n in DOCKER_NODES)
    for name in ("broker-1", "broker-2"):
        broker = services[name]
        servers = next(a for a in broker["command"] if a.startswith("--server="))
        assert sorted(servers.removeprefix("--server=").split(",")) == everywhere.split(",")
        assert broker["environment"]["REACH_TOKEN_SECRET"].startswith("${REACH_TOKEN_SECRET:?")
        assert {n: broker["depends_on"][n]["condition"] for n in DOCKER_NODES} == dict.fromkeys(
            DOCKER_NODES, "service_healthy"
        )
        published += broker["ports"]
    # published on loopback only, each host port once
    assert all(p.startswith("127.0.0.1:") for p in published), published
    hosts = [int(p.split(":")[1]) for p in published]
    assert sorted(hosts) == [4222, 4223, 4224, 8222, 8223, 8224, 9464, 9465]
    assert (ROOT / "configs" / "cluster" / "docker.conf").is_file()


def test_compose_file_is_accepted_by_docker_compose() -> None:
    command = None
    if shutil.which("docker"):
        probe = subprocess.run(["docker", "compose", "version"], capture_output=True, timeout=30)
        command = ["docker", "compose"] if probe.returncode == 0 else None
    if command is None and shutil.which("docker-compose"):
        command = ["docker-compose"]
    if command is None:
        pytest.skip("neither `docker compose` nor docker-compose is installed")
    env = {**os.environ, "REACH_TOKEN_SECRET": "test"}
    proc = subprocess.run([*command, "-f", str(COMPOSE), "config", "-q"], capture_output=True,
                          text=True, timeout=60, cwd=ROOT, env=env)  # fmt: skip
    assert proc.returncode == 0, proc.stderr


# --- the cluster config at work -------------------------------------------------------------


@pytest.mark.slow
async def test_connz_is_answered_by_every_node(tmp_path: Path) -> None:
    async with nats_cluster(tmp_path / "cluster") as cluster:
        conns = [await nats.connect(url, name=f"connz-{i}") for i, url in enumerate(cluster.urls)]
        try:
            nc = conns[0]
            # The inbox's interest reaches n2 and n3 over routes some time after the SUB:
            # until it has, their replies go nowhere. Ask again, on a fresh inbox, until one
            # request is answered by every node.
            deadline = asyncio.get_running_loop().time() + 10
            replies: list[dict[str, Any]] = []
            while len(replies) < 3:
                assert asyncio.get_running_loop().time() < deadline, f"answered by {replies}"
                sub = await nc.subscribe(nc.new_inbox())
                await flush_subscriptions(nc)
                await nc.publish("$SYS.REQ.ACCOUNT.APP.CONNZ", b"{}", reply=sub.subject)
                replies = []
                while len(replies) < 3:
                    try:
                        replies.append(json.loads((await sub.next_msg(timeout=0.5)).data))
                    except TimeoutError:
                        break
                await sub.unsubscribe()
            by_server = {r["server"]["name"]: r["data"]["num_connections"] for r in replies}
            assert by_server == {"n1": 1, "n2": 1, "n3": 1}
        finally:
            for c in conns:
                await c.close()


@pytest.mark.slow
async def test_a_disconnect_advisory_reaches_every_node(tmp_path: Path) -> None:
    async with nats_cluster(tmp_path / "cluster") as cluster:
        watcher = await nats.connect(cluster.url("n1"), name="watcher")
        try:
            sub = await watcher.subscribe("$SYS.ACCOUNT.APP.DISCONNECT")
            await flush_subscriptions(watcher)
            # The interest reaches n3 over a route some time after the SUB: until it has,
            # n3's advisories go nowhere. Connect and close agents there until one is seen.
            deadline = asyncio.get_running_loop().time() + 10
            body: dict[str, Any] = {}
            for attempt in range(1000):
                agent = await nats.connect(cluster.url("n3"), name=f"agent-on-n3-{attempt}")
                await agent.close()
                try:
                    msg = await sub.next_msg(timeout=0.2)
                except TimeoutError:
                    assert asyncio.get_running_loop().time() < deadline, "no advisory from n3"
                    continue
                body = json.loads(msg.data)
                assert body["client"]["name"] == f"agent-on-n3-{attempt}"
                break
            assert body["server"]["name"] == "n3"
            assert body["client"]["acc"] == "APP"
        finally:
            await watcher.close()


# --- the launcher, as a subprocess ----------------------------------------------------------


def _launcher(*args: str) -> list[str]:
    return [sys.executable, "-m", "reach_broker.cluster.devcluster", *args]


async def launch(*args: str) -> subprocess.CompletedProcess[str]:
    """Run the launcher to its end (a background start, a stop, a refusal)."""
    argv = _launcher(*args)
    return await asyncio.to_thread(subprocess.run, argv, capture_output=True, text=True,
                                   timeout=60)  # fmt: skip


def _gone(pid: int) -> bool:
    """No such process, or only its zombie (the container's init may be slow to reap)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    if not Path("/proc").is_dir():
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        return False
    return stat.rsplit(")", 1)[1].split()[0] == "Z"


def _argv(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/cmdline").read_bytes().rstrip(b"\0").decode().split("\0")


class Launched(msgspec.Struct):
    urls: list[str]
    pids: list[int]
    dir: str


@pytest.fixture
async def foreground(tmp_path: Path) -> AsyncIterator[tuple[asyncio.subprocess.Process, Launched]]:
    """``reach dev-cluster --nodes 3 --dir tmp/dc`` running in the foreground."""
    proc = await asyncio.create_subprocess_exec(
        *_launcher("--nodes", "3", "--dir", str(tmp_path / "dc")),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        line = await asyncio.wait_for(proc.stdout.readline(), LAUNCH_TIMEOUT_S)
        assert line, (await proc.stderr.read()).decode() if proc.stderr else "no stderr"
        yield proc, msgspec.json.decode(line, type=Launched)
    finally:
        if proc.returncode is None:
            proc.terminate()
            await asyncio.wait_for(proc.wait(), 30)
        await devcluster_stop(tmp_path / "dc")  # anything left (a failed test)


async def devcluster_stop(dir: Path) -> None:
    if (dir / devcluster.STATE_FILE).exists():
        await asyncio.to_thread(devcluster.stop, dir)


@pytest.mark.slow
async def test_the_launcher_prints_one_line_and_sigterm_stops_every_node(
    tmp_path: Path, foreground: tuple[asyncio.subprocess.Process, Launched]
) -> None:
    proc, launched = foreground
    root = (tmp_path / "dc").resolve()
    assert launched.dir == str(root)
    assert len(launched.urls) == len(set(launched.urls)) == 3
    assert len(launched.pids) == 3
    for i, pid in enumerate(launched.pids):
        assert _argv(pid) == [find_binary(), "-c", str(root / f"n{i + 1}.conf")]
    state = devcluster.read_state(root)
    assert state is not None and state.launcher_pid == proc.pid
    assert (root / devcluster.STATE_FILE).stat().st_mode & 0o777 == 0o600

    # a client on every url; they are one cluster with a meta leader and take an R3 stream
    conns = [await nats.connect(url, name=f"dc-{i}") for i, url in enumerate(launched.urls)]
    try:
        jsz = {n.name: _get_json(n.monitor_url + "/jsz") for n in state.nodes}
        assert meta_leader(jsz) in {"n1", "n2", "n3"}
        # every node's generated config fsyncs each acknowledged write
        varz = {n.name: _get_json(n.monitor_url + "/varz") for n in state.nodes}
        assert {k: v["jetstream"]["config"]["sync_always"] for k, v in varz.items()} == {
            "n1": True, "n2": True, "n3": True}  # fmt: skip
        js = conns[0].jetstream(timeout=5)
        info = await add_stream(js, name="DEV_R3", subjects=["dev.r3.>"], num_replicas=3)
        assert info.config.num_replicas == 3
        assert info.cluster is not None and info.cluster.leader in {"n1", "n2", "n3"}
        # From another node the stream's subjects answer once its interest is routed there
        # (a publish before that meets no responders and stores nothing; the msg id keeps a
        # retry from storing twice).
        ack = await _publish_when_routed(conns[2], "dev.r3.one", b"1", msg_id="one")
        assert (ack.stream, ack.seq, ack.duplicate) == ("DEV_R3", 1, None)
    finally:
        for nc in conns:
            await nc.close()

    proc.send_signal(signal.SIGTERM)
    assert await asyncio.wait_for(proc.wait(), 30) == 0
    assert [pid for pid in launched.pids if not _gone(pid)] == []
    assert not (root / devcluster.STATE_FILE).exists()


async def _publish_when_routed(nc: Any, subject: str, data: bytes, msg_id: str) -> Any:
    js = nc.jetstream(timeout=5)
    for _ in range(100):
        try:
            return await js.publish(subject, data, headers={H_MSG_ID: msg_id})
        except NoStreamResponseError:
            await asyncio.sleep(0.05)
    raise AssertionError(f"no stream answered {subject} within 5 s")


def _get_json(url: str) -> Any:
    import urllib.request

    with urllib.request.urlopen(url, timeout=5) as resp:
        return json.loads(resp.read())


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux")
async def test_a_sigkilled_launcher_takes_its_nodes_with_it(
    foreground: tuple[asyncio.subprocess.Process, Launched],
) -> None:
    proc, launched = foreground
    proc.kill()
    await asyncio.wait_for(proc.wait(), 10)
    await wait_for(lambda: all(_gone(pid) for pid in launched.pids), timeout=15,
                   what="every node gone after the launcher's SIGKILL")  # fmt: skip


@pytest.mark.slow
async def test_a_second_launcher_on_a_running_dir_is_refused(
    tmp_path: Path, foreground: tuple[asyncio.subprocess.Process, Launched]
) -> None:
    _, launched = foreground
    root = (tmp_path / "dc").resolve()
    second = await launch("--dir", str(root))
    assert second.returncode == 1
    assert second.stdout == ""
    assert second.stderr == (
        f"reach dev-cluster: {root} already holds a running cluster (pids {launched.pids}); "
        f"stop it with `reach dev-cluster --stop --dir {root}`\n"
    )
    assert all(not _gone(pid) for pid in launched.pids)


@pytest.mark.slow
async def test_stop_ends_a_cluster_started_in_the_background(tmp_path: Path) -> None:
    root = (tmp_path / "bg").resolve()
    try:
        started = await launch("--dir", str(root), "--background")
        assert started.returncode == 0, started.stderr
        launched = msgspec.json.decode(started.stdout, type=Launched)
        assert len(launched.pids) == 3
        state = devcluster.read_state(root)
        assert state is not None and state.launcher_pid is None
        assert devcluster.running_pids(state) == launched.pids
        nc = await nats.connect(launched.urls, name="bg-client")
        await nc.close()

        stopped = await launch("--stop", "--dir", str(root))
        assert stopped.returncode == 0, stopped.stderr
        assert stopped.stderr == f"reach dev-cluster: stopped pids {launched.pids}\n"
        await wait_for(lambda: all(_gone(pid) for pid in launched.pids), timeout=5,
                       what="every background node gone")  # fmt: skip
        assert not (root / devcluster.STATE_FILE).exists()
    finally:
        await devcluster_stop(root)


async def test_a_port_in_use_is_one_clear_line(tmp_path: Path) -> None:
    with socket.socket() as taken:
        for _ in range(100):  # a port with room for +4002 above it
            port = random.randrange(20000, 30000)
            try:
                taken.bind(("127.0.0.1", port))
                break
            except OSError:
                continue
        taken.listen()
        proc = await launch("--dir", str(tmp_path / "p"), "--base-port", str(port))
    assert proc.returncode == 1
    assert proc.stdout == ""
    assert proc.stderr == (
        f"reach dev-cluster: port {port} (n1 client) on 127.0.0.1 is in use; "
        "pick another --base-port\n"
    )


def test_stop_never_signals_a_reused_pid(tmp_path: Path) -> None:
    stranger = subprocess.Popen(["sleep", "60"])
    try:
        node = devcluster.NodeState(name="n1", pid=stranger.pid, url="nats://127.0.0.1:1",
                                    argv=[find_binary(), "-c", str(tmp_path / "n1.conf")],
                                    monitor_url="http://127.0.0.1:2")  # fmt: skip
        state = devcluster.ClusterState(dir=str(tmp_path), urls=[node.url], pids=[node.pid],
                                        nodes=[node], sys_user="sys", sys_password="x")  # fmt: skip
        (tmp_path / devcluster.STATE_FILE).write_bytes(msgspec.json.encode(state))
        assert devcluster.running_pids(state) == []
        assert devcluster.stop(tmp_path) == 0
        assert stranger.poll() is None  # the pid now names someone else: left alone
        assert not (tmp_path / devcluster.STATE_FILE).exists()
    finally:
        stranger.kill()
        stranger.wait()


def test_stop_without_a_recorded_cluster_says_so(tmp_path: Path, capsys: Any) -> None:
    assert devcluster.stop(tmp_path) == 1
    assert capsys.readouterr().err == (
        f"reach dev-cluster: no cluster recorded in {tmp_path.resolve() / 'cluster.json'}\n"
    )
