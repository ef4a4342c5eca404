"""A loopback proxy in front of a real nats-server that makes one legal ordering certain: a
consumer info answered after the consumer sent its last message reaches the client, and is
acted on, *before* those messages.

nats-server answers a JetStream API request from its API's internal send queue and hands a
push consumer's deliveries to the client from the stream's outbound queue (``internalLoop``):
two senders, no order between them. So a consumer info request that arrives just after the
deliveries were made can be answered ``num_pending`` 0 and overtake every one of them on the
wire, and a client may act on that answer before the next read of its socket brings them. On
an idle machine that is rare; this proxy does it every time, by holding bytes (never dropping
or altering one):

- a ``SUB`` until the client's next operation, so both reach the server together (a
  delivery inbox is subscribed, then the consumer is made or asked about: the server starts
  no delivery the proxy could see before it knows what comes next);
- a ``$JS.API.CONSUMER.INFO`` request, and everything the client sends after it, until a
  delivery of that consumer with nothing pending after it (the ack reply's pending count 0)
  came from the server: the server has then made every delivery before it answers;
- the deliveries (messages with a ``$JS.ACK.`` reply) from that request on, until the client's
  next operation after the answer: they follow what the client did with the answer. (A
  client that waits for them in silence gets them with its next ``PING``.)

Parses the client protocol (``PUB``/``HPUB`` payloads by size) and the server's (``MSG``/
``HMSG``); everything else passes through line by line.
"""

from __future__ import annotations

import asyncio
import contextlib
from types import TracebackType

_INFO_REQUEST = b"$JS.API.CONSUMER.INFO."
_ACK = b"$JS.ACK."


def delivery_of(reply: bytes) -> tuple[bytes, int]:
    """(consumer, pending count) of a delivery's ack reply (``$JS.ACK.<stream>.<consumer>.
    <delivered>.<stream seq>.<consumer seq>.<time>.<pending>``, or the longer form with
    domain and account hash ahead and a token behind)."""
    tokens = reply.split(b".")
    if len(tokens) == 9:
        return tokens[3], int(tokens[8])
    return tokens[5], int(tokens[10])


async def _frame(
    reader: asyncio.StreamReader, sized: dict[bytes, int]
) -> tuple[bytes, list[bytes]]:
    """One protocol operation: (its bytes, its control line's words). ``sized``: the
    operations that carry a payload, and which word (from the end) gives its size."""
    line = await reader.readuntil(b"\r\n")
    words = line.split()
    at = sized.get(words[0].upper()) if words else None
    if at is None:
        return line, words
    return line + await reader.readexactly(int(words[at]) + 2), words


_CLIENT_SIZED = {b"PUB": -1, b"HPUB": -1}
_SERVER_SIZED = {b"MSG": -1, b"HMSG": -1}


class _Link:
    """One proxied connection's holding state."""

    def __init__(self, to_client: asyncio.StreamWriter) -> None:
        self.to_client = to_client
        self.asking: bytes | None = None
        """The reply subject of a consumer info request held or not yet answered."""
        self.sent_all: dict[bytes, asyncio.Event] = {}
        """Per consumer: a delivery with nothing pending after it came."""
        self.holding = False
        """Deliveries are held: from that request until the client's next operation after
        its answer."""
        self.answered = False
        """Its answer went to the client."""
        self.held: list[bytes] = []


class InfoFirstProxy:
    """Forwards connections on a free loopback port to ``upstream_port``, reordered as the
    module says."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.port = 0
        self.reordered = 0
        """Consumer info answers acted on before deliveries made before them."""
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    async def __aenter__(self) -> InfoFirstProxy:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        assert self._server is not None
        self._server.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.upstream_port)
        link = _Link(writer)
        pumps = {asyncio.create_task(self._from_client(link, reader, up_writer)),
                 asyncio.create_task(self._from_server(link, up_reader, writer))}  # fmt: skip
        self._tasks |= pumps
        try:
            await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for pump in pumps:
                pump.cancel()
            await asyncio.gather(*pumps, return_exceptions=True)
            self._tasks -= pumps
            writer.transport.abort()
            up_writer.transport.abort()

    def _release(self, link: _Link) -> None:
        """The client spoke after the answer: the held deliveries go to it now."""
        if link.held:
            self.reordered += 1
            link.to_client.write(b"".join(link.held))
        link.held, link.holding, link.answered = [], False, False

    async def _from_client(self, link: _Link, src: asyncio.StreamReader,
                           dst: asyncio.StreamWriter) -> None:  # fmt: skip
        subs: list[bytes] = []
        with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
            while True:
                frame, words = await _frame(src, _CLIENT_SIZED)
                if link.answered:
                    self._release(link)
                op = words[0].upper() if words else b""
                if op == b"SUB":
                    subs.append(frame)
                    continue
                out, subs = b"".join(subs), []
                if op == b"PUB" and words[1].startswith(_INFO_REQUEST) and len(words) == 4:
                    link.asking, link.holding = words[2], True
                    dst.write(out)
                    await dst.drain()
                    consumer = words[1].rsplit(b".", 1)[1]
                    await link.sent_all.setdefault(consumer, asyncio.Event()).wait()
                    out = b""
                dst.write(out + frame)
                await dst.drain()

    async def _from_server(self, link: _Link, src: asyncio.StreamReader,
                           dst: asyncio.StreamWriter) -> None:  # fmt: skip
        with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
            while True:
                frame, words = await _frame(src, _SERVER_SIZED)
                op = words[0].upper() if words else b""
                if op in (b"MSG", b"HMSG"):
                    reply = words[3] if len(words) == (5 if op == b"MSG" else 6) else b""
                    if reply.startswith(_ACK):
                        consumer, pending = delivery_of(reply)
                        if pending == 0:
                            link.sent_all.setdefault(consumer, asyncio.Event()).set()
                        if link.holding:
                            link.held.append(frame)
                            continue
                    elif words[1] == link.asking:
                        link.asking, link.answered = None, True
                dst.write(frame)
                await dst.drain()
