"""The demo agents ``alpha``, ``beta`` and ``gamma``, written with the SDK's public API only,
and what they are called with.

``python -m reach_broker.demo agent alpha`` runs one (``reach demo`` starts all three this
way; so does ``docker-compose.nats.yml``). ``reach demo`` itself is
:mod:`reach_broker.cli.demo`.
"""

from __future__ import annotations

import asyncio
import os
import random
import sys
from typing import Any

from .logs import setup_logging

DEMO_AGENTS: dict[str, list[str]] = {
    "alpha": ["text_processing", "tool_use"],
    "beta": ["data_cleaning", "text_processing"],
    "gamma": ["intent.recognition", "tool_use"],
}
"""The field report's alpha and beta, and a gamma that overlaps both on ``tool_use``."""

PAYLOADS: dict[str, Any] = {
    "text_processing": {"text": "reach makes every agent reachable by what it can do"},
    "tool_use": {"tool": "search", "query": "nats jetstream"},
    "data_cleaning": {"rows": [" a ", "b", "", " c"]},
    "intent.recognition": {"text": "hi, can you book a table for two?"},
}
"""A call payload per demo capability."""


def build_agent(agent_id: str) -> Any:
    """A demo agent: each handler does a little simulated work and says who did it."""
    import reach_agent

    agent = reach_agent.Agent(agent_id, DEMO_AGENTS[agent_id], max_concurrency=4,
                              heartbeat_interval=1.0, version="demo", grace=3.0)  # fmt: skip

    async def work() -> None:
        await asyncio.sleep(random.uniform(0.02, 0.15))

    async def text_processing(task: reach_agent.Task) -> dict[str, Any]:
        await work()
        text = str((task.payload or {}).get("text", ""))
        return {"chars": len(text), "words": len(text.split()), "by": agent_id}

    async def tool_use(task: reach_agent.Task) -> dict[str, Any]:
        await work()
        return {"tool": (task.payload or {}).get("tool"), "ok": True, "by": agent_id}

    async def data_cleaning(task: reach_agent.Task) -> dict[str, Any]:
        await work()
        rows = [str(r).strip() for r in (task.payload or {}).get("rows", [])]
        return {"rows": [r for r in rows if r], "by": agent_id}

    async def intent(task: reach_agent.Task) -> dict[str, Any]:
        await work()
        text = str((task.payload or {}).get("text", "")).lower()
        return {"intent": "booking" if "book" in text else "chat", "by": agent_id}

    handlers = {"text_processing": text_processing, "tool_use": tool_use,
                "data_cleaning": data_cleaning, "intent.recognition": intent}  # fmt: skip
    for cap in DEMO_AGENTS[agent_id]:
        agent.handler(cap)(handlers[cap])
    return agent


def agent_main(agent_id: str) -> int:
    import reach_agent

    if agent_id not in DEMO_AGENTS:
        sys.stderr.write(f"reach demo: unknown demo agent {agent_id!r} "
                         f"(one of {', '.join(DEMO_AGENTS)})\n")  # fmt: skip
        return 2
    setup_logging(os.environ.get("REACH_LOG_FORMAT", "text"), "info")
    reach_agent.run(build_agent(agent_id))
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) == 2 and argv[0] == "agent":
        return agent_main(argv[1])
    sys.stderr.write("usage: python -m reach_broker.demo agent {alpha|beta|gamma}\n")
    return 2


if __name__ == "__main__":
    sys.exit(main())
