"""Log handlers of the reach processes (the CLI, the broker process, the demo agents): one
line per record on stderr, as text or as one JSON object (``ts``, ``level``, ``logger``,
``msg``, ``exc``). Library modules only log; configuring handlers happens here.

Also here: what a process does when its stdout goes away (a closed terminal, ``| head``):
:func:`say` never raises for it, :func:`drop_stdout` points the descriptor at /dev/null so
nothing later (nor the flush at exit) fails on it again.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
from typing import Any


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": round(record.created, 3),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out)


def setup_logging(fmt: str, level: str) -> None:
    """Send every log record to stderr as ``fmt`` (``text`` or ``json``) from ``level`` up."""
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(
            logging.Formatter("%(asctime)s %(levelname)-5s %(name)s %(message)s", "%H:%M:%S")
        )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())


def drop_stdout() -> None:
    """Point stdout at /dev/null: its reader or terminal is gone, so whatever is still
    buffered, and every later write, goes nowhere instead of raising."""
    with contextlib.suppress(OSError, ValueError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)


def say(line: str) -> None:
    """A status line on stdout that cannot fail the process: when the terminal went away
    (SIGHUP leaves it returning EIO) the line is dropped, and so is stdout."""
    try:
        print(line, flush=True)
    except OSError:
        drop_stdout()
