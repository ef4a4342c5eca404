"""``reach rules set|show|clear``: the live route rules in KV ``reach_rules``.

``set CAPABILITY --split version=1:95,2:5`` (or ``--split TAG=a:90,b:10``), ``--require
env=prod`` (repeatable), ``--quota RATE[:BURST]``: changes only what it names, over the rule
stored for the capability. Every broker replica applies a change at once and audits it
(``reach events`` shows it as kind ``rule``). ``show`` lists the stored rules; rules of a
broker's ``broker.toml`` apply where the bucket has none. Needs a credential that may write
the bucket (the broker's)."""

from __future__ import annotations

import argparse
import asyncio
import getpass
import socket
import time
from typing import Any

import msgspec

from jetstream.names import RULES_BUCKET
from reach_agent.routing.rules import RouteRule, build, decode_rule, describe, rule_encoder
from reach_agent.wire.errors import InvalidRequest

from .common import (
    EXIT_UNAVAILABLE,
    EXIT_USAGE,
    CliError,
    Subcommands,
    add_common,
    connect,
    refusal,
)
from .common import capability as check_capability
from .output import print_json, print_table, utc


def add_parser(sub: Subcommands) -> None:
    p = sub.add_parser(
        "rules", help=f"route rules: splits, required tags, quotas (KV {RULES_BUCKET})"
    )
    verbs = p.add_subparsers(dest="verb", required=True, metavar="VERB")
    s = verbs.add_parser("set", help="set (part of) a capability's rule")
    add_common(s)
    s.add_argument("capability", help="the capability the rule is for")
    s.add_argument("--split", metavar="KEY=V:W,...",
                   help="split traffic by version or a tag: version=1:95,2:5")  # fmt: skip
    s.add_argument("--require", action="append", metavar="TAG=VALUE",
                   help="a tag every routed agent must carry (repeatable): env=prod")  # fmt: skip
    s.add_argument("--quota", metavar="RATE[:BURST]",
                   help="route requests per second per caller for this capability")  # fmt: skip
    s.set_defaults(func=run)
    sh = verbs.add_parser("show", help="the stored rules (one capability, or all)")
    add_common(sh)
    sh.add_argument("capability", nargs="?", help="one capability (default: every rule)")
    sh.set_defaults(func=run)
    c = verbs.add_parser("clear", help="remove a capability's stored rule")
    add_common(c)
    c.add_argument("capability", help="the capability whose rule goes")
    c.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    return asyncio.run(_rules(args))


def _who() -> str:
    try:
        user = getpass.getuser()
    except Exception:  # noqa: BLE001 - no login name (a container): the host says enough
        user = "unknown"
    return f"{user}@{socket.gethostname()}"


async def _rules(args: argparse.Namespace) -> int:
    from nats.errors import Error as NatsError
    from nats.js.errors import BucketNotFoundError, NotFoundError

    from jetstream import rules as bucket

    if args.capability is not None:
        check_capability(args.capability)
    if args.verb == "set" and args.split is None and args.require is None and args.quota is None:
        raise CliError("rules set: name at least one of --split, --require, --quota", EXIT_USAGE)
    nc = await connect(args)
    try:
        if args.verb == "set":
            stored = await bucket.read_all(nc)
            base = decode_rule(args.capability, stored[args.capability]) if (
                args.capability in stored) else RouteRule()  # fmt: skip
            try:
                rule = build(args.split, args.require, args.quota, base)
            except InvalidRequest as exc:
                raise CliError(exc.message, EXIT_USAGE) from None
            rule = msgspec.structs.replace(rule, updated_ms=int(time.time() * 1000),
                                           updated_by=_who())  # fmt: skip
            revision = await bucket.put(nc, args.capability, rule_encoder.encode(rule))
            out: Any = {"capability": args.capability, "revision": revision, "rule": rule}
            text = f"{args.capability}: {describe(rule)} (revision {revision})"
        elif args.verb == "clear":
            cleared = await bucket.delete(nc, args.capability)
            out = {"capability": args.capability, "cleared": cleared}
            text = (f"{args.capability}: rule cleared" if cleared
                    else f"{args.capability}: no stored rule")  # fmt: skip
        else:
            stored = await bucket.read_all(nc)
            rules = {cap: decode_rule(cap, data) for cap, data in sorted(stored.items())
                     if args.capability in (None, cap)}  # fmt: skip
            if args.json:
                print_json(rules)
                return 0
            if not rules:
                what = f"for {args.capability!r} " if args.capability else ""
                print(f"no stored rule {what}(broker.toml's rules apply where the bucket has none)")
                return 0
            rows = [(cap, describe(r), utc(r.updated_ms) if r.updated_ms else "",
                     r.updated_by or "") for cap, r in rules.items()]  # fmt: skip
            print_table(rows, ["CAPABILITY", "RULE", "UPDATED", "BY"])
            return 0
    except (BucketNotFoundError, NotFoundError):
        raise CliError(f"no KV bucket {RULES_BUCKET} on this server: a broker creates it at "
                       "start when JetStream is on", EXIT_UNAVAILABLE) from None  # fmt: skip
    except (NatsError, TimeoutError) as exc:
        raise refusal(nc, f"cannot use KV {RULES_BUCKET}") or CliError(
            f"cannot use KV {RULES_BUCKET}: {exc or type(exc).__name__}", EXIT_UNAVAILABLE
        ) from None
    finally:
        await nc.close()
    if args.json:
        print_json(out)
    else:
        print(text)
    return 0
