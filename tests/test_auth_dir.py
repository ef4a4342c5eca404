"""The auth DIR without a server: tokens, the role table, issuing, listing, revoking."""

from __future__ import annotations

import base64
import json
import stat
from pathlib import Path

import msgspec
import pytest

from reach_agent.wire.subjects import Subjects
from reach_broker.auth import (
    ROLES,
    AuthDir,
    AuthError,
    claims,
    inbox_prefix_of,
    init,
    issue_agent,
    issue_broker,
    issue_caller,
    list_identities,
    revoke,
)
from reach_broker.auth.claims import AccountClaims, OperatorClaims, UserClaims
from reach_broker.auth.layout import APP_ACCOUNT_NAME
from reach_broker.auth.roles import permissions

ACC = "ACCOUNTKEY"


def _payload(token: str) -> dict[str, object]:
    part = token.split(".")[1]
    return dict(json.loads(base64.urlsafe_b64decode(part + "=" * (-len(part) % 4))))


def test_jwt_round_trip_and_tamper() -> None:
    op = claims.keypair(claims.new_seed("operator"))
    acc = claims.keypair(claims.new_seed("account"))
    token = claims.encode(AccountClaims(sub=claims.public_key(acc), name="REACH"), op, now=1000)
    header = json.loads(base64.urlsafe_b64decode(token.split(".")[0] + "=="))
    assert header == {"typ": "JWT", "alg": "ed25519-nkey"}
    got = claims.decode(token, AccountClaims)
    assert (got.iss, got.sub, got.iat, got.name) == (
        claims.public_key(op),
        claims.public_key(acc),
        1000,
        "REACH",
    )
    assert (got.nats.type, got.nats.version) == ("account", 2)
    assert len(got.jti) == 52
    # Another payload under the same signature is refused.
    h, _, sig = token.split(".")
    forged = (
        base64.urlsafe_b64encode(msgspec.json.encode(msgspec.structs.replace(got, name="EVIL")))
        .rstrip(b"=")
        .decode()
    )
    with pytest.raises(AuthError, match="account JWT signature does not verify"):
        claims.decode(f"{h}.{forged}.{sig}", AccountClaims)


def test_issuer_kind_is_checked() -> None:
    user = claims.keypair(claims.new_seed("user"))
    with pytest.raises(AuthError, match="UserClaims cannot be issued by key U"):
        claims.encode(UserClaims(sub=claims.public_key(user)), user)
    with pytest.raises(AuthError, match=r"expected an operator nkey seed \(SO…\)"):
        claims.keypair(claims.new_seed("account"), "operator")


def test_limits_are_written_as_unlimited_not_zero() -> None:
    """nats-server reads a missing limit as 0 (none allowed): unlimited must be -1."""
    user = permissions("agent", "alpha", account=ACC)
    encoded = json.loads(msgspec.json.encode(user))
    assert (encoded["subs"], encoded["data"], encoded["payload"]) == (-1, -1, -1)


def test_agent_permissions() -> None:
    user = permissions("agent", "alpha", account=ACC)
    assert user.pub.allow == [
        "reach.announce.alpha",
        "reach.hb.alpha",
        "reach.leave.alpha",
        "reach.ack.alpha.>",
        "$KV.reach_claims.>",
        "$JS.API.STREAM.INFO.KV_reach_claims",
        "$JS.API.STREAM.MSG.GET.KV_reach_claims",
        "$JS.API.STREAM.MSG.GET.REACH_ACKS",
        "$JS.API.STREAM.INFO.REACH_ACKS",
        "reach.part.*.announce.alpha",
        "reach.part.*.hb.alpha",
        "reach.part.*.leave.alpha",
    ]
    assert user.sub.allow == [
        "reach.task.alpha.>",
        "reach.probe.alpha",
        "reach.reannounce.alpha",
        "reach.cancel.alpha",
        "reach.event.*.alpha",
        "_INBOX.agent.alpha.>",
    ]
    assert user.resp is not None
    assert (user.resp.max, user.resp.ttl) == (-1, 3660_000_000_000)
    assert user.allowed_connection_types == ["STANDARD"]
    assert user.tags == ["reach-role:agent"]
    assert inbox_prefix_of(user) == "_INBOX.agent.alpha"
    assert permissions("agent", "a", account=ACC, reply_window_s=600).resp.ttl == 600 * 10**9  # type: ignore[union-attr]
    with pytest.raises(ValueError, match="reply_window_s 0 must be > 0"):
        permissions("agent", "a", account=ACC, reply_window_s=0)


