"""``reach route CAP``: the candidates a caller would get (``<prefix>.route.<capability>``);
with ``--explain`` also why: each candidate's score terms, and every agent left out with its
reason."""

from __future__ import annotations

import argparse
import asyncio
from typing import Any

from .common import CliError, Subcommands, add_common, ask_msg, capability, subjects, tags
from .output import print_json, print_table


def add_parser(sub: Subcommands) -> None:
    p = sub.add_parser("route", help="ask for the candidates a caller would get")
    add_common(p)
    p.add_argument("capability", help="the capability to route, e.g. text_processing")
    p.add_argument("--limit", "-n", type=int, default=3,
                   help="candidates to ask for (default 3)")  # fmt: skip
    p.add_argument("--region", help="only agents announced in this region")
    p.add_argument("--tag", action="append", metavar="K=V",
                   help="only agents with this tag (repeatable: all must match)")  # fmt: skip
    p.add_argument("--sticky-key",
                   help="the same key gets the same agent while it stays healthy")  # fmt: skip
    p.add_argument("--exclude", action="append", metavar="AGENT_ID",
                   help="leave this agent out (repeatable)")  # fmt: skip
    p.add_argument("--allow-suspect", action="store_true",
                   help="also offer agents in state suspect")  # fmt: skip
    p.add_argument("--canary", metavar="VALUE", help="this arm of the capability's split rule")
    p.add_argument("--requires", action="append", metavar="PERMISSION",
                   help="a permission the agent must hold (repeatable)")  # fmt: skip
    p.add_argument("--min-context-tokens", type=int, metavar="N",
                   help="context headroom the agent must have")  # fmt: skip
    p.add_argument("--explain", action="store_true",
                   help="the score terms of each candidate, and why each other agent is "
                        "left out")  # fmt: skip
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    return asyncio.run(_route(args))


async def _route(args: argparse.Namespace) -> int:
    import msgspec

    from reach_agent.wire import schema
    from reach_agent.wire.errors import from_reply

    cap = capability(args.capability)
    req = schema.RouteRequest(
        limit=args.limit, region=args.region, tags=tags(args.tag), sticky_key=args.sticky_key,
        exclude=args.exclude or [], allow_suspect=args.allow_suspect, explain=args.explain,
        peek=True,
        canary=args.canary, requires=args.requires or [],
        min_context_tokens=args.min_context_tokens,
    )  # fmt: skip
    msg = await ask_msg(args, subjects(args).route(cap), schema.encoder.encode(req))
    err = from_reply(msg.headers, msg.data)
    if err is not None:
        failure = CliError.of(err)
        explain = _error_explain(msg.data) if args.explain else None
        if explain is not None:
            failure.extra = {"explain": explain}
            if not args.json:
                print_explain(cap, msgspec.convert(explain, schema.RouteExplain), [])
        raise failure
    reply = schema.route_reply_decoder.decode(msg.data)
    if args.json:
        print_json(reply)
    elif reply.explain is not None:
        print_explain(cap, reply.explain, reply.candidates)
    else:
        rows = [(i + 1, c.agent_id, c.state, f"{c.score:.1f}", f"{c.load:.2f}", c.region or "-",
                 c.subject) for i, c in enumerate(reply.candidates)]  # fmt: skip
        print_table(rows, ["#", "AGENT", "STATE", "SCORE", "LOAD", "REGION", "SUBJECT"])
    return 0


def _error_explain(data: bytes) -> Any:
    """The ``explain`` an explained ``NO_REACHABLE_AGENT`` carries beside ``error``, if any."""
    import msgspec

    try:
        body = msgspec.json.decode(data)
    except msgspec.DecodeError:
        return None
    return body.get("explain") if isinstance(body, dict) else None


def _f(value: float) -> str:
    return f"{value:.2f}"


def print_explain(cap: str, ex: Any, candidates: list[Any]) -> None:
    """The explanation as people read it: a summary line, the candidates with their score
    terms, then every agent left out with its reason."""
    panic = "; PANIC: nothing ejected for its score" if ex.panic else ""
    print(f"{cap}: {ex.members} agents, {ex.healthy} healthy, {ex.ranked} ranked, "
          f"{ex.ejected} ejected; choice {ex.choice}, pool {ex.pool}; min score "
          f"{ex.min_reach_score:g}, load watermark {ex.load_watermark:g}{panic}")  # fmt: skip
    if ex.shared or ex.unseen_partitions:
        unseen = ", ".join(map(str, ex.unseen_partitions)) or "none"
        print(f"other brokers' partitions: {ex.shared} agents routed from their shares, not "
              f"explained one by one; partitions not seen: {unseen}")  # fmt: skip
    rows = []
    for i, c in enumerate(candidates, 1):
        e = c.explain
        if e is None:  # an agent of another broker's share
            rows.append((i, c.agent_id, c.state, f"{c.score:.1f}", f"{c.load:.2f}",
                         *["-"] * 10))  # fmt: skip
            continue
        t = e.terms
        rows.append((i, c.agent_id, c.state, f"{c.score:.1f}", f"{e.active}/{e.max_concurrency}",
                     f"{e.weight:.1f}", _f(e.slow_start), _f(t.liveness), _f(t.latency),
                     _f(t.load), _f(t.success), _f(t.stuck), e.weakest or "-", e.rank or "-",
                     e.kept or "-"))  # fmt: skip
    if rows:
        print()
        print_table(rows, ["#", "AGENT", "STATE", "SCORE", "ACTIVE", "WEIGHT", "SLOW", "LIVE",
                           "LAT", "LOAD", "SUCC", "STUCK", "WEAKEST", "RANK", "KEPT"])  # fmt: skip
    total = sum(ex.counts.values())
    if not total:
        return
    by = ", ".join(f"{n} {code}" for code, n in sorted(ex.counts.items(), key=lambda kv: -kv[1]))
    shown = f", first {len(ex.excluded)} listed" if len(ex.excluded) < total else ""
    print(f"\nleft out: {total} ({by}{shown})")
    print_table(
        [(x.agent_id, x.state, f"{x.score:.1f}",
          f"{x.explain.active}/{x.explain.max_concurrency}" if x.explain else f"{x.load:.2f}",
          x.reason, x.detail) for x in ex.excluded],
        ["AGENT", "STATE", "SCORE", "ACTIVE", "REASON", "DETAIL"],
    )  # fmt: skip
