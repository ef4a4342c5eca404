"""The A2A gateway of a broker in operator mode (``reach broker --auth``): its client runs on
the broker's own connection and credential, so a message sent through the gateway reaches an
agent holding only the credential ``reach auth`` issued for it, and the result comes back."""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("a2a.client", reason="needs the extra 'a2a'")

import httpx
from a2a.client import A2ACardResolver

from reach_broker.auth import AuthDir
from reach_broker.broker import Broker

from . import test_auth_broker as secured
from .auth_helpers import AuthServer
from .conftest import wait_for
from .test_a2a_gateway import data_of, make_gateway, send, text_message

auth, server, broker = secured.auth, secured.server, secured.broker
"""The fixtures of test_auth_broker: an auth DIR (agents alpha and beta), its server in
operator mode, a broker with its credential."""


async def test_the_gateway_of_a_secured_broker_routes_to_an_agent_with_its_own_credential(
    auth: AuthDir,
    server: AuthServer,
    broker: Broker,
) -> None:
    alpha = secured.agent(auth, "alpha")
    await asyncio.wait_for(alpha.start(server.url), 20)
    try:
        await wait_for(lambda: (rec := broker.registry.agents.get("alpha")) is not None
                       and rec.state == "healthy", 5.0, what="alpha healthy")  # fmt: skip
        async with (
            make_gateway(broker) as gateway,
            httpx.AsyncClient(timeout=10.0) as http,
        ):
            card = await A2ACardResolver(http, gateway.url).get_agent_card()
            async with asyncio.timeout(10):
                [event] = await send(http, card, text_message("hi", skill="secure.echo"))
            assert data_of(event.message.parts[0]) == {"by": "alpha", "got": {"text": "hi"}}
    finally:
        await alpha.stop(grace=2)
