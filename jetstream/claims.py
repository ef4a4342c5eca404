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
    NO_MESSAGE_FOUND,
    STREAM_NOT_FOUND,
    WRONG_LAST_SEQUENCE,
)

API = "$JS.API"
_KEY_RE = re.compile(r"^[A-Za-z0-9_-]{1,128}$")
_KV_OP = "KV-Operation"
_DELETED = ("DEL", "PURGE")


class ClaimsUnavailable(RuntimeError):
    """The claim store did not answer in time (or answered an error): nothing was decided."""


class NoClaimsBucket(ClaimsUnavailable):
    """The server has no JetStream, or no ``reach_claims`` bucket: claims are off."""


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


class _Info(msgspec.Struct):
    error: _ApiError | None = None


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

    async def exists(self) -> bool:
        """Whether the server has JetStream and the bucket (False: claims are off)."""
        try:
            reply = await self.nc.request(
                f"{API}.STREAM.INFO.{self.stream}", b"", timeout=self.timeout_s
            )
        except NoRespondersError:
            return False
        except (NatsTimeoutError, NatsError) as exc:
            raise ClaimsUnavailable(
                f"JetStream did not answer STREAM.INFO {self.stream} ({type(exc).__name__})"
            ) from None
        err = _info.decode(reply.data).error
        if err is None:
            return True
        if err.err_code in (STREAM_NOT_FOUND, JS_NOT_ENABLED):
            return False
        raise ClaimsUnavailable(f"STREAM.INFO {self.stream}: {err.description}")

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

    async def get(self, key: str) -> Stored | None:
        """The stored claim of ``key`` (None: no claim, or a deleted one)."""
        last = await self._last(key)
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
                raise NoClaimsBucket(f"no stream stores {self._pre}{key} (no {self.bucket} "
                                     "bucket)")  # fmt: skip
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
            raise NoClaimsBucket(
                f"no stream stores {self._pre}{key} (no {self.bucket} bucket)"
            ) from None
        except NatsTimeoutError:
            raise ClaimsUnavailable(
                f"JetStream did not confirm the claim {key!r} within {self.timeout_s}s"
            ) from None
        except NatsError as exc:  # the connection is closed or reconnecting
            raise ClaimsUnavailable(f"claim {key!r}: {type(exc).__name__}: {exc}") from None
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

    async def _last(self, key: str) -> tuple[Stored, bool] | None:
        """(the last message of ``key``, is it a delete marker), or None."""
        body = _encoder.encode({"last_by_subj": self._pre + key})
        try:
            msg = await self.nc.request(self._get, body, timeout=self.timeout_s)
        except NoRespondersError:
            raise NoClaimsBucket(f"no message get answers for {self.stream}") from None
        except NatsTimeoutError:
            raise ClaimsUnavailable(
                f"JetStream did not return the claim {key!r} within {self.timeout_s}s"
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
