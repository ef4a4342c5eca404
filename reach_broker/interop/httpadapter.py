"""An HTTP agent made a reach agent by a sidecar (``reach adapt http``).

The sidecar is a :class:`reach_agent.Agent` (announce, heartbeats, probes, admission, claims,
the duplicate window) whose one handler forwards each task on ``<p>.task.<agent_id>.<cap>``
to the agent's URL as an HTTP POST:

* body: the task's payload as JSON (``Content-Type: application/json``); headers
  ``Reach-Request-Id``, ``Reach-Timeout-Ms`` (the time left) and ``traceparent`` when the
  task carries one; the request times out with the task's deadline;
* answer (:func:`error_of`): 2xx → the result (the response's JSON, or its text when it is
  not JSON; ``null`` for an empty body); 429/503 → ``TARGET_BUSY``; other 4xx →
  ``BIZ_REJECT``; anything else (5xx, a redirect), a timeout or a refused connection →
  ``TIMEOUT`` (retryable: the caller tries another agent, the claim is handed back);
* ``active`` is the sidecar's own count of forwarded requests in flight (the SDK's);
  ``--max-concurrency`` caps it (the SDK answers ``TARGET_BUSY`` beyond);
* the backend is checked every second (:meth:`HttpAdapter.ready`, the agent's readiness
  check): with ``--health URL`` a GET answered 2xx within ``HEALTH_TIMEOUT_S``; without one,
  the calls that ended since the last check (an HTTP answer of any status: up; only refused
  or unreachable connections: down) or, when there were none, a TCP connection to the URL's
  host and port. A backend found down makes the sidecar report ``draining`` in a heartbeat
  sent at once, so brokers take it out of the routes within the second, and announce again
  once it answers (see :mod:`reach_agent.agent.presence`);
* a request id runs once: the fleet-wide claim and the duplicate window of the SDK answer a
  repeat with the first result, never a second POST.

The HTTP client is httpx (the optional extra ``nats-reach[http]``): well kept, async with a
connection pool, per-request timeouts, and no event-loop plumbing of its own.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any
from urllib.parse import urlsplit

import msgspec

from reach_agent import Agent, Task
from reach_agent.wire.errors import BizReject, ReachError, TargetBusy, Timeout

log = logging.getLogger(__name__)

HEALTH_TIMEOUT_S = 0.5
"""A health check (the GET, or the TCP connection) slower than this fails: with the check
every second, a backend that hangs is out of the routes within 1.5 s."""
DEFAULT_TIMEOUT_S = 60.0
"""How long a POST may take when the task carries no deadline."""
TRACEPARENT = "traceparent"

_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder()


def missing_extra() -> str | None:
    """Why the sidecar cannot run here (httpx not installed), else None."""
    try:
        import httpx  # noqa: F401
    except ImportError:
        return "reach adapt http needs httpx: pip install 'nats-reach[http]'"
    return None


def error_of(status: int, message: str) -> ReachError:
    """The reach error of a non-2xx HTTP status."""
    if status in (429, 503):
        return TargetBusy(message)
    if 400 <= status < 500:
        return BizReject(message)
    return Timeout(message)


class HttpAdapter:
    """One HTTP agent behind one sidecar: ``await start(servers)``, ``await stop()``."""

    def __init__(
        self,
        agent_id: str,
        capability: str,
        url: str,
        *,
        health_url: str | None = None,
        max_concurrency: int = 8,
        timeout_hint_ms: int | None = None,
        heartbeat_interval: float = 5.0,
        **agent_options: Any,
    ) -> None:
        import httpx

        self.url = url
        self.health_url = health_url
        self.posts = 0
        """HTTP requests sent to ``url`` (tests count them)."""
        self._answered = 0  # calls since the last check that got an HTTP answer (any status)
        self._unreached = 0  # ... that found no backend (connection refused, unreachable)
        parts = urlsplit(url)
        self._address = (parts.hostname or "127.0.0.1",
                         parts.port or (443 if parts.scheme == "https" else 80))  # fmt: skip
        self.agent = Agent(
            agent_id, [capability], max_concurrency, agent_type="http",
            timeout_hint=timeout_hint_ms / 1000 if timeout_hint_ms else None,
            heartbeat_interval=heartbeat_interval, metadata={"url": url},
            readiness=self.ready, **agent_options,
        )  # fmt: skip
        self.agent.handler(capability)(self.forward)
        self.http = httpx.AsyncClient(
            limits=httpx.Limits(max_connections=max_concurrency, max_keepalive_connections=64)
        )

    async def start(
        self, servers: str | list[str] | None = None, *, stop: asyncio.Event | None = None
    ) -> None:
        """Serve as the agent (see :meth:`reach_agent.Agent.start`: ``stop`` ends the wait
        for a first server)."""
        await self.agent.start(servers, stop=stop)

    async def stop(self, grace: float | None = None) -> None:
        try:
            await self.agent.stop(grace)
        finally:
            await self.http.aclose()

    def not_ready(self) -> str | None:
        """Why the sidecar's ``/readyz`` says 503 (:mod:`reach_broker.console.health`), or None:
        connected to NATS, announced to a broker that answered, not draining. (Its backend's
        health is the brokers' business: a dead one is reported draining, out of the routes,
        while the sidecar process itself stays ready.)"""
        agent = self.agent
        if agent.nc is None or not agent.nc.is_connected:
            return "not connected to NATS"
        if agent.draining:
            return "draining: it takes no new tasks"
        if agent.token is None:
            return "announced, but no broker has answered yet"
        return None

    async def ready(self) -> bool:
        """Whether the backend answers (asked every second): the health URL when there is
        one; else the calls since the last check, or a TCP connection when there were none."""
        if self.health_url is not None:
            return await self._health()
        answered, unreached = self._answered, self._unreached
        self._answered = self._unreached = 0
        if answered or unreached:
            return answered > 0
        return await self._connects()

    async def _health(self) -> bool:
        """GET the health URL: a 2xx within the timeout."""
        assert self.health_url is not None
        return await answers(self.http, self.health_url, HEALTH_TIMEOUT_S, "adapt.health_failed")

    async def _connects(self) -> bool:
        """A TCP connection to the URL's host and port opens within the timeout."""
        host, port = self._address
        try:
            async with asyncio.timeout(HEALTH_TIMEOUT_S):
                _, writer = await asyncio.open_connection(host, port)
        except (OSError, TimeoutError) as exc:
            log.info("adapt.connect_failed url=%s error=%s", self.url, type(exc).__name__)
            return False
        writer.close()
        try:
            await writer.wait_closed()
        except OSError:
            pass
        return True

    async def forward(self, task: Task) -> Any:
        """The task as an HTTP POST; its answer as the result or a reach error."""
        import httpx

        left = task.time_left
        timeout_s = max(left, 0.001) if left is not None else DEFAULT_TIMEOUT_S
        headers = {
            "Content-Type": "application/json",
            "Reach-Request-Id": task.request_id,
            "Reach-Timeout-Ms": str(int(timeout_s * 1000)),
        }
        trace = task.headers.get(TRACEPARENT)
        if trace:
            headers[TRACEPARENT] = trace
        self.posts += 1
        try:
            resp = await self.http.post(self.url, content=_encoder.encode(task.payload),
                                        headers=headers, timeout=timeout_s)  # fmt: skip
        except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
            self._unreached += 1
            raise Timeout(f"HTTP agent {self.url} unreachable: {type(exc).__name__}") from None
        except httpx.TimeoutException:
            raise Timeout(f"HTTP agent {self.url} did not answer within {timeout_s:.3f}s") from None
        except httpx.HTTPError as exc:
            raise Timeout(f"HTTP agent {self.url} unreachable: {type(exc).__name__}") from None
        self._answered += 1
        if resp.is_success:
            return self._result(resp.content)
        raise error_of(resp.status_code, f"HTTP agent {self.url} answered {resp.status_code}: "
                       f"{resp.text[:200].strip()}")  # fmt: skip

    @staticmethod
    def _result(body: bytes) -> Any:
        if not body:
            return None
        try:
            return _decoder.decode(body)
        except msgspec.DecodeError:
            return body.decode("utf-8", "replace")


async def answers(http: Any, url: str, timeout_s: float, failed: str) -> bool:
    """Whether a GET of ``url`` on ``http`` (an ``httpx.AsyncClient``) answers 2xx within
    ``timeout_s``; a failure is logged as ``failed`` (the adapters' health checks)."""
    import httpx

    try:
        resp = await http.get(url, timeout=timeout_s)
    except httpx.HTTPError as exc:
        log.info("%s url=%s error=%s", failed, url, type(exc).__name__)
        return False
    if not resp.is_success:
        log.info("%s url=%s status=%d", failed, url, resp.status_code)
    return bool(resp.is_success)
