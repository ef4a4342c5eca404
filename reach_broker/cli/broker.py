"""``reach broker``: run a broker (the process itself is :mod:`reach_broker.process`)."""

from __future__ import annotations

import argparse

from reach_agent.wire.errors import ReachError
from reach_agent.wire.schema import check_capability
from reach_broker import process
from reach_broker.config import ConfigError, a2a_token, console_token, load

from .common import (
    EXIT_UNAVAILABLE,
    EXIT_USAGE,
    CliError,
    Subcommands,
    add_common,
    connection_options,
    env_default,
    int_env,
    subjects,
)


def add_parser(sub: Subcommands) -> None:
    p = sub.add_parser("broker", help="run a broker (embedded nats-server unless --server)")
    add_common(p)
    p.add_argument("--auth", metavar="DIR", default=env_default("REACH_AUTH_DIR"),
                   help="secured mode: the embedded server runs DIR/server.conf (from `reach "
                        "auth init DIR`) and the broker connects with DIR/broker.creds "
                        "(env REACH_AUTH_DIR)")  # fmt: skip
    p.add_argument("--config", "-c", default=env_default("REACH_CONFIG"),
                   help="broker.toml (env REACH_CONFIG)")  # fmt: skip
    p.add_argument("--metrics-port", type=int, default=int_env("REACH_METRICS_PORT"),
                   help="Prometheus /metrics port, 0 turns it off "
                        "(env REACH_METRICS_PORT)")  # fmt: skip
    p.add_argument("--metrics-host", default=env_default("REACH_METRICS_HOST"),
                   help="address of /metrics (default 127.0.0.1; 0.0.0.0 in containers; "
                        "env REACH_METRICS_HOST)")  # fmt: skip
    p.add_argument("--port", type=int, default=int_env("REACH_NATS_PORT"),
                   help="port of the embedded nats-server (default 4222; "
                        "0: any free port)")  # fmt: skip
    store = p.add_mutually_exclusive_group()
    store.add_argument("--store-dir", default=env_default("REACH_STORE_DIR"),
                       help="JetStream store dir of the embedded server, kept across restarts "
                            "(default ./reach-data; env REACH_STORE_DIR)")  # fmt: skip
    store.add_argument("--ephemeral", action="store_true",
                       default=env_default("REACH_EPHEMERAL") == "1",
                       help="give the embedded server a throwaway store (a temp dir removed "
                            "at exit; env REACH_EPHEMERAL=1)")  # fmt: skip
    p.add_argument("--broker-id", default=env_default("REACH_BROKER_ID"),
                   help="this replica's id (default host-pid-random; env "
                        "REACH_BROKER_ID)")  # fmt: skip
    p.add_argument("--console-token", default=env_default("REACH_CONSOLE_TOKEN"),
                   help="token of the web console; needed when --metrics-host is beyond "
                        "loopback (env REACH_CONSOLE_TOKEN)")  # fmt: skip
    p.add_argument("--a2a-port", type=int, default=int_env("REACH_A2A_PORT"),
                   help="serve the A2A registry and gateway on this port (default off; "
                        "needs the extra 'a2a'; env REACH_A2A_PORT)")  # fmt: skip
    p.add_argument("--a2a-host", default=env_default("REACH_A2A_HOST"),
                   help="address of the A2A gateway (default 127.0.0.1; beyond loopback a "
                        "token is required; env REACH_A2A_HOST)")  # fmt: skip
    p.add_argument("--a2a-token", default=None,
                   help="bearer token the A2A gateway requires (16-256 characters; default "
                        "the console's token; env REACH_A2A_TOKEN)")  # fmt: skip
    p.add_argument("--a2a-root-skill", default=env_default("REACH_A2A_ROOT_SKILL"),
                   metavar="CAPABILITY",
                   help="the A2A gateway's origin stands for this capability: its card at "
                        "/.well-known/agent-card.json, its JSON-RPC at POST / (env "
                        "REACH_A2A_ROOT_SKILL)")  # fmt: skip
    # --prefix (from add_common) overrides broker.toml only when given (or REACH_PREFIX).
    p.set_defaults(func=run, prefix=env_default("REACH_PREFIX"))


def run(args: argparse.Namespace) -> int:
    try:
        cfg = load(args.config)
    except ConfigError as exc:
        raise CliError(str(exc), EXIT_USAGE) from None
    if args.server is not None or args.creds or args.tls_ca:  # a bad URL or a missing file
        connection_options(args, "reach-broker")
    # Flags (and their env vars) win over broker.toml.
    if args.server:
        cfg.nats.url = args.server
    if args.creds:
        cfg.nats.creds = args.creds
    if args.context:
        cfg.nats.context = args.context
    if args.tls_ca:
        cfg.nats.tls_ca = args.tls_ca
    if args.auth:
        from reach_broker.auth import AuthDir, AuthError

        try:
            AuthDir.open(args.auth)
        except AuthError as exc:
            raise CliError(f"--auth: {exc}", EXIT_USAGE) from None
        cfg.nats.auth_dir = args.auth
    if args.metrics_port is not None:
        cfg.broker.metrics_port = args.metrics_port
    if args.metrics_host:
        cfg.broker.metrics_host = args.metrics_host
    if args.port is not None:
        cfg.nats.embedded_port = args.port
    if args.ephemeral:
        cfg.nats.embedded_ephemeral = True
    elif args.store_dir:
        cfg.nats.embedded_store_dir = args.store_dir
    if args.broker_id:
        cfg.broker.broker_id = args.broker_id
    if args.console_token:
        try:
            cfg.console.token = console_token(args.console_token, "--console-token")
        except ConfigError as exc:
            raise CliError(str(exc), EXIT_USAGE) from None
    if args.a2a_port is not None:
        if not 0 <= args.a2a_port <= 65535:
            raise CliError(f"--a2a-port {args.a2a_port} is not a port (0-65535)", EXIT_USAGE)
        cfg.a2a.port = args.a2a_port
    if args.a2a_host:
        cfg.a2a.host = args.a2a_host
    if args.a2a_token is not None:
        try:
            cfg.a2a.token = a2a_token(args.a2a_token, "--a2a-token")
        except ConfigError as exc:
            raise CliError(str(exc), EXIT_USAGE) from None
    if args.a2a_root_skill:
        try:
            check_capability(args.a2a_root_skill, "--a2a-root-skill")
        except ReachError as exc:
            raise CliError(exc.message, EXIT_USAGE) from None
        cfg.a2a.root_skill = args.a2a_root_skill
    if args.prefix is not None:
        subjects(args)  # a bad prefix is a usage error naming it
        cfg.broker.prefix = args.prefix
    try:
        process.run(cfg)
    except process.StartError as exc:
        raise CliError(str(exc), EXIT_UNAVAILABLE) from None
    return 0
