"""``reach auth``: the credentials of a secured deployment (:mod:`reach_broker.auth`).

    reach auth init DIR [--tls] [--force]      keys, DIR/server.conf, DIR/broker.creds
    reach auth agent AGENT_ID --dir DIR        DIR/agents/AGENT_ID.creds (prints the path)
    reach auth caller NAME --dir DIR           DIR/callers/NAME.creds (prints the path)
    reach auth list --dir DIR [--json]         every credential, valid and revoked
    reach auth revoke NAME --dir DIR           revoke it and tell the running server
    reach auth push --dir DIR                  hand the running server the account again

Issuing needs no server at all (the server accepts any user JWT the DIR's account signed);
revoking reaches a running server through its system account (``DIR/sys.creds``), so it
takes effect at once, without a restart. ``--dir`` also comes from ``REACH_AUTH_DIR``.
"""

from __future__ import annotations

import argparse
import asyncio
from typing import Any

from .common import (
    EXIT_UNAVAILABLE,
    EXIT_USAGE,
    CliError,
    Subcommands,
    add_log_options,
    env_default,
    parse_duration,
    servers,
)
from .output import print_json, print_table, utc


def add_parser(sub: Subcommands) -> None:
    p = sub.add_parser("auth", help="issue, list and revoke credentials (secured mode)")
    cmds = p.add_subparsers(dest="auth_command", required=True, metavar="ACTION")

    init = cmds.add_parser("init", help="create an auth DIR: keys, server.conf, broker.creds")
    _basics(init)
    init.add_argument("dir", metavar="DIR", help="the directory to create (must not exist)")
    init.add_argument("--tls", action="store_true",
                      help="also a local CA and a server certificate: the server requires "
                           "TLS (needs the 'cryptography' package: "
                           "pip install 'nats-reach[tls]')")  # fmt: skip
    init.add_argument(
        "--force",
        action="store_true",
        help="replace an existing DIR (every credential from it stops working)",
    )
    init.add_argument("--host", default="127.0.0.1", help="address in server.conf")
    init.add_argument("--port", type=int, default=4222, help="port in server.conf")
    init.add_argument(
        "--prefix",
        default=env_default("REACH_PREFIX", "reach"),
        help="subject prefix the permissions are written for (env REACH_PREFIX)",
    )
    init.add_argument(
        "--partitions",
        type=int,
        default=int(env_default("REACH_PARTITIONS", "32")),
        help="partitions the account's subject mappings split the agents into; the brokers' "
             "[fleet] partitions must say the same (env REACH_PARTITIONS; default 32)",
    )  # fmt: skip
    init.set_defaults(func=run_init)

    for role, what in (("agent", "AGENT_ID"), ("caller", "NAME")):
        issue = cmds.add_parser(role, help=f"issue DIR/{role}s/{what}.creds; prints its path")
        _basics(issue)
        _dir(issue)
        issue.add_argument("name", metavar=what, help=f"the {role}'s {what.lower()}")
        issue.add_argument(
            "--force",
            action="store_true",
            help="replace existing credentials (the old key is revoked)",
        )
        issue.add_argument(
            "--expires",
            metavar="DURATION",
            help="lifetime of the credential (90d, 12h; default: none)",
        )
        issue.set_defaults(func=run_issue, role=role)

    listing = cmds.add_parser("list", help="every credential of DIR, valid and revoked")
    _basics(listing)
    _dir(listing)
    listing.set_defaults(func=run_list)

    for action, text in (("revoke", "revoke a credential and tell the running server"),
                         ("push", "hand the running server the DIR's account again")):  # fmt: skip
        cmd = cmds.add_parser(action, help=text)
        _basics(cmd)
        _dir(cmd)
        if action == "revoke":
            cmd.add_argument("name", metavar="AGENT_ID", help="an agent id (or a caller's name)")
            cmd.add_argument(
                "--role",
                choices=["agent", "caller", "broker"],
                help="when a caller and an agent share the name",
            )
            cmd.add_argument(
                "--no-push",
                action="store_true",
                help="only on disk (a server started from DIR loads it)",
            )
        cmd.add_argument("--server", "-s", default=env_default("NATS_URL"),
                         help="the running server (env NATS_URL; default "
                              "nats://127.0.0.1:4222)")  # fmt: skip
        cmd.add_argument("--timeout", type=float, default=float(env_default("REACH_TIMEOUT", 2)),
                         help="seconds to wait for the server (default 2; env "
                              "REACH_TIMEOUT)")  # fmt: skip
        cmd.set_defaults(func=run_revoke if action == "revoke" else run_push)


def _basics(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", default=bool(env_default("REACH_JSON")),
                   help="machine-readable JSON output (env REACH_JSON)")  # fmt: skip
    add_log_options(p)


def _dir(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dir", "-d", default=env_default("REACH_AUTH_DIR"), metavar="DIR",
                   help="the auth DIR of `reach auth init` (env REACH_AUTH_DIR)")  # fmt: skip


