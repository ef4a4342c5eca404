"""The blocking entry point of an agent process: :func:`run` (``reach_agent.run``).

It sits above :mod:`reach_agent.agent.agent` (it imports the agent, never the other way round):
uvloop when available, SIGTERM/SIGINT handling, the wait for a first server, the drain.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import signal
from collections.abc import Callable, Sequence
from typing import Any, Unpack

import nats.errors

from reach_agent.connection import CredentialOptions, Credentials, NotConnected
from reach_agent.wire.errors import ReachError

from .agent import Agent

log = logging.getLogger(__name__)


def new_event_loop_factory() -> Any:
    """uvloop's loop factory when uvloop is installed, else ``None`` (asyncio's default)."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency except on Windows
        return None
    return uvloop.new_event_loop


LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s %(message)s"
SDK_LOGGERS = ("reach_agent", "jetstream")
"""The loggers of an agent process: the SDK's, and its ack write-ahead log's."""


def default_logging() -> Callable[[], None] | None:
    """When the application configured no logging for the SDK (no handler on its loggers or
    above them, the root included), log the SDK's INFO lines to stderr — announced,
    disconnected, reconnected, draining — so an agent process says what it does. Returns
    the undo, or None when the application's own configuration was left alone."""
    loggers = [logging.getLogger(name) for name in SDK_LOGGERS]
    if any(lg.hasHandlers() for lg in loggers):
        return None
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter(LOG_FORMAT))
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.addHandler(handler)
        if lg.level == logging.NOTSET:
            lg.setLevel(logging.INFO)

    def undo() -> None:
        for lg, level in zip(loggers, levels, strict=True):
            lg.removeHandler(handler)
            lg.setLevel(level)

    return undo


def run(
    agent: Agent,
    servers: str | Sequence[str] | None = None,
    **credentials: Unpack[CredentialOptions],
) -> None:
    """Serve ``agent`` until SIGTERM or SIGINT, then drain: stop taking tasks, leave, let
    in-flight tasks finish within the agent's grace period, close. Blocks.

    ``servers`` defaults to ``NATS_URL`` or ``nats://127.0.0.1:4222``; uvloop is used when
    available. While no server accepts the first connection it keeps trying, logging each
    failed attempt (``agent.connect_failed server=… error=…``, at most every 2 s); a signal
    during that wait ends it at once: one line on stderr saying the agent never connected,
    exit status 1. The credentials given here win
    over the agent's own; unset ones come from the environment (``NATS_CREDS``, ...). A
    file that does not exist is a ``ValueError`` at once. Without any logging configured
    by the application, the SDK's INFO lines go to stderr (:func:`default_logging`).
    """
    cred = Credentials(**credentials).check()

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        delay = 0.2
        while True:  # no server yet: keep trying (backoff with jitter) until one answers
            try:
                await agent.start(servers, cred, stop=stop)
                break
            except NotConnected as exc:  # a signal while no server had answered yet
                raise SystemExit(f"reach: {exc}") from None
            except ReachError as exc:  # refused (CONFLICT, FORBIDDEN): one line, exit 1
                raise SystemExit(f"reach: agent {agent.agent_id}: {exc.code}: {exc.message}"
                                 ) from None  # fmt: skip
            except (nats.errors.Error, OSError, TimeoutError) as exc:
                pause = delay * (0.5 + random.random())
                log.warning("agent.connect_failed agent=%s error=%r retry_in=%.1fs",
                            agent.agent_id, exc, pause)  # fmt: skip
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(pause):
                        await stop.wait()
                if stop.is_set():
                    raise SystemExit(f"reach: agent {agent.agent_id!r} never started: stopped "
                                     f"while retrying after {exc!r}") from None  # fmt: skip
                delay = min(delay * 2, 10.0)
        try:
            stopping = asyncio.ensure_future(stop.wait())
            closed = asyncio.ensure_future(agent.watch.closed.wait())
            await asyncio.wait({stopping, closed}, return_when=asyncio.FIRST_COMPLETED)
            stopping.cancel()
            closed.cancel()
            if not stop.is_set():  # the server closed the connection for good
                raise SystemExit(f"reach: agent {agent.agent_id}: {agent.watch.closed_reason}")
            log.info("agent.signal agent=%s: draining", agent.agent_id)
        finally:
            await agent.stop()

    undo = default_logging()
    try:
        with asyncio.Runner(loop_factory=new_event_loop_factory()) as runner:
            runner.run(main())
    finally:
        if undo is not None:
            undo()
