"""``reach adapt http``: a sidecar that makes an HTTP agent a reach agent
(:mod:`reach_broker.interop.httpadapter`); it runs until Ctrl-C, then drains."""

from __future__ import annotations

import argparse
import asyncio
import logging
from urllib.parse import urlsplit

from reach_agent.wire import schema
from reach_agent.wire.errors import ReachError
from reach_broker.logs import say

from .common import (
    EXIT_UNAVAILABLE,
    EXIT_USAGE,
    CliError,
    Subcommands,
    add_common,
    capability,
    env_default,
    stop_on_signals,
)


def add_parser(sub: Subcommands) -> None:
    p = sub.add_parser("adapt", help="make an agent that does not speak reach reachable")
    kinds = p.add_subparsers(dest="kind", required=True, metavar="KIND")
    h = kinds.add_parser("http", help="an HTTP agent: tasks forwarded as HTTP POSTs")
    add_common(h)
    h.add_argument("--agent-id", required=True, help="the reach agent id it announces")
    h.add_argument("--capability", required=True, help="the capability it serves")
    h.add_argument("--url", required=True, help="where each task is POSTed")
    h.add_argument("--health", metavar="URL",
                   help="GET before each heartbeat and probe; not 2xx: unrouted")  # fmt: skip
    h.add_argument("--max-concurrency", type=int, default=8,
                   help="requests in flight at most (default 8)")  # fmt: skip
    h.add_argument("--timeout-hint-ms", type=int,
                   help="how long a request usually may take (announced)")  # fmt: skip
    h.add_argument("--interval", type=float, default=5.0,
                   help="seconds between heartbeats (default 5)")  # fmt: skip
    h.add_argument("--health-port", type=int, default=env_default("REACH_HEALTH_PORT"),
                   metavar="PORT",
                   help="serve /healthz and /readyz on this port, for an orchestrator's "
                        "probes (default off; env REACH_HEALTH_PORT)")  # fmt: skip
    h.add_argument("--health-host", default=env_default("REACH_HEALTH_HOST", "127.0.0.1"),
                   help="address of --health-port (default 127.0.0.1; 0.0.0.0 in a pod; "
                        "env REACH_HEALTH_HOST)")  # fmt: skip
    h.set_defaults(func=run)


def _url(value: str, flag: str) -> str:
    parts = urlsplit(value)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise CliError(f"{flag} {value!r} is not an http:// or https:// URL", EXIT_USAGE)
    return value


def run(args: argparse.Namespace) -> int:
    from reach_broker.interop.httpadapter import missing_extra

    why = missing_extra()
    if why is not None:
        raise CliError(why, EXIT_USAGE)
    try:
        schema.check_agent_id(args.agent_id, "--agent-id")
    except ReachError as exc:
        raise CliError(exc.message, EXIT_USAGE) from None
    cap = capability(args.capability, "--capability")
    url = _url(args.url, "--url")
    health = _url(args.health, "--health") if args.health else None
    if not 1 <= args.max_concurrency <= 100_000:
        raise CliError(f"--max-concurrency {args.max_concurrency} is not within 1-100000",
                       EXIT_USAGE)  # fmt: skip
    if args.timeout_hint_ms is not None and not 1 <= args.timeout_hint_ms <= 86_400_000:
        raise CliError(f"--timeout-hint-ms {args.timeout_hint_ms} is not within 1-86400000",
                       EXIT_USAGE)  # fmt: skip
    if args.health_port is not None and not 0 <= args.health_port <= 65535:
        raise CliError(f"--health-port {args.health_port} is not a port (0-65535)", EXIT_USAGE)
    if not 0.05 <= args.interval <= 3600:
        raise CliError(f"--interval {args.interval:g} is not within 0.05-3600 seconds", EXIT_USAGE)
    return asyncio.run(_adapt(args, cap, url, health))


async def _adapt(args: argparse.Namespace, cap: str, url: str, health: str | None) -> int:
    from reach_broker.interop.httpadapter import HttpAdapter

    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per request
    stop = stop_on_signals()
    adapter = HttpAdapter(
        args.agent_id, cap, url, health_url=health, max_concurrency=args.max_concurrency,
        timeout_hint_ms=args.timeout_hint_ms, heartbeat_interval=args.interval,
        prefix=args.prefix, creds=args.creds,
    )  # fmt: skip
    probes = None
    if args.health_port is not None:  # listening first: /healthz answers while connecting
        from ..health import ProbePort

        probes = ProbePort(args.health_host, args.health_port, adapter.not_ready)
        try:
            await probes.start()
        except OSError as exc:
            raise CliError(f"--health-port {args.health_port} on {args.health_host}: "
                           f"{exc.strerror or exc}", EXIT_UNAVAILABLE) from None  # fmt: skip
        say(f"probes on {probes.url}/healthz and /readyz")
    try:
        await adapter.start(args.server)
        say(f"adapting {args.agent_id} ({cap}) -> POST {url}"
            + (f", health {health}" if health else ""))  # fmt: skip
        try:
            await stop.wait()
        finally:
            await adapter.stop()
            say(f"stopped {args.agent_id} after {adapter.posts} requests")
    finally:
        if probes is not None:
            await probes.stop()
    return 0
