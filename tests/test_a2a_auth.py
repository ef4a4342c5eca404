"""The A2A gateway of a broker in operator mode (``reach broker --auth``): its client runs on
the broker's own connection and credential, so a message sent through the gateway reaches an
agent holding only the credential ``reach auth`` issued for it, and the result comes back."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("a2a.client", reason="needs the extra 'a2a'")

import httpx
from a2a.client import A2ACardResolver

import reach_agent
from reach_broker.auth import AuthDir, init, issue_agent
from reach_broker.metrics import Metrics
from reach_broker.service import Broker

from .auth_helpers import AuthServer, auth_server
from .conftest import fast_config, wait_for
from .test_a2a_gateway import data_of, make_gateway, send, text_message

CAP = "secure.echo"


@pytest.fixture
def auth(tmp_path: Path) -> AuthDir:
    d = init(tmp_path / "auth")
    issue_agent(d, "alpha")
    return d


@pytest.fixture
def server(auth: AuthDir, tmp_path: Path) -> Iterator[AuthServer]:
    with auth_server(auth, tmp_path / "nats") as s:
        yield s


@pytest.fixture
async def secure_broker(auth: AuthDir, server: AuthServer) -> AsyncIterator[Broker]:
    b = Broker(fast_config(server.url, nats__creds=str(auth.broker_creds)), metrics=Metrics())
    await asyncio.wait_for(b.start(), 20)
    try:
        yield b
    finally:
        await b.stop()


async def test_the_gateway_of_a_secured_broker_routes_to_an_agent_with_its_own_credential(
    auth: AuthDir, server: AuthServer, secure_broker: Broker
) -> None:
    alpha = reach_agent.Agent("alpha", [CAP], heartbeat_interval=0.1,
                              creds=str(auth.creds("agent", "alpha")))  # fmt: skip

    @alpha.handler(CAP)
    async def echo(task: reach_agent.Task) -> dict[str, Any]:
        return {"by": "alpha", "got": task.payload}

    await asyncio.wait_for(alpha.start(server.url), 20)
    try:
        await wait_for(lambda: (rec := secure_broker.registry.agents.get("alpha")) is not None
                       and rec.state == "healthy", 5.0, what="alpha healthy")  # fmt: skip
        async with (
            make_gateway(secure_broker) as gateway,
            httpx.AsyncClient(timeout=10.0) as http,
        ):
            card = await A2ACardResolver(http, gateway.url).get_agent_card()
            async with asyncio.timeout(10):
                [event] = await send(http, card, text_message("hi", skill=CAP))
            assert data_of(event.message.parts[0]) == {"by": "alpha", "got": {"text": "hi"}}
    finally:
        await alpha.stop(grace=2)
