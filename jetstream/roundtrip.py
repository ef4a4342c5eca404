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
"""

from __future__ import annotations

import asyncio
from typing import Any

from nats.errors import ConnectionClosedError, FlushTimeoutError


async def round_trip(nc: Any, timeout_s: float) -> None:
    """Return once the server answered a PING sent now (what was written before it has
    reached the server); ``FlushTimeoutError`` after ``timeout_s``, ``ConnectionClosedError``
    on a closed connection. Without a reader or a flusher to ask with (reconnecting), the
    pending commands are written and no PING is sent, as ``nc.flush()`` does."""
    if nc.is_closed:
        raise ConnectionClosedError
    reader, flusher = nc._reading_task, nc._flusher_task
    if reader is None or reader.done() or flusher is None or flusher.done():
        await nc.flush()  # nats-py's own fallback: no PING, so no future to leave behind
        return
    pong: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
    await nc._send_ping(pong)
    try:
        async with asyncio.timeout(timeout_s):
            await asyncio.shield(pong)
    except TimeoutError:
        raise FlushTimeoutError from None
