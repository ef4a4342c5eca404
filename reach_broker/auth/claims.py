"""NATS decentralized-auth tokens: nkeys, the JWT v2 claims of operators, accounts and users,
and the credentials file a NATS client reads.

A JWT is ``base64url(header).base64url(claims).base64url(ed25519 signature)`` with the header
``{"typ":"JWT","alg":"ed25519-nkey"}``, signed by the issuer's nkey (operator signs accounts,
account signs users, the operator signs itself). The claim shapes follow ``nats-io/jwt`` v2
(``v2/user_claims.go``, ``account_claims.go``, ``operator_claims.go``, ``exports.go``,
``imports.go``, ``types.go``); nats-server verifies them. The structs below carry only the
fields reach writes; unknown fields of tokens written by ``nsc`` are kept when decoding.
"""

from __future__ import annotations

import base64
import hashlib
import os
import time
from pathlib import Path
from typing import Any, Literal, TypeVar

import msgspec
import nkeys

KeyKind = Literal["operator", "account", "user"]

_PREFIX = {
    "operator": nkeys.PREFIX_BYTE_OPERATOR,
    "account": nkeys.PREFIX_BYTE_ACCOUNT,
    "user": nkeys.PREFIX_BYTE_USER,
}
_SEED_START = {"operator": b"SO", "account": b"SA", "user": b"SU"}

NO_LIMIT = -1
"""``jwt.NoLimit``: a limit that is not limited."""


class AuthError(Exception):
    """A credential, key or DIR that cannot be used as asked; the message says why."""


# --- nkeys -------------------------------------------------------------------------------


def new_seed(kind: KeyKind) -> bytes:
    """A fresh nkey seed (``SO…``/``SA…``/``SU…``) from the OS's CSPRNG."""
    return bytes(nkeys.encode_seed(os.urandom(32), _PREFIX[kind]))


def keypair(seed: bytes, kind: KeyKind | None = None) -> Any:
    """The nkeys ``KeyPair`` of ``seed``; with ``kind``, the seed must be of that kind."""
    seed = seed.strip()
    if kind is not None and not seed.startswith(_SEED_START[kind]):
        raise AuthError(f"expected an {kind} nkey seed ({_SEED_START[kind].decode()}…)")
    try:
        return nkeys.from_seed(bytearray(seed))
    except nkeys.NkeysError as exc:
        raise AuthError(f"not a valid nkey seed: {type(exc).__name__}") from None


def public_key(kp: Any) -> str:
    return bytes(kp.public_key).decode()


# --- claims --------------------------------------------------------------------------------


class _Struct(msgspec.Struct, omit_defaults=True, kw_only=True):
    # Every default is Go's zero value, so omit_defaults mirrors Go's `omitempty`: a field
    # left out reads back as nats-server reads it. A limit of 0 means zero, not "unlimited":
    # write NO_LIMIT explicitly (see User.unlimited, AccountLimits.unlimited).
    pass


class Permission(_Struct, kw_only=True):
    """Subjects a user may publish or subscribe to (``jwt.Permission``)."""

    allow: list[str] = []
    deny: list[str] = []


class ResponsePermission(_Struct, kw_only=True):
    """``allow_responses``: publish to the reply subject of a message received, at most
    ``max`` times within ``ttl`` nanoseconds of its delivery (``jwt.ResponsePermission``)."""

    max: int
    ttl: int


class User(_Struct, kw_only=True):
    """The ``nats`` part of a user JWT: permissions and limits."""

    pub: Permission = msgspec.field(default_factory=Permission)
    sub: Permission = msgspec.field(default_factory=Permission)
    resp: ResponsePermission | None = None
    subs: int = 0
    data: int = 0
    payload: int = 0
    bearer_token: bool = False
    allowed_connection_types: list[str] = []
    issuer_account: str = ""
    tags: list[str] = []
    type: str = ""
    version: int = 0

    @classmethod
    def unlimited(cls, **fields: Any) -> User:
        """A user with no subscription, data or payload limit of its own."""
        return cls(subs=NO_LIMIT, data=NO_LIMIT, payload=NO_LIMIT, **fields)


