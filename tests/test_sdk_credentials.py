"""Agents and clients on a real nats-server that requires user credentials (operator mode,
from a reach_broker.auth DIR), with ``creds=`` and with ``NATS_CREDS`` in the environment."""

from __future__ import annotations

import asyncio
import signal
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import nats
import nats.errors
import pytest

import reach_agent
from reach_agent.client import durable
from reach_agent.connection import Credentials, connect_options
from reach_broker.auth import AuthDir, claims, init
from reach_broker.auth.claims import User, UserClaims
from reach_broker.broker import Broker
from reach_broker.service.metrics import Metrics

from .agents.procs import AgentProcess
from .auth_helpers import AuthServer
from .conftest import fast_config, wait_for


def unrestricted_user(d: AuthDir, name: str, path: Path) -> Path:
    """Credentials of a user of the DIR's application account allowed everything: this
    module tests how the SDK presents credentials, not the roles (test_auth_server.py)."""
    seed = claims.new_seed("user")
    user = UserClaims(sub=claims.public_key(claims.keypair(seed)), name=name,
                      nats=User.unlimited())  # fmt: skip
    path.write_bytes(claims.format_creds(claims.encode(user, d.signer("app")), seed))
    path.chmod(0o600)
    return path


class Secured:
    """A server that admits only users of the DIR's accounts, and a credentials file per
    user of this test."""

    def __init__(self, tmp: Path) -> None:
        d = init(tmp / "auth")
        self.creds = {u: unrestricted_user(d, u, tmp / f"{u}.creds")
                      for u in ("broker", "agent", "client")}  # fmt: skip
        self.server = AuthServer(d, tmp / "nats")

    @property
    def url(self) -> str:
        return self.server.url


@pytest.fixture
def secured(tmp_path: Path) -> Iterator[Secured]:
    s = Secured(tmp_path)
    s.server.start()
    try:
        yield s
    finally:
        s.server.stop()


@pytest.fixture
async def secured_broker(secured: Secured) -> AsyncIterator[Broker]:
    """A broker (JetStream streams provisioned) connected with its own credentials."""
    broker = Broker(
        fast_config(secured.url, nats__creds=str(secured.creds["broker"])), metrics=Metrics()
    )
    await asyncio.wait_for(broker.start(), 20)
    try:
        yield broker
    finally:
        await broker.stop()


def echo_agent(agent_id: str, **kw: Any) -> reach_agent.Agent:
    agent = reach_agent.Agent(agent_id, ["secure.echo"], heartbeat_interval=0.1, **kw)

    @agent.handler("secure.echo")
    async def echo(task: reach_agent.Task) -> dict[str, Any]:
        return {"by": agent_id, "got": task.payload}

    return agent


def healthy(broker: Broker, agent_id: str) -> bool:
    assert broker.registry is not None
    rec = broker.registry.agents.get(agent_id)
    return rec is not None and rec.state == "healthy"


async def test_the_server_refuses_a_connection_without_credentials(secured: Secured) -> None:
    nc = nats.NATS()
    try:
        with pytest.raises(nats.errors.Error) as info:
            await asyncio.wait_for(nc.connect(secured.url, allow_reconnect=False), 10)
        assert "Authorization Violation" in str(info.value)
    finally:
        await nc.close()  # nats-py leaves the refused socket open otherwise


async def test_agent_and_client_with_creds_serve_a_call_and_store_its_acks(
    secured: Secured, secured_broker: Broker
) -> None:
    agent = echo_agent("cred1", creds=str(secured.creds["agent"]))
    await asyncio.wait_for(agent.start(secured.url), 20)
    try:
        await wait_for(lambda: healthy(secured_broker, "cred1"), 10, what="cred1 healthy")
        async with reach_agent.Client(secured.url, creds=str(secured.creds["client"])) as client:
            rid = str(uuid.uuid4())
            result = await client.call("secure.echo", {"x": 1}, request_id=rid, timeout=10)
            assert result == {"by": "cred1", "got": {"x": 1}}
            # The agent's ack writer has a connection of its own: it used the agent's creds.
            record = await durable.wait(client, rid, timeout=10)
            assert (record.request_id, record.state, record.agent_id) == (rid, "completed",
                                                                          "cred1")  # fmt: skip
    finally:
        await asyncio.wait_for(agent.stop(grace=2), 20)


