"""The broker process's frozen heap (reach_broker/heap.py): what survives a full garbage
collection is frozen out of the next ones, and given back when the process stops serving."""

from __future__ import annotations

import asyncio
import gc
import logging
import sys

import pytest

from reach_broker.heap import FrozenHeap

from .conftest import wait_for


async def test_what_survives_a_full_collection_is_frozen_until_the_heap_is_given_back() -> None:
    heap = FrozenHeap(asyncio.get_running_loop())
    kept = [[i] for i in range(10_000)]  # tracked and long-lived, as a fleet's records are
    assert gc.get_freeze_count() == 0
    gc.disable()  # the test's collections only (the callbacks run for explicit ones too)
    try:
        await frozen_until_given_back(heap, kept)
    finally:
        gc.enable()
    assert heap._collected not in gc.callbacks
    assert gc.get_freeze_count() == 0  # the collector's again
    assert any(obj is kept for obj in gc.get_objects(generation=2))


async def frozen_until_given_back(heap: FrozenHeap, kept: list[list[int]]) -> None:
    with heap.installed():
        assert heap._collected in gc.callbacks
        gc.collect(1)  # not a full collection: nothing to freeze
        gc.collect(2)
        await wait_for(lambda: heap.freezes == 1, what="the freeze after the full collection")
        frozen = gc.get_freeze_count()
        assert frozen >= len(kept) + 1
        assert not any(obj is kept for obj in gc.get_objects(generation=2))  # walked no more
        gc.collect(2)
        await wait_for(lambda: heap.freezes == 2, what="the freeze after the next one")
        assert gc.get_freeze_count() >= frozen


def test_a_freeze_never_counts_the_frozen_heap(caplog: pytest.LogCaptureFixture) -> None:
    """``gc.get_freeze_count()`` walks every frozen object: evaluated for the freeze's debug
    line (printed or not), it was each stall of a broker's loop while a fleet registered
    (tens of milliseconds per freeze at 25,000 agents, growing with the heap). The freeze
    calls ``gc.freeze`` and never the count, even with its debug line printed."""
    heap = FrozenHeap(asyncio.new_event_loop())
    called: list[object] = []

    def profile(frame: object, event: str, arg: object) -> None:
        if event == "c_call":
            called.append(arg)

    caplog.set_level(logging.DEBUG, logger="reach_broker.heap")
    sys.setprofile(profile)
    try:
        heap._freeze()
    finally:
        sys.setprofile(None)
        gc.unfreeze()
        heap.loop.close()
    assert gc.freeze in called
    assert gc.get_freeze_count not in called
    assert [r.getMessage() for r in caplog.records] == ["heap.frozen freezes=1"]
