"""How one handler runs: on the loop, in a worker thread, or streamed; its result encoded.

A handler is an ``async def`` (awaited on the loop), a plain function (run in a worker
thread, at most ``min(max_concurrency, 128)`` at once) or an async generator (a streaming
handler: :mod:`~reach_agent.client.streaming` sends its chunks when the caller asked with
``Reach-Stream: 1``, and joins them into one result when it did not).
"""

from __future__ import annotations

import asyncio
import contextvars
import inspect
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Literal

import msgspec
from nats.aio.client import Client as NATS

from jetstream.names import H_REQUEST_ID
from reach_agent.wire import schema, streams
from reach_agent.wire.errors import InternalError

from . import streaming
from .dedup import Reply
from .task import Task

Handler = Callable[[Task], Any]
HandlerKind = Literal["async", "sync", "stream"]

_result_encoder = msgspec.json.Encoder()


def kind_of(fn: Handler) -> HandlerKind:
    """How ``fn`` runs: an async generator streams, a coroutine function is awaited, any
    other callable runs in a worker thread."""
    if inspect.isasyncgenfunction(fn):
        return "stream"
    if inspect.iscoroutinefunction(fn):
        return "async"
    return "sync"


class HandlerRunner:
    """Runs handlers of one agent; owns its worker threads and its stream credit subjects."""

    def __init__(self, agent_id: str, max_concurrency: int) -> None:
        self.agent_id = agent_id
        self.max_concurrency = max_concurrency
        self.credits = streaming.Credits()
        self.nc = NATS()
        self._executor: ThreadPoolExecutor | None = None

    async def subscribe(self, nc: NATS, handlers: Iterable[tuple[Handler, HandlerKind]]) -> None:
        """The agent's connection; the credit subscription when a handler streams."""
        self.nc = nc
        if any(kind == "stream" for _, kind in handlers):
            await self.credits.subscribe(nc)

    def forget(self) -> None:
        self.credits.forget()

    def close(self) -> None:
        """End the worker threads."""
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None

    async def run(
        self, handler: tuple[Handler, HandlerKind], task: Task, stream_to: str | None
    ) -> tuple[bytes, Reply | None]:
        """Run ``handler`` on ``task``: (its result as JSON, the reply to send in place of the
        result — a stream's ``completed`` — or None). ``stream_to`` is the reply subject a
        streaming handler's chunks may go to (None: join them)."""
        fn, kind = handler
        if kind == "stream":
            chunks = fn(task)
            if stream_to and task.headers.get(schema.H_STREAM) == "1":
                deadline = task.deadline
                n, joined = await streaming.send(
                    self.nc, chunks, reply=stream_to, request_id=task.request_id,
                    window=streams.window_of(task.headers), credits=self.credits,
                    wait_s=lambda: (streaming.CREDIT_WAIT_S if deadline is None
                                    else deadline - time.monotonic()),
                )  # fmt: skip
                end = {H_REQUEST_ID: task.request_id, schema.H_STATUS: "completed",
                       schema.H_CHUNKS: str(n)}  # fmt: skip
                return joined, (end, b"")
            return await streaming.collect(chunks), None
        if kind == "async":
            result = await fn(task)
        else:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(
                    max_workers=min(self.max_concurrency, 128),
                    thread_name_prefix=f"reach-{self.agent_id}",
                )
            loop = asyncio.get_running_loop()
            # In the task's context, as on the loop: its trace, for log lines and sub-calls.
            ctx = contextvars.copy_context()
            result = await loop.run_in_executor(self._executor, ctx.run, fn, task)
        try:
            return _result_encoder.encode(result), None
        except (TypeError, msgspec.EncodeError) as exc:
            raise InternalError(
                f"handler {task.capability!r} returned a result that is not JSON ({exc})"
            ) from None
