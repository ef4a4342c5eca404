"""The observer that doubts itself first: the broker's own link to NATS, and what the broker
concludes while that link may be what failed.

A fleet does not go silent all at once; a broker's link does. Three rules follow:

- **Disconnected, no deadlines.** While the broker's connection is down (nats-py's
  ``disconnected_cb`` to ``reconnected_cb``) the tick does not run: nobody is judged on a
  silence the broker could not hear. On reconnect every agent's clock is rebased
  (:meth:`Registry.observer_gap`: shifted by the outage, plus one interval of grace) and the
  server's connection list is reconciled (the advisories component).
- **Too many at once, hold.** When more than ``detection.observer_suspect_share`` of the
  fleet (not offline) would move for silence within one heartbeat interval — the agents due
  this tick plus those moved for silence in the last interval, each agent once (suspect,
  then offline, is one agent gone silent) — the broker suspects itself:
  it logs it, sets ``reach_observer_suspect 1`` and holds those agents' states
  (:meth:`Registry.expire` with ``max_silent``), and every later silence with them, until
  its link is shown to work: a heartbeat arrives, the server answers ``CONNZ`` (the
  reconcile then moves who has no connection), or a held agent's probe is answered either
  way (a reply or "no responders"). Then the clocks are rebased over the doubt, as after an
  outage: a broker whose server was stopped, or whose routes were down, heard nobody while
  its connection stayed open, and the silence of the doubt is not held against anyone
  (the first heartbeat heard, or a "no responders" from a server whose routes are still
  coming back, does not mean the others are heard yet). The held deadlines then run again,
  rebased, and are believed when they come (not held a second time). A single agent never
  makes the broker doubt itself.
- **Hearing nothing, no judgement.** A silence is believed only while the broker hears the
  server: some message came in within :data:`DEAF_S`, 1.5 s (a healthy broker hears every
  second: heartbeats, its JetStream follows' idle heartbeats). When one comes due after
  that, its move is held and a round trip (a PING) asked. A PONG within
  :data:`QUICK_PONG_S` shows the link was merely quiet: the held moves are judged at once
  (what the server sent before the PONG was read first). A link stalled with its
  connection open (a frozen proxy or node, a partition TCP has not noticed) answers late or
  not at all: the moves wait until it carries messages again, and since what was sent
  meanwhile may be lost, every clock is then rebased over the time nothing was heard, as
  after an outage; when the client gives the connection up first, the outage's rebase
  starts where the hearing stopped, not at the disconnect (nemesis seed 44: a node stopped
  for 5 s, the connection given up at its end, its agents judged on 5 s of silence).
  Unlike the share rule this holds for one agent too: a broker holding a single live agent
  declared it ``offline`` while its own link was stalled, and released its claims (nemesis
  seed 43).
- **Behind its own input, no judgement.** A tick that runs more than :data:`STALL_S` later
  than it was due means the broker's loop was held up (busy, or the process starved of
  CPU): heartbeats that arrived meanwhile may still be unread in its socket. That tick
  judges nobody; the next one, after they are read, does. Never two ticks in a row, so a
  broker starved for good still judges every other tick.
- **Nothing computed blind goes out later.** nats-py buffers publishes while it reconnects;
  the pipeline publishes no event while :attr:`Link.connected` is false
  (:class:`~reach_broker.service.fanout.Fanout`), and a probe whose round trip overlapped an outage
  is not held against the agent (:attr:`Link.epoch`, read by the prober).
"""

from __future__ import annotations

import collections
import logging
import math
from collections.abc import Callable
from typing import Any

from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError

from jetstream.roundtrip import round_trip
from reach_broker.config import DetectionSection
from reach_broker.core.records import Transition
from reach_broker.core.registry import Registry

from .advisories import Advisories
from .context import BrokerContext

log = logging.getLogger(__name__)

