"""The claim store: KV bucket ``reach_claims``, one create-only claim per request id.

Before an agent runs a handler it *creates* the request id's key (a publish to
``$KV.reach_claims.<key>`` with ``Nats-Expected-Last-Subject-Sequence: 0``): exactly one
create succeeds fleet-wide, every other agent gets the stored claim back instead. Every
later change (the holder's ``completed``/``failed``, a broker's ``released``, a takeover) is
a compare-and-set on the revision the writer read, so two writers never both win. The
bucket's ``max_age`` is the ack records' retention: a claim lives as long as the result it
points to.

This module works on bytes (the claim's JSON is :class:`reach_agent.wire.schema.Claim`, read and
written above this floor). :class:`ClaimStore` talks to the bucket with plain requests (the
JetStream publish and the message get), so a claim costs one round trip; :func:`follow` is the
broker's read of the bucket from a start time, then live (:mod:`jetstream.follow`).
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import itertools
import re
from collections.abc import Awaitable, Callable
from typing import Any, NamedTuple

import msgspec
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.errors import Error as NatsError
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError

from .follow import UNCOUNTED, Follower, FollowMetrics, Start
from .names import (
    CLAIMS_BUCKET,
    CLAIMS_STREAM,
    H_EXPECTED_LAST_SUBJECT_SEQ,
    JS_NOT_ENABLED,
    JS_NOT_READY,
    NO_MESSAGE_FOUND,
    STREAM_NOT_FOUND,
    WRONG_LAST_SEQUENCE,
)

API = "$JS.API"
_KEY_RE = re.compile(r"^[A-Za-z0-9_-]{1,128}$")
_KV_OP = "KV-Operation"
_DELETED = ("DEL", "PURGE")
LOOK_TIMEOUT_S = 0.25
"""The longest wait for the STREAM.INFO that tells why nobody took a write: well under a
caller's receipt timeout (1 s), so the task it refuses is still answered in time."""
LOOK_REUSE_S = 1.0
"""How long that look's answer explains every write nobody took: a burst of refusals (an
election) costs JetStream one STREAM.INFO a second, not one each."""
_ELECTING = "JetStream electing a leader (a node died or restarted)"


class ClaimsUnavailable(RuntimeError):
    """The claim store did not answer in time (or answered an error): nothing was decided."""


class NoClaimsBucket(ClaimsUnavailable):
    """The server has no JetStream, or no ``reach_claims`` bucket: claims are off until the
    bucket is created."""


class NoClaimsLeader(ClaimsUnavailable):
    """Nothing took the write or the read, though JetStream is there: the bucket's stream has
    no leader now (an election after a node died), or JetStream did not say. Nothing was
    stored; it passes by itself."""


class Stored(NamedTuple):
    """A claim as stored: its revision (the stream sequence) and its JSON."""

    revision: int
    data: bytes


class _ApiError(msgspec.Struct):
    code: int = 0
    err_code: int = 0
    description: str = ""


class _PubAck(msgspec.Struct):
    seq: int = 0
    error: _ApiError | None = None


class _Cluster(msgspec.Struct):
    leader: str = ""


class _Info(msgspec.Struct):
    error: _ApiError | None = None
    cluster: _Cluster | None = None


class _StoredMsg(msgspec.Struct):
    seq: int = 0
    hdrs: str = ""
    data: str = ""


class _MsgGet(msgspec.Struct):
    message: _StoredMsg | None = None
    error: _ApiError | None = None


_pub_ack = msgspec.json.Decoder(_PubAck)
_info = msgspec.json.Decoder(_Info)
_msg_get = msgspec.json.Decoder(_MsgGet)
_encoder = msgspec.json.Encoder()


def claim_key(request_id: str) -> str:
    """The key of ``request_id``: the id itself when it is a plain token (a UUID is), else
    ``h-`` and a digest, so every request id has exactly one key."""
    if _KEY_RE.match(request_id) is not None:
        return request_id
    return "h-" + hashlib.blake2b(request_id.encode(), digest_size=16).hexdigest()


