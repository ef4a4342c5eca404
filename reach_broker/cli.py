"""The ``reach`` command line: ``reach broker`` and the operator commands.

Every option also comes from an environment variable (``NATS_URL``, ``REACH_*``); ``--json``
prints machine-readable output; errors are one clear line on stderr and a non-zero exit.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import sys
from collections.abc import Callable, Sequence
from typing import Any

import msgspec

from reach_agent.errors import ReachError

from . import __version__
from .config import ConfigError, load
from .natsserver import NatsServer, NatsServerError

log = logging.getLogger("reach")

EXIT_USAGE = 2
EXIT_UNAVAILABLE = 3


class CliError(Exception):
    """A failure to report as one line on stderr with exit code ``code``."""

    def __init__(self, message: str, code: int = 1) -> None:
        super().__init__(message)
        self.code = code


# --- logging ------------------------------------------------------------------------------


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": round(record.created, 3),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out)


def setup_logging(fmt: str, level: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(
            logging.Formatter("%(asctime)s %(levelname)-5s %(name)s %(message)s", "%H:%M:%S")
        )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())


# --- helpers shared by commands -----------------------------------------------------------


def env_default(name: str, default: Any = None) -> Any:
    return os.environ.get(name, default)


def add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--server", "-s", default=env_default("NATS_URL"),
                   help="NATS server URL(s), comma-separated (env NATS_URL)")  # fmt: skip
    p.add_argument("--creds", default=env_default("REACH_CREDS"),
                   help="NATS credentials file (env REACH_CREDS)")  # fmt: skip
    p.add_argument("--json", action="store_true", default=bool(env_default("REACH_JSON")),
                   help="machine-readable JSON output (env REACH_JSON)")  # fmt: skip
    p.add_argument("--prefix", default=env_default("REACH_PREFIX", "reach"),
                   help="subject prefix (env REACH_PREFIX)")  # fmt: skip
    p.add_argument("--timeout", type=float, default=float(env_default("REACH_TIMEOUT", "2")),
                   help="request timeout in seconds (env REACH_TIMEOUT)")  # fmt: skip
    p.add_argument("--log-format", choices=["text", "json"],
                   default=env_default("REACH_LOG_FORMAT", "text"))  # fmt: skip
    p.add_argument("--log-level", default=env_default("REACH_LOG_LEVEL", "info"))


def print_json(value: Any) -> None:
    sys.stdout.write(msgspec.json.encode(value).decode() + "\n")


def format_table(rows: Sequence[Sequence[Any]], header: Sequence[str]) -> list[str]:
    """Left-aligned columns two spaces apart, header first; ``None`` cells print empty."""
    cells = [[str(c) for c in header]] + [["" if c is None else str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    return ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in cells]


def print_table(rows: Sequence[Sequence[Any]], header: Sequence[str]) -> None:
    for line in format_table(rows, header):
        sys.stdout.write(line + "\n")


async def connect(args: argparse.Namespace, name: str = "reach-cli") -> Any:
    """A NATS connection for a CLI command, or a clear CliError."""
    import nats

    servers = (args.server or "nats://127.0.0.1:4222").split(",")
    errors: list[BaseException] = []

    async def on_error(exc: Exception) -> None:  # nats-py would log a traceback per attempt
        errors.append(exc)

    try:
        # max_reconnect_attempts=0 would mean "forever" to nats-py's initial server loop;
        # 1 tries each server twice, 0.1 s apart, then gives up.
        return await nats.connect(
            servers=servers,
            name=name,
            user_credentials=args.creds,
            connect_timeout=args.timeout,
            max_reconnect_attempts=1,
            reconnect_time_wait=0.1,
            allow_reconnect=False,
            error_cb=on_error,
        )
    except Exception as exc:  # every connect failure is the same to a user
        cause = errors[-1] if errors else exc
        raise CliError(
            f"cannot connect to NATS at {','.join(servers)}: {cause or type(cause).__name__} "
            "(is `reach broker` running? set --server or NATS_URL)",
            EXIT_UNAVAILABLE,
        ) from None


async def request(nc: Any, subject: str, data: bytes, timeout_s: float) -> bytes:
    """Request-reply that turns no-responders, timeouts and error replies into CliError."""
    from nats.errors import NoRespondersError
    from nats.errors import TimeoutError as NatsTimeout

    from reach_agent.errors import from_reply

    try:
        msg = await nc.request(subject, data, timeout=timeout_s)
    except NoRespondersError:
        raise CliError(
            f"no broker answers on {subject} (is `reach broker` running on this server?)",
            EXIT_UNAVAILABLE,
        ) from None
    except NatsTimeout:
        raise CliError(f"no reply on {subject} within {timeout_s}s", EXIT_UNAVAILABLE) from None
    err = from_reply(msg.headers, msg.data)
    if err is not None:
        raise CliError(f"{err.code}: {err.message}")
    return bytes(msg.data)


# --- reach broker -------------------------------------------------------------------------


def cmd_broker(args: argparse.Namespace) -> int:
    try:
        cfg = load(args.config)
    except ConfigError as exc:
        raise CliError(str(exc), EXIT_USAGE) from None
    if args.server:
        cfg.nats.url = args.server
    if args.creds:
        cfg.nats.creds = args.creds
    if args.metrics_port is not None:
        cfg.broker.metrics_port = args.metrics_port
    if args.metrics_host:
        cfg.broker.metrics_host = args.metrics_host
    if args.port is not None:
        cfg.nats.embedded_port = args.port
    if args.store_dir:
        cfg.nats.embedded_store_dir = args.store_dir
    if args.broker_id:
        cfg.broker.broker_id = args.broker_id
    _install_uvloop()
    return asyncio.run(_broker_main(cfg))


def _install_uvloop() -> None:
    try:
        import uvloop
    except ImportError:
        return
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())


async def _broker_main(cfg: Any) -> int:
    from prometheus_client import start_http_server

    from .metrics import Metrics
    from .service import Broker

    server: NatsServer | None = None
    if not cfg.nats.url:
        # Own session: a terminal Ctrl-C reaches the broker only, which stops its clients
        # first and then the server (the server dying first would leave them reconnecting).
        server = NatsServer(port=cfg.nats.embedded_port, store_dir=cfg.nats.embedded_store_dir,
                            new_session=True)  # fmt: skip
        try:
            await asyncio.to_thread(server.start)
        except NatsServerError as exc:
            raise CliError(f"embedded nats-server: {exc}", EXIT_UNAVAILABLE) from None
        cfg.nats.url = server.url
        print(f"reach: embedded nats-server listening on {server.url} "
              f"(JetStream store {server.store_dir})", flush=True)  # fmt: skip
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    metrics = Metrics()
    try:
        if cfg.broker.metrics_port:
            try:
                start_http_server(cfg.broker.metrics_port, cfg.broker.metrics_host,
                                  registry=metrics.registry)  # fmt: skip
            except OSError as exc:
                raise CliError(
                    f"metrics port {cfg.broker.metrics_port}: {exc.strerror} "
                    "(choose another with --metrics-port, 0 turns it off)",
                    EXIT_UNAVAILABLE,
                ) from None
        broker = Broker(cfg, metrics=metrics)
        try:
            await broker.start()
        except Exception as exc:
            raise CliError(
                f"cannot start the broker on {cfg.nats.url}: {exc or type(exc).__name__}",
                EXIT_UNAVAILABLE,
            ) from None
        where = (f"; metrics on http://{cfg.broker.metrics_host}:{cfg.broker.metrics_port}/metrics"
                 if cfg.broker.metrics_port else "")  # fmt: skip
        print(f"reach: broker {broker.broker_id} serving on {cfg.nats.url}{where}", flush=True)
        try:
            await stop.wait()
        finally:
            print("reach: stopping", flush=True)
            await broker.stop()
    finally:
        if server is not None:
            await asyncio.to_thread(server.stop)
    return 0


# --- reach agents / route -----------------------------------------------------------------


def cmd_agents(args: argparse.Namespace) -> int:
    return asyncio.run(_agents(args))


async def _agents(args: argparse.Namespace) -> int:
    from reach_agent import schema

    body: dict[str, str] = {}
    if args.capability:
        body["capability"] = args.capability
    if args.state:
        body["state"] = args.state
    nc = await connect(args)
    try:
        data = await request(nc, f"{args.prefix}.agents", json.dumps(body).encode(), args.timeout)
    finally:
        await nc.close()
    views = schema.agent_views_decoder.decode(data)
    if args.json:
        print_json(views)
        return 0
    print_table(agent_rows(views), AGENT_HEADER)
    return 0


AGENT_HEADER = ["AGENT", "STATE", "SCORE", "LOAD", "LAST HEARD", "CAPABILITIES", "REGION",
                "SUCCESS"]  # fmt: skip


def agent_rows(views: Sequence[Any], now_ms: float | None = None) -> list[tuple[str, ...]]:
    """Table rows of ``reach.agents`` views (shared by ``reach agents`` and ``reach top``)."""
    return [
        (v.agent_id, v.state, f"{v.score:.1f}", f"{v.active}/{v.max_concurrency}",
         _ago(v.last_seen_ms, now_ms), ",".join(v.capabilities), v.region or "-",
         f"{100 * v.success_rate:.1f}%")
        for v in views
    ]  # fmt: skip


def _ago(ms: int, now_ms: float | None = None) -> str:
    import time

    if not ms:
        return "-"
    now = time.time() * 1000.0 if now_ms is None else now_ms
    return f"{max(now - ms, 0.0) / 1000.0:.1f}s ago"


def cmd_route(args: argparse.Namespace) -> int:
    return asyncio.run(_route(args))


async def _route(args: argparse.Namespace) -> int:
    from reach_agent import schema

    tags: dict[str, str] = {}
    for item in args.tag or []:
        key, sep, value = item.partition("=")
        if not sep:
            raise CliError(f"--tag {item!r} is not key=value", EXIT_USAGE)
        tags[key] = value
    req = schema.RouteRequest(
        limit=args.limit, region=args.region, tags=tags, sticky_key=args.sticky_key,
        exclude=args.exclude or [], allow_suspect=args.allow_suspect,
    )  # fmt: skip
    nc = await connect(args)
    try:
        data = await request(
            nc, f"{args.prefix}.route.{args.capability}", schema.encoder.encode(req), args.timeout
        )
    finally:
        await nc.close()
    reply = schema.route_reply_decoder.decode(data)
    if args.json:
        print_json(reply)
        return 0
    rows = [(i + 1, c.agent_id, c.state, f"{c.score:.1f}", f"{c.load:.2f}", c.region or "-",
             c.subject) for i, c in enumerate(reply.candidates)]  # fmt: skip
    print_table(rows, ["#", "AGENT", "STATE", "SCORE", "LOAD", "REGION", "SUBJECT"])
    return 0


# --- reach events -------------------------------------------------------------------------

AUDIT_STREAM = "REACH_AUDIT"
_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def parse_duration(text: str, what: str = "--since") -> float:
    """``90s``, ``15m``, ``1h30m``, ``2d``, ``500ms`` or plain seconds → seconds (> 0)."""
    import re

    value = text.strip()
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|s|m|h|d)", value)
    if re.fullmatch(r"\d+(?:\.\d+)?", value):
        seconds = float(value)
    elif parts and "".join(n + u for n, u in parts) == value:
        seconds = sum(float(n) * _UNITS[u] for n, u in parts)
    else:
        raise CliError(f"{what} {text!r} is not a duration (like 90s, 15m, 1h30m, 2d)", EXIT_USAGE)
    if seconds <= 0:
        raise CliError(f"{what} {text!r} must be above zero", EXIT_USAGE)
    return seconds


def format_event(event: Any) -> str:
    """One human line: time, kind, agent, transition, reason, broker."""
    import time

    at = time.strftime("%H:%M:%S", time.localtime(event.at_ms / 1000.0))
    move = f"{event.from_ or '-'} -> {event.to}" if event.to else ""
    return (f"{at}.{event.at_ms % 1000:03d}  {event.kind:<10}  {event.agent_id:<16}  "
            f"{move:<22}  {event.reason}  [{event.broker_id}]").rstrip()  # fmt: skip


def cmd_events(args: argparse.Namespace) -> int:
    since = parse_duration(args.since) if args.since else None
    if since is None and not args.follow:
        since = 3600.0  # plain `reach events`: the last hour of the audit trail
    return asyncio.run(_events(args, since))


async def _events(args: argparse.Namespace, since: float | None) -> int:
    """Print REACH_AUDIT from ``since`` seconds ago (ordered consumer), then live if --follow."""
    from reach_agent import schema

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    queue: asyncio.Queue[Any] = asyncio.Queue()

    async def on_msg(msg: Any) -> None:
        queue.put_nowait(msg)

    def emit(msg: Any) -> None:
        try:
            event = schema.event_decoder.decode(msg.data)
        except msgspec.DecodeError as exc:
            log.warning("events.undecodable subject=%s error=%s", msg.subject, exc)
            return
        if args.json:
            print_json(event)
        else:
            sys.stdout.write(format_event(event) + "\n")
        sys.stdout.flush()

    nc = await connect(args)
    try:
        subject = f"{args.prefix}.event.>"
        if since is None:
            await nc.subscribe(subject, cb=on_msg)
            await nc.flush()
            caught_up = True
        else:
            psub = await _audit_subscribe(nc, subject, since, on_msg, args.timeout)
            info = await psub.consumer_info()
            # nothing delivered and nothing pending: the window is empty
            caught_up = info.num_pending == 0 and info.delivered.consumer_seq == 0
        if caught_up and not args.follow:
            return 0
        stopper = asyncio.ensure_future(stop.wait())
        try:
            while not stop.is_set():
                getter = asyncio.ensure_future(queue.get())
                wait = None if (caught_up or args.follow) else max(args.timeout, 2.0)
                done, _ = await asyncio.wait({getter, stopper}, timeout=wait,
                                             return_when=asyncio.FIRST_COMPLETED)  # fmt: skip
                if getter not in done:
                    getter.cancel()
                    if not done:  # a quiet stream after the last pending message
                        break
                    continue
                msg = getter.result()
                emit(msg)
                pending = msg.metadata.num_pending if since is not None else None
                if pending == 0 and not args.follow:
                    break
        finally:
            stopper.cancel()
    finally:
        await nc.close()
    return 0


async def _audit_subscribe(
    nc: Any, subject: str, since: float, cb: Callable[[Any], Any], timeout_s: float
) -> Any:
    """An ordered consumer on REACH_AUDIT from ``since`` seconds ago, or a clear CliError."""
    import datetime

    from nats.errors import NoRespondersError
    from nats.errors import TimeoutError as NatsTimeout
    from nats.js import api
    from nats.js.errors import NotFoundError, ServiceUnavailableError

    js = nc.jetstream(timeout=timeout_s)
    start = datetime.datetime.now(datetime.UTC) - datetime.timedelta(seconds=since)
    try:
        await js.stream_info(AUDIT_STREAM)
        return await js.subscribe(
            subject,
            stream=AUDIT_STREAM,
            cb=cb,
            ordered_consumer=True,
            config=api.ConsumerConfig(
                deliver_policy=api.DeliverPolicy.BY_START_TIME, opt_start_time=start
            ),
        )
    except NotFoundError:
        raise CliError(
            f"stream {AUDIT_STREAM} not found on this server: the broker creates it at start "
            "when JetStream is on (use --follow for live events only)",
            EXIT_UNAVAILABLE,
        ) from None
    except (NoRespondersError, ServiceUnavailableError, NatsTimeout):
        raise CliError(
            f"JetStream is not available on this server, so there is no {AUDIT_STREAM} "
            "history (use --follow for live events only)",
            EXIT_UNAVAILABLE,
        ) from None


# --- reach top / demo ----------------------------------------------------------------------


def cmd_top(args: argparse.Namespace) -> int:
    from .top import run_top

    return asyncio.run(run_top(args))


def cmd_demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    return run_demo(args)


# --- reach ack -----------------------------------------------------------------------------


def cmd_ack(args: argparse.Namespace) -> int:
    return asyncio.run(_ack(args))


async def _ack(args: argparse.Namespace) -> int:
    """Every record stored on REACH_ACKS for one request id (received, completed/failed)."""
    from jetstream import acks
    from reach_agent.schema import decode_ack_record
    from reach_agent.subjects import Subjects

    try:
        acks.check_request_id(args.request_id)
    except acks.InvalidRequestId as exc:
        raise CliError(str(exc), EXIT_USAGE) from None
    nc = await connect(args)
    try:
        stored = await acks.all_records(nc, args.request_id, subjects=Subjects(args.prefix),
                                        timeout_s=args.timeout)  # fmt: skip
    except Exception as exc:  # no stream, no JetStream: one clear line
        raise CliError(f"cannot read REACH_ACKS: {exc or type(exc).__name__}",
                       EXIT_UNAVAILABLE) from None  # fmt: skip
    finally:
        await nc.close()
    if not stored:
        raise CliError(f"no ack record for request_id {args.request_id!r} (acks are kept 24 h)")
    records = [decode_ack_record(s.data) for s in stored]
    if args.json:
        print_json(records if args.all else records[-1])
        return 0
    shown = records if args.all else [records[-1]]
    rows = [
        (r.state, r.agent_id, r.capability, _when(r.at_ms),
         (r.error or {}).get("code", "") or "",
         (bytes(r.result).decode(errors="replace")[:60] if r.result else
          (r.error or {}).get("message", "")[:60]))
        for r in shown
    ]  # fmt: skip
    print(f"request {args.request_id}")
    print_table(rows, ["STATE", "AGENT", "CAPABILITY", "AT", "ERROR", "RESULT / MESSAGE"])
    return 0


def _when(ms: int) -> str:
    import datetime as dt

    return dt.datetime.fromtimestamp(ms / 1000, dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"


# --- entry point --------------------------------------------------------------------------

Command = Callable[[argparse.Namespace], int]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="reach", description="reach: every AI agent in a fleet reachable by capability"
    )
    parser.add_argument("--version", action="version", version=f"reach {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("broker", help="run a broker (embedded nats-server unless --server)")
    add_common(p)
    p.add_argument("--config", "-c", default=env_default("REACH_CONFIG"),
                   help="broker.toml (env REACH_CONFIG)")  # fmt: skip
    p.add_argument("--metrics-port", type=int, default=_int_env("REACH_METRICS_PORT"),
                   help="Prometheus /metrics port, 0 turns it off "
                        "(env REACH_METRICS_PORT)")  # fmt: skip
    p.add_argument("--metrics-host", default=env_default("REACH_METRICS_HOST"),
                   help="address of /metrics (default 127.0.0.1; 0.0.0.0 in containers; "
                        "env REACH_METRICS_HOST)")  # fmt: skip
    p.add_argument("--port", type=int, default=_int_env("REACH_NATS_PORT"),
                   help="port of the embedded nats-server (default 4222; "
                        "0: any free port)")  # fmt: skip
    p.add_argument("--store-dir", default=env_default("REACH_STORE_DIR"),
                   help="JetStream store dir of the embedded server "
                        "(default: a temp dir)")  # fmt: skip
    p.add_argument("--broker-id", default=env_default("REACH_BROKER_ID"))
    p.set_defaults(func=cmd_broker)

    p = sub.add_parser("agents", help="list agents with state, score and load")
    add_common(p)
    p.add_argument("--capability", "-C")
    p.add_argument("--state", choices=["healthy", "suspect", "offline", "recovering", "draining"])
    p.set_defaults(func=cmd_agents)

    p = sub.add_parser("route", help="ask for the candidates a caller would get")
    add_common(p)
    p.add_argument("capability")
    p.add_argument("--limit", "-n", type=int, default=3)
    p.add_argument("--region")
    p.add_argument("--tag", action="append", metavar="K=V")
    p.add_argument("--sticky-key")
    p.add_argument("--exclude", action="append", metavar="AGENT_ID")
    p.add_argument("--allow-suspect", action="store_true")
    p.set_defaults(func=cmd_route)

    p = sub.add_parser("top", help="live view of the fleet: states, scores, load, route rate")
    add_common(p)
    p.add_argument("--interval", type=float, default=1.0, help="seconds between refreshes")
    p.add_argument("--once", action="store_true", help="print one snapshot and exit")
    p.add_argument("--events", type=int, default=8, help="recent events shown")
    p.set_defaults(func=cmd_top)

    p = sub.add_parser("events", help="the event stream (REACH_AUDIT history and live)")
    add_common(p)
    p.add_argument("--since", metavar="DURATION",
                   help="replay REACH_AUDIT from this long ago "
                        "(90s, 15m, 1h; default 1h)")  # fmt: skip
    p.add_argument("--follow", "-f", action="store_true", help="keep printing live events")
    p.set_defaults(func=cmd_events)

    p = sub.add_parser("demo", help="embedded NATS, a broker, three demo agents and calls")
    add_common(p)
    p.add_argument("--duration", type=float, default=None,
                   help="stop after this many seconds (default: until Ctrl-C)")  # fmt: skip
    p.add_argument("--rate", type=float, default=2.0, help="demo calls per second")
    p.add_argument("--no-view", action="store_true", help="no live view (logs only)")
    p.add_argument("--interval", type=float, default=1.0, help="seconds between refreshes")
    p.add_argument("--events", type=int, default=8, help="recent events shown")
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser("ack", help="the durable ack record of a request id (REACH_ACKS)")
    add_common(p)
    p.add_argument("request_id")
    p.add_argument("--all", action="store_true", help="every record, not only the latest")
    p.set_defaults(func=cmd_ack)
    return parser


def _int_env(name: str) -> int | None:
    value = os.environ.get(name)
    return int(value) if value else None


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    setup_logging(getattr(args, "log_format", "text"), getattr(args, "log_level", "info"))
    func: Command = args.func
    try:
        return func(args)
    except CliError as exc:
        sys.stderr.write(f"reach: {exc}\n")
        return exc.code
    except ReachError as exc:
        sys.stderr.write(f"reach: {exc.code}: {exc.message}\n")
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    # `python -m reach_broker.cli`: run the imported module's main, so `CliError` raised in
    # modules that import `reach_broker.cli` (top, demo) is the class main() catches.
    from reach_broker.cli import main as _main

    sys.exit(_main())
