"""The console in a real browser: Debian's chromium, headless, driven by selenium through
chromium-driver, against a ``reach broker`` process and three demo agent processes."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from reach_broker.cluster.natsserver import NatsServer

from .test_broker_process import free_port, read_until

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
REPORTS = ROOT / "reports"
"""Where the screenshot goes (a test artifact; .gitignore covers it)."""
CHROMIUM = ("/usr/bin/chromium", "/usr/bin/chromedriver")
FLAGS = (
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    # Without these Chromium reaches out to the network at start, and this machine refuses.
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
    "--window-size=1440,1000",
)  # fmt: skip


def browser(profile: Path) -> Any:
    """A headless chromium under selenium, with a fresh profile."""
    missing = [p for p in CHROMIUM if not os.access(p, os.X_OK)]
    if missing:
        pytest.skip(f"{', '.join(missing)} not installed (.ci/run installs Debian's chromium "
                    "and chromium-driver where it can)")  # fmt: skip
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM[0]
    for flag in (*FLAGS, f"--user-data-dir={profile}"):
        opts.add_argument(flag)
    return webdriver.Chrome(service=Service(CHROMIUM[1]), options=opts)


def kill(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGKILL)
    proc.wait(10)
    if proc.stdout is not None:
        proc.stdout.close()


@pytest.fixture
def fleet(nats_server: NatsServer) -> Iterator[tuple[str, dict[str, subprocess.Popen[str]]]]:
    """A ``reach broker`` (console on a free loopback port) and the demo agents alpha, beta
    and gamma, each a process of its own; yields (console URL, the processes)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("REACH_", "NATS_"))}
    env |= {"NATS_URL": nats_server.url, "PYTHONUNBUFFERED": "1"}
    port = free_port()
    procs: dict[str, subprocess.Popen[str]] = {}
    try:
        procs["broker"] = subprocess.Popen(
            [sys.executable, "-m", "reach_broker.cli", "broker", "--server", nats_server.url,
             "--metrics-port", str(port)],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
        )  # fmt: skip
        line = read_until(procs["broker"].stdout, "serving on")
        found = re.search(r"console on (http://127\.0\.0\.1:\d+/), metrics on", line)
        assert found, line
        for agent_id in ("alpha", "beta", "gamma"):
            procs[agent_id] = subprocess.Popen(
                [sys.executable, "-m", "reach_broker.demo", "agent", agent_id],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, text=True, env=env,
            )  # fmt: skip
        yield found.group(1), procs
    finally:
        for proc in procs.values():
            kill(proc)


def test_the_console_shows_the_fleet_and_a_failover_live(
    fleet: tuple[str, dict[str, subprocess.Popen[str]]], tmp_path: Path
) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    url, procs = fleet
    d = browser(tmp_path / "chromium")
    try:
        d.get(url)
        d.execute_script("window.reachLoaded = true")  # gone if the page ever reloads

        def states() -> dict[str, str]:
            rows = d.find_elements(By.CSS_SELECTOR, "#fleet tbody tr")
            return {r.get_attribute("data-agent"): r.find_element(By.CSS_SELECTOR, "td.st").text
                    for r in rows}  # fmt: skip

        healthy = {"alpha": "healthy", "beta": "healthy", "gamma": "healthy"}
        WebDriverWait(d, 30, poll_frequency=0.1).until(lambda _: states() == healthy)
        assert d.find_element(By.ID, "link-text").text == "live"
        assert d.find_element(By.CSS_SELECTOR, '[data-capability="tool_use"] .reach').text == (
            "2 of 2 reachable")  # fmt: skip

        killed_at = time.monotonic()
        os.kill(procs["beta"].pid, signal.SIGKILL)
        WebDriverWait(d, 2.0, poll_frequency=0.05).until(
            lambda _: states().get("beta") == "offline"
        )
        took = time.monotonic() - killed_at
        assert took < 2.0, took
        event = 'ol#events li[data-agent="beta"][data-to="offline"]'
        WebDriverWait(d, 2.0, poll_frequency=0.05).until(
            lambda _: d.find_elements(By.CSS_SELECTOR, event)
        )
        assert "offline" in d.find_element(By.CSS_SELECTOR, event).text
        assert states() == {**healthy, "beta": "offline"}
        # The rankings say why: beta is out of data_cleaning's, which is in panic.
        cap = d.find_element(By.CSS_SELECTOR, '[data-capability="data_cleaning"]')
        WebDriverWait(d, 2.0, poll_frequency=0.05).until(lambda _: "PANIC" in cap.text)
        assert re.search(r"beta\s+\d+\.\d\s+state\s+offline for \d+\.\ds", cap.text), cap.text
        assert d.execute_script("return window.reachLoaded") is True  # no reload

        d.find_element(By.CSS_SELECTOR, '#fleet tr[data-agent="beta"]').click()
        WebDriverWait(d, 5, poll_frequency=0.1).until(
            lambda _: "Transitions" in d.find_element(By.ID, "detail").text
        )
        REPORTS.mkdir(exist_ok=True)
        shot = REPORTS / "console-failover.png"
        assert d.save_screenshot(str(shot))
        assert shot.stat().st_size > 10_000
    finally:
        d.quit()
        shutil.rmtree(tmp_path / "chromium", ignore_errors=True)


