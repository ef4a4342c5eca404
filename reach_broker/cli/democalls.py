"""The demo's callers: a trickle of calls over every demo capability, counted by outcome."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from reach_broker.demo import PAYLOADS

from .children import STOP_GRACE_S


class Calls:
    """A trickle of calls over every demo capability, counted by outcome."""

    def __init__(self, nc: Any, prefix: str, rate: float) -> None:
        self.nc = nc
        self.prefix = prefix
        self.rate = rate
        self.ok = 0
        self.failed: dict[str, int] = {}
        self.by_agent: dict[str, int] = {}

    async def run(self, stop: asyncio.Event) -> None:
        import reach_agent

        caps = sorted(PAYLOADS)
        pending: set[asyncio.Task[None]] = set()
        sem = asyncio.Semaphore(16)
        config = reach_agent.ClientConfig(prefix=self.prefix)
        async with reach_agent.Client(config=config, nc=self.nc, name="reach-demo") as client:

            async def one(cap: str) -> None:
                async with sem:
                    try:
                        result = await client.call(cap, PAYLOADS[cap], timeout=10)
                    except reach_agent.ReachError as err:
                        self.failed[err.code] = self.failed.get(err.code, 0) + 1
                        return
                    self.ok += 1
                    by = result.get("by", "?") if isinstance(result, dict) else "?"
                    self.by_agent[by] = self.by_agent.get(by, 0) + 1

            i = 0
            while not stop.is_set():
                task = asyncio.create_task(one(caps[i % len(caps)]))
                pending.add(task)
                task.add_done_callback(pending.discard)
                i += 1
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), 1.0 / self.rate)
            if pending:
                await asyncio.wait(pending, timeout=STOP_GRACE_S)
                for task in pending:
                    task.cancel()

    def summary(self) -> dict[str, Any]:
        return {"ok": self.ok, "failed": dict(sorted(self.failed.items())),
                "by_agent": dict(sorted(self.by_agent.items()))}  # fmt: skip
