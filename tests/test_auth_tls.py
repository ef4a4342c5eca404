"""``init(DIR, tls=True)``: a local CA, a server that requires TLS, clients that trust it."""

from __future__ import annotations

import asyncio
import contextlib
import json
import ssl
from collections.abc import Iterator
from pathlib import Path

import pytest

from reach_broker.auth import AuthDir, init, issue_agent, push_account, revoke

from .auth_helpers import AuthServer, auth_server, connect

pytest.importorskip("cryptography")


@pytest.fixture
def auth(tmp_path: Path) -> AuthDir:
    d = init(tmp_path / "auth", tls=True)
    issue_agent(d, "alpha")
    return d


@pytest.fixture
def server(auth: AuthDir, tmp_path: Path) -> Iterator[AuthServer]:
    with auth_server(auth, tmp_path / "nats") as s:
        yield s


async def test_plaintext_client_is_refused(server: AuthServer, auth: AuthDir) -> None:
    reader, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", server.port), 5)
    try:
        info = await asyncio.wait_for(reader.readline(), 5)
        assert info.startswith(b"INFO ")
        assert json.loads(info[5:])["tls_required"] is True
        writer.write(b'CONNECT {"verbose":false,"pedantic":false}\r\nPING\r\n')
        await writer.drain()
        rest = await asyncio.wait_for(reader.read(), 5)  # the server hangs up
        assert b"PONG" not in rest
    finally:
        writer.close()
        await writer.wait_closed()


async def test_client_needs_the_ca(server: AuthServer, auth: AuthDir) -> None:
    # A client upgrading to TLS as the server asks, with the system trust store only, does
    # not trust the local CA. (Raw asyncio: nats-py's close() hangs after a failed handshake.)
    reader, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", server.port), 5)
    try:
        await asyncio.wait_for(reader.readline(), 5)
        with pytest.raises(ssl.SSLCertVerificationError, match="CERTIFICATE_VERIFY_FAILED"):
            await asyncio.wait_for(
                writer.start_tls(ssl.create_default_context(), server_hostname="127.0.0.1"), 5
            )
    finally:
        writer.close()
        with contextlib.suppress(ssl.SSLError, ConnectionError):
            await writer.wait_closed()
    creds = auth.creds("agent", "alpha")
    async with connect(server.url, creds, "alpha", "_INBOX.agent.alpha", tls_ca=auth.ca) as (
        alpha,
        errors,
    ):
        await alpha.publish("reach.hb.alpha", b"{}")
        await alpha.flush(timeout=2)
        assert alpha.connected_url is not None
        assert errors.seen == []


async def test_push_over_tls_uses_the_dirs_ca(server: AuthServer, auth: AuthDir) -> None:
    revoke(auth, "alpha")
    assert await push_account(auth, server.url) == "jwt updated"
