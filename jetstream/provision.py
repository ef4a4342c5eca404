"""Idempotent provisioning of the JetStream assets defined in ``jetstream/definitions/``.

Each definition is a StreamConfig in the JSON shape ``nats stream add --config`` accepts
(durations in nanoseconds), sent to the server as is through the JetStream API, so the file
is exactly what the server sees. For each one: create the stream when it is absent; when it
exists and a field of the definition differs, update it if the change cannot lose data;
otherwise refuse with :class:`UnsafeChange`, naming the field, the old and new value and
why, and leave the stream untouched. Only fields the definition names are compared: the
server fills in the rest (and its own ``metadata``).

Replicas: with ``least_replicas`` (a count the caller worked out from the nodes it sees, not
one it was told) a stream that has more keeps them — a node down at a start must not take an
R3 stream to R1. A raise the cluster cannot place now ("no suitable peers": a node down) is
left for later: the stream keeps what it has, the rest of the definition is applied, and the
outcome says how short it is, as it says a count kept (the caller says either,
:func:`say_replicas`, with when it tries again), instead of failing the start of a broker
whose streams work as they are.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterable, Mapping
from datetime import UTC
from pathlib import Path
from typing import Any, Literal, NamedTuple

from nats.aio.client import Client as NATS
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError

from .names import (
    A2A_TASKS_STREAM,
    ACK_STREAM,
    AUDIT_STREAM,
    CLAIMS_STREAM,
    COMP_STREAM,
    JS_NOT_ENABLED,
    JS_NOT_READY,
    NO_SUITABLE_PEERS,
    STREAM_EXISTS,
    STREAM_NAMES,
    STREAM_NOT_FOUND,
    StreamSubjects,
)

log = logging.getLogger(__name__)

DEFINITIONS_DIR = Path(__file__).resolve().parent / "definitions"
API = "$JS.API"
NS = 1_000_000_000


Action = Literal["created", "updated", "unchanged"]


class ProvisionError(RuntimeError):
    """A stream could not be provisioned; the message names the stream and the reason."""


class JetStreamUnavailable(ProvisionError):
    """The server (or this account) has no JetStream."""


class ProvisionTimeout(ProvisionError):
    """The JetStream API did not answer in time (e.g. a cluster still electing a leader)."""


class NoPeers(ProvisionTimeout):
    """No cluster peer could take a replica now (one still starting or rejoining): retried as
    a timeout is."""


class NotReady(ProvisionTimeout):
    """JetStream answered 503, temporarily unavailable (a server just restarted, a cluster
    with no meta leader yet): retried as a timeout is."""


class UnsafeChange(ProvisionError):
    """The definition differs from the stream in a way that could lose data: refused."""


class Outcome(NamedTuple):
    name: str
    action: Action
    changes: tuple[str, ...]
    short: tuple[int, int] | None = None
    """(replicas the stream has, replicas wanted) when the cluster could not place them now."""
    refusal: str = ""
    """The server's words when it could not (``short``)."""
    kept: tuple[int, int] | None = None
    """(replicas the stream has, the fewer counted) when ``least_replicas`` kept them."""


def load_definitions(
    subjects: StreamSubjects | None = None,
    overrides: Mapping[str, Mapping[str, Any]] | None = None,
    directory: Path = DEFINITIONS_DIR,
    names: Iterable[str] = STREAM_NAMES,
) -> list[dict[str, Any]]:
    """The definitions as dicts, with the subjects of ``subjects`` and ``overrides`` applied.

    The files hold the default prefix's subjects (``reach.ack.>``, ...); given ``subjects``
    (:class:`reach_agent.wire.subjects.Subjects` of the broker's prefix), the ack, compensation and
    audit streams take its wildcards instead. ``overrides`` maps a stream name to fields
    replacing the file's (the broker sets ``REACH_COMPENSATION.max_msgs`` from
    ``compensation.max_entries`` this way). The claims bucket keeps its claims exactly as long
    as the ack records their results live in: its ``max_age`` is ``REACH_ACKS``'s (unless
    ``overrides`` names it); so does the A2A gateway's task bucket, when ``names`` (default:
    the assets every broker provisions) asks for it.
    """
    own = (
        {ACK_STREAM: [subjects.all_acks], COMP_STREAM: [subjects.all_comp],
         AUDIT_STREAM: [subjects.all_events]}
        if subjects is not None else {}
    )  # fmt: skip
    wanted = tuple(names)
    out = []
    for name in (*wanted, ACK_STREAM):
        path = directory / f"{name}.json"
        try:
            cfg = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise ProvisionError(f"definition {path}: {exc}") from None
        if name in own:
            cfg["subjects"] = own[name]
        cfg.update((overrides or {}).get(name, {}))
        out.append(cfg)
    by_name = {cfg["name"]: cfg for cfg in out}
    ack = out.pop()  # read for its max_age; returned only when asked for
    for follower in (CLAIMS_STREAM, A2A_TASKS_STREAM):
        if follower in by_name and "max_age" not in (overrides or {}).get(follower, {}):
            by_name[follower]["max_age"] = ack["max_age"]
    return out


