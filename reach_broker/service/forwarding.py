"""One broker answers each capability's route requests: its owner, so that quotas and
hand-outs are counted once however many brokers share the fleet.

A capability's owner is the owner of partition ``partition(capability, P)`` (the FNV-1a hash
agent ids are partitioned by, :func:`reach_agent.routing.table.partition`): whoever holds that
partition's lease. A route request reaches any broker (queue group ``reach-broker``); one that
does not own the capability forwards it on ``<p>.forward.<owner>.<capability>`` with the
caller it named (``Reach-Caller``: from the caller's private inbox in secured mode, where only
brokers may publish on ``<p>.forward.>``) and relays the owner's reply, body and headers as
they are. The owner answers a forwarded request as its own (quota, route, hand-out), or
refuses it when the partition is no longer its own. A forward that finds no owner, a former
owner or no answer within ``[fleet] forward_timeout_s`` is refused ``OVERLOADED`` with
``retry_after_ms`` (a retryable refusal: never answered by a second broker's own count while
the owner may still be counting), the leases read again, and
``reach_route_forwards_total{result}`` counts it. A partition whose lease lapsed and that
nobody holds yet is forwarded to the lease's last holder, as its owner. An owner the server
has no responder for is gone (its connection closed: a crash, SIGKILL), its counts with it,
whether its lease has lapsed yet or not: its successor stands in (the highest random
weight of (capability, broker) among the other lease holders last read and the forwarder
itself; the same at every broker that read the same leases), answering here or forwarded
there with ``Reach-Stand-In: <gone>``, until a new owner holds the partition; counted
``stand_in``. A broker that stops (:meth:`Forwarder.drain`, before its parts stop) answers
the forwards the server already sent it while it still owns their partitions, and waits for
the answers to its own forwards; one still unanswered at its stop is refused ``OVERLOADED``
too, counted ``stopped``.

A broker that owns every partition (the single-broker default, a server without JetStream)
answers every request itself, as before; so does one without route tables (``[fleet] tables =
false``: no leases are kept), and one that lost a lease while no other broker held any (its
renewal failed: nobody else counts).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, NamedTuple

from nats.aio.msg import Msg
from nats.errors import Error as NatsError
from nats.micro.request import Request

from jetstream.tasks import raise_if_cancelled
from reach_agent.aio import stop_loops, wait_event
from reach_agent.connection import drain_subscription
from reach_agent.routing.hashing import hash64
from reach_agent.routing.table import partition
from reach_agent.wire.errors import Overloaded, to_reply
from reach_agent.wire.schema import H_CALLER
from reach_agent.wire.subjects import broker_token, is_inbox
from reach_broker.config import FleetSection
from reach_broker.core.quotas import ANONYMOUS, MAX_CALLER_LEN, caller_of

from .context import BrokerContext
from .handlers import Endpoint, Handle
from .owners import Owners

log = logging.getLogger(__name__)

RETRY_SOON_MS = 100
"""``retry_after_ms`` of a refusal while a partition changes hands or its owner is slow (a
hand-back is taken within 60-110 ms on loopback)."""
FORWARD_RESULTS = ("ok", "timeout", "no_owner", "not_owner", "stopped", "answered", "stand_in")
"""``result`` of ``reach_route_forwards_total``: forwarded and relayed (``ok``); refused
because the owner did not answer in time (``timeout``), none is known (or it and its
successor are gone: ``no_owner``), it no longer owns the capability (``not_owner``), or this
broker stopped before the owner answered (``stopped``); a forward received and answered as
the owner (``answered``); a request answered for a gone owner by its successor
(``stand_in``)."""

REFUSED = {
    "timeout": "did not answer in time",
    "not_owner": "no longer owns it",
    "no_owner": "is not there",
    "stopped": "had not answered when this broker stopped",
}
"""Why a forward was refused, as its error message says it."""

H_STAND_IN = "Reach-Stand-In"
"""On a forward to a gone owner's successor: the gone owner (its subject token)."""

H_FORWARD = "Reach-Forward"
"""Set by an owner refusing a forward: ``not_owner`` (the partition is no longer its own)."""

STATUS, NO_RESPONDERS = "Status", "503"
"""What nats-server answers a request nobody subscribes to."""


class Waiting(NamedTuple):
    """A forward waiting for the owner's answer."""

    req: Request
    capability: str
    partition: int
    owner: str | None
    deadline: float
    gone: str | None = None
    """Set when ``owner`` stands in for this gone owner (a second no-responders: refused)."""


