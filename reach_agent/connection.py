"""How every reach process connects to NATS: one function builds the connection options.

:func:`connect_options` is used by the agent, the client, the broker, the CLI and the ack
writer alike, so credentials, TLS and reconnect behaviour are decided in one place. Every
setting may be given explicitly or come from the environment, with the names the ``nats``
CLI uses: ``NATS_URL`` (comma-separated servers), ``NATS_CREDS`` (a credentials file: user
JWT + nkey seed), ``NATS_NKEY`` (an nkey seed file), ``NATS_USER`` / ``NATS_PASSWORD``,
``NATS_TOKEN``, ``NATS_CA`` / ``NATS_CERT`` / ``NATS_KEY`` (TLS). An explicit value wins
over the environment, and both win over a ``nats`` CLI context (:class:`NatsContext`): the
one named by the ``context`` option or ``NATS_CONTEXT``, else the one selected in
``context.txt``, read from ``$XDG_CONFIG_HOME/nats`` (default ``~/.config/nats``) with the
field names the ``nats`` CLI writes. A file that does not exist is a ``ValueError`` naming
the setting and the path, at once, rather than a connect failure later. A credentials file
also sets the connection's inbox prefix: the private ``_INBOX.<role>.<name>`` its user JWT
lets it subscribe to (:mod:`reach_agent.grants`), or no reply would ever reach it.

Also here: the connection plumbing every reach process shares (:func:`flush_subscriptions`,
:func:`drain_or_close`, the jittered reconnect handler).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import ssl
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TypedDict

import msgspec

from jetstream.roundtrip import round_trip

from . import grants
from .aio import stop_loops

log = logging.getLogger(__name__)

DEFAULT_URL = "nats://127.0.0.1:4222"

ENV = {
    "context": "NATS_CONTEXT",
    "creds": "NATS_CREDS",
    "nkey_seed": "NATS_NKEY",
    "user": "NATS_USER",
    "password": "NATS_PASSWORD",
    "token": "NATS_TOKEN",
    "tls_ca": "NATS_CA",
    "tls_cert": "NATS_CERT",
    "tls_key": "NATS_KEY",
}
"""Environment variable of each :class:`Credentials` field (the ``nats`` CLI's names)."""

_FILES = ("creds", "nkey_seed", "tls_ca", "tls_cert", "tls_key")


class CredentialOptions(TypedDict, total=False):
    """The credential keywords of ``Agent(...)``, ``Client(...)`` and ``reach_agent.run()``:
    the fields of :class:`Credentials`."""

    context: str | None
    creds: str | None
    nkey_seed: str | None
    user: str | None
    password: str | None
    token: str | None
    tls_ca: str | None
    tls_cert: str | None
    tls_key: str | None
    inbox_prefix: str | None


class Credentials(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Who a connection is and how it trusts the server. Every field is optional."""

    context: str | None = None
    """A ``nats`` CLI context (:class:`NatsContext`) whose settings fill what is left unset;
    ``""``: none, not even the selected one."""
    creds: str | None = None
    """A NATS credentials file (user JWT and nkey seed), e.g. from ``reach auth agent``."""
    nkey_seed: str | None = None
    """A file holding an nkey seed (``SU…``), for servers configured with nkey users."""
    user: str | None = None
    """User name, for servers configured with user/password."""
    password: str | None = None
    """Password of ``user``."""
    token: str | None = None
    """An authorization token, for servers configured with one."""
    tls_ca: str | None = None
    """CA certificate (PEM) the server's certificate must chain to; turns TLS on."""
    tls_cert: str | None = None
    """Client certificate (PEM), for servers that verify clients; needs ``tls_key``."""
    tls_key: str | None = None
    """Private key (PEM) of ``tls_cert``."""
    inbox_prefix: str | None = None
    """Prefix of the connection's reply subjects (one a credentials file's grants name wins)."""

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Credentials:
        """The credentials the environment names (``NATS_CREDS``, ``NATS_CA``, …)."""
        env = os.environ if env is None else env
        return cls(**{f: env[v] for f, v in ENV.items() if env.get(v)})

    def check(self) -> Credentials:
        """Raise ``ValueError`` naming the setting for a file or a NATS context that does not
        exist, a password without a user, or half a TLS key pair; returns ``self``."""
        if self.context:
            load_context(self.context)
        for field in _FILES:
            path = getattr(self, field)
            if path is not None and not Path(path).expanduser().is_file():
                raise ValueError(
                    f"{field} file {path!r} does not exist (set by the {field} option or "
                    f"{ENV[field]})"
                )
        if self.password is not None and self.user is None:
            raise ValueError("password is set but user is not (NATS_USER / the user option)")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("tls_cert and tls_key go together: give both or neither")
        return self

    def over(self, base: Credentials) -> Credentials:
        """These credentials, with every field left unset taken from ``base``."""
        return Credentials(
            **{f: getattr(self, f) if getattr(self, f) is not None else getattr(base, f)
               for f in self.__struct_fields__}
        )  # fmt: skip


class NatsContext(msgspec.Struct, frozen=True, kw_only=True):
    """A ``nats`` CLI context: ``<config>/nats/context/<name>.json``, where ``<config>`` is
    ``$XDG_CONFIG_HOME`` or ``~/.config``, as ``nats context save`` writes it (the field
    names are the CLI's; those reach has no use for, such as ``jetstream_domain``, are
    ignored). Empty means unset."""

    description: str = ""
    url: str = ""
    """Server URL(s), comma-separated."""
    token: str = ""
    user: str = ""
    password: str = ""
    creds: str = ""
    """A credentials file."""
    nkey: str = ""
    """A file holding an nkey seed."""
    cert: str = ""
    key: str = ""
    ca: str = ""
    inbox_prefix: str = ""

    def credentials(self) -> Credentials:
        """The context's settings as :class:`Credentials` (paths with ``~`` expanded)."""

        def path(value: str) -> str | None:
            return str(Path(value).expanduser()) if value else None

        return Credentials(
            creds=path(self.creds), nkey_seed=path(self.nkey), user=self.user or None,
            password=self.password or None, token=self.token or None, tls_ca=path(self.ca),
            tls_cert=path(self.cert), tls_key=path(self.key),
            inbox_prefix=self.inbox_prefix or None,
        )  # fmt: skip


def context_dir(env: Mapping[str, str] | None = None) -> Path:
    """Where the ``nats`` CLI keeps its contexts: ``$XDG_CONFIG_HOME/nats`` or
    ``~/.config/nats``."""
    env = os.environ if env is None else env
    home = Path(env.get("HOME") or "~").expanduser()
    return Path(env.get("XDG_CONFIG_HOME") or home / ".config") / "nats"


def context_name(named: str | None, env: Mapping[str, str] | None = None) -> str | None:
    """The context a connection uses: ``named`` (``""``: none), else ``NATS_CONTEXT``, else
    the one selected in ``context.txt`` (``nats context select``); None: no context."""
    env = os.environ if env is None else env
    if named is not None:
        return named or None
    if env.get("NATS_CONTEXT"):
        return env["NATS_CONTEXT"]
    try:
        selected = (context_dir(env) / "context.txt").read_text().strip()
    except OSError:
        return None
    return selected or None


def load_context(name: str, env: Mapping[str, str] | None = None) -> NatsContext:
    """The context ``name``, or a ``ValueError`` naming it and its file."""
    if not name or ".." in name or "/" in name:
        raise ValueError(f"NATS context {name!r} is not a context name")
    path = context_dir(env) / "context" / f"{name}.json"
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise ValueError(f"NATS context {name!r} not found: no file {path} (set by the "
                         "context option, --context or NATS_CONTEXT)") from None  # fmt: skip
    except OSError as exc:
        raise ValueError(f"NATS context {name!r}: cannot read {path}: {exc.strerror}") from None
    try:
        return msgspec.json.decode(data, type=NatsContext)
    except msgspec.DecodeError as exc:
        raise ValueError(f"NATS context {name!r}: {path} is not a context: {exc}") from None


def resolve(
    servers: str | Sequence[str] | None,
    credentials: Credentials | None = None,
    env: Mapping[str, str] | None = None,
) -> tuple[list[str], Credentials]:
    """The servers and credentials a connection uses, as the ``nats`` CLI decides them:
    each setting given explicitly, else from its ``NATS_*`` variable, else from the context
    (:func:`context_name`), else the default (``nats://127.0.0.1:4222``, no credentials).
    A user or a client certificate set explicitly or in the environment takes its pair
    (password, key) from there too, never from the context. The result names no context
    any more (``context=""``): resolving it again changes nothing."""
    cred = (credentials or Credentials()).over(Credentials.from_env(env))
    url = servers if servers is not None else (os.environ if env is None else env).get("NATS_URL")
    name = context_name(cred.context, env)
    if name is not None:
        ctx = load_context(name, env)
        fill = ctx.credentials()
        if cred.user is not None:
            fill = msgspec.structs.replace(fill, user=None, password=None)
        if cred.tls_cert is not None:
            fill = msgspec.structs.replace(fill, tls_cert=None, tls_key=None)
        cred = cred.over(fill)
        if not url and ctx.url:
            url = ctx.url
    return server_list(url or DEFAULT_URL, env), msgspec.structs.replace(cred, context="")


def server_list(
    servers: str | Sequence[str] | None, env: Mapping[str, str] | None = None
) -> list[str]:
    """``servers`` as a list; ``None`` reads ``NATS_URL`` (comma-separated), else localhost
    (:func:`resolve` also reads the context)."""
    if servers is None:
        servers = (os.environ if env is None else env).get("NATS_URL") or DEFAULT_URL
    if isinstance(servers, str):
        servers = servers.split(",")
    out = [s.strip() for s in servers if s and s.strip()]
    if not out:
        raise ValueError(f"servers {servers!r} names no NATS server")
    return out


def reconnect_with_jitter(servers: list[Any], info: dict[str, Any]) -> tuple[Any, float]:
    """nats-py ``reconnect_to_server_handler``: least-tried server first, exponential
    delay with jitter (0.1 s doubling to 2 s, x0.5-1.5) so a fleet does not reconnect in
    lockstep after a server restart."""
    server = min(servers, key=lambda s: s.reconnects)
    base = min(0.1 * 2 ** min(server.reconnects, 5), 2.0)
    return server, base * (0.5 + random.random())


def tls_context(cred: Credentials) -> ssl.SSLContext | None:
    """An SSL context for ``tls_ca`` / ``tls_cert`` + ``tls_key``, or None when neither."""
    if cred.tls_ca is None and cred.tls_cert is None:
        return None
    cred.check()
    ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=cred.tls_ca)
    if cred.tls_cert is not None and cred.tls_key is not None:
        ctx.load_cert_chain(cred.tls_cert, cred.tls_key)
    return ctx


def connect_options(
    name: str,
    servers: str | Sequence[str] | None = None,
    credentials: Credentials | None = None,
    *,
    env: Mapping[str, str] | None = None,
    **overrides: Any,
) -> dict[str, Any]:
    """Keyword arguments for nats-py ``connect()``: servers, name, credentials, TLS and the
    reconnect behaviour of a long-lived reach connection.

    ``credentials`` override what the environment names (``NATS_CREDS``, …), both what the
    ``nats`` CLI context names (:func:`resolve`); ``overrides`` replace any option (a CLI
    command connects with ``allow_reconnect=False``, the broker passes its callbacks and
    ping settings).
    """
    urls, cred = resolve(servers, credentials, env)
    cred.check()
    opts: dict[str, Any] = {
        "servers": urls,
        "name": name,
        "ping_interval": 2,
        "max_outstanding_pings": 2,
        "allow_reconnect": True,
        "max_reconnect_attempts": -1,  # also: the first connect waits for a server
        "reconnect_time_wait": 0.5,  # pause between first-connect attempts
        "reconnect_to_server_handler": reconnect_with_jitter,
        "connect_timeout": 2,
    }
    if cred.creds is not None:
        opts["user_credentials"] = str(Path(cred.creds).expanduser())
        found = _grants(cred.creds)
        if found is not None and found.inbox_prefix is not None:
            opts["inbox_prefix"] = found.inbox_prefix
    if cred.inbox_prefix is not None and "inbox_prefix" not in opts:
        opts["inbox_prefix"] = cred.inbox_prefix
    if cred.nkey_seed is not None:
        opts["nkeys_seed"] = str(Path(cred.nkey_seed).expanduser())
    if cred.user is not None:
        opts["user"] = cred.user
        opts["password"] = cred.password
    if cred.token is not None:
        opts["token"] = cred.token
    ctx = tls_context(cred)
    if ctx is not None:
        opts["tls"] = ctx
    opts.update(overrides)
    return opts


def credential_grants(
    credentials: Credentials | None = None, env: Mapping[str, str] | None = None
) -> tuple[str, grants.Grants] | None:
    """(the credentials file, what its user JWT allows), for the credentials a connection
    would use (``NATS_CREDS`` included); None without a credentials file."""
    _, cred = resolve([DEFAULT_URL], credentials, env)
    if cred.creds is None:
        return None
    found = _grants(cred.creds)
    return None if found is None else (cred.creds, found)


def _grants(creds: str) -> grants.Grants | None:
    """What a credentials file's user JWT allows; None when it holds none we can read (the
    connect then fails, or succeeds, on the server's word alone)."""
    try:
        return grants.read_creds(creds)
    except grants.GrantError as exc:
        log.debug("connection.creds_unreadable %s", exc)
        return None


_REFUSALS = ("authorization violation", "authentication revoked", "authentication expired")


def is_refusal(exc: BaseException) -> bool:
    """Whether an error callback's exception is the server refusing the credentials."""
    text = str(exc).lower()
    return any(r in text for r in _REFUSALS)


class NotConnected(ConnectionError):
    """The first connect was stopped (a signal, a shutdown) before any server accepted it."""


FLUSH_TIMEOUT_S = 10.0
"""How long :func:`flush_subscriptions` waits for each PONG (nats-py's flush default)."""
CONNECT_LOG_EVERY_S = 2.0
"""At most one ``<role>.connect_failed`` line per this many seconds (each says how many
attempts failed so far): a first connect retries every ``reconnect_time_wait``."""


class _FirstConnect:
    """Says each failed attempt of a first connect (rate-limited), with the server tried."""

    def __init__(self, nc: Any, role: str, what: str, name: str, servers: Sequence[str]) -> None:
        self.nc = nc
        self.role = role
        self.what = what
        self.name = name
        self.servers = list(servers)
        self.failures = 0
        self.last_error: BaseException | None = None
        self._said_at = float("-inf")

    def failed(self, exc: BaseException) -> None:
        self.failures += 1
        self.last_error = exc
        now = asyncio.get_running_loop().time()
        if now - self._said_at < CONNECT_LOG_EVERY_S:
            return
        self._said_at = now
        log.warning("%s.connect_failed %s=%s server=%s error=%s attempts=%d: no NATS server "
                    "accepted the connection yet; trying again", self.role, self.role,
                    self.name, self.server(), describe(exc), self.failures)  # fmt: skip

    def server(self) -> str:
        """The server the last attempt went to (nats-py tries its pool in turn)."""
        pool = getattr(self.nc, "_server_pool", None) or []
        tried = [s for s in pool if getattr(s, "last_attempt", None) is not None]
        if tried:
            uri = max(tried, key=lambda s: s.last_attempt).uri
            return f"{uri.scheme}://{uri.hostname}:{uri.port}"
        return ",".join(self.servers)

    def never(self) -> NotConnected:
        last = f"; last error: {describe(self.last_error)}" if self.last_error else ""
        return NotConnected(
            f"{self.what} never connected to {','.join(self.servers)}: stopped after "
            f"{self.failures} failed attempt(s){last}"
        )


def describe(exc: BaseException) -> str:
    """An exception as the one-line reason a connect failed."""
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


async def connect(
    nc: Any,
    options: dict[str, Any],
    *,
    what: str,
    role: str = "agent",
    stop: asyncio.Event | None = None,
) -> None:
    """``nc.connect(**options)`` for a long-lived connection (its first connect retries until
    a server answers), except that:

    - each failed attempt is logged as ``<role>.connect_failed <role>=<name> server=…
      error=… attempts=N`` (at most every :data:`CONNECT_LOG_EVERY_S`), so a typo in ``NATS_URL`` or
      a server not started yet is visible at once;
    - ``stop`` being set (a signal handler's event) ends the wait at once with
      :class:`NotConnected` (nats-py's ``connect()`` retries forever inside itself with
      ``max_reconnect_attempts=-1``, so it is raced against ``stop``, never left to end);
    - the server refusing the credentials ends it at once with
      :class:`~reach_agent.wire.errors.Forbidden` naming ``what`` and the credentials file,
      instead of retrying until a timeout that would blame the network."""
    from reach_agent.wire.errors import Forbidden

    loop = asyncio.get_running_loop()
    refused: asyncio.Future[BaseException] = loop.create_future()
    user_cb = options.get("error_cb")
    first = _FirstConnect(nc, role, what, options.get("name") or "?", options.get("servers", []))
    attempt: asyncio.Task[Any] | None = None

    async def on_error(exc: Exception) -> None:
        if attempt is not None and not attempt.done() and not nc.is_connected:
            if is_refusal(exc) and not refused.done():
                refused.set_result(exc)
            elif not refused.done():
                first.failed(exc)
        if user_cb is not None:
            await user_cb(exc)

    attempt = asyncio.create_task(nc.connect(**{**options, "error_cb": on_error}))
    stopped = asyncio.ensure_future(stop.wait()) if stop is not None else loop.create_future()
    try:
        await asyncio.wait({attempt, refused, stopped}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:  # cancelled (a timeout, a shutdown): the attempt ends too
        await stop_loops(attempt)
        raise
    finally:
        stopped.cancel()
    if attempt.done():
        attempt.result()
        if first.failures:
            log.info("%s.connected %s=%s after %d failed attempt(s)", role, role, first.name,
                     first.failures)  # fmt: skip
        return
    # Cancelled again until it ends: a cancel that races the wait_for of nats-py's TCP
    # connect completing is swallowed on 3.11, and its retry loop would go on for ever.
    await stop_loops(attempt)
    with contextlib.suppress(Exception):
        await nc.close()
    if not refused.done():
        raise first.never()
    creds = options.get("user_credentials") or "(none)"
    raise Forbidden(f"{what}: the server at {', '.join(options.get('servers', []))} refused the "
                    f"credentials {creds}: {refused.result()}")  # fmt: skip


async def flush_subscriptions(nc: Any) -> None:
    """Return once the server has registered every SUB sent so far.

    nats-py 2.16 ``flush()`` writes its PING straight to the socket while SUB commands wait
    in the pending buffer for the flusher task, so the PONG can arrive before the server saw
    the SUBs (a request right after start then gets "no responders"). By the first PONG the
    flusher has written the SUBs; a second PING queues behind them. Each round trip is
    :func:`jetstream.roundtrip.round_trip`, so a cancel (a stop's grace running out) never
    leaves the connection deaf.
    """
    await round_trip(nc, FLUSH_TIMEOUT_S)
    await round_trip(nc, FLUSH_TIMEOUT_S)


async def drain_subscription(nc: Any, sub: Any, grace_s: float) -> None:
    """Stop ``sub``'s deliveries, returning once every message the server sent it has been
    handled by its callback (up to ``grace_s``); never raises.

    nats-py 2.16's ``Subscription.drain()`` fences its UNSUB with one ``flush()``, whose PING
    can overtake the UNSUB (see :func:`flush_subscriptions`): a message the server delivered
    between that PONG and its reading the UNSUB arrived after the subscription was removed
    and was dropped unseen (a queue-group request never answered: 18 messages lost in 2 of
    30 drains under a steady publish, none with this fence). nats-py keeps the pieces of its
    drain private; they are used here in its own order, fenced by two round trips.
    """
    if nc.is_closed or sub._closed:
        return
    if not nc.is_connected or nc.is_draining:
        with contextlib.suppress(Exception):  # nothing more will come: let it go
            await sub.unsubscribe()
        return
    try:
        await nc._send_unsubscribe(sub._id)
        async with asyncio.timeout(grace_s):
            await flush_subscriptions(nc)  # the server has read the UNSUB: nothing follows
            await sub._pending_queue.join()  # each message handed to the callback, handled
    except Exception as exc:  # noqa: BLE001 - shutdown goes on; what is left is dropped
        log.debug("nats.drain_subscription_failed subject=%s error=%r", sub.subject, exc)
    finally:
        sub._closed = True
        sub._stop_processing()
        nc._remove_sub(sub._id)


async def drain_or_close(nc: Any, grace_s: float) -> None:
    """End a connection at shutdown without ever raising or hanging.

    Drain (let buffered messages out) when connected; when the server is gone, or the drain
    fails or overruns ``timeout``, close instead. A close on a transport the event loop has
    already torn down raises (uvloop: "the handler is closed"); that is swallowed too.
    """
    if nc.is_closed:
        return
    try:
        if nc.is_connected:
            await asyncio.wait_for(nc.drain(), grace_s)
            return
    except Exception:  # noqa: BLE001 - shutdown goes on whatever the connection does
        log.debug("nats.drain_failed", exc_info=True)
    try:
        await nc.close()
    except Exception:  # noqa: BLE001 - a transport already torn down
        log.debug("nats.close_failed", exc_info=True)
