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
    cancel,
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

COMMANDS = (broker, agents, route, call, cancel, announce, adapt, top, events, demo, ack, auth,
            devcluster, mcp, rules)  # fmt: skip
"""The subcommands, in the order ``reach --help`` lists them."""

Command = Callable[[argparse.Namespace], int]


GLOBAL_FLAGS = {"--server": True, "-s": True, "--context": True, "--creds": True,
                "--tls-ca": True, "--json": False, "--prefix": True, "--timeout": True,
                "--log-format": True, "--log-level": True}  # fmt: skip
"""The options every command takes (:func:`~.common.add_common`), and whether each takes a
value: they may come before the command too (``reach --json call …``)."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="reach", description="reach: every AI agent in a fleet reachable by capability",
        epilog="The options every command takes (--server/-s, --context, --creds, --tls-ca, "
               "--json, --prefix, --timeout, --log-format, --log-level) may also come before "
               "the command: reach --json route text_processing. `reach COMMAND --help` "
               "lists a command's own.",
    )  # fmt: skip
    parser.add_argument("--version", action="version", version=f"reach {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in COMMANDS:
        command.add_parser(sub)
    _finish(parser)
    return parser


def _finish(parser: argparse.ArgumentParser) -> None:
    """Each (sub)command's parser: its one-line help as its description when it has none,
    and itself as the parser whose usage a bad option prints (``_parser``)."""
    for action in parser._actions:
        if not isinstance(action, argparse._SubParsersAction):
            continue
        helps = {a.dest: a.help for a in action._choices_actions}
        for name, child in action.choices.items():
            if not child.description and helps.get(name):
                text = str(helps[name])
                child.description = text[0].upper() + text[1:] + "."
            child.set_defaults(_parser=child)
            _finish(child)


def hoist(parser: argparse.ArgumentParser, argv: Sequence[str]) -> list[str]:
    """``argv`` with the common options given before the command moved after it (after the
    last subcommand: ``reach --json auth list`` → ``reach auth list --json``), where the
    command's parser reads them. Anything else before the command stays where it is."""
    args = list(argv)
    moved: list[str] = []
    i = 0
    while i < len(args) and args[i].startswith("-") and args[i] != "--":
        flag = args[i].split("=", 1)[0]
        if flag not in GLOBAL_FLAGS:
            return args  # --help, --version, a typo: the top-level parser answers
        takes = GLOBAL_FLAGS[flag] and "=" not in args[i]
        moved += args[i : i + 1 + takes]
        i += 1 + takes
    if not moved or i >= len(args):
        return args
    rest, node, j = args[i:], parser, 0
    while j < len(rest):  # walk down the subcommands: moved flags go after the last one
        choices = next((a.choices for a in node._actions
                        if isinstance(a, argparse._SubParsersAction)), None)  # fmt: skip
        if choices is None or rest[j] not in choices:
            break
        node = choices[rest[j]]
        j += 1
    return [*rest[:j], *moved, *rest[j:]]


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    argv = hoist(parser, sys.argv[1:] if argv is None else argv)
    args, extra = parser.parse_known_args(argv)
    if extra:  # the command's own usage, not the top level's
        own: argparse.ArgumentParser = getattr(args, "_parser", parser)
        own.error(f"unrecognized arguments: {' '.join(extra)}")
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
