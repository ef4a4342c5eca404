"""Hand a running server the application account as last signed (after a revocation).

nats-server's ``full`` resolver accepts an account JWT signed by its operator on
``$SYS.REQ.CLAIMS.UPDATE`` from a system-account user, stores it in its resolver dir and
applies it at once: connections of a revoked user are closed ("User Authentication
Revoked") and its reconnects refused. In a cluster every server stores it (each answers;
the first answer is taken) and the resolvers keep each other in sync.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec
import nats
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError

from reach_agent.connection import Credentials, connect_options, drain_or_close

from .claims import AuthError
from .identities import DirLike, _open
from .layout import APP_ACCOUNT_NAME

CLAIMS_UPDATE = "$SYS.REQ.CLAIMS.UPDATE"


class _Status(msgspec.Struct):
    account: str = ""
    code: int = 0
    message: str = ""
    description: str = ""


class _Reply(msgspec.Struct):
    data: _Status | None = None
    error: _Status | None = None


_reply_decoder = msgspec.json.Decoder(_Reply)


async def push_account(
    directory: DirLike,
    servers: str | Sequence[str] | None = None,
    *,
    nc: Any = None,
    timeout_s: float = 2.0,
) -> str:
    """Send the DIR's application account JWT to the server(s); returns the server's word
    (``"jwt updated"``). ``nc`` is an open connection of a system-account user to use;
    otherwise one is made to ``servers`` (``NATS_URL`` when None) with ``DIR/sys.creds``
    and, when the DIR has one, its CA.

    Raises :class:`AuthError` when no server takes it (not in operator mode with a ``full``
    resolver, not a system-account connection, or the JWT is refused).
    """
    d = _open(directory)
    token = d.account_path(APP_ACCOUNT_NAME).read_bytes().strip()
    own = nc is None
    if own:
        cred = Credentials(creds=str(d.sys_creds), tls_ca=str(d.ca) if d.meta().tls else None)
        errors: list[BaseException] = []

        async def on_error(exc: Exception) -> None:  # nats-py would log one per attempt
            errors.append(exc)

        # max_reconnect_attempts=1: each server twice, then give up (0 would mean forever).
        options = connect_options(
            "reach-auth",
            servers,
            cred,
            allow_reconnect=False,
            max_reconnect_attempts=1,
            reconnect_time_wait=0.1,
            connect_timeout=timeout_s,
            error_cb=on_error,
        )
        try:
            nc = await nats.connect(**options)
        except Exception as exc:  # noqa: BLE001 - any connect failure is the same answer
            cause = errors[-1] if errors else exc
            raise AuthError(
                f"cannot connect to {', '.join(options['servers'])} as the system user "
                f"({str(d.sys_creds)!r}): {cause or type(cause).__name__}"
            ) from None
    try:
        try:
            msg = await nc.request(CLAIMS_UPDATE, token, timeout=timeout_s)
        except (NoRespondersError, NatsTimeoutError) as exc:
            raise AuthError(
                f"no server took the account update on {CLAIMS_UPDATE} ({type(exc).__name__}): "
                "is it in operator mode with a full resolver, and is this a system-account "
                "connection?"
            ) from None
        try:
            reply = _reply_decoder.decode(msg.data)
        except msgspec.DecodeError as exc:
            raise AuthError(f"unexpected answer on {CLAIMS_UPDATE}: {exc}") from None
        if reply.error is not None:
            raise AuthError(
                f"server refused the account update: {reply.error.description} "
                f"(code {reply.error.code})"
            )
        return reply.data.message if reply.data else ""
    finally:
        if own:
            await drain_or_close(nc, timeout_s)
