"""A small HTTP/1.1 server on asyncio: GET and HEAD, one request per connection, and
responses that stream (server-sent events).

Just what the broker's HTTP port needs — ``/metrics``, the console's page, its JSON and its
event stream — without a web framework: the request line and headers are read with limits
(size, count, time), the handler returns a :class:`Response` or a :class:`Stream`, and the
connection closes after it. Every connection is a task of the server, cancelled at
:meth:`HttpServer.stop`, so an open event stream never holds the broker's shutdown.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import urllib.parse
from collections.abc import Awaitable, Callable
from http import HTTPStatus
from typing import NamedTuple, Protocol

log = logging.getLogger(__name__)

MAX_HEAD_BYTES = 16 * 1024
"""Request line and headers together; a larger head is answered 431."""
MAX_HEADERS = 64
HEAD_TIMEOUT_S = 10.0
"""A client that has not sent its whole head by then is disconnected."""


class Request(NamedTuple):
    method: str
    path: str
    """The percent-decoded path, without the query."""
    query: dict[str, str]
    """The query's parameters (the last one of a repeated name)."""
    headers: dict[str, str]
    """Header names lowercased."""


class Response(NamedTuple):
    status: int
    body: bytes = b""
    content_type: str = "text/plain; charset=utf-8"
    headers: tuple[tuple[str, str], ...] = ()


class Stream(Protocol):
    """A response that writes its own body after the headers, until it ends or the client
    goes away (``closed`` is set when the client has closed its side)."""

    status: int
    content_type: str
    headers: tuple[tuple[str, str], ...]

    async def run(self, writer: asyncio.StreamWriter, closed: asyncio.Event) -> None: ...


Handler = Callable[[Request], Awaitable[Response | Stream]]


def text(status: int, message: str, headers: tuple[tuple[str, str], ...] = ()) -> Response:
    return Response(status, (message + "\n").encode(), headers=headers)


class BadRequest(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def parse_head(head: bytes) -> Request:
    """The request of a head (request line and headers, up to the blank line)."""
    try:
        lines = head.decode("latin-1").split("\r\n")
    except UnicodeDecodeError:  # latin-1 decodes any byte; kept for clarity
        raise BadRequest(400, "undecodable request") from None
    parts = lines[0].split(" ")
    if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
        raise BadRequest(400, f"not an HTTP/1.x request line: {lines[0][:80]!r}")
    method, target, _ = parts
    if len(lines) - 1 > MAX_HEADERS:
        raise BadRequest(431, f"more than {MAX_HEADERS} header lines")
    headers: dict[str, str] = {}
    for line in lines[1:]:
        if not line:
            continue
        name, sep, value = line.partition(":")
        if not sep or not name or name != name.strip():
            raise BadRequest(400, f"malformed header line {line[:80]!r}")
        headers[name.lower()] = value.strip()
    split = urllib.parse.urlsplit(target)
    if not split.path.startswith("/"):
        raise BadRequest(400, f"request target {target[:80]!r} is not a path")
    query = dict(urllib.parse.parse_qsl(split.query, keep_blank_values=True))
    return Request(method, urllib.parse.unquote(split.path), query, headers)


def head_bytes(status: int, content_type: str, headers: tuple[tuple[str, str], ...],
               length: int | None) -> bytes:  # fmt: skip
    reason = HTTPStatus(status).phrase
    lines = [f"HTTP/1.1 {status} {reason}", f"Content-Type: {content_type}"]
    if length is not None:
        lines.append(f"Content-Length: {length}")
    lines += ["Connection: close", *(f"{k}: {v}" for k, v in headers), "", ""]
    return "\r\n".join(lines).encode("latin-1")


class HttpServer:
    """Serves ``handler`` on ``host:port`` (port 0: any free one, see :attr:`port`)."""

    def __init__(self, host: str, port: int, handler: Handler) -> None:
        self.host = host
        self.port = port
        self.handler = handler
        self._server: asyncio.Server | None = None
        self._conns: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        """Listen (raises OSError when the address is taken or not ours)."""
        if self._server is not None:
            return
        self._server = await asyncio.start_server(self._accept, self.host, self.port,
                                                  limit=MAX_HEAD_BYTES)  # fmt: skip
        self.port = self._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        """Stop listening and end every open connection (event streams included)."""
        if self._server is None:
            return
        server, self._server = self._server, None
        server.close()
        for task in list(self._conns):
            task.cancel()
        await asyncio.gather(*self._conns, return_exceptions=True)
        await server.wait_closed()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._conns.add(task)
        try:
            await self._serve(reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass  # the client went away
        except Exception:  # noqa: BLE001 - one connection's failure never stops the server
            log.exception("http.failed peer=%s", writer.get_extra_info("peername"))
        finally:
            self._conns.discard(task)
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), HEAD_TIMEOUT_S)
            req = parse_head(head[:-4])
        except TimeoutError:
            return
        except asyncio.LimitOverrunError:
            await self._send(writer, "GET", text(431, "request head too large"))
            return
        except BadRequest as exc:
            await self._send(writer, "GET", text(exc.status, str(exc)))
            return
        if req.method not in ("GET", "HEAD"):
            await self._send(writer, "GET", text(405, f"{req.method} not allowed: read-only",
                                                 (("Allow", "GET, HEAD"),)))  # fmt: skip
            return
        resp = await self.handler(req)
        if isinstance(resp, Response):
            await self._send(writer, req.method, resp)
            return
        writer.write(head_bytes(resp.status, resp.content_type, resp.headers, None))
        await writer.drain()
        if req.method == "HEAD":
            return
        closed = asyncio.Event()
        watch = asyncio.ensure_future(self._watch_eof(reader, closed))
        try:
            await resp.run(writer, closed)
        finally:
            watch.cancel()

    @staticmethod
    async def _watch_eof(reader: asyncio.StreamReader, closed: asyncio.Event) -> None:
        with contextlib.suppress(Exception):
            while await reader.read(1024):
                pass
        closed.set()

    @staticmethod
    async def _send(writer: asyncio.StreamWriter, method: str, resp: Response) -> None:
        writer.write(head_bytes(resp.status, resp.content_type, resp.headers, len(resp.body)))
        if method != "HEAD":
            writer.write(resp.body)
        await writer.drain()
