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


def print_table(rows: Sequence[Sequence[Any]], header: Sequence[str]) -> None:
    cells = [[str(c) for c in header]] + [["" if c is None else str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    for r in cells:
        sys.stdout.write("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())
        sys.stdout.write("\n")


async def connect(args: argparse.Namespace, name: str = "reach-cli") -> Any:
    """A NATS connection for a CLI command, or a clear CliError."""
    import nats

    servers = (args.server or "nats://127.0.0.1:4222").split(",")
    try:
        return await nats.connect(
            servers=servers,
            name=name,
            user_credentials=args.creds,
            connect_timeout=args.timeout,
            max_reconnect_attempts=0,
            allow_reconnect=False,
        )
    except Exception as exc:  # noqa: BLE001 - every connect failure is the same to a user
        raise CliError(
            f"cannot connect to NATS at {','.join(servers)}: {exc or type(exc).__name__} "
            "(is `reach broker` running? set --server or NATS_URL)",
            EXIT_UNAVAILABLE,
        ) from None


async def request(nc: Any, subject: str, data: bytes, timeout: float) -> bytes:
    """Request-reply that turns no-responders, timeouts and error replies into CliError."""
    from nats.errors import NoRespondersError
    from nats.errors import TimeoutError as NatsTimeout

    from reach_agent.errors import from_reply

    try:
        msg = await nc.request(subject, data, timeout=timeout)
    except NoRespondersError:
        raise CliError(
            f"no broker answers on {subject} (is `reach broker` running on this server?)",
            EXIT_UNAVAILABLE,
        ) from None
    except NatsTimeout:
        raise CliError(f"no reply on {subject} within {timeout}s", EXIT_UNAVAILABLE) from None
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
        server = NatsServer(port=cfg.nats.embedded_port, store_dir=cfg.nats.embedded_store_dir)
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
        except Exception as exc:  # noqa: BLE001
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
    rows = [
        (v.agent_id, v.state, f"{v.score:.1f}", f"{v.active}/{v.max_concurrency}",
         _ago(v.last_seen_ms), ",".join(v.capabilities), v.region or "-",
         f"{100 * v.success_rate:.1f}%")
        for v in views
    ]  # fmt: skip
    print_table(rows, ["AGENT", "STATE", "SCORE", "LOAD", "LAST HEARD", "CAPABILITIES",
                       "REGION", "SUCCESS"])  # fmt: skip
    return 0


def _ago(ms: int) -> str:
    import time

    if not ms:
        return "-"
    delta = max(time.time() - ms / 1000.0, 0.0)
    return f"{delta:.1f}s ago"


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


# --- reach ack -----------------------------------------------------------------------------


def cmd_ack(args: argparse.Namespace) -> int:
    return asyncio.run(_ack(args))


async def _ack(args: argparse.Namespace) -> int:
    """Every record stored on REACH_ACKS for one request id (received, completed/failed)."""
    from jetstream import acks
    from reach_agent.durable import decode_ack

    try:
        acks.check_request_id(args.request_id)
    except acks.InvalidRequestId as exc:
        raise CliError(str(exc), EXIT_USAGE) from None
    nc = await connect(args)
    try:
        stored = await acks.all_records(nc, args.request_id, prefix=args.prefix,
                                        timeout_s=args.timeout)  # fmt: skip
    except Exception as exc:  # noqa: BLE001 - no stream, no JetStream: one clear line
        raise CliError(f"cannot read REACH_ACKS: {exc or type(exc).__name__}",
                       EXIT_UNAVAILABLE) from None  # fmt: skip
    finally:
        await nc.close()
    if not stored:
        raise CliError(f"no ack record for request_id {args.request_id!r} (acks are kept 24 h)")
    records = [decode_ack(s.data) for s in stored]
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
                   help="Prometheus /metrics port, 0 turns it off (env REACH_METRICS_PORT)")  # fmt: skip
    p.add_argument("--port", type=int, default=_int_env("REACH_NATS_PORT"),
                   help="port of the embedded nats-server (default 4222; 0: any free port)")  # fmt: skip
    p.add_argument("--store-dir", default=env_default("REACH_STORE_DIR"),
                   help="JetStream store dir of the embedded server (default: a temp dir)")  # fmt: skip
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
    sys.exit(main())
