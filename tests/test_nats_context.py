"""NATS contexts as the ``nats`` CLI keeps them (``~/.config/nats/context/NAME.json`` and the
selected one in ``context.txt``): a server that requires a user and password, a context file
that names both, and ``NATS_CONTEXT`` / ``--context`` / the selected context giving ``reach
route``, an SDK agent, a ``Client`` and a broker that server and those credentials.
Explicit values and ``NATS_*`` variables win over the context, as in the ``nats`` CLI."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

import reach_agent
from reach_agent.connection import Credentials, NatsContext, connect_options, load_context
from reach_broker.broker import Broker
from reach_broker.cluster.natsserver import NatsServer
from reach_broker.service.metrics import Metrics

from .conftest import fast_config, wait_for
from .test_cli import reach

USER, PASSWORD = "ops", "s3cret-ctx"


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """HOME in the test's tmp dir, with no NATS_* or XDG variable of the machine's."""
    home = tmp_path / "home"
    (home / ".config" / "nats" / "context").mkdir(parents=True)
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.delenv("XDG_CONFIG_HOME", raising=False)
    for var in ("NATS_URL", "NATS_CONTEXT", "NATS_USER", "NATS_PASSWORD", "NATS_CREDS"):
        monkeypatch.delenv(var, raising=False)
    return home


@pytest.fixture
def secured(tmp_path: Path) -> Iterator[NatsServer]:
    """A nats-server with JetStream that lets in only ``ops`` with its password."""
    conf = tmp_path / "secured.conf"
    conf.write_text(
        f"jetstream {{ store_dir: {json.dumps(str(tmp_path / 'js'))} }}\n"
        f"authorization {{ users = [ {{ user: {USER}, password: {PASSWORD} }} ] }}\n"
    )
    server = NatsServer(port=0, config=conf, config_store=True, store_dir=tmp_path / "srv")
    server.start()
    try:
        yield server
    finally:
        server.stop()


def save_context(home: Path, name: str, body: dict[str, object]) -> None:
    """A context file as ``nats context save`` writes it: every field, most of them empty."""
    full = {"description": f"the {name} servers", "url": "", "socks_proxy": "", "token": "",
            "user": "", "password": "", "creds": "", "nkey": "", "cert": "", "key": "",
            "ca": "", "nsc": "", "jetstream_domain": "", "jetstream_api_prefix": "",
            "jetstream_event_prefix": "", "inbox_prefix": "", "user_jwt": "",
            "color_scheme": "", "tls_first": False, **body}  # fmt: skip
    (home / ".config" / "nats" / "context" / f"{name}.json").write_text(json.dumps(full))


@pytest.fixture
async def broker_on_secured(
    secured: NatsServer, home: Path
) -> AsyncIterator[tuple[NatsServer, Broker]]:
    """A broker that reaches the secured server through the context ``ops`` (no url or
    credentials of its own in the config)."""
    save_context(home, "ops", {"url": secured.url, "user": USER, "password": PASSWORD})
    cfg = fast_config("unused")
    cfg.nats.url = None
    cfg.nats.context = "ops"
    broker = Broker(cfg, metrics=Metrics())
    await broker.start()
    try:
        yield secured, broker
    finally:
        await broker.stop()


def echo_agent(agent_id: str, **options: str) -> reach_agent.Agent:
    agent = reach_agent.Agent(agent_id, ["echo"], heartbeat_interval=0.2, **options)  # type: ignore[arg-type]

    @agent.handler("echo")
    async def echo(task: reach_agent.Task) -> object:
        return {"by": agent_id, "echo": task.payload}

    return agent


async def test_nats_context_gives_route_agent_and_client_the_server_and_credentials(
    broker_on_secured: tuple[NatsServer, Broker], home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    server, broker = broker_on_secured
    env = {"HOME": str(home)}
    # Without the context: refused by the server, so the server is secured.
    code, _, err = await reach("route", "echo", "--server", server.url, env=env)
    assert code == 3 and "authorization violation" in err, err

    monkeypatch.setenv("NATS_CONTEXT", "ops")
    agent = echo_agent("ctx-agent")
    await agent.start()  # no servers, no credentials: all from the context
    try:
        await wait_for(lambda: (r := broker.registry.agents.get("ctx-agent")) is not None
                       and r.state == "healthy", 10, what="ctx-agent healthy")  # fmt: skip
        code, out, err = await reach("route", "echo", "--json", env={**env, "NATS_CONTEXT": "ops"})
        assert code == 0, err
        assert [c["agent_id"] for c in json.loads(out)["candidates"]] == ["ctx-agent"]
        code, out, err = await reach("route", "echo", "--context", "ops", "--json", env=env)
        assert code == 0, err
        assert [c["agent_id"] for c in json.loads(out)["candidates"]] == ["ctx-agent"]
        async with reach_agent.Client() as client:
            assert await client.call("echo", {"n": 1}, timeout=10) == {
                "by": "ctx-agent", "echo": {"n": 1}
            }  # fmt: skip
    finally:
        await agent.stop(grace=1)


async def test_the_selected_context_applies_when_none_is_named(
    broker_on_secured: tuple[NatsServer, Broker], home: Path
) -> None:
    (home / ".config" / "nats" / "context.txt").write_text("ops\n")
    code, out, err = await reach("agents", "--json", env={"HOME": str(home)})
    assert code == 0, err
    assert json.loads(out) == []


async def test_nats_variables_and_explicit_values_win_over_the_context(
    broker_on_secured: tuple[NatsServer, Broker], home: Path
) -> None:
    env = {"HOME": str(home), "NATS_CONTEXT": "ops"}
    code, _, err = await reach("route", "echo", env={**env, "NATS_PASSWORD": "wrong"})
    assert code == 3 and "authorization violation" in err, err
    code, _, err = await reach("route", "echo", "--server", "nats://127.0.0.1:1", env=env)
    assert code == 3 and "nats://127.0.0.1:1: connection refused" in err, err


def test_context_fields_fill_only_what_is_unset(home: Path) -> None:
    save_context(home, "prod", {"url": "nats://a:4222,nats://b:4222", "user": "u",
                                "password": "p", "inbox_prefix": "_INBOX.prod"})  # fmt: skip
    opts = connect_options("x", credentials=Credentials(context="prod"), env={"HOME": str(home)})
    assert opts["servers"] == ["nats://a:4222", "nats://b:4222"]
    assert (opts["user"], opts["password"], opts["inbox_prefix"]) == ("u", "p", "_INBOX.prod")
    env = {"HOME": str(home), "NATS_CONTEXT": "prod", "NATS_URL": "nats://c:4222",
           "NATS_USER": "v", "NATS_PASSWORD": "q"}  # fmt: skip
    opts = connect_options("x", env=env)
    assert (opts["servers"], opts["user"], opts["password"]) == (["nats://c:4222"], "v", "q")
    opts = connect_options("x", "nats://d:4222", Credentials(user="w"), env=env)
    # An explicit user takes its password from where it is set (here: NATS_PASSWORD), never
    # from the context.
    assert (opts["servers"], opts["user"], opts["password"]) == (["nats://d:4222"], "w", "q")
    # context="": none, not even NATS_CONTEXT's.
    opts = connect_options("x", credentials=Credentials(context=""), env=env)
    assert "inbox_prefix" not in opts and opts["user"] == "v"
    assert load_context("prod", {"HOME": str(home)}) == NatsContext(
        description="the prod servers", url="nats://a:4222,nats://b:4222", user="u",
        password="p", inbox_prefix="_INBOX.prod",
    )  # fmt: skip


def test_xdg_config_home_is_where_contexts_live(tmp_path: Path) -> None:
    xdg = tmp_path / "xdg"
    (xdg / "nats" / "context").mkdir(parents=True)
    (xdg / "nats" / "context" / "x.json").write_text('{"url": "nats://x:4222"}')
    (xdg / "nats" / "context.txt").write_text("x")
    assert connect_options("x", env={"XDG_CONFIG_HOME": str(xdg)})["servers"] == ["nats://x:4222"]


async def test_an_unknown_context_is_one_clear_line(home: Path) -> None:
    path = home / ".config" / "nats" / "context" / "nope.json"
    code, out, err = await reach("route", "echo", "--context", "nope", env={"HOME": str(home)})
    assert (code, out) == (2, "")
    assert err == (f"reach: NATS context 'nope' not found: no file {path} (set by the context "
                   "option, --context or NATS_CONTEXT)\n")  # fmt: skip
    with pytest.raises(ValueError, match="NATS context 'nope' not found"):
        reach_agent.Client(context="nope")
    with pytest.raises(ValueError, match="NATS context 'nope' not found"):
        echo_agent("a", context="nope")


def test_reach_broker_with_a_context_connects_instead_of_embedding(home: Path) -> None:
    from reach_broker import process
    from reach_broker.config import Config

    save_context(home, "ops", {"url": "nats://10.0.0.1:4222", "user": USER})
    cfg = Config()
    cfg.nats.context = "ops"
    process._use_context(cfg)
    assert (cfg.nats.url, cfg.nats.context) == ("nats://10.0.0.1:4222", "ops")
    (home / ".config" / "nats" / "context.txt").write_text("ops")
    cfg = Config()  # the selected context alone: the embedded server, with no context
    process._use_context(cfg)
    assert (cfg.nats.url, cfg.nats.context) == (None, "")
