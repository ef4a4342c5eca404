"""An agent's connection as the server sees it: whether its credential may serve the agent
(checked before connecting), the permission violations and slow-consumer errors the server
reports, a close for good (revoked, expired), and a reconnect (re-announce).

Its own module because it is what the NATS connection's callbacks tell, apart from the
agent's lifecycle (:mod:`reach_agent.agent.agent`), which hands it what it reads.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from typing import Any

from nats.aio.client import Client as NATS
from nats.errors import SlowConsumerError

from reach_agent import grants
from reach_agent.connection import Credentials, credential_grants
from reach_agent.metrics import AgentMetrics
from reach_agent.wire.errors import Forbidden
from reach_agent.wire.subjects import Subjects

log = logging.getLogger(__name__)


class ConnectionWatch:
    """The callbacks of one agent's connection (:meth:`callbacks`) and its grants check."""

    def __init__(
        self,
        agent_id: str,
        subjects: Subjects,
        metrics: AgentMetrics | None,
        serving: Callable[[], bool],
        reannounce: Callable[[], None],
    ) -> None:
        self.agent_id = agent_id
        self.subjects = subjects
        self.metrics = metrics
        self.serving = serving
        """Whether the agent is started (a close or disconnect after stop() is our own)."""
        self.reannounce = reannounce
        self.nc: NATS | None = None
        self.creds_file: str | None = None
        self.violations: list[grants.Violation] = []
        self.takes_cancels = True
        """Whether the credential allows subscribing to the agent's cancel subject (one
        issued before cancellation existed does not: cancels are then not received)."""
        self.closed = asyncio.Event()
        """Set when the server closed the connection for good while serving (the credential
        was revoked or expired): :func:`reach_agent.run` then exits."""
        self.closed_reason = ""

    def callbacks(self) -> dict[str, Any]:
        """The connect options that route the connection's callbacks here."""
        return {"error_cb": self._on_error, "disconnected_cb": self._on_disconnected,
                "reconnected_cb": self._on_reconnected, "closed_cb": self._on_closed}  # fmt: skip

    def check_grants(
        self, cred: Credentials, capabilities: Sequence[str], *, writes_acks: bool
    ) -> None:
        """Fail now, naming the subject and the file, when the credentials cannot serve
        this agent (a credential issued for another agent id, a caller's)."""
        self.takes_cancels = True
        found = credential_grants(cred)
        if found is None:
            return
        self.creds_file, allowed = found
        s, me = self.subjects, self.agent_id
        if not allowed.may_subscribe(s.cancel(me)):
            self.takes_cancels = False
            log.warning("agent.cancels_off agent=%s creds=%s: the credential predates "
                        "cancellation (it does not allow subscribing to %r): cancels of its "
                        "requests are not received; re-issue it (`reach auth agent`)", me,
                        self.creds_file, s.cancel(me))  # fmt: skip
        publish = [s.announce(me), s.heartbeat(me), s.leave(me)]
        if writes_acks:
            publish.append(s.ack(me, "request"))
        subscribe = [s.probe(me), s.reannounce(me),
                     *(s.task(me, cap) for cap in capabilities)]  # fmt: skip
        try:
            grants.check(allowed, self.creds_file, publish=publish, subscribe=subscribe)
        except grants.GrantError as exc:
            raise Forbidden(f"agent {me!r}: {exc}") from None

    def check_subscriptions(self) -> None:
        """After the subscriptions' flush: a SUB the server refused is a start error."""
        refused = [v for v in self.violations if v.action == "subscription"]
        if refused:
            raise Forbidden(f"the server refused subscribing to {refused[0].subject!r} with "
                            f"credentials {self.creds_file or '(none)'}: issue agent "
                            f"{self.agent_id!r} its own credentials")  # fmt: skip

    async def _on_error(self, exc: Exception) -> None:
        violation = grants.violation_of(exc)
        kind = ("slow_consumer" if isinstance(exc, SlowConsumerError) else
                "permission" if violation else type(exc).__name__)  # fmt: skip
        if self.metrics is not None:
            self.metrics.nats_errors.labels(kind).inc()
        if isinstance(exc, SlowConsumerError):
            log.warning("agent.slow_consumer agent=%s subject=%s", self.agent_id, exc.subject)
        elif violation is not None:
            self.violations.append(violation)
            del self.violations[:-16]
            log.error("agent.permission_denied agent=%s action=%s subject=%s creds=%s",
                      self.agent_id, violation.action, violation.subject,
                      self.creds_file)  # fmt: skip
        else:
            log.debug("agent.nats_error agent=%s error=%r", self.agent_id, exc)

    async def _on_closed(self) -> None:
        if not self.serving():  # our own stop
            return
        err = self.nc.last_error if self.nc is not None else None
        self.closed_reason = str(err or "closed by the server")
        if "revoked" in self.closed_reason.lower():
            log.error("agent.revoked agent=%s creds=%s: the server closed the connection and "
                      "refuses this credential", self.agent_id, self.creds_file)  # fmt: skip
        else:
            log.error("agent.closed agent=%s error=%s: the connection will not come back",
                      self.agent_id, self.closed_reason)  # fmt: skip
        self.closed.set()

    async def _on_disconnected(self) -> None:
        if self.serving():  # not the close at the end of stop()
            log.info("agent.disconnected agent=%s", self.agent_id)

    async def _on_reconnected(self) -> None:
        log.info("agent.reconnected agent=%s: re-announcing", self.agent_id)
        self.reannounce()