async def _calls(url: str, n: int) -> None:
    import reach_agent

    # Routes asked of the broker (the routes/s chart counts those; a client routing from its
    # route tables asks none), and every call's ack records (the latency chart).
    config = reach_agent.ClientConfig(local_routing=False)
    async with reach_agent.Client(url, config=config) as client:
        for i in range(n):
            await client.call("text_processing", {"text": f"call {i}"}, timeout=10)


def test_the_console_charts_calls_per_capability_and_an_agents_history(
    fleet: tuple[str, dict[str, subprocess.Popen[str]]], nats_server: NatsServer, tmp_path: Path
) -> None:
    import asyncio

    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    url, _ = fleet
    d = browser(tmp_path / "chromium")
    try:
        d.get(url)
        WebDriverWait(d, 30, poll_frequency=0.1).until(
            lambda _: len(d.find_elements(By.CSS_SELECTOR, "#fleet tbody tr")) == 3
        )
        asyncio.run(_calls(nats_server.url, 40))

        def points(kind: str, series: str) -> list[float]:
            dots = d.find_elements(
                By.CSS_SELECTOR, f'#calls svg[data-kind="{kind}"] circle.pt[data-series="{series}"]'
            )
            return [float(p.get_attribute("data-v")) for p in dots]

        # The page asks every 5 s; the broker reads its route counts on its 5 s tick.
        WebDriverWait(d, 30, poll_frequency=0.2).until(
            lambda _: points("routes", "routes/s") and points("latency", "p50")
        )
        assert d.find_element(By.ID, "calls").get_attribute("data-capability") == (
            "text_processing"
        )
        assert sum(points("routes", "routes/s")) > 0
        p50, p99 = points("latency", "p50"), points("latency", "p99")
        assert p50 and p99 and all(0 < a <= b for a, b in zip(p50, p99, strict=True))

        d.find_element(By.CSS_SELECTOR, '#fleet tr[data-agent="alpha"]').click()
        WebDriverWait(d, 10, poll_frequency=0.1).until(
            lambda _: (
                d.find_elements(By.CSS_SELECTOR, "#detail .timeline rect.seg")
                and d.find_elements(By.CSS_SELECTOR, "#detail svg polyline")
            )
        )
        segs = d.find_elements(By.CSS_SELECTOR, "#detail .timeline rect.seg")
        assert segs[-1].get_attribute("data-state") == "healthy"
        labels = d.find_element(By.ID, "detail").text
        assert "score · last" in labels and "load · last" in labels and "states · last" in labels
        REPORTS.mkdir(exist_ok=True)
        shot = REPORTS / "console-charts.png"
        assert d.save_screenshot(str(shot))
        assert shot.stat().st_size > 10_000
    finally:
        d.quit()
        shutil.rmtree(tmp_path / "chromium", ignore_errors=True)
