"""``python -m loadtest.nemesis`` end to end, short (the CI's fault-injection run): eleven
faults of nine kinds in 45 s — agents, brokers and NATS nodes killed, stopped, cut off and
stalled — and the history checker finds no breach of the delivery guarantee, every call
and submitted task reaches its final state, and every process the run started is gone.
What is measured (calls, faults, second runs allowed) is in the report, never asserted as
a speed."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.slow


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (exited, not reaped by its parent) is not a process left behind
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def explain(report: dict[str, object], run: Path) -> str:
    """What a failed run's CI log needs to be read later (pytest's tmp dir does not last):
    the violations' kinds and the first five, the faults, the callers' outcomes, the tail of
    each caller's own log (its connection's disconnects and reconnects), and the first three
    violations' lines in the callers' and agents' logs."""
    violations = report["violations"]
    assert isinstance(violations, list)
    lines = [f"violation kinds: {report['violation_kinds']}",
             *(json.dumps(v) for v in violations[:5]),
             f"faults: {json.dumps(report['faults'])}",
             f"outcomes: {json.dumps(report['outcomes'])}",
             f"callers: {json.dumps(report['callers'])}, load: {report['loadavg']}"]  # fmt: skip
    for log in sorted(run.glob("c*.log")):
        lines += [f"--- {log.name} (tail)", *log.read_text().splitlines()[-25:]]
    for v in violations[:3]:  # what the callers and agents wrote of them
        assert isinstance(v, dict)
        token = f'"{v.get("request_id")}"'
        said = [f"{log.name}: {line}" for log in sorted(run.glob("*.jsonl"))
                for line in log.read_text().splitlines() if token in line]  # fmt: skip
        lines += [f"--- {token} in the run's logs", *said[:12]]
    return "\n".join(lines)


@pytest.mark.timeout(330)
def test_a_short_nemesis_run_finds_no_violation_and_leaves_no_process(tmp_path: Path) -> None:
    report_path = tmp_path / "nemesis.json"
    argv = [sys.executable, "-m", "loadtest.nemesis", "--duration", "45", "--interval", "4",
            "--seed", "8", "--report", str(report_path),
            "--dir", str(tmp_path / "run")]  # fmt: skip
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=320, cwd=ROOT)
    assert report_path.exists(), proc.stderr[-3000:]
    report = json.loads(report_path.read_text())
    assert report["violations"] == [], explain(report, tmp_path / "run")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert len(report["faults"]) == len(report["planned"]) == 11
    assert len(report["fault_kinds"]) == 9
    assert report["calls"] > 0 and report["submits"] > 0
    assert (report["unresolved"], report["unresolved_ids"]) == (0, [])
    assert report["resolved"] == report["calls"] + report["submits"] - report["refused_submits"]
    assert report["queued_at_end"] == 0
    assert [pid for pid in report["pids"] if alive(pid)] == []
    assert re.search(r"^VIOLATIONS +0$", proc.stdout, re.M), proc.stdout[-2000:]
