"""The bounded compensation queue ``REACH_COMPENSATION``: enqueue, and the broker's reading side.

One subject per capability, ``reach.comp.<capability>``; an entry is the task payload with
the task headers plus ``Nats-Msg-Id`` = request id (a second enqueue of the same id within
the stream's duplicate window is recognised, not stored twice), ``Reach-Priority`` and
``Reach-Expires-Ms``. The stream is a work queue with ``max_msgs`` and discard *new*: at the
bound the server refuses the publish (err_code 10077) and :func:`enqueue` raises
:class:`QueueFull`, so nothing is dropped silently and nothing is half-stored.

Expiry is a header checked by the broker (at replay, and by a periodic sweep for
capabilities nobody serves), not a JetStream per-message TTL: a TTL-expired message
disappears without trace, but an expired entry must be recorded as ``failed``/``expired``
on ``REACH_ACKS`` so the caller's ``wait()`` learns what happened.

Replay reads a capability through one durable pull consumer shared by every broker replica
(explicit acks): a fetched entry is held by one replica only; if that replica dies before
acking, the entry is redelivered after ``ack_wait``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Mapping
from typing import Any, NamedTuple

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.errors import NoRespondersError
from nats.js import api
from nats.js.errors import APIError, NoStreamResponseError, NotFoundError

from .names import (
    COMP_STREAM,
    H_BODY_DIGEST,
    H_ENQUEUED_MS,
    H_EXPIRES_MS,
    H_MSG_ID,
    H_PRIORITY,
    H_REQUEST_ID,
    MAX_MSGS_EXCEEDED,
    MSG_DELETE_FAILED,
    NO_MESSAGE_FOUND,
    QUEUE_HEADERS,
    StreamSubjects,
    replay_consumer,
)

log = logging.getLogger(__name__)


class QueueError(RuntimeError):
    """The queue could not take an entry (no JetStream, no answer)."""


class QueueFull(QueueError):
    """The queue is at its bound (discard new): the entry was refused, not stored."""


class EnqueueResult(NamedTuple):
    seq: int
    duplicate: bool


async def enqueue(
    nc: NATS,
    capability: str,
    payload: bytes,
    *,
    request_id: str,
    priority: int = 0,
    expires_at_ms: int,
    headers: Mapping[str, str] | None = None,
    subjects: StreamSubjects,
    timeout_s: float = 2.0,
    body_digest: str | None = None,
) -> EnqueueResult:
    """Store one entry; raise QueueFull at the bound. ``duplicate`` when already queued (the
    entry stored first is ``seq``: :func:`digest_at` reads its body's digest)."""
    hdrs = dict(headers or {})
    if body_digest is not None:
        hdrs[H_BODY_DIGEST] = body_digest
    hdrs[H_MSG_ID] = request_id
    hdrs[H_REQUEST_ID] = request_id
    hdrs[H_PRIORITY] = str(int(priority))
    hdrs[H_EXPIRES_MS] = str(int(expires_at_ms))
    hdrs[H_ENQUEUED_MS] = str(int(time.time() * 1000))
    js = nc.jetstream(timeout=timeout_s)
    subject = subjects.comp(capability)
    try:
        ack = await js.publish(subject, payload, headers=hdrs)
    except APIError as exc:
        if exc.err_code == MAX_MSGS_EXCEEDED:
            raise QueueFull(
                f"compensation queue {COMP_STREAM} is full: {exc.description}"
            ) from None
        raise QueueError(f"enqueue on {COMP_STREAM} failed: {exc.description}") from None
    except (NoStreamResponseError, NoRespondersError):
        raise QueueError(
            f"no JetStream stream {COMP_STREAM} answers on {subject} "
            "(is a broker with JetStream provisioned?)"
        ) from None
    except TimeoutError:
        raise QueueError(f"enqueue on {COMP_STREAM}: no PubAck within {timeout_s}s") from None
    return EnqueueResult(ack.seq, bool(ack.duplicate))


async def digest_at(nc: NATS, seq: int, timeout_s: float = 2.0) -> str | None:
    """The body digest of the entry stored at ``seq`` (a message get: its headers as
    stored); None when it is gone (replayed and removed) or carries none."""
    js = nc.jetstream(timeout=timeout_s)
    try:
        raw = await js.get_msg(COMP_STREAM, seq)
    except NotFoundError:
        return None
    return (raw.headers or {}).get(H_BODY_DIGEST)


# --- reading side (the broker) ----------------------------------------------------------


class Entry(NamedTuple):
    """One queued task as the replayer sees it."""

    capability: str
    request_id: str
    priority: int
    expires_at_ms: int
    enqueued_ms: int
    seq: int
    headers: dict[str, str]
    data: bytes
    msg: Msg | None

    def task_headers(self) -> dict[str, str]:
        """The caller's task headers, without the queue's own."""
        return {k: v for k, v in self.headers.items() if k not in QUEUE_HEADERS}

    def expired(self, now_ms: int) -> bool:
        return 0 < self.expires_at_ms <= now_ms

    @property
    def body_digest(self) -> str | None:
        """The digest of its body, as ``submit`` stamped it (None: a raw or older
        publisher's entry)."""
        return self.headers.get(H_BODY_DIGEST)


def header_int(headers: Mapping[str, str], key: str, default: int = 0) -> int:
    """An integer queue header (priority, expiry), ``default`` when absent or malformed."""
    try:
        return int(headers.get(key, default))
    except (TypeError, ValueError):
        return default


def parse_entry(subject: str, headers: Mapping[str, str] | None, data: bytes, seq: int,
                msg: Msg | None, subjects: StreamSubjects) -> Entry:  # fmt: skip
    h = {k: v for k, v in (headers or {}).items() if not k.startswith("Nats-") or k == H_MSG_ID}
    rid = h.get(H_REQUEST_ID) or h.get(H_MSG_ID) or ""
    return Entry(
        capability=subjects.capability_of_comp(subject),
        request_id=rid,
        priority=header_int(h, H_PRIORITY),
        expires_at_ms=header_int(h, H_EXPIRES_MS),
        enqueued_ms=header_int(h, H_ENQUEUED_MS),
        seq=seq,
        headers=h,
        data=data,
        msg=msg,
    )


def entry_of(msg: Msg, subjects: StreamSubjects) -> Entry:
    return parse_entry(
        msg.subject, msg.headers, msg.data, msg.metadata.sequence.stream, msg, subjects
    )


async def ensure_consumer(
    nc: NATS, capability: str, *, ack_wait_s: float, max_ack_pending: int,
    subjects: StreamSubjects, timeout_s: float = 2.0,
) -> Any:  # fmt: skip
    """The shared durable pull consumer of ``capability`` (created or updated), bound."""
    js = nc.jetstream(timeout=timeout_s)
    name = replay_consumer(capability)
    subject = subjects.comp(capability)
    cfg = api.ConsumerConfig(
        durable_name=name,
        description=f"reach replay of {subject}",
        filter_subject=subject,
        ack_policy=api.AckPolicy.EXPLICIT,
        deliver_policy=api.DeliverPolicy.ALL,
        ack_wait=ack_wait_s,
        max_deliver=-1,
        max_ack_pending=max_ack_pending,
        inactive_threshold=7 * 24 * 3600.0,
    )
    await js.add_consumer(COMP_STREAM, cfg)
    return await js.pull_subscribe_bind(durable=name, stream=COMP_STREAM)


FETCH_BATCH = 256


async def take(psub: Any, subjects: StreamSubjects) -> list[Entry] | None:
    """Every entry the capability's durable consumer ``psub`` gives this reader now, by
    priority then age (fetched, not acked: the caller acks, naks or holds each); None when
    the consumer has nothing pending nor unacknowledged."""
    info = await psub.consumer_info()
    waiting = int(info.num_pending or 0) + int(info.num_ack_pending or 0)
    if waiting == 0:
        return None
    msgs: list[Msg] = []
    try:
        while len(msgs) < waiting:
            try:
                got = await psub.fetch(batch=min(waiting - len(msgs), FETCH_BATCH), timeout=0.3)
            except TimeoutError:
                break
            msgs += got
            if len(got) < FETCH_BATCH:
                break
    except BaseException:
        # Cancelled between two fetches (its broker stopping), or a fetch failed (JetStream
        # away: its round fails): what came is given back now, not held until the consumer's
        # ack_wait; asked for 1 s, as a stopping delivery's (nemesis seed 74: 36 submits ran
        # one ack_wait, 15 s, after they were queued, while rounds failed "503" and "nats:
        # timeout").
        await asyncio.gather(*(give_back(m, within_s=1.0) for m in msgs),
                             return_exceptions=True)  # fmt: skip
        raise
    entries = [entry_of(m, subjects) for m in msgs]
    entries.sort(key=lambda e: (-e.priority, e.enqueued_ms, e.seq))
    return entries


GIVE_BACK_TRY_S = 0.5
"""How long one try of :func:`give_back` waits for the server's answer."""
GIVE_BACK_WITHIN_S = 10.0
"""How long :func:`give_back` asks in all: a node stopped for 7.6 s and the consumer's
election after it outlasted 5 s (nemesis seed 38: ten entries given back then came back after
ack_wait, 30 s after their submit, and their callers' waits had given up)."""


async def give_back(msg: Msg, *, delay_s: float | None = None,
                    within_s: float = GIVE_BACK_WITHIN_S) -> bool:  # fmt: skip
    """Nak a fetched entry (redelivered at once, or after ``delay_s``) and wait for the
    server to say it took the nak, asking again while nobody answers (the consumer electing
    a leader: no responders, or no answer) for up to ``within_s``. True once answered; False
    (said at warning) when it never was: the entry then comes back after the consumer's
    ``ack_wait``.

    Not ``Msg.nak``: a nak published while the consumer has no leader reaches nobody, and the
    entry came back only after the consumer's ``ack_wait`` (nemesis seed 37: nine entries
    given back during an election ran 30 s after their submit, with agents idle)."""
    payload = Msg.Ack.Nak
    if delay_s:
        payload += b" " + json.dumps({"delay": int(delay_s * 1e9)}).encode()
    deadline = time.monotonic() + within_s
    while True:
        try:
            await msg._client.request(msg.reply, payload, timeout=GIVE_BACK_TRY_S)
            return True
        except (NoRespondersError, TimeoutError) as exc:
            if time.monotonic() >= deadline:
                log.warning("compensation.give_back_unconfirmed subject=%s seq=%s error=%s: "
                            "no answer within %g s; the entry comes back after the consumer's "
                            "ack_wait", msg.subject, _stream_seq(msg), type(exc).__name__,
                            within_s)  # fmt: skip
                return False
            await asyncio.sleep(0.1)  # no responders answers at once: not a busy loop


def _stream_seq(msg: Msg) -> int | None:
    try:
        return int(msg.metadata.sequence.stream)
    except Exception:  # noqa: BLE001 - a message not from a consumer: no metadata
        return None


async def depths(
    nc: NATS, subjects: StreamSubjects, timeout_s: float = 2.0
) -> tuple[int, dict[str, int]]:
    """Total entries and entries per capability, from the stream's state."""
    reply = await nc.request(
        f"$JS.API.STREAM.INFO.{COMP_STREAM}",
        json.dumps({"subjects_filter": subjects.all_comp}).encode(),
        timeout=timeout_s,
    )
    info = json.loads(reply.data)
    if "error" in info:
        raise QueueError(f"stream info {COMP_STREAM}: {info['error'].get('description')}")
    state = info.get("state", {})
    of = subjects.capability_of_comp
    per = {of(subj): n for subj, n in (state.get("subjects") or {}).items()}
    return int(state.get("messages", 0)), per


async def oldest(
    nc: NATS, capability: str, *, subjects: StreamSubjects, timeout_s: float = 2.0
) -> Entry | None:
    """The oldest entry of ``capability`` still queued (read, not taken), None when none is:
    one direct get of the first message on its subject."""
    js = nc.jetstream(timeout=timeout_s)
    try:
        raw = await js.get_msg(COMP_STREAM, seq=1, subject=subjects.comp(capability), next=True,
                               direct=True)  # fmt: skip
    except NotFoundError:
        return None
    assert raw.seq is not None and raw.subject is not None
    return parse_entry(raw.subject, raw.headers, raw.data or b"", raw.seq, None, subjects)


async def scan(nc: NATS, capability: str | None = None, *, subjects: StreamSubjects,
               limit: int = 100_000, timeout_s: float = 2.0) -> list[Entry]:  # fmt: skip
    """Every entry (of ``capability`` or all), read without taking them (direct get)."""
    js = nc.jetstream(timeout=timeout_s)
    subject = subjects.comp(capability) if capability else subjects.all_comp
    out: list[Entry] = []
    seq = 0
    while len(out) < limit:
        try:
            raw = await js.get_msg(
                COMP_STREAM, seq=seq + 1, subject=subject, next=True, direct=True
            )
        except NotFoundError:
            break
        assert raw.seq is not None and raw.subject is not None
        out.append(parse_entry(raw.subject, raw.headers, raw.data or b"", raw.seq, None, subjects))
        seq = raw.seq
    return out


async def remove(nc: NATS, seq: int, timeout_s: float = 2.0) -> bool:
    """Delete one entry by sequence; False when it was already gone."""
    js = nc.jetstream(timeout=timeout_s)
    try:
        return bool(await js.delete_msg(COMP_STREAM, seq))
    except NotFoundError:
        return False
    except APIError as exc:
        if exc.err_code in (MSG_DELETE_FAILED, NO_MESSAGE_FOUND):
            return False
        raise
