"""The agent's default ack writer: the JetStream ``AckWriter`` behind a write-ahead log in
the agent's ack directory (``$REACH_ACK_DIR/<agent_id>``), on its own connection.

``Agent`` uses it unless handed another ``ack_sink`` (or ``durable_acks=False``); the
directory is checked once at start, so a directory that cannot be written is one clear error.
"""

from __future__ import annotations

import os

from jetstream import acks
from reach_agent.connection import Credentials, connect_options
from reach_agent.wire.subjects import DEFAULT_PREFIX, Subjects

ACK_DIR_ENV = "REACH_ACK_DIR"


def default_ack_dir(agent_id: str) -> str:
    """Where an agent's ack write-ahead files live: ``$REACH_ACK_DIR/<agent_id>`` or
    ``~/.cache/reach/<agent_id>`` (the same path across restarts, so a restart replays it)."""
    base = os.environ.get(ACK_DIR_ENV) or os.path.join(os.path.expanduser("~"), ".cache", "reach")
    return os.path.join(base, agent_id)


def check_ack_dir(agent_id: str, wal_dir: str | None = None) -> str:
    """The agent's ack write-ahead directory (``wal_dir``, else :func:`default_ack_dir`),
    created if missing; a ``ValueError`` naming the path and the setting that chose it when
    it cannot be created or written: one clear error at start instead of a failing write
    per task (or a start retried forever, as an ``OSError`` would be)."""
    path = wal_dir or default_ack_dir(agent_id)
    why = None
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as exc:
        why = f"cannot be created ({exc.strerror or type(exc).__name__})"
    else:
        if not os.access(path, os.W_OK | os.X_OK):
            why = "is not writable"
    if why is None:
        return path
    if wal_dir:
        source = "the Agent argument ack_wal_dir"
    elif os.environ.get(ACK_DIR_ENV):
        source = f"{ACK_DIR_ENV}={os.environ[ACK_DIR_ENV]!r} (as $REACH_ACK_DIR/<agent_id>)"
    else:
        source = f"the default ~/.cache/reach/<agent_id> ({ACK_DIR_ENV} is not set)"
    raise ValueError(
        f"agent {agent_id!r}: the ack write-ahead directory {path!r} {why}; it comes from "
        f"{source}. Set {ACK_DIR_ENV} or the Agent argument ack_wal_dir to a writable "
        "directory (or pass durable_acks=False)."
    )


def default_ack_writer(
    agent_id: str, servers: str | list[str] | None = None, *, prefix: str = DEFAULT_PREFIX,
    credentials: Credentials | None = None, wal_dir: str | None = None,
) -> acks.AckWriter:  # fmt: skip
    """The ack sink an ``Agent`` uses by default: WAL under :func:`default_ack_dir`, its own
    NATS connection named ``<agent_id>-acks`` (not the agent id, so the broker's disconnect
    advisories never confuse it with the agent), with the agent's ``credentials``."""
    return acks.AckWriter(
        wal_dir or default_ack_dir(agent_id),
        author=agent_id,
        connect=connect_options(f"{agent_id}-acks", servers, credentials),
        subjects=Subjects(prefix),
    )  # fmt: skip
