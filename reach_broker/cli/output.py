"""How ``reach`` commands print: JSON lines for scripts, left-aligned tables and one-line
events for people. Shared by the commands and the live view, which show the same rows."""

from __future__ import annotations

import datetime as dt
import sys
import time
from collections.abc import Sequence
from typing import Any

import msgspec


def print_json(value: Any) -> None:
    sys.stdout.write(msgspec.json.encode(value).decode() + "\n")


def format_table(rows: Sequence[Sequence[Any]], header: Sequence[str]) -> list[str]:
    """Left-aligned columns two spaces apart, header first; ``None`` cells print empty."""
    cells = [[str(c) for c in header]] + [["" if c is None else str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    return ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in cells]


def print_table(rows: Sequence[Sequence[Any]], header: Sequence[str]) -> None:
    for line in format_table(rows, header):
        sys.stdout.write(line + "\n")


AGENT_HEADER = ["AGENT", "STATE", "SCORE", "LOAD", "LAST HEARD", "CAPABILITIES", "REGION",
                "SUCCESS"]  # fmt: skip


def agent_rows(views: Sequence[Any], now_ms: float | None = None) -> list[tuple[str, ...]]:
    """Table rows of ``<prefix>.agents`` views (``reach agents`` and the live view)."""
    return [
        (v.agent_id, v.state, f"{v.score:.1f}", f"{v.active}/{v.max_concurrency}",
         ago(v.last_seen_ms, now_ms), ",".join(v.capabilities), v.region or "-",
         f"{100 * v.success_rate:.1f}%")
        for v in views
    ]  # fmt: skip


def ago(ms: int, now_ms: float | None = None) -> str:
    """``3.2s ago`` of a Unix-ms time (``-`` when unknown)."""
    if not ms:
        return "-"
    now = time.time() * 1000.0 if now_ms is None else now_ms
    return f"{max(now - ms, 0.0) / 1000.0:.1f}s ago"


def utc(ms: int) -> str:
    """A Unix-ms time as ISO 8601 UTC with milliseconds (``2026-01-02T03:04:05.678Z``)."""
    return dt.datetime.fromtimestamp(ms / 1000, dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"


def format_event(event: Any) -> str:
    """One human line of an ``Event``: time, kind, agent, transition, reason, broker."""
    at = time.strftime("%H:%M:%S", time.localtime(event.at_ms / 1000.0))
    move = f"{event.from_ or '-'} -> {event.to}" if event.to else ""
    return (f"{at}.{event.at_ms % 1000:03d}  {event.kind:<10}  {event.agent_id:<16}  "
            f"{move:<22}  {event.reason}  [{event.broker_id}]").rstrip()  # fmt: skip
