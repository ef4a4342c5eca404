"""``python -m loadtest.calls`` end to end at a tiny scale: every request it sent succeeded,
was run once and stored where it should be, the report has every figure, nothing outlives
it. Speeds are never asserted (they live in the report)."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from pathlib import Path

import pytest

from loadtest import hops
from loadtest.calls import GOALS, goals, ratios, server_config
from reach_agent.wire.subjects import Subjects

from .test_loadtest_smoke import _alive

CALLS = 20
WARMUP = 5
TRACE = 10


@pytest.mark.slow
def test_tiny_run_counts_every_request_exactly(tmp_path: Path) -> None:
    report_path = tmp_path / "calls.json"
    argv = [
        sys.executable, "-m", "loadtest.calls", "--sync", "both", "--rounds", "1",
        "--calls", str(CALLS), "--duration", "60", "--concurrency", "1,16",
        "--warmup-calls", str(WARMUP), "--trace", str(TRACE), "--json", str(report_path),
        "--budget", "170",
    ]  # fmt: skip
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=180,
                          cwd=Path(__file__).resolve().parent.parent)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(report_path.read_text())
    assert report["status"] == "ok"
    assert report["nats_server_version"].startswith("nats-server: v")
    assert "claimed_p50_over_raw_plus_js" in proc.stdout  # the summary went to stdout
    assert list(report["sync"]) == ["always", "default"]
    assert report["sync"]["always"]["server_jetstream"]["sync_always"] is True
    assert report["sync"]["default"]["server_jetstream"]["sync_always"] is False

    for sync, entry in report["sync"].items():
        # Every slice ran to its count (the duration never cut one short) and every
        # request in it succeeded: 1 round, 2 concurrencies, 4 kinds.
        slices = [(s["kind"], s["concurrency"], s["calls"], s["ok"], s["errors"])
                  for s in entry["slices"]]  # fmt: skip
        assert slices == [(kind, conc, CALLS, CALLS, {}) for conc in (1, 16)
                          for kind in ("raw", "js", "idem", "claimed")], sync  # fmt: skip
        # Warm-up + 2 slices (+ the trace, but for js): sent, answered, none failed.
        calls = WARMUP + 2 * CALLS + TRACE
        requests = WARMUP + 2 * CALLS
        assert entry["requests"] == {
            "raw": {"sent": requests + TRACE, "ok": requests + TRACE, "errors": {}},
            "js": {"sent": requests, "ok": requests, "errors": {}},
            "idem": {"sent": calls, "ok": calls, "errors": {}},
            "claimed": {"sent": calls, "ok": calls, "errors": {}},
        }, sync
        # Each call ran its handler once; each claimed call left one claim; every call
        # two ack records (received, completed), each stored or, for received, folded into
        # its final record (then not stored: one write instead of two); every publish is
        # in its stream.
        stored = entry["stored"]
        folded = stored["acks_folded_by_agent"]
        assert 0 < folded <= 2 * calls, sync
        assert stored == {
            "agent_runs": {"bench.idem": calls, "bench.claimed": calls},
            "acks_written_by_agent": 4 * calls - folded,
            "acks_folded_by_agent": folded,
            "acks_pending_in_agent": 0,
            "stream_messages": {"claims": calls, "acks": 4 * calls - folded, "js": requests},
        }, sync
        for kind in ("raw", "js", "idem", "claimed"):
            for conc in ("1", "16"):
                fig = entry["figures"][kind][conc]
                assert fig["rounds"] == 1
                assert 0 < fig["p50_us"] <= fig["p99_us"]
                assert fig["per_s"] > 0
                assert fig["cpu_us_per_request"]["caller"] is not None
        assert set(entry["ratios"]) == {name for name, *_ in GOALS}
        assert all(isinstance(v, float) for v in entry["ratios"].values()), entry["ratios"]
        assert set(entry["goals"]) == set(entry["ratios"])
        assert [r["round"] for r in entry["ratios_per_round"]] == [0]
        # The wiretap found every mark of every traced call.
        claimed, idem, raw = (entry["hops"][k] for k in ("claimed", "idem", "raw"))
        for traced in (claimed, idem, raw):
            assert (traced["calls"], traced["complete"], traced["errors"]) == (TRACE, TRACE, 0)
        assert raw["jetstream_writes_per_call"] == 0
        # claim create and the completed record, which is the claim's end (received folded
        # into it: the sequential traced calls end long before the writer's linger); the
        # idempotent call: that record only
        assert claimed["jetstream_writes_per_call"] == 2
        assert idem["jetstream_writes_per_call"] == 1
        assert list(claimed["hops_us"]) == [
            hops.HOPS[pair] for pair in itertools.pairwise(hops.CLAIMED_PATH)
        ]

    assert {"nats-server-always", "nats-server-default"} <= set(report["pids"])
    assert len(report["pids"]) == 10  # per stack: server, broker, echo, agent, caller
    assert [name for name, pid in report["pids"].items() if _alive(pid)] == []


# --- the pieces (pure: no processes) ---------------------------------------------------


BASE = """ping_interval: "2s"
jetstream {
  max_memory_store: 256MB
  sync_interval: 5s
  max_file_store: 4GB
}
"""


def test_server_config_sets_or_drops_sync_interval() -> None:
    always = server_config("always", BASE)
    assert always == BASE.replace("  sync_interval: 5s\n", "").replace(
        "jetstream {\n", "jetstream {\n  sync_interval: always\n"
    )
    assert "sync_interval" not in server_config("default", BASE)
    with pytest.raises(ValueError, match="no 'jetstream"):
        server_config("always", "ping_interval: 2s\n")


def test_server_config_of_the_repository_has_one_jetstream_block() -> None:
    assert server_config("always").count("sync_interval: always") == 1
    assert "sync_interval" not in server_config("default")


def test_ratios_and_goals_from_medians() -> None:
    fig = {
        "raw": {"1": {"p50_us": 200.0}, "16": {"per_s": 10_000.0}},
        "js": {"1": {"p50_us": 300.0}, "16": {"per_s": 2_000.0}},
        "idem": {"1": {"p50_us": 400.0}, "16": {"per_s": 5_000.0}},
        "claimed": {"1": {"p50_us": 1_000.0}, "16": {"per_s": 1_000.0}},
    }
    rat = ratios(fig, "1", "16")
    assert rat == {
        "idem_p50_over_raw": 2.0,
        "claimed_p50_over_raw": 5.0,
        "idem_per_s_over_raw": 0.5,
        "claimed_per_s_over_raw": 0.1,
        "claimed_p50_over_raw_plus_js": 2.0,
        "claimed_per_s_over_js": 0.5,
    }
    met = {name: g["met"] for name, g in goals(rat).items()}
    assert met == {
        "idem_p50_over_raw": False,
        "idem_per_s_over_raw": True,
        "claimed_p50_over_raw": False,
        "claimed_per_s_over_raw": False,
        "claimed_p50_over_raw_plus_js": False,
        "claimed_per_s_over_js": False,
    }
    assert ratios({}, "1", "16")["claimed_p50_over_raw_plus_js"] is None


def _claimed_call_on_the_wire(rid: str) -> list[hops.Seen]:
    s = Subjects("reach")
    key = f"$KV.reach_claims.{rid}"
    task_reply = "_INBOX.c.1.1"

    def ack(state: str) -> dict[str, str]:
        return {"Nats-Msg-Id": f"bench-agent.{rid}.{state}.abc"}

    return [
        hops.Seen(1_100, s.route("bench.claimed"), "_INBOX.r.1", {}),
        hops.Seen(1_400, "_INBOX.r.1", "", {}),
        hops.Seen(1_600, s.task("bench-agent", "bench.claimed"), task_reply,
                  {"Reach-Request-Id": rid}),
        hops.Seen(1_900, key, "_INBOX.a.1", {"Nats-Expected-Last-Subject-Sequence": "0"}),
        # the broker's consumer gets a copy of the claim: not a send
        hops.Seen(2_000, key, "$JS.ACK.KV_reach_claims.x.1.1.1.1.0", {}),
        hops.Seen(2_500, "_INBOX.a.1", "", {}),
        hops.Seen(3_000, task_reply, "", {"Reach-Request-Id": rid, "Reach-Status": "received"}),
        # the completed record (the claim's end, received folded in) ahead of the result
        hops.Seen(3_010, s.ack("bench-agent", rid), "_INBOX.a.2", ack("completed")),
        hops.Seen(3_020, task_reply, "", {"Reach-Request-Id": rid, "Reach-Status": "completed"}),
        hops.Seen(3_300, "_INBOX.a.2", "", {}),
    ]  # fmt: skip


def test_timeline_finds_each_mark_of_a_claimed_call() -> None:
    rid = "0123456789abcdef0123456789abcdef"
    by_subject = hops.index(_claimed_call_on_the_wire(rid))
    line = hops.timeline(by_subject, Subjects("reach"), "bench-agent", "bench.claimed", rid,
                         1_000, 3_200)  # fmt: skip
    assert line == {
        "start": 0, "end": 2_200, "route_request": 100, "route_reply": 400, "task": 600,
        "claim_create": 900, "claim_create_puback": 1_500, "receipt": 2_000,
        "ack_completed": 2_010, "ack_completed_puback": 2_300, "result": 2_020,
    }  # fmt: skip
    summary = hops.breakdown([line, line], hops.CLAIMED_PATH)
    assert summary["calls"] == summary["complete"] == 2
    assert summary["total_us"] == 2.2
    assert summary["jetstream_writes_per_call"] == 2
    assert summary["on_path_writes"] == ["claim_create_puback"]
    assert summary["hops_us"][hops.HOPS[("claim_create", "claim_create_puback")]] == 0.6
    assert summary["hops_us"][hops.HOPS[("result", "end")]] == 0.2  # 180 ns, in µs to one decimal


def test_breakdown_leaves_incomplete_calls_out_of_the_hops() -> None:
    partial = {"start": 0, "end": 5_000, "task": 1_000}
    summary = hops.breakdown([partial], hops.IDEMPOTENT_PATH)
    assert (summary["calls"], summary["complete"], summary["total_us"]) == (1, 0, None)
    assert set(summary["hops_us"].values()) == {None}
    assert summary["marks_us"] == {"start": 0.0, "task": 1.0, "end": 5.0}


def test_a_bare_request_is_known_by_its_body_even_when_the_tap_reads_it_late() -> None:
    # The tap read request 1 only after request 2 had started: "the first request after
    # the start" would give request 2 request 1's marks.
    seen = [
        hops.Seen(1_500, "loadtest.echo", "_INBOX.q.1", {}, b"0000001"),
        hops.Seen(1_600, "_INBOX.q.1", "", {}),
        hops.Seen(1_700, "loadtest.echo", "_INBOX.q.2", {}, b"0000002"),
        hops.Seen(1_900, "_INBOX.q.2", "", {}),
    ]
    by_subject = hops.index(seen)
    first = hops.raw_timeline(by_subject, "loadtest.echo", b"0000001", 1_000, 1_300)
    second = hops.raw_timeline(by_subject, "loadtest.echo", b"0000002", 1_400, 1_950)
    assert first == {"start": 0, "request": 500, "reply": 600, "end": 300}
    assert second == {"start": 0, "request": 300, "reply": 500, "end": 550}
