"""The attempt loop of one call: next candidate, route again, back off, wait out "full",
follow a claim's holder — until an attempt succeeds or the retry rule says stop.

Its own module because it decides across attempts with the client's parts (routes,
attempts, breakers, holders) and needs nothing else of :class:`~reach_agent.client.client.Client`.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Callable
from typing import Any

from jetstream.tasks import raise_if_cancelled
from reach_agent import trace
from reach_agent.wire import schema
from reach_agent.wire.errors import InProgress, NoReachableAgent, ReachError
from reach_agent.wire.retry import merely_full, should_retry
from reach_agent.wire.subjects import ReplyInbox

from .attempts import Attempts
from .breaker import Breakers
from .calls import Call
from .config import ClientConfig
from .holder import Holders
from .routes import RouteSource

log = trace.logger(__name__)


class AttemptLoop:
    """Runs the attempts of the client's calls (:meth:`run`)."""

    def __init__(
        self,
        config: ClientConfig,
        clock: Callable[[], float],
        breakers: Breakers,
        routes: RouteSource,
        attempts: Attempts,
        holders: Holders,
    ) -> None:
        self.config = config
        self.clock = clock
        self.breakers = breakers
        self.routes = routes
        self.attempts = attempts
        self.holders = holders

    def _holder_to_ask(self, call: Call, holder: str) -> schema.Candidate | None:
        """The agent holding ``call``'s claim as its next attempt, once per call: a holder
        running the request answers the copy with its run's result (its duplicate window); a
        new process of the holder takes over the claim its dead predecessor left running (no
        broker releases it: the agent id stays healthy) and runs it. None when it was tried
        already or is behind an open breaker: the call then waits for the holder at once
        (one not reached goes on as after any lost attempt)."""
        if holder in call.tried:
            return None
        allowed, change = self.breakers.allow(holder, call.capability, self.clock())
        self.attempts.breaker_changed(holder, call.capability, change)
        if not allowed:
            return None
        log.info("call.ask_holder request_id=%s holder=%s", call.request_id, holder)
        call.attempt += 1
        call.tried.append(holder)
        return self.holders.target(holder, call.capability)

    async def _hear_again(self, call: Call) -> bool:
        """Wait until this client's own server answers a round trip again: True then, False
        when too little of ``call``'s deadline is left for another attempt."""
        while self.clock() + self.config.ack_timeout_s < call.deadline:
            if await self.attempts.liveness.hearing():
                return True
            await asyncio.sleep(0.1)  # not connected: answered at once, not a busy loop
        return False

    async def run(self, call: Call, inbox: ReplyInbox) -> Any:
        """Attempts until one succeeds or the retry rule says stop."""
        cfg = self.config
        capability = call.capability
        candidates: list[schema.Candidate] = []
        while True:
            raise_if_cancelled()
            if call.cancelled is not None:  # Client.cancel: no further attempt
                raise call.cancelled
            target = self.attempts.next(candidates, call.tried, capability)
            if target is None:
                # Everything we knew was tried (or is behind an open breaker): ask again.
                try:
                    blocked = self.breakers.blocked(capability, self.clock())
                    candidates = await self.routes.route(
                        capability, call.filters, limit=cfg.route_limit,
                        exclude=[*blocked, *call.gone] if call.gone else blocked,
                        deadline=call.deadline, headers=call.span_headers,
                    )  # fmt: skip
                except NoReachableAgent as no_agent:
                    raise (call.last_err or no_agent) from None
                except ReachError as refused:
                    if not merely_full("error", refused):
                        raise
                    # OVERLOADED: every candidate is full. Wait as told, then ask again. (An
                    # agent's own TARGET_BUSY, which made a table route find it full, stays
                    # the call's error.)
                    if call.last_err is None or not merely_full("error", call.last_err):
                        call.last_err = refused
                    await call.wait_full(refused, self.config, self.clock, call.last_err)
                    candidates = []  # route again: the fleet moved while we waited
                    continue
                nxt = self.attempts.next
                target = nxt(candidates, call.tried, capability) or nxt(
                    candidates, call.gone, capability
                )
                if target is None:
                    raise call.last_err or NoReachableAgent(
                        f"every agent with capability {capability!r} is behind an open "
                        "circuit breaker"
                    )
            if call.attempt > 0 and target.agent_id in call.tried:
                assert call.last_err is not None
                if merely_full("error", call.last_err):
                    # Every candidate answered TARGET_BUSY: a moment, then a new round from a
                    # new route (an agent of the old one may have died meanwhile).
                    await call.wait_full(call.last_err, self.config, self.clock)
                    candidates = []
                    continue
                else:
                    # A retry to an agent we already tried: back off first, inside the
                    # deadline.
                    delay = cfg.backoff(call.retries, random.random())
                    if self.clock() + delay + cfg.ack_timeout_s > call.deadline:
                        raise call.last_err
                    await asyncio.sleep(delay)
            call.attempt += 1
            call.tried.append(target.agent_id)
            allowed, change = self.breakers.allow(target.agent_id, capability, self.clock())
            self.attempts.breaker_changed(target.agent_id, capability, change)
            if not allowed:
                continue
            if call.cancelled is not None:
                raise call.cancelled
            outcome, value = await self.attempts.send(call, target, inbox)
            if outcome == "error" and isinstance(value, InProgress):
                # Another agent holds the claim: its result is the answer, not a re-run.
                call.taker = value.holder
                if call.ack_mode == "received":
                    return schema.Receipt(request_id=call.request_id, agent_id=value.holder)
                holder = self._holder_to_ask(call, value.holder)
                if holder is not None:
                    target = holder
                    outcome, value = await self.attempts.send(call, holder, inbox)
            if outcome == "error" and isinstance(value, InProgress):
                call.taker = value.holder
                end, value = await self.holders.wait(call, value.holder, self.clock)
                if end == "released":
                    call.tried.clear()  # the holder is gone: anyone may take it, at once
                    continue
                outcome = end  # the holder's own result or error: the retry rule judges it
            if outcome == "ok":
                return value
            if outcome == "not_delivered" and not await self.attempts.liveness.hearing():
                # No receipt while this client's own server does not answer a round trip
                # either (its link stalled, its node stopped): the silence says nothing of
                # the agent, which may have taken the task. Not a retry spent: once the
                # server answers again the same agent is asked first (a taker answers the
                # copy from its duplicate window). Nemesis seed 55: c3-000172's receipt
                # from a4 was lost as the caller's node was stopped; its three attempts ran
                # out in the stall and it was told TIMEOUT 6 s before its deadline, 2.2 s
                # after a4 had stored the result.
                call.last_err = value
                log.info("call.attempt_unjudged request_id=%s agent=%s: no receipt while "
                         "this client's own server did not answer either; asked again once "
                         "it does", call.request_id, target.agent_id)  # fmt: skip
                if not await self._hear_again(call):
                    raise value
                call.tried.remove(target.agent_id)
                candidates = [target, *(c for c in candidates if c is not target)]
                continue
            if outcome == "lost" or outcome == "no_responders":
                call.gone.append(target.agent_id)  # dead to this call: elsewhere from now on
            call.last_err = value
            if not should_retry(
                outcome, value, retries_done=call.retries, max_retries=cfg.retries,
                time_left_s=call.deadline - self.clock(),
                min_attempt_s=min(cfg.ack_timeout_s, 0.05),
            ):  # fmt: skip
                raise value
            if not merely_full(outcome, value):
                call.retries += 1
            if log.isEnabledFor(logging.DEBUG):
                log.debug("call.retry capability=%s request_id=%s agent=%s outcome=%s "
                          "retry=%d", capability, call.request_id, target.agent_id, outcome,
                          call.retries)  # fmt: skip
