"""Reading the audit trail ``REACH_AUDIT`` (every ``reach.event.>``, delete and purge denied).

:func:`read_events` returns the stored events since a point in time, oldest first, through an
ephemeral pull consumer that is removed when done (or by the server after 30 s idle). The
``reach events`` command is meant to use it.
"""

from __future__ import annotations

import datetime as dt
from typing import NamedTuple

from nats.aio.client import Client as NATS
from nats.js import api

from .names import AUDIT_STREAM, StreamSubjects


class StoredEvent(NamedTuple):
    subject: str
    data: bytes
    seq: int
    time: dt.datetime | None


async def read_events(
    nc: NATS,
    *,
    since_s: float | None = None,
    subject: str | None = None,
    subjects: StreamSubjects,
    limit: int = 10_000,
    timeout_s: float = 2.0,
) -> list[StoredEvent]:
    """Events stored in the last ``since_s`` seconds (all when None), oldest first."""
    js = nc.jetstream(timeout=timeout_s)
    cfg = api.ConsumerConfig(
        ack_policy=api.AckPolicy.NONE,
        inactive_threshold=30.0,
        filter_subject=subject or subjects.all_events,
        mem_storage=True,
    )
    if since_s is not None:
        cfg.deliver_policy = api.DeliverPolicy.BY_START_TIME
        cfg.opt_start_time = dt.datetime.now(dt.UTC) - dt.timedelta(seconds=since_s)
    psub = await js.pull_subscribe(cfg.filter_subject or "", stream=AUDIT_STREAM, config=cfg)
    out: list[StoredEvent] = []
    try:
        pending = (await psub.consumer_info()).num_pending or 0
        while len(out) < min(pending, limit):
            try:
                msgs = await psub.fetch(batch=min(pending - len(out), 256), timeout=timeout_s)
            except TimeoutError:
                break
            for m in msgs:
                md = m.metadata
                out.append(StoredEvent(m.subject, m.data, md.sequence.stream, md.timestamp))
    finally:
        try:
            info = await psub.consumer_info()
            await js.delete_consumer(AUDIT_STREAM, info.name)
        except Exception:  # noqa: BLE001 - the server removes it after inactive_threshold
            pass
        await psub.unsubscribe()
    return out[:limit]
