"""The distribution as a user gets it: the wheel built from this tree, installed into a fresh
venv (its dependencies from the package index, nothing from this checkout), runs ``reach
broker`` with the configs it ships and serves a route."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path

import nats
import pytest

from .test_broker_process import free_port
from .test_health import probe

ROOT = Path(__file__).resolve().parent.parent
_NOT_SHIPPED = shutil.ignore_patterns(
    ".git", ".venv", "__pycache__", "build", "dist", "*.egg-info", "node_modules", ".*_cache"
)


def test_the_distribution_name_is_not_reach() -> None:
    """``reach`` on the package index is an unrelated word-embeddings package."""
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert cfg["project"]["name"] == "nats-reach"
    assert cfg["project"]["scripts"] == {"reach": "reach_broker.cli:main"}


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A fresh venv with the built wheel installed; yields its bin dir."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    shutil.copytree(ROOT, src, ignore=_NOT_SHIPPED)
    dist = tmp / "dist"
    run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(dist), str(src)])
    (wheel,) = dist.glob("nats_reach-*.whl")
    venv = tmp / "venv"
    run([sys.executable, "-m", "venv", str(venv)])
    run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", str(wheel)])
    yield venv / "bin"


def run(cmd: list[str]) -> None:
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=280, cwd="/")
    assert done.returncode == 0, f"{cmd}: {done.stdout}{done.stderr}"


@pytest.fixture
def wheel_broker(installed: Path, tmp_path: Path) -> Iterator[tuple[str, int]]:
    """``reach broker`` of the installed wheel with the ``broker.toml`` it ships, an embedded
    server on a free port; yields (its NATS URL, its HTTP port)."""
    found = subprocess.run(
        [str(installed / "python"), "-c", "import reach_broker, importlib.resources as r; "
         "print(r.files('reach_broker.configs').joinpath('broker.toml')); "
         "print(reach_broker.__file__)"],
        capture_output=True, text=True, check=True, cwd="/",
    )  # fmt: skip
    config, module = found.stdout.split()
    assert Path(config).is_file() and not module.startswith(str(ROOT))
    http = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NATS_", "REACH_"))}
    proc = subprocess.Popen(
        [str(installed / "reach"), "broker", "--config", config, "--port", "0",
         "--metrics-port", str(http), "--store-dir", str(tmp_path / "js")],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=tmp_path,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        lines, url = [], None
        for line in proc.stdout:
            lines.append(line)
            if m := re.search(r"embedded nats-server listening on (nats://\S+)", line):
                url = m.group(1)
            if "serving on" in line:
                break
        assert url, "".join(lines)
        yield url, http
        proc.send_signal(signal.SIGTERM)
        rest = proc.communicate(timeout=20)[0]
        assert proc.returncode == 0, "".join(lines) + rest
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


@pytest.mark.slow
@pytest.mark.timeout(300)
async def test_the_wheel_runs_reach_broker_with_its_shipped_configs(
    wheel_broker: tuple[str, int],
) -> None:
    url, http = wheel_broker
    assert await probe(http, "/readyz") == (200, {"ready": True})
    nc = await nats.connect(url)
    try:
        body = {"agent_id": "w1", "capabilities": ["text_processing"], "max_concurrency": 1,
                "heartbeat_interval_ms": 1000}  # fmt: skip
        ack = json.loads((await nc.request("reach.announce.w1", json.dumps(body).encode(),
                                           5)).data)  # fmt: skip
        await nc.publish("reach.hb.w1", json.dumps({"agent_id": "w1", "token": ack["token"],
                                                    "seq": 1}).encode())  # fmt: skip
        reply = await nc.request("reach.route.text_processing", b"", timeout=5)
        assert [c["agent_id"] for c in json.loads(reply.data)["candidates"]] == ["w1"]
    finally:
        await nc.close()
