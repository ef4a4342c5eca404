"""The observer that doubts itself first, pure, fake clock: the registry's outage rebase
(``observer_gap``), the hold of silence moves (``expire(max_silent=…)``) and the observer's
rules over them (tick gate, share, release)."""

from __future__ import annotations

import itertools
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from nats.aio.client import Client as NATS

from reach_agent.wire.schema import Announce, Heartbeat
from reach_agent.wire.subjects import Subjects
from reach_broker.config import Config
from reach_broker.core.records import Transition
from reach_broker.core.registry import Registry
from reach_broker.core.tokens import TokenSigner
from reach_broker.service.context import BrokerContext, Link
from reach_broker.service.fanout import Fanout
from reach_broker.service.metrics import Metrics
from reach_broker.service.observer import TRUST_S, Observer

INTERVAL_MS = 1000  # suspect after 3 s of silence, offline after 6 s (fixed thresholds)


def fixed() -> Config:
    """No phi prior: these young agents are judged on the fixed thresholds alone, so the
    deadlines below are round multiples of the interval."""
    cfg = Config()
    cfg.detection.phi_prior_samples = 0
    return cfg


def make(n: int, offline_after: float | None = None) -> tuple[Registry, dict[str, str]]:
    cfg = fixed()
    if offline_after is not None:
        cfg.detection.offline_after = offline_after
    reg = Registry(
        cfg.detection,
        cfg.scoring,
        TokenSigner(b"k" * 32, 3600.0, wall=lambda: 1_000_000.0),
        interval_ms=cfg.broker.interval_ms,
    )
    tokens = {}
    for i in range(n):
        ann = Announce(agent_id=f"a{i}", capabilities=["summarize"], max_concurrency=4,
                       heartbeat_interval_ms=INTERVAL_MS)  # fmt: skip
        rec, _ = reg.announce(ann, 0.0, 0)
        tokens[rec.agent_id] = rec.token
    return reg, tokens


def beat(reg: Registry, tokens: dict[str, str], agent_id: str, seq: int, now: float) -> str:
    hb = Heartbeat(agent_id=agent_id, token=tokens[agent_id], seq=seq)
    return reg.heartbeat(hb, now, int(now * 1000))[0]


# --- Registry.observer_gap --------------------------------------------------------------


def test_an_outage_is_not_held_against_anyone() -> None:
    reg, tokens = make(2)
    beat(reg, tokens, "a0", 1, 1.0)  # a0 seen at 1.0, a1 at 0.0 (announce)
    score = {a: r.score for a, r in reg.agents.items()}
    outcomes = {a: (r.stats.live_n, r.stats.live_ok) for a, r in reg.agents.items()}
    reg.observer_gap(2.0, 12.0)  # 10 s deaf: far past every deadline
    assert reg.expire(12.0) == []
    # Shifted by the gap plus one interval of grace: a1's suspect deadline 3.0 -> 14.0.
    assert (reg.agents["a1"].last_seen, reg.agents["a1"].suspect_at) == (10.0, 14.0)
    assert reg.expire(13.99) == []
    assert [(t.agent_id, t.to) for t in reg.expire(14.0)] == [("a1", "suspect")]
    # a0 beats again right after the outage: on time, no arrival sample of the gap.
    window = len(reg.agents["a0"].window)
    assert beat(reg, tokens, "a0", 2, 12.5) == "accepted"
    rec = reg.agents["a0"]
    assert (rec.resync, len(rec.window)) == (False, window)
    n, ok = outcomes["a0"]
    assert (rec.stats.live_n, rec.stats.live_ok) == (n + 1, ok + 1)  # an on-time beat
    assert rec.score == score["a0"]


def test_silence_before_the_outage_still_counts() -> None:
    reg, _ = make(1)  # seen at 0.0: suspect at 3.0
    reg.observer_gap(2.5, 4.5)  # 2 s deaf
    assert reg.expire(5.49) == []
    assert [t.to for t in reg.expire(6.0)] == ["suspect"]  # 3.0 + 2.0 + 1.0 grace