def test_caller_permissions() -> None:
    user = permissions("caller", "ops", account=ACC)
    assert user.pub.allow == [
        "reach.route.>",
        "reach.agents",
        "reach.agents.*",
        "reach.task.>",
        "reach.comp.>",
        "reach.probe.*",
        "reach.outcome.*",
        "reach.part.*.outcome.*",
        "reach.cancel.*",
        "$JS.API.STREAM.MSG.GET.REACH_ACKS",
        "$JS.API.STREAM.INFO.REACH_ACKS",
        "$JS.API.STREAM.MSG.GET.KV_reach_claims",
        "reach.tables.>",
        "$JS.API.STREAM.INFO.KV_reach_tables",
        "$JS.API.STREAM.MSG.GET.KV_reach_tables",
    ]
    assert user.sub.allow == ["reach.ack.>", "reach.event.>", "reach.table.>",
                              "_INBOX.caller.ops.>"]  # fmt: skip
    assert user.resp is not None
    assert (user.resp.max, user.resp.ttl) == (-1, 3660_000_000_000)


def test_broker_permissions() -> None:
    user = permissions("broker", "broker", account=ACC)
    assert user.pub.allow == [
        "reach.event.>",
        "reach.probe.*",
        "reach.reannounce.*",
        "reach.task.>",
        "reach.table.>",
        "reach.partcheck.*",
        "reach.part.*.check.*",
        "reach.cancel.*",
        "reach.ack._broker.>",
        "_INBOX.>",
        "$JS.API.>",
        "$JS.ACK.>",
        "$JS.FC.>",
        "$KV.>",
        "$SYS.REQ.USER.INFO",
        f"$SYS.REQ.ACCOUNT.{ACC}.CONNZ",
        "$SYS.REQ.ACCOUNT.PING.CONNZ",
        "$SYS.REQ.SERVER.PING.CONNZ",
        "$SRV.>",
        "reach.agents",
        "reach.agents.*",
        "reach.route.>",
        "reach.forward.>",
    ]
    assert user.sub.allow == [
        "reach.part.>",
        "reach.partcheck.*",
        "reach.announce.*",
        "reach.hb.*",
        "reach.leave.*",
        "reach.route.>",
        "reach.agents",
        "reach.agents.*",
        "reach.comp.>",
        "reach.ack.>",
        "reach.event.>",
        "reach.outcome.*",
        "reach.tables.>",
        "reach.cancel._broker",
        "$SRV.>",
        f"$SYS.ACCOUNT.{ACC}.CONNECT",
        f"$SYS.ACCOUNT.{ACC}.DISCONNECT",
        "_INBOX.broker.broker.>",
        "reach.forward.>",
    ]


def test_permissions_follow_the_prefix() -> None:
    user = permissions("agent", "alpha", account=ACC, subjects=Subjects("acme"))
    assert user.pub.allow[0] == "acme.announce.alpha"
    assert user.pub.allow[3] == "acme.ack.alpha.>"


def test_every_role_cell_expands() -> None:
    for role in ROLES:
        user = permissions(role, "broker" if role == "broker" else "x", account=ACC)
        assert all(s and " " not in s for s in user.pub.allow + user.sub.allow), role


