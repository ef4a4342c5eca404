"""The ``reach`` CLI: ``reach broker`` and the operator commands (see :mod:`.parser`).

Modules: :mod:`.parser` (the parser and ``main``), :mod:`.common` (errors, options,
connection, request), :mod:`.output` (JSON, tables, event lines), :mod:`.view` (the live
fleet view), and one module per command: :mod:`.broker`, :mod:`.agents`, :mod:`.route`,
:mod:`.top`, :mod:`.events`, :mod:`.demo`, :mod:`.ack`. The broker process the ``broker``
command runs is :mod:`reach_broker.process`.
"""

from .parser import build_parser, main

__all__ = ["build_parser", "main"]
