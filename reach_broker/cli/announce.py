"""``reach announce``: a hand-made agent, written from ``docs/protocol.md`` with plain NATS
(no :class:`reach_agent.Agent`), that prints every step it takes.

It subscribes to its probe and task subjects, announces (retrying until a broker answers),
heartbeats every interval until Ctrl-C, answers probes, and serves each capability by
echoing the task's payload (``{"agent_id", "capability", "echo"}``; a receipt first when
asked, a repeated request id gets the first result). On a reconnect it announces again; on
Ctrl-C it refuses new tasks with ``DRAINING``, leaves and closes. It writes no ack records,
so it refuses ``Reach-Ack-Mode: received``.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import random
import time
import uuid
from typing import Any

import msgspec

from jetstream.names import H_REQUEST_ID
from reach_agent.connection import drain_or_close, flush_subscriptions
from reach_agent.wire import schema
from reach_agent.wire.errors import Draining, InvalidRequest, LoopDetected, ReachError
from reach_agent.wire.errors import to_reply as error_reply
from reach_agent.wire.subjects import Subjects, is_inbox
from reach_broker.logs import say

from .common import (
    EXIT_USAGE,
    CliError,
    Subcommands,
    add_common,
    capability,
    connect,
    stop_on_signals,
    subjects,
)

ANNOUNCE_TIMEOUT_S = 2.0
REMEMBERED = 1000
"""Results kept for repeated request ids."""
MAX_VISITS = 3
"""Earlier visits of this agent in ``Reach-Hops`` from which a task is a loop."""

_payload_decoder = msgspec.json.Decoder()
_payload_encoder = msgspec.json.Encoder()


def add_parser(sub: Subcommands) -> None:
    p = sub.add_parser("announce", help="a hand-made agent: announce, heartbeat and echo "
                                        "tasks until Ctrl-C")  # fmt: skip
    add_common(p)
    p.add_argument("--agent-id", "-a", default="alpha", help="the agent's id (default alpha)")
    p.add_argument("--capability", "-C", action="append", metavar="CAP",
                   help="a capability it serves, repeatable (default text_processing)")  # fmt: skip
    p.add_argument("--max-concurrency", type=int, default=4, help="slots it announces (4)")
    p.add_argument("--interval", type=float, default=5.0,
                   help="seconds between heartbeats (default 5)")  # fmt: skip
    p.add_argument("--region", help="the region it announces")
    p.set_defaults(func=run)


def announcement(args: argparse.Namespace) -> schema.Announce:
    """The ``Announce`` the options describe, or a usage error naming what is wrong."""
    caps = [capability(c, "--capability") for c in args.capability or ["text_processing"]]
    if not 1 <= args.max_concurrency <= 100_000:
        raise CliError(f"--max-concurrency {args.max_concurrency} is not within 1-100000",
                       EXIT_USAGE)  # fmt: skip
    if not 0.05 <= args.interval <= 3600:
        raise CliError(f"--interval {args.interval:g} is not within 0.05-3600 seconds", EXIT_USAGE)
    try:
        schema.check_agent_id(args.agent_id, "--agent-id")
        msg = schema.Announce(agent_id=args.agent_id, capabilities=caps,
                              max_concurrency=args.max_concurrency,
                              heartbeat_interval_ms=round(args.interval * 1000),
                              region=args.region)  # fmt: skip
        # Announce's own limits (msgspec checks them on decode only), then the cross checks.
        schema.decode(schema.announce_decoder, schema.encoder.encode(msg), "announce")
        return schema.validate_announce(msg, args.agent_id)
    except ReachError as exc:
        raise CliError(exc.message, EXIT_USAGE) from None


def run(args: argparse.Namespace) -> int:
    ann = announcement(args)
    return asyncio.run(_announce(args, ann))


async def _announce(args: argparse.Namespace, ann: schema.Announce) -> int:
    subs = subjects(args)
    stop = stop_on_signals()
    agent = HandMadeAgent(subs, ann, as_json=args.json)
    # The connection name is the agent id: the broker hears of its closing at once.
    nc = await connect(args, name=ann.agent_id, allow_reconnect=True,
                       disconnected_cb=agent.on_disconnected,
                       reconnected_cb=agent.on_reconnected)  # fmt: skip
    # Connected: from now on reconnect for as long as the agent runs (nats-py reads this
    # option at each reconnect; the first connect above failed fast instead).
    nc.options["max_reconnect_attempts"] = -1
    try:
        await agent.run(nc, stop)
    finally:
        await drain_or_close(nc, 2.0)
    return 0


class HandMadeAgent:
    """The agent's state and its handlers; :meth:`run` is its whole life."""

    def __init__(self, subjects: Subjects, announce: schema.Announce, *, as_json: bool) -> None:
        self.subjects = subjects
        self.announce = announce
        self.agent_id = announce.agent_id
        self.as_json = as_json
        self.nc: Any = None
        self.token = ""
        self.seq = 0
        self.interval = announce.heartbeat_interval_ms / 1000
        self.ok_total = 0
        self.fail_total = 0
        self.draining = False
        self.results: collections.OrderedDict[str, bytes] = collections.OrderedDict()
        self.reannounce = asyncio.Event()

    @property
    def status(self) -> schema.AgentStatus:
        return "draining" if self.draining else "idle"

    def say(self, event: str, text: str, **fields: Any) -> None:
        """One line of what the agent does (one JSON object with ``--json``)."""
        if self.as_json:
            say(msgspec.json.encode({"event": event, "agent_id": self.agent_id,
                                     **fields}).decode())  # fmt: skip
        else:
            say(f"{time.strftime('%H:%M:%S')}  {self.agent_id}  {text}")

    async def run(self, nc: Any, stop: asyncio.Event) -> None:
        self.nc = nc
        subs = self.subjects
        listening = [subs.probe(self.agent_id)]
        await nc.subscribe(listening[0], cb=self.on_probe)
        for cap in self.announce.capabilities:
            listening.append(subs.task(self.agent_id, cap))
            await nc.subscribe(listening[-1], cb=self.on_task)
        await flush_subscriptions(nc)  # subscribed before announcing: routes must reach us
        self.say("subscribed", f"listening on {', '.join(listening)}", subjects=listening)
        self.reannounce.set()
        while not stop.is_set():
            if self.reannounce.is_set():
                self.reannounce.clear()
                if not await self.announce_until_answered(stop):
                    break
            await self.heartbeat()
            waits = [asyncio.ensure_future(e.wait()) for e in (stop, self.reannounce)]
            try:
                await asyncio.wait(waits, timeout=self.interval,
                                   return_when=asyncio.FIRST_COMPLETED)  # fmt: skip
            finally:
                for w in waits:
                    w.cancel()
        await self.leave()

    async def announce_until_answered(self, stop: asyncio.Event) -> bool:
        """Announce, retrying with jittered backoff until a broker answers (False: stopped)."""
        from nats.errors import Error as NatsError

        body = schema.encoder.encode(self.announce)
        delay, told = 0.5, False
        while not stop.is_set():
            try:
                msg = await self.nc.request(self.subjects.announce(self.agent_id), body,
                                            timeout=ANNOUNCE_TIMEOUT_S)  # fmt: skip
            except (NatsError, TimeoutError) as exc:
                if not told:
                    reason = str(exc) or "timeout"
                    self.say("waiting", f"no broker answers the announce yet ({reason}); "
                             "retrying (is `reach broker` running on this server?)",
                             reason=reason)  # fmt: skip
                    told = True
            else:
                err = _error_of(msg)
                if err is not None:  # a refused start: one line, exit 1
                    raise CliError(f"the broker refused the announce: {err.code}: {err.message}",
                                   1, kind=err.code)  # fmt: skip
                ack = schema.announce_ack_decoder.decode(msg.data)
                self.token, self.seq = ack.token, 0
                self.interval = ack.heartbeat_interval_ms / 1000
                self.say("announced",
                         f"announced {', '.join(self.announce.capabilities)} (max_concurrency "
                         f"{self.announce.max_concurrency}) to broker {ack.broker_id}; "
                         f"heartbeat every {self.interval:g}s, Ctrl-C leaves",
                         broker_id=ack.broker_id, heartbeat_interval_ms=ack.heartbeat_interval_ms,
                         capabilities=self.announce.capabilities)  # fmt: skip
                return True
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), delay * (0.5 + random.random()))
            delay = min(delay * 2, 5.0)
        return False

    async def heartbeat(self) -> None:
        if not self.nc.is_connected:
            return
        self.seq += 1
        hb = schema.Heartbeat(agent_id=self.agent_id, token=self.token, seq=self.seq,
                              status=self.status,
                              ok_total=self.ok_total, fail_total=self.fail_total,
                              initial=self.seq == 1)  # fmt: skip
        await self.nc.publish(self.subjects.heartbeat(self.agent_id), schema.encoder.encode(hb))
        self.say("heartbeat", f"heartbeat seq={self.seq}{' (initial)' if hb.initial else ''}",
                 seq=self.seq)  # fmt: skip

    async def leave(self) -> None:
        from nats.errors import Error as NatsError

        self.draining = True
        body = schema.encoder.encode(schema.Leave(agent_id=self.agent_id, token=self.token or None,
                                                  reason="shutdown"))  # fmt: skip
        try:
            await self.nc.request(self.subjects.leave(self.agent_id), body, timeout=2.0)
        except (NatsError, TimeoutError) as exc:
            self.say("left", f"leaving: no broker confirmed ({exc or 'timeout'})", confirmed=False)
            return
        self.say("left", "left: brokers route nothing here any more", confirmed=True)

    async def on_disconnected(self) -> None:
        if not self.draining:  # not our own close after leaving
            self.say("disconnected", "disconnected from NATS; reconnecting")

    async def on_reconnected(self) -> None:
        self.say("reconnected", "reconnected; announcing again (new token, seq from 1)")
        self.reannounce.set()

    async def on_probe(self, msg: Any) -> None:
        if not is_inbox(msg.reply or ""):  # the protocol: answer inboxes only
            self.say("probe", "ignored a probe whose reply subject is not an inbox", ignored=True)
            return
        reply = schema.ProbeReply(agent_id=self.agent_id, status=self.status, seq=self.seq)
        await msg.respond(schema.encoder.encode(reply))
        self.say("probe", "answered a probe")

    async def on_task(self, msg: Any) -> None:
        if not msg.reply:  # a publish, not a request: nobody to answer
            self.say("task", "ignored a task sent without a reply subject", ignored=True)
            return
        if not is_inbox(msg.reply):  # answering it would publish wherever the caller chose
            self.say("task", f"ignored a task whose reply subject {msg.reply[:80]!r} is not an "
                             "inbox", ignored=True)  # fmt: skip
            return
        hdrs = msg.headers or {}
        rid = hdrs.get(H_REQUEST_ID) or str(uuid.uuid4())
        cap = self.subjects.capability_of_task(msg.subject, self.agent_id)
        done = self.results.get(rid)
        if done is not None:  # a retry of a task already served: the same result, not rerun
            await self._reply(msg, rid, done, "completed")
            self.say("task", f"task {rid} {cap}: a repeat, answered with the first result",
                     request_id=rid, capability=cap, repeat=True)  # fmt: skip
            return
        try:
            payload = self._check(hdrs, msg.data)
        except ReachError as err:
            self.fail_total += 1
            headers, body = error_reply(err)
            await self.nc.publish(msg.reply, body, headers={**headers, H_REQUEST_ID: rid})
            self.say("task", f"task {rid} {cap}: refused {err.code} ({err.message})",
                     request_id=rid, capability=cap, error=err.code)  # fmt: skip
            return
        if hdrs.get(schema.H_RECEIPT) == "1":
            receipt = schema.encoder.encode(schema.Receipt(request_id=rid))
            await self._reply(msg, rid, receipt, "received")
        result = _payload_encoder.encode({"agent_id": self.agent_id, "capability": cap,
                                          "echo": payload})  # fmt: skip
        self.results[rid] = result
        while len(self.results) > REMEMBERED:
            self.results.popitem(last=False)
        self.ok_total += 1
        await self._reply(msg, rid, result, "completed")
        self.say("task", f"task {rid} {cap}: echoed {len(msg.data)} bytes",
                 request_id=rid, capability=cap)  # fmt: skip

    def _check(self, hdrs: dict[str, str], data: bytes) -> Any:
        """The task's payload, or the error the protocol prescribes for it."""
        if self.draining:
            raise Draining(f"agent {self.agent_id} is leaving")
        if hdrs.get(schema.H_ACK_MODE, "completed") != "completed":
            raise InvalidRequest("Reach-Ack-Mode: received needs an agent that writes ack "
                                 "records; reach announce writes none")  # fmt: skip
        visits = hdrs.get(schema.H_HOPS, "").split(",").count(self.agent_id)
        if visits >= MAX_VISITS:
            raise LoopDetected(f"agent {self.agent_id} already visited {visits} times")
        try:
            return _payload_decoder.decode(data) if data else None
        except msgspec.DecodeError as exc:
            raise InvalidRequest(f"task payload is not JSON ({exc})") from None

    async def _reply(self, msg: Any, rid: str, body: bytes, status: str) -> None:
        headers = {H_REQUEST_ID: rid, schema.H_STATUS: status}
        await self.nc.publish(msg.reply, body, headers=headers)


def _error_of(msg: Any) -> ReachError | None:
    from reach_agent.wire.errors import from_reply

    return from_reply(msg.headers, msg.data)