class Export(_Struct, kw_only=True):
    """A subject an account offers other accounts (``jwt.Export``)."""

    name: str = ""
    subject: str
    type: Literal["stream", "service"]
    response_type: str = ""
    account_token_position: int = 0
    description: str = ""


class Import(_Struct, kw_only=True):
    """A subject an account takes from another account (``jwt.Import``)."""

    name: str = ""
    subject: str
    account: str
    type: Literal["stream", "service"]
    local_subject: str = ""


class AccountLimits(_Struct, kw_only=True):
    """``jwt.OperatorLimits`` flattened; non-zero ``mem_storage``/``disk_storage`` turn
    JetStream on for the account."""

    subs: int = 0
    data: int = 0
    payload: int = 0
    imports: int = 0
    exports: int = 0
    wildcards: bool = False
    conn: int = 0
    leaf: int = 0
    mem_storage: int = 0
    disk_storage: int = 0
    streams: int = 0
    consumer: int = 0

    @classmethod
    def unlimited(cls, *, jetstream: bool) -> AccountLimits:
        """No limit of the account's own (the server's still apply); JetStream on or off."""
        js = NO_LIMIT if jetstream else 0
        return cls(
            subs=NO_LIMIT,
            data=NO_LIMIT,
            payload=NO_LIMIT,
            imports=NO_LIMIT,
            exports=NO_LIMIT,
            wildcards=True,
            conn=NO_LIMIT,
            leaf=NO_LIMIT,
            mem_storage=js,
            disk_storage=js,
            streams=js,
            consumer=js,
        )


class WeightedMapping(_Struct, kw_only=True):
    """One destination of a subject mapping (``jwt.WeightedMapping``)."""

    subject: str
    weight: int = 100


class Account(_Struct, kw_only=True):
    """The ``nats`` part of an account JWT."""

    imports: list[Import] = []
    exports: list[Export] = []
    mappings: dict[str, list[WeightedMapping]] = {}
    """Subject mappings the server applies to every message published in the account (the
    agent subjects into partitions: ``Subjects.mappings``)."""
    limits: AccountLimits = msgspec.field(default_factory=AccountLimits)
    """Write :meth:`AccountLimits.unlimited` (or real limits): zeros limit to zero."""
    revocations: dict[str, int] = {}
    """User public key → Unix second: user JWTs of that key issued at or before it are void."""
    description: str = ""
    tags: list[str] = []
    type: str = ""
    version: int = 0


class Operator(_Struct, kw_only=True):
    """The ``nats`` part of an operator JWT."""

    system_account: str = ""
    signing_keys: list[str] = []
    type: str = ""
    version: int = 0


class _Claims(_Struct, kw_only=True):
    # jwt.ClaimsData, in its field order.
    exp: int = 0
    jti: str = ""
    iat: int = 0
    iss: str = ""
    name: str = ""
    sub: str


class UserClaims(_Claims, kw_only=True):
    nats: User = msgspec.field(default_factory=User)


class AccountClaims(_Claims, kw_only=True):
    nats: Account = msgspec.field(default_factory=Account)


class OperatorClaims(_Claims, kw_only=True):
    nats: Operator = msgspec.field(default_factory=Operator)


AnyClaims = UserClaims | AccountClaims | OperatorClaims
C = TypeVar("C", UserClaims, AccountClaims, OperatorClaims)

_HEADER = base64.urlsafe_b64encode(b'{"typ":"JWT","alg":"ed25519-nkey"}').rstrip(b"=")
_encoder = msgspec.json.Encoder()
_EXPECTED_ISSUER = {UserClaims: "A", AccountClaims: "O", OperatorClaims: "O"}
_TYPE = {UserClaims: "user", AccountClaims: "account", OperatorClaims: "operator"}
VERSION = 2
"""JWT format version (``nats.version``): nats-server reads v2 claims by it."""