async def _api(nc: NATS, subject: str, body: Any, timeout_s: float) -> dict[str, Any]:
    data = b"" if body is None else json.dumps(body).encode()
    try:
        reply = await nc.request(f"{API}.{subject}", data, timeout=timeout_s)
    except NoRespondersError:
        raise JetStreamUnavailable(
            "JetStream is not enabled on this server (no answer on $JS.API): start "
            "nats-server with -js"
        ) from None
    except NatsTimeoutError:
        raise ProvisionTimeout(f"JetStream API {subject}: no answer within {timeout_s}s") from None
    resp: dict[str, Any] = json.loads(reply.data)
    return resp


def _fmt(key: str, value: Any) -> str:
    if key in ("max_age", "duplicate_window") and isinstance(value, int):
        return f"{value / NS:g}s"
    return json.dumps(value)


def _same(key: str, old: Any, new: Any) -> bool:
    if key == "subjects":
        return sorted(old or []) == sorted(new or [])
    if key == "description":
        return (old or "") == (new or "")
    return bool(old == new)


def _limit(value: Any) -> float:
    """A JetStream limit where -1 and 0 mean unlimited."""
    return float("inf") if value is None or value <= 0 else float(value)


def unsafe_reason(key: str, old: Any, new: Any, state: Mapping[str, Any]) -> str | None:
    """Why changing ``key`` from ``old`` to ``new`` could lose data (None: it cannot)."""
    msgs = int(state.get("messages", 0))
    if key == "retention":
        return "the retention policy of an existing stream cannot change without re-creating it"
    if key == "storage":
        return "the storage type of an existing stream cannot change without re-creating it"
    if key in ("deny_delete", "deny_purge") and old and not new:
        return f"{key} protects the stream's history; lifting it is refused"
    if key == "allow_msg_ttl" and old and not new:
        return "per-message TTL cannot be turned off once enabled"
    if key == "max_msgs" and _limit(new) < _limit(old) and msgs > _limit(new):
        return f"the stream holds {msgs} messages, more than the new limit"
    if (
        key == "max_bytes"
        and _limit(new) < _limit(old)
        and int(state.get("bytes", 0)) > _limit(new)
    ):
        return f"the stream holds {state.get('bytes')} bytes, more than the new limit"
    if key == "max_msgs_per_subject" and _limit(new) < _limit(old) and msgs:
        return "lowering the per-subject limit would drop kept revisions"
    if key == "max_age" and _limit(new) < _limit(old) and msgs:
        first = state.get("first_ts")
        age_ns = _age_ns(first) if isinstance(first, str) else None
        if age_ns is None or age_ns > _limit(new):
            return "the stream holds messages older than the new max_age"
    if key == "subjects" and msgs and set(old or []) - set(new or []):
        return f"subjects {sorted(set(old or []) - set(new or []))} would be dropped"
    return None


def _age_ns(ts: str) -> int | None:
    """Age of an RFC 3339 timestamp with nanoseconds (``2026-11-30T02:20:21.123456789Z``)."""
    from datetime import datetime

    base, _, frac = ts.rstrip("Z").partition(".")
    try:
        dt = datetime.strptime(base, "%Y-%m-%dT%H:%M:%S").replace(tzinfo=UTC)
    except ValueError:
        return None
    ns = int(dt.timestamp()) * NS + int((frac + "000000000")[:9] or 0)
    return time.time_ns() - ns


