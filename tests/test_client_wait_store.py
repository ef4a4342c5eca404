"""``Client.wait`` when the ack store cannot answer: ``STORE_UNAVAILABLE`` (retryable, the
store named), never a raw nats-py exception and never a ``TIMEOUT`` that blames the agent."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

import reach_agent
from reach_agent.wire.errors import StoreUnavailable
from reach_broker.cluster.natsserver import NatsServer


async def test_wait_on_a_server_without_jetstream_is_store_unavailable(tmp_path: Path) -> None:
    # No -js: every JetStream API request meets "no responders".
    with NatsServer(store_dir=tmp_path / "nats", config=None, config_store=True) as server:
        async with reach_agent.Client(server.url) as client:
            with pytest.raises(StoreUnavailable) as err:
                await asyncio.wait_for(client.wait("r-nojs", timeout=5), 4)
    assert err.value.code == "STORE_UNAVAILABLE"
    assert err.value.retryable is True
    assert err.value.retry_after_ms == 1000
    assert err.value.message == (
        "REACH_ACKS could not be read for request_id 'r-nojs' (ServiceUnavailableError: "
        "nats: ServiceUnavailableError: code=None err_code=None description='None'): "
        "wait for it again"
    )


async def test_wait_on_a_closed_connection_is_store_unavailable(nats_server: NatsServer) -> None:
    async with reach_agent.Client(nats_server.url) as client:
        await client.nc.close()
        with pytest.raises(StoreUnavailable) as err:
            await asyncio.wait_for(client.wait("r-closed", timeout=5), 4)
    assert err.value.code == "STORE_UNAVAILABLE"
    assert err.value.message == (
        "REACH_ACKS could not be read for request_id 'r-closed' (ConnectionClosedError: "
        "nats: connection closed): wait for it again"
    )
