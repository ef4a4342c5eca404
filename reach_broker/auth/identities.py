"""Issue, list and revoke the identities of an auth DIR.

An identity is a user of the application account: an nkey pair and a user JWT signed by
the account, carrying its role's permissions (:mod:`reach_broker.auth.roles`). Issuing one
touches nothing but its credentials file: the server accepts any user JWT the account signed.
Revoking one re-signs the account JWT with the user's key in ``revocations``; that reaches a
running server with :func:`reach_broker.auth.push.push_account` (and a stopped one through the
resolver dir it loads at start).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import get_args

import msgspec

from reach_agent.wire.schema import is_agent_id
from reach_agent.wire.subjects import Subjects

from . import claims
from .claims import AuthError, UserClaims
from .files import private_dir, write_private, write_public
from .layout import APP_ACCOUNT_NAME, BROKER_NAME, AuthDir
from .roles import RoleName, permissions

DirLike = str | os.PathLike[str] | AuthDir

ROLE_NAMES: tuple[RoleName, ...] = get_args(RoleName)


@dataclass(frozen=True)
class Identity:
    """One credential issued from a DIR, as :func:`list_identities` reports it."""

    role: RoleName
    name: str
    public_key: str
    """The user's nkey (``U…``): what revocation and the server's CONNZ name it by."""
    issued_at: int
    """Unix second the JWT was signed."""
    expires_at: int | None
    revoked_at: int | None
    """Unix second of its revocation (None while it is valid)."""
    path: Path
    """Its credentials file, or the revoked JWT kept under ``revoked/``."""


def _open(directory: DirLike) -> AuthDir:
    return directory if isinstance(directory, AuthDir) else AuthDir.open(directory)


def _check_name(role: RoleName, name: str) -> str:
    if role not in ROLE_NAMES:
        raise AuthError(f"role {role!r} is not one of {', '.join(ROLE_NAMES)}")
    if role == "broker":
        if name != BROKER_NAME:
            raise AuthError(f"the broker identity is named {BROKER_NAME!r}, not {name!r}")
        return name
    # The name is a subject token (its subjects, its inbox prefix) and a file name.
    if not isinstance(name, str) or not is_agent_id(name):
        what = "agent_id" if role == "agent" else f"{role} name"
        raise AuthError(
            f"{what} {str(name)[:160]!r} is not valid "
            "(one subject token: [A-Za-z0-9][A-Za-z0-9_-]{0,127})"
        )
    return name


def issue(
    directory: DirLike,
    role: RoleName,
    name: str,
    *,
    force: bool = False,
    reply_window_s: float | None = None,
    expires_s: float | None = None,
) -> Path:
    """Write the credentials of ``name`` in ``role``; returns the file's path.

    An existing credential of the same name is an error unless ``force``: then it is
    replaced *and its key revoked* (rotation in one step; push the account to a running
    server, as after :func:`revoke`). ``expires_s`` bounds the credential's lifetime;
    ``reply_window_s`` overrides the role's response window (agents).
    """
    d = _open(directory)
    name = _check_name(role, name)
    meta = d.meta()
    path = d.creds(role, name)
    if path.exists():
        if not force:
            raise AuthError(
                f"{role} {name!r} already has credentials at {str(path)!r}: revoke them first "
                "or pass force to replace them (the old key is then revoked)"
            )
        _revoke_file(d, role, name, path, int(time.time()))
    seed = claims.new_seed("user")
    user = claims.keypair(seed)
    now = time.time()
    user_claims = UserClaims(
        sub=claims.public_key(user),
        name=name,
        exp=int(now + expires_s) if expires_s else 0,
        nats=permissions(
            role,
            name,
            account=meta.account,
            subjects=Subjects(meta.prefix),
            reply_window_s=reply_window_s,
        ),
    )
    token = claims.encode(user_claims, d.signer("app"), now=now)
    if role != "broker":
        private_dir(path.parent)
    write_private(path, claims.format_creds(token, seed))
    return path


def issue_agent(
    directory: DirLike,
    agent_id: str,
    *,
    force: bool = False,
    reply_window_s: float | None = None,
    expires_s: float | None = None,
) -> Path:
    """``DIR/agents/<agent_id>.creds`` (see :func:`issue` for the options)."""
    return issue(
        directory,
        "agent",
        agent_id,
        force=force,
        reply_window_s=reply_window_s,
        expires_s=expires_s,
    )


def issue_caller(
    directory: DirLike, name: str, *, force: bool = False, expires_s: float | None = None
) -> Path:
    """``DIR/callers/<name>.creds`` (see :func:`issue` for the options)."""
    return issue(directory, "caller", name, force=force, expires_s=expires_s)


def issue_broker(directory: DirLike, *, force: bool = False) -> Path:
    """``DIR/broker.creds`` again (``init`` writes the first one); ``force`` rotates it."""
    return issue(directory, "broker", BROKER_NAME, force=force)


def _find(d: AuthDir, name: str, role: RoleName | None) -> tuple[RoleName, Path]:
    roles = ROLE_NAMES if role is None else (role,)
    found = [
        (r, d.creds(r, name))
        for r in roles
        if (r != "broker" or name == BROKER_NAME) and d.creds(r, name).is_file()
    ]
    if not found:
        where = role or "agent or caller"
        raise AuthError(f"no {where} named {name!r} has credentials in {str(d.root)!r}")
    if len(found) > 1:
        raise AuthError(f"{name!r} is both {' and '.join(r for r, _ in found)}: name the role")
    return found[0]


def revoke(
    directory: DirLike, name: str, *, role: RoleName | None = None, now: float | None = None
) -> Identity:
    """Revoke the credential of ``name`` (found among agents, callers and the broker unless
    ``role`` says which); returns it, with ``revoked_at`` set.

    Re-signs the application account with the user's key revoked as of now, writes it to
    ``DIR/accounts/`` and to the resolver dir (a server started later loads it), moves the
    user JWT to ``revoked/`` and deletes the credentials file. A running server learns of it
    from :func:`reach_broker.auth.push.push_account`: it then closes that user's connections
    and refuses new ones.
    """
    d = _open(directory)
    found_role, path = _find(d, name, role)
    at = int(time.time() if now is None else now)
    return _revoke_file(d, found_role, name, path, at)


def _revoke_file(d: AuthDir, role: RoleName, name: str, path: Path, at: int) -> Identity:
    token, _ = claims.read_creds(path)
    user = claims.decode(token, UserClaims)
    account = d.app_account()
    revocations = {**account.nats.revocations, user.sub: at}
    signed = claims.encode(
        msgspec.structs.replace(
            account, nats=msgspec.structs.replace(account.nats, revocations=revocations)
        ),
        d.signer("operator"),
    )
    write_public(d.account_path(APP_ACCOUNT_NAME), signed.encode())
    write_public(d.resolver_dir / f"{account.sub}.jwt", signed.encode())
    kept = d.revoked / role / f"{name}.{user.sub}.jwt"
    write_public(kept, token.encode())
    path.unlink()
    return _identity(role, user, kept, at)


def _identity(role: RoleName, user: UserClaims, path: Path, revoked_at: int | None) -> Identity:
    return Identity(
        role=role,
        name=user.name,
        public_key=user.sub,
        issued_at=user.iat,
        expires_at=user.exp or None,
        revoked_at=revoked_at,
        path=path,
    )


def list_identities(directory: DirLike) -> list[Identity]:
    """Every credential issued from the DIR, valid ones and revoked ones, by role and name."""
    d = _open(directory)
    revocations = d.app_account().nats.revocations
    out: list[Identity] = []
    files: list[tuple[RoleName, Path]] = (
        [("broker", d.broker_creds)] if d.broker_creds.is_file() else []
    )
    for role in ("agent", "caller"):
        files += [(role, p) for p in sorted((d.root / f"{role}s").glob("*.creds"))]
    for role, path in files:
        user = claims.decode(claims.read_creds(path)[0], UserClaims)
        out.append(_identity(role, user, path, _revoked_at(revocations, user)))
    for role in ROLE_NAMES:
        for path in sorted((d.revoked / role).glob("*.jwt")):
            user = claims.decode(path.read_text(), UserClaims)
            out.append(_identity(role, user, path, _revoked_at(revocations, user)))
    # Oldest first; within one second (issued_at is whole seconds) a revoked credential
    # before a valid one, since a credential is revoked before or when it is replaced.
    return sorted(
        out, key=lambda i: (ROLE_NAMES.index(i.role), i.name, i.issued_at, i.revoked_at is None)
    )


def _revoked_at(revocations: dict[str, int], user: UserClaims) -> int | None:
    """When ``user`` was revoked, by its key or by a revocation of everyone (``*``)."""
    for key in (user.sub, "*"):
        at = revocations.get(key)
        if at is not None and at >= user.iat:
            return at
    return None
