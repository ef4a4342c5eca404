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
"""

from __future__ import annotations

from .agent import AckSink, Agent
from .breaker import Breaker, Breakers
from .client import Client
from .config import BreakerConfig, ClientConfig
from .errors import (
    BizReject,
    CompensationFull,
    Conflict,
    Draining,
    FlowFailed,
    Forbidden,
    IdempotencyMismatch,
    InProgress,
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
from .flow import FanOut, Flow, fan_out
from .metrics import AgentMetrics, ClientMetrics
from .runner import run
from .task import Reject, Task

__all__ = [
    "AckSink",
    "Agent",
    "AgentMetrics",
    "BizReject",
    "Breaker",
    "BreakerConfig",
    "Breakers",
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
