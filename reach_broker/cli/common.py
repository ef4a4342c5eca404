"""What every ``reach`` command shares: the error it raises, its common options (and their
checks: server URLs, capability names), its NATS connection and request, its signals and its
reading of durations.

A command never builds connection options, subjects or messages of its own: the connection
comes from :func:`connect` (through :func:`reach_agent.connection.connect_options`), subjects
from :func:`subjects` (a :class:`reach_agent.wire.subjects.Subjects`).
"""

from __future__ import annotations

import argparse
import asyncio
import errno
import logging
import os
import re
import socket
import urllib.parse
import weakref
from typing import Any

from reach_agent.wire.subjects import Subjects
from reach_broker.process import STOP_SIGNALS

log = logging.getLogger("reach")

EXIT_USAGE = 2
EXIT_UNAVAILABLE = 3
_KINDS = {EXIT_USAGE: "USAGE", EXIT_UNAVAILABLE: "UNAVAILABLE"}

Subcommands = argparse._SubParsersAction  # what ``add_parser(sub)`` of a command receives


class CliError(Exception):
    """A failure reported as one line on stderr (with ``--json`` also as one JSON object on
    stdout, :meth:`as_json`) and exit code ``code``.

    ``kind`` is the wire error code when the failure is a reach error reply
    (``NO_REACHABLE_AGENT``), else ``USAGE`` (exit 2), ``UNAVAILABLE`` (3) or ``ERROR`` (1).
    """

    def __init__(self, message: str, code: int = 1, *, kind: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.kind = kind or _KINDS.get(code, "ERROR")
        self.detail = message
        self.extra: dict[str, Any] = {}
        """Members the ``--json`` object carries beside ``error`` (a route's ``explain``)."""

    @classmethod
    def of(cls, err: Any) -> CliError:
        """A :class:`~reach_agent.wire.errors.ReachError` (an error reply): exit code 1."""
        out = cls(f"{err.code}: {err.message}", 1, kind=err.code)
        out.detail = err.message
        return out

    def as_json(self) -> dict[str, Any]:
        """``{"error": {"code", "message", "exit"}}``: the wire's error body, plus the exit."""
        return {"error": {"code": self.kind, "message": self.detail, "exit": self.code},
                **self.extra}  # fmt: skip


# --- options ------------------------------------------------------------------------------


def env_default(name: str, default: Any = None) -> Any:
    """The environment variable ``name``; set but empty counts as unset."""
    return os.environ.get(name) or default


def int_env(name: str) -> int | None:
    value = os.environ.get(name)
    return int(value) if value else None


def add_common(
    p: argparse.ArgumentParser,
    *,
    timeout: float = 2.0,
    timeout_help: str = "request timeout in seconds",
) -> None:
    """The options every command takes, each also from an environment variable."""
    p.add_argument("--server", "-s", default=env_default("NATS_URL"),
                   help="NATS server URL(s), comma-separated (env NATS_URL)")  # fmt: skip
    p.add_argument("--context", default=env_default("NATS_CONTEXT"), metavar="NAME",
                   help="a `nats` CLI context (~/.config/nats/context/NAME.json): its server "
                        "and credentials fill what the other options leave unset (env "
                        "NATS_CONTEXT; default the selected one)")  # fmt: skip
    p.add_argument("--creds", default=env_default("REACH_CREDS"),
                   help="NATS credentials file, e.g. from `reach auth` (env REACH_CREDS; "
                        "NATS_CREDS also works)")  # fmt: skip
    p.add_argument("--tls-ca", default=env_default("NATS_CA"), metavar="PEM",
                   help="CA certificate the server's must chain to; turns TLS on "
                        "(env NATS_CA; `reach auth init --tls`: DIR/tls/ca.pem)")  # fmt: skip
    p.add_argument("--json", action="store_true", default=bool(env_default("REACH_JSON")),
                   help="machine-readable JSON output (env REACH_JSON)")  # fmt: skip
    p.add_argument("--prefix", default=env_default("REACH_PREFIX", "reach"),
                   help="subject prefix (env REACH_PREFIX)")  # fmt: skip
    p.add_argument("--timeout", type=float, default=float(env_default("REACH_TIMEOUT", timeout)),
                   help=f"{timeout_help} (default {timeout:g}; env REACH_TIMEOUT)")  # fmt: skip
    add_log_options(p)


def add_log_options(p: argparse.ArgumentParser) -> None:
    """``--log-format`` and ``--log-level``: every command has them, also those that take
    no connection options (``reach auth``, ``reach dev-cluster``)."""
    p.add_argument("--log-format", choices=["text", "json"],
                   default=env_default("REACH_LOG_FORMAT", "text"),
                   help="log lines on stderr as text or one JSON object each (env "
                        "REACH_LOG_FORMAT)")  # fmt: skip
    p.add_argument("--log-level", default=env_default("REACH_LOG_LEVEL", "info"),
                   help="debug, info, warning or error (default info; env "
                        "REACH_LOG_LEVEL)")  # fmt: skip


def subjects(args: argparse.Namespace) -> Subjects:
    """The subjects under ``--prefix``, or a usage error naming the bad prefix."""
    try:
        return Subjects(args.prefix)
    except ValueError as exc:
        raise CliError(f"--{exc}", EXIT_USAGE) from None


def capability(value: str, flag: str = "capability") -> str:
    """``value`` if it is a capability name (the wire schema's own check), else a usage
    error naming the flag and the value."""
    from reach_agent.wire.errors import InvalidCapability
    from reach_agent.wire.schema import check_capability

    try:
        return check_capability(value, flag)
    except InvalidCapability as exc:
        raise CliError(exc.message, EXIT_USAGE, kind=exc.code) from None


def tags(items: list[str] | None, flag: str = "--tag") -> dict[str, str]:
    """``K=V`` options as a dict, or a usage error naming the one that is not."""
    out: dict[str, str] = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep:
            raise CliError(f"{flag} {item!r} is not key=value", EXIT_USAGE)
        out[key] = value
    return out


NATS_SCHEMES = ("nats", "tls", "ws", "wss")


def servers(args: argparse.Namespace) -> list[str]:
    """The server URLs of ``--server``/``NATS_URL`` (default ``nats://127.0.0.1:4222``),
    each checked to be a NATS URL, or a usage error naming the bad one."""
    from reach_agent.connection import Credentials, resolve, server_list

    if args.server is not None and not args.server.replace(",", "").strip():
        raise CliError(f"--server {args.server!r} names no NATS server (give nats://HOST:PORT, "
                       "or leave it out for nats://127.0.0.1:4222)", EXIT_USAGE)  # fmt: skip
    try:
        urls = server_list(args.server)
    except ValueError as exc:
        raise CliError(f"--server: {exc}", EXIT_USAGE) from None
    if args.server is None:  # NATS_URL, else the NATS context's server, else localhost
        try:
            urls = resolve(None, Credentials(context=getattr(args, "context", None)))[0]
        except ValueError as exc:
            raise CliError(str(exc), EXIT_USAGE) from None
    for url in urls:
        parts = urllib.parse.urlsplit(url if "://" in url else f"nats://{url}")
        if parts.scheme not in NATS_SCHEMES:
            raise CliError(f"--server {url!r}: {parts.scheme}:// is not a NATS URL (use "
                           "nats://HOST:PORT, tls://, ws:// or wss://)", EXIT_USAGE)  # fmt: skip
        try:
            parts.port  # noqa: B018 - parsing it is the check
        except ValueError:
            raise CliError(f"--server {url!r}: the port is not a number", EXIT_USAGE) from None
        if not parts.hostname:
            raise CliError(f"--server {url!r} names no host", EXIT_USAGE)
    return urls


def connection_options(
    args: argparse.Namespace, name: str, *, urls: list[str] | None = None, **overrides: Any
) -> dict[str, Any]:
    """nats-py ``connect()`` options for ``--server`` (or ``urls``) and ``--creds`` (and the
    ``NATS_*`` environment), or a usage error: a credentials file that does not exist is
    named as such, not reported as a failure to connect."""
    from reach_agent.connection import Credentials, connect_options

    urls = urls or servers(args)
    cred = Credentials(creds=args.creds, tls_ca=getattr(args, "tls_ca", None),
                       context=getattr(args, "context", None))  # fmt: skip
    try:
        return connect_options(name, urls, cred, **overrides)
    except ValueError as exc:
        raise CliError(str(exc), EXIT_USAGE) from None


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
    """An event SIGINT, SIGTERM and SIGHUP set (call inside the running loop)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in STOP_SIGNALS:
        loop.add_signal_handler(sig, stop.set)
    return stop


def default_signals() -> None:
    """Undo :func:`stop_on_signals`: the signals act as Python's defaults again."""
    loop = asyncio.get_running_loop()
    for sig in STOP_SIGNALS:
        loop.remove_signal_handler(sig)


async def connect(
    args: argparse.Namespace,
    name: str = "reach-cli",
    *,
    urls: list[str] | None = None,
    **overrides: Any,
) -> Any:
    """A NATS connection for a CLI command to ``--server`` (or ``urls``): one try per
    server, no reconnect unless ``overrides`` say so; or a clear CliError."""
    import nats

    from reach_agent.grants import violation_of

    errors: list[BaseException] = []
    refused: list[Any] = []

    async def on_error(exc: Exception) -> None:  # nats-py would log a traceback per attempt
        violation = violation_of(exc)
        if violation is None:
            errors.append(exc)
            return
        refused.append(violation)
        log.warning("permission denied: %s to %r (credentials %s)", violation.action,
                    violation.subject, args.creds or os.environ.get("NATS_CREDS"))  # fmt: skip

    timeout = min(args.timeout, CONNECT_TIMEOUT_S)
    # max_reconnect_attempts=0 would mean "forever" to nats-py's initial server loop;
    # 1 tries each server twice, 0.1 s apart, then gives up.
    options = connection_options(
        args, name, urls=urls, **{"connect_timeout": timeout, "max_reconnect_attempts": 1,
                       "reconnect_time_wait": 0.1, "allow_reconnect": False,
                       "error_cb": on_error, **overrides},
    )  # fmt: skip
    try:
        nc = await nats.connect(**options)
        _REFUSED[nc] = refused
        return nc
    except Exception as exc:  # every connect failure is one line to a user
        cause = errors[-1] if errors else exc
        raise CliError(
            f"cannot connect to NATS at {','.join(options['servers'])}: "
            f"{connect_failure(cause, timeout)}",
            EXIT_UNAVAILABLE,
        ) from None


_REFUSED: weakref.WeakKeyDictionary[Any, list[Any]] = weakref.WeakKeyDictionary()
"""The permission violations the server reported on each CLI connection."""


def refusal(nc: Any, what: str) -> CliError | None:
    """A clear error when the server refused something on ``nc`` (a request that then timed
    out): which subject, and that it is the credentials' doing."""
    refused = _REFUSED.get(nc) or []
    if not refused:
        return None
    v = refused[-1]
    return CliError(
        f"{what}: the server refused {v.action} to {v.subject!r} for these credentials "
        "(check --creds / NATS_CREDS: a caller's credential may route, call, submit and read "
        "acks; reading REACH_AUDIT history and broker stats needs the broker's)",
        1, kind="FORBIDDEN",
    )  # fmt: skip


CONNECT_TIMEOUT_S = 5.0
"""The longest a command waits for a server's greeting (``--timeout`` when shorter)."""


def connect_failure(cause: BaseException, timeout: float) -> str:
    """Why a connection failed, in words a user can act on."""
    from nats.errors import AuthorizationError
    from nats.errors import Error as NatsError
    from nats.errors import TimeoutError as NatsTimeout

    if isinstance(cause, ConnectionRefusedError) or (
        isinstance(cause, OSError) and cause.errno == errno.ECONNREFUSED
    ):
        return "connection refused (is `reach broker` running? set --server or NATS_URL)"
    if isinstance(cause, socket.gaierror):
        return f"unknown host ({cause.strerror})"
    if isinstance(cause, AuthorizationError) or "authorization violation" in str(cause).lower():
        return ("authorization violation (check --creds, NATS_CREDS, NATS_USER/NATS_PASSWORD "
                "or NATS_TOKEN)")  # fmt: skip
    if isinstance(cause, TimeoutError | NatsTimeout):
        return (f"no NATS greeting within {timeout:g}s: is this a NATS client port? "
                "(nats-server listens on 4222 by default; 8222 is for monitoring)")  # fmt: skip
    if isinstance(cause, NatsError) and "INFO" in str(cause):
        return "the server there does not speak NATS (is this a NATS client port?)"
    return str(cause) or type(cause).__name__


async def exchange(nc: Any, subject: str, data: bytes, timeout_s: float) -> Any:
    """Request-reply that turns no-responders and timeouts into CliError; the reply ``Msg``
    (an error reply too)."""
    from nats.errors import NoRespondersError
    from nats.errors import TimeoutError as NatsTimeout

    try:
        return await nc.request(subject, data, timeout=timeout_s)
    except NoRespondersError:
        raise CliError(
            f"no broker answers on {subject} (is `reach broker` running on this server?)",
            EXIT_UNAVAILABLE,
        ) from None
    except NatsTimeout:
        raise refusal(nc, f"no reply on {subject}") or CliError(
            f"no reply on {subject} within {timeout_s}s", EXIT_UNAVAILABLE
        ) from None


def body_of(msg: Any) -> bytes:
    """A reply's body, or the CliError of the error reply it is."""
    from reach_agent.wire.errors import from_reply

    err = from_reply(msg.headers, msg.data)
    if err is not None:
        raise CliError.of(err)
    return bytes(msg.data)


async def request(nc: Any, subject: str, data: bytes, timeout_s: float) -> bytes:
    """:func:`exchange` that also turns an error reply into CliError; the reply body."""
    return body_of(await exchange(nc, subject, data, timeout_s))


async def ask(args: argparse.Namespace, subject: str, data: bytes) -> bytes:
    """One :func:`request` on a connection of its own (closed after), for one-shot commands."""
    return body_of(await ask_msg(args, subject, data))


async def ask_msg(args: argparse.Namespace, subject: str, data: bytes) -> Any:
    """One :func:`exchange` on a connection of its own: the reply ``Msg``, error or not."""
    nc = await connect(args)
    try:
        return await exchange(nc, subject, data, args.timeout)
    finally:
        await nc.close()
