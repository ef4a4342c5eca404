"""``reach dev-cluster``: a local N-node JetStream cluster (:mod:`reach_broker.cluster.devcluster`).

    reach dev-cluster --nodes 3 --dir DIR [--base-port P] [--background]
    reach dev-cluster --stop --dir DIR

Every option also comes from the environment: ``REACH_CLUSTER_NODES``, ``REACH_CLUSTER_DIR``,
``REACH_CLUSTER_BASE_PORT``. The launcher prints its own one JSON line and its own errors, so
this command only parses and hands over.
"""

from __future__ import annotations

import argparse

from reach_broker.cluster import devcluster

from .common import EXIT_USAGE, CliError, Subcommands, add_log_options, env_default, int_env


def add_parser(sub: Subcommands) -> None:
    p = sub.add_parser(
        "dev-cluster",
        help="run a local JetStream cluster of N nats-server nodes on loopback",
        description="Start N nats-server nodes on loopback ports routed into one JetStream "
        'cluster; print one JSON line {"urls": [...], "pids": [...], "dir": DIR} once it has '
        "a meta leader; stop them on SIGINT/SIGTERM (or with --stop --dir DIR).",
    )
    nodes = int_env("REACH_CLUSTER_NODES")
    p.add_argument("--nodes", type=int, default=3 if nodes is None else nodes,
                   help="number of nodes (default 3; env REACH_CLUSTER_NODES)")  # fmt: skip
    p.add_argument("--dir", default=env_default("REACH_CLUSTER_DIR"),
                   help="node configs, logs, JetStream stores and cluster.json "
                        "(env REACH_CLUSTER_DIR)")  # fmt: skip
    p.add_argument("--base-port", type=int, default=int_env("REACH_CLUSTER_BASE_PORT"),
                   help="clients on P+i, routes on P+2000+i, monitoring on P+4000+i "
                        "(default: free ports; env REACH_CLUSTER_BASE_PORT)")  # fmt: skip
    p.add_argument("--background", action="store_true",
                   help="leave the cluster running and return once it is ready")  # fmt: skip
    p.add_argument("--stop", action="store_true", help="stop the cluster recorded in --dir")
    p.add_argument("--json", action="store_true",
                   help="accepted like every command's; the ready line is JSON anyway")  # fmt: skip
    add_log_options(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if not args.dir:
        raise CliError("--dir is required (or env REACH_CLUSTER_DIR)", EXIT_USAGE)
    if args.stop:
        return devcluster.stop(args.dir)
    if args.nodes < 1:
        raise CliError(f"--nodes {args.nodes} must be at least 1", EXIT_USAGE)
    return devcluster.run(args.nodes, args.dir, base_port=args.base_port,
                          background=args.background)  # fmt: skip
