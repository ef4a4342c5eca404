"""Mint NATS operator-mode (decentralized JWT) credentials, for tests that need a server which
requires user credentials.

The chain of trust: an operator (self-signed JWT) signs an account JWT, the account signs
user JWTs; a user's credentials file holds its JWT and its nkey seed. The server trusts the
operator and knows the accounts from a MEMORY resolver preloaded in its config. Keys and
signatures come from ``nkeys``, the NATS project's library (ed25519); the JWT layout is
nats-io/jwt v2's (``typ: JWT``, ``alg: ed25519-nkey``, claims under ``nats``)::

    op = Operator.create("test")
    app = op.account("APP")                      # JetStream enabled
    Path("agent.creds").write_text(app.user_creds("agent"))
    Path("server.conf").write_text(op.server_config(tmp_dir))
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import time
from pathlib import Path
from typing import Any

import nkeys

UNLIMITED = -1


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


class Key:
    """An nkey pair of one role (operator, account or user)."""

    def __init__(self, prefix: int) -> None:
        self.seed: bytes = nkeys.encode_seed(os.urandom(32), prefix)
        self._pair = nkeys.from_seed(bytearray(self.seed))
        self.public: str = self._pair.public_key.decode()

    def sign(self, data: bytes) -> bytes:
        return bytes(self._pair.sign(data))


def encode_jwt(name: str, subject: str, issuer: Key, nats: dict[str, Any]) -> str:
    """A JWT of ``subject`` (a public key) signed by ``issuer``; ``nats`` holds the claims of
    its type (``type`` and ``version`` are added)."""
    claims: dict[str, Any] = {
        "iat": int(time.time()),
        "iss": issuer.public,
        "name": name,
        "sub": subject,
        "nats": {**nats, "version": 2},
    }
    # jti: a unique id, the hash of the claims without it (as nats-io/jwt does).
    digest = hashlib.new("sha512_256", json.dumps(claims, sort_keys=True).encode()).digest()
    claims["jti"] = base64.b32encode(digest).rstrip(b"=").decode()
    header = _b64(json.dumps({"typ": "JWT", "alg": "ed25519-nkey"}).encode())
    signed = f"{header}.{_b64(json.dumps(claims).encode())}"
    return f"{signed}.{_b64(issuer.sign(signed.encode()))}"


class Account:
    """An account signed by its operator; it signs its users."""

    def __init__(self, name: str, operator: Key, *, jetstream: bool) -> None:
        self.name = name
        self.key = Key(nkeys.PREFIX_BYTE_ACCOUNT)
        limits: dict[str, Any] = {
            "subs": UNLIMITED, "data": UNLIMITED, "payload": UNLIMITED,
            "imports": UNLIMITED, "exports": UNLIMITED, "wildcards": True,
            "conn": UNLIMITED, "leaf": UNLIMITED,
        }  # fmt: skip
        if jetstream:  # JetStream is on for an account with any storage allowed
            limits.update(mem_storage=UNLIMITED, disk_storage=UNLIMITED,
                          streams=UNLIMITED, consumer=UNLIMITED)  # fmt: skip
        self.jwt = encode_jwt(name, self.key.public, operator, {
            "type": "account", "limits": limits,
            "default_permissions": {"pub": {}, "sub": {}},
        })  # fmt: skip

    def user_creds(self, name: str) -> str:
        """A credentials file (user JWT + seed) for a new user of this account, allowed
        everything the account allows."""
        user = Key(nkeys.PREFIX_BYTE_USER)
        jwt = encode_jwt(name, user.public, self.key, {
            "type": "user", "pub": {}, "sub": {},
            "subs": UNLIMITED, "data": UNLIMITED, "payload": UNLIMITED,
        })  # fmt: skip
        return (
            f"-----BEGIN NATS USER JWT-----\n{jwt}\n------END NATS USER JWT------\n\n"
            "************************* IMPORTANT *************************\n"
            "NKEY Seed printed below can be used to sign and prove identity.\n"
            "NKEYs are sensitive and should be treated as secrets.\n\n"
            f"-----BEGIN USER NKEY SEED-----\n{user.seed.decode()}\n"
            "------END USER NKEY SEED------\n\n"
            "*************************************************************\n"
        )


class Operator:
    """The root of trust: a self-signed operator JWT and the accounts it signed, among them
    the system account the server needs (JetStream refuses to start without one)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.key = Key(nkeys.PREFIX_BYTE_OPERATOR)
        self.jwt = encode_jwt(name, self.key.public, self.key, {"type": "operator"})
        self.system = Account("SYS", self.key, jetstream=False)
        self.accounts: list[Account] = [self.system]

    @classmethod
    def create(cls, name: str) -> Operator:
        return cls(name)

    def account(self, name: str, *, jetstream: bool = True) -> Account:
        acct = Account(name, self.key, jetstream=jetstream)
        self.accounts.append(acct)
        return acct

    def server_config(self, directory: str | os.PathLike[str]) -> str:
        """nats-server config text trusting this operator, with every account preloaded in
        a MEMORY resolver (the operator JWT is written to ``directory``)."""
        path = Path(directory) / f"{self.name}.jwt"
        path.write_text(self.jwt)
        preload = "\n".join(f'  {a.key.public}: "{a.jwt}"' for a in self.accounts)
        return (
            f'operator: "{path}"\nsystem_account: {self.system.key.public}\n'
            f"resolver: MEMORY\nresolver_preload: {{\n{preload}\n}}\n"
        )
