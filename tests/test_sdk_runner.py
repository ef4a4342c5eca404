"""An agent process's first minute: one clear error for an unusable ack directory, and
``reach_agent.run``'s own log lines unless the application configured logging."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import sys
from pathlib import Path

import pytest

import reach_agent
from reach_agent.agent.runner import SDK_LOGGERS, default_logging
from reach_broker.broker import Broker
from reach_broker.cluster.natsserver import NatsServer
from reach_broker.service.metrics import Metrics

from .agents.procs import AgentProcess
from .conftest import fast_config, wait_for


def agent(**kw: object) -> reach_agent.Agent:
    a = reach_agent.Agent("alpha", capabilities=["text_processing"], **kw)  # type: ignore[arg-type]

    @a.handler("text_processing")
    async def echo(task: reach_agent.Task) -> object:
        return task.payload

    return a


def a_file(tmp_path: Path) -> Path:
    f = tmp_path / "not-a-dir"
    f.write_text("")
    return f


# --- the ack write-ahead directory ------------------------------------------------------------


async def test_unusable_ack_wal_dir_argument_is_one_error_naming_it(
    nats_server: NatsServer, tmp_path: Path
) -> None:
    path = str(a_file(tmp_path) / "acks")
    a = agent(ack_wal_dir=path)
    with pytest.raises(ValueError) as exc:
        await a.start(nats_server.url)
    assert str(exc.value) == (
        f"agent 'alpha': the ack write-ahead directory {path!r} cannot be created (Not a "
        "directory); it comes from the Agent argument ack_wal_dir. Set REACH_ACK_DIR or the "
        "Agent argument ack_wal_dir to a writable directory (or pass durable_acks=False)."
    )
    assert a.nc is None  # refused before connecting


async def test_unusable_reach_ack_dir_is_one_error_naming_the_setting(
    nats_server: NatsServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    base = str(a_file(tmp_path))
    monkeypatch.setenv("REACH_ACK_DIR", base)
    with pytest.raises(ValueError) as exc:
        await agent().start(nats_server.url)
    assert str(exc.value) == (
        f"agent 'alpha': the ack write-ahead directory {base + '/alpha'!r} cannot be created "
        f"(Not a directory); it comes from REACH_ACK_DIR={base!r} (as "
        "$REACH_ACK_DIR/<agent_id>). Set REACH_ACK_DIR or the Agent argument ack_wal_dir to a "
        "writable directory (or pass durable_acks=False)."
    )


async def test_homeless_default_ack_dir_is_one_error(
    nats_server: NatsServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The Docker image's user without a home: ~/.cache/reach cannot be created."""
    home = a_file(tmp_path)
    monkeypatch.delenv("REACH_ACK_DIR")
    monkeypatch.setenv("HOME", str(home))
    with pytest.raises(ValueError) as exc:
        await agent().start(nats_server.url)
    path = f"{home}/.cache/reach/alpha"
    assert str(exc.value).startswith(
        f"agent 'alpha': the ack write-ahead directory {path!r} cannot be created (Not a "
        "directory); it comes from the default ~/.cache/reach/<agent_id> (REACH_ACK_DIR is "
        "not set). Set REACH_ACK_DIR"
    )


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into any directory")
async def test_read_only_ack_dir_is_one_error(nats_server: NatsServer, tmp_path: Path) -> None:
    ro = tmp_path / "ro"
    ro.mkdir(mode=0o500)
    with pytest.raises(ValueError) as exc:
        await agent(ack_wal_dir=str(ro)).start(nats_server.url)
    assert f"the ack write-ahead directory {str(ro)!r} is not writable;" in str(exc.value)


async def test_without_durable_acks_no_directory_is_needed(
    nats_server: NatsServer, tmp_path: Path
) -> None:
    a = agent(ack_wal_dir=str(a_file(tmp_path) / "acks"), durable_acks=False)
    await a.start(nats_server.url)
    await a.stop(grace=0)


