"""``init``: a new auth DIR — operator, system and application accounts, server config,
the broker's and the system user's credentials, and (with ``tls``) a local CA."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import msgspec

from reach_agent.wire.subjects import DEFAULT_PREFIX, Subjects

from . import claims, serverconf
from . import tls as tls_certs
from .claims import (
    Account,
    AccountClaims,
    AccountLimits,
    AuthError,
    Export,
    Import,
    Operator,
    OperatorClaims,
    User,
    UserClaims,
    WeightedMapping,
)
from .files import private_dir, write_private, write_public
from .identities import issue
from .layout import APP_ACCOUNT_NAME, OPERATOR_NAME, SYS_USER, SYSTEM_ACCOUNT_NAME, AuthDir, Meta

# The system account publishes every account's connect/disconnect advisories on
# $SYS.ACCOUNT.<account>.CONNECT|DISCONNECT and answers $SYS.REQ.ACCOUNT.<account>.CONNZ. It
# exports each with the account token position, so an importing account can only ever take
# its own account's (the server enforces that the token equals the importer's key).
_ADVISORY_EXPORTS = (
    Export(
        name="connect advisories",
        subject="$SYS.ACCOUNT.*.CONNECT",
        type="stream",
        account_token_position=3,
    ),
    Export(
        name="disconnect advisories",
        subject="$SYS.ACCOUNT.*.DISCONNECT",
        type="stream",
        account_token_position=3,
    ),
    Export(
        name="connections",
        subject="$SYS.REQ.ACCOUNT.*.CONNZ",
        type="service",
        response_type="Stream",
        account_token_position=4,
    ),
)


def _advisory_imports(system_account: str, account: str) -> list[Import]:
    return [
        Import(
            name="connect advisories",
            subject=f"$SYS.ACCOUNT.{account}.CONNECT",
            account=system_account,
            type="stream",
        ),
        Import(
            name="disconnect advisories",
            subject=f"$SYS.ACCOUNT.{account}.DISCONNECT",
            account=system_account,
            type="stream",
        ),
        Import(
            name="connections",
            subject=f"$SYS.REQ.ACCOUNT.{account}.CONNZ",
            account=system_account,
            type="service",
        ),
    ]


def init(
    directory: str | os.PathLike[str],
    *,
    tls: bool = False,
    force: bool = False,
    prefix: str = DEFAULT_PREFIX,
    host: str = "127.0.0.1",
    port: int = 4222,
    partitions: int = 32,
) -> AuthDir:
    """Create the auth DIR ``directory`` (see :mod:`reach_broker.auth.layout`).

    Refuses a directory that exists and is not empty unless ``force``, which deletes it first
    (every credential issued from the old DIR stops working with a server using the new one).
    ``host``/``port`` go into ``server.conf``; ``prefix`` is the subject prefix the
    permissions are written for; ``partitions`` the count the application account's subject
    mappings split the agent subjects into (``[fleet] partitions`` of the brokers).
    """
    subjects = Subjects(prefix)  # validates the prefix
    if not 1 <= partitions <= 4096:
        raise ValueError(f"partitions {partitions!r} must be within 1..4096 ([fleet] partitions)")
    root = Path(directory).expanduser().resolve()
    if tls:
        tls_certs.require()  # before anything is written
    if root.exists() and (not root.is_dir() or any(root.iterdir())):
        if not force:
            raise AuthError(
                f"{str(root)!r} exists and is not empty: refusing to overwrite its keys "
                "(pass force to replace it; credentials issued from it stop working)"
            )
        if root.is_dir():
            shutil.rmtree(root)
        else:
            root.unlink()
    private_dir(root)
    d = AuthDir(root)
    private_dir(d.keys)

    seeds = {
        "operator": claims.new_seed("operator"),
        "sys": claims.new_seed("account"),
        "app": claims.new_seed("account"),
    }
    for key, seed in seeds.items():
        write_private(d.seed_path(key), seed + b"\n")
    op, sys_kp, app = (claims.keypair(seeds[k]) for k in ("operator", "sys", "app"))
    op_pub, sys_pub, app_pub = (claims.public_key(k) for k in (op, sys_kp, app))

    operator_jwt = claims.encode(
        OperatorClaims(sub=op_pub, name=OPERATOR_NAME, nats=Operator(system_account=sys_pub)),
        op,
    )
    sys_jwt = claims.encode(
        AccountClaims(
            sub=sys_pub,
            name=SYSTEM_ACCOUNT_NAME,
            nats=Account(
                exports=list(_ADVISORY_EXPORTS), limits=AccountLimits.unlimited(jetstream=False)
            ),
        ),
        op,
    )
    app_jwt = claims.encode(
        AccountClaims(
            sub=app_pub,
            name=APP_ACCOUNT_NAME,
            nats=Account(
                imports=_advisory_imports(sys_pub, app_pub),
                mappings={
                    src: [WeightedMapping(subject=dst)]
                    for src, dst in subjects.mappings(partitions).items()
                },
                # JetStream on, bounded by the server's own limits.
                limits=AccountLimits.unlimited(jetstream=True),
                description="reach: agents, callers and brokers",
            ),
        ),
        op,
    )
    write_public(d.account_path("operator"), operator_jwt.encode())
    write_public(d.account_path(SYSTEM_ACCOUNT_NAME), sys_jwt.encode())
    write_public(d.account_path(APP_ACCOUNT_NAME), app_jwt.encode())
    private_dir(d.resolver_dir)
    write_public(d.resolver_dir / f"{app_pub}.jwt", app_jwt.encode())
    write_public(d.resolver_dir / f"{sys_pub}.jwt", sys_jwt.encode())
    d.store_dir.mkdir(parents=True, exist_ok=True)

    meta = Meta(prefix=prefix, operator=op_pub, system_account=sys_pub, account=app_pub, tls=tls)
    write_public(d.meta_path, msgspec.json.format(msgspec.json.encode(meta)) + b"\n")

    # The system user: full rights in the system account, to push account updates.
    sys_user = claims.new_seed("user")
    sys_claims = UserClaims(
        sub=claims.public_key(claims.keypair(sys_user)), name=SYS_USER, nats=User.unlimited()
    )
    write_private(d.sys_creds, claims.format_creds(claims.encode(sys_claims, sys_kp), sys_user))

    if tls:
        private_dir(d.tls_dir)
        tls_certs.make(
            d.ca, d.tls_dir / "ca-key.pem", d.tls_dir / "server.pem", d.tls_dir / "server-key.pem"
        )
    write_server_conf(d, host=host, port=port)
    issue(d, "broker", "broker")
    return d


def write_server_conf(d: AuthDir, *, host: str = "127.0.0.1", port: int = 4222) -> Path:
    """(Re)write ``DIR/server.conf`` from the DIR's JWTs, e.g. after moving the DIR."""
    meta = d.meta()
    text = serverconf.render(
        operator_jwt=d.account_path("operator").read_text().strip(),
        system_account=meta.system_account,
        system_account_jwt=d.account_path(SYSTEM_ACCOUNT_NAME).read_text().strip(),
        resolver_dir=d.resolver_dir,
        store_dir=d.store_dir,
        host=host,
        port=port,
        tls=(d.tls_dir / "server.pem", d.tls_dir / "server-key.pem") if meta.tls else None,
    )
    write_public(d.server_conf, text.encode())
    return d.server_conf
