"""The broker process's heap, kept out of the garbage collector's full collections.

A broker holds some tens of tracked objects an agent (its record, arrival window, announce,
table entry, snapshot memory...). CPython's collector walks every tracked object at each full
(generation 2) collection, which comes whenever the objects that survived collections have
grown by a quarter since the last full one: while a fleet registers, or partitions are taken
over, the event loop stops for a walk of the whole heap each time, longer as the fleet grows
(25,000 agents announcing to one broker: 26 ms at first, 160 ms by the end; no route answered
meanwhile, and on a machine shared by four brokers each stop lasts four times as long).

So the survivors of every full collection are frozen (:func:`gc.freeze`): the next full
collection walks only what came since (11-43 ms in the same registration). The freeze runs
on the event loop right after the collection (scheduled from the collector's callback), and
the process's heap is given back to the collector when the process stops serving.

What it costs: a reference cycle that is alive at a freeze and becomes garbage later is not
collected (objects freed by their reference count, nearly all of a broker's, are freed as
before); and a freeze happens only after a full collection, which a fleet that no longer grows
does not cause. Installed by the broker process (:func:`reach_broker.process.serve`), never by
a :class:`~reach_broker.broker.Broker`: it is the whole process's.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
from collections.abc import Iterator
from typing import Any

log = logging.getLogger(__name__)


class FrozenHeap:
    """Freezes what survives each full collection, while installed on an event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.freezes = 0
        """Freezes so far."""

    @contextlib.contextmanager
    def installed(self) -> Iterator[FrozenHeap]:
        """Freeze after every full collection until the block ends; then every object is
        the collector's again (:func:`gc.unfreeze`)."""
        gc.callbacks.append(self._collected)
        try:
            yield self
        finally:
            gc.callbacks.remove(self._collected)
            gc.unfreeze()

    def _collected(self, phase: str, info: dict[str, Any]) -> None:
        """The collector's callback (any thread): after a full collection, a freeze."""
        if phase != "stop" or info["generation"] != 2:
            return
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile: nothing to keep
            self.loop.call_soon_threadsafe(self._freeze)

    def _freeze(self) -> None:
        gc.freeze()  # a splice of the collector's lists: microseconds, whatever the heap
        self.freezes += 1
        # Never gc.get_freeze_count() here: it walks every frozen object (20 ms per 3 million
        # on this machine), and, evaluated for a debug line nobody printed, it was each stall
        # of the loop while 25,000 agents announced at once (28 of 40-115 ms each, asyncio's
        # slow-callback log in `python -m loadtest.stallcost --in-flight 25000`).
        log.debug("heap.frozen freezes=%d", self.freezes)