TRUST_S = 1.0
"""After the link was shown to work, silence is believed (not held) for this long."""
CONFIRM_EVERY_S = 1.0
"""While suspecting itself, the broker asks for confirmation this often."""
CONFIRM_PROBES = 8
"""Held agents probed per confirmation round."""
MIN_SILENT = 2
"""Fewer agents than this going silent together never make the broker doubt itself."""
DEAF_S = 1.5
"""Nothing heard from the server for this long: a silence that comes due waits for a round
trip. Above the idle heartbeat of the broker's JetStream follows (1 s), so a broker with
JetStream is not asking for nothing. A link stalled within one interval after an agent's
(1 s) last heartbeat has been quiet at least 1.4 s when that agent's ``suspect`` deadline
(2.4 s of silence and on) comes: most such moves are held, the rest (``suspect`` only: it
stops routes, releases nothing) are undone by the next heartbeat; ``offline`` comes later
and is held."""
QUICK_PONG_S = 0.25
"""A deaf episode's PING answered within this long: the link was merely quiet (a round trip
on a working link takes milliseconds). A later PONG, or messages first, end a stall."""
STALL_S = 0.25
"""A tick this much later than it was due judges nobody (the input that came meanwhile is
read first)."""


class Observer:
    """The broker's self-doubt: the tick's gate, the hold, its release, the outage rebase."""

    def __init__(self, ctx: BrokerContext, registry: Registry, advisories: Advisories,
                 cfg: DetectionSection, *, inbound: Callable[[], int], suspect: Any,
                 gaps: Any) -> None:  # fmt: skip
        """``inbound``: how many messages the connection has received (nats-py's
        ``stats["in_msgs"]``); ``suspect``, ``gaps``: ``reach_observer_suspect``,
        ``reach_observer_gaps_total``."""
        self.ctx, self.link, self.cfg = ctx, ctx.link, cfg
        self._inbound = inbound
        self._in_msgs = -1
        self._heard_at = -math.inf
        """When the connection last received a message (or the server answered a PING)."""
        self.deaf_since: float | None = None
        """Since when silences are held for want of anything heard (None: hearing)."""
        self.deaf_holds = 0
        """Times silences were held that way (for tests and the log)."""
        self._deaf_from = 0.0
        """When the broker last heard anything before the current deaf episode."""
        self._unanswered = 0
        """PINGs of the current deaf episode the server did not answer (the link stalled)."""
        self._quick = False
        """The current deaf episode's PING was answered within :data:`QUICK_PONG_S`."""
        self._pinging = False
        self._pinged_at = 0.0
        self._next_ping = 0.0
        self.registry = registry
        self.advisories = advisories
        self.share = cfg.observer_suspect_share
        self._suspect, self._gaps = suspect, gaps
        self.suspect = False
        """True while the broker doubts its own view and holds states."""
        self.suspected = 0
        """Times the broker has suspected itself (for tests and the log)."""
        self._since = 0.0
        self._beats_at = 0
        self._trusted_until = 0.0
        self._next_confirm = 0.0
        self._recent: dict[str, float] = {}
        """The agents moved for silence lately, each until it stops counting (the move's
        time + the agent's interval; its second move within that time counts once)."""
        self._lapses: collections.deque[tuple[float, str]] = collections.deque()
        """The same moves in the order they were made, for :attr:`_recent`'s pruning."""
        self._confirming = False
        self._stalled = False
        self.stalls = 0
        """Ticks that judged nobody because they ran late (the loop was held up)."""
        suspect.set(0)

    # --- the tick -------------------------------------------------------------------------

    def tick(self, now: float, due: float | None = None) -> list[Transition]:
        """The deadlines that passed by ``now``, as far as the broker believes its ears
        (``due``: when this tick was meant to run, if it was scheduled)."""
        if not self.link.connected:
            return []  # deaf: judge nobody (rebased on reconnect)
        if due is not None and now - due > STALL_S and not self._stalled:
            self._stalled = True  # held up: what came meanwhile is read before judging
            self.stalls += 1
            log.debug("observer.stalled late_s=%.3f: judging on the next tick", now - due)
            return []
        self._stalled = False
        registry = self.registry
        if self.suspect and registry.beats != self._beats_at:
            self.release(now, "heartbeats flow again")
        hearing = self._hearing(now)
        if hearing and self.deaf_since is not None:
            self._heard_again(now)
        # While it doubts itself every silence waits, an agent counted before included.
        counted = () if self.suspect or not hearing else self._recent
        out = registry.expire(now, self._max_silent(now) if hearing else 0, counted)
        if registry.held and not self.suspect:
            if hearing:
                self._suspect_self(now, len(registry.held))
            else:
                self._deaf(now)
        for agent_id in registry.silenced:
            rec = registry.agents.get(agent_id)
            until = now + (rec.interval_s if rec is not None else 0.0)
            self._recent[agent_id] = until  # moved again: counted once, from now
            self._lapses.append((until, agent_id))
        if self.suspect and now >= self._next_confirm and not self._confirming:
            self._next_confirm = now + CONFIRM_EVERY_S
            self._confirming = True
            self.ctx.spawn(self._confirm(), "observer-confirm")
        return out

    # --- hearing --------------------------------------------------------------------------

    def _hearing(self, now: float) -> bool:
        """Whether a message came in within :data:`DEAF_S` (read off the connection's
        counter: one read a tick)."""
        n = self._inbound()
        if n != self._in_msgs:
            self._in_msgs, self._heard_at = n, now
        return now - self._heard_at <= DEAF_S

    def _deaf(self, now: float) -> None:
        """Silences came due while nothing was heard: they are held, and the server asked."""
        if self.deaf_since is None:
            self.deaf_since, self._deaf_from, self._unanswered = now, self._heard_at, 0
            self._quick = False
            self.deaf_holds += 1
            self._suspect.set(1)
            log.info("observer.deaf held=%d heard_s_ago=%.2f: nothing came from the server "
                     "lately; these silences wait for a round trip", len(self.registry.held),
                     now - self._heard_at)  # fmt: skip
        if not self._pinging and now >= self._next_ping:
            self._pinging, self._pinged_at = True, now
            self._next_ping = now + CONFIRM_EVERY_S
            self.ctx.spawn(self._ping(), "observer-ping")

    async def _ping(self) -> None:
        """A round trip: its PONG shows the link carries messages (the next tick judges)."""
        try:
            await round_trip(self.ctx.nc, CONFIRM_EVERY_S)
            self.answered(self.ctx.clock())
        except Exception as exc:  # noqa: BLE001 - no answer: asked again while held
            log.debug("observer.ping_unanswered error=%r", exc)
            self.unanswered()
        finally:
            self._pinging = False

    def answered(self, now: float) -> None:
        """The server answered the PING: heard now; merely quiet if it answered at once."""
        self._pinging = False
        self._heard_at = max(self._heard_at, now)
        if (
            self.deaf_since is not None
            and not self._unanswered  # a PING of this episode went unanswered: a stall
            and now - self._pinged_at <= QUICK_PONG_S
        ):
            self._quick = True

    def unanswered(self) -> None:
        """The PING went unanswered: the link stalled, not merely quiet."""
        self._pinging = False
        if self.deaf_since is not None:
            self._unanswered += 1

    def _heard_again(self, now: float) -> None:
        registry = self.registry
        took = now - (self.deaf_since or now)
        if not self._quick and not self.suspect:
            # Stalled (its PING unanswered, answered late, or overtaken by messages): what
            # was sent meanwhile may be lost (a frozen node's routes went stale), so nobody
            # is judged on the time nothing was heard (nemesis seed 46: a stall that ended
            # within the first PING's second was judged as quiet).
            held = len(registry.held)
            registry.observer_gap(self._deaf_from, now)
            self._gaps.inc()
            log.warning("observer.hearing again after %.2fs, %d pings unanswered: the link "
                        "stalled; every agent's clock rebased over the %.2fs nothing was "
                        "heard (%d held)", took, self._unanswered, now - self._deaf_from,
                        held)  # fmt: skip
        else:
            # Quiet, not stalled: the PING was answered at once (the doubt's own release,
            # when it doubts itself, judges what it holds).
            held = registry.release_held() if not self.suspect else len(registry.held)
            log.info("observer.hearing again after %.2fs (%d held agents judged now)", took,
                     held)  # fmt: skip
        self.deaf_since = None
        if not self.suspect:
            self._suspect.set(0)

    def _max_silent(self, now: float) -> int | None:
        if self.suspect:
            return 0  # every silence waits for the confirmation
        if now < self._trusted_until or self.share >= 1.0:
            return None
        recent, lapses = self._recent, self._lapses
        while lapses and lapses[0][0] <= now:
            until, agent_id = lapses.popleft()
            if recent.get(agent_id) == until:  # not moved again since
                del recent[agent_id]
        counts = self.registry.counts
        fleet = sum(counts.values()) - counts["offline"]
        allowed = max(math.floor(self.share * fleet), MIN_SILENT - 1)
        return max(allowed - len(recent), 0)

    def _suspect_self(self, now: float, held: int) -> None:
        self.suspect = True
        self.suspected += 1
        self._since = now
        self._beats_at = self.registry.beats
        self._next_confirm = now
        self._suspect.set(1)
        counts = self.registry.counts
        # Named apart: the lately silenced may be offline by now, and the fleet counts no
        # offline agent ("silent=2 fleet=1" read as twice the fleet: nemesis seed 35).
        log.warning(
            "observer.suspect_self held=%d silenced_lately=%d not_offline=%d share=%.2f: too "
            "much of the fleet went silent at once; holding every state until heartbeats "
            "flow again or the server confirms who is gone",
            held, len(self._recent), sum(counts.values()) - counts["offline"], self.share,
        )  # fmt: skip

    def release(self, now: float, why: str) -> None:
        """The link is shown to work: held deadlines run again (believed for TRUST_S).

        After a doubt, the silence the broker could not tell from its own deafness is held
        against nobody: every clock is rebased over the doubt (silence before it still
        counts, plus one interval of grace), and the held agents' rebased deadlines are
        believed when they come (no second hold for the same silence)."""
        if not self.suspect and not self.registry.held:
            return
        registry = self.registry
        if self.suspect:
            ids = set(registry.held)
            registry.observer_gap(self._since, now)
            recs = [registry.agents[a] for a in ids if a in registry.agents]
            until = max((r.offline_at for r in recs if r.state != "offline"), default=now)
            held = len(ids)
            self._trusted_until = max(now, until) + TRUST_S
        else:
            held = registry.release_held()
            self._trusted_until = now + TRUST_S
        if self.suspect:
            self.suspect = False
            self._suspect.set(0)
            log.warning("observer.trusted again after %.2fs: %s (%d held agents judged now)",
                        now - self._since, why, held)  # fmt: skip

    async def _confirm(self) -> None:
        """Ask the servers: a CONNZ answer or a decided probe shows the link works."""
        ctx = self.ctx
        try:
            answers = self.advisories.answers
            await self.advisories.reconcile()
            if self.advisories.answers > answers:
                self.release(ctx.clock(), "the server's connection list answered")
                return
            for agent_id in list(self.registry.held)[:CONFIRM_PROBES]:
                if not self.suspect:
                    return
                try:
                    await ctx.nc.request(ctx.subjects.probe(agent_id), b"{}",
                                         timeout=self.cfg.probe_timeout_s)  # fmt: skip
                except NatsTimeoutError:
                    continue
                except NoRespondersError:
                    pass
                self.release(ctx.clock(), f"a probe of {agent_id} was decided")
                return
        except Exception:  # noqa: BLE001 - confirmation is retried on the next round
            log.debug("observer.confirm failed", exc_info=True)
        finally:
            self._confirming = False

    # --- the link -------------------------------------------------------------------------

    def lost(self, now: float) -> None:
        """The broker's connection dropped: stop judging, withhold events."""
        if self.link.connected:
            self.link.lost(now)
            self._suspect.set(1)
            log.warning("observer.link_lost: deadlines paused, events withheld until reconnect")

    def regained(self, now: float) -> None:
        """Reconnected: rebase every agent's clock over the outage, reconcile, trust again."""
        if self.link.connected:
            return
        start = min(self.link.since, self._since) if self.suspect else self.link.since
        if self.deaf_since is not None:
            start = min(start, self._deaf_from)  # deaf before the client gave the link up
        self.link.regained(now)
        self.registry.observer_gap(start, now)
        self._gaps.inc()
        self.suspect = False
        self.deaf_since = None  # the rebase, from where hearing stopped, covers it
        self._recent.clear()
        self._lapses.clear()
        self._suspect.set(0)
        log.warning("observer.link_regained after %.2fs: every agent's clock rebased",
                    now - start)  # fmt: skip
        self.advisories.on_reconnected()
