"""A round trip to the server (PING, then its PONG) that a timeout or a cancel never turns
into a deaf connection.

nats-py 2.16's ``flush(timeout)`` queues a future for the PONG and cancels it on a timeout
(or when the flush itself is cancelled), leaving it queued. When the late PONG comes, the
connection's reader completes that cancelled future, dies of ``InvalidStateError`` ("nats:
encountered error") and reads nothing more: no reply, no PubAck, no message, until the
pings go stale and the client reconnects (4-6 s with reach's ping settings). A server that
stops for a second (SIGSTOP, a frozen node, a long pause) is enough. Here the PONG's future
is never cancelled: whoever waits gives up on a shield, and a late PONG completes it
unawaited.

A reconnect drops every PONG future nats-py queued on the old connection (its reconnect
starts a new list): the PONG a round trip waits for then never comes, and it used to wait
out its whole timeout (nemesis seed 61: a broker's partition takeover flushed its
subscriptions over a connection whose node was killed; it reconnected within 0.5 s, the
flush waited 10 s, timed out and the takeover dropped ten partitions). So a round trip
that sees the connection change under it asks again on the new one, within its timeout.
"""

from __future__ import annotations

import asyncio
from typing import Any

from nats.errors import ConnectionClosedError, FlushTimeoutError

RECHECK_S = 0.05
"""How often a round trip waiting for its PONG looks whether the connection changed."""


def _running(nc: Any) -> bool:
    """Whether the connection has the reader and flusher a PING needs (not reconnecting)."""
    reader, flusher = nc._reading_task, nc._flusher_task
    return not (reader is None or reader.done() or flusher is None or flusher.done())


async def round_trip(nc: Any, timeout_s: float) -> None:
    """Return once the server answered a PING sent now (what was written before it has
    reached the server), on the connection there is when it answers: one replaced while
    it waits (a reconnect, which sends the subscriptions again first) is asked again;
    ``FlushTimeoutError`` after ``timeout_s``, ``ConnectionClosedError`` on a closed
    connection. Without a reader or a flusher to ask with at the start (reconnecting), the
    pending commands are written and no PING is sent, as ``nc.flush()`` does."""
    if nc.is_closed:
        raise ConnectionClosedError
    if not _running(nc):
        await nc.flush()  # nats-py's own fallback: no PING, so no future to leave behind
        return
    loop = asyncio.get_running_loop()
    try:
        async with asyncio.timeout(timeout_s):
            while True:
                reader = nc._reading_task
                pong: asyncio.Future[Any] = loop.create_future()
                await nc._send_ping(pong)
                # asyncio.wait leaves the future alone (never cancelled: see above).
                while not pong.done() and nc._reading_task is reader and not nc.is_closed:
                    await asyncio.wait((pong,), timeout=RECHECK_S)
                if pong.done():
                    return
                if nc.is_closed:
                    raise ConnectionClosedError
                while not _running(nc):  # the new connection's loops, then ask again
                    await asyncio.sleep(RECHECK_S)
                    if nc.is_closed:
                        raise ConnectionClosedError
    except TimeoutError:
        raise FlushTimeoutError from None
