"""Child processes that die with their parent, on every way the parent can end.

A clean stop (Ctrl-C, SIGTERM, SIGHUP) stops children in order; this module covers the
rest: ``kill -9``, a crash, an OOM kill. Two mechanisms, chosen by :func:`default_guard`:

* ``pdeathsig`` (Linux): the child asks the kernel for SIGTERM when its parent dies
  (``prctl(PR_SET_PDEATHSIG)`` in ``preexec_fn``). The kernel's "parent" is the *thread*
  that forked, so :func:`spawn` forks from the main thread or from one spawner thread that
  lives as long as the process, never from a short-lived worker thread.
* ``watchdog`` (elsewhere; also usable on Linux): a tiny process (``python -m
  reach_broker.cluster.lifeline PID``) reads a pipe whose write end only the parent holds. The
  kernel closes that end however the parent ends; on EOF the watchdog sends the child
  SIGTERM, then SIGKILL after a grace. A clean stop writes ``q`` first: the watchdog then
  exits without touching the (already stopped) child.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, Literal

Guard = Literal["pdeathsig", "watchdog", "none"]

PR_SET_PDEATHSIG = 1
WATCHDOG_GRACE_S = 10.0
"""How long the watchdog waits after SIGTERM before it sends SIGKILL."""


def default_guard() -> Guard:
    return "pdeathsig" if sys.platform == "linux" else "watchdog"


def parent_death_preexec(sig: int = signal.SIGTERM) -> Callable[[], None] | None:
    """A ``preexec_fn`` that makes the child receive ``sig`` when this process dies, or
    ``None`` where the kernel has no such request (then use the watchdog).

    Everything is looked up before the fork: the child only calls ``prctl`` and checks that
    its parent did not die in between (the signal would then never come).
    """
    if sys.platform != "linux":
        return None
    try:
        import ctypes

        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    parent = os.getpid()

    def preexec() -> None:
        prctl(PR_SET_PDEATHSIG, int(sig))
        if os.getppid() != parent:
            os._exit(1)

    return preexec


_spawner: concurrent.futures.ThreadPoolExecutor | None = None
_spawner_lock = threading.Lock()


def _on_long_lived_thread(fn: Callable[[], subprocess.Popen[Any]]) -> subprocess.Popen[Any]:
    """Run ``fn`` (a fork) on the main thread or on the process's one spawner thread."""
    global _spawner
    if threading.current_thread() is threading.main_thread():
        return fn()
    with _spawner_lock:
        if _spawner is None:
            _spawner = concurrent.futures.ThreadPoolExecutor(1, "reach-spawner")
    return _spawner.submit(fn).result()


class Lifeline:
    """What keeps one child tied to this process; :meth:`release` before a clean stop."""

    def __init__(self, watchdog: subprocess.Popen[bytes] | None = None) -> None:
        self.watchdog = watchdog

    def release(self) -> None:
        """The child is being stopped by its owner: dismiss the watchdog (idempotent)."""
        dog, self.watchdog = self.watchdog, None
        if dog is None:
            return
        if dog.stdin is not None:
            with contextlib.suppress(OSError):
                dog.stdin.write(b"q")
                dog.stdin.close()
        try:
            dog.wait(5)
        except subprocess.TimeoutExpired:
            dog.kill()
            dog.wait()


def spawn(
    argv: list[str], *, guard: Guard | None = None, **popen: Any
) -> tuple[subprocess.Popen[Any], Lifeline]:
    """``subprocess.Popen(argv, **popen)`` with the child tied to this process by ``guard``
    (default :func:`default_guard`). ``popen`` must not set ``preexec_fn``."""
    guard = guard or default_guard()
    preexec = parent_death_preexec() if guard == "pdeathsig" else None
    if guard == "pdeathsig" and preexec is None:
        guard = "watchdog"
    proc = _on_long_lived_thread(lambda: subprocess.Popen(argv, preexec_fn=preexec, **popen))
    if guard != "watchdog":
        return proc, Lifeline()
    try:
        dog = subprocess.Popen(
            [sys.executable, "-m", "reach_broker.cluster.lifeline", str(proc.pid)],
            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, start_new_session=True,
        )  # fmt: skip
    except OSError:
        proc.kill()
        proc.wait()
        raise
    return proc, Lifeline(dog)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def watch(pid: int, grace: float = WATCHDOG_GRACE_S) -> int:
    """The watchdog: block until stdin ends; unless told ``q``, stop ``pid``."""
    for sig in (signal.SIGINT, signal.SIGHUP):  # only the pipe decides
        signal.signal(sig, signal.SIG_IGN)
    told = sys.stdin.buffer.read()
    if told.startswith(b"q") or not _alive(pid):
        return 0
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    if _alive(pid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1 or not argv[0].isdigit():
        sys.stderr.write(
            "usage: python -m reach_broker.cluster.lifeline PID  (stdin: the lifeline)\n"
        )
        return 2
    return watch(int(argv[0]))


if __name__ == "__main__":
    sys.exit(main())
