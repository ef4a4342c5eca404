"""How every reach process connects to NATS: one function builds the connection options.

:func:`connect_options` is used by the agent, the client, the broker, the CLI and the ack
writer alike, so credentials, TLS and reconnect behaviour are decided in one place. Every
setting may be given explicitly or come from the environment, with the names the ``nats``
CLI uses: ``NATS_URL`` (comma-separated servers), ``NATS_CREDS`` (a credentials file: user
JWT + nkey seed), ``NATS_NKEY`` (an nkey seed file), ``NATS_USER`` / ``NATS_PASSWORD``,
``NATS_TOKEN``, ``NATS_CA`` / ``NATS_CERT`` / ``NATS_KEY`` (TLS). An explicit value wins
over the environment. A file that does not exist is a ``ValueError`` naming the setting and
the path, at once, rather than a connect failure later. A credentials file also sets the
connection's inbox prefix: the private ``_INBOX.<role>.<name>`` its user JWT lets it
subscribe to (:mod:`reach_agent.grants`), or no reply would ever reach it.

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

from . import grants

log = logging.getLogger(__name__)

DEFAULT_URL = "nats://127.0.0.1:4222"

ENV = {
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

    creds: str | None
    nkey_seed: str | None
    user: str | None
    password: str | None
    token: str | None
    tls_ca: str | None
    tls_cert: str | None
    tls_key: str | None


class Credentials(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Who a connection is and how it trusts the server. Every field is optional."""

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

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Credentials:
        """The credentials the environment names (``NATS_CREDS``, ``NATS_CA``, …)."""
        env = os.environ if env is None else env
        return cls(**{f: env[v] for f, v in ENV.items() if env.get(v)})

    def check(self) -> Credentials:
        """Raise ``ValueError`` naming the setting for a file that does not exist, a
        password without a user, or half a TLS key pair; returns ``self``."""
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


def server_list(
    servers: str | Sequence[str] | None, env: Mapping[str, str] | None = None
) -> list[str]:
    """``servers`` as a list; ``None`` reads ``NATS_URL`` (comma-separated), else localhost."""
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

    ``credentials`` override what the environment names (``NATS_CREDS``, …); ``overrides``
    replace any option (a CLI command connects with ``allow_reconnect=False``, the broker
    passes its callbacks and ping settings).
    """
    cred = (credentials or Credentials()).over(Credentials.from_env(env)).check()
    opts: dict[str, Any] = {
        "servers": server_list(servers, env),
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
    cred = (credentials or Credentials()).over(Credentials.from_env(env))
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


async def connect(nc: Any, options: dict[str, Any], *, what: str) -> None:
    """``nc.connect(**options)``, except that the server refusing the credentials ends the
    first connect at once with :class:`~reach_agent.wire.errors.Forbidden` naming ``what`` and the
    credentials file, instead of retrying until a timeout that would blame the network."""
    from reach_agent.wire.errors import Forbidden

    refused: asyncio.Future[BaseException] = asyncio.get_running_loop().create_future()
    user_cb = options.get("error_cb")

    async def on_error(exc: Exception) -> None:
        if is_refusal(exc) and not refused.done() and not nc.is_connected:
            refused.set_result(exc)
        if user_cb is not None:
            await user_cb(exc)

    attempt = asyncio.ensure_future(nc.connect(**{**options, "error_cb": on_error}))
    try:
        await asyncio.wait({attempt, refused}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        attempt.cancel()
        raise
    if attempt.done():
        attempt.result()
        return
    attempt.cancel()
    await asyncio.gather(attempt, return_exceptions=True)
    with contextlib.suppress(Exception):
        await nc.close()
    creds = options.get("user_credentials") or "(none)"
    raise Forbidden(f"{what}: the server at {', '.join(options.get('servers', []))} refused the "
                    f"credentials {creds}: {refused.result()}")  # fmt: skip


async def flush_subscriptions(nc: Any) -> None:
    """Return once the server has registered every SUB sent so far.

    nats-py 2.16 ``flush()`` writes its PING straight to the socket while SUB commands wait
    in the pending buffer for the flusher task, so the PONG can arrive before the server saw
    the SUBs (a request right after start then gets "no responders"). By the first PONG the
    flusher has written the SUBs; a second PING queues behind them.
    """
    await nc.flush()
    await nc.flush()


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
