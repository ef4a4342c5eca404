"""The load report: the JSON keys other tools read, the targets, and a readable summary.

Each phase of a run returns its :class:`Figures`; :func:`assemble` is the one place they
become the report, in the order the phases ran.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgspec

REQUIRED_KEYS: dict[str, tuple[type, ...]] = {
    "agents": (int,),
    "routes_per_s": (float, int),
    "echo_per_s": (float, int),
    "route_vs_echo_ratio": (float, int),
    "route_p50_ms": (float, int),
    "route_p99_ms": (float, int),
    "heartbeats_per_s": (float, int),
    "heartbeats_dropped": (int,),
    "broker_cpu_share": (float, int),
    "broker_rss_bytes": (int,),
    "rss_per_agent_bytes": (float, int),
    "kill_detection_ms": (float, int),
}
"""Keys every report carries and their types (a figure that could not be measured is null)."""


class Figures(msgspec.Struct, frozen=True, kw_only=True):
    """What one phase measured: each field is the report key of the same name.

    A field left ``UNSET`` is absent from the report (not measured in this configuration:
    no broker metrics, ``--latency-seconds 0``, …); ``None`` is a null figure.
    """


def figures(part: Figures) -> dict[str, Any]:
    """The report keys of one phase's figures, in field order, ``UNSET`` ones left out."""
    return {k: v for k, v in msgspec.structs.asdict(part).items() if v is not msgspec.UNSET}


def assemble(
    settings: Figures,
    parts: Sequence[Figures],
    *,
    pids: dict[str, int],
    loadavg_end: str,
    complete: bool,
    failure: str | None = None,
) -> dict[str, Any]:
    """The report: the run's settings, every required key (null until a phase measures
    it), the figures of each phase that returned, the PIDs, targets, summary and status.

    ``loadavg_end`` is used when no part carried it (a run cut short); ``failure`` says
    what cut it short (the phase and the error, or the watchdog)."""
    r = figures(settings)
    for key in REQUIRED_KEYS:
        r.setdefault(key, None)
    for part in parts:
        r.update(figures(part))
    r["pids"] = pids
    r.setdefault("loadavg_end", loadavg_end)
    r["targets"] = targets(r)
    if failure is not None:
        r["failure"] = failure
    r["summary"] = summary(r)
    r["status"] = "ok" if complete else "incomplete"
    return r


