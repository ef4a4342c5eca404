"""Process plumbing shared by agents and clients: server URLs, reconnect jitter, uvloop and
the blocking :func:`run` entry point."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import signal
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import nats.errors

if TYPE_CHECKING:
    from .agent import Agent

log = logging.getLogger(__name__)

DEFAULT_URL = "nats://127.0.0.1:4222"


def server_list(servers: str | Sequence[str] | None) -> list[str]:
    """``servers`` as a list; ``None`` reads ``NATS_URL`` (comma-separated), else localhost."""
    if servers is None:
        servers = os.environ.get("NATS_URL") or DEFAULT_URL
    if isinstance(servers, str):
        servers = servers.split(",")
    out = [s.strip() for s in servers if s and s.strip()]
    if not out:
        raise ValueError(f"servers {servers!r} names no NATS server")
    return out


def reconnect_with_jitter(servers: list[Any], info: dict[str, Any]) -> tuple[Any, float]:
    """nats-py ``reconnect_to_server_handler``: least-tried server first, exponential
    delay with jitter (0.1 s doubling to 2 s, x0.5-1.5) so a fleet does not reconnect in
    lockstep after a server restart."""
    server = min(servers, key=lambda s: s.reconnects)
    base = min(0.1 * 2 ** min(server.reconnects, 5), 2.0)
    return server, base * (0.5 + random.random())


def connect_options(name: str, servers: list[str]) -> dict[str, Any]:
    """The connection options every reach SDK connection uses (DESIGN §6)."""
    return {
        "servers": servers,
        "name": name,
        "ping_interval": 2,
        "max_outstanding_pings": 2,
        "allow_reconnect": True,
        "max_reconnect_attempts": -1,  # also: the first connect waits for a server
        "reconnect_time_wait": 0.5,  # pause between first-connect attempts
        "reconnect_to_server_handler": reconnect_with_jitter,
        "connect_timeout": 2,
    }


async def flush_subscriptions(nc: Any) -> None:
    """Return once the server has registered every SUB sent so far.

    nats-py 2.16 ``flush()`` writes its PING straight to the socket while SUB commands wait
    in the pending buffer for the flusher task, so the PONG can arrive before the server saw
    the SUBs (a request right after start then gets "no responders"). By the first PONG the
    flusher has written the SUBs; a second PING queues behind them.
    """
    await nc.flush()
    await nc.flush()


async def drain_or_close(nc: Any, grace_s: float) -> None:
    """End a connection at shutdown without ever raising or hanging.

    Drain (let buffered messages out) when connected; when the server is gone, or the drain
    fails or overruns ``timeout``, close instead. A close on a transport the event loop has
    already torn down raises (uvloop: "the handler is closed"); that is swallowed too.
    """
    if nc.is_closed:
        return
    try:
        if nc.is_connected:
            await asyncio.wait_for(nc.drain(), grace_s)
            return
    except Exception:  # noqa: BLE001 - shutdown goes on whatever the connection does
        log.debug("nats.drain_failed", exc_info=True)
    try:
        await nc.close()
    except Exception:  # noqa: BLE001 - a transport already torn down
        log.debug("nats.close_failed", exc_info=True)


def new_event_loop_factory() -> Any:
    """uvloop's loop factory when uvloop is installed, else ``None`` (asyncio's default)."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency except on Windows
        return None
    return uvloop.new_event_loop


def run(agent: Agent, servers: str | Sequence[str] | None = None) -> None:
    """Serve ``agent`` until SIGTERM or SIGINT, then drain: stop taking tasks, leave, let
    in-flight tasks finish within the agent's grace period, close. Blocks.

    ``servers`` defaults to ``NATS_URL`` or ``nats://127.0.0.1:4222``; uvloop is used when
    available. While no server accepts the first connection it keeps trying (0.2 s doubling
    to 10 s, jittered); a signal during that wait ends it.
    """

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        delay = 0.2
        while True:  # no server yet: keep trying (backoff with jitter) until one answers
            try:
                await agent.start(servers)
                break
            except (nats.errors.Error, OSError, TimeoutError) as exc:
                pause = delay * (0.5 + random.random())
                log.warning("agent.connect_failed agent=%s error=%r retry_in=%.1fs",
                            agent.agent_id, exc, pause)  # fmt: skip
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(pause):
                        await stop.wait()
                if stop.is_set():
                    return
                delay = min(delay * 2, 10.0)
        try:
            await stop.wait()
            log.info("agent.signal agent=%s: draining", agent.agent_id)
        finally:
            await agent.stop()

    with asyncio.Runner(loop_factory=new_event_loop_factory()) as runner:
        runner.run(main())
