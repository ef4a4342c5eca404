"""The live view of the fleet (``reach top``, and ``reach demo``'s screen), redrawn with plain
ANSI codes (usable over SSH).

Each refresh pages through ``<prefix>.agents.<partition>`` (states, scores, load: each
partition from its owner) and every broker
for its NATS Services stats (``$SRV.STATS.reach-broker``: route requests, from which the
route rate is the difference between two refreshes). Recent events are the last ones of
``REACH_AUDIT``, then the live ones through the same consumer (:mod:`jetstream.audit`; live
only when the stream or JetStream is missing). ``--once`` prints one snapshot; ``--json``
prints snapshots as JSON lines.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import shutil
import sys
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from typing import Any

import msgspec
from nats.errors import Error as NatsError
from nats.micro.service import ServiceVerb, control_subject

from jetstream import audit
from reach_agent.connection import flush_subscriptions
from reach_agent.wire import schema
from reach_agent.wire.schema import AGENT_STATES, AgentView, Event
from reach_agent.wire.subjects import Subjects

from .agents import fleet
from .common import EXIT_UNAVAILABLE, CliError
from .output import AGENT_HEADER, agent_rows, format_event, format_table, print_json

log = logging.getLogger(__name__)

SERVICE_NAME = "reach-broker"
"""The broker's NATS Services name (``service.SERVICE_NAME``; not imported: the view stays
light)."""

STATS_SUBJECT = control_subject(ServiceVerb.STATS, SERVICE_NAME)
"""``$SRV.STATS.reach-broker``: every replica answers with its endpoint stats."""
STATS_WINDOW_S = 0.15
"""After the first stats reply, how long to wait for the other broker replicas."""


class BrokerStats(msgspec.Struct, kw_only=True):
    """One broker replica as its NATS Services stats describe it."""

    id: str
    broker_id: str
    version: str
    route_requests: int
    route_errors: int
    route_avg_ms: float


class Snapshot(msgspec.Struct, kw_only=True):
    """What one refresh of ``reach top`` shows (also its ``--json`` form)."""

    at_ms: int
    agents: list[AgentView]
    by_state: dict[str, int]
    brokers: list[BrokerStats]
    route_requests: int
    route_rate: float | None
    """Route requests per second since the previous refresh (None on the first)."""
    events: list[Event]
    error: str | None = None


_stats_decoder = msgspec.json.Decoder(dict[str, Any])


class Fleet:
    """Collects snapshots over one NATS connection."""

    def __init__(
        self,
        nc: Any,
        *,
        subjects: Subjects,
        timeout: float,
        max_events: int,
        reconnect: Callable[[], Awaitable[Any]] | None = None,
    ) -> None:
        self.nc = nc
        self.reconnect = reconnect
        """Makes a new connection when the server went away (``reach top`` keeps running)."""
        self.subjects = subjects
        self.timeout = timeout
        self.events: collections.deque[Event] = collections.deque(maxlen=max(max_events, 0))
        self._prev: dict[str, tuple[float, int]] = {}

    async def start(self) -> None:
        """The last events of the audit trail (when there is one), then the live ones."""
        await self._follow_events(history=self.events.maxlen or 0)

    async def _follow_events(self, *, history: int) -> None:
        if not self.events.maxlen:
            return
        try:
            follow = await audit.follow_events(self.nc, self._on_event, subjects=self.subjects,
                                               last=history, timeout_s=self.timeout)  # fmt: skip
        except (audit.AuditUnavailable, NatsError) as exc:  # no trail to read: live only
            log.debug("top.no_history error=%s", exc)
            await audit.live_events(self.nc, self._on_event, subjects=self.subjects)
            await flush_subscriptions(self.nc)
            return
        if not await follow.until_caught_up(self.timeout):
            log.debug("top.history_incomplete delivered=%d", follow.delivered)

    async def _on_event(self, stored: audit.StoredEvent) -> None:
        try:
            self.events.append(schema.event_decoder.decode(stored.data))
        except msgspec.DecodeError:
            log.debug("top.undecodable_event subject=%s", stored.subject)

    async def snapshot(self) -> Snapshot:
        now = time.time()
        error = None
        if self.nc.is_closed:
            if self.reconnect is None:
                raise CliError("lost the connection to NATS", EXIT_UNAVAILABLE)
            try:
                self.nc = await self.reconnect()
                await self._follow_events(history=0)
            except CliError as exc:
                return Snapshot(at_ms=int(now * 1000), agents=[], by_state={}, brokers=[],
                                route_requests=0, route_rate=None, events=list(self.events),
                                error=f"{exc}; retrying")  # fmt: skip
        try:
            agents = await fleet(self.nc, self.subjects, self.timeout)
        except CliError as exc:
            agents, error = [], str(exc)
        except Exception as exc:  # e.g. the connection closed: show it, go on
            agents, error = [], f"{type(exc).__name__}: {exc}"
        try:
            brokers = await self.broker_stats()
        except Exception:  # same: the next refresh tries again
            brokers = []
        total = sum(b.route_requests for b in brokers)
        rate = None
        if self._prev:
            deltas = []
            for b in brokers:
                if b.id in self._prev:
                    t0, n0 = self._prev[b.id]
                    deltas.append((b.route_requests - n0) / max(now - t0, 1e-3))
            rate = round(sum(deltas), 2)
        self._prev = {b.id: (now, b.route_requests) for b in brokers}
        by_state: dict[str, int] = {s: 0 for s in AGENT_STATES}
        for view in agents:
            by_state[view.state] = by_state.get(view.state, 0) + 1
        return Snapshot(
            at_ms=int(now * 1000),
            agents=agents,
            by_state=by_state,
            brokers=brokers,
            route_requests=total,
            route_rate=rate,
            events=list(self.events),
            error=error,
        )

    async def broker_stats(self) -> list[BrokerStats]:
        """Stats of every replica answering ``$SRV.STATS.reach-broker`` (short gather)."""
        inbox = self.nc.new_inbox()
        replies: asyncio.Queue[bytes] = asyncio.Queue()

        async def on_reply(msg: Any) -> None:
            replies.put_nowait(msg.data)

        sub = await self.nc.subscribe(inbox, cb=on_reply)
        out: list[BrokerStats] = []
        try:
            await self.nc.publish(STATS_SUBJECT, b"", reply=inbox)
            wait = self.timeout
            while True:
                try:
                    data = await asyncio.wait_for(replies.get(), wait)
                except TimeoutError:
                    break
                wait = STATS_WINDOW_S
                stats = _broker_stats(data)
                if stats is not None:
                    out.append(stats)
        finally:
            await sub.unsubscribe()
        out.sort(key=lambda b: b.broker_id)
        return out


def _broker_stats(data: bytes) -> BrokerStats | None:
    try:
        raw = _stats_decoder.decode(data)
        route: dict[str, Any] = next(
            (e for e in raw.get("endpoints") or [] if e.get("name") == "route"), {}
        )
        return BrokerStats(
            id=str(raw["id"]),
            broker_id=str((raw.get("metadata") or {}).get("broker_id", raw["id"])),
            version=str(raw.get("version", "")),
            route_requests=int(route.get("num_requests", 0)),
            route_errors=int(route.get("num_errors", 0)),
            route_avg_ms=round(int(route.get("average_processing_time", 0)) / 1e6, 3),
        )
    except (msgspec.DecodeError, KeyError, TypeError, ValueError):
        log.debug("top.bad_stats_reply data=%r", data[:200])
        return None


def render(
    snap: Snapshot,
    *,
    server: str,
    width: int,
    height: int,
    title: str = "reach top",
    notes: Sequence[str] = (),
) -> str:
    """One frame of text, cut to ``width`` columns and ``height`` lines; ``notes`` (what the
    demo did, e.g. restarted an agent) go under the header."""
    clock = time.strftime("%H:%M:%S", time.localtime(snap.at_ms / 1000.0))
    rate = "-" if snap.route_rate is None else f"{snap.route_rate:.1f}/s"
    states = "  ".join(f"{s} {snap.by_state.get(s, 0)}" for s in AGENT_STATES)
    lines = [
        f"{title} — {server} — {clock}   (q or Ctrl-C quits)",
        f"brokers {len(snap.brokers)}   agents {len(snap.agents)}: {states}",
        f"routes {rate}   total {snap.route_requests}"
        + "".join(f"   [{b.broker_id}: {b.route_requests}, avg {b.route_avg_ms:.2f} ms]"
                  for b in snap.brokers[:3]),
        "",
    ]  # fmt: skip
    if snap.error:
        lines += [f"! {snap.error}", ""]
    if notes:
        lines += [*notes, ""]
    agents = sorted(snap.agents, key=lambda v: (AGENT_STATES.index(v.state), -v.score, v.agent_id))
    lines += format_table(agent_rows(agents, snap.at_ms), AGENT_HEADER)
    if snap.events:
        lines += ["", "recent events"]
        lines += [format_event(e) for e in snap.events]
    if len(lines) > height:
        lines = [*lines[: height - 1], f"… {len(lines) - height + 1} more lines"]
    return "\n".join(line[:width] for line in lines)


@contextlib.contextmanager
def _keys(loop: asyncio.AbstractEventLoop, stop: asyncio.Event) -> Iterator[None]:
    """On a terminal: cbreak mode, `q` sets ``stop``; the terminal is restored on exit."""
    if not sys.stdin.isatty():
        yield
        return
    import termios
    import tty

    fd = sys.stdin.fileno()
    saved = termios.tcgetattr(fd)

    def on_key() -> None:
        with contextlib.suppress(OSError):
            if sys.stdin.read(1) in ("q", "Q"):
                stop.set()

    try:
        tty.setcbreak(fd)
        loop.add_reader(fd, on_key)
        yield
    finally:
        loop.remove_reader(fd)
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)


async def view_loop(
    nc: Any,
    *,
    subjects: Subjects,
    server: str,
    interval: float,
    timeout_s: float,
    max_events: int,
    once: bool,
    as_json: bool,
    stop: asyncio.Event,
    title: str = "reach top",
    reconnect: Callable[[], Awaitable[Any]] | None = None,
    notes: Callable[[], Sequence[str]] | None = None,
) -> None:
    """Refresh until ``stop`` (or once); redraws in place on a terminal, appends otherwise."""
    fleet = Fleet(nc, subjects=subjects, timeout=timeout_s, max_events=max_events,
                  reconnect=reconnect)  # fmt: skip
    await fleet.start()
    tty_out = sys.stdout.isatty() and not as_json and not once
    loop = asyncio.get_running_loop()
    if tty_out:
        sys.stdout.write("\x1b[?1049h\x1b[?25l")  # alternate screen, hide cursor
    try:
        with _keys(loop, stop) if tty_out else contextlib.nullcontext():
            while not stop.is_set():
                snap = await fleet.snapshot()
                if once and snap.error:
                    raise CliError(snap.error, EXIT_UNAVAILABLE)
                if as_json:
                    print_json(snap)
                else:
                    size = shutil.get_terminal_size((120, 40))
                    height = size.lines if tty_out else 10_000
                    frame = render(snap, server=server, width=size.columns, height=height,
                                   title=title, notes=notes() if notes else ())  # fmt: skip
                    if tty_out:
                        sys.stdout.write("\x1b[H\x1b[2J" + frame + "\n")
                    else:
                        sys.stdout.write(frame + "\n\n")
                sys.stdout.flush()
                if once:
                    return
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), interval)
    finally:
        if fleet.nc is not nc and not fleet.nc.is_closed:
            await fleet.nc.close()
        if tty_out:
            sys.stdout.write("\x1b[?25h\x1b[?1049l")
            sys.stdout.flush()
