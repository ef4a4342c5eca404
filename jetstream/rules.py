"""The route-rules bucket ``reach_rules`` on bytes: one key per capability.

Writers (``reach rules set|clear``) put and delete keys; every broker follows the bucket
(:func:`follow`: the last value of each key, then every change, through a
:class:`~jetstream.follow.Follower` that rebuilds its consumer after a reconnect, a node loss
or its deletion), so a change reaches every replica as soon as JetStream stores it. What a
value means is the broker's (:mod:`reach_agent.routing.rules`): this floor moves bytes.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js.errors import NotFoundError

from . import lastvalues
from .follow import UNCOUNTED, Follower, FollowMetrics, Start
from .names import RULES_BUCKET, RULES_STREAM

_KV_OP = "KV-Operation"
_DELETED = ("DEL", "PURGE")
_PRE = f"$KV.{RULES_BUCKET}."

RuleCallback = Callable[[str, int, bytes | None, float], Awaitable[None]]
"""Told of every stored change: (capability, revision, JSON or None when the key was deleted,
when JetStream stored it in Unix seconds)."""


def rule_subject(capability: str) -> str:
    """The KV subject of one capability's rule."""
    return _PRE + capability


async def follow(nc: NATS, cb: RuleCallback, *, metrics: FollowMetrics = UNCOUNTED) -> Follower:
    """Each capability's current rule, then every change, in order: a started
    :class:`~jetstream.follow.Follower` named ``rules`` (``stop()`` ends it). The bucket keeps
    one message per key, so a rebuild from the next sequence misses no key's last value."""
    cut = len(_PRE)

    async def on_msg(msg: Msg) -> None:
        deleted = (msg.headers or {}).get(_KV_OP) in _DELETED
        md = msg.metadata
        await cb(msg.subject[cut:], md.sequence.stream, None if deleted else msg.data,
                 md.timestamp.timestamp())  # fmt: skip

    follower = Follower(nc, on_msg, name="rules", stream=RULES_STREAM, subject=_PRE + ">",
                        start=Start.last_per_subject(), metrics=metrics)  # fmt: skip
    await follower.start()
    return follower


async def stored(nc: NATS) -> int:
    """How many keys the bucket holds (cleared ones included: each is one message)."""
    info = await nc.jetstream().stream_info(RULES_STREAM)
    return info.state.messages


async def put(nc: NATS, capability: str, data: bytes) -> int:
    """Store ``capability``'s rule; its revision."""
    kv = await nc.jetstream().key_value(RULES_BUCKET)
    return await kv.put(capability, data)


async def delete(nc: NATS, capability: str) -> bool:
    """Clear ``capability``'s rule; False when it had none."""
    kv = await nc.jetstream().key_value(RULES_BUCKET)
    try:
        await kv.get(capability)
    except NotFoundError:  # never set, or deleted already
        return False
    await kv.delete(capability)
    return True


async def read_all(nc: NATS) -> dict[str, bytes]:
    """Every stored rule: capability → JSON. Read by :mod:`jetstream.lastvalues`, not
    nats-py's ``KeyValue.keys``, whose watch can end before its first key: ``reach rules
    set`` would then build on no rule and overwrite the stored one's other parts."""
    cut = len(_PRE)
    stored = await lastvalues.messages(nc, RULES_STREAM, _PRE + ">", name="rules-read")
    return {msg.subject[cut:]: msg.data for msg in stored
            if msg.data and (msg.headers or {}).get(_KV_OP) not in _DELETED}  # fmt: skip
