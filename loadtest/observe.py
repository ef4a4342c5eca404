"""What a run reads from the system under test: the broker's /metrics, the server's /varz,
and route requests asking whether a capability still has a candidate.

Reads only; nothing here starts or stops a process.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import time
import urllib.request
from typing import Any

from reach_agent.wire.errors import H_SERVICE_ERROR_CODE
from reach_agent.wire.subjects import Subjects

_SAMPLE_RE = re.compile(r"^(\w+)(?:\{([^}]*)\})? ([0-9.eE+-]+|NaN)$")
_HEARTBEATS = 'reach_heartbeats_total{result="'


def scrape(url: str) -> dict[str, float]:
    """``name{labels}`` → value for every sample on the broker's /metrics."""
    with urllib.request.urlopen(url, timeout=5) as resp:
        text = resp.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = _SAMPLE_RE.match(line)
        if m:
            key = m.group(1) + ("{" + m.group(2) + "}" if m.group(2) else "")
            out[key] = float(m.group(3))
    return out


def heartbeat_counts(sample: dict[str, float]) -> dict[str, int]:
    """``reach_heartbeats_total`` by result (accepted, stale, …) in one scrape."""
    return {
        k[len(_HEARTBEATS) : -2]: int(v) for k, v in sample.items() if k.startswith(_HEARTBEATS)
    }


class Observer:
    """The broker and the server as the run sees them.

    ``metrics_url`` is the broker's /metrics (None: a broker we cannot read, so no heartbeat
    counts); ``monitor_url`` the server's monitoring port (None: a server we did not start).
    """

    def __init__(
        self, nc: Any, subjects: Subjects, metrics_url: str | None, monitor_url: str | None
    ) -> None:
        self.nc = nc
        self.subjects = subjects
        self.metrics_url = metrics_url
        self.monitor_url = monitor_url

    async def metrics(self) -> dict[str, float]:
        if not self.metrics_url:
            return {}
        return await asyncio.to_thread(scrape, self.metrics_url)

    async def hb_total(self) -> int | None:
        """Heartbeats the broker has counted, of every result."""
        if not self.metrics_url:
            return None
        return sum(heartbeat_counts(await self.metrics()).values())

    async def settle_heartbeats(self, expect: int, within: float) -> int | None:
        """Wait until the broker counted ``expect`` heartbeats or its count stops moving."""
        deadline = time.monotonic() + within
        last, still = -1, 0
        while True:
            total = await self.hb_total()
            if total is None or total >= expect or time.monotonic() > deadline:
                return total
            still = still + 1 if total == last else 0
            if still >= 5:
                return total
            last = total
            await asyncio.sleep(0.1)

    async def slow_consumers(self) -> int | None:
        """The server's count of slow-consumer events (messages it dropped for a client)."""
        if not self.monitor_url:
            return None
        url = self.monitor_url + "/varz"

        def get() -> int:
            with urllib.request.urlopen(url, timeout=5) as resp:
                return int(json.loads(resp.read()).get("slow_consumers", 0))

        try:
            return await asyncio.to_thread(get)
        except Exception:
            return None

    async def route_reply_bytes(self, capability: str) -> int:
        """Size of the broker's reply to a default route request for ``capability``."""
        msg = await self.nc.request(self.subjects.route(capability), b'{"peek":true}', timeout=2)
        return len(msg.data)

    async def routable(self, capability: str) -> int:
        """Candidates the broker returns for ``capability`` (0 when none is reachable). A peek:
        polling must not make the broker count tasks nobody sends."""
        body = b'{"limit":100,"peek":true}'
        msg = await self.nc.request(self.subjects.route(capability), body, timeout=2)
        if msg.headers and H_SERVICE_ERROR_CODE in msg.headers:
            return 0
        return len(json.loads(msg.data)["candidates"])

    async def wait_routable(self, capability: str, want: int, within: float) -> int:
        """Wait until at least ``want`` candidates for ``capability`` come back."""
        deadline = time.monotonic() + within
        n = 0
        while time.monotonic() < deadline:
            with contextlib.suppress(Exception):
                n = await self.routable(capability)
                if n >= want:
                    break
            await asyncio.sleep(0.05)
        return n

    async def until_unroutable(self, capability: str, t_kill: float, within: float) -> float | None:
        """ms from ``t_kill`` until no candidate for ``capability`` (and none for 1 s after)."""
        deadline = time.perf_counter() + within
        first_none: float | None = None
        while time.perf_counter() < deadline:
            try:
                n = await self.routable(capability)
            except Exception:
                n = -1
            now = time.perf_counter()
            if n == 0:
                if first_none is None:
                    first_none = now
                elif now - first_none >= 1.0:
                    return round((first_none - t_kill) * 1000.0, 1)
            elif n > 0:
                first_none = None
            await asyncio.sleep(0.005)
        return None
