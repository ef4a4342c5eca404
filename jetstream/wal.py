"""The write-ahead log of an agent's ack records: one file per process, its line format, and
the adoption of files that dead processes left behind.

A record is durable in the log before it is published, so a crash between "handler done" and
"ack stored" loses nothing. One line per event, bytes::

    A <msg_id> <subject> <json>\\n    a record to publish (the JSON holds no newline)
    D <msg_id>\\n                     that record is stored (JetStream confirmed it)

Each process appends to its own ``acks-<pid>-<rand>.wal`` in the agent's directory and holds
it with ``flock``. A file whose lock is free belongs to a process that died: :meth:`Wal.open`
copies its pending lines into the new file, makes them durable and removes it. A torn last
line (a crash mid-write) is ignored. A close with nothing pending removes the file, and the
directory when nothing else is in it. This module knows files and lines, not NATS.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import secrets
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import NamedTuple


class Entry(NamedTuple):
    """A record written but not yet confirmed: where it goes and what it is."""

    subject: str
    data: bytes


def entry(subject: str, data: bytes) -> Entry:
    """A record as the log keeps it: a newline in valid JSON is only ever whitespace, so it
    becomes a space and the record stays one line."""
    return Entry(subject, data.replace(b"\n", b" "))


def added(msg_id: str, record: Entry) -> bytes:
    """The ``A`` line of a record (as :func:`entry` made it)."""
    return b"A %s %s %s\n" % (msg_id.encode(), record.subject.encode(), record.data)


def stored(msg_ids: Iterable[str]) -> bytes:
    """The ``D`` lines marking records confirmed."""
    return b"".join(b"D %s\n" % m.encode() for m in msg_ids)


def parse(content: bytes) -> dict[str, Entry]:
    """Records added but not marked stored, in order; a torn last line is ignored."""
    pending: dict[str, Entry] = {}
    for line in content.split(b"\n"):
        if line.startswith(b"A "):
            parts = line.split(b" ", 3)
            if len(parts) == 4 and parts[3]:
                pending[parts[1].decode()] = Entry(parts[2].decode(), parts[3])
        elif line.startswith(b"D "):
            pending.pop(line[2:].decode(), None)
    return pending


class Wal:
    """This process's write-ahead file in ``directory``.

    Appends go to the OS at once (they survive a process crash, SIGKILL included);
    ``fsync=True`` also makes each one survive power loss, at a cost per record.
    """

    def __init__(self, directory: str | os.PathLike[str], *, fsync: bool = False) -> None:
        self.directory = Path(directory)
        self.fsync = fsync
        self.path: Path | None = None
        self.size = 0
        """Bytes in the current file (compaction is decided on it)."""
        self._fd: int | None = None

    @property
    def is_open(self) -> bool:
        return self._fd is not None

    def open(self) -> dict[str, Entry]:
        """Create and lock this process's file, adopt the files of dead processes; returns
        the pending records adopted (already copied into the new file, durably)."""
        path = self.directory / f"acks-{os.getpid()}-{secrets.token_hex(3)}.wal"
        for attempt in range(3):
            self.directory.mkdir(parents=True, exist_ok=True)
            try:
                self._fd, self.path, self.size = _locked(path, os.O_CREAT), path, 0
                break
            except FileNotFoundError:  # another process's close() took the empty dir away
                if attempt == 2:
                    raise
        adopted: dict[str, Entry] = {}
        for orphan in sorted(self.directory.glob("acks-*.wal")):
            if orphan != path:
                self._adopt(orphan, adopted)
        return adopted

    def add(self, msg_id: str, subject: str, data: bytes) -> Entry:
        """Append one record (durable in the OS on return); returns it as the log keeps it."""
        record = entry(subject, data)
        self._append(added(msg_id, record))
        return record

    def mark_stored(self, msg_ids: Iterable[str]) -> None:
        self._append(stored(msg_ids))

    def compact(self, pending: Mapping[str, Entry]) -> None:
        """Rewrite the file with only the ``pending`` records (atomically: write, fsync,
        rename over the old one)."""
        assert self.path is not None and self._fd is not None
        tmp = self.path.with_suffix(".tmp")
        fd = _locked(tmp, os.O_CREAT | os.O_TRUNC)
        content = b"".join(added(msg_id, e) for msg_id, e in pending.items())
        os.write(fd, content)
        os.fsync(fd)
        os.replace(tmp, self.path)
        os.close(self._fd)
        self._fd, self.size = fd, len(content)

    def close(self, *, remove: bool) -> None:
        """Release the file (and its lock); ``remove`` deletes it (nothing is pending), and
        the directory too when nothing else is left in it (a clean drain leaves no trace; a
        file of another process of the agent, or anything else there, keeps it)."""
        if self._fd is None:
            return
        os.close(self._fd)
        self._fd = None
        if remove and self.path is not None:
            try:
                self.path.unlink()
            except OSError:
                pass
            with contextlib.suppress(OSError):  # not empty: someone else's, kept
                self.directory.rmdir()

    def _append(self, line: bytes) -> None:
        if self._fd is None:
            raise RuntimeError("write-ahead log used before open()")
        os.write(self._fd, line)
        self.size += len(line)
        if self.fsync:
            os.fsync(self._fd)

    def _adopt(self, orphan: Path, adopted: dict[str, Entry]) -> None:
        """Copy the pending lines of a file no live process holds into ours, then remove it."""
        try:
            fd = os.open(orphan, os.O_RDONLY)
        except OSError:
            return
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                return  # a live writer (another process of this agent) owns it
            with os.fdopen(os.dup(fd), "rb") as f:
                pending = parse(f.read())
            for msg_id, record in pending.items():
                if msg_id not in adopted:
                    self._append(added(msg_id, record))
                    adopted[msg_id] = record
            if self._fd is not None and not self.fsync:
                os.fsync(self._fd)  # the copy is durable before the original goes
            orphan.unlink()
        finally:
            os.close(fd)


def _locked(path: Path, flags: int) -> int:
    """Open ``path`` for appending and take its exclusive lock (raises if another holds it)."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | flags, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    return fd
