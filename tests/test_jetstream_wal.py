"""The ack write-ahead log (jetstream/wal.py): its line format, adoption and compaction.
Files only (a temp dir); the sending side is tested against a real server in
test_jetstream_assets.py."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

from jetstream import wal


def test_lines_round_trip_and_a_torn_last_line_is_ignored() -> None:
    a = wal.entry("reach.ack.r1", b'{"x":\n1}')
    assert a == wal.Entry("reach.ack.r1", b'{"x": 1}')  # one record, one line
    b = wal.entry("reach.ack.r2", b"{}")
    content = (
        wal.added("r1.received", a)
        + wal.added("r2.completed", b)
        + wal.stored(["r1.received"])
        + b"A r3.completed reach.ack.r3"  # a crash mid-write: no data
    )
    assert content.startswith(b'A r1.received reach.ack.r1 {"x": 1}\nA r2.completed ')
    assert wal.parse(content) == {"r2.completed": b}


def test_open_adopts_the_files_of_dead_processes_but_not_of_live_ones(tmp_path: Path) -> None:
    dead = tmp_path / "acks-1-dead.wal"
    dead.write_bytes(
        wal.added("d1.completed", wal.entry("reach.ack.d1", b"{}"))
        + wal.added("d2.completed", wal.entry("reach.ack.d2", b"{}"))
        + wal.stored(["d2.completed"])
    )
    live = tmp_path / "acks-2-live.wal"
    live.write_bytes(wal.added("l1.completed", wal.entry("reach.ack.l1", b"{}")))
    fd = os.open(live, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # another process of this agent
    try:
        log = wal.Wal(tmp_path)
        adopted = log.open()
        assert adopted == {"d1.completed": wal.Entry("reach.ack.d1", b"{}")}
        assert not dead.exists() and live.exists()
        assert log.path is not None
        assert wal.parse(log.path.read_bytes()) == adopted  # copied into the new file
        log.close(remove=False)
    finally:
        os.close(fd)


def test_compact_keeps_only_pending_records_and_close_removes_an_empty_log(
    tmp_path: Path,
) -> None:
    log = wal.Wal(tmp_path)
    assert log.open() == {}
    kept = log.add("k.completed", "reach.ack.k", b"{}")
    log.add("s.completed", "reach.ack.s", b"{}")
    log.mark_stored(["s.completed"])
    log.compact({"k.completed": kept})
    assert log.path is not None
    assert log.path.read_bytes() == wal.added("k.completed", kept)
    assert log.size == len(wal.added("k.completed", kept))
    path = log.path
    log.close(remove=True)
    assert not path.exists()
