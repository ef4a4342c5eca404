"""``reach mcp``: the MCP server (:mod:`reach_broker.interop.mcptools`) on stdio, or with
``--http PORT`` on streamable HTTP at ``http://127.0.0.1:PORT/mcp`` (with ``/healthz`` and
``/readyz`` beside it, :mod:`reach_broker.console.health`). Needs the extra ``mcp``.

stdout belongs to the protocol on stdio: every word of ours goes to stderr.
"""

from __future__ import annotations

import argparse
import asyncio
from typing import Any

from .common import (
    EXIT_UNAVAILABLE,
    EXIT_USAGE,
    CliError,
    Subcommands,
    add_common,
    default_signals,
    env_default,
    servers,
    stop_on_signals,
    subjects,
)

DEFAULT_CALL_TIMEOUT_S = 30.0


def add_parser(sub: Subcommands) -> None:
    p = sub.add_parser("mcp", help="serve reach's tools to MCP clients (stdio, or --http PORT)")
    add_common(p, timeout_help="timeout of the tools' broker requests in seconds")
    # Environment defaults as strings: argparse converts them (type=) only when this command
    # runs, so a bad value is this command's usage error naming it, not every command's crash.
    p.add_argument("--http", type=int, default=env_default("REACH_MCP_PORT"), metavar="PORT",
                   help="serve streamable HTTP on 127.0.0.1:PORT/mcp instead of stdio "
                        "(env REACH_MCP_PORT)")  # fmt: skip
    p.add_argument("--call-timeout", type=float,
                   default=env_default("REACH_MCP_CALL_TIMEOUT", str(DEFAULT_CALL_TIMEOUT_S)),
                   help="call_agent's deadline when the model gives none (default 30; env "
                        "REACH_MCP_CALL_TIMEOUT)")  # fmt: skip
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from reach_broker.extras import MissingExtra, require

    try:
        require("mcp", "reach mcp")
    except MissingExtra as exc:
        raise CliError(str(exc), EXIT_USAGE) from None
    if args.http is not None and not 1 <= args.http <= 65535:
        raise CliError(f"--http {args.http} is not a port (1-65535)", EXIT_USAGE)
    if args.call_timeout <= 0:
        raise CliError(f"--call-timeout {args.call_timeout:g} must be above zero", EXIT_USAGE)
    return asyncio.run(_serve(args))


async def _serve(args: argparse.Namespace) -> int:
    import reach_agent
    from reach_broker import __version__
    from reach_broker.interop.mcpserver import build_server
    from reach_broker.interop.mcptools import Tools

    base = reach_agent.ClientConfig()
    config = reach_agent.ClientConfig(
        prefix=subjects(args).prefix, connect_timeout_s=min(args.timeout * 5, 10.0),
        max_timeout_s=max(args.call_timeout, base.max_timeout_s),
    )  # fmt: skip
    try:
        client = reach_agent.Client(servers(args), config, name="reach-mcp", creds=args.creds,
                                    tls_ca=args.tls_ca)  # fmt: skip
    except ValueError as exc:  # a credentials file that does not exist
        raise CliError(str(exc), EXIT_USAGE) from None
    stop = stop_on_signals()  # while connecting: a signal ends the wait with one line
    try:
        await client.start(stop=stop)
    except (ConnectionError, OSError) as exc:
        raise CliError(f"reach mcp: {exc}", EXIT_UNAVAILABLE) from None
    finally:
        default_signals()  # serving: Ctrl-C and SIGTERM act as they always did
    try:
        tools = Tools(client, call_timeout_s=args.call_timeout, request_timeout_s=args.timeout)
        server = build_server(tools, __version__, not_ready=lambda: _not_ready(client))
        if args.http is None:
            await server.run_stdio_async()
        else:
            await server.run_streamable_http_async(host="127.0.0.1", port=args.http)
    finally:
        await client.stop()
    return 0


def _not_ready(client: Any) -> str | None:
    """Why ``reach mcp --http``'s ``/readyz`` says 503, or None: its client is connected."""
    if not client.nc.is_connected:
        return "not connected to NATS (reconnecting)"
    return None
