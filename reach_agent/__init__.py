"""reach SDK: make an agent reachable by capability, and reach agents from callers.

```python
agent = reach_agent.Agent("alpha", capabilities=["text_processing"], max_concurrency=8)

@agent.handler("text_processing")
async def text_processing(task: reach_agent.Task) -> dict:
    return {"chars": len(task.payload["text"])}

reach_agent.run(agent)          # NATS_URL or nats://127.0.0.1:4222; SIGTERM drains

async with reach_agent.Client() as client:
    result = await client.call("text_processing", {"text": "hi"}, timeout=30)
    async for chunk in client.stream("chat", {"prompt": "hi"}):   # an async-generator handler
        print(chunk, end="")
```

The package is three floors: :mod:`reach_agent.wire` (the contract every language
implements; no ``nats``, no ``asyncio``), then :mod:`reach_agent.agent` (the agent runtime)
and :mod:`reach_agent.client` (the caller). The runtime names below are imported on first
use, so importing the wire contract alone (``reach_agent.wire.schema``, as the broker's pure
core does) loads neither NATS nor asyncio.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .wire.errors import (
    BizReject,
    Cancelled,
    CompensationFull,
    Conflict,
    Draining,
    FlowFailed,
    Forbidden,
    IdempotencyMismatch,
    InProgress,
    InputRequired,
    InternalError,
    InvalidCapability,
    InvalidRequest,
    LoopDetected,
    NoReachableAgent,
    Overloaded,
    ReachError,
    StoreUnavailable,
    StreamBroken,
    TargetBusy,
    Timeout,
)

if TYPE_CHECKING:
    from .agent.agent import AckSink, Agent
    from .agent.runner import run
    from .agent.task import Reject, Task
    from .client.breaker import Breaker, Breakers
    from .client.client import Client
    from .client.config import BreakerConfig, ClientConfig
    from .client.flow import FanOut, Flow, fan_out
    from .metrics import AgentMetrics, ClientMetrics

_RUNTIME = {
    "AckSink": "reach_agent.agent.agent",
    "Agent": "reach_agent.agent.agent",
    "run": "reach_agent.agent.runner",
    "Reject": "reach_agent.agent.task",
    "Task": "reach_agent.agent.task",
    "Breaker": "reach_agent.client.breaker",
    "Breakers": "reach_agent.client.breaker",
    "Client": "reach_agent.client.client",
    "BreakerConfig": "reach_agent.client.config",
    "ClientConfig": "reach_agent.client.config",
    "FanOut": "reach_agent.client.flow",
    "Flow": "reach_agent.client.flow",
    "fan_out": "reach_agent.client.flow",
    "AgentMetrics": "reach_agent.metrics",
    "ClientMetrics": "reach_agent.metrics",
}
"""Where each runtime name lives: imported on first use (PEP 562)."""


def __getattr__(name: str) -> Any:
    home = _RUNTIME.get(name)
    if home is None:
        raise AttributeError(f"module 'reach_agent' has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_RUNTIME})


__all__ = [
    "AckSink",
    "Agent",
    "AgentMetrics",
    "BizReject",
    "Breaker",
    "BreakerConfig",
    "Breakers",
    "Cancelled",
    "Client",
    "ClientConfig",
    "ClientMetrics",
    "CompensationFull",
    "Conflict",
    "Draining",
    "FanOut",
    "Flow",
    "FlowFailed",
    "Forbidden",
    "IdempotencyMismatch",
    "InProgress",
    "InputRequired",
    "InternalError",
    "InvalidCapability",
    "InvalidRequest",
    "LoopDetected",
    "NoReachableAgent",
    "Overloaded",
    "ReachError",
    "Reject",
    "StoreUnavailable",
    "StreamBroken",
    "TargetBusy",
    "Task",
    "Timeout",
    "fan_out",
    "run",
]
