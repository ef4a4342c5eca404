"""Held replay entries checked against their claim once held longer than ack_wait (pure: an
injected clock, claims and records; the entry's message records what it was told)."""

from __future__ import annotations

import types

from jetstream.claims import ClaimsUnavailable
from jetstream.compensation import Entry
from reach_broker.replay.taken import Taken


class Told:
    """The entry's JetStream message: what the holder told it."""

    reply = "$JS.ACK.REACH_COMPENSATION.job.1.1.1.0.0"

    def __init__(self) -> None:
        self.said: list[str] = []
        self._client = self  # a nak given back is a request on the message's client

    async def ack_sync(self) -> None:
        self.said.append("ack")

    async def request(self, subject: str, payload: bytes, **_: float) -> None:
        assert subject == self.reply
        self.said.append({b"-NAK": "nak"}[payload[:4]])

    async def in_progress(self) -> None:
        self.said.append("wip")


def entry(rid: str) -> tuple[Entry, Told]:
    msg = Told()
    e = Entry(capability="job", request_id=rid, priority=0, expires_at_ms=0, enqueued_ms=0,
              seq=1, headers={}, data=b"{}", msg=msg)  # type: ignore[arg-type]  # fmt: skip
    return e, msg


async def test_a_long_held_entry_follows_its_claim() -> None:
    """``elsewhere``: running on an agent of a partition another broker holds (this broker
    knows nothing of it; that broker releases the claim if it goes offline): held on.
    ``vanished``: running on an agent of a partition this broker holds that it does not
    know (gone): given back."""
    claims = {"done": ("a", "completed"), "runs": ("a", "running"), "freed": ("a", "released"),
              "gone": ("b", "running"), "elsewhere": ("c", "running"),
              "vanished": ("d", "running")}  # fmt: skip
    states = {"a": "healthy", "b": "offline"}
    holder = {"gone": "b", "elsewhere": "c", "vanished": "d"}

    async def claim_of(rid: str) -> tuple[str, str] | None:
        if rid == "silent":
            raise ClaimsUnavailable("JetStream did not return the claim within 2.0s")
        return claims.get(rid)

    def record_of(agent_id: str) -> object:
        return types.SimpleNamespace(state=states[agent_id]) if agent_id in states else None

    given_back: list[int] = []
    taken = Taken(30.0, claim_of, record_of, clock=lambda: 100.0,
                  on_returned=lambda: given_back.append(1),
                  owns_agent=lambda agent_id: agent_id != "c")  # fmt: skip
    told = {}
    for rid in ("done", "runs", "freed", "gone", "unclaimed", "silent", "elsewhere", "vanished"):
        e, told[rid] = entry(rid)
        await taken.hold(e, holder.get(rid, "a"))
    running = {rid: await taken._still_running(taken._held[rid]) for rid in list(taken._held)}
    # "silent": the bucket cannot say; held on, never removed or given back on a guess.
    assert running == {"done": False, "runs": True, "freed": False, "gone": False,
                       "unclaimed": False, "silent": True, "elsewhere": True,
                       "vanished": False}  # fmt: skip
    assert {rid: m.said for rid, m in told.items()} == {
        "done": ["ack"],
        "runs": [],
        "freed": ["nak"],
        "gone": ["nak"],
        "unclaimed": ["ack"],
        "silent": [],
        "elsewhere": [],
        "vanished": ["nak"],
    }
    assert (len(taken), taken.finished, taken.returned, len(given_back)) == (3, 2, 3, 3)
    assert taken.holds("runs") and taken.holds("silent") and taken.holds("elsewhere")


async def test_an_entry_whose_claim_was_released_before_its_hold_is_given_back_at_once() -> None:
    """The claim's release can arrive before the hold that follows its delivery (nemesis seed
    71: c1-000540 held 20 s, until its claim check, for a claim released in the second it
    was held). Remembered a moment, the release gives the entry back at its hold, and its
    capability is replayed again; a release of another holder's claim, or one heard more
    than 5 s before, does not."""
    now = [100.0]
    again: list[str] = []
    taken = Taken(30.0, clock=lambda: now[0], again=again.append)
    taken.released_before("fresh", "a")
    taken.released_before("other", "b")
    taken.released_before("stale", "a")
    now[0] += 5.1
    taken.released_before("fresh", "a")
    told, held = {}, {}
    for rid in ("fresh", "other", "stale"):
        e, told[rid] = entry(rid)
        held[rid] = await taken.hold(e, "a")  # whether it holds (the replay says "held")
    assert {rid: m.said for rid, m in told.items()} == {"fresh": ["nak"], "other": [],
                                                        "stale": []}  # fmt: skip
    assert held == {"fresh": False, "other": True, "stale": True}
    assert (taken.holds("fresh"), taken.holds("other"), taken.holds("stale")) == (
        False, True, True)  # fmt: skip
    assert (again, taken.returned) == (["job"], 1)
