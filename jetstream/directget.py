"""A stream's stored values read by JetStream's batched direct get: a page a round trip.

``$JS.API.DIRECT.GET.<stream>`` with ``{"next_by_subj": <filter>, "batch": N, "seq": S,
"no_hdr": true}`` (batches since nats-server 2.11, ``no_hdr`` since 2.12; ADR-31; the stream
needs ``allow_direct``): the server sends the stored messages matching the filter from
sequence S on, up to N, to the reply inbox, then an end-of-batch status, ``204 EOB`` with
``Nats-Num-Pending`` (how many are left) and ``Nats-Last-Sequence`` (the page's last
message). The next page starts after that sequence; the read ends when a page finds nothing
(``404``) or none is left. No consumer is made and nothing is acknowledged: one request and
one status a page, where a KV watch (an ordered push consumer) costs a consumer, its flow
control and its bookkeeping per message.

Measured choices (``python -m loadtest.restorecost``, loadtest/README.md):

- ``no_hdr``: each answer is its payload alone. With headers (``Nats-Stream``,
  ``Nats-Subject``, ``Nats-Sequence``, ``Nats-Time-Stamp``, ``Nats-Num-Pending``,
  ``Nats-Last-Sequence``) nats-py parses six header lines a message, most of the client's
  time. The price: the subject is not handed out, so the caller finds which key a value is
  from in the value itself. A KV delete or purge marker has no payload: left out. With
  ``no_hdr`` nats-server (2.15.1) does not count the page's messages off the EOB's
  ``Nats-Num-Pending``: the read then ends on the next page's ``404``, one round trip more.
  A 2.11 server ignores ``no_hdr`` and sends the headers: read all the same.
- ``next_by_subj``, not ``multi_last``: the server answers ``multi_last`` with ``413 Too
  Many Results`` as soon as its filter matches more than 1,024 subjects, whatever the
  ``batch`` (nats-server ``getDirectMulti``, ``maxAllowedResponses``; checked on 2.15.1).
  ``next_by_subj`` hands out every stored message of the filter, in sequence order: with one
  message per subject (a KV bucket with ``history=1``) each key's value once. A key written
  again while the pages are read moves past the cursor and is read again, later.

A stream without ``allow_direct`` has no responder (status 503), a server before 2.11
answers a batch with one message and no ``Nats-Num-Pending``, a server may refuse the
request (408) or not answer in time (a permission the connection lacks: the publish is
dropped): each raises :class:`DirectGetUnavailable`, saying which, and the caller reads
another way.
"""

from __future__ import annotations

import asyncio
import json

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from .names import H_LAST_SEQUENCE, H_NUM_PENDING, H_STATUS

BATCH = 4096
"""Messages a page asks for."""
TIMEOUT_S = 5.0
"""How long a page's end-of-batch status is awaited."""


class DirectGetUnavailable(Exception):
    """The stream does not answer batched direct gets here (the message says why)."""


async def values(
    nc: NATS,
    stream: str,
    subjects: str,
    *,
    batch: int = BATCH,
    timeout_s: float = TIMEOUT_S,
) -> list[bytes]:
    """The payloads stored in ``stream`` on ``subjects`` (a filter, wildcards allowed), in
    stream order, empty ones (a KV delete or purge marker) left out; ``batch`` a page."""
    got: list[bytes] = []
    loop = asyncio.get_running_loop()
    end: asyncio.Future[Msg] = loop.create_future()

    async def take(msg: Msg) -> None:
        hdrs = msg.headers
        # Headers on a value: a server that ignores no_hdr (2.11), which then numbers the
        # batch; without that number, an older server's one answer to a batch.
        if hdrs is None or (H_NUM_PENDING in hdrs and H_STATUS not in hdrs):
            if msg.data:
                got.append(msg.data)
        elif not end.done():
            end.set_result(msg)

    sub = await nc.subscribe(nc.new_inbox(), cb=take)
    try:
        request: dict[str, object] = {"next_by_subj": subjects, "batch": batch, "no_hdr": True}
        seq = 0
        while True:
            await nc.publish(f"$JS.API.DIRECT.GET.{stream}", json.dumps(request).encode(),
                             reply=sub.subject)  # fmt: skip
            try:
                async with asyncio.timeout(timeout_s):
                    status = await end
            except TimeoutError:
                raise DirectGetUnavailable(f"no answer within {timeout_s:g} s") from None
            end = loop.create_future()
            hdrs = status.headers or {}
            code = hdrs.get(H_STATUS)
            if code == "404":  # nothing (more) on the filter
                break
            if code != "204":
                # nats-py leaves the next header line in a 503's description
                desc = str(hdrs.get("Description", "")).split("\n", 1)[0]
                why = f"status {code} {desc}".strip()
                raise DirectGetUnavailable(why if code else "the server answers no batch")
            if int(hdrs.get(H_NUM_PENDING, "0")) == 0:
                break
            after = int(hdrs.get(H_LAST_SEQUENCE, "0"))
            if after < seq:
                raise DirectGetUnavailable(f"a page made no progress (at sequence {seq})")
            seq = request["seq"] = after + 1
    finally:
        await sub.unsubscribe()
    return got