def _b64(data: bytes) -> bytes:
    return base64.urlsafe_b64encode(data).rstrip(b"=")


def _unb64(data: str) -> bytes:
    return base64.urlsafe_b64decode(data + "=" * (-len(data) % 4))


def encode(claims: AnyClaims, issuer: Any, *, now: float | None = None) -> str:
    """Sign ``claims`` with the ``issuer`` key pair; sets ``iss``, ``iat`` and ``jti``.

    ``jti`` is a hash of the claims themselves, so two different tokens issued in the same
    second never share an id (nats-server's JWT store skips an update with an equal id).
    """
    iss = public_key(issuer)
    if not iss.startswith(_EXPECTED_ISSUER[type(claims)]):
        raise AuthError(f"{type(claims).__name__} cannot be issued by key {iss[:8]}…")
    nats = msgspec.structs.replace(claims.nats, type=_TYPE[type(claims)], version=VERSION)
    claims = msgspec.structs.replace(
        claims, iss=iss, iat=int(time.time() if now is None else now), jti="", nats=nats
    )
    digest = hashlib.sha256(_encoder.encode(claims)).digest()
    claims = msgspec.structs.replace(claims, jti=base64.b32encode(digest).decode().rstrip("="))
    signing_input = _HEADER + b"." + _b64(_encoder.encode(claims))
    return (signing_input + b"." + _b64(issuer.sign(signing_input))).decode()


def decode(token: str, kind: type[C]) -> C:
    """The claims of ``token``, after checking its signature against its ``iss`` key."""
    what = kind.__name__.removesuffix("Claims").lower()
    try:
        header, payload, signature = token.strip().split(".")
        claims = msgspec.json.decode(_unb64(payload), type=kind)
        verify_key = _verify_key(claims.iss)
    except (ValueError, msgspec.DecodeError) as exc:
        raise AuthError(f"not a valid {what} JWT: {exc}") from None
    try:
        verify_key.verify(f"{header}.{payload}".encode(), _unb64(signature))
    except Exception as exc:  # noqa: BLE001 - nacl's BadSignatureError, a short signature
        raise AuthError(f"{what} JWT signature does not verify: {type(exc).__name__}") from None
    return claims


def _verify_key(public: str) -> Any:
    import nacl.signing

    raw = base64.b32decode(public + "=" * (-len(public) % 8))
    if len(raw) != 35:
        raise ValueError(f"public key {public[:8]}… has {len(raw)} bytes, expected 35")
    return nacl.signing.VerifyKey(raw[1:33])


# --- credentials files -------------------------------------------------------------------

_CREDS = """\
-----BEGIN NATS USER JWT-----
{jwt}
------END NATS USER JWT------

************************* IMPORTANT *************************
NKEY Seed printed below can be used to sign and prove identity.
NKEYs are sensitive and should be treated as secrets.

-----BEGIN USER NKEY SEED-----
{seed}
------END USER NKEY SEED------

*************************************************************
"""


def format_creds(user_jwt: str, seed: bytes) -> bytes:
    """A credentials file as ``nsc`` writes it and every NATS client reads it."""
    return _CREDS.format(jwt=user_jwt, seed=seed.decode()).encode()


def read_creds(path: str | os.PathLike[str]) -> tuple[str, bytes]:
    """``(user JWT, nkey seed)`` of a credentials file."""
    try:
        lines = Path(path).read_bytes().splitlines()
    except OSError as exc:
        raise AuthError(f"cannot read credentials file {str(path)!r}: {exc.strerror}") from None
    found: dict[bytes, bytes] = {}
    for i, line in enumerate(lines[:-1]):
        for marker in (b"BEGIN NATS USER JWT", b"BEGIN USER NKEY SEED"):
            if marker in line:
                found[marker] = lines[i + 1].strip()
    if len(found) != 2:
        raise AuthError(f"{str(path)!r} is not a NATS credentials file (user JWT and seed)")
    return found[b"BEGIN NATS USER JWT"].decode(), found[b"BEGIN USER NKEY SEED"]