def _open(args: argparse.Namespace) -> Any:
    from reach_broker.auth import AuthDir, AuthError

    if not args.dir:
        raise CliError("--dir DIR is required (or set REACH_AUTH_DIR)", EXIT_USAGE)
    try:
        return AuthDir.open(args.dir)
    except AuthError as exc:
        raise CliError(str(exc), EXIT_USAGE) from None


def _identity(i: Any) -> dict[str, Any]:
    return {"role": i.role, "name": i.name, "public_key": i.public_key,
            "issued_at": i.issued_at, "expires_at": i.expires_at, "revoked_at": i.revoked_at,
            "path": str(i.path)}  # fmt: skip


def run_init(args: argparse.Namespace) -> int:
    from reach_broker.auth import AuthError, init

    try:
        d = init(args.dir, tls=args.tls, force=args.force, prefix=args.prefix, host=args.host,
                 port=args.port, partitions=args.partitions)  # fmt: skip
    except (AuthError, ValueError) as exc:
        raise CliError(str(exc), EXIT_USAGE) from None
    meta = d.meta()
    made = {"dir": str(d.root), "server_conf": str(d.server_conf),
            "broker_creds": str(d.broker_creds), "sys_creds": str(d.sys_creds),
            "ca": str(d.ca) if meta.tls else None, "tls": meta.tls, "prefix": meta.prefix,
            "account": meta.account}  # fmt: skip
    if args.json:
        print_json(made)
        return 0
    print(f"reach: auth DIR {d.root} (operator reach, account REACH {meta.account[:12]}…; "
          f"TLS {'on' if meta.tls else 'off'})")  # fmt: skip
    print(f"  server config  {d.server_conf}")
    print(f"  broker         {d.broker_creds}")
    if meta.tls:
        print(f"  CA             {d.ca}   (clients: --tls-ca / NATS_CA / tls_ca=)")
    print(f"next: reach broker --auth {d.root}\n"
          f"      reach auth agent AGENT_ID --dir {d.root}   (one per agent)\n"
          f"      reach auth caller NAME --dir {d.root}      (one per calling "
          "service)")  # fmt: skip
    return 0


def run_issue(args: argparse.Namespace) -> int:
    from reach_broker.auth import AuthError, issue

    d = _open(args)
    expires = parse_duration(args.expires, "--expires") if args.expires else None
    try:
        path = issue(d, args.role, args.name, force=args.force, expires_s=expires)
    except AuthError as exc:
        raise CliError(str(exc), EXIT_USAGE) from None
    if args.json:
        print_json({"role": args.role, "name": args.name, "path": str(path)})
    else:
        print(path)
    return 0


def run_list(args: argparse.Namespace) -> int:
    from reach_broker.auth import list_identities

    found = list_identities(_open(args))
    if args.json:
        print_json([_identity(i) for i in found])
        return 0
    rows = [(i.role, i.name, i.public_key[:12] + "…", utc(i.issued_at * 1000),
             utc(i.expires_at * 1000) if i.expires_at else "-",
             utc(i.revoked_at * 1000) if i.revoked_at else "-", i.path)
            for i in found]  # fmt: skip
    print_table(rows, ["ROLE", "NAME", "KEY", "ISSUED", "EXPIRES", "REVOKED", "PATH"])
    return 0


def run_revoke(args: argparse.Namespace) -> int:
    from reach_broker.auth import AuthError, revoke

    d = _open(args)
    try:
        revoked = revoke(d, args.name, role=args.role)
    except AuthError as exc:
        raise CliError(str(exc), EXIT_USAGE) from None
    what = f"{revoked.role} {revoked.name!r} (key {revoked.public_key[:12]}…)"
    if args.no_push:
        _say(args, {"revoked": _identity(revoked), "pushed": None},
             f"reach: revoked {what} in {d.root}; a server started from it refuses it "
             "(a running one learns of it with `reach auth push`)")  # fmt: skip
        return 0
    word = _push(args, d, f"revoked {what} in {d.root}, but")
    _say(args, {"revoked": _identity(revoked), "pushed": word},
         f"reach: revoked {what}; the running server closed its connections and refuses it "
         f"({word})")  # fmt: skip
    return 0


def run_push(args: argparse.Namespace) -> int:
    d = _open(args)
    word = _push(args, d, "")
    _say(args, {"pushed": word}, f"reach: the running server has the account of {d.root} "
                                 f"({word})")  # fmt: skip
    return 0


def _push(args: argparse.Namespace, d: Any, done: str) -> str:
    """Hand the server the DIR's account (``$SYS.REQ.CLAIMS.UPDATE``); its answer."""
    from reach_broker.auth import AuthError, push_account

    urls = servers(args)
    try:
        return asyncio.run(push_account(d, urls, timeout_s=args.timeout))
    except AuthError as exc:
        prefix = f"{done} " if done else ""
        raise CliError(f"{prefix}no running server took the update: {exc} (a server started "
                       f"from {d.root} loads it; `reach auth push --dir {d.root}` retries)",
                       EXIT_UNAVAILABLE) from None  # fmt: skip


def _say(args: argparse.Namespace, record: dict[str, Any], text: str) -> None:
    if args.json:
        print_json(record)
    else:
        print(text)
