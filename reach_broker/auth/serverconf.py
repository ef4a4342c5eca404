"""``DIR/server.conf``: nats-server in operator mode, as ``reach auth init`` writes it.

- ``operator``: the operator JWT (inline, so the file does not depend on the working dir).
- ``system_account`` and a ``full`` resolver over ``DIR/jwt``: the server keeps every account
  JWT there and accepts updates signed by the operator on ``$SYS.REQ.CLAIMS.UPDATE`` while it
  runs, so revoking a user takes effect without a restart. Users need no server change at
  all: a user JWT signed by a known account is accepted as it comes.
- ``resolver_preload``: the system account only (it never changes). The application account
  lives in ``DIR/jwt`` alone, so the newest signed version (with its revocations) is what a
  restarted server loads; a lost ``DIR/jwt`` locks everyone out rather than undoing a
  revocation.
- JetStream with its store in ``DIR/data`` (files in ``DIR/data/jetstream``); the same ping
  and payload settings as reach's open-mode ``configs/nats-server.conf``; TLS required when
  the DIR was made with a CA.
"""

from __future__ import annotations

import json
from pathlib import Path

PING_INTERVAL = "2s"
"""As in configs/nats-server.conf: a frozen peer is disconnected in ~4-6 s."""
PING_MAX = 2
MAX_PAYLOAD = "8MB"


def _q(value: str | Path) -> str:
    """A quoted config string (JSON string syntax is valid nats-server config syntax)."""
    return json.dumps(str(value))


def render(
    *,
    operator_jwt: str,
    system_account: str,
    system_account_jwt: str,
    resolver_dir: Path,
    store_dir: Path,
    host: str = "127.0.0.1",
    port: int = 4222,
    tls: tuple[Path, Path] | None = None,
) -> str:
    """The config text. ``tls`` is ``(cert, key)``: clients must then connect with TLS."""
    lines = [
        "# nats-server in operator mode for reach: written by `reach auth init`.",
        "# Users (agents, callers, the broker) are JWTs signed by the application account;",
        "# issuing one needs no change here. Revocations reach a running server through",
        "# $SYS.REQ.CLAIMS.UPDATE (`reach auth revoke`) and are kept in the resolver dir.",
        f"host: {_q(host)}",
        f"port: {port}",
        f"ping_interval: {_q(PING_INTERVAL)}",
        f"ping_max: {PING_MAX}",
        f"max_payload: {MAX_PAYLOAD}",
        "",
        "# An acknowledged write is fsynced first (the second line below; docs/operations.md,",
        "# Durability).",
        "jetstream {",
        f"  store_dir: {_q(store_dir)}",
        "  sync_interval: always",
        "  max_memory_store: 256MB",
        "  max_file_store: 4GB",
        "}",
        "",
        f"operator: {_q(operator_jwt)}",
        f"system_account: {_q(system_account)}",
        "resolver {",
        "  type: full",
        f"  dir: {_q(resolver_dir)}",
        "  allow_delete: true",
        '  interval: "2m"',
        '  timeout: "1.9s"',
        "}",
        "resolver_preload {",
        f"  {system_account}: {_q(system_account_jwt)}",
        "}",
    ]
    if tls is not None:
        cert, key = tls
        lines += [
            "",
            "tls {",
            f"  cert_file: {_q(cert)}",
            f"  key_file: {_q(key)}",
            "  timeout: 2",
            "}",
        ]
    return "\n".join(lines) + "\n"
