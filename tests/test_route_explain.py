"""``RouteRequest.explain`` on the wire and ``reach route --explain``: a real nats-server, an
in-process broker, raw agents."""

from __future__ import annotations

import json

from nats.aio.client import Client as NATS

from reach_broker.cluster.natsserver import NatsServer

from .conftest import BrokerFactory, wait_for
from .test_cli import QUIET, announce, reach


async def test_explained_route_on_the_wire_and_as_a_table(
    nats_server: NatsServer, nc: NATS, broker_factory: BrokerFactory
) -> None:
    broker = await broker_factory(**QUIET)
    await announce(nc, "alpha", ["summarize"], region="eu")
    await announce(nc, "beta", ["summarize"], region="us")
    await wait_for(lambda: broker.metrics.heartbeat_result["accepted"].value == 2,
                   what="two heartbeats")  # fmt: skip
    body = json.dumps({"region": "eu", "explain": True}).encode()
    reply = json.loads((await nc.request("reach.route.summarize", body, timeout=2)).data)
    (alpha,) = reply["candidates"]
    assert alpha["agent_id"] == "alpha"
    assert alpha["explain"]["terms"] == {"liveness": 1.0, "latency": 1.0, "load": 0.8,
                                         "success": 1.0, "stuck": 1.0,
                                         "delivery": 1.0}  # fmt: skip
    assert (alpha["explain"]["weakest"], alpha["explain"]["active"]) == ("load", 1)
    explain = reply["explain"]
    assert [(x["agent_id"], x["reason"], x["detail"]) for x in explain["excluded"]] == [
        ("beta", "region", "region 'us', the request asks 'eu'")
    ]
    assert (explain["members"], explain["healthy"], explain["counts"]) == (2, 2, {"region": 1})
    # The plain request is answered as before: no explain anywhere. (A peek: a plain route
    # would count a task handed to its pick, and the table below would show alpha 2/4 busy.)
    plain = (await nc.request("reach.route.summarize", b'{"peek": true}', timeout=2)).data
    assert b"explain" not in plain

    code, out, err = await reach("route", "summarize", "--explain", "--region", "eu",
                                 "-s", nats_server.url)  # fmt: skip
    assert (code, err) == (0, "")
    lines = out.splitlines()
    assert lines[0] == ("summarize: 2 agents, 2 healthy, 2 ranked, 0 ejected; choice weighted, "
                        "pool 1; min score 60, load watermark 0.85")  # fmt: skip
    assert lines[2].split() == ["#", "AGENT", "STATE", "SCORE", "ACTIVE", "WEIGHT", "SLOW",
                                "LIVE", "LAT", "LOAD", "SUCC", "STUCK", "WEAKEST", "RANK",
                                "KEPT"]  # fmt: skip
    assert lines[3].split()[:4] == ["1", "alpha", "healthy", "91.5"]
    assert lines[3].split()[4:] == ["1/4", "68.6", "1.00", "1.00", "1.00", "0.80", "1.00",
                                    "1.00", "load", "1", "-"]  # fmt: skip
    assert lines[5] == "left out: 1 (1 region)"
    assert lines[6].split() == ["AGENT", "STATE", "SCORE", "ACTIVE", "REASON", "DETAIL"]
    assert lines[7].split(maxsplit=5) == ["beta", "healthy", "91.5", "1/4", "region",
                                          "region 'us', the request asks 'eu'"]  # fmt: skip

    code, out, _ = await reach("route", "summarize", "--explain", "--json", "-s", nats_server.url)
    assert code == 0
    assert {c["agent_id"] for c in json.loads(out)["candidates"]} == {"alpha", "beta"}


async def test_nothing_reachable_is_the_error_with_its_explanation(
    nats_server: NatsServer, nc: NATS, broker_factory: BrokerFactory
) -> None:
    broker = await broker_factory(**QUIET)
    await announce(nc, "alpha", ["summarize"], region="eu")
    await wait_for(lambda: broker.metrics.heartbeat_result["accepted"].value == 1,
                   what="a heartbeat")  # fmt: skip
    code, out, err = await reach("route", "summarize", "--explain", "--exclude", "alpha",
                                 "-s", nats_server.url)  # fmt: skip
    assert code == 1
    assert err == ("reach: NO_REACHABLE_AGENT: no reachable agent for 'summarize' among 1: "
                   "1 filtered by exclude\n")  # fmt: skip
    assert out.splitlines()[2] == "left out: 1 (1 exclude)"
    assert out.splitlines()[4].split(maxsplit=5)[4:] == [
        "exclude",
        "named in the request's exclude",
    ]
    code, out, _ = await reach("route", "summarize", "--explain", "--exclude", "alpha", "--json",
                               "-s", nats_server.url)  # fmt: skip
    data = json.loads(out)
    assert data["error"]["code"] == "NO_REACHABLE_AGENT"
    assert [x["reason"] for x in data["explain"]["excluded"]] == ["exclude"]


def test_the_route_cost_tool_times_every_kind_of_request() -> None:
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-m", "loadtest.routecost", "--agents", "3", "--rounds", "1",
         "--batch", "20"],
        capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    figures = json.loads(out.stdout)
    assert figures["agents"] == 3
    assert set(figures["us_per_request"]) == {"plain", "filtered", "peek", "explain", "rules",
                                              "quota", "rules_quota", "merged",
                                              "single"}  # fmt: skip
    assert isinstance(figures["plain_over_peek"], float)
    assert isinstance(figures["explain_over_plain"], float)  # a timing: its size is not tested
    assert isinstance(figures["rules_quota_over_plain"], float)
    assert isinstance(figures["merged_over_plain"], float)
