"""A loopback TCP proxy a test or a fault-injection run can cut: put it between a client and
a nats-server.

    async with TcpProxy("127.0.0.1", server_port) as proxy:
        nc = await nats.connect(proxy.url)
        await proxy.cut()        # hard: every live connection is closed
        await proxy.blackhole()  # silent: connections stay open, nothing is forwarded
        await proxy.restore()    # forwarding again, on the same port

A hard cut is what a client sees when its server or a middlebox drops the connection: an
immediate disconnect. A blackhole is a partition: nothing arrives, nothing fails, and only
the peers' pings tell (nats-py after ``ping_interval * max_outstanding_pings``, the server
after its ``ping_interval * ping_max``). Bytes read during a blackhole are held, not
dropped, and delivered on restore, as TCP would after a partition heals.

In both, new connections are refused until the restore (the listening socket is closed and
opened again on the same port). Accepting and then closing them would look more like a
partition to the client, but nats-py leaks the socket of a reconnect that fails during the
handshake (a ResourceWarning, an error under the test suite's warning filter).

``python -m loadtest.tcpproxy --links FILE`` runs named proxies in a process of their own,
driven by one command a line on stdin (``loadtest.nemesis`` uses it, so proxying never
competes with the run's own bookkeeping for its event loop):

    add NAME HOST:PORT   → {"event": "add", "name": NAME, "port": P}   (a proxy to HOST:PORT)
    cut OWNER            → {"event": "cut", "names": [...]}            (every NAME "OWNER.…")
    stall OWNER          → {"event": "stall", "names": [...]}          (a blackhole)
    restore OWNER        → {"event": "restore", "names": [...]}

Each proxied connection's opening and end is a JSON line in FILE (``name``, ``link``,
``ev``: open/close, ``t``: Unix time), so a run knows which server each owner was linked to
when. EOF on stdin (or ``quit``) stops every proxy.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from collections.abc import Callable
from types import TracebackType
from typing import Literal

State = Literal["open", "cut", "blackhole"]
LinkEvent = Literal["open", "close"]
_CHUNK = 65536


class TcpProxy:
    """Forwards every connection on ``host:port`` (0: a free port) to the upstream."""

    def __init__(self, upstream_host: str, upstream_port: int, *, host: str = "127.0.0.1",
                 port: int = 0,
                 on_link: Callable[[LinkEvent, int], None] | None = None) -> None:  # fmt: skip
        self.upstream = (upstream_host, upstream_port)
        self.on_link = on_link
        """Told of each proxied connection's opening and end (its number: accept order)."""
        self.host = host
        self.port = port
        self.state: State = "open"
        self.accepted = 0
        """Connections accepted since start."""
        self.held = 0
        """Chunks read during a blackhole and not yet forwarded."""
        self._flowing = asyncio.Event()
        self._flowing.set()
        self._server: asyncio.Server | None = None
        self._links: set[asyncio.Task[None]] = set()
        self._writers: set[asyncio.StreamWriter] = set()

    @classmethod
    def to_url(cls, url: str) -> TcpProxy:
        """A proxy to ``nats://host:port``."""
        host, _, port = url.rpartition("//")[2].rpartition(":")
        return cls(host, int(port))

    @property
    def url(self) -> str:
        return f"nats://{self.host}:{self.port}"

    @property
    def connections(self) -> int:
        """Live proxied connections."""
        return len(self._links)

    async def start(self) -> TcpProxy:
        await self._listen()
        return self

    async def cut(self) -> None:
        """Close every live connection (both sides); refuse new ones until restored."""
        self.state = "cut"
        self._unlisten()
        self._flowing.set()  # a link held by a blackhole ends now instead
        # Aborted transports end the pumps' reads; the links then finish by themselves.
        for writer in list(self._writers):
            self._close(writer)

    async def blackhole(self) -> None:
        """Keep every connection open but forward nothing; refuse new ones until restored."""
        self.state = "blackhole"
        self._unlisten()
        self._flowing.clear()

    async def restore(self) -> None:
        """Forward again (held bytes first) and accept connections on the same port."""
        self.state = "open"
        self._flowing.set()
        if self._server is None:
            await self._listen()

    async def stop(self) -> None:
        await self.cut()
        if self._links:
            await asyncio.wait(set(self._links), timeout=5)

    async def _listen(self) -> None:
        self._server = await asyncio.start_server(self._accept, self.host, self.port)
        self.port = self._server.sockets[0].getsockname()[1]

    def _unlisten(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None

    async def __aenter__(self) -> TcpProxy:
        return await self.start()

    async def __aexit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.stop()

    # --- the links --------------------------------------------------------------------

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.accepted += 1
        link = self.accepted
        task = asyncio.current_task()
        assert task is not None
        self._links.add(task)
        self._writers.add(writer)
        try:
            try:
                up_reader, up_writer = await asyncio.open_connection(*self.upstream)
            except OSError:
                return
            self._writers.add(up_writer)
            if self.on_link is not None:
                self.on_link("open", link)
            try:
                pumps = [asyncio.create_task(self._pump(reader, up_writer)),
                         asyncio.create_task(self._pump(up_reader, writer))]  # fmt: skip
                try:
                    await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    for pump in pumps:
                        pump.cancel()
                    await asyncio.gather(*pumps, return_exceptions=True)
            finally:
                self._close(up_writer)
                if self.on_link is not None:
                    self.on_link("close", link)
        finally:
            self._close(writer)
            self._links.discard(task)

    async def _pump(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
        while True:
            try:
                data = await src.read(_CHUNK)
            except ConnectionError:
                return
            if not data or self.state == "cut":
                return
            if not self._flowing.is_set():
                self.held += 1
                try:
                    await self._flowing.wait()
                finally:
                    self.held -= 1
                if self.state == "cut":
                    return
            try:
                dst.write(data)
                await dst.drain()
            except ConnectionError:
                return

    def _close(self, writer: asyncio.StreamWriter) -> None:
        self._writers.discard(writer)
        writer.transport.abort()


# --- named proxies in a process of their own ----------------------------------------------


class Proxies:
    """Named proxies, driven by commands (see the module doc); link events go to a file."""

    def __init__(self, links_path: str) -> None:
        self.proxies: dict[str, TcpProxy] = {}
        self._links = os.open(links_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def _logger(self, name: str) -> Callable[[LinkEvent, int], None]:
        def log(ev: LinkEvent, link: int) -> None:
            line = {"name": name, "link": link, "ev": ev, "t": time.time()}
            os.write(self._links, (json.dumps(line) + "\n").encode())

        return log

    def owned(self, owner: str) -> list[TcpProxy]:
        return [p for n, p in self.proxies.items() if n.startswith(owner + ".")]

    async def command(self, line: str) -> dict[str, object] | None:
        """Do one command; its answer (None: not a command)."""
        words = line.split()
        if not words:
            return None
        match words:
            case ["add", name, upstream]:
                host, _, port = upstream.rpartition(":")
                proxy = TcpProxy(host, int(port), on_link=self._logger(name))
                self.proxies[name] = await proxy.start()
                return {"event": "add", "name": name, "port": proxy.port}
            case ["cut" | "stall" | "restore" as verb, owner]:
                chosen = self.owned(owner)
                for proxy in chosen:
                    await {"cut": proxy.cut, "stall": proxy.blackhole,
                           "restore": proxy.restore}[verb]()  # fmt: skip
                names = sorted(n for n, p in self.proxies.items() if p in chosen)
                return {"event": verb, "names": names}
            case _:
                return {"event": "error", "message": f"unknown command {line.strip()!r}"}

    async def stop(self) -> None:
        await asyncio.gather(*(p.stop() for p in self.proxies.values()))
        os.close(self._links)


async def serve(links_path: str) -> None:
    """Read commands on stdin until EOF or ``quit``; answer each on stdout."""
    proxies = Proxies(links_path)
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    try:
        while line := (await reader.readline()).decode():
            if line.strip() == "quit":
                break
            answer = await proxies.command(line)
            if answer is not None:
                sys.stdout.write(json.dumps(answer) + "\n")
                sys.stdout.flush()
    finally:
        await proxies.stop()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m loadtest.tcpproxy",
        description="named loopback TCP proxies, driven on stdin",
    )
    ap.add_argument("--links", required=True, help="JSON lines: each link's open and close")
    args = ap.parse_args(argv)
    asyncio.run(serve(args.links))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
