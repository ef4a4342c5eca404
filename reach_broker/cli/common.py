"""What every ``reach`` command shares: the error it raises, its common options, its NATS
connection and request, its signals and its reading of durations.

A command never builds connection options, subjects or messages of its own: the connection
comes from :func:`connect` (through :func:`reach_agent.connection.connect_options`), subjects
from :func:`subjects` (a :class:`reach_agent.subjects.Subjects`).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import signal
from typing import Any

from reach_agent.subjects import Subjects

EXIT_USAGE = 2
EXIT_UNAVAILABLE = 3

Subcommands = argparse._SubParsersAction  # what ``add_parser(sub)`` of a command receives


class CliError(Exception):
    """A failure to report as one line on stderr with exit code ``code``."""

    def __init__(self, message: str, code: int = 1) -> None:
        super().__init__(message)
        self.code = code


# --- options ------------------------------------------------------------------------------


def env_default(name: str, default: Any = None) -> Any:
    return os.environ.get(name, default)


def int_env(name: str) -> int | None:
    value = os.environ.get(name)
    return int(value) if value else None


def add_common(p: argparse.ArgumentParser) -> None:
    """The options every command takes, each also from an environment variable."""
    p.add_argument("--server", "-s", default=env_default("NATS_URL"),
                   help="NATS server URL(s), comma-separated (env NATS_URL)")  # fmt: skip
    p.add_argument("--creds", default=env_default("REACH_CREDS"),
                   help="NATS credentials file (env REACH_CREDS)")  # fmt: skip
    p.add_argument("--json", action="store_true", default=bool(env_default("REACH_JSON")),
                   help="machine-readable JSON output (env REACH_JSON)")  # fmt: skip
    p.add_argument("--prefix", default=env_default("REACH_PREFIX", "reach"),
                   help="subject prefix (env REACH_PREFIX)")  # fmt: skip
    p.add_argument("--timeout", type=float, default=float(env_default("REACH_TIMEOUT", "2")),
                   help="request timeout in seconds (env REACH_TIMEOUT)")  # fmt: skip
    p.add_argument("--log-format", choices=["text", "json"],
                   default=env_default("REACH_LOG_FORMAT", "text"))  # fmt: skip
    p.add_argument("--log-level", default=env_default("REACH_LOG_LEVEL", "info"))


def subjects(args: argparse.Namespace) -> Subjects:
    """The subjects under ``--prefix``, or a usage error naming the bad prefix."""
    try:
        return Subjects(args.prefix)
    except ValueError as exc:
        raise CliError(f"--{exc}", EXIT_USAGE) from None


_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def parse_duration(text: str, what: str = "--since") -> float:
    """``90s``, ``15m``, ``1h30m``, ``2d``, ``500ms`` or plain seconds → seconds (> 0)."""
    value = text.strip()
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|s|m|h|d)", value)
    if re.fullmatch(r"\d+(?:\.\d+)?", value):
        seconds = float(value)
    elif parts and "".join(n + u for n, u in parts) == value:
        seconds = sum(float(n) * _UNITS[u] for n, u in parts)
    else:
        raise CliError(f"{what} {text!r} is not a duration (like 90s, 15m, 1h30m, 2d)", EXIT_USAGE)
    if seconds <= 0:
        raise CliError(f"{what} {text!r} must be above zero", EXIT_USAGE)
    return seconds


# --- NATS ---------------------------------------------------------------------------------


def stop_on_signals() -> asyncio.Event:
    """An event SIGINT and SIGTERM set (call inside the running loop)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    return stop


async def connect(args: argparse.Namespace, name: str = "reach-cli") -> Any:
    """A NATS connection for a CLI command (one try per server, no reconnect), or a clear
    CliError."""
    import nats

    from reach_agent.connection import Credentials, connect_options, server_list

    try:
        servers = server_list(args.server or None)
    except ValueError as exc:
        raise CliError(f"--server: {exc}", EXIT_USAGE) from None
    errors: list[BaseException] = []

    async def on_error(exc: Exception) -> None:  # nats-py would log a traceback per attempt
        errors.append(exc)

    try:
        # max_reconnect_attempts=0 would mean "forever" to nats-py's initial server loop;
        # 1 tries each server twice, 0.1 s apart, then gives up.
        options = connect_options(
            name,
            servers,
            Credentials(creds=args.creds),
            connect_timeout=args.timeout,
            max_reconnect_attempts=1,
            reconnect_time_wait=0.1,
            allow_reconnect=False,
            error_cb=on_error,
        )
        return await nats.connect(**options)
    except Exception as exc:  # every connect failure is the same to a user
        cause = errors[-1] if errors else exc
        raise CliError(
            f"cannot connect to NATS at {','.join(servers)}: {cause or type(cause).__name__} "
            "(is `reach broker` running? set --server or NATS_URL)",
            EXIT_UNAVAILABLE,
        ) from None


async def request(nc: Any, subject: str, data: bytes, timeout_s: float) -> bytes:
    """Request-reply that turns no-responders, timeouts and error replies into CliError."""
    from nats.errors import NoRespondersError
    from nats.errors import TimeoutError as NatsTimeout

    from reach_agent.errors import from_reply

    try:
        msg = await nc.request(subject, data, timeout=timeout_s)
    except NoRespondersError:
        raise CliError(
            f"no broker answers on {subject} (is `reach broker` running on this server?)",
            EXIT_UNAVAILABLE,
        ) from None
    except NatsTimeout:
        raise CliError(f"no reply on {subject} within {timeout_s}s", EXIT_UNAVAILABLE) from None
    err = from_reply(msg.headers, msg.data)
    if err is not None:
        raise CliError(f"{err.code}: {err.message}")
    return bytes(msg.data)


async def ask(args: argparse.Namespace, subject: str, data: bytes) -> bytes:
    """One :func:`request` on a connection of its own (closed after), for one-shot commands."""
    nc = await connect(args)
    try:
        return await request(nc, subject, data, args.timeout)
    finally:
        await nc.close()
