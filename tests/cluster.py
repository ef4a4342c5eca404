"""A real N-node NATS cluster for tests: start it, kill and restart nodes, find leaders.

    async with nats_cluster(tmp_path / "cluster", nodes=3) as cluster:
        nc = await nats.connect(cluster.urls)
        leader = await cluster.stream_leader(nc, "REACH_COMP")
        await cluster.kill(leader)
        await cluster.wait_stream_leader(nc, "REACH_COMP", not_on={leader})

The nodes are ``reach_broker.cluster.natscluster`` nodes (the same config as ``reach dev-cluster``:
APP/SYS accounts, advisories, JetStream) on free loopback ports, with their stores under the
given directory; every process is stopped when the block ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Collection
from pathlib import Path
from typing import Any

from nats.aio.client import Client as NATS
from nats.errors import NoRespondersError
from nats.js.api import PubAck, StreamInfo
from nats.js.client import JetStreamContext
from nats.js.errors import BadRequestError, ServiceUnavailableError

from jetstream.names import NO_SUITABLE_PEERS
from reach_broker.cluster.natscluster import Cluster, launch

READY_TIMEOUT_S = 30.0
FAILOVER_TIMEOUT_S = 30.0
"""A stream's new leader after its old one is SIGKILLed (the Raft election takes 4-10 s)."""
REQUEST_TIMEOUT_S = 5.0
"""One JetStream request to a stream that has a leader: what an answer may take on two noisy
cores (a publish's ack, :meth:`NatsCluster.stream_leader`'s STREAM.INFO)."""
ELECTING = (TimeoutError, NoRespondersError, ServiceUnavailableError)
"""What a JetStream API request meets while the asset it names has no leader."""


async def add_stream(
    js: JetStreamContext, within: float = READY_TIMEOUT_S, **config: Any
) -> StreamInfo:
    """``js.add_stream(**config)`` asked again until the cluster places it, within ``within``.

    A cluster whose nodes agree on a meta leader and answer ``/healthz`` may still refuse a
    replicated stream: the meta leader places replicas only on peers whose statsz it has
    had, and a node it learned of through another's route is "offline" to placement until
    its own statsz arrives (nats-server's ``nodeInfo.selectable``; 10005, "no suitable
    peers for placement, peer offline", CI at c29ae0c). So that, and an election's errors,
    are asked again; any other refusal is raised."""
    deadline = time.monotonic() + within
    while True:
        try:
            return await js.add_stream(**config)
        except BadRequestError as exc:
            if exc.err_code != NO_SUITABLE_PEERS or "peer offline" not in (exc.description or ""):
                raise
            refused: Exception = exc
        except ELECTING as exc:
            refused = exc
        if time.monotonic() > deadline:
            raise AssertionError(
                f"stream {config.get('name')} not created within {within} s: {refused!r}"
            ) from refused
        await asyncio.sleep(0.1)


