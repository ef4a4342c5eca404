"""``reach dev-cluster``: a JetStream cluster of N ``nats-server`` processes on loopback.

``run(3, DIR)`` starts nodes ``n1``…``n3`` (configs, logs and JetStream stores under DIR),
waits until the cluster has a meta leader (see :mod:`reach_broker.cluster.natscluster`), prints one
JSON line ``{"urls": [...], "pids": [...], "dir": DIR}`` on stdout and runs until SIGINT or
SIGTERM, then stops them. On Linux the nodes also get SIGTERM if the launcher itself dies
(``PR_SET_PDEATHSIG``); elsewhere ``stop(DIR)`` is the way to end them.

``run(..., background=True)`` starts the nodes in sessions of their own, prints the same line
and returns: the cluster lives on until ``stop(DIR)``. Both modes record the cluster in
``DIR/cluster.json`` (mode 0600: it holds the generated password of the ``sys`` user), and
``stop`` ends only the processes recorded there whose command line is still the recorded one,
so a reused PID is never signalled.

``python -m reach_broker.cluster.devcluster --nodes 3 --dir DIR [--base-port P] [--background]``
and ``--stop --dir DIR`` do the same from a shell.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import IO, Any

import msgspec

from .clusterconfig import ClusterError, PortInUse
from .natscluster import STOP_GRACE_S, Cluster, launch

STATE_FILE = "cluster.json"
LOCK_FILE = "cluster.lock"
SYS_USER = "sys"
READY_TIMEOUT_S = 30.0
_PROG = "reach dev-cluster"


class NodeState(msgspec.Struct, frozen=True, kw_only=True):
    """One node as recorded in ``cluster.json``."""

    name: str
    pid: int
    argv: list[str]
    """The command line it was started with: ``stop`` signals it only while it still is."""
    url: str
    monitor_url: str


class ClusterState(msgspec.Struct, frozen=True, kw_only=True):
    """``DIR/cluster.json``: what ``stop`` and the next ``run`` read."""

    dir: str
    urls: list[str]
    pids: list[int]
    nodes: list[NodeState]
    sys_user: str
    sys_password: str
    launcher_pid: int | None = None
    """The foreground launcher (``None`` in background mode); ``stop`` signals it first."""
    launcher_argv: list[str] | None = None


def run(
    nodes: int,
    dir: str | os.PathLike[str],
    *,
    base_port: int | None = None,
    background: bool = False,
    timeout: float = READY_TIMEOUT_S,
    out: IO[str] | None = None,
) -> int:
    """Start the cluster, print its JSON line to ``out`` (stdout); the exit code.

    Foreground: runs until SIGINT/SIGTERM, then stops every node (0; 1 if every node exited
    by itself). Background: returns 0 once the cluster is ready. Errors (a port in use, DIR
    holding a running cluster, no meta leader in ``timeout`` s) are one line on stderr and 1.
    """
    out = out or sys.stdout
    root = Path(dir).resolve()
    stopping = _StopSignals()
    try:
        with stopping:
            with _locked(root):  # only while starting: a second run then sees cluster.json
                cluster, leader, took = _start(nodes, root, base_port, background, timeout)
            try:
                state = _record(cluster, root, background)
                line = {"urls": state.urls, "pids": state.pids, "dir": str(root)}
                out.write(json.dumps(line) + "\n")
                out.flush()
                ready = f"meta leader {leader}, ready in {took:.1f} s"
                if background:
                    _say(f"{nodes} nodes in the background, {ready}; "
                         f"stop with `{_PROG} --stop --dir {root}`")  # fmt: skip
                    return 0
                _say(f"{nodes} nodes, {ready}; Ctrl-C stops them")
                code = _serve(cluster, stopping)
            except BaseException:
                stopping.ignore()
                cluster.stop()
                raise
            finally:
                if not background:
                    (root / STATE_FILE).unlink(missing_ok=True)
            return code
    except ClusterError as exc:
        _say(str(exc))
        return 1
    except _Stopped:
        return 130


def stop(dir: str | os.PathLike[str], *, grace: float = STOP_GRACE_S) -> int:
    """Stop the cluster recorded in ``DIR/cluster.json``: the foreground launcher (which then
    stops its nodes), then any recorded node still running; SIGKILL after ``grace``."""
    root = Path(dir).resolve()
    try:
        state = read_state(root)
    except ClusterError as exc:
        _say(str(exc))
        return 1
    if state is None:
        _say(f"no cluster recorded in {root / STATE_FILE}")
        return 1
    ours = [(n.pid, n.argv) for n in state.nodes]
    stopped = [pid for pid, argv in ours if _is_running(pid, argv)]
    if state.launcher_pid is not None and state.launcher_argv is not None:
        if _end([(state.launcher_pid, state.launcher_argv)], grace + 5.0):
            _say(f"launcher pid {state.launcher_pid} did not exit within {grace + 5.0} s")
    left = _end(ours, grace)
    (root / STATE_FILE).unlink(missing_ok=True)
    if left:
        _say(f"pids {left} survived SIGKILL")
        return 1
    _say(f"stopped pids {stopped}" if stopped else "no node was running (stale state removed)")
    return 0


def read_state(root: Path) -> ClusterState | None:
    """``DIR/cluster.json``, or ``None`` if there is none."""
    path = root / STATE_FILE
    try:
        return msgspec.json.decode(path.read_bytes(), type=ClusterState)
    except FileNotFoundError:
        return None
    except msgspec.DecodeError as exc:
        raise ClusterError(f"{path} is not a dev-cluster state file: {exc}") from None


def running_pids(state: ClusterState) -> list[int]:
    """The recorded nodes that are still the processes we started."""
    return [n.pid for n in state.nodes if _is_running(n.pid, n.argv)]


# --- start, record, serve -----------------------------------------------------------------


def _start(nodes: int, root: Path, base_port: int | None, background: bool,
           timeout: float) -> tuple[Cluster, str, float]:  # fmt: skip
    """Start and wait for the meta leader: (cluster, leader, seconds it took)."""
    previous = read_state(root)
    if previous is not None and running_pids(previous):
        raise ClusterError(
            f"{root} already holds a running cluster (pids {running_pids(previous)}); "
            f"stop it with `{_PROG} --stop --dir {root}`"
        )
    if (root / f"n{nodes + 1}").is_dir():
        raise ClusterError(
            f"{root} holds the data of a cluster with more than {nodes} nodes; "
            "use a new --dir or the same --nodes"
        )
    began = time.monotonic()
    try:
        cluster, leader = launch(
            nodes, root, base_port=base_port, sys_password=secrets.token_urlsafe(24),
            timeout=timeout, die_with_parent_=not background, new_session=background,
        )  # fmt: skip
    except PortInUse as exc:
        hint = "pick another --base-port" if base_port is not None else "try again"
        raise ClusterError(f"{exc}; {hint}") from None
    return cluster, leader, time.monotonic() - began


def _record(cluster: Cluster, root: Path, background: bool) -> ClusterState:
    nodes = [NodeState(name=n.name, pid=n.pid or 0, argv=n.argv, url=n.url,
                       monitor_url=n.config.monitor_url) for n in cluster.nodes]  # fmt: skip
    state = ClusterState(
        dir=str(root), urls=cluster.urls, pids=[n.pid for n in nodes], nodes=nodes,
        sys_user=SYS_USER, sys_password=cluster.nodes[0].config.sys_password or "",
        launcher_pid=None if background else os.getpid(),
        launcher_argv=None if background else _cmdline(os.getpid()),
    )  # fmt: skip
    path = root / STATE_FILE
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(msgspec.json.format(msgspec.json.encode(state)) + b"\n")
    tmp.replace(path)
    return state


def _serve(cluster: Cluster, stopping: _StopSignals) -> int:
    """Wait for SIGINT/SIGTERM, noting nodes that exit meanwhile; then stop the rest."""
    gone: set[str] = set()
    try:
        while len(gone) < len(cluster.nodes):
            time.sleep(0.25)
            for n in cluster.nodes:
                if n.name not in gone and not n.running():
                    gone.add(n.name)
                    code = n.proc.returncode if n.proc is not None else None
                    _say(f"{n.name} (pid {n.pid}) exited with code {code}")
        _say("every node has exited")
        stopping.ignore()
        cluster.stop()
        return 1
    except _Stopped:
        stopping.ignore()
        cluster.stop()
        return 0


# --- signals, lock, processes -------------------------------------------------------------


class _Stopped(BaseException):
    """SIGINT or SIGTERM arrived (raised in the main thread by the handler)."""


class _StopSignals:
    """While active, SIGINT and SIGTERM raise :class:`_Stopped`; restored on exit."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __enter__(self) -> _StopSignals:
        self._saved = {s: signal.signal(s, self._raise) for s in self.SIGNALS}
        return self

    def __exit__(self, *exc: object) -> None:
        for s, handler in self._saved.items():
            signal.signal(s, handler)

    def ignore(self) -> None:
        """A second signal must not interrupt the shutdown (it is bounded by the grace)."""
        for s in self.SIGNALS:
            signal.signal(s, signal.SIG_IGN)

    @staticmethod
    def _raise(signum: int, frame: Any) -> None:
        raise _Stopped