def test_an_agent_heard_after_the_outage_began_is_not_shifted() -> None:
    reg, tokens = make(1)
    beat(reg, tokens, "a0", 1, 5.0)
    reg.observer_gap(4.0, 6.0)
    rec = reg.agents["a0"]
    assert (rec.last_seen, rec.resync) == (5.0, False)


# --- Registry.expire(max_silent) --------------------------------------------------------


def test_more_silence_than_allowed_is_held_then_released() -> None:
    reg, tokens = make(4)
    assert reg.expire(3.0, max_silent=3) == [] and reg.held == {"a0", "a1", "a2", "a3"}
    assert reg.counts["healthy"] == 4
    assert reg.expire(10.0, max_silent=3) == []  # held entries are not retried
    beat(reg, tokens, "a0", 1, 10.0)  # a sign of life re-arms its own deadline
    assert reg.release_held() == 4 and reg.held == set()
    moved = reg.expire(10.0)
    assert sorted((t.agent_id, t.to) for t in moved) == [
        ("a1", "suspect"), ("a2", "suspect"), ("a3", "suspect")
    ]  # fmt: skip
    assert sorted(reg.silenced) == ["a1", "a2", "a3"]


def test_silence_within_the_limit_moves_at_once() -> None:
    reg, _ = make(4)
    assert len(reg.expire(3.0, max_silent=4)) == 4
    assert reg.held == set()


def test_disconnect_confirmed_moves_are_never_held() -> None:
    reg, _ = make(3)
    for a in ("a0", "a1", "a2"):
        reg.disconnected(a, 1.0)
    moved = reg.expire(4.0, max_silent=0)  # probe timeout 3 s: offline, confirmed
    assert sorted((t.agent_id, t.to) for t in moved) == [
        ("a0", "offline"), ("a1", "offline"), ("a2", "offline")
    ]  # fmt: skip


# --- Observer ---------------------------------------------------------------------------


class _Ctx:
    def __init__(self, share: float = 0.3) -> None:
        self.spawned: list[str] = []
        cfg = fixed()
        cfg.detection.observer_suspect_share = share
        self.cfg = cfg
        self.metrics = m = Metrics()
        self.link = Link()
        self.ctx = BrokerContext(nc=NATS(), subjects=Subjects(), broker_id="b",
                                 clock=lambda: 0.0, wall=lambda: 0.0, spawn=self.spawn,
                                 emit=self.emit, link=self.link)  # fmt: skip
        self.fanout = Fanout(self.ctx, lambda _: None, consumers=(), changes=m.registry_changes,
                             states=m.state_changes,
                             withheld=m.dropped.labels("event", "link_down"),
                             unsent=m.dropped.labels("event", "error"))  # fmt: skip

    def emit(self, transitions: list[Transition]) -> None:
        self.fanout.emit(transitions)

    def spawn(self, coro: Awaitable[Any], name: str) -> None:
        self.spawned.append(name)
        getattr(coro, "close", lambda: None)()


class _Advisories:
    answers = 0
    available = False

    def on_reconnected(self) -> None:
        self.reconnected = True


def observer(
    n: int, share: float = 0.3, offline_after: float | None = None,
    inbound: Callable[[], int] | None = None,
) -> tuple[Observer, Registry, dict[str, str], _Ctx]:  # fmt: skip
    """``inbound``: the connection's message count (default: a new message at every tick,
    so the broker always hears)."""
    reg, tokens = make(n, offline_after)
    c = _Ctx(share)
    m = c.metrics
    obs = Observer(c.ctx, reg, _Advisories(), c.cfg.detection,  # type: ignore[arg-type]
                   inbound=inbound or itertools.count().__next__,
                   suspect=m.observer_suspect, gaps=m.observer_gaps)  # fmt: skip
    return obs, reg, tokens, c


