"""Writing DIR's files: atomically (a crash leaves the old file or the new, never half of
one), secrets readable by their owner only."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

PRIVATE = 0o600
PUBLIC = 0o644
PRIVATE_DIR = 0o700


def _write(path: Path, data: bytes, mode: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_private(path: Path, data: bytes) -> None:
    """A secret (seed, creds, private key): mode 0600."""
    _write(path, data, PRIVATE)


def write_public(path: Path, data: bytes) -> None:
    """Anything else (JWTs, certificates, the server config): mode 0644."""
    _write(path, data, PUBLIC)


def private_dir(path: Path) -> Path:
    """A directory of secrets, mode 0700."""
    path.mkdir(parents=True, exist_ok=True)
    path.chmod(PRIVATE_DIR)
    return path
