"""``reach adapt http`` and ``reach adapt a2a``: sidecars that make an HTTP agent
(:mod:`reach_broker.interop.httpadapter`) or an A2A agent
(:mod:`reach_broker.interop.a2aadapter`) a reach agent; each runs until Ctrl-C, then drains."""

from __future__ import annotations

import argparse
import asyncio
import logging
from urllib.parse import urlsplit

from reach_agent.connection import NotConnected
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
                   help="GET every second; not 2xx within 0.5 s: out of the routes (without "
                   "it: the last calls, else a TCP connection to --url's host)")  # fmt: skip
    _agent_options(h, "requests")
    h.add_argument("--health-port", type=int, default=env_default("REACH_HEALTH_PORT"),
                   metavar="PORT",
                   help="serve /healthz and /readyz on this port, for an orchestrator's "
                        "probes (default off; env REACH_HEALTH_PORT)")  # fmt: skip
    h.add_argument("--health-host", default=env_default("REACH_HEALTH_HOST", "127.0.0.1"),
                   help="address of --health-port (default 127.0.0.1; 0.0.0.0 in a pod; "
                        "env REACH_HEALTH_HOST)")  # fmt: skip
    h.set_defaults(func=run)
    a = kinds.add_parser("a2a", help="an A2A agent: its card's skills as capabilities, tasks "
                         "as A2A messages")  # fmt: skip
    add_common(a)
    a.add_argument("url", metavar="URL", help="the A2A agent's base URL (its card is at "
                   "URL/.well-known/agent-card.json)")  # fmt: skip
    a.add_argument("--agent-id", help="the reach agent id it announces (default: the card's "
                   "name, e.g. echo-agent)")  # fmt: skip
    a.add_argument("--skill", action="append", default=[], metavar="SKILL_ID",
                   help="announce only this skill (repeatable; default: every skill)")  # fmt: skip
    a.add_argument("--capability", action="append", default=[], metavar="SKILL_ID=NAME",
                   help="announce a skill as this capability (repeatable; default: the skill "
                   "id, sanitised)")  # fmt: skip
    _agent_options(a, "tasks")
    a.set_defaults(func=run_a2a)


def _agent_options(p: argparse.ArgumentParser, what: str) -> None:
    """The announced agent's limits and heartbeat, checked by :func:`_limits`."""
    p.add_argument("--max-concurrency", type=int, default=8,
                   help=f"{what} in flight at most (default 8)")  # fmt: skip
    p.add_argument("--timeout-hint-ms", type=int,
                   help=f"how long one of its {what} usually takes (announced)")  # fmt: skip
    p.add_argument("--interval", type=float, default=5.0,
                   help="seconds between heartbeats (default 5)")  # fmt: skip


def _url(value: str, flag: str) -> str:
    parts = urlsplit(value)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise CliError(f"{flag} {value!r} is not an http:// or https:// URL", EXIT_USAGE)
    return value


def _limits(args: argparse.Namespace) -> None:
    if not 1 <= args.max_concurrency <= 100_000:
        raise CliError(f"--max-concurrency {args.max_concurrency} is not within 1-100000",
                       EXIT_USAGE)  # fmt: skip
    if args.timeout_hint_ms is not None and not 1 <= args.timeout_hint_ms <= 86_400_000:
        raise CliError(f"--timeout-hint-ms {args.timeout_hint_ms} is not within 1-86400000",
                       EXIT_USAGE)  # fmt: skip
    if not 0.05 <= args.interval <= 3600:
        raise CliError(f"--interval {args.interval:g} is not within 0.05-3600 seconds", EXIT_USAGE)


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
    _limits(args)
    if args.health_port is not None and not 0 <= args.health_port <= 65535:
        raise CliError(f"--health-port {args.health_port} is not a port (0-65535)", EXIT_USAGE)
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
        from ..console.health import ProbePort

        probes = ProbePort(args.health_host, args.health_port, adapter.not_ready)
        try:
            await probes.start()
        except OSError as exc:
            raise CliError(f"--health-port {args.health_port} on {args.health_host}: "
                           f"{exc.strerror or exc}", EXIT_UNAVAILABLE) from None  # fmt: skip
        say(f"probes on {probes.url}/healthz and /readyz")
    try:
        try:
            await adapter.start(args.server, stop=stop)
        except NotConnected as exc:  # a signal while no server had answered yet
            await adapter.stop()
            raise CliError(str(exc), EXIT_UNAVAILABLE) from None
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


def run_a2a(args: argparse.Namespace) -> int:
    from reach_broker.interop.a2aadapter import missing_extra

    why = missing_extra()
    if why is not None:
        raise CliError(why, EXIT_USAGE)
    url = _url(args.url, "URL")
    if args.agent_id is not None:
        try:
            schema.check_agent_id(args.agent_id, "--agent-id")
        except ReachError as exc:
            raise CliError(exc.message, EXIT_USAGE) from None
    rename: dict[str, str] = {}
    for item in args.capability:
        skill, sep, name = item.partition("=")
        if not sep or not skill:
            raise CliError(f"--capability {item!r} is not SKILL_ID=NAME", EXIT_USAGE)
        rename[skill] = capability(name, f"--capability {skill}=")
    _limits(args)
    return asyncio.run(_adapt_a2a(args, url, rename))


async def _adapt_a2a(args: argparse.Namespace, url: str, rename: dict[str, str]) -> int:
    from reach_broker.interop.a2aadapter import A2AAdapter

    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per request
    stop = stop_on_signals()
    try:
        adapter = await A2AAdapter.connect(
            url, agent_id=args.agent_id, skills=args.skill, rename=rename,
            max_concurrency=args.max_concurrency, timeout_hint_ms=args.timeout_hint_ms,
            heartbeat_interval=args.interval, prefix=args.prefix, creds=args.creds,
        )  # fmt: skip
    except ConnectionError as exc:
        raise CliError(str(exc), EXIT_UNAVAILABLE) from None
    except ReachError as exc:
        raise CliError(exc.message, EXIT_USAGE) from None
    try:
        await adapter.start(args.server)
    except BaseException:
        await adapter.http.aclose()
        raise
    mode = "streaming" if adapter.streams else "not streaming"
    say(f"adapting {adapter.agent_id} -> A2A {adapter.version} agent "
        f"{adapter.card.name!r} at {url} ({mode})")  # fmt: skip
    for skill, cap in adapter.mapping.items():
        say(f"  skill {skill} -> capability {cap}")
    try:
        await stop.wait()
    finally:
        await adapter.stop()
        say(f"stopped {adapter.agent_id} after {adapter.sent} messages")
    return 0
