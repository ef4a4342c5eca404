"""``python -m loadtest`` end to end at a tiny scale: it runs, reports every key, cleans up.

Speeds are never asserted here (they live in the report); only that each figure was measured,
has the right type, and that the accounting and the kill phases did what they say.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from loadtest.report import REQUIRED_KEYS, Figures, assemble, figures, missing_keys

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
    # Each slice says what the processes spent in it (one round: one slice of each).
    (routed,), (echoed,) = report["route_slices"], report["echo_slices"]
    assert routed["broker_cpu_share"] > 0 and 0 < routed["machine_busy"] <= 1
    assert echoed["responder_cpu_share"] > 0
    assert 0 < report["route_p50_ms"] <= report["route_p99_ms"]
    assert 0 < report["route_c1_p50_ms"] <= report["route_c1_p99_ms"]
    assert report["broker_rss_bytes"] > 0
    assert isinstance(report["targets"], dict) and "route_vs_echo_ratio" in report["targets"]
    assert "routes/s" in report["summary"]
    # Nothing this run started outlives it.
    assert set(report["pids"]) >= {"broker-0", "nats-server"}
    assert [name for name, pid in report["pids"].items() if _alive(pid)] == []


# --- the pieces the report is built from (pure: no processes) -------------------------------


def test_figures_leave_out_unset_and_keep_null_in_field_order() -> None:
    from loadtest.phases import Accounting

    part = Accounting(heartbeats_sent=7, nats_slow_consumers_steady=None, broker_nats_errors={})
    assert list(figures(part).items()) == [
        ("heartbeats_sent", 7),
        ("nats_slow_consumers_steady", None),
        ("broker_nats_errors", {}),
    ]


def test_assemble_puts_settings_then_required_keys_then_phases_in_order() -> None:
    from loadtest.phases import HeartbeatsOnly, Reannounce

    class Head(Figures, frozen=True, kw_only=True):
        date_utc: str
        agents: int

    class End(Figures, frozen=True, kw_only=True):
        loadavg_end: str

    head = Head(date_utc="2026-12-01T00:00:00Z", agents=20)
    parts = [
        HeartbeatsOnly(broker_cpu_share_heartbeats=0.1, heartbeats_per_s=40.0),
        Reannounce(reannounce_s=0.5, reannounce_errors=0, reannounce_agents=16),
    ]
    cut_short = assemble(head, parts, pids={"broker-0": 1}, loadavg_end="1 2 3", complete=False)
    required = [k for k in REQUIRED_KEYS if k != "agents"]
    assert list(cut_short) == [
        "date_utc", "agents", *required, "broker_cpu_share_heartbeats",
        "reannounce_s", "reannounce_errors", "reannounce_agents",
        "pids", "loadavg_end", "targets", "summary", "status",
    ]  # fmt: skip
    assert cut_short["heartbeats_per_s"] == 40.0  # a required key, filled where it stands
    assert cut_short["routes_per_s"] is None
    assert cut_short["loadavg_end"] == "1 2 3"
    assert cut_short["status"] == "incomplete"
    assert missing_keys(cut_short) == []

    done = assemble(head, [*parts, End(loadavg_end="0 0 0")], pids={}, loadavg_end="9 9 9",
                    complete=True)  # fmt: skip
    assert done["loadavg_end"] == "0 0 0"
    assert list(done).index("loadavg_end") < list(done).index("pids")
    assert done["status"] == "ok"


def test_peak_rate_is_the_best_window_of_at_least_one_second() -> None:
    from loadtest.phases import peak_rate

    samples = [(0.0, 0), (0.25, 100), (0.5, 200), (1.0, 300), (1.25, 1300)]
    assert peak_rate(samples) == 1200.0
    # A span shorter than 1 s: the whole span.
    assert peak_rate([(0.0, 0), (0.5, 100)]) == 200.0


def test_cpu_spans_leave_out_spans_that_could_not_be_read() -> None:
    from loadtest.procfs import CpuSpans

    spans = CpuSpans()
    assert spans.share() is None and spans.us_per(10) is None
    spans.add(1.0, 1.5, 2.0)
    spans.add(None, 3.0, 5.0)  # the process was gone at the start: not counted
    spans.add(2.0, 2.5, 2.0)
    assert spans.share() == 0.25
    assert spans.us_per(1000) == 1000.0
    assert spans.us_per(0) is None


async def test_a_childs_concurrent_commands_take_turns_and_each_gets_its_own_reply() -> None:
    """Two commands sent together to one child (the nemesis healing two faults at once on
    the proxies' controller): each gets its own reply. Together they read the child's
    stdout at once and failed ("readuntil() called while another coroutine is already
    waiting", nemesis seed 57), or one dropped the other's reply."""
    from loadtest.children import Child

    echo = ("import json, sys\n"
            "for line in sys.stdin:\n"
            "    verb, _, target = line.strip().partition(' ')\n"
            "    print(json.dumps({'event': verb, 'target': target}), flush=True)\n")  # fmt: skip
    child = await Child.start("echo", sys.executable, "-c", echo, stdin=True)
    try:
        got = await asyncio.gather(*(child.command(f"{verb} t{i}", verb, within=10)
                                     for i, verb in enumerate(["cut", "restore"] * 4)))  # fmt: skip
    finally:
        await child.kill()
    assert [(e["event"], e["target"]) for e in got] == [
        (verb, f"t{i}") for i, verb in enumerate(["cut", "restore"] * 4)]  # fmt: skip


# --- what cut a run short ----------------------------------------------------------------


async def test_an_inner_timeout_is_reported_as_one_with_its_phase_not_as_the_watchdog() -> None:
    from loadtest.__main__ import Progress, watched
    from loadtest.children import Child

    child = await Child.start("silent", sys.executable, "-c", "import time; time.sleep(30)")
    progress = Progress()
    try:

        async def run() -> None:
            progress.enter("heartbeats only")
            await child.read_event(0.05)  # a child that never answers: its wait gives up

        failed = await watched(run(), 60.0, progress)
    finally:
        await child.kill()
    assert failed is not None
    assert failed.startswith("phase 'heartbeats only': TimeoutError at children.py:")
    assert failed.endswith(" read_event")
    assert "budget" not in failed


async def test_no_responders_is_reported_as_what_it_is() -> None:
    from nats.errors import NoRespondersError

    from loadtest.__main__ import Progress, watched

    progress = Progress()

    async def run() -> None:
        progress.enter("kill")
        raise NoRespondersError

    failed = await watched(run(), 60.0, progress)
    assert (
        failed
        == "phase 'kill': nats.errors.NoRespondersError: nats: no responders available for request"
    )


async def test_the_watchdog_speaks_only_when_the_budget_ran_out() -> None:
    import asyncio

    from loadtest.__main__ import Progress, watched

    progress = Progress()

    async def run() -> None:
        progress.enter("kill")
        await asyncio.Event().wait()  # never ends by itself

    assert await watched(run(), 0.05, progress) == "phase 'kill': the run exceeded --budget 0.05 s"
    report = assemble(Figures(), [], pids={}, loadavg_end="0 0 0", complete=False,
                      failure="phase 'kill': the run exceeded --budget 0.05 s")  # fmt: skip
    assert report["failure"] == "phase 'kill': the run exceeded --budget 0.05 s"
    assert "INCOMPLETE, phase 'kill': the run exceeded --budget 0.05 s" in report["summary"]
