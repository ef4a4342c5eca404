"""The wire contract is the ground floor: no module of reach_agent/wire loads nats or asyncio."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

WIRE = Path(__file__).resolve().parent.parent / "reach_agent" / "wire"

PROBE = """
import importlib, json, sys
loaded = {}
for name in sys.argv[1:]:
    importlib.import_module(name)
    loaded[name] = sorted(m for m in ("nats", "asyncio") if m in sys.modules)
print(json.dumps(loaded))
"""


def test_every_wire_module_imports_neither_nats_nor_asyncio() -> None:
    modules = sorted(
        f"reach_agent.wire.{p.stem}" for p in WIRE.glob("*.py") if p.stem != "__init__"
    )
    assert {"reach_agent.wire.schema", "reach_agent.wire.subjects", "reach_agent.wire.errors",
            "reach_agent.wire.retry", "reach_agent.wire.streams"} <= set(modules)  # fmt: skip
    out = subprocess.run([sys.executable, "-c", PROBE, *modules], capture_output=True,
                         text=True, timeout=60, check=True)  # fmt: skip
    assert json.loads(out.stdout) == {name: [] for name in modules}


def test_the_public_names_still_come_from_reach_agent() -> None:
    """The runtime names load on first use, from the same homes as before the split."""
    import reach_agent

    assert reach_agent.Agent.__module__ == "reach_agent.agent.agent"
    assert reach_agent.Client.__module__ == "reach_agent.client.client"
    assert reach_agent.run.__module__ == "reach_agent.agent.runner"
    assert [n for n in reach_agent.__all__ if getattr(reach_agent, n, None) is None] == []
    assert set(reach_agent.__all__) <= set(dir(reach_agent))
