"""Where an ordered consumer that follows a stream "since a time" starts: a sequence.

nats-py (2.16) recreates an ordered consumer — after a reconnect, missed idle heartbeats or
a gap in its sequence — with ``deliver_policy: by_start_sequence`` at the next sequence but
keeps the ``opt_start_time`` it was first created with, and the server refuses that pair
(``err_code`` 10094: "consumer delivery policy is deliver by start sequence, but optional
start time is also set"). The subscription then never delivers again; only the
connection's error callback says so, every few seconds. (nats.go fixed the same in its
#1341.) So reach never gives an ordered consumer a start time: :func:`start_at` turns the
time into the first sequence stored at or after it, and the consumer starts there.
"""

from __future__ import annotations

import contextlib
from datetime import datetime
from typing import Any

from nats.js import api

PROBE_INACTIVE_S = 30.0
"""The throwaway consumer's inactivity threshold: the server removes it even if our delete
does not arrive."""


async def start_at(js: Any, stream: str, subject: str, when: datetime) -> api.ConsumerConfig:
    """The config of an ordered consumer on ``stream`` (``subject``) starting at the first
    message stored at or after ``when`` — by sequence, so its resets work. A throwaway
    consumer created from ``when`` reports the sequence before that message as its
    delivered stream sequence (the last one stored when nothing is newer)."""
    probe = await js.add_consumer(
        stream,
        config=api.ConsumerConfig(
            deliver_policy=api.DeliverPolicy.BY_START_TIME, opt_start_time=when,
            filter_subject=subject, ack_policy=api.AckPolicy.NONE,
            inactive_threshold=PROBE_INACTIVE_S,
        ),
    )  # fmt: skip
    with contextlib.suppress(Exception):
        await js.delete_consumer(stream, probe.name)
    seq = (probe.delivered.stream_seq if probe.delivered is not None else 0) + 1
    return api.ConsumerConfig(deliver_policy=api.DeliverPolicy.BY_START_SEQUENCE,
                              opt_start_seq=seq)  # fmt: skip