def test_a_third_of_the_fleet_silent_at_once_makes_the_broker_doubt_itself(
    caplog: pytest.LogCaptureFixture,
) -> None:
    obs, reg, tokens, c = observer(10)
    for i in range(7):  # 7 of 10 keep beating; 3 (30 %) go silent: allowed
        beat(reg, tokens, f"a{i}", 1, 2.0)
    assert sorted(t.agent_id for t in obs.tick(3.0)) == ["a7", "a8", "a9"]
    assert obs.suspect is False
    # A fresh fleet of 10, 4 silent in one tick: more than 30 %, held.
    obs, reg, tokens, c = observer(10)
    for i in range(6):
        beat(reg, tokens, f"a{i}", 1, 2.0)
    assert obs.tick(3.0) == []
    assert (obs.suspect, reg.held) == (True, {"a6", "a7", "a8", "a9"})
    assert c.metrics.observer_suspect._value.get() == 1
    said = [r.getMessage() for r in caplog.records if "observer.suspect_self" in r.getMessage()]
    assert [m.partition(":")[0] for m in said] == [
        "observer.suspect_self held=4 silenced_lately=0 not_offline=10 share=0.30"]  # fmt: skip
    assert c.spawned == ["observer-confirm"]
    assert obs.tick(5.0) == []  # a0..a5 go silent too: every silence waits
    assert reg.held == {f"a{i}" for i in range(10)}
    # Heartbeats flow again: the broker trusts its ears; the doubt's 2.1 s are held against
    # nobody (rebased, one interval of grace), then the truly silent move.
    for i in range(6):
        beat(reg, tokens, f"a{i}", 2, 5.1)
    assert obs.tick(5.1) == []
    assert obs.suspect is False and c.metrics.observer_suspect._value.get() == 0
    moved = obs.tick(6.1)
    assert sorted(t.agent_id for t in moved) == ["a6", "a7", "a8", "a9"]
    assert {reg.agents[f"a{i}"].state for i in range(6)} == {"healthy"}


def test_silences_within_one_interval_add_up() -> None:
    obs, reg, tokens, _ = observer(10)
    for i in range(10):
        beat(reg, tokens, f"a{i}", 1, 0.1 * i)  # phases spread over the interval
    moved = []
    now = 3.0
    while now < 4.0:
        moved += obs.tick(now)
        now += 0.05
    assert len(moved) == 3 and obs.suspect is True  # 3 allowed, the 4th within 1 s held
    assert len(reg.held) >= 1


def test_a_late_tick_judges_nobody_the_next_one_does() -> None:
    """The loop held up for 0.5 s: heartbeats that came meanwhile are read after the late
    tick, before the next one judges."""
    obs, reg, tokens, _ = observer(4, share=1.0)  # no hold: only the late tick's rule
    assert obs.tick(3.0, due=2.5) == [] and obs.stalls == 1  # every deadline (3.0) passed
    for i in range(2):
        beat(reg, tokens, f"a{i}", 1, 3.01)  # read once the loop got round to it
    moved = obs.tick(3.06, due=3.05)
    assert sorted(t.agent_id for t in moved) == ["a2", "a3"]
    assert {reg.agents[f"a{i}"].state for i in range(2)} == {"healthy"}


def test_never_two_late_ticks_in_a_row_judge_nobody() -> None:
    obs, _reg, _, _ = observer(2, share=1.0)
    assert obs.tick(3.0, due=2.5) == []
    assert len(obs.tick(3.6, due=3.1)) == 2  # late again: judged all the same
    assert obs.stalls == 1


def test_one_agent_never_makes_the_broker_doubt_itself() -> None:
    obs, _reg, _, _ = observer(1)
    assert [t.to for t in obs.tick(3.0)] == ["suspect"]
    assert obs.suspect is False


