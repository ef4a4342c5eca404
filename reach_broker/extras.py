"""The optional extras (``pip install 'nats-reach[a2a]'``, ``'nats-reach[mcp]'``): whether one is
installed, and the one-line error naming it when it is not.

The core install stays lean: a protocol SDK is imported only by the command that needs it,
after :func:`require` said it is there.
"""

from __future__ import annotations

from importlib import metadata

EXTRAS: dict[str, tuple[str, ...]] = {
    "a2a": ("a2a-sdk", "starlette", "sse-starlette", "uvicorn"),
    "mcp": ("mcp",),
}
"""The distributions each extra needs (pyproject.toml's optional-dependencies; the a2a
extra's ``httptools`` only makes uvicorn faster, so it is not required here)."""


class MissingExtra(Exception):
    """An optional extra is not installed; the message names it and how to install it."""


def missing(extra: str) -> list[str]:
    """The distributions of ``extra`` that are not installed."""
    out = []
    for dist in EXTRAS[extra]:
        try:
            metadata.distribution(dist)
        except metadata.PackageNotFoundError:
            out.append(dist)
    return out


def require(extra: str, what: str) -> None:
    """Raise :class:`MissingExtra` unless every distribution of ``extra`` is installed."""
    absent = missing(extra)
    if absent:
        raise MissingExtra(
            f"{what} needs the optional extra {extra!r} ({', '.join(absent)} not installed): "
            f"pip install 'nats-reach[{extra}]' (in a clone: pip install -e '.[{extra}]')"
        )
