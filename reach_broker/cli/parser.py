"""The ``reach`` command line: the parser, built from one module per command, and ``main``.

A command is a module with ``add_parser(sub)`` (its subparser, options and
``set_defaults(func=run)``) and ``run(args) -> int`` (the exit code); adding one is a new
module and one entry in :data:`COMMANDS`. Every option also comes from an environment
variable (``NATS_URL``, ``REACH_*``); ``--json`` prints machine-readable output; errors are
one clear line on stderr and a non-zero exit (:class:`~.common.CliError`).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

from reach_agent.errors import ReachError

from .. import __version__
from ..logs import setup_logging
from . import ack, agents, broker, demo, events, route, top
from .common import CliError

COMMANDS = (broker, agents, route, top, events, demo, ack)
"""The subcommands, in the order ``reach --help`` lists them."""

Command = Callable[[argparse.Namespace], int]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="reach", description="reach: every AI agent in a fleet reachable by capability"
    )
    parser.add_argument("--version", action="version", version=f"reach {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in COMMANDS:
        command.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging(args.log_format, args.log_level)
    func: Command = args.func
    try:
        return func(args)
    except CliError as exc:
        sys.stderr.write(f"reach: {exc}\n")
        return exc.code
    except ReachError as exc:
        sys.stderr.write(f"reach: {exc.code}: {exc.message}\n")
        return 1
    except KeyboardInterrupt:
        return 130
