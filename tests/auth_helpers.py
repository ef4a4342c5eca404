"""Helpers of the auth tests: a real nats-server started from ``DIR/server.conf`` and plain
nats-py connections made with issued credentials (no reach code in between)."""

from __future__ import annotations

import asyncio
import re
import signal
import ssl
import subprocess
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import Any

from nats.aio.client import Client as NATS

from reach_agent.routing.table import partition
from reach_broker.auth import AuthDir
from reach_broker.cluster.natsserver import find_binary

from .conftest import wait_for


class AuthServer:
    """nats-server run from ``DIR/server.conf`` as it is (JetStream store included), on a
    free port; killed by its PID."""

    def __init__(self, d: AuthDir, log_dir: Path) -> None:
        self.d = d
        self.log = log_dir / "nats-server.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.port = 0

    @property
    def url(self) -> str:
        scheme = "tls" if self.d.meta().tls else "nats"
        return f"{scheme}://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def start(self, timeout: float = 10.0) -> None:
        self.log.parent.mkdir(parents=True, exist_ok=True)
        self.log.write_bytes(b"")
        args = [
            find_binary(),
            "-c",
            str(self.d.server_conf),
            "-a",
            "127.0.0.1",
            "-p",
            "-1",
            "-l",
            str(self.log),
        ]
        self.proc = subprocess.Popen(
            args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.proc = None
                raise AssertionError(f"nats-server exited: {self.log.read_text()[-2000:]}")
            match = _LISTEN_RE.search(self.log.read_text(errors="replace"))
            if match:
                self.port = int(match.group(1))
                return
            time.sleep(0.02)
        self.stop()
        raise AssertionError(f"nats-server did not listen within {timeout} s")

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


_LISTEN_RE = re.compile(r"Listening for client connections on 127\.0\.0\.1:(\d+)")


@contextmanager
def auth_server(d: AuthDir, log_dir: Path) -> Iterator[AuthServer]:
    server = AuthServer(d, log_dir)
    server.start()
    try:
        yield server
    finally:
        server.stop()


class Errors:
    """What reached a connection's error callback, as strings."""

    def __init__(self) -> None:
        self.seen: list[str] = []

    async def record(self, exc: Exception) -> None:
        self.seen.append(str(exc))

    async def wait(self, text: str, timeout: float = 5.0) -> None:  # noqa: ASYNC109
        await wait_for(lambda: text in self.seen, timeout, what=f"error {text!r} in {self.seen}")


def violation(action: str, subject: str) -> str:
    """The error nats-py reports for a refused publish or subscription (it lowercases the
    server's ``Permissions Violation for Publish to "<subject>"``, subject included). An
    agent subject published is checked, and named, as the server maps it (:func:`mapped`)."""
    if action == "publish":
        subject = mapped(subject)
    return f'nats: permissions violation for {action} to "{subject.lower()}"'


@asynccontextmanager
async def connect(
    url: str,
    creds: Path | None,
    name: str,
    inbox_prefix: str | None = None,
    *,
    tls_ca: Path | None = None,
    **options: Any,
) -> AsyncIterator[tuple[NATS, Errors]]:
    """A nats-py connection as ``name`` with the credentials ``creds``; closed at exit."""
    errors = Errors()
    opts: dict[str, Any] = {
        "servers": [url],
        "name": name,
        "error_cb": errors.record,
        "allow_reconnect": False,
        "max_reconnect_attempts": 1,
        "reconnect_time_wait": 0.1,
        "connect_timeout": 2,
    }
    if creds is not None:
        opts["user_credentials"] = str(creds)
    if inbox_prefix is not None:
        opts["inbox_prefix"] = inbox_prefix
    if tls_ca is not None:
        opts["tls"] = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=str(tls_ca))
    opts.update(options)
    nc = NATS()
    try:
        await asyncio.wait_for(nc.connect(**opts), 10)
    except BaseException:
        await nc.close()  # nats-py leaves a refused connection's socket open
        raise
    try:
        yield nc, errors
    finally:
        await nc.close()


HEARD = "reach.part.>"
"""Where the server delivers the agent subjects (mapped into partitions: `reach auth init`'s
account JWT): what a broker subscribes to."""


def unmapped(subject: str) -> str:
    """``reach.part.<n>.<kind>.<agent_id>`` as the agent published it (``reach.<kind>.<id>``),
    if ``n`` is the agent id's partition of 32; any other subject as it is."""
    parts = subject.split(".")
    if len(parts) == 5 and parts[:2] == ["reach", "part"]:
        if parts[2] == str(partition(parts[4], 32)):
            return f"reach.{parts[3]}.{parts[4]}"
    return subject


def mapped(subject: str) -> str:
    """``reach.<kind>.<agent_id>`` (announce, hb, leave, outcome) as the server maps it, and
    checks the publisher's rights on: ``reach.part.<n>.<kind>.<agent_id>``; any other as it
    is."""
    parts = subject.split(".")
    if len(parts) == 3 and parts[0] == "reach" and parts[1] in ("announce", "hb", "leave",
                                                                "outcome"):  # fmt: skip
        return f"reach.part.{partition(parts[2], 32)}.{parts[1]}.{parts[2]}"
    return subject


class Inbox:
    """Subjects (and messages) a subscription received, in order (mapped agent subjects as
    the agent published them: :func:`unmapped`)."""

    def __init__(self) -> None:
        self.msgs: list[Any] = []

    async def record(self, msg: Any) -> None:
        self.msgs.append(msg)

    @property
    def subjects(self) -> list[str]:
        return [unmapped(m.subject) for m in self.msgs]

    async def wait(self, subject: str, timeout: float = 5.0) -> None:  # noqa: ASYNC109
        await wait_for(
            lambda: subject in self.subjects, timeout, what=f"{subject!r} in {self.subjects}"
        )