def test_init_layout_and_modes(tmp_path: Path) -> None:
    d = init(tmp_path / "auth")
    assert isinstance(d, AuthDir)
    meta = d.meta()
    assert (meta.prefix, meta.tls, meta.format) == ("reach", False, 1)
    assert meta.operator.startswith("O") and meta.account.startswith("A")
    for secret in (d.broker_creds, d.sys_creds, *d.keys.iterdir()):
        assert stat.S_IMODE(secret.stat().st_mode) == 0o600, secret
    assert stat.S_IMODE(d.keys.stat().st_mode) == 0o700
    assert sorted(p.name for p in d.resolver_dir.iterdir()) == sorted(
        [f"{meta.account}.jwt", f"{meta.system_account}.jwt"]
    )
    conf = d.server_conf.read_text()
    assert f'system_account: "{meta.system_account}"' in conf
    assert "type: full" in conf and "allow_delete: true" in conf
    assert "password" not in conf and "tls {" not in conf
    op = claims.decode(d.account_path("operator").read_text(), OperatorClaims)
    assert op.nats.system_account == meta.system_account
    app = d.app_account()
    assert app.nats.limits.disk_storage == -1
    assert [i.subject for i in app.nats.imports] == [
        f"$SYS.ACCOUNT.{meta.account}.CONNECT",
        f"$SYS.ACCOUNT.{meta.account}.DISCONNECT",
        f"$SYS.REQ.ACCOUNT.{meta.account}.CONNZ",
    ]
    broker_jwt, seed = claims.read_creds(d.broker_creds)
    assert seed.startswith(b"SU")
    assert _payload(broker_jwt)["name"] == "broker"


def test_init_refuses_an_existing_dir(tmp_path: Path) -> None:
    first = init(tmp_path / "auth")
    key = first.seed_path("operator").read_bytes()
    with pytest.raises(AuthError, match="exists and is not empty: refusing to overwrite"):
        init(tmp_path / "auth")
    assert first.seed_path("operator").read_bytes() == key
    again = init(tmp_path / "auth", force=True)
    assert again.seed_path("operator").read_bytes() != key


def test_open_needs_an_auth_dir(tmp_path: Path) -> None:
    with pytest.raises(AuthError, match=r"is not a reach auth dir \(no auth.json\)"):
        issue_agent(tmp_path, "alpha")


def test_issue_and_list(tmp_path: Path) -> None:
    d = init(tmp_path / "auth")
    alpha = issue_agent(d, "alpha")
    ops = issue_caller(tmp_path / "auth", "ops", expires_s=3600)
    assert alpha == d.root / "agents" / "alpha.creds"
    assert ops == d.root / "callers" / "ops.creds"
    assert stat.S_IMODE(alpha.stat().st_mode) == 0o600
    token, _ = claims.read_creds(alpha)
    user = claims.decode(token, UserClaims)
    assert (user.name, user.iss) == ("alpha", d.meta().account)
    assert user.nats.pub.allow[1] == "reach.hb.alpha"
    listed = [(i.role, i.name, i.revoked_at) for i in list_identities(d)]
    assert listed == [("agent", "alpha", None), ("caller", "ops", None), ("broker", "broker", None)]
    caller = next(i for i in list_identities(d) if i.role == "caller")
    assert caller.expires_at is not None and caller.expires_at - caller.issued_at == 3600


def test_issue_refuses_bad_names_and_duplicates(tmp_path: Path) -> None:
    d = init(tmp_path / "auth")
    with pytest.raises(AuthError, match=r"agent_id 'a.b' is not valid \(one subject token"):
        issue_agent(d, "a.b")
    with pytest.raises(AuthError, match=r"caller name '\*' is not valid"):
        issue_caller(d, "*")
    issue_agent(d, "alpha")
    with pytest.raises(AuthError, match="agent 'alpha' already has credentials at"):
        issue_agent(d, "alpha")