class NatsCluster:
    """The tests' handle on a running :class:`Cluster` (nodes ``n1``…``nN``)."""

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster

    @property
    def names(self) -> list[str]:
        return [n.name for n in self.cluster.nodes]

    @property
    def urls(self) -> list[str]:
        return self.cluster.urls

    @property
    def servers(self) -> str:
        """The comma-separated server list (``--server``, ``NATS_URL``)."""
        return ",".join(self.urls)

    @property
    def pids(self) -> list[int | None]:
        return self.cluster.pids

    def url(self, name: str) -> str:
        return self.cluster.node(name).url

    def pid(self, name: str) -> int | None:
        return self.cluster.node(name).pid

    def running(self, name: str) -> bool:
        return self.cluster.node(name).running()

    async def wait_meta_leader(self, within: float = READY_TIMEOUT_S) -> str:
        """The meta leader once the running nodes agree on it and are healthy."""
        return await asyncio.to_thread(self.cluster.wait_ready, within)

    async def kill(self, name: str) -> None:
        """SIGKILL node ``name``; its ports and store dir are kept for :meth:`restart`."""
        await asyncio.to_thread(self.cluster.kill, name)

    async def restart(self, name: str, within: float = READY_TIMEOUT_S) -> str:
        """Start a killed node on the same ports and store dir; the meta leader once the
        cluster is ready again."""
        return await asyncio.to_thread(self.cluster.restart, name, within)

    async def stream_leader(
        self, nc: NATS, stream: str, within: float = REQUEST_TIMEOUT_S
    ) -> str | None:
        """The node leading ``stream`` (``$JS.API.STREAM.INFO``'s ``cluster.leader``), or
        ``None`` while it has none (the request times out during an election); a stream that
        does not exist is ``NotFoundError``. A leader slower to answer than ``within`` is
        taken for none."""
        try:
            info = await nc.jetstream(timeout=within).stream_info(stream)
        except ELECTING:
            return None
        return info.cluster.leader if info.cluster is not None else None

    async def wait_stream_leader(
        self,
        nc: NATS,
        stream: str,
        *,
        not_on: Collection[str] = (),
        current: bool = False,
        within: float = FAILOVER_TIMEOUT_S,
    ) -> str:
        """:meth:`wait_stream_info`'s leader: the name of the node leading ``stream``."""
        info = await self.wait_stream_info(nc, stream, not_on=not_on, current=current,
                                           within=within)  # fmt: skip
        assert info.cluster is not None and info.cluster.leader
        return info.cluster.leader

    async def wait_stream_info(
        self,
        nc: NATS,
        stream: str,
        *,
        not_on: Collection[str] = (),
        current: bool = False,
        within: float = FAILOVER_TIMEOUT_S,
    ) -> StreamInfo:
        """Wait until ``stream`` has a leader outside ``not_on``; with ``current`` also until
        the leader lists all ``num_replicas - 1`` other replicas and every one is current (has
        persisted all the leader's committed entries). Returns the stream info that showed it.

        ``current`` counts the replicas: the leader lists only the peers its Raft node has
        (a scale-up's new replica once it is added), and ``all()`` over a list missing one is
        true. A replica that is current has the entries in its log; it applies the last ones
        to its store a moment later (:meth:`wait_stored` waits for that).

        A leader answers STREAM.INFO once its Raft node leads, before it subscribes to the
        stream's subjects: a publish right after this returns can still meet no responders,
        which :meth:`publish` rides out."""
        deadline = time.monotonic() + within
        while True:
            try:
                info = await nc.jetstream(timeout=1.0).stream_info(stream)
            except ELECTING:
                info = None
            cl = info.cluster if info is not None else None
            if info is not None and cl is not None and cl.leader and cl.leader not in not_on:
                replicas = cl.replicas or []
                if not current or (
                    len(replicas) == (info.config.num_replicas or 1) - 1
                    and all(p.current for p in replicas)
                ):
                    return info
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"stream {stream} has no leader outside {sorted(not_on)} "
                    f"(current={current}) after {within} s; last: {cl}"
                )
            await asyncio.sleep(0.05)

    async def publish(
        self,
        nc: NATS,
        subject: str,
        payload: bytes,
        *,
        msg_id: str,
        within: float = FAILOVER_TIMEOUT_S,
    ) -> PubAck:
        """Publish ``payload`` to a stream's ``subject`` once, through a failover: the ack.

        Right after an election the new leader answers STREAM.INFO (:meth:`wait_stream_leader`)
        before the stream's monitor has run its leader change and subscribed the subjects, and
        the subscription reaches the server ``nc`` is on over a route after that: a publish in
        between meets no responders (nothing stored). So it is sent again on an electing error
        until ``within``, each try with the same ``Nats-Msg-Id``: a try that timed out but was
        stored is not stored twice (the stream's duplicate window; the ack of the try that is
        answered carries the first one's sequence, ``duplicate`` set)."""
        deadline = time.monotonic() + within
        js = nc.jetstream(timeout=REQUEST_TIMEOUT_S)
        while True:
            try:
                return await js.publish(subject, payload, headers={"Nats-Msg-Id": msg_id})
            except ELECTING as exc:
                if time.monotonic() > deadline:
                    raise AssertionError(
                        f"no stream took {subject} (Nats-Msg-Id {msg_id}) within {within} s: "
                        f"{exc!r}"
                    ) from exc
            await asyncio.sleep(0.05)

    async def stored(self, name: str, stream: str) -> dict[str, Any] | None:
        """Node ``name``'s own copy of ``stream``: the ``state`` its ``/jsz`` reports
        (``messages``, ``first_seq``, ``last_seq``…), ``None`` if it has none or does not
        answer. Unlike STREAM.INFO, which the leader answers whichever server is asked, this
        is what that node has applied to its store."""
        status, body = await asyncio.to_thread(
            self.cluster.node(name).get, "/jsz?accounts=true&streams=true"
        )
        if status != 200 or not body:
            return None
        for account in body.get("account_details") or []:
            for detail in account.get("stream_detail") or []:
                if detail.get("name") == stream:
                    state: dict[str, Any] = detail.get("state") or {}
                    return state
        return None

    async def wait_stored(
        self, name: str, stream: str, last_seq: int, within: float = FAILOVER_TIMEOUT_S
    ) -> dict[str, Any]:
        """Wait until node ``name``'s own copy of ``stream`` (:meth:`stored`) has applied up to
        ``last_seq``; returns that state. A replica the leader reports current has the entries
        in its log and applies them once it learns they are committed (the next append or
        heartbeat), so its store can be a message behind for a moment."""
        deadline = time.monotonic() + within
        while True:
            state = await self.stored(name, stream)
            if state is not None and int(state.get("last_seq") or 0) >= last_seq:
                return state
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"{name}'s copy of {stream} did not reach seq {last_seq} within {within} s; "
                    f"last: {state}"
                )
            await asyncio.sleep(0.05)


@contextlib.asynccontextmanager
async def nats_cluster(
    dir: Path, nodes: int = 3, *, no_advertise: bool = False
) -> AsyncIterator[NatsCluster]:
    """Start an ``nodes``-node cluster under ``dir``; stop every node at the end.
    ``no_advertise``: as the nemesis runs it (clients know only the addresses given)."""
    cluster, _ = await asyncio.to_thread(launch, nodes, dir, timeout=READY_TIMEOUT_S,
                                         no_advertise=no_advertise)  # fmt: skip
    try:
        yield NatsCluster(cluster)
    finally:
        await asyncio.to_thread(cluster.stop)
