"""The hashes routing decides with, the same at a broker and at a caller (docs/protocol.md,
"Sticky keys"): :func:`hash64` of a text, and :func:`rendezvous`, the weight of an agent for
a sticky key (highest random weight: the key goes to the member weighing most).

Rendezvous hashing keeps one 64-bit hash per agent (its id's, computed once) where a
consistent-hash ring kept ``vnodes`` points per agent and rebuilt them all on every
membership change; a key still stays with its agent while the members stay, and when one
leaves only the keys it held move (each to its own next-heaviest member).
"""

from __future__ import annotations

import hashlib

M64 = (1 << 64) - 1


def hash64(text: str) -> int:
    """The first 8 bytes of BLAKE2b (8-byte digest) of ``text``'s UTF-8, big-endian."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")


FIBONACCI = 0x9E3779B97F4A7C15
"""2^64 / the golden ratio, odd: multiplying by it modulo 2^64 spreads every bit of a value
into the high bits (Fibonacci hashing)."""


def rendezvous(agent_hash: int, key_hash: int) -> int:
    """An agent's weight for a key: ``(agent_hash XOR key_hash) * FIBONACCI mod 2^64`` (both
    :func:`hash64`s). The same agent and key always weigh the same, so a key's heaviest member
    stays its heaviest while it is a member; over keys, each member is the heaviest as often
    as any other. (:meth:`reach_agent.routing.index.CapabilityIndex.heaviest` computes it
    inline: one call less per member.)"""
    return ((agent_hash ^ key_hash) * FIBONACCI) & M64