async def test_run_with_an_unusable_ack_dir_exits_with_one_error(
    nats_server: NatsServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before: the PermissionError/OSError of the WAL was retried as a connect failure,
    for ever. Now the process ends at once with the one error."""
    base = str(a_file(tmp_path))
    monkeypatch.setenv("REACH_ACK_DIR", base)
    proc = AgentProcess("design_agent.py", nats_server.url, log_path=tmp_path / "alpha.err")
    try:
        assert await asyncio.to_thread(proc.wait, 20) == 1
    finally:
        proc.stop()
    lines = proc.output().splitlines()
    assert lines[-1] == (
        f"ValueError: agent 'alpha': the ack write-ahead directory {base + '/alpha'!r} cannot "
        f"be created (Not a directory); it comes from REACH_ACK_DIR={base!r} (as "
        "$REACH_ACK_DIR/<agent_id>). Set REACH_ACK_DIR or the Agent argument ack_wal_dir to a "
        "writable directory (or pass durable_acks=False)."
    )
    assert [line for line in lines if line.startswith("ValueError")] == [lines[-1]]
    assert [line for line in lines if "connect_failed" in line] == []


# --- run()'s logging ------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def test_run_logs_announced_disconnected_reconnected_and_draining(tmp_path: Path) -> None:
    port = free_port()
    server = NatsServer(port=port, store_dir=tmp_path / "nats")
    server.start()
    broker = Broker(fast_config(server.url), metrics=Metrics())
    proc: AgentProcess | None = None
    try:
        await broker.start()
        proc = AgentProcess("design_agent.py", server.url, log_path=tmp_path / "alpha.err")
        p = proc

        def said(event: str) -> list[str]:
            return [line.split(" ", 4)[-1] for line in p.output().splitlines()
                    if f" INFO reach_agent.{event}" in line]  # fmt: skip

        await wait_for(lambda: said("agent.presence agent.announced"), 20, what="announced line")
        assert said("agent.presence agent.announced") == [
            f"agent.announced agent=alpha broker={broker.broker_id}"
        ]
        await asyncio.to_thread(server.stop)
        await wait_for(lambda: said("agent.connwatch agent.disconnected"), 10, what="disconnected")
        await asyncio.to_thread(server.start)
        await wait_for(lambda: said("agent.connwatch agent.reconnected"), 20, what="reconnected")
        assert said("agent.connwatch agent.reconnected") == [
            "agent.reconnected agent=alpha: re-announcing"
        ]
        await wait_for(lambda: len(said("agent.presence agent.announced")) == 2, 20, what="again")
        proc.signal(signal.SIGTERM)
        assert await asyncio.to_thread(proc.wait, 20) == 0, proc.output()
        assert said("agent.runner agent.signal") == ["agent.signal agent=alpha: draining"]
        assert said("agent.connwatch agent.disconnected") == ["agent.disconnected agent=alpha"]
        # Each line: "<date> <time> INFO <logger> <event> ...", the first the claims store's.
        first = proc.output().splitlines()[0].split(" ")
        assert first[2:5] == ["INFO", "reach_agent.agent.claiming", "claims.on"]
    finally:
        if proc is not None:
            proc.stop()
        await broker.stop()
        server.stop()


async def test_run_leaves_the_applications_logging_alone(
    nats_server: NatsServer, tmp_path: Path
) -> None:
    broker = Broker(fast_config(nats_server.url), metrics=Metrics())
    await broker.start()
    proc = AgentProcess("app_logging_agent.py", nats_server.url, log_path=tmp_path / "app.err")
    try:
        await wait_for(lambda: "alpha" in broker.registry.agents, 20, what="alpha registered")
        proc.signal(signal.SIGTERM)
        assert await asyncio.to_thread(proc.wait, 20) == 0, proc.output()
    finally:
        proc.stop()
        await broker.stop()
    assert proc.output() == ""  # WARNING and up, in the app's format: nothing to say


def test_default_logging_is_installed_only_without_any_and_undone() -> None:
    loggers = [logging.getLogger(name) for name in SDK_LOGGERS]
    before = [(lg.level, list(lg.handlers)) for lg in loggers]
    # pytest's capture handlers sit on the root logger: logging counts as configured.
    assert default_logging() is None
    assert [(lg.level, list(lg.handlers)) for lg in loggers] == before
    root = logging.getLogger()
    kept = list(root.handlers)
    try:
        for h in kept:
            root.removeHandler(h)
        undo = default_logging()
        assert undo is not None
        assert [lg.level for lg in loggers] == [logging.INFO, logging.INFO]
        (handler,) = loggers[0].handlers
        assert loggers[1].handlers == [handler]
        assert isinstance(handler, logging.StreamHandler) and handler.stream is sys.stderr
        undo()
        assert [(lg.level, list(lg.handlers)) for lg in loggers] == before
    finally:
        for h in kept:
            root.addHandler(h)
