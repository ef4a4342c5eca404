"""asyncio helpers of the SDK: a set of spawned tasks, and bounded waits that survive the
Python 3.11 race in which ``wait_for`` swallows a cancel arriving as it completes."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Coroutine
from typing import Any

from . import trace

log = trace.logger(__name__)


class TaskSet:
    """Tasks a component spawned and must end at stop; holding them keeps each alive. A task
    that ends with an error nobody handled is said at once (``task.failed``, naming the task
    and the error, with its traceback), not left to asyncio's "Task exception was never
    retrieved" at collection (nemesis seed 38: an agent's task ended that way, unanswered)."""

    __slots__ = ("_tasks",)

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[Any]] = set()

    def __len__(self) -> int:
        return len(self._tasks)

    def spawn(self, coro: Coroutine[Any, Any, Any], name: str) -> asyncio.Task[Any]:
        task = asyncio.ensure_future(coro)
        task.set_name(name)
        self._tasks.add(task)
        task.add_done_callback(self._ended)
        return task

    def _ended(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if task.cancelled():
            return
        exc = task.exception()
        if exc is not None:
            log.error("task.failed name=%s error=%r", task.get_name(), exc, exc_info=exc)

    def cancel(self) -> None:
        for t in list(self._tasks):
            t.cancel()

    async def wait(self, timeout_s: float) -> None:
        """Wait for every task to end, at most ``timeout_s``."""
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=timeout_s)


async def wait_event(event: asyncio.Event, seconds: float) -> None:
    """Wait for ``event`` at most ``seconds``. (``asyncio.timeout``, not ``wait_for``:
    on 3.11 ``wait_for`` can swallow a cancel that races the event being set.)"""
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(seconds):
            await event.wait()


STOP_WITHIN_S = 2.0
RECANCEL_S = 0.1


async def stop_loops(*tasks: asyncio.Task[Any], within_s: float = STOP_WITHIN_S) -> None:
    """Cancel background loops and wait for them to end, at most ``within_s``. On 3.11 a
    cancel that races a completing ``wait_for`` inside nats-py is swallowed (the loop goes
    on to its next sleep), so a task still running is cancelled again every ``RECANCEL_S``;
    one that outlives ``within_s`` is logged, never waited on for ever."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within_s
    pending = {t for t in tasks if not t.done()}
    while pending:
        for t in pending:
            t.cancel()
        left = deadline - loop.time()
        if left <= 0:
            for t in pending:
                log.warning("loop_did_not_stop task=%s", t.get_name())
            return
        _, pending = await asyncio.wait(pending, timeout=min(RECANCEL_S, left))