def targets(r: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Each target of issue 7: the figure, the bound, whether it was met (None: not measured)."""

    def check(value: Any, ok: Any, bound: str, note: str = "") -> dict[str, Any]:
        met = None if value is None else bool(ok(value))
        out = {"value": value, "bound": bound, "met": met}
        if note:
            out["note"] = note
        return out

    interval = r.get("interval_s") or 1.0
    silent_bound_ms = 2.5 * interval * 1000.0
    cond_p99 = (r.get("agents") == 1000 and r.get("concurrency") == 64
                and interval == 1.0)  # fmt: skip
    return {
        "route_vs_echo_ratio": check(r.get("route_vs_echo_ratio"), lambda v: v >= 0.9, ">= 0.9"),
        "routes_per_s": check(r.get("routes_per_s"), lambda v: v >= 12_000, ">= 12000"),
        "route_p99_ms": check(
            r.get("route_p99_ms"), lambda v: v < 5.0, "< 5 ms",
            "" if cond_p99 else "target is for 1000 agents, 1 s interval, 64 requesters",
        ),
        "heartbeat_ingest_per_s": check(
            r.get("heartbeat_ingest_peak_per_s"), lambda v: v >= 50_000, ">= 50000"
        ),
        "rss_per_agent_bytes": check(
            r.get("rss_per_agent_bytes"), lambda v: v < 4096, "< 4096 B",
            "" if (r.get("agents") or 0) >= 10_000 else "target is for 10,000 agents",
        ),
        "kill_detection_ms": check(
            r.get("kill_detection_ms"), lambda v: v <= 1000.0, "<= 1000 ms (advisories)",
            "" if r.get("advisories_active") else "broker did not report disconnect advisories",
        ),
        "kill_detection_silent_ms": check(
            r.get("kill_detection_silent_ms"), lambda v: v <= silent_bound_ms,
            f"<= {silent_bound_ms:g} ms (2.5 intervals, heartbeats only)",
        ),
    }  # fmt: skip


def _fmt(value: Any, unit: str = "", digits: int = 1) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, float):
        return f"{value:,.{digits}f}{unit}"
    if isinstance(value, int):
        return f"{value:,}{unit}"
    return f"{value}{unit}"


def summary(r: dict[str, Any]) -> str:
    """A few readable lines: the figures, then each target with met / missed."""
    kib = None if r.get("rss_per_agent_bytes") is None else r["rss_per_agent_bytes"] / 1024
    mib = None if r.get("broker_rss_bytes") is None else r["broker_rss_bytes"] / 2**20
    lines = [
        f"reach load test {r.get('date_utc')} on {r.get('host_cores')} cores "
        f"(loadavg {r.get('loadavg_start')} -> {r.get('loadavg_end')})",
        f"  agents {_fmt(r.get('agents'))} heartbeating every {_fmt(r.get('interval_s'), ' s', 2)} "
        f"over {_fmt(r.get('sim_connections'))} connections; {_fmt(r.get('concurrency'))} "
        f"requesters for {_fmt(r.get('duration_s'), ' s')} per mode",
        f"  routes/s {_fmt(r.get('routes_per_s'))}  p50 {_fmt(r.get('route_p50_ms'), ' ms', 2)}  "
        f"p99 {_fmt(r.get('route_p99_ms'), ' ms', 2)}  errors {r.get('route_errors')}",
        f"  echo/s   {_fmt(r.get('echo_per_s'))}  p50 {_fmt(r.get('echo_p50_ms'), ' ms', 2)}  "
        f"p99 {_fmt(r.get('echo_p99_ms'), ' ms', 2)}  "
        f"route/echo {_fmt(r.get('route_vs_echo_ratio'), '', 3)}",
        f"  one requester: route p50 {_fmt(r.get('route_c1_p50_ms'), ' ms', 3)} "
        f"p99 {_fmt(r.get('route_c1_p99_ms'), ' ms', 3)}; echo p50 "
        f"{_fmt(r.get('echo_c1_p50_ms'), ' ms', 3)} p99 {_fmt(r.get('echo_c1_p99_ms'), ' ms', 3)}",
        f"  heartbeats/s {_fmt(r.get('heartbeats_per_s'))} steady, ingest peak "
        f"{_fmt(r.get('heartbeat_ingest_peak_per_s'))}/s (storm offered "
        f"{_fmt(r.get('storm_offered_per_s'))}/s; "
        f"{_fmt(r.get('heartbeats_per_broker_cpu_s'))} per broker CPU second); "
        f"dropped {_fmt(r.get('heartbeats_dropped'))} "
        f"of {_fmt(r.get('heartbeats_sent'))}",
        f"  CPU per request: broker {_fmt(r.get('broker_cpu_us_per_route'), ' us')} a route "
        f"(heartbeats included), {_fmt(r.get('broker_cpu_us_per_route_net'), ' us')} net of "
        f"heartbeats; echo responder {_fmt(r.get('echo_cpu_us_per_request'), ' us')}; "
        f"machine busy {_fmt(r.get('machine_cpu_busy_share'), '', 2)}",
        f"  broker CPU {_fmt(r.get('broker_cpu_share'), ' cores', 2)} under route load, "
        f"{_fmt(r.get('broker_cpu_share_heartbeats'), ' cores', 3)} heartbeats only; "
        f"RSS {_fmt(mib, ' MiB')} ({_fmt(kib, ' KiB', 2)} per agent)",
        f"  re-announce storm: {_fmt(r.get('reannounce_s'), ' s', 2)} for "
        f"{_fmt(r.get('reannounce_agents'))} agents ({_fmt(r.get('reannounce_errors'))} errors)",
        f"  {(r.get('kill_share') or 0):.0%} killed: none routed after "
        f"{_fmt(r.get('kill_detection_ms'), ' ms', 0)} "
        f"(SIGKILL, advisories {'on' if r.get('advisories_active') else 'off'}); "
        f"{_fmt(r.get('kill_detection_silent_ms'), ' ms', 0)} with heartbeats stopped",
        "  targets:",
    ]
    if r.get("failure"):
        lines.insert(1, f"  INCOMPLETE, {r['failure']}")
    for name, t in (r.get("targets") or {}).items():
        mark = {True: "met", False: "MISSED", None: "not measured"}[t["met"]]
        note = f" ({t['note']})" if t.get("note") else ""
        lines.append(
            f"    {name:26s} {_fmt(t['value'], '', 2):>12s}  {t['bound']:34s} {mark}{note}"
        )
    return "\n".join(lines)


def write(report: dict[str, Any], path: str | os.PathLike[str]) -> None:
    Path(path).write_text(json.dumps(report, indent=2, sort_keys=False) + "\n")


def missing_keys(report: dict[str, Any]) -> list[str]:
    """Required keys that are absent or of the wrong type (null is allowed: not measured)."""
    bad = []
    for key, types in REQUIRED_KEYS.items():
        if key not in report:
            bad.append(key)
        elif report[key] is not None and (
            isinstance(report[key], bool) or not isinstance(report[key], types)
        ):
            bad.append(key)
    return bad
