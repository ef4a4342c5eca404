"""The hashes routing decides with, the same at a broker and at a caller (docs/protocol.md,
"Sticky keys"): :func:`hash64` of a text, :func:`slot_hash`, the hash a sticky key is weighed
by (its slot's: one of :data:`SLOTS`), and :func:`rendezvous`, the weight of an agent for it
(highest random weight: the key goes to the member weighing most), computed for many agents
at once by :class:`Lanes`.

Rendezvous hashing keeps one 64-bit hash per agent (its id's, computed once) where a
consistent-hash ring kept ``vnodes`` points per agent and rebuilt them all on every
membership change; a key still stays with its agent while the members stay, and when one
leaves only the keys it held move (each to its own next-heaviest member). Weighing the key's
slot instead of the key itself bounds what a capability has to remember to answer any key
without weighing its members: the heaviest members of each of :data:`SLOTS` slots
(:class:`reach_agent.routing.index.CapabilityIndex`).
"""

from __future__ import annotations

import hashlib
import sys
from array import array

M64 = (1 << 64) - 1


def hash64(text: str) -> int:
    """The first 8 bytes of BLAKE2b (8-byte digest) of ``text``'s UTF-8, big-endian."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")


SLOT_BITS = 12
SLOTS = 1 << SLOT_BITS
"""Sticky keys hash into 4,096 slots: a key's slot is the top 12 bits of its :func:`hash64`
(the low bits give a split rule's arm, :mod:`reach_agent.routing.rules`, so arm and slot
are independent). Every key of a slot has the same owner; a member owns about
``SLOTS / members`` slots, so keys spread evenly over up to a few hundred members of a
capability, coarser beyond (at 4,096 members and more, some own no slot)."""

SLOT_HASHES = [hash64(str(s)) for s in range(SLOTS)]
"""Each slot's hash: :func:`hash64` of its number in decimal (``"0"`` … ``"4095"``)."""


def slot_of(key: str) -> int:
    """The slot of the sticky ``key``: the top :data:`SLOT_BITS` bits of its hash64."""
    return hash64(key) >> (64 - SLOT_BITS)


def slot_hash(key: str) -> int:
    """What the sticky ``key`` is weighed by: the hash64 of its slot's number in decimal."""
    return SLOT_HASHES[hash64(key) >> (64 - SLOT_BITS)]


FIBONACCI = 0x9E3779B97F4A7C15
"""2^64 / the golden ratio, odd: multiplying by it modulo 2^64 spreads every bit of a value
into the high bits (Fibonacci hashing)."""


def rendezvous(agent_hash: int, key_hash: int) -> int:
    """An agent's weight for a key: ``(agent_hash XOR key_hash) * FIBONACCI mod 2^64`` (the
    agent id's :func:`hash64`, the key's :func:`slot_hash`). The same agent and key always
    weigh the same, so a key's heaviest member stays its heaviest while it is a member; over
    keys, each member is the heaviest as often as any other.
    (:class:`reach_agent.routing.index.CapabilityIndex` computes it inline: one call less
    per member.)"""
    return ((agent_hash ^ key_hash) * FIBONACCI) & M64


class Lanes:
    """Many agents' hashes packed into one integer, 128 bits a lane, so that their weights for
    a key are computed at once by a few big-integer operations (C speed) instead of a Python
    loop: ``rendezvous(h, k)`` for every ``h``, in order. A 64-bit weight times FIBONACCI
    fits its 128-bit lane, so no lane spills into the next."""

    __slots__ = ("_mask", "_ones", "_packed", "n")

    def __init__(self, hashes: list[int]) -> None:
        self.n = n = len(hashes)
        self._packed = int.from_bytes(b"".join(h.to_bytes(16, "little") for h in hashes), "little")
        self._ones = int.from_bytes(_ONE_LANE * n, "little")
        self._mask = int.from_bytes(_MASK_LANE * n, "little")

    def weights(self, key_hash: int) -> list[int]:
        """``[rendezvous(h, key_hash) for h in hashes]``."""
        lanes = ((self._packed ^ (key_hash * self._ones)) * FIBONACCI) & self._mask
        words = array("Q", lanes.to_bytes(16 * self.n, "little"))
        if _BIG:
            words.byteswap()
        return words[::2].tolist()  # each lane's low 64 bits: its weight

    def at_least(self, key_hash: int, floors: int) -> list[int]:
        """The lanes whose weight for ``key_hash`` is at least their floor, in order:
        ``[i for i, h in enumerate(hashes) if rendezvous(h, key_hash) >= floor[i]]``,
        ``floors`` packed as the hashes are (one per 128-bit lane, each at most
        :data:`NEVER`, which no weight reaches). Computed by big-integer operations: the
        Python loop runs only over the lanes found."""
        lanes = ((self._packed ^ (key_hash * self._ones)) * FIBONACCI) & self._mask
        # 2^66 + weight - floor per lane: positive (no borrow from the next lane), and its
        # bit 66 is set exactly when weight >= floor.
        bits = (((lanes + (self._ones << 66)) - floors) >> 66) & self._ones
        data = bits.to_bytes(16 * self.n, "little")
        found = []
        i = data.find(1)
        while i >= 0:
            found.append(i >> 4)
            i = data.find(1, i + 16)
        return found


NEVER = 1 << 65
"""A floor of :meth:`Lanes.at_least` that no weight (< 2^64) reaches."""

_ONE_LANE = (1).to_bytes(16, "little")
_MASK_LANE = M64.to_bytes(16, "little")
_BIG = sys.byteorder == "big"


SLOT_LANES = Lanes(SLOT_HASHES)
"""Every slot's hash packed: ``SLOT_LANES.weights(agent_hash)`` is the agent's weight for
each slot, in slot order (rendezvous is symmetric in its two hashes)."""
