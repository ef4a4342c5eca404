"""Compensation entries delivered to Synadia Agent Protocol agents.

Their agents write no ack records, so the broker is their caller: :meth:`Prompts.send`
publishes the prompt envelope (:func:`reach_agent.client.prompting.envelope`) to the candidate's
prompt subject with a reply inbox of its own and waits for the first message — the leading
ack is the receipt (the entry is delivered), an error frame the agent's refusal, nothing
within ``receipt_timeout_s`` no receipt. After the ack, the collector it returns (run by the
replay once the entry is held, :mod:`reach_broker.replay.taken`) reads the rest of the stream until
its end or the entry's expiry (else ``DEFAULT_RUN_S``), stores the ack record itself, as the
broker (author ``_broker``): ``completed`` with the response chunks joined, or ``failed``
with the error — and then tells ``on_done`` (the held entry is removed).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError

from jetstream.compensation import Entry
from reach_agent.client import prompting
from reach_agent.connection import flush_subscriptions
from reach_agent.wire import schema, streams
from reach_agent.wire.errors import ReachError, Timeout, from_reply
from reach_agent.wire.schema import PROTOCOL_SYNADIA
from reach_broker.config import CompensationSection
from reach_broker.service.brokeracks import BrokerAcks
from reach_broker.service.context import BrokerContext

log = logging.getLogger(__name__)

DEFAULT_RUN_S = 600.0
"""How long a prompt may run when its entry does not expire."""
_STATUS = "Status"  # nats-server's no-responders reply: Status: 503, no body
Collector = Callable[[], Awaitable[None]]
"""Reads the rest of an acknowledged prompt stream and records the answer."""


class Prompts:
    """Sends compensation entries to Synadia agents and records their answers."""

    def __init__(self, ctx: BrokerContext, cfg: CompensationSection,
                 on_done: Callable[[str, str], Awaitable[object]],
                 records: BrokerAcks) -> None:  # fmt: skip
        self.ctx, self.cfg, self.records = ctx, cfg, records
        self.on_done = on_done
        """Told (request id, agent id) once the agent's answer is recorded."""

    async def deliver(
        self, target: Any, e: Entry, headers: dict[str, str]
    ) -> tuple[ReachError | None, Collector | None, str | None]:
        """Send entry ``e`` to ``target`` (its ``agent_id``, ``subject``, ``protocol``): a
        reach agent gets the task and answers a receipt, a Synadia agent the prompt (see
        :meth:`send`). (The refusal or None, the collector of a Synadia agent's answer, and
        the holder a reach agent's reply names with ``Reach-Holder``: then the reply is no
        receipt but that holder's stored result or error — the agent found the request
        claimed and finished — and the refusal, if any, is that stored error.)"""
        if target.protocol != PROTOCOL_SYNADIA:
            reply = await self.ctx.nc.request(target.subject, e.data, headers=headers,
                                              timeout=self.cfg.receipt_timeout_s)  # fmt: skip
            holder = reply.headers.get(schema.H_HOLDER) if reply.headers else None
            return from_reply(reply.headers, reply.data), None, holder or None
        sent = await self.send(target.subject, target.agent_id, e.request_id, e.capability,
                               e.data, e.expires_at_ms)  # fmt: skip
        return (sent, None, None) if isinstance(sent, ReachError) else (None, sent, None)

    async def send(
        self, subject: str, agent_id: str, request_id: str, capability: str, data: bytes,
        expires_at_ms: int | None,
    ) -> ReachError | Collector:  # fmt: skip
        """Deliver one entry: its error when the agent refused it, else (acknowledged) the
        collector to run once the entry is held; raises nats' TimeoutError or
        NoRespondersError when nothing acknowledged it."""
        nc = self.ctx.nc
        inbox = nc.new_inbox()
        sub = await nc.subscribe(inbox)
        await flush_subscriptions(nc)
        taken = False
        try:
            await nc.publish(subject, prompting.envelope(data), reply=inbox)
            try:
                first = await sub.next_msg(timeout=self.cfg.receipt_timeout_s)
            except NatsTimeoutError:
                raise NatsTimeoutError from None
            hdrs = first.headers
            if hdrs and hdrs.get(_STATUS) == "503" and not first.data:
                raise NoRespondersError
            kind, value = prompting.read(first, agent_id)
            if kind == "error":
                return value  # type: ignore[no-any-return]
            chunks: list[Any] = [value] if kind == "chunk" else []
            left_s = (expires_at_ms - self.ctx.wall_ms()) / 1000.0 if expires_at_ms else 0.0
            run_s = left_s if left_s > 0 else DEFAULT_RUN_S
            taken = True
            return lambda: self._collect(sub, agent_id, request_id, capability, chunks, run_s)
        finally:
            if not taken:
                await sub.unsubscribe()

    async def _collect(
        self, sub: Any, agent_id: str, request_id: str, capability: str, chunks: list[Any],
        run_s: float,
    ) -> None:  # fmt: skip
        err: ReachError | None = None
        try:
            async with asyncio.timeout(run_s):
                while True:
                    kind, value = prompting.read(await sub.next_msg(timeout=run_s), agent_id)
                    if kind == "chunk":
                        chunks.append(value)
                    elif kind == "error":
                        err = value
                    elif kind == "end":
                        break
        except (TimeoutError, NatsTimeoutError):
            err = Timeout(f"agent {agent_id!r} did not end its answer within {run_s:.0f}s")
        finally:
            await sub.unsubscribe()
        rec = schema.AckRecord(
            request_id=request_id, agent_id=agent_id, capability=capability,
            state="failed" if err else "completed", at_ms=self.ctx.wall_ms(),
            result=None if err else msgspec.Raw(schema.encoder.encode(streams.join(chunks))),
            error={"code": err.code, "message": err.message} if err else None,
        )  # fmt: skip
        # Until stored: the answer exists nowhere else (their agents write no records).
        await self.records.store(rec, "answer")
        log.info("replay.synadia_recorded request_id=%s agent=%s state=%s", request_id,
                 agent_id, rec.state)  # fmt: skip
        await self.on_done(request_id, agent_id)
