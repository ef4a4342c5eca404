"""``python -m loadtest`` end to end at a tiny scale: it runs, reports every key, cleans up.

Speeds are never asserted here (they live in the report); only that each figure was measured,
has the right type, and that the accounting and the kill phases did what they say.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from loadtest.report import REQUIRED_KEYS, missing_keys

pytestmark = pytest.mark.slow


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie (exited, not yet reaped by its parent) is not a process left behind.
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_loadtest_tiny_run_reports_every_key(tmp_path: Path) -> None:
    report_path = tmp_path / "report.json"
    argv = [
        sys.executable, "-m", "loadtest",
        "--agents", "20", "--interval", "0.5", "--duration", "1", "--rounds", "1",
        "--warmup", "0.2", "--latency-seconds", "0.5", "--concurrency", "4",
        "--connections", "2", "--capabilities", "1",
        "--storm-rate", "2000", "--storm-seconds", "0.5",
        "--report", str(report_path), "--budget", "100",
    ]  # fmt: skip
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=110,
                          cwd=Path(__file__).resolve().parent.parent)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(report_path.read_text())

    assert report["status"] == "ok"
    assert missing_keys(report) == []
    # Every required figure was measured in this configuration (none left null).
    assert [k for k in REQUIRED_KEYS if report[k] is None] == []
    assert report["agents"] == 20
    assert report["kill_count"] == 2
    assert report["route_errors"] == {}
    assert report["echo_errors"] == {}
    assert report["announce_errors"] == 0
    assert report["reannounce_errors"] == 0
    assert report["reannounce_agents"] == 16
    # Accounting: every heartbeat the sims sent was counted by the broker, and accepted.
    assert report["heartbeats_dropped"] == 0
    assert report["heartbeats_sent"] == report["heartbeats_counted"]
    assert report["heartbeats_rejected"] == 0
    assert report["storm_dropped"] == 0
    assert report["nats_slow_consumers"] == 0
    assert report["heartbeat_ingest_peak_per_s"] > 0
    assert report["kill_silent_routable_before"] >= 1
    assert report["kill_adv_routable_before"] >= 1
    assert report["routes_per_s"] > 0 and report["echo_per_s"] > 0
    assert 0 < report["route_p50_ms"] <= report["route_p99_ms"]
    assert 0 < report["route_c1_p50_ms"] <= report["route_c1_p99_ms"]
    assert report["broker_rss_bytes"] > 0
    assert isinstance(report["targets"], dict) and "route_vs_echo_ratio" in report["targets"]
    assert "routes/s" in report["summary"]
    # Nothing this run started outlives it.
    assert set(report["pids"]) >= {"broker-0", "nats-server"}
    assert [name for name, pid in report["pids"].items() if _alive(pid)] == []