async def test_nats_creds_from_the_environment(
    secured: Secured, secured_broker: Broker, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("NATS_CREDS", str(secured.creds["agent"]))
    monkeypatch.setenv("NATS_URL", secured.url)
    agent = echo_agent("cred2")
    await asyncio.wait_for(agent.start(), 20)
    try:
        await wait_for(lambda: healthy(secured_broker, "cred2"), 10, what="cred2 healthy")
        async with reach_agent.Client() as client:
            rid = str(uuid.uuid4())
            assert await client.call("secure.echo", "hi", request_id=rid, timeout=10) == {
                "by": "cred2", "got": "hi",
            }  # fmt: skip
            assert (await durable.wait(client, rid, timeout=10)).state == "completed"
    finally:
        await asyncio.wait_for(agent.stop(grace=2), 20)


async def test_run_takes_creds_and_reads_nats_creds(
    secured: Secured, secured_broker: Broker, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``reach_agent.run(agent, creds=...)`` in an agent process (worker.py --creds), and
    ``run(agent)`` with ``NATS_CREDS`` (design_agent.py)."""
    by_option = AgentProcess("worker.py", secured.url, "cred3", "secure.echo", "--creds",
                             str(secured.creds["agent"]), "--log", str(tmp_path / "cred3.log"),
                             log_path=tmp_path / "cred3.err")  # fmt: skip
    monkeypatch.setenv("NATS_CREDS", str(secured.creds["agent"]))
    by_env = AgentProcess("design_agent.py", secured.url, log_path=tmp_path / "alpha.err")
    try:
        await wait_for(lambda: healthy(secured_broker, "cred3"), 30, what="cred3 healthy")
        await wait_for(lambda: healthy(secured_broker, "alpha"), 30, what="alpha healthy")
        async with reach_agent.Client(secured.url, creds=str(secured.creds["client"])) as client:
            assert await client.call("secure.echo", {"n": 4}, timeout=10) == {
                "agent": "cred3", "n": 4,
            }  # fmt: skip
            assert await client.call("text_processing", {"text": "abc"}, timeout=10) == {"chars": 3}
        for proc in (by_option, by_env):
            proc.signal(signal.SIGTERM)
            assert await asyncio.to_thread(proc.wait, 20) == 0, proc.output()
    finally:
        by_option.stop()
        by_env.stop()


async def test_a_missing_credentials_file_is_a_clear_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    missing = str(tmp_path / "nope.creds")
    expected = f"creds file {missing!r} does not exist (set by the creds option or NATS_CREDS)"
    with pytest.raises(ValueError) as info:
        echo_agent("cred4", creds=missing)
    assert str(info.value) == expected
    with pytest.raises(ValueError) as info:
        reach_agent.Client(creds=missing)
    assert str(info.value) == expected
    with pytest.raises(ValueError) as info:
        reach_agent.run(echo_agent("cred5"), "nats://127.0.0.1:1", creds=missing)
    assert str(info.value) == expected
    monkeypatch.setenv("NATS_CREDS", missing)  # from the environment: at connect time
    with pytest.raises(ValueError) as info:
        await echo_agent("cred6").start("nats://127.0.0.1:1")
    assert str(info.value) == expected
    with pytest.raises(ValueError) as info:
        await reach_agent.Client("nats://127.0.0.1:1").start()
    assert str(info.value) == expected
    with pytest.raises(ValueError) as info:
        reach_agent.Client(creds=str(tmp_path), nc=nats.NATS())
    assert "does not exist" in str(info.value)  # a directory is not a credentials file
    with pytest.raises(ValueError) as info:
        reach_agent.Client(user="u", nc=nats.NATS())
    assert str(info.value) == "credentials apply to the client's own connection: not with nc="


def test_connect_options_map_credentials_and_the_environment(tmp_path: Path) -> None:
    creds, seed = tmp_path / "u.creds", tmp_path / "u.nk"
    creds.write_text("x")
    seed.write_text("SU...")
    env = {"NATS_URL": "nats://a:4222, nats://b:4222", "NATS_CREDS": str(seed),
           "NATS_USER": "env-user", "NATS_PASSWORD": "pw", "NATS_TOKEN": "t0k"}  # fmt: skip
    opts = connect_options("n1", None, Credentials(creds=str(creds)), env=env)
    assert opts["servers"] == ["nats://a:4222", "nats://b:4222"]
    assert opts["user_credentials"] == str(creds)  # the explicit value wins over NATS_CREDS
    assert (opts["user"], opts["password"], opts["token"]) == ("env-user", "pw", "t0k")
    assert "nkeys_seed" not in opts and "tls" not in opts
    opts = connect_options("n2", "nats://c:4222", Credentials(nkey_seed=str(seed)), env={})
    assert (opts["servers"], opts["nkeys_seed"], opts["name"]) == (["nats://c:4222"], str(seed),
                                                                   "n2")  # fmt: skip
    assert "user_credentials" not in opts and "user" not in opts


def test_credentials_that_cannot_work_are_refused_naming_the_setting(tmp_path: Path) -> None:
    pem = tmp_path / "c.pem"
    pem.write_text("not really a certificate")
    with pytest.raises(ValueError) as info:
        Credentials(password="pw").check()
    assert str(info.value) == "password is set but user is not (NATS_USER / the user option)"
    with pytest.raises(ValueError) as info:
        Credentials(tls_cert=str(pem)).check()
    assert str(info.value) == "tls_cert and tls_key go together: give both or neither"
    with pytest.raises(ValueError) as info:
        connect_options("n", "nats://x:4222", env={"NATS_CA": str(tmp_path / "ca.pem")})
    assert str(info.value) == (f"tls_ca file {str(tmp_path / 'ca.pem')!r} does not exist "
                               "(set by the tls_ca option or NATS_CA)")  # fmt: skip
