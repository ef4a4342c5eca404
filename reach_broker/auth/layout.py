"""The auth directory (``DIR``): where every key, token and config file lives.

    DIR/
      auth.json               what this DIR is: format, subject prefix, account public keys
      server.conf             nats-server config (operator mode, JetStream, TLS if made)
      broker.creds            the broker's credential (all replicas share it)        0600
      sys.creds               a system-account user: pushes account updates          0600
      agents/<agent_id>.creds one per agent                                          0600
      callers/<name>.creds    one per caller                                         0600
      keys/                   nkey seeds of the operator and both accounts     0700 / 0600
      accounts/               the JWTs reach signed: operator, SYS, REACH (the application
                              account, re-signed on every revocation)
      jwt/                    the server's account store (full resolver), <account>.jwt
      revoked/<role>/<name>.<user key>.jwt   user JWTs of revoked credentials (no seed)
      tls/                    ca.pem, ca-key.pem, server.pem, server-key.pem (with --tls)
      data/jetstream/         JetStream's store

Keep ``keys/`` offline-grade secret: the operator and account seeds sign new identities.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

from . import claims
from .claims import AccountClaims, AuthError
from .roles import RoleName

FORMAT = 1
OPERATOR_NAME = "reach"
SYSTEM_ACCOUNT_NAME = "SYS"
APP_ACCOUNT_NAME = "REACH"
SYS_USER = "sys"
BROKER_NAME = "broker"


class Meta(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """``DIR/auth.json``."""

    format: int = FORMAT
    """Layout version of the DIR."""
    prefix: str = "reach"
    """Subject prefix the permissions are written for."""
    operator: str
    """Operator public key (``O…``)."""
    system_account: str
    """System account public key (``A…``)."""
    account: str
    """Application account public key (``A…``): every reach identity is a user of it."""
    tls: bool = False
    """Whether ``tls/`` holds a CA and the server requires TLS."""


@dataclass(frozen=True)
class AuthDir:
    """Paths of one DIR; :meth:`open` checks it is one."""

    root: Path

    @classmethod
    def open(cls, root: str | os.PathLike[str]) -> AuthDir:
        d = cls(Path(root).expanduser().resolve())
        if not d.meta_path.is_file():
            raise AuthError(
                f"{str(d.root)!r} is not a reach auth dir (no auth.json): "
                "create one with `reach auth init DIR`"
            )
        return d

    # --- files ---------------------------------------------------------------------------

    @property
    def meta_path(self) -> Path:
        return self.root / "auth.json"

    @property
    def server_conf(self) -> Path:
        return self.root / "server.conf"

    @property
    def broker_creds(self) -> Path:
        return self.root / "broker.creds"

    @property
    def sys_creds(self) -> Path:
        return self.root / "sys.creds"

    @property
    def keys(self) -> Path:
        return self.root / "keys"

    @property
    def accounts(self) -> Path:
        return self.root / "accounts"

    @property
    def resolver_dir(self) -> Path:
        return self.root / "jwt"

    @property
    def revoked(self) -> Path:
        return self.root / "revoked"

    @property
    def tls_dir(self) -> Path:
        return self.root / "tls"

    @property
    def ca(self) -> Path:
        """The CA certificate clients verify the server with (``tls_ca`` / ``NATS_CA``)."""
        return self.tls_dir / "ca.pem"

    @property
    def store_dir(self) -> Path:
        """JetStream's ``store_dir`` (the server keeps its files in ``jetstream/`` below)."""
        return self.root / "data"

    def creds(self, role: RoleName, name: str) -> Path:
        """Where the credential of ``name`` in ``role`` is written."""
        if role == "broker":
            return self.broker_creds
        return self.root / f"{role}s" / f"{name}.creds"

    def seed_path(self, key: str) -> Path:
        return self.keys / f"{key}.nk"

    # --- contents ------------------------------------------------------------------------

    def meta(self) -> Meta:
        try:
            return msgspec.json.decode(self.meta_path.read_bytes(), type=Meta)
        except (OSError, msgspec.DecodeError) as exc:
            raise AuthError(f"cannot read {str(self.meta_path)!r}: {exc}") from None

    def signer(self, key: str) -> Any:
        """The key pair of ``operator``, ``sys`` or ``app`` (the application account)."""
        path = self.seed_path(key)
        try:
            seed = path.read_bytes()
        except OSError as exc:
            raise AuthError(f"cannot read key {str(path)!r}: {exc.strerror}") from None
        return claims.keypair(seed, "operator" if key == "operator" else "account")

    def account_path(self, name: str) -> Path:
        return self.accounts / f"{name}.jwt"

    def app_account(self) -> AccountClaims:
        """The application account as last signed (with its revocations)."""
        path = self.account_path(APP_ACCOUNT_NAME)
        try:
            token = path.read_text()
        except OSError as exc:
            raise AuthError(f"cannot read {str(path)!r}: {exc.strerror}") from None
        return claims.decode(token, AccountClaims)