async def ensure_stream(
    nc: NATS, cfg: Mapping[str, Any], timeout_s: float = 5.0, *, least_replicas: bool = False,
    create: bool = True,
) -> Outcome:  # fmt: skip
    """Create, update or leave alone one stream; raise UnsafeChange instead of losing data.
    ``least_replicas``: the definition's ``num_replicas`` is a least, never lowered (see the
    module docstring). ``create=False``: a stream that does not exist raises ProvisionError
    (``cfg`` may then name only the fields to change)."""
    name = cfg["name"]
    info = await _api(nc, f"STREAM.INFO.{name}", None, timeout_s)
    err = info.get("error")
    if err is not None:
        if err.get("err_code") == JS_NOT_ENABLED:
            raise JetStreamUnavailable(f"JetStream is not enabled for this account: {err}")
        if err.get("err_code") == JS_NOT_READY:
            raise NotReady(f"stream {name}: info failed: {err.get('description')}")
        if err.get("err_code") != STREAM_NOT_FOUND:
            raise ProvisionError(f"stream {name}: info failed: {err.get('description')}")
        if not create:
            raise ProvisionError(f"stream {name} does not exist (not created here)")
        resp = await _api(nc, f"STREAM.CREATE.{name}", dict(cfg), timeout_s)
        if "error" in resp:
            # Another replica may have created it in between: then it is an update check.
            if resp["error"].get("err_code") == STREAM_EXISTS:
                return await ensure_stream(nc, cfg, timeout_s, least_replicas=least_replicas)
            if resp["error"].get("err_code") == JS_NOT_READY:
                raise NotReady(f"stream {name}: create failed: {resp['error'].get('description')}")
            if resp["error"].get("err_code") == NO_SUITABLE_PEERS:
                raise NoPeers(f"stream {name}: create failed: {resp['error'].get('description')}")
            raise ProvisionError(
                f"stream {name}: create failed: {resp['error'].get('description')}"
            )
        log.info("jetstream.stream_created name=%s", name)
        return Outcome(name, "created", ())
    current: dict[str, Any] = info["config"]
    state: dict[str, Any] = info.get("state", {})
    changes: list[str] = []
    refused: list[str] = []
    kept: dict[str, Any] = {}  # the stream's own values kept over the definition's
    for key, new in cfg.items():
        old = current.get(key)
        if _same(key, old, new):
            continue
        if key == "num_replicas" and least_replicas and int(old or 1) > int(new):
            kept[key] = old
            continue
        desc = f"{key}: {_fmt(key, old)} -> {_fmt(key, new)}"
        why = unsafe_reason(key, old, new, state)
        if why is not None:
            refused.append(f"{desc} ({why})")
        else:
            changes.append(desc)
    if refused:
        raise UnsafeChange(
            f"stream {name}: refusing to apply the definition, the change could lose data: "
            + "; ".join(refused)
            + ". The stream was left as it is; migrate it by hand (e.g. `nats stream backup`, "
            "then remove and re-provision) or change the definition back."
        )
    kept_replicas = (int(kept["num_replicas"]), int(cfg["num_replicas"])) if kept else None
    if not changes:
        return Outcome(name, "unchanged", (), kept=kept_replicas)
    merged = {**current, **cfg, **kept}
    resp = await _api(nc, f"STREAM.UPDATE.{name}", merged, timeout_s)
    short, refusal = None, ""
    have, want = int(current.get("num_replicas") or 1), int(merged.get("num_replicas") or 1)
    if "error" in resp and resp["error"].get("err_code") == NO_SUITABLE_PEERS and want > have:
        # The cluster cannot place the replicas now (a node down): the rest without them.
        short = (have, want)
        refusal = str(resp["error"].get("description"))
        changes = [c for c in changes if not c.startswith("num_replicas:")]
        if not changes:
            return Outcome(name, "unchanged", (), short, refusal, kept_replicas)
        merged["num_replicas"] = have
        resp = await _api(nc, f"STREAM.UPDATE.{name}", merged, timeout_s)
    if "error" in resp:
        raise UnsafeChange(
            f"stream {name}: the server refused the update ({'; '.join(changes)}): "
            f"{resp['error'].get('description')}. The stream was left as it is."
        )
    log.info("jetstream.stream_updated name=%s changes=%s", name, "; ".join(changes))
    return Outcome(name, "updated", tuple(changes), short, refusal, kept_replicas)


def say_replicas(outcome: Outcome, until: str) -> None:
    """Say what became of ``outcome``'s replicas when it is not the count asked for: kept
    over a lower count (info), or left short (warning, and ``until`` when: who tries the
    raise again)."""
    if outcome.kept is not None:
        log.info("jetstream.replicas_kept name=%s replicas=%d (more than the %d counted from "
                 "the nodes answering now)", outcome.name, *outcome.kept)  # fmt: skip
    if outcome.short is not None:
        have, want = outcome.short
        log.warning("jetstream.replicas_short name=%s replicas=%d wanted=%d: %s; the stream "
                    "keeps %d %s", outcome.name, have, want, outcome.refusal, have,
                    until)  # fmt: skip


async def provision(
    nc: NATS,
    definitions: Iterable[Mapping[str, Any]] | None = None,
    timeout_s: float = 5.0,
    *,
    least_replicas: bool = False,
) -> list[Outcome]:
    """Ensure every definition (default: all of ``jetstream/definitions``); idempotent."""
    defs = list(definitions) if definitions is not None else load_definitions()
    return [await ensure_stream(nc, cfg, timeout_s, least_replicas=least_replicas)
            for cfg in defs]  # fmt: skip
