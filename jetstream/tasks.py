"""asyncio's cancel, kept: on Python 3.11 ``asyncio.wait_for`` (which nats-py's requests use)
loses a cancel that arrives as the awaited call completes. A loop that goes on after such a
call would then never end, and whoever cancelled it (a stop, asyncio.run's final cleanup)
would wait for ever. Long-lived loops call :func:`raise_if_cancelled` once per turn."""

from __future__ import annotations

import asyncio


def raise_if_cancelled() -> None:
    """Raise ``CancelledError`` when the current task was asked to stop (a cancel that is
    still outstanding: ``Task.cancelling()``), even if an inner ``wait_for`` swallowed it."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError
