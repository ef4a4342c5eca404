"""A stream's last value of each subject of a filter, read by a consumer: the read where the
stream answers no batched direct get (:mod:`jetstream.directget`: no ``allow_direct``, a
server before 2.11).

A :class:`~jetstream.follow.Follower` from the last message of each subject (a consumer of
its own: ephemeral, one replica in memory, no acks, rebuilt from the next message if lost)
hands the messages over in stream order. The read ends with the message the server sends
with nothing pending after it (its ``num_pending`` 0), or at once when the consumer, as made,
had nothing to deliver: the server takes the info it answers a consumer's creation with
before the consumer's delivery loop starts (nats-server ``consumer.go``, ``setLeader``:
``infoWithSnap(true)``, then ``go o.loopAndGatherMsgs``), so its ``num_pending`` is every
message still to come and its ``delivered`` is nothing.

Not nats-py's KV watch (``KeyValue.watch``): it learns that the initial values are done
from a consumer info it asks for *after* subscribing the delivery inbox (nats-py
``nats/js/kv.py``, ``watch``: ``consumer_info()``, then ``if cinfo.num_pending == 0 and
received == 0: put(None)``). The server answers that request from its API's send queue and
delivers the messages from the stream's own outbound queue (``internalLoop``): the answer may
say that nothing is pending (every message already handed to the outbound queue) and reach the
client before the first of them. The watch then says "no more" before handing anything over,
and the values come after that marker, to nobody: a partition restored that way held none of
its agents (``loadtest.restorecost``: 0 of 200 keys read, now and then).

:func:`messages` hands over the messages themselves (a KV delete or purge marker among them,
told by its ``KV-Operation`` header); :func:`values` their payloads, empty ones (those
markers) left out, as :func:`directget.values` leaves them out. No message for ``timeout_s``
before the end (the server stalled, the consumer could not be made again) raises
:class:`ReadStalled`: a read never ends short in silence.
"""

from __future__ import annotations

import asyncio

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from .follow import Follower, Start

TIMEOUT_S = 5.0
"""How long the read may go without a message before it gives up."""


class ReadStalled(Exception):
    """No message came for ``timeout_s`` before the last one (the message says how many
    came)."""


async def values(
    nc: NATS, stream: str, subjects: str, *, name: str = "last-values",
    timeout_s: float = TIMEOUT_S,
) -> list[bytes]:  # fmt: skip
    """The payloads last stored in ``stream`` on each subject of ``subjects`` (a filter,
    wildcards allowed), in stream order, empty ones left out. ``name``: what the follow's
    logs call it."""
    stored = await messages(nc, stream, subjects, name=name, timeout_s=timeout_s)
    return [msg.data for msg in stored if msg.data]


async def messages(
    nc: NATS, stream: str, subjects: str, *, name: str = "last-values",
    timeout_s: float = TIMEOUT_S,
) -> list[Msg]:  # fmt: skip
    """The message last stored in ``stream`` on each subject of ``subjects``, in stream
    order (as :func:`values`, markers included): one a subject. A subject written again
    while the read runs comes twice (its last value when the consumer was made, then the new
    one), and the later stands: counted as they came, the presence keys of 4 brokers read
    while one of them wrote its own made 5 or 6 (``loadtest --brokers 4 --agents 100000``),
    and the brokers handed partitions back to a share of 6 or 7 that the others took again,
    over and over."""
    got: dict[str, Msg] = {}
    came = 0  # messages, not subjects: a key written again and again is a read going on
    end = asyncio.Event()

    async def take(msg: Msg) -> None:
        nonlocal came
        came += 1
        got.pop(msg.subject, None)  # a later write of the subject: in stream order, it last
        got[msg.subject] = msg
        if msg.metadata.num_pending == 0:
            end.set()

    follower = Follower(nc, take, name=name, stream=stream, subject=subjects,
                        start=Start.last_per_subject(), timeout_s=timeout_s)  # fmt: skip
    made = await follower.start()
    try:
        delivered = made.delivered.consumer_seq if made.delivered is not None else 0
        if made.num_pending == 0 and delivered == 0:
            return []  # nothing stored on the filter
        while not end.is_set():
            before = came
            try:
                await asyncio.wait_for(end.wait(), timeout_s)
            except TimeoutError:
                if came == before:
                    raise ReadStalled(f"{len(got)} of {made.num_pending} messages of {subjects} "
                                      f"read, none for {timeout_s:g} s") from None  # fmt: skip
    finally:
        await follower.stop()
    return list(got.values())
