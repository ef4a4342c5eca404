"""The console's per-capability charts, in bounded memory: route requests per second and call
latency (p50, p99) over the last 15 minutes.

Pure (no I/O; times are arguments). Time is cut into :data:`BUCKET_S` buckets, the last
:data:`BUCKETS` kept in a ring per capability (a bucket's slot is reused, and zeroed, when
its time comes round again). Per bucket: the route requests answered (the broker's
per-capability counts, read on the console's sample tick: nothing per request here) and a
latency histogram of :data:`BINS` log-spaced bins (x :data:`BIN_RATIO` each, from 1 ms), from
the agents' ack records (``received`` → ``completed``/``failed``: the time an agent held the
task). A capability is about ``BUCKETS * (BINS + 2) * 4`` bytes (about 10 KiB); at most
:data:`MAX_CAPABILITIES` are charted (later ones are counted, not kept), and at most
:data:`PENDING_MAX` calls are timed at once: past that, a call whose ``received`` record finds
no room is not timed (a sample of the others is), so a large fleet costs the same memory and
O(1) work per ack record. The pending calls outlive the feed's follows of the records: a
``received`` read by one follow (or by the stored records read when a follow starts) is paired
with its final record read by the next. A record older than what its slot holds now (before
the window: :func:`window_start_ms`) is not charted (counted in ``stale``), so a late record
never wipes a newer bucket.
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Mapping

import msgspec

BUCKET_S = 15
"""Seconds per bucket."""
BUCKETS = 60
"""Buckets kept: 15 minutes."""
BINS = 40
"""Latency histogram bins per bucket."""
BIN_RATIO = 1.5
"""Each bin's upper bound is this times the previous one's (the first ends at 1 ms; the last
holds everything above ~2.6 hours)."""
MAX_CAPABILITIES = 256
PENDING_MAX = 20_000

_LOG_RATIO = math.log(BIN_RATIO)


def first_bucket(wall_ms: int) -> int:
    """The oldest of the :data:`BUCKETS` buckets the charts show at ``wall_ms``."""
    return wall_ms // (BUCKET_S * 1000) - BUCKETS + 1


def window_start_ms(wall_ms: int) -> int:
    """Where the charts begin at ``wall_ms``: the start of :func:`first_bucket` (the stored
    records a follow reads from)."""
    return first_bucket(wall_ms) * BUCKET_S * 1000


def bin_of(ms: float) -> int:
    """The histogram bin of a latency of ``ms`` milliseconds."""
    if ms <= 1.0:
        return 0
    return min(BINS - 1, 1 + int(math.log(ms) / _LOG_RATIO))


def bin_ms(i: int) -> float:
    """A bin's representative latency: the geometric middle of its bounds."""
    if i == 0:
        return 1.0
    return BIN_RATIO ** (i - 0.5)


class CapabilityChart(msgspec.Struct):
    """One capability's buckets, oldest first: where nothing happened the rate is 0 and the
    latencies ``None``."""

    capability: str
    bucket_s: int
    at_ms: list[int]
    """Each bucket's start."""
    routes_per_s: list[float]
    calls: list[int]
    """Calls timed (final ack records matched to their ``received``)."""
    p50_ms: list[float | None]
    p99_ms: list[float | None]


class ChartIndex(msgspec.Struct):
    """What can be charted: each capability with its route requests in the window, busiest
    first; ``untracked``: capabilities seen beyond :data:`MAX_CAPABILITIES`."""

    capabilities: list[tuple[str, int]]
    untracked: int = 0


class _Ring:
    __slots__ = ("epoch", "hist", "routes")

    def __init__(self) -> None:
        self.epoch = array("q", [-1]) * BUCKETS
        """Each slot's bucket number (-1: never used)."""
        self.routes = array("I", [0]) * BUCKETS
        self.hist = array("I", [0]) * (BUCKETS * BINS)

    def slot(self, bucket: int) -> int:
        """The slot of bucket number ``bucket``, zeroed when it held an older one."""
        pos = bucket % BUCKETS
        if self.epoch[pos] != bucket:
            self.epoch[pos] = bucket
            self.routes[pos] = 0
            base = pos * BINS
            self.hist[base : base + BINS] = array("I", [0]) * BINS
        return pos


