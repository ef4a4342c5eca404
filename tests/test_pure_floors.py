"""The pure floors do no I/O: no module of reach_agent/wire (the contract every language
implements), reach_agent/routing (the routing decision, the broker's and a caller's) nor of
reach_broker/core (the broker's pure core) loads nats or asyncio."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

PROBE = """
import importlib, json, sys
loaded = {}
for name in sys.argv[1:]:
    importlib.import_module(name)
    loaded[name] = sorted(m for m in ("nats", "asyncio") if m in sys.modules)
print(json.dumps(loaded))
"""


def modules_of(package: str) -> list[str]:
    folder = ROOT.joinpath(*package.split("."))
    return sorted(f"{package}.{p.stem}" for p in folder.glob("*.py") if p.stem != "__init__")


def test_the_floors_hold_their_modules() -> None:
    wire = {"schema", "subjects", "errors", "retry", "streams"}
    assert {f"reach_agent.wire.{m}" for m in wire} <= set(modules_of("reach_agent.wire"))
    core = {"registry", "routing", "explain", "records", "states", "detector", "scoring"}
    assert {f"reach_broker.core.{m}" for m in core} <= set(modules_of("reach_broker.core"))
    routing = {"member", "filters", "choice", "draws", "index", "rules", "reasons"}
    assert {f"reach_agent.routing.{m}" for m in routing} <= set(modules_of("reach_agent.routing"))


@pytest.mark.parametrize(
    "package", ["reach_agent.wire", "reach_agent.routing", "reach_broker.core"]
)
def test_every_module_of_a_pure_floor_imports_neither_nats_nor_asyncio(package: str) -> None:
    """Each module imported in turn in a fresh interpreter, sys.modules read after each."""
    modules = modules_of(package)
    out = subprocess.run([sys.executable, "-c", PROBE, *modules], capture_output=True,
                         text=True, timeout=60, check=True)  # fmt: skip
    assert json.loads(out.stdout) == {name: [] for name in modules}


def test_the_public_names_still_come_from_reach_agent() -> None:
    """The runtime names load on first use, from their homes in the subpackages."""
    import reach_agent

    assert reach_agent.Agent.__module__ == "reach_agent.agent.agent"
    assert reach_agent.Client.__module__ == "reach_agent.client.client"
    assert reach_agent.run.__module__ == "reach_agent.agent.runner"
    assert [n for n in reach_agent.__all__ if getattr(reach_agent, n, None) is None] == []
    assert set(reach_agent.__all__) <= set(dir(reach_agent))