def test_revoke_resigns_the_account(tmp_path: Path) -> None:
    d = init(tmp_path / "auth")
    path = issue_agent(d, "alpha")
    key = claims.decode(claims.read_creds(path)[0], UserClaims).sub
    gone = revoke(d, "alpha", now=2_000_000_000)
    assert (gone.role, gone.name, gone.public_key, gone.revoked_at) == (
        "agent",
        "alpha",
        key,
        2_000_000_000,
    )
    assert not path.exists()
    assert gone.path == d.revoked / "agent" / f"alpha.{key}.jwt"
    app = d.app_account()
    assert app.nats.revocations == {key: 2_000_000_000}
    assert (d.resolver_dir / f"{app.sub}.jwt").read_text() == d.account_path("REACH").read_text()
    # The rest of the account is unchanged.
    assert len(app.nats.imports) == 3 and app.nats.limits.disk_storage == -1
    assert [(i.name, i.revoked_at) for i in list_identities(d) if i.role == "agent"] == [
        ("alpha", 2_000_000_000)
    ]
    with pytest.raises(AuthError, match="no agent or caller named 'alpha' has credentials"):
        revoke(d, "alpha")
    # A new credential for the same agent is a new key, untouched by the old revocation.
    fresh = claims.decode(claims.read_creds(issue_agent(d, "alpha"))[0], UserClaims)
    assert fresh.sub != key
    # Oldest first, the revoked key before its replacement however the seconds fall.
    assert [i.revoked_at for i in list_identities(d) if i.name == "alpha"] == [2_000_000_000, None]


def test_force_reissue_revokes_the_old_key(tmp_path: Path) -> None:
    d = init(tmp_path / "auth")
    first = claims.decode(claims.read_creds(d.broker_creds)[0], UserClaims).sub
    second = claims.decode(claims.read_creds(issue_broker(d, force=True))[0], UserClaims).sub
    assert second != first
    assert list(d.app_account().nats.revocations) == [first]
    listed = [(i.public_key, i.revoked_at is None) for i in list_identities(d)]
    assert sorted(listed) == sorted([(first, False), (second, True)])


def test_revoke_ambiguous_name(tmp_path: Path) -> None:
    d = init(tmp_path / "auth")
    issue_agent(d, "x")
    issue_caller(d, "x")
    with pytest.raises(AuthError, match="'x' is both agent and caller: name the role"):
        revoke(d, "x")
    assert revoke(d, "x", role="caller").role == "caller"


def test_tls_init_makes_certificates(tmp_path: Path) -> None:
    pytest.importorskip("cryptography")
    from cryptography import x509

    d = init(tmp_path / "auth", tls=True)
    assert d.meta().tls is True
    ca = x509.load_pem_x509_certificate(d.ca.read_bytes())
    srv = x509.load_pem_x509_certificate((d.tls_dir / "server.pem").read_bytes())
    assert srv.issuer == ca.subject
    sans = srv.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert sans.get_values_for_type(x509.DNSName) == ["localhost"]
    assert [str(ip) for ip in sans.get_values_for_type(x509.IPAddress)] == ["127.0.0.1", "::1"]
    assert stat.S_IMODE((d.tls_dir / "server-key.pem").stat().st_mode) == 0o600
    conf = d.server_conf.read_text()
    assert f'cert_file: "{d.tls_dir / "server.pem"}"' in conf


def test_init_maps_the_agent_subjects_into_partitions(tmp_path: Path) -> None:
    d = init(tmp_path / "auth", prefix="acme", partitions=8)
    app = claims.decode(d.account_path(APP_ACCOUNT_NAME).read_text().strip(), AccountClaims)
    mappings = app.nats.mappings
    assert {src: [(m.subject, m.weight) for m in dst] for src, dst in mappings.items()} == {
        "acme.announce.*": [("acme.part.{{partition(8,1)}}.announce.{{wildcard(1)}}", 100)],
        "acme.hb.*": [("acme.part.{{partition(8,1)}}.hb.{{wildcard(1)}}", 100)],
        "acme.leave.*": [("acme.part.{{partition(8,1)}}.leave.{{wildcard(1)}}", 100)],
        "acme.outcome.*": [("acme.part.{{partition(8,1)}}.outcome.{{wildcard(1)}}", 100)],
        "acme.partcheck.*": [("acme.part.{{partition(8,1)}}.check.{{wildcard(1)}}", 100)],
    }
    with pytest.raises(ValueError, match="partitions 0"):
        init(tmp_path / "auth2", partitions=0)