def test_one_agent_suspect_then_offline_within_an_interval_is_one_silence() -> None:
    """Its two moves count as one agent gone silent: the second is not held (nemesis seed
    42: in a fleet of four, each silent agent's offline move was held for a second, the
    broker doubting itself over one agent)."""
    obs, reg, tokens, _ = observer(4, offline_after=3.5)  # offline 0.5 s after suspect
    for i in range(3):
        beat(reg, tokens, f"a{i}", 1, 2.0)
    assert [(t.agent_id, t.to) for t in obs.tick(3.0)] == [("a3", "suspect")]
    assert [(t.agent_id, t.to) for t in obs.tick(3.5)] == [("a3", "offline")]
    assert (obs.suspect, obs.suspected, reg.held) == (False, 0, set())


def test_while_the_broker_doubts_itself_an_agent_silent_before_is_held_too() -> None:
    """An agent already counted (suspect within the interval) does not move offline while
    the broker doubts itself: every silence waits for the confirmation."""
    obs, reg, tokens, _ = observer(10, offline_after=3.5)
    for i in range(9):
        beat(reg, tokens, f"a{i}", 1, 2.0 if i < 5 else 0.3)  # a5..a8 due at 3.3
    assert [(t.agent_id, t.to) for t in obs.tick(3.0)] == [("a9", "suspect")]
    assert obs.tick(3.3) == [] and obs.suspect is True  # 4 more: held
    assert obs.tick(3.5) == []  # a9's offline is due
    assert reg.held == {"a5", "a6", "a7", "a8", "a9"}
    assert reg.agents["a9"].state == "suspect"