class ClaimStore:
    """Create, read and compare-and-set claims in ``reach_claims`` over one connection."""

    def __init__(self, nc: NATS, *, timeout_s: float = 2.0, bucket: str = CLAIMS_BUCKET) -> None:
        self.nc = nc
        self.timeout_s = timeout_s
        self.bucket = bucket
        self.stream = f"KV_{bucket}"
        self._pre = f"$KV.{bucket}."
        # A message get, not a direct get: a direct get's answer is the stored value itself,
        # sent to whatever reply subject the requester names (the server never checks it),
        # so a claim written as `{}` and read with reply `$JS.API.STREAM.DELETE.<stream>`
        # deletes that stream. A message get's answer is wrapped in JSON: never an empty
        # request to the JetStream API.
        self._get = f"{API}.STREAM.MSG.GET.{self.stream}"
        self._create_headers = {H_EXPECTED_LAST_SUBJECT_SEQ: "0"}
        self._sub: Any = None
        self._inbox = ""
        self._tokens = itertools.count(1)
        self._waiting: dict[str, asyncio.Future[Any]] = {}
        self._looking: asyncio.Task[tuple[bool | None, str]] | None = None
        self._looked_at = float("-inf")

    async def exists(self) -> bool:
        """Whether the server has JetStream and the bucket (False: claims are off)."""
        found, why = await self._look(self.timeout_s)
        if found is None:
            raise ClaimsUnavailable(why)
        return found

    async def _look(self, timeout_s: float) -> tuple[bool | None, str]:
        """Whether the bucket's stream exists, by one STREAM.INFO, and what it showed: True,
        False (no JetStream, no stream), None (JetStream did not say)."""
        try:
            reply = await self.nc.request(f"{API}.STREAM.INFO.{self.stream}", b"",
                                          timeout=timeout_s)  # fmt: skip
            info = _info.decode(reply.data)
        except NoRespondersError:
            return False, f"no JetStream on this server (nothing answers STREAM.INFO {self.stream})"
        except (NatsTimeoutError, NatsError) as exc:
            why = f"did not answer STREAM.INFO {self.stream} within {timeout_s}s"
            return None, f"JetStream {why} ({type(exc).__name__})"
        except msgspec.MsgspecError:
            return None, f"STREAM.INFO {self.stream}: not an answer: {reply.data[:80]!r}"
        err = info.error
        if err is not None:
            if err.err_code in (STREAM_NOT_FOUND, JS_NOT_ENABLED):
                return False, f"no {self.bucket} bucket on this server ({err.description})"
            return None, f"STREAM.INFO {self.stream}: {err.description}"
        if info.cluster is not None and not info.cluster.leader:
            return True, f"{self.stream} exists but has no leader now"
        if info.cluster is not None:
            return True, (f"{self.stream} exists, its leader {info.cluster.leader} not yet "
                          "taking writes")  # fmt: skip
        return True, f"{self.stream} exists"

    async def _not_taken(self, key: str) -> ClaimsUnavailable:
        """Why nobody took a write of ``key`` ("no responders", or a 503 answer): no bucket,
        or one whose stream has no leader now. On this error path only, one STREAM.INFO
        (:data:`LOOK_TIMEOUT_S`) says which; concurrent and following writes nobody took
        share it for :data:`LOOK_REUSE_S`."""
        loop = asyncio.get_running_loop()
        look = self._looking
        if look is None or loop.time() - self._looked_at >= LOOK_REUSE_S:
            look = loop.create_task(self._look(min(self.timeout_s, LOOK_TIMEOUT_S)))
            self._looking, self._looked_at = look, loop.time()
        found, why = await asyncio.shield(look)
        if found is False:
            return NoClaimsBucket(f"no stream stores {self._pre}{key}: {why}")
        return NoClaimsLeader(f"no stream took {self._pre}{key}: {why}; most likely "
                              f"{_ELECTING}; nothing was stored")  # fmt: skip

    async def create(self, key: str, data: bytes) -> tuple[bool, Stored]:
        """Store ``data`` under ``key`` if nobody has: (True, ours) or (False, the stored one)."""
        expected = "0"
        for _ in range(4):
            revision = await self._write(key, data, expected)
            if revision is not None:
                return True, Stored(revision, data)
            last = await self._last(key)
            if last is None:
                expected = "0"  # it expired between our create and our read
                continue
            stored, deleted = last
            if not deleted:
                return False, stored
            expected = str(stored.revision)  # a deleted key: create over its tombstone
        raise ClaimsUnavailable(f"claim {key!r} changed under every create attempt")

    async def get(self, key: str, timeout_s: float | None = None) -> Stored | None:
        """The stored claim of ``key`` (None: no claim, or a deleted one), within
        ``timeout_s`` (default: the store's)."""
        last = await self._last(key, timeout_s)
        if last is None or last[1]:
            return None
        return last[0]

    async def swap(self, key: str, data: bytes, revision: int) -> int | None:
        """Replace the claim at ``revision`` by ``data``: its new revision, or None when the
        claim moved on since (someone else changed it first)."""
        return await self._write(key, data, str(revision))

    async def swap_soon(
        self, key: str, data: bytes, revision: int
    ) -> Callable[[], Awaitable[int | None]]:
        """:meth:`swap`, sent now and confirmed later: on return the compare-and-set is on
        the connection ahead of anything published after it (so the server has it before,
        say, the reply it must precede), and awaiting the returned function gives what
        :meth:`swap` returns. A holder ends its claim this way: one round trip less."""
        if self._sub is None:
            self._inbox = self.nc.new_inbox()
            self._sub = await self.nc.subscribe(f"{self._inbox}.*", cb=self._on_reply)
        token = format(next(self._tokens), "x")
        answer: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._waiting[token] = answer
        headers = {H_EXPECTED_LAST_SUBJECT_SEQ: str(revision)}
        try:
            await self.nc.publish(self._pre + key, data, reply=f"{self._inbox}.{token}",
                                  headers=headers)  # fmt: skip
        except NatsError as exc:
            self._waiting.pop(token, None)
            raise ClaimsUnavailable(f"claim {key!r}: {type(exc).__name__}: {exc}") from None

        async def confirmed() -> int | None:
            try:
                async with asyncio.timeout(self.timeout_s):
                    msg = await answer
            except TimeoutError:
                raise ClaimsUnavailable(
                    f"JetStream did not confirm the claim {key!r} within {self.timeout_s}s"
                ) from None
            finally:
                self._waiting.pop(token, None)
            if not msg.data and (msg.headers or {}).get("Status") == "503":
                raise await self._not_taken(key)  # no responders
            self._looked_at = float("-inf")  # taken: why the last was not is no answer now
            return self._revision_of(key, msg.data)

        return confirmed

    async def _on_reply(self, msg: Any) -> None:
        answer = self._waiting.pop(msg.subject.rpartition(".")[2], None)
        if answer is not None and not answer.done():
            answer.set_result(msg)

    async def _write(self, key: str, data: bytes, expected: str) -> int | None:
        headers = self._create_headers if expected == "0" else {H_EXPECTED_LAST_SUBJECT_SEQ:
                                                                 expected}  # fmt: skip
        try:
            reply = await self.nc.request(
                self._pre + key, data, timeout=self.timeout_s, headers=headers
            )
        except NoRespondersError:
            raise await self._not_taken(key) from None
        except NatsTimeoutError:
            raise ClaimsUnavailable(
                f"JetStream did not confirm the claim {key!r} within {self.timeout_s}s"
            ) from None
        except NatsError as exc:  # the connection is closed or reconnecting
            raise ClaimsUnavailable(f"claim {key!r}: {type(exc).__name__}: {exc}") from None
        self._looked_at = float("-inf")  # taken: why the last was not is no answer now
        return self._revision_of(key, reply.data)

    @staticmethod
    def _revision_of(key: str, pub_ack: bytes) -> int | None:
        """The new revision a PubAck names; None for a lost compare-and-set."""
        try:
            ack = _pub_ack.decode(pub_ack)
        except msgspec.MsgspecError:
            raise ClaimsUnavailable(f"claim {key!r}: not a PubAck: {pub_ack[:80]!r}") from None
        if ack.error is None:
            return ack.seq
        if ack.error.err_code in WRONG_LAST_SEQUENCE:
            return None
        raise ClaimsUnavailable(f"claim {key!r}: {ack.error.description}")

    async def _last(self, key: str, timeout_s: float | None = None) -> tuple[Stored, bool] | None:
        """(the last message of ``key``, is it a delete marker), or None."""
        body = _encoder.encode({"last_by_subj": self._pre + key})
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        try:
            msg = await self.nc.request(self._get, body, timeout=timeout_s)
        except NoRespondersError:
            raise NoClaimsBucket(
                f"no JetStream on this server (nothing answers the message get of {self.stream})"
            ) from None
        except NatsTimeoutError:
            raise ClaimsUnavailable(
                f"JetStream did not return the claim {key!r} within {timeout_s}s"
            ) from None
        except NatsError as exc:
            raise ClaimsUnavailable(f"claim {key!r}: {type(exc).__name__}: {exc}") from None
        try:
            answer = _msg_get.decode(msg.data)
        except msgspec.MsgspecError:
            raise ClaimsUnavailable(f"claim {key!r}: not a message: {msg.data[:80]!r}") from None
        if answer.error is not None:
            if answer.error.err_code == NO_MESSAGE_FOUND:
                return None
            if answer.error.err_code in (STREAM_NOT_FOUND, JS_NOT_ENABLED):
                raise NoClaimsBucket(f"no {self.bucket} bucket: {answer.error.description}")
            if answer.error.err_code == JS_NOT_READY:
                raise NoClaimsLeader(f"claim {key!r} not read: {answer.error.description}; "
                                     f"most likely {_ELECTING}")  # fmt: skip
            raise ClaimsUnavailable(f"claim {key!r}: {answer.error.description}")
        stored = answer.message
        if stored is None:
            raise ClaimsUnavailable(f"claim {key!r}: a message get without a message")
        headers = base64.b64decode(stored.hdrs) if stored.hdrs else b""
        deleted = any(f"{_KV_OP}: {op}".encode() in headers for op in _DELETED)
        return Stored(stored.seq, base64.b64decode(stored.data) if stored.data else b""), deleted


ClaimCallback = Callable[[str, int, bytes], Awaitable[None]]
"""Told of every stored claim: (key, revision, JSON)."""


async def follow(
    nc: NATS,
    cb: ClaimCallback,
    *,
    since: float,
    bucket: str = CLAIMS_BUCKET,
    metrics: FollowMetrics = UNCOUNTED,
) -> Follower:
    """Every claim written since ``since`` (Unix seconds), then live, in order, each once,
    through a :class:`~jetstream.follow.Follower` named ``claims`` (rebuilt after a reconnect,
    a node loss or its deletion). Returns it started (``stop()`` ends it)."""
    stream = CLAIMS_STREAM if bucket == CLAIMS_BUCKET else f"KV_{bucket}"
    pre = f"$KV.{bucket}."
    cut = len(pre)

    async def on_msg(msg: Msg) -> None:
        if (msg.headers or {}).get(_KV_OP) in _DELETED:
            return
        await cb(msg.subject[cut:], msg.metadata.sequence.stream, msg.data)

    follower = Follower(nc, on_msg, name="claims", stream=stream, subject=pre + ">",
                        start=Start.at_time(since), metrics=metrics)  # fmt: skip
    await follower.start()
    return follower
