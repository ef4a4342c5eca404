"""The child processes of ``reach demo``: started in sessions of their own (a terminal
Ctrl-C reaches only the demo, which stops them in order), tied to the demo's life
(:mod:`reach_broker.cluster.lifeline`), restartable under the same name, their output appended to
one log file per name."""

from __future__ import annotations

import logging
import signal
import subprocess
import time
from pathlib import Path

from reach_broker.cluster.lifeline import Lifeline, spawn

log = logging.getLogger(__name__)

STOP_GRACE_S = 10.0


class Children:
    """Named child processes; a name keeps its command, so it can be started again."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.lifelines: dict[str, Lifeline] = {}
        self.commands: dict[str, tuple[list[str], dict[str, str]]] = {}

    @property
    def pids(self) -> dict[str, int]:
        return {name: proc.pid for name, proc in self.procs.items()}

    def spawn(self, name: str, argv: list[str], env: dict[str, str]) -> int:
        """Start ``argv`` as ``name`` (output appended to ``<log_dir>/<name>.log``)."""
        self.commands[name] = (argv, env)
        logfile = open(self.log_dir / f"{name}.log", "ab")
        try:
            proc, self.lifelines[name] = spawn(
                argv, stdin=subprocess.DEVNULL, stdout=logfile, stderr=subprocess.STDOUT,
                env=env, start_new_session=True,
            )  # fmt: skip
        finally:
            logfile.close()
        self.procs[name] = proc
        log.debug("demo.spawned name=%s pid=%d", name, proc.pid)
        return proc.pid

    def restart(self, name: str) -> int:
        """Start ``name`` again with the command it was first started with."""
        old = self.procs.pop(name, None)
        if old is not None and old.poll() is None:
            raise RuntimeError(f"{name} (pid {old.pid}) is still running")
        if name in self.lifelines:
            self.lifelines.pop(name).release()
        argv, env = self.commands[name]
        return self.spawn(name, argv, env)

    def exited(self) -> dict[str, int]:
        """Exit codes of the children that ended (negative: killed by that signal)."""
        return {n: p.returncode for n, p in self.procs.items() if p.poll() is not None}

    def stop(self, names: list[str], grace: float = STOP_GRACE_S) -> None:
        """SIGTERM ``names`` together, wait up to ``grace``, then SIGKILL what is left."""
        procs = [self.procs[n] for n in names if n in self.procs]
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace
        for proc in procs:
            try:
                proc.wait(max(deadline - time.monotonic(), 0.01))
            except subprocess.TimeoutExpired:
                log.warning("demo.kill pid=%d: no exit %.0f s after SIGTERM", proc.pid, grace)
                proc.kill()
                proc.wait()
        for name in names:
            if name in self.lifelines:
                self.lifelines.pop(name).release()

    def tail(self, name: str, lines: int = 15) -> str:
        path = self.log_dir / f"{name}.log"
        try:
            return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""
