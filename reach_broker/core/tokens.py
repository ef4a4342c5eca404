"""Agent tokens: an HMAC over ``agent_id`` and an epoch, verifiable by every replica.

``v1.<epoch>.<mac>`` where ``epoch`` is the wall-clock second the token was issued. Every
announce issues a fresh token (rotation); a token is accepted until ``max_age_s`` after its
epoch, so an agent keeps working across broker restarts and replicas without re-announcing.

The broker builds its signer before it knows the secret (the replicas share one through
JetStream KV, read at start) and keys it with :meth:`TokenSigner.set_secret` then.
"""

from __future__ import annotations

import hashlib
import hmac
import time
from collections.abc import Callable


class TokenSigner:
    def __init__(
        self, secret: bytes, max_age_s: float, wall: Callable[[], float] = time.time
    ) -> None:
        self._secret = secret
        self._max_age_s = max_age_s
        self._wall = wall

    def set_secret(self, secret: bytes) -> None:
        """Key the signer (at broker start); tokens of an earlier secret stop verifying."""
        if not secret:
            raise ValueError("the token secret must not be empty")
        self._secret = secret

    def _mac(self, agent_id: str, epoch: int) -> str:
        if not self._secret:
            raise RuntimeError("token signer has no secret yet (the broker sets it at start)")
        msg = f"{agent_id}.{epoch}".encode()
        return hmac.new(self._secret, msg, hashlib.sha256).hexdigest()[:32]

    def issue(self, agent_id: str) -> str:
        epoch = int(self._wall())
        return f"v1.{epoch}.{self._mac(agent_id, epoch)}"

    def verify(self, agent_id: str, token: str) -> bool:
        parts = token.split(".")
        if len(parts) != 3 or parts[0] != "v1" or not parts[1].isdigit():
            return False
        epoch = int(parts[1])
        age = self._wall() - epoch
        if age > self._max_age_s or age < -300:  # 5 min of clock skew between replicas
            return False
        return hmac.compare_digest(parts[2], self._mac(agent_id, epoch))