class CapabilitySeries:
    """Per capability: route rates and call latencies, bucketed."""

    def __init__(self) -> None:
        self.rings: dict[str, _Ring] = {}
        self.untracked: set[str] = set()
        self._last_counts: dict[str, int] = {}
        self._primed = False
        """Whether the counts were read once (that first read is the baseline)."""
        self._pending: dict[str, tuple[str, int]] = {}
        """request id → (capability, ``received`` at_ms), insertion-ordered."""
        self.stale = 0
        """Final records not charted: older than the bucket their slot holds now."""

    def _ring(self, capability: str) -> _Ring | None:
        ring = self.rings.get(capability)
        if ring is None:
            if len(self.rings) >= MAX_CAPABILITIES:
                if len(self.untracked) < 100_000:
                    self.untracked.add(capability)
                return None
            ring = self.rings[capability] = _Ring()
        return ring

    # --- inputs --------------------------------------------------------------------------------

    def routes(self, counts: Mapping[str, int], wall_ms: int) -> None:
        """The broker's cumulative route requests per capability, read now: what came since
        the last read goes to the current bucket. O(capabilities) per read."""
        bucket = wall_ms // (BUCKET_S * 1000)
        last = self._last_counts
        first_read = not self._primed
        self._primed = True
        for capability, n in counts.items():
            seen = last.get(capability, 0)
            last[capability] = n
            if first_read:  # what came before the console started is not charted
                continue
            if n > seen and (ring := self._ring(capability)) is not None:
                ring.routes[ring.slot(bucket)] += n - seen

    def ack(
        self, request_id: str, capability: str, state: str, at_ms: int,
        received_ms: int | None = None,
    ) -> None:  # fmt: skip
        """An agent's ack record: a ``received`` starts timing the call (when there is
        room), its ``completed`` or ``failed`` ends it (or times it alone: a final record
        its ``received`` was folded into carries ``received_ms``). O(1)."""
        if state == "received":
            if request_id not in self._pending and len(self._pending) < PENDING_MAX:
                self._pending[request_id] = (capability, at_ms)
            return
        started = self._pending.pop(request_id, None)
        if started is None and received_ms is not None:
            started = (capability, received_ms)
        if started is None or started[0] != capability or at_ms < started[1]:
            return
        ring = self._ring(capability)
        if ring is None:
            return
        bucket = at_ms // (BUCKET_S * 1000)
        if ring.epoch[bucket % BUCKETS] > bucket:  # 15 minutes old or more: not a slot's
            self.stale += 1
            return
        pos = ring.slot(bucket)
        ring.hist[pos * BINS + bin_of(at_ms - started[1])] += 1

    def expire(self, wall_ms: int, older_than_s: float = BUCKET_S * BUCKETS) -> None:
        """Forget calls received longer ago than the window (their end never came)."""
        cutoff = wall_ms - older_than_s * 1000
        pending = self._pending
        while pending:
            rid = next(iter(pending))
            if pending[rid][1] >= cutoff:
                break
            del pending[rid]

    # --- views ---------------------------------------------------------------------------------

    def index(self, wall_ms: int) -> ChartIndex:
        first = first_bucket(wall_ms)
        rows = []
        for capability, ring in self.rings.items():
            total = sum(ring.routes[p] for p in range(BUCKETS) if ring.epoch[p] >= first)
            rows.append((capability, total))
        rows.sort(key=lambda r: (-r[1], r[0]))
        return ChartIndex(capabilities=rows, untracked=len(self.untracked))

    def chart(self, capability: str, wall_ms: int) -> CapabilityChart | None:
        """The last 15 minutes of ``capability`` (None when it is not charted)."""
        ring = self.rings.get(capability)
        if ring is None:
            return None
        now_bucket = wall_ms // (BUCKET_S * 1000)
        out = CapabilityChart(capability=capability, bucket_s=BUCKET_S, at_ms=[],
                              routes_per_s=[], calls=[], p50_ms=[], p99_ms=[])  # fmt: skip
        for bucket in range(first_bucket(wall_ms), now_bucket + 1):
            pos = bucket % BUCKETS
            start_ms = bucket * BUCKET_S * 1000
            out.at_ms.append(start_ms)
            if ring.epoch[pos] != bucket:
                out.routes_per_s.append(0.0)
                out.calls.append(0)
                out.p50_ms.append(None)
                out.p99_ms.append(None)
                continue
            # The current bucket is partly gone by: its rate over the time it has had.
            span_s = BUCKET_S if bucket < now_bucket else max(1.0, (wall_ms - start_ms) / 1000)
            out.routes_per_s.append(round(ring.routes[pos] / span_s, 3))
            hist = ring.hist[pos * BINS : (pos + 1) * BINS]
            n = sum(hist)
            out.calls.append(n)
            out.p50_ms.append(_quantile(hist, n, 0.50))
            out.p99_ms.append(_quantile(hist, n, 0.99))
        return out


def _quantile(hist: array[int], n: int, q: float) -> float | None:
    if n == 0:
        return None
    rank = max(1, math.ceil(q * n))
    seen = 0
    for i, count in enumerate(hist):
        seen += count
        if seen >= rank:
            return round(bin_ms(i), 1)
    return round(bin_ms(BINS - 1), 1)