def test_a_silence_due_while_nothing_is_heard_waits_for_the_server(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """One agent, held all the same: its broker heard nothing for over DEAF_S when its
    silence came due (its own link stalled, connection open: nemesis seed 43 declared a live
    agent offline that way and released its claims). A PONG at once shows the link was
    merely quiet: the held move is judged then."""
    caplog.set_level(logging.INFO, logger="reach_broker.service.observer")
    heard = [0]
    obs, reg, _tokens, c = observer(1, inbound=lambda: heard[0])
    assert obs.tick(0.5) == []  # the first reading: heard
    assert obs.tick(3.0) == []  # a0 due suspect; nothing came for 2.5 s
    assert (reg.held, obs.deaf_since, c.spawned) == ({"a0"}, 3.0, ["observer-ping"])
    assert c.metrics.observer_suspect._value.get() == 1
    assert obs.tick(3.05) == [] and c.spawned == ["observer-ping"]  # one PING at a time
    obs.answered(3.1)  # its PONG, at once: the link is merely quiet
    assert [(t.agent_id, t.to) for t in obs.tick(3.15)] == [("a0", "suspect")]
    gauge = c.metrics.observer_suspect._value.get()
    assert (obs.deaf_since, obs.suspect, gauge) == (None, False, 0)
    assert obs.tick(6.0) == [] and reg.held == {"a0"}  # due offline, 2.9 s after the PONG
    assert c.spawned == ["observer-ping", "observer-ping"]
    obs.answered(6.02)
    assert [(t.agent_id, t.to) for t in obs.tick(6.05)] == [("a0", "offline")]
    assert obs.deaf_holds == 2 and obs.suspected == 0
    assert c.metrics.observer_gaps._value.get() == 0  # nothing rebased
    said = [r.getMessage().partition(":")[0] for r in caplog.records
            if r.getMessage().startswith("observer.")]  # fmt: skip
    assert said == [
        "observer.deaf held=1 heard_s_ago=2.50",
        "observer.hearing again after 0.15s (1 held agents judged now)",
        "observer.deaf held=1 heard_s_ago=2.90",
        "observer.hearing again after 0.05s (1 held agents judged now)",
    ]


def judged_while_beating(
    obs: Observer, reg: Registry, tokens: dict[str, str], heard: list[int], start: float
) -> list[tuple[str, str | None]]:
    """Ticking every 0.1 s from ``start`` until 9 s, a0 beating every second again from
    half a second after it (each beat a message heard): the moves made meanwhile."""
    moved: list[tuple[str, str | None]] = []
    now, seq, first = start, 10, round(start + 0.5, 1)
    while now < 9.0:
        if now >= first and round((now - first) % 1.0, 1) in (0.0, 1.0):
            beat(reg, tokens, "a0", seq, now)
            heard[0] += 1
            seq += 1
        moved += [(t.agent_id, t.to) for t in obs.tick(now)]
        now = round(now + 0.1, 1)
    return moved


def test_a_stall_given_up_by_the_client_is_rebased_from_where_hearing_stopped() -> None:
    """Nothing heard from 0.5 s (its node stopped), the connection given up at 5.0 and
    made again at once: the rebase covers the 4.5 s of deafness, not the 0.05 s of the
    outage (nemesis seed 44: its agents were judged on 5 s of silence just after)."""
    heard = [0]
    obs, reg, tokens, c = observer(1, inbound=lambda: heard[0])
    beat(reg, tokens, "a0", 1, 0.5)
    assert obs.tick(0.5) == [] and obs.tick(3.5) == []  # a0 due suspect at 3.5: held
    assert obs.deaf_since == 3.5
    obs.lost(5.0)
    obs.regained(5.05)
    assert obs.deaf_since is None and c.metrics.observer_gaps._value.get() == 1
    heard[0] += 1  # the new connection hears
    assert judged_while_beating(obs, reg, tokens, heard, 5.2) == []
    assert reg.agents["a0"].state == "healthy"


def test_a_stall_that_ends_without_a_reconnect_is_rebased_too() -> None:
    """The link carried nothing from 0.5 s, its PINGs unanswered, then carried again (a
    frozen proxy or node resumed; the connection never given up): what was sent meanwhile
    may be lost, so the time nothing was heard is held against nobody."""
    heard = [0]
    obs, reg, tokens, c = observer(1, inbound=lambda: heard[0])
    beat(reg, tokens, "a0", 1, 0.5)
    assert obs.tick(0.5) == [] and obs.tick(3.5) == []
    obs.unanswered()  # the PING's round trip timed out
    heard[0] += 1  # the link carries again (a0's own heartbeat is still on its way)
    assert judged_while_beating(obs, reg, tokens, heard, 5.3) == []
    assert c.metrics.observer_gaps._value.get() == 1 and obs.deaf_since is None


def test_a_pong_that_comes_late_ends_a_stall() -> None:
    """The first PING answered 0.7 s after it was sent (the stall ended meanwhile, within
    the PING's second): a stall, rebased, not a quiet link judged at once (nemesis seed 46:
    a live agent's silence then included 2.8 s of its broker's own deafness)."""
    heard = [0]
    obs, reg, tokens, c = observer(1, inbound=lambda: heard[0])
    beat(reg, tokens, "a0", 1, 0.5)
    assert obs.tick(0.5) == [] and obs.tick(3.5) == []
    obs.answered(4.2)
    assert judged_while_beating(obs, reg, tokens, heard, 4.3) == []
    assert c.metrics.observer_gaps._value.get() == 1


def test_a_quick_pong_after_an_unanswered_ping_still_ends_a_stall() -> None:
    """The first PING timed out, the second was answered at once as the stall ended (a
    node resumed): a stall all the same, rebased (nemesis seed 46 at 0b92b3b: three held
    agents judged as on a quiet link after 1.2 s of a stopped node)."""
    heard = [0]
    obs, reg, tokens, c = observer(1, inbound=lambda: heard[0])
    beat(reg, tokens, "a0", 1, 0.5)
    assert obs.tick(0.5) == [] and obs.tick(3.5) == []  # deaf: the first PING
    obs.unanswered()  # timed out
    assert obs.tick(4.5) == [] and c.spawned == ["observer-ping", "observer-ping"]
    obs.answered(4.6)  # the second, at once
    assert judged_while_beating(obs, reg, tokens, heard, 4.7) == []
    assert c.metrics.observer_gaps._value.get() == 1


def test_while_disconnected_nobody_is_judged_and_the_gap_is_rebased() -> None:
    obs, reg, _tokens, c = observer(3)
    obs.lost(1.0)
    assert obs.tick(10.0) == [] and reg.counts["healthy"] == 3
    obs.regained(11.0)
    assert c.link.connected is True and c.metrics.observer_gaps._value.get() == 1
    assert obs.advisories.reconnected is True  # type: ignore[attr-defined]
    assert obs.tick(11.0) == []
    assert reg.agents["a0"].suspect_at == 3.0 + 10.0 + 1.0


def test_a_release_is_believed_for_a_while() -> None:
    obs, _reg, _tokens, _ = observer(4)
    assert obs.tick(3.0) == [] and obs.suspect is True
    obs.release(3.1, "test")
    assert obs.tick(3.1) == []  # the doubt's silence is rebased away
    assert [t.to for t in obs.tick(4.1)] == ["suspect"] * 4  # then judged, not held again
    assert obs.suspect is False
    assert [t.to for t in obs.tick(7.1)] == ["offline"] * 4  # believed when they come
    assert obs.tick(7.1 + TRUST_S) == []


def test_events_made_while_the_link_is_down_are_withheld() -> None:
    obs, reg, _, c = observer(1)
    obs.lost(0.5)
    c.ctx.emit(reg.disconnected("a0", 0.6))
    assert c.fanout.withheld == 1 and c.spawned == []
    obs.regained(0.7)
    c.ctx.emit(reg.leave("a0", 0.8))
    assert c.spawned == ["event"]


def test_what_the_broker_could_not_hear_while_it_doubted_itself_is_held_against_nobody() -> None:
    """The broker's server stopped (SIGSTOP) for 5 s: its connection stayed open, it heard
    nobody, doubted itself and held the fleet; the server resumed with its routes not yet
    back, so a held agent's probe came back "no responders" and released the hold — and the
    agents were judged on 5.8 s of a silence that was the broker's own: declared offline,
    their claims released, while their heartbeats reached the cluster all along (found by
    loadtest.nemesis, a 30 min run). The doubt's silence is rebased away at the release;
    the heartbeats that follow keep everyone healthy."""
    obs, reg, tokens, _ = observer(4)
    for i in range(4):
        beat(reg, tokens, f"a{i}", 1, 10.0)  # the last heartbeats the broker hears
    assert obs.tick(13.0) == [] and obs.suspect is True  # 4 silent at once: held
    obs.release(15.8, "a probe of a0 was decided")
    assert obs.tick(15.8) == []
    assert obs.tick(16.0) == []  # not offline on 6 s of its own deafness
    for i in range(4):
        beat(reg, tokens, f"a{i}", 2, 16.2)  # the routes are back: heard again
    assert obs.tick(16.3) == []
    assert {reg.agents[f"a{i}"].state for i in range(4)} == {"healthy"}


def test_after_a_doubt_the_truly_silent_are_judged_and_not_held_again() -> None:
    """Four of ten frozen (connections open, nothing sent): the doubt's silence is rebased
    away, and then their own silence is judged — suspect, then offline — without a second
    hold (the rebased deadlines are believed when they come)."""
    obs, reg, tokens, _ = observer(10)
    for i in range(6):
        beat(reg, tokens, f"a{i}", 1, 2.0)
    assert obs.tick(3.0) == [] and obs.suspect is True
    now, seq, moved = 3.0, 2, []
    while now < 12.0:
        now = round(now + 0.1, 1)
        if now % 1.0 == 0:  # a0..a5 beat every second
            for i in range(6):
                beat(reg, tokens, f"a{i}", seq, now)
            seq += 1
        moved += [(t.agent_id, t.to, now) for t in obs.tick(now)]
    frozen = [f"a{i}" for i in range(6, 10)]
    assert obs.suspect is False and obs.suspected == 1
    assert sorted(a for a, to, _ in moved if to == "suspect") == frozen
    assert sorted(a for a, to, _ in moved if to == "offline") == frozen
    assert {reg.agents[a].state for a in frozen} == {"offline"}
    assert {reg.agents[f"a{i}"].state for i in range(6)} == {"healthy"}
