"""The ``reach`` command line: the parser, built from one module per command, and ``main``.

A command is a module with ``add_parser(sub)`` (its subparser, options and
``set_defaults(func=run)``) and ``run(args) -> int`` (the exit code); adding one is a new
module and one entry in :data:`COMMANDS`. Every option also comes from an environment
variable (``NATS_URL``, ``REACH_*``); ``--json`` prints machine-readable output; errors are
one clear line on stderr and a non-zero exit (:class:`~.common.CliError`), with ``--json``
also one JSON object on stdout. A reader of stdout that goes away (``reach events | head``)
ends the command quietly with exit code 141, as SIGPIPE would.
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import sys
from collections.abc import Callable, Sequence

from reach_agent.wire.errors import ReachError
from reach_broker import __version__
from reach_broker.logs import drop_stdout, setup_logging

from . import (
    ack,
    adapt,
    agents,
    announce,
    auth,
    broker,
    call,
    demo,
    devcluster,
    events,
    mcp,
    route,
    rules,
    top,
)
from .common import CliError
from .output import print_json

COMMANDS = (broker, agents, route, call, announce, adapt, top, events, demo, ack, auth,
            devcluster, mcp, rules)  # fmt: skip
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
        return report(exc, as_json=args.json)
    except ReachError as exc:
        return report(CliError.of(exc), as_json=args.json)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        drop_stdout()
        return 128 + signal.SIGPIPE


def report(exc: CliError, *, as_json: bool) -> int:
    """The failure as one line on stderr (and one JSON object on stdout); its exit code."""
    sys.stderr.write(f"reach: {exc}\n")
    if as_json:
        try:
            print_json(exc.as_json())
            sys.stdout.flush()
        except BrokenPipeError:
            drop_stdout()
    with contextlib.suppress(OSError):
        sys.stderr.flush()
    return exc.code
