"""Where the gateway listens: the loopback rule (beyond it, a token; on it, a loopback
``Host``, as the console has it: :mod:`reach_broker.console.app`) and the socket.

No SDK is needed here: the process checks the binding before anything starts.
"""

from __future__ import annotations

import socket

from reach_broker.config import A2ASection
from reach_broker.console.app import host_name, is_loopback

LOOPBACK_NAMES = ("127.0.0.1", "localhost", "::1")


def loopback_host(header: str, listen: str) -> bool:
    """Whether a request's ``Host`` header names this machine (or the listen address): a
    page elsewhere that rebinds its DNS name to 127.0.0.1 sends its own name."""
    name = host_name(header)
    return name in LOOPBACK_NAMES or name == listen.strip("[]")


def binding_error(cfg: A2ASection) -> str | None:
    """Why the gateway must not start as configured (bound beyond loopback without a
    token), or None."""
    if cfg.port and not is_loopback(cfg.host) and not cfg.token:
        return (f"--a2a-host {cfg.host} listens beyond loopback: give a token with "
                "--a2a-token or REACH_A2A_TOKEN, or the console's --console-token "
                "(16 or more characters)")  # fmt: skip
    return None


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` (port 0: any free one); raises OSError."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    return socket.create_server((host, port), family=family, backlog=1024)
