"""``python -m loadtest.chaos --concurrency N --agents N``: the options the first-hour issue's
load row needs (N calls always in flight, two agents), on a short real run."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.slow
async def test_chaos_with_concurrent_callers_and_two_agents(tmp_path: Path) -> None:
    report = tmp_path / "chaos.json"
    argv = [sys.executable, "-m", "loadtest.chaos", "--fault", "latency", "--agents", "2",
            "--concurrency", "4", "--max-concurrency", "4", "--warmup", "1", "--hold", "1.5",
            "--watch", "1.5", "--report", str(report)]  # fmt: skip
    out = await asyncio.to_thread(subprocess.run, argv, capture_output=True, text=True,
                                  timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stderr
    data = json.loads(report.read_text())
    assert (data["setup"]["agents"], data["setup"]["concurrency"]) == (["alpha", "beta"], 4)
    assert "--max-concurrency" in data["setup"]["agent_args"]
    assert set(data["served"]["before"]) == {"alpha", "beta"}
    # Back to back for the whole run: far more calls than the 4 in flight, every one counted.
    assert data["calls"] > 40
    assert (
        data["calls"]
        == sum(sum(p.values()) for p in data["served"].values()) + data["failed_calls"]
    )
    assert "served (alpha/beta): before " in out.stdout
