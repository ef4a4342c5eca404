"""``reach mcp`` end to end: the official MCP SDK's client starts it over stdio against a
real broker and real SDK agents, lists its tools, finds agents, calls one, and sees a killed
agent leave the candidates."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("mcp.client", reason="needs the extra 'mcp'")

from mcp import Client
from mcp.client.stdio import StdioServerParameters

from reach_agent.routing.reasons import EXCLUSIONS
from reach_broker.broker import Broker
from reach_broker.cluster.natsserver import NatsServer

from .agents.procs import AgentProcess
from .conftest import wait_for

ROOT = Path(__file__).resolve().parent.parent


def reach_mcp(url: str) -> StdioServerParameters:
    return StdioServerParameters(
        command=sys.executable, args=["-m", "reach_broker", "mcp", "--server", url],
        env={"PYTHONPATH": str(ROOT), "REACH_ACK_DIR": os.environ["REACH_ACK_DIR"]},
    )  # fmt: skip


async def tool(client: Client, name: str, **arguments: Any) -> dict[str, Any]:
    result = await client.call_tool(name, arguments)
    assert result.is_error is False, result.content
    assert result.structured_content is not None
    # The text content is the same JSON, for clients that read only text.
    assert json.loads(result.content[0].text) == result.structured_content  # type: ignore[union-attr]
    return result.structured_content


async def test_mcp_client_lists_tools_finds_agents_and_calls_one(
    nats_server: NatsServer, broker: Broker, tmp_path: Path
) -> None:
    log = str(tmp_path / "agents.log")
    procs = {a: AgentProcess("worker.py", nats_server.url, a, "summarize", "--log", log, "--hb",
                             "1.0") for a in ("alpha", "beta")}  # fmt: skip

    def both_healthy() -> bool:
        recs = [broker.registry.agents.get(a) for a in procs]
        return all(r is not None and r.state == "healthy" for r in recs)

    try:
        await wait_for(both_healthy, 20.0, what="alpha and beta healthy")  # Python starting
        async with asyncio.timeout(60):
            async with Client(reach_mcp(nats_server.url)) as client:
                listed = await client.list_tools()
                by_name = {t.name: t for t in listed.tools}
                assert sorted(by_name) == ["call_agent", "find_agents", "list_capabilities"]
                assert by_name["find_agents"].description is not None
                assert by_name["find_agents"].description.startswith(
                    "Which agents can do `capability` right now, and why the others cannot."
                )
                assert sorted(by_name["call_agent"].input_schema["properties"]) == [
                    "capability", "payload", "timeout_s"]  # fmt: skip

                assert await tool(client, "list_capabilities") == {
                    "capabilities": [{"capability": "summarize", "agents": 2, "healthy": 2}],
                    "agents": 2,
                }
                found = await tool(client, "find_agents", capability="summarize", limit=2)
                assert sorted(c["agent_id"] for c in found["candidates"]) == ["alpha", "beta"]
                assert [c["rank"] for c in found["candidates"]] == [1, 2]
                assert {c["state"] for c in found["candidates"]} == {"healthy"}
                assert found["others"] == []

                called = await tool(client, "call_agent", capability="summarize",
                                    payload={"n": 3})  # fmt: skip
                assert called["capability"] == "summarize"
                assert called["result"]["n"] == 3
                assert called["result"]["agent"] in ("alpha", "beta")

                os.kill(procs["alpha"].pid, signal.SIGKILL)
                assert procs["alpha"].wait(5) == -signal.SIGKILL
                await wait_for(lambda: broker.registry.agents["alpha"].state == "offline", 5.0,
                               what="alpha offline")  # fmt: skip
                found = await tool(client, "find_agents", capability="summarize")
                assert [c["agent_id"] for c in found["candidates"]] == ["beta"]
                [beta] = found["candidates"]
                assert sorted(beta["score_terms"]) == [
                    "delivery", "latency", "liveness", "load", "stuck", "success"]  # fmt: skip
                [other] = found["others"]
                assert (other["agent_id"], other["state"], other["reason"]) == (
                    "alpha", "offline", "state")  # fmt: skip
                assert re.fullmatch(r"offline for \d+\.\ds", other["why"]), other["why"]
                assert found["left_out"] == {"state": 1}
                assert found["reasons"] == {"state": EXCLUSIONS["state"]}
                for _ in range(3):
                    called = await tool(client, "call_agent", capability="summarize",
                                        payload={"n": 4})  # fmt: skip
                    assert called["result"] == {"agent": "beta", "n": 4}

                missing = await client.call_tool(
                    "call_agent", {"capability": "nothing", "payload": {}}
                )
                assert missing.is_error is True
                assert missing.content[0].text == (  # type: ignore[union-attr]
                    "Error executing tool call_agent: NO_REACHABLE_AGENT: no agent has the "
                    "capability 'nothing'"
                )
                none = await tool(client, "find_agents", capability="nothing")
                assert none == {"capability": "nothing", "candidates": [], "others": [],
                                "reason": "no agent has the capability 'nothing'"}  # fmt: skip
    finally:
        for proc in procs.values():
            proc.stop()
