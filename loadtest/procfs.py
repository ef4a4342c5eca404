"""Process accounting from ``/proc``: CPU and RSS of one PID, how busy the machine is, loadavg.

Every figure is ``None`` when the process is gone or was never ours to measure (a broker
run by someone else: ``--no-broker``), so a phase reports null rather than failing.
"""

from __future__ import annotations

import os
import time

CLK_TCK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int | None) -> float | None:
    """User + system CPU seconds ``pid`` has used so far."""
    if not pid:
        return None
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / CLK_TCK
    except (OSError, IndexError, ValueError):
        return None


def rss_bytes(pid: int | None) -> int | None:
    """Resident set size of ``pid``."""
    if not pid:
        return None
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def machine_busy() -> tuple[float, float]:
    """(busy, total) jiffies of the whole machine, for the share of CPU others used."""
    with open("/proc/stat") as f:
        vals = [int(v) for v in f.readline().split()[1:]]
    idle = vals[3] + (vals[4] if len(vals) > 4 else 0)
    total = sum(vals[:8])
    return float(total - idle), float(total)


def loadavg() -> str:
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


class CpuMeter:
    """CPU seconds of one process over a span, as a share of one core."""

    def __init__(self, pid: int | None) -> None:
        self.pid = pid
        self.t0 = time.perf_counter()
        self.c0 = cpu_seconds(pid)

    def share(self) -> float | None:
        if self.c0 is None:
            return None
        c1 = cpu_seconds(self.pid)
        dt = time.perf_counter() - self.t0
        return None if c1 is None or dt <= 0 else round((c1 - self.c0) / dt, 3)


class CpuSpans:
    """CPU seconds of one process summed over several spans (the slices of one mode).

    A span whose start or end could not be read is left out, wall time included.
    """

    def __init__(self) -> None:
        self.spans: list[tuple[float, float]] = []  # (cpu seconds, wall seconds)

    def add(self, c0: float | None, c1: float | None, wall: float) -> None:
        if c0 is not None and c1 is not None:
            self.spans.append((c1 - c0, wall))

    @property
    def cpu(self) -> float:
        return sum(c for c, _ in self.spans)

    def share(self) -> float | None:
        """CPU seconds per second over the spans (1.0: one core); None with no span."""
        if not self.spans:
            return None
        return round(self.cpu / sum(t for _, t in self.spans), 3)

    def us_per(self, count: int) -> float | None:
        """CPU µs per one of ``count`` requests served over the spans."""
        if not self.spans or not count:
            return None
        return round(self.cpu / count * 1e6, 1)