@contextlib.contextmanager
def _locked(root: Path) -> Iterator[None]:
    """Hold ``DIR/cluster.lock`` so two launchers never start on one DIR at once."""
    root.mkdir(parents=True, exist_ok=True)
    with open(root / LOCK_FILE, "w") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ClusterError(f"another dev-cluster launcher is using {root}") from None
        yield


def _cmdline(pid: int) -> list[str] | None:
    """The command line of ``pid`` (``None``: no such process, or a zombie)."""
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except FileNotFoundError:
        if Path("/proc/self").exists():
            return None
        proc = subprocess.run(["ps", "-o", "command=", "-p", str(pid)],
                              capture_output=True, text=True, check=False)  # fmt: skip
        return proc.stdout.split() or None
    except OSError:
        return None
    return raw.rstrip(b"\0").decode(errors="replace").split("\0") if raw else None


def _is_running(pid: int, argv: Sequence[str]) -> bool:
    found = _cmdline(pid)
    return found is not None and " ".join(found) == " ".join(argv)


def _end(procs: Sequence[tuple[int, Sequence[str]]], grace: float) -> list[int]:
    """SIGTERM each process still running as recorded, SIGKILL after ``grace``; returns
    the pids still running after that."""
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 2.0)):
        alive = [(p, a) for p, a in procs if _is_running(p, a)]
        for pid, _ in alive:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.monotonic() + wait
        while alive and time.monotonic() < deadline:
            time.sleep(0.05)
            alive = [(p, a) for p, a in alive if _is_running(p, a)]
        if not alive:
            return []
    return [pid for pid, argv in procs if _is_running(pid, argv)]


def _say(message: str) -> None:
    sys.stderr.write(f"{_PROG}: {message}\n")
    sys.stderr.flush()


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog=_PROG, description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", type=int, default=3, help="number of nats-server nodes (3)")
    p.add_argument("--dir", required=True, help="configs, logs, JetStream stores, cluster.json")
    p.add_argument(
        "--base-port",
        type=int,
        default=None,
        help="clients on P+i, routes P+2000+i, monitoring P+4000+i (default: free ports)",
    )
    p.add_argument(
        "--background",
        action="store_true",
        help="leave the cluster running and return once it is ready",
    )
    p.add_argument("--stop", action="store_true", help="stop the cluster recorded in --dir")
    args = p.parse_args(argv)
    if args.stop:
        return stop(args.dir)
    return run(args.nodes, args.dir, base_port=args.base_port, background=args.background)


if __name__ == "__main__":
    sys.exit(main())
