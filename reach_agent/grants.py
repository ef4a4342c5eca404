"""What a NATS credential lets its holder do, read from the credential itself.

A ``.creds`` file holds a user JWT whose ``nats.pub``/``nats.sub`` lists are exactly what
nats-server enforces for that user (operator mode). This module reads them *without*
verifying the signature (the server does that at connect; a client only needs to know what
it will be allowed), so a reach process can:

- connect with the credential's private inbox prefix (the one ``_INBOX.….>`` entry of its
  subscribe list, ``_INBOX.<role>.<name>`` for credentials ``reach auth`` issues), without
  which every reply to it would be refused;
- check at start that the subjects it is about to use are allowed, and fail with an error
  naming the subject and the credential file instead of waiting on refused messages;
- read the user name a JWT was issued for (the broker compares it with a connection's name).

It also parses the permission violations nats-server reports on a connection
(:func:`violation_of`).
"""

from __future__ import annotations

import base64
import binascii
import re
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import NamedTuple

import msgspec

from reach_agent.wire.subjects import INBOX_ROOT


class _Permission(msgspec.Struct):
    allow: list[str] = []
    deny: list[str] = []


class _Nats(msgspec.Struct):
    pub: _Permission = msgspec.field(default_factory=_Permission)
    sub: _Permission = msgspec.field(default_factory=_Permission)


class _UserClaims(msgspec.Struct):
    name: str = ""
    nats: _Nats = msgspec.field(default_factory=_Nats)


class _Name(msgspec.Struct):
    name: str = ""


_claims_decoder = msgspec.json.Decoder(_UserClaims)
_name_decoder = msgspec.json.Decoder(_Name)


class GrantError(ValueError):
    """A credential that cannot be read, or that does not allow what it is used for."""


class Grants(NamedTuple):
    """The user name and permissions a user JWT carries."""

    name: str
    publish: tuple[str, ...]
    """Subjects it may publish to; empty: no publish limit of its own."""
    publish_deny: tuple[str, ...]
    subscribe: tuple[str, ...]
    """Subjects it may subscribe to; empty: no subscribe limit of its own."""
    subscribe_deny: tuple[str, ...]

    def may_publish(self, subject: str) -> bool:
        return _permitted(subject, self.publish, self.publish_deny)

    def may_subscribe(self, subject: str) -> bool:
        return _permitted(subject, self.subscribe, self.subscribe_deny)

    @property
    def inbox_prefix(self) -> str | None:
        """The private inbox prefix the subscribe list grants (``_INBOX.x.y`` of
        ``_INBOX.x.y.>``), if it restricts inboxes at all."""
        for subject in self.subscribe:
            if subject.startswith(INBOX_ROOT + ".") and subject.endswith(".>"):
                return subject[:-2]
        return None


def _payload(token: str) -> bytes:
    payload = token.strip().split(".")[1]
    return base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4))


def decode_jwt(token: str) -> Grants:
    """The grants of a user JWT (signature not checked)."""
    try:
        claims = _claims_decoder.decode(_payload(token))
    except (IndexError, ValueError, binascii.Error, msgspec.DecodeError) as exc:
        raise GrantError(f"not a user JWT: {exc}") from None
    n = claims.nats
    return Grants(claims.name, tuple(n.pub.allow), tuple(n.pub.deny), tuple(n.sub.allow),
                  tuple(n.sub.deny))  # fmt: skip


def jwt_name(token: str) -> str | None:
    """The user name of a JWT (what the broker compares with a connection's name), or None
    when it is not a readable JWT."""
    try:
        return _name_decoder.decode(_payload(token)).name
    except (IndexError, ValueError, binascii.Error, msgspec.DecodeError):
        return None


def read_creds(path: str) -> Grants:
    """The grants of the user JWT in a ``.creds`` file."""
    try:
        text = Path(path).expanduser().read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise GrantError(f"cannot read credentials file {path!r}: {exc}") from None
    lines = text.splitlines()
    for i, line in enumerate(lines[:-1]):
        if "BEGIN NATS USER JWT" in line:
            try:
                return decode_jwt(lines[i + 1])
            except GrantError as exc:
                raise GrantError(f"credentials file {path!r}: {exc}") from None
    raise GrantError(f"{path!r} is not a NATS credentials file (no user JWT)")


def check(
    grants: Grants,
    creds: str,
    *,
    publish: Iterable[str] = (),
    subscribe: Iterable[str] = (),
) -> None:
    """Raise :class:`GrantError` naming the first subject ``grants`` refuses, and the
    credential file, e.g. ``credentials /x/alpha.creds (user 'alpha') do not allow
    publishing to 'reach.announce.beta'``."""
    for action, subjects, may in (("publishing to", publish, grants.may_publish),
                                  ("subscribing to", subscribe, grants.may_subscribe)):  # fmt: skip
        for subject in subjects:
            if not may(subject):
                raise GrantError(
                    f"credentials {creds} (user {grants.name!r}) do not allow {action} "
                    f"{subject!r}: issue this identity its own credentials (for an agent: "
                    "`reach auth agent <agent_id> --dir DIR`)"
                )


def _permitted(subject: str, allow: Sequence[str], deny: Sequence[str]) -> bool:
    if allow and not any(matches(p, subject) for p in allow):
        return False
    return not any(matches(p, subject) for p in deny)


def matches(pattern: str, subject: str) -> bool:
    """NATS subject matching: ``*`` is one token, a final ``>`` one or more. A wildcard in
    ``subject`` (a subscription) matches only the same wildcard, or a wider one."""
    p, s = pattern.split("."), subject.split(".")
    for i, token in enumerate(p):
        if token == ">":
            return len(s) > i
        if i >= len(s):
            return False
        if token != "*" and token != s[i]:
            return False
        if token == "*" and s[i] == ">":
            return False
    return len(p) == len(s)


class Violation(NamedTuple):
    """A permission violation the server reported on a connection."""

    action: str
    """``publish`` or ``subscription``."""
    subject: str
    """As nats-py reports it: lowercased (it lowercases the server's whole error line)."""


_VIOLATION_RE = re.compile(r'permissions violation for (publish|subscription) to "([^"]*)"')


def violation_of(exc: BaseException) -> Violation | None:
    """The violation an error-callback exception reports, if it is one."""
    match = _VIOLATION_RE.search(str(exc).lower())
    return Violation(match.group(1), match.group(2)) if match else None