EXPIRY_S = 0.05
"""The longest between two looks at the forwards waiting (refused once overdue)."""

MAX_CAPABILITIES = 10_000
"""Capabilities whose partition is remembered (forgotten all at once beyond)."""


class Forwarder:
    """The route endpoint's front: answered here when this broker owns the capability, else
    forwarded to the owner (a broker component)."""

    def __init__(
        self, ctx: BrokerContext, cfg: FleetSection, route: Endpoint, handle: Handle, *,
        owned: Callable[[int], bool], owns_all: Callable[[], bool],
        follow: Callable[[str], Awaitable[None] | None], jetstream: Callable[[], bool],
        forwards: Any, owners: Owners,
    ) -> None:  # fmt: skip
        self.ctx = ctx
        self.cfg = cfg
        self.route = route
        """The local route endpoint (answers, counts and maps failures)."""
        self.handle = handle
        """The route handler: (subject, body, caller) -> reply body."""
        self.owned = owned
        """Whether this broker owns partition ``p`` now (its route tables' word)."""
        self.owns_all = owns_all
        self.follow = follow
        """What a request this broker answers waits for first: the other owners' shares
        of its capability, on its first request (:meth:`Shares.waiting`)."""
        self.jetstream = jetstream
        self.results = {r: forwards.labels(r) for r in FORWARD_RESULTS}
        """``reach_route_forwards_total`` by result."""
        self.owners = owners
        """Each partition's owner as the leases say (started and stopped with this)."""
        self.token = broker_token(ctx.broker_id)
        self.active = False
        """Whether requests are forwarded at all (leases kept: JetStream and tables on)."""
        self._partition_of: dict[str, int] = {}
        self._forwards: Any = None
        """The subscription to the forwards sent to this broker (as their owner)."""
        self._answers: Any = None
        """The subscription to the owners' answers to this broker's forwards."""
        self._inbox = ""
        """This forwarder's inbox prefix: the owners' answers come to ``<inbox><token>``."""
        self._tokens = itertools.count()
        self._waiting: dict[str, Waiting] = {}
        """Forwards sent and not answered yet, oldest first."""
        self._answered = asyncio.Event()
        """Set when a forward waiting is answered or refused (what :meth:`drain` waits on)."""
        self._expiry: asyncio.Task[None] | None = None

    async def start(self) -> None:
        if self.active or not (self.cfg.tables and self.jetstream()):
            return
        self.active = True
        await self.owners.start()
        nc = self.ctx.nc
        self._inbox = nc.new_inbox() + "."
        self._forwards = await nc.subscribe(self.ctx.subjects.forwards_to(self.token),
                                            cb=self.on_forward)  # fmt: skip
        self._answers = await nc.subscribe(self._inbox + "*", cb=self._on_answer)
        self._expiry = asyncio.create_task(self._expire(), name="reach-forward-expiry")

    async def drain(self) -> None:
        """Stop taking forwards, answering every one the server already sent (this broker
        still owns its partitions: the broker drains before its parts stop), then wait for
        this broker's own forwards to be answered, or refused at their deadline (at most
        ``forward_timeout_s``): a stopping broker leaves no route request unanswered. Called
        once the route endpoint has stopped (no forward of its own is sent after)."""
        if not self.active or self._forwards is None:
            return
        forwards, self._forwards = self._forwards, None
        await drain_subscription(self.ctx.nc, forwards, self.cfg.forward_timeout_s)
        deadline = self.ctx.clock() + self.cfg.forward_timeout_s + EXPIRY_S
        while self._waiting and (left := deadline - self.ctx.clock()) > 0:
            self._answered.clear()
            await wait_event(self._answered, left)

    async def stop(self) -> None:
        if not self.active:
            return
        self.active = False
        if self._expiry is not None:
            await stop_loops(self._expiry)
            self._expiry = None
        for sub in (self._forwards, self._answers):
            if sub is None:
                continue
            try:
                await sub.unsubscribe()
            except NatsError:
                pass
        self._forwards = self._answers = None
        # Forwards still waiting (the broker stopped without draining: a start undone): no
        # answer can come now; refused, retryable, so their callers ask another broker.
        waiting, self._waiting = self._waiting, {}
        for w in waiting.values():
            try:
                await self._refuse(w, "stopped")
            except NatsError:  # the connection is gone: nothing can be answered
                break
        await self.owners.stop()

    def owner_of(self, capability: str) -> tuple[int, str | None]:
        """The partition of ``capability`` and its owner's token (this broker's own when it
        owns it; None: nobody known)."""
        p = self._partition_of.get(capability)
        if p is None:
            if len(self._partition_of) >= MAX_CAPABILITIES:
                self._partition_of.clear()
            p = self._partition_of[capability] = partition(capability, self.cfg.partitions)
        if self.owned(p):
            return p, self.token
        owner = self.owners.of[p]
        if owner == self.token:
            # A read from before this broker lost or handed back the partition: it does not
            # answer for it (it no longer holds its agents); the leases are read again.
            self.owners.stale()
            return p, None
        return p, owner

    # --- the front of the route endpoint --------------------------------------------------

    async def on_request(self, req: Request) -> None:
        """The route endpoint's handler: answered here, or forwarded to the owner."""
        if not self.active or self.owns_all():
            await self.route.on_request(req)
            return
        capability = self.ctx.subjects.capability_of_route(req.subject)
        p, owner = self.owner_of(capability)
        if owner == self.token:
            wait = self.follow(capability)
            if wait is None:
                await self.route.on_request(req)
            else:  # not held up here: the endpoint's callback runs one request at a time
                self.ctx.spawn(self._answer_after(wait, self.route.on_request(req)), "route")
            return
        reply = req._msg.reply  # nats.micro keeps it private; respond() publishes there
        if not reply or not is_inbox(reply):
            await self.route.on_request(req)  # refused there, counted as dropped
            return
        if owner is None:
            lapsed = self.owners.lapsed[p]
            if self.owners.alone(self.token):
                # No other broker held a lease at the last read (a lone broker whose lease
                # lapsed while JetStream was slow): nobody else counts, so this broker
                # answers; the leases are read again now, in case one just joined.
                self.owners.stale()
                await self.route.on_request(req)
            elif lapsed is not None and lapsed != self.token:
                # Its lease lapsed and nobody holds it yet: its last holder is asked, as its
                # owner. Gone (no responders: a crash), it is stood in for, as before its
                # lease lapsed; there still, it answers while it counts, or refuses. (Refused
                # here, a route waited up to a third of the lease until another broker took
                # the partition, while a gone owner's other leases had not lapsed yet.)
                await self._send(Waiting(req, capability, p, lapsed, 0.0))
            else:
                await self._refuse(Waiting(req, capability, p, owner, 0.0), "no_owner")
            return
        await self._send(Waiting(req, capability, p, owner, 0.0))

    async def _send(self, w: Waiting) -> None:
        """Forward ``w`` to ``w.owner``: sent, not awaited (the endpoint's callback runs one
        request at a time); the answer comes to this forwarder's one inbox
        (:meth:`_on_answer`)."""
        req = w.req
        headers = dict(req.headers) if req.headers else {}
        headers[H_CALLER] = caller_of(req.headers, req._msg.reply, self.ctx.link.secured)
        if w.gone is not None:
            headers[H_STAND_IN] = w.gone
        owner = w.owner or ""  # (never None here: a forward has an owner)
        token = str(next(self._tokens))
        self._waiting[token] = w._replace(deadline=self.ctx.clock() + self.cfg.forward_timeout_s)
        await self.ctx.nc.publish(self.ctx.subjects.forward(owner, w.capability), req.data,
                                  reply=self._inbox + token, headers=headers)  # fmt: skip

    def successor(self, capability: str, gone: str) -> str:
        """Who stands in for ``gone`` (an owner whose connection the server no longer has)
        on ``capability``: among this broker and the other lease holders last read, the
        highest random weight of (capability, broker) — the same choice at every broker
        that read the same leases."""
        others = {o for o in self.owners.of if o is not None and o != gone}
        others.add(self.token)
        return max(others, key=lambda t: hash64(f"{capability}#{t}"))

    async def _stand_in(self, w: Waiting) -> None:
        """``w.owner`` is gone (no responders: its connection is closed, its counts with
        it) and its lease not yet lapsed: its successor answers, this broker or the one it
        forwards to; a successor gone too is refused."""
        gone = w.owner
        if w.gone is not None or gone is None:
            await self._refuse(w, "no_owner")
            return
        successor = self.successor(w.capability, gone)
        if successor == self.token:
            self.results["stand_in"].inc()
            # As an owner's own request: the other owners' shares first (a stand-in has
            # most often never followed the capability, whose requests it forwarded).
            wait = self.follow(w.capability)
            if wait is None:
                await self.route.on_request(w.req)
            else:
                self.ctx.spawn(self._answer_after(wait, self.route.on_request(w.req)), "route")
            return
        await self._send(w._replace(owner=successor, gone=gone))

    async def _on_answer(self, msg: Msg) -> None:
        """The owner's answer to a forward (or the server's: no responders), relayed."""
        w = self._waiting.pop(msg.subject[len(self._inbox) :], None)
        if w is None:
            return  # refused already (too late)
        self._answered.set()
        headers = msg.headers
        if headers and not msg.data:
            if headers.get(STATUS) == NO_RESPONDERS:
                await self._stand_in(w)
                return
            if headers.get(H_FORWARD) == "not_owner":
                await self._refuse(w, "not_owner")
                return
        self.results["ok"].inc()
        await w.req.respond(msg.data, headers=headers)

    async def _expire(self) -> None:
        """Forwards not answered within ``forward_timeout_s`` refused (oldest first: they
        all wait as long)."""
        every = min(self.cfg.forward_timeout_s / 5, EXPIRY_S)
        waiting = self._waiting
        while True:
            raise_if_cancelled()
            await asyncio.sleep(every)
            now = self.ctx.clock()
            try:
                while waiting:
                    token, w = next(iter(waiting.items()))
                    if w.deadline > now:
                        break
                    del waiting[token]
                    self._answered.set()
                    await self._refuse(w, "timeout")
            except Exception:  # noqa: BLE001 - the loop body never dies
                log.exception("route.forward_expiry failed")

    async def _refuse(self, w: Waiting, result: str) -> None:
        """A forward that got no answer from the owner: refused, retryable, and counted."""
        self.results[result].inc()
        self.owners.stale()
        # Soon: a slow or stopping owner (another broker, or the owner, may answer at once),
        # a former owner or a lease handed back (the partition changes hands: the brokers
        # rebalance at once, and the leases are read again now). Else (a lease lapsed, its
        # owner dead; a stand-in gone too): the others take it at their next round, within a
        # third of the lease's time to live.
        soon = result in ("timeout", "stopped", "not_owner") or (
            result == "no_owner" and w.partition in self.owners.freed
        )
        retry_ms = RETRY_SOON_MS if soon else int(self.cfg.lease_ttl_s * 1000 / 3)
        log.info("route.forward_failed capability=%s partition=%d owner=%s result=%s",
                 w.capability, w.partition, w.owner, result)  # fmt: skip
        err = Overloaded(
            f"route requests for {w.capability!r} are answered by the owner of partition "
            f"{w.partition} ({w.owner or 'none known'}), which {REFUSED[result]}; retry in "
            f"{retry_ms} ms", retry_after_ms=retry_ms,
        )  # fmt: skip
        headers, body = to_reply(err)
        await w.req.respond(body, headers=headers)

    # --- the owner's side -----------------------------------------------------------------

    async def on_forward(self, msg: Msg) -> None:
        """A route request forwarded by another broker: answered as this broker's own (the
        caller as the forwarder named it), or refused when the capability is not this
        broker's now."""
        if not msg.reply or not is_inbox(msg.reply):
            return
        subjects = self.ctx.subjects
        capability = subjects.capability_of_forward(msg.subject)
        gone = (msg.headers or {}).get(H_STAND_IN)
        mine = (self.owner_of(capability)[1] == self.token if gone is None
                else self.successor(capability, gone) == self.token)  # fmt: skip
        if not mine:
            self.results["not_owner"].inc()
            await self.ctx.nc.publish(msg.reply, b"", headers={H_FORWARD: "not_owner"})
            return
        self.results["stand_in" if gone is not None else "answered"].inc()
        wait = self.follow(capability)
        if wait is None:
            await self._answer_forward(msg, capability)
        else:
            self.ctx.spawn(self._answer_after(wait, self._answer_forward(msg, capability)),
                           "route")  # fmt: skip

    @staticmethod
    async def _answer_after(wait: Awaitable[None], answer: Coroutine[Any, Any, None]) -> None:
        """``answer`` once the other owners' shares are in (or could not be had)."""
        await wait
        await answer

    async def _answer_forward(self, msg: Msg, capability: str) -> None:
        subjects = self.ctx.subjects
        caller = (msg.headers or {}).get(H_CALLER) or ANONYMOUS
        subject = subjects.route(capability)
        try:
            body = self.handle(subject, msg.data, caller[:MAX_CALLER_LEN])
        except Exception as exc:  # noqa: BLE001 - answered by the endpoint's failure()
            failed = self.route.failure(subject, exc)
            if failed is not None:
                await self.ctx.nc.publish(msg.reply, failed[0], headers=failed[1])
            return
        await self.ctx.nc.publish(msg.reply, body or b"")
