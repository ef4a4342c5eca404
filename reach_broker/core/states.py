"""Every move of an agent's reach state, in one table (state x event -> new state, reason).

In the manner of h11's ``_state.py``: the registry turns what it observed into an
:data:`Event`, looks the move up (``MOVES[state].get(event)``) and applies it; an event a
state does not list changes nothing (a heartbeat of a healthy agent, a disconnect of an
offline one).
What a move does besides changing the state (a forget clock on entering ``offline``, slow
start on ``recovering -> healthy``) is the registry's; which moves exist is decided here::

    new ──announce──▶ healthy ◀──heartbeat── suspect ──silence/probe fails──▶ offline
                        │  ▲                    ▲                                │
                        │  └──probe ok / 2 hb── recovering ◀──heartbeat/probe───┘
                        └──silence/disconnect───┘
    any ──leave / status=draining──▶ draining ──silence/disconnect──▶ evicted
    offline ──forget_after──▶ evicted

A reason may name details the registry passes along (``{silence:.2f}``, ``{interval:g}``,
``{forget:g}``, ``{reason}``).
"""

from __future__ import annotations

from typing import Final, Literal, NamedTuple

from reach_agent.wire.schema import AgentState

from .records import TransitionKind

Event = Literal[
    "announce",  # the agent announced again (a new process, or a reconnect)
    "heartbeat",  # an accepted heartbeat
    "heartbeat_draining",  # an accepted heartbeat with status "draining"
    "heartbeats_on_time",  # a recovering agent's RECOVER_HEARTBEATS-th heartbeat on time
    "leave",  # the agent said goodbye
    "disconnect",  # the server saw its connection close (or reconcile found none)
    "probe_ok",  # it answered a probe
    "probe_failed_disconnected",  # a probe went unanswered after a disconnect
    "silent",  # past its suspect deadline
    "silent_long",  # past its offline deadline
    "silent_disconnected",  # past its offline deadline, after a disconnect
    "forgotten",  # offline for forget_after_s
    "evict",  # removed by hand
]

SILENCE_EVENTS: Final[frozenset[Event]] = frozenset(("silent", "silent_long"))
"""Deadline events that rest on silence alone (no disconnect seen): what a deaf broker would
wrongly conclude, so what the registry may hold while the broker doubts itself."""

EVICTED: Final = "evicted"
"""The target of a move that removes the agent from the registry."""


class Move(NamedTuple):
    to: AgentState | Literal["evicted"]
    reason: str
    kind: TransitionKind = "state"


SILENCE = "no heartbeat for {silence:.2f}s (interval {interval:g}s)"
SILENCE_DISCONNECTED = "disconnected and no probe answer for {silence:.2f}s"

_DRAINING = Move("draining", "agent reports draining")
_LEFT = Move("draining", "{reason}", "left")
_EVICT = Move(EVICTED, "{reason}", "evicted")

MOVES: Final[dict[AgentState, dict[Event, Move]]] = {
    "healthy": {
        "heartbeat_draining": _DRAINING,
        "leave": _LEFT,
        "disconnect": Move("suspect", "{reason}"),
        "silent": Move("suspect", SILENCE),
        "evict": _EVICT,
    },
    "suspect": {
        "announce": Move("healthy", "re-announced"),
        "heartbeat": Move("healthy", "heartbeat resumed"),
        "heartbeat_draining": _DRAINING,
        "leave": _LEFT,
        "probe_ok": Move("healthy", "probe answered"),
        "probe_failed_disconnected": Move("offline", "disconnected and probe unanswered"),
        "silent_long": Move("offline", SILENCE),
        "silent_disconnected": Move("offline", SILENCE_DISCONNECTED),
        "evict": _EVICT,
    },
    "offline": {
        "announce": Move("recovering", "re-announced"),
        "heartbeat": Move("recovering", "heartbeat resumed"),
        "heartbeat_draining": _DRAINING,
        "leave": _LEFT,
        "probe_ok": Move("recovering", "probe answered"),
        "forgotten": Move(EVICTED, "offline for {forget:g}s", "evicted"),
        "evict": _EVICT,
    },
    "recovering": {
        "heartbeats_on_time": Move("healthy", "heartbeats on time"),
        "heartbeat_draining": _DRAINING,
        "leave": _LEFT,
        "disconnect": Move("suspect", "{reason}"),
        "probe_ok": Move("healthy", "probe answered"),
        "silent": Move("suspect", SILENCE),
        "evict": _EVICT,
    },
    "draining": {
        "announce": Move("healthy", "re-announced"),
        "disconnect": Move(EVICTED, "left and disconnected", "evicted"),
        "silent": Move(EVICTED, "left and went silent", "evicted"),
        "evict": _EVICT,
    },
}
"""For each state, the events that move it, and where to. Unlisted: no change."""
