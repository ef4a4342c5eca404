"""A request id runs once across the fleet: claims in KV ``reach_claims``, real servers.

The decision is pure (:func:`reach_agent.agent.claiming.decide`); the rest runs against a real
nats-server and broker, with in-process agents where nothing crashes and agent processes
(``tests/agents/worker.py``, which log every handler start) where one is stalled or killed.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import signal
import time
import uuid
from pathlib import Path
from typing import Any

import msgspec
import nats
import pytest
from nats.aio.client import Client as NATS
from nats.js.errors import ServiceUnavailableError

import reach_agent
from jetstream import ackreads, acks, compensation
from jetstream.acks import ack_msg_id, publish_record
from jetstream.claims import (
    ClaimStore,
    ClaimsUnavailable,
    NoClaimsBucket,
    NoClaimsLeader,
    Stored,
    claim_key,
)
from jetstream.names import ACK_STREAM, CLAIMS_BUCKET, CLAIMS_STREAM, H_REQUEST_ID
from jetstream.provision import load_definitions, provision
from loadtest.tcpproxy import TcpProxy
from reach_agent import ClientConfig
from reach_agent.agent.claiming import Claimer, decide
from reach_agent.agent.dedup import DedupCache
from reach_agent.agent.handling import kind_of
from reach_agent.agent.serving import TaskServer
from reach_agent.aio import stop_loops
from reach_agent.connection import flush_subscriptions
from reach_agent.results import ended_by_record
from reach_agent.wire import schema
from reach_agent.wire.errors import from_reply
from reach_agent.wire.schema import decode_ack_record
from reach_agent.wire.subjects import Subjects
from reach_broker.broker import Broker
from reach_broker.cluster.natsserver import NatsServer
from reach_broker.service.metrics import Metrics

from .cluster import nats_cluster
from .conftest import fast_config, wait_for
from .test_sdk_failover import EventLog, healthy, lines, worker

SUBJECTS = Subjects("reach")

# --- the decision ---------------------------------------------------------------------------


def claim(state: schema.ClaimState, agent: str = "alpha", instance: str = "i1") -> schema.Claim:
    return schema.Claim(request_id="r", agent_id=agent, instance=instance, capability="cap",
                        state=state, at_ms=1)  # fmt: skip


def test_a_stored_claim_means_wait_answer_or_take_over() -> None:
    me = {"agent_id": "alpha", "instance": "i1"}
    assert decide(claim("running", "beta", "i9"), **me) == "in_progress"
    # ours, this very process: a create that landed while its answer was lost (this process
    # runs nothing under the id: a copy of a task it runs never reaches the claim)
    assert decide(claim("running", "alpha", "i1"), **me) == "take_over"
    assert decide(claim("running", "alpha", "i0"), **me) == "take_over"  # our dead predecessor
    assert decide(claim("released", "beta", "i9"), **me) == "take_over"
    assert decide(claim("completed", "beta", "i9"), **me) == "stored"
    assert decide(claim("failed", "alpha", "i0"), **me) == "stored"


def test_every_request_id_has_one_key_and_the_bucket_lives_as_long_as_the_acks() -> None:
    uuid4 = "0b7c1c4e-4a55-4f43-9d55-1d6f3f1f0c2a"
    assert claim_key(uuid4) == uuid4
    assert claim_key("a b/c") == claim_key("a b/c") != claim_key("a b/d")
    assert claim_key("a b/c").startswith("h-") and len(claim_key("a b/c")) == 34
    defs = {d["name"]: d for d in load_definitions(overrides={"REACH_ACKS": {"max_age": 7}})}
    assert defs["KV_reach_claims"]["max_age"] == 7
    assert {d["name"]: d for d in load_definitions()}["KV_reach_claims"]["max_age"] == 86400 * 10**9


async def test_the_claim_store_creates_once_and_changes_only_by_revision(
    nc: NATS, broker: Broker
) -> None:
    store = ClaimStore(nc)
    assert await store.exists() is True
    created, mine = await store.create("k1", b'{"v":1}')
    assert created is True
    again, theirs = await store.create("k1", b'{"v":2}')
    assert (again, theirs) == (False, mine)
    assert await store.swap("k1", b'{"v":3}', mine.revision - 1) is None  # a stale revision
    revision = await store.swap("k1", b'{"v":3}', mine.revision)
    assert revision is not None and revision > mine.revision
    stored = await store.get("k1")
    assert stored is not None and (stored.revision, stored.data) == (revision, b'{"v":3}')
    assert await store.get("k2") is None


def unclaimed(answer: tuple[str, Any] | None) -> reach_agent.ReachError:
    """The refusal a :meth:`Claimer.take` answered (labelled ``unclaimed``)."""
    assert answer is not None and answer[0] == "unclaimed", answer
    headers, body = answer[1]
    assert headers[H_REQUEST_ID] == "r-unclaimed"
    err = from_reply(headers, body)
    assert isinstance(err, reach_agent.StoreUnavailable)
    assert (err.code, err.retryable, err.retry_after_ms) == ("STORE_UNAVAILABLE", True, 500)
    return err


async def test_a_claim_nobody_took_for_want_of_a_bucket_says_the_bucket_is_missing(
    nc: NATS, plain_server: str, caplog: pytest.LogCaptureFixture
) -> None:
    store = ClaimStore(nc)  # a server with JetStream, no broker: no reach_claims bucket
    with pytest.raises(NoClaimsBucket) as caught:
        await store.create("k1", b"{}")
    missing = "no reach_claims bucket on this server (stream not found)"
    assert str(caught.value) == f"no stream stores $KV.reach_claims.k1: {missing}"
    confirm = await store.swap_soon("k1", b"{}", 1)  # answered by a 503
    with pytest.raises(NoClaimsBucket) as caught:
        await confirm()
    assert str(caught.value) == f"no stream stores $KV.reach_claims.k1: {missing}"
    with pytest.raises(NoClaimsBucket) as caught:
        await store.get("k1")
    assert str(caught.value) == "no reach_claims bucket: stream not found"

    caplog.set_level(logging.WARNING, logger="reach_agent.agent.claiming")
    metrics = reach_agent.AgentMetrics()
    claimer = Claimer(nc, "nobucket", "i1", SUBJECTS, metrics=metrics, store=store)
    held, answer = await claimer.take("r-unclaimed", "cap")
    assert held is None
    err = unclaimed(answer)
    assert err.message == (
        "agent 'nobucket' did not run request_id 'r-unclaimed': the claims bucket "
        "'reach_claims' does not exist on this server (no JetStream, or no reach broker has "
        "provisioned it yet); a claimed capability never runs unclaimed: ask again"
    )
    assert len(claimer._watching) == 0  # nobody took the create: nothing to look for
    assert metrics.store_errors.labels("claims", "claim")._value.get() == 1
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("claims.")]
    assert len(said) == 1, said
    assert said[0].startswith("claims.unavailable agent=nobucket bucket=reach_claims error=no "
                              f"stream stores $KV.reach_claims.{claim_key('r-unclaimed')}: "
                              f"{missing} refused_since_last_warning=1: ")  # fmt: skip
    assert said[0].endswith(
        "never run unclaimed; run nats-server with JetStream (-js) and start `reach broker` "
        "against it (the broker creates 'reach_claims'), or mark capabilities whose duplicates "
        "are harmless idempotent"
    )

    plain = None  # and a server without JetStream at all
    for _ in range(200):
        with contextlib.suppress(Exception):
            plain = await nats.connect(plain_server, connect_timeout=1, allow_reconnect=False)
            break
        await asyncio.sleep(0.05)
    assert plain is not None
    try:
        with pytest.raises(NoClaimsBucket) as caught:
            await ClaimStore(plain).create("k1", b"{}")
        assert str(caught.value) == (
            "no stream stores $KV.reach_claims.k1: no JetStream on this server (nothing answers "
            "STREAM.INFO KV_reach_claims)"
        )
    finally:
        await plain.close()


async def test_a_store_that_flaps_is_said_back_once_for_each_outage_said(
    nc: NATS, caplog: pytest.LogCaptureFixture
) -> None:
    """Nemesis seed 33: an agent whose claims store flapped logged ``claims.available`` 30
    times in 5 s, though its ``claims.unavailable`` warnings are said at most every 30 s. The
    recovery is now said once for each outage said: a refusal within the 30 s says nothing,
    and neither does the answer after it."""
    caplog.set_level(logging.INFO, logger="reach_agent.agent.claiming")
    claims_def = load_definitions(names=(CLAIMS_STREAM,))
    claimer = Claimer(nc, "flappy", "i1", SUBJECTS, store=ClaimStore(nc))
    js = nc.jetstream()
    for n in range(3):  # gone, back; gone, back; gone, back
        held, answer = await claimer.take(f"r-down-{n}", "cap")
        assert held is None and answer is not None and answer[0] == "unclaimed"
        await provision(nc, claims_def)
        held, _ = await claimer.take(f"r-up-{n}", "cap")
        assert held is not None
        await js.delete_stream(CLAIMS_STREAM)
    said = [r.getMessage().split(" agent=")[0] for r in caplog.records
            if r.getMessage().startswith("claims.")]  # fmt: skip
    assert said == ["claims.unavailable", "claims.available"]
    assert claimer.refused == 3


@pytest.mark.slow
async def test_a_claims_stream_without_a_leader_is_not_taken_for_a_missing_bucket(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Two of its three replicas gone, the bucket's stream cannot elect a leader: a write meets
    "no responders" as on a server without the bucket, but the store, the refusal and the log
    say that JetStream is electing a leader, never that the bucket is missing."""
    defs = load_definitions(overrides={CLAIMS_STREAM: {"num_replicas": 3}})
    async with nats_cluster(tmp_path / "cluster", nodes=3) as cluster:
        await cluster.wait_meta_leader()
        nc = await nats.connect(cluster.urls, name="claims-leader")
        try:
            await provision(nc, [d for d in defs if d["name"] == CLAIMS_STREAM])
            leader = await cluster.wait_stream_leader(nc, CLAIMS_STREAM, current=True)
        finally:
            await nc.close()
        survivor, follower = [name for name in cluster.names if name != leader]
        await cluster.kill(follower)  # the leader keeps its majority: no election before
        await cluster.kill(leader)  # and the survivor alone cannot elect itself
        nc = await nats.connect(cluster.url(survivor), name="claims-leaderless",
                                allow_reconnect=False)  # fmt: skip
        try:
            store = ClaimStore(nc)
            electing = "; most likely JetStream electing a leader (a node died or restarted)"
            with pytest.raises(NoClaimsLeader) as caught:
                await store.create("k1", b"{}")
            said = str(caught.value)
            assert said.startswith("no stream took $KV.reach_claims.k1: "), said
            assert said.endswith(f"{electing}; nothing was stored"), said
            confirm = await store.swap_soon("k1", b"{}", 1)  # answered by a 503
            with pytest.raises(NoClaimsLeader) as caught:
                await confirm()
            assert str(caught.value).endswith(f"{electing}; nothing was stored")

            caplog.set_level(logging.WARNING, logger="reach_agent.agent.claiming")
            metrics = reach_agent.AgentMetrics()
            claimer = Claimer(nc, "electing", "i1", SUBJECTS, metrics=metrics, store=store)
            held, answer = await claimer.take("r-unclaimed", "cap")
            assert held is None
            err = unclaimed(answer)
            key = claim_key("r-unclaimed")
            assert err.message.startswith(
                "agent 'electing' did not run request_id 'r-unclaimed': the claims bucket "
                f"'reach_claims' is not taking claims right now (no stream took "
                f"$KV.reach_claims.{key}: "
            ), err.message
            assert err.message.endswith(f"{electing}; nothing was stored); a claimed capability "
                                        "never runs unclaimed: ask again")  # fmt: skip
            assert len(claimer._watching) == 0  # nobody took the create: nothing to look for
            assert metrics.store_errors.labels("claims", "claim")._value.get() == 1
            logged = [r.getMessage() for r in caplog.records
                      if r.getMessage().startswith("claims.")]  # fmt: skip
            assert len(logged) == 1, logged
            assert logged[0].startswith(
                "claims.unavailable agent=electing bucket=reach_claims error=no stream took "
                f"$KV.reach_claims.{key}: "
            ), logged[0]
            assert logged[0].endswith(
                "never run unclaimed; the bucket needs no creating: most likely JetStream is "
                "electing a leader for KV_reach_claims (a node died or restarted) and callers "
                "ask again; if this lasts, bring the cluster's nodes back (the stream needs a "
                "majority of its replicas up)"
            ), logged[0]
        finally:
            await nc.close()


# --- in-process agents ----------------------------------------------------------------------


def slow_agent(agent_id: str, cap: str, runs: list[tuple[str, str]], sleep: float = 0.0,
               **kw: Any) -> reach_agent.Agent:  # fmt: skip
    agent = reach_agent.Agent(agent_id, [cap], heartbeat_interval=0.1,
                              tags={"slot": agent_id}, **kw)  # fmt: skip

    @agent.handler(cap)
    async def handle(task: reach_agent.Task) -> dict[str, Any]:
        runs.append((agent_id, task.request_id))
        await asyncio.sleep(sleep)
        return {"agent": agent_id, "n": (task.payload or {}).get("n")}

    return agent


async def stored_claim(nc: NATS, request_id: str) -> schema.Claim | None:
    stored = await ClaimStore(nc).get(claim_key(request_id))
    return None if stored is None else schema.claim_decoder.decode(stored.data)


async def dead_process_claim(nc: NATS, agent_id: str, capability: str) -> str:
    """A request id whose claim ``agent_id``'s previous process left ``running`` (it died
    before running it, and no broker released the claim)."""
    orphan = str(uuid.uuid4())
    dead = schema.Claim(request_id=orphan, agent_id=agent_id, instance="dead-process",
                        capability=capability, state="running", at_ms=1,
                        ack_subject=SUBJECTS.ack(agent_id, orphan))  # fmt: skip
    assert (await ClaimStore(nc).create(claim_key(orphan), schema.encoder.encode(dead)))[0]
    return orphan


async def running_on(
    nc: NATS, agent_id: str, capability: str, body: bytes, runs: list[tuple[str, str]]
) -> tuple[str, asyncio.Task[Any]]:
    """A new request sent straight to ``agent_id`` and running there (its id, and the task
    awaiting its reply)."""
    rid = str(uuid.uuid4())
    direct = nc.request(SUBJECTS.task(agent_id, capability), body,
                        headers={H_REQUEST_ID: rid}, timeout=10)  # fmt: skip
    first = asyncio.create_task(direct)
    await wait_for(lambda: (agent_id, rid) in runs, 5, what=f"running on {agent_id}")
    return rid, first


async def ended_by(nc: NATS, request_id: str) -> tuple[str, str, str]:
    """(holder, claim state, the author of the completed record that ends the claim) once
    that record is stored (at most 10 s): an SDK agent's completed record of a claimed run is
    the claim's end, and the claim stays ``running`` (docs/protocol.md, Claims)."""
    claim = await stored_claim(nc, request_id)
    assert claim is not None
    subject = Subjects("reach").ack(claim.agent_id, request_id)
    await ackreads.wait_final_at(nc, subject, 10, subjects=Subjects("reach"))
    found = await ended_by_record(nc, claim, Subjects("reach"))
    assert found is not None, f"no completed record of {claim.agent_id} ends {request_id}"
    return claim.agent_id, claim.state, found.agent_id


async def claim_becomes(nc: NATS, request_id: str, state: str, limit_s: float = 15.0
                        ) -> schema.Claim:  # fmt: skip
    """The request id's claim once it is in ``state`` (read every 50 ms, at most
    ``limit_s``)."""
    deadline = time.monotonic() + limit_s
    while True:
        claim = await stored_claim(nc, request_id)
        if claim is not None and claim.state == state:
            return claim
        assert time.monotonic() < deadline, f"claim of {request_id} is {claim}, not {state}"
        await asyncio.sleep(0.05)


async def test_one_request_id_sent_to_two_agents_at_once_runs_once_and_both_get_its_result(
    nats_server: NatsServer, broker: Broker, agents: Any, nc: NATS
) -> None:
    runs: list[tuple[str, str]] = []
    await agents(slow_agent("twin-a", "book", runs, sleep=0.5))
    await agents(slow_agent("twin-b", "book", runs, sleep=0.5))
    await wait_for(lambda: healthy(broker, "twin-a") and healthy(broker, "twin-b"))
    rid = str(uuid.uuid4())
    async with (
        reach_agent.Client(nats_server.url) as one,
        reach_agent.Client(nats_server.url) as other,
    ):
        results = await asyncio.wait_for(asyncio.gather(
            one.call("book", {"n": 1}, request_id=rid, tags={"slot": "twin-a"}, timeout=10),
            other.call("book", {"n": 1}, request_id=rid, tags={"slot": "twin-b"}, timeout=10),
        ), 15)  # fmt: skip
    assert len(runs) == 1
    holder = runs[0][0]
    assert runs == [(holder, rid)]
    assert results == [{"agent": holder, "n": 1}, {"agent": holder, "n": 1}]
    stored = await stored_claim(nc, rid)
    assert stored is not None and stored.ack_subject == f"reach.ack.{holder}.{rid}"
    assert await ended_by(nc, rid) == (holder, "running", holder)


async def test_a_completed_record_ends_its_claim_for_repeats_releases_and_cancels(
    nats_server: NatsServer, broker: Broker, agents: Any, nc: NATS
) -> None:
    runs: list[tuple[str, str]] = []
    await agents(slow_agent("end-a", "file", runs))
    await agents(slow_agent("end-b", "file", runs))
    await wait_for(lambda: healthy(broker, "end-a") and healthy(broker, "end-b"))
    rid = str(uuid.uuid4())
    first = await nc.request("reach.task.end-a.file", b'{"n":2}', timeout=5,
                             headers={H_REQUEST_ID: rid})  # fmt: skip
    assert msgspec.json.decode(first.data) == {"agent": "end-a", "n": 2}
    assert await ended_by(nc, rid) == ("end-a", "running", "end-a")
    # Another agent answers the stored result: the record ended the claim.
    again = await nc.request("reach.task.end-b.file", b'{"n":2}', timeout=5,
                             headers={H_REQUEST_ID: rid})  # fmt: skip
    assert (again.headers or {}).get(schema.H_STATUS) == "completed"
    assert msgspec.json.decode(again.data) == {"agent": "end-a", "n": 2}
    assert runs == [("end-a", rid)]
    # The broker heard of the record: nothing of end-a's is left to release, and a release
    # of end-a (declared gone) leaves the finished claim alone.
    await wait_for(lambda: "end-a" not in broker.releaser._running, 10,
                   what="the releaser forgot the finished claim")  # fmt: skip
    assert broker.releaser.held_by("end-a") == []
    # As if it had not heard (a record published while it was down): the release reads it.
    claim = await stored_claim(nc, rid)
    assert claim is not None
    broker.releaser._running["end-a"] = {claim_key(rid): (1, claim)}
    broker.releaser._holder_of[claim_key(rid)] = "end-a"
    assert await broker.releaser.release("end-a", "a test") == 0
    assert broker.releaser.held_by("end-a") == []
    assert await ended_by(nc, rid) == ("end-a", "running", "end-a")
    # A cancel the broker settles (its holder named, so not asked) is too late.
    cancel = schema.Cancel(request_id=rid, reason="a test", holder="end-a")
    reply = await nc.request(Subjects("reach").cancel_broker, schema.encoder.encode(cancel),
                             timeout=5)  # fmt: skip
    answer = schema.cancel_reply_decoder.decode(reply.data)
    assert (answer.state, answer.agent_id) == ("finished", "end-a")
    assert await ended_by(nc, rid) == ("end-a", "running", "end-a")
    view = await broker.releaser.claim_of(rid)
    assert view is not None and (view.holder, view.state) == ("end-a", "completed")
    # A lookup that finds the record also ends the claim remembered as running (nemesis seed
    # 31: a record the ack watch missed had each later release read it again).
    broker.releaser._running["end-a"] = {claim_key(rid): (1, claim)}
    broker.releaser._holder_of[claim_key(rid)] = "end-a"
    view = await broker.releaser.claim_of(rid)
    assert view is not None and (view.holder, view.state) == ("end-a", "completed")
    assert broker.releaser.held_by("end-a") == []
    # Released after all (end-a declared offline while it still ran, then finished): the
    # record ends that claim too, so a replay removes its entry instead of giving it back.
    stored = await ClaimStore(nc).get(claim_key(rid))
    assert stored is not None
    released = msgspec.structs.replace(claim, state="released", reason="a test")
    assert await ClaimStore(nc).swap(claim_key(rid), schema.encoder.encode(released),
                                     stored.revision) is not None  # fmt: skip
    view = await broker.releaser.claim_of(rid)
    assert view is not None and (view.holder, view.state) == ("end-a", "completed")


async def test_an_idempotent_capability_runs_without_a_claim(
    nats_server: NatsServer, broker: Broker, agents: Any, nc: NATS
) -> None:
    runs: list[tuple[str, str]] = []
    await agents(slow_agent("idem-a", "lookup", runs, idempotent={"lookup"}))
    per_handler = reach_agent.Agent("idem-b", ["peek"], heartbeat_interval=0.1)

    @per_handler.handler("peek", idempotent=True)
    async def peek(task: reach_agent.Task) -> str:
        runs.append(("idem-b", task.request_id))
        return "seen"

    await agents(per_handler)
    await wait_for(lambda: healthy(broker, "idem-a") and healthy(broker, "idem-b"))
    async with reach_agent.Client(nats_server.url) as client:
        assert await client.call("lookup", {"n": 2}, request_id="idem-1") == {"agent": "idem-a",
                                                                               "n": 2}  # fmt: skip
        assert await client.call("peek", None, request_id="idem-2") == "seen"
    assert runs == [("idem-a", "idem-1"), ("idem-b", "idem-2")]
    assert await stored_claim(nc, "idem-1") is None
    assert await stored_claim(nc, "idem-2") is None
    with pytest.raises(reach_agent.InvalidRequest, match=r"idempotent \['nope'\] are not among"):
        reach_agent.Agent("idem-c", ["lookup"], idempotent={"nope"})


async def test_compensation_replay_of_a_completed_request_does_not_run_it_again(
    nats_server: NatsServer, broker: Broker, agents: Any, nc: NATS
) -> None:
    runs: list[tuple[str, str]] = []
    await agents(slow_agent("done-a", "bill", runs))
    await wait_for(lambda: healthy(broker, "done-a"))
    rid = str(uuid.uuid4())
    async with reach_agent.Client(nats_server.url) as client:
        first = await client.call("bill", {"n": 7}, request_id=rid, timeout=10)
        assert first == {"agent": "done-a", "n": 7}
        submitted = await client.submit("bill", {"n": 7}, request_id=rid)
        assert submitted == rid and submitted.duplicate is False
        await wait_for(
            lambda: broker.replayer.sender.claimed == 1, 10, what="the entry seen as claimed"
        )
        record = await client.wait(rid, timeout=5)
        # A replay that raced the broker's own check reaches another agent: it answers the
        # stored result and does not run the handler either.
        await agents(slow_agent("done-b", "bill", runs))
        await wait_for(lambda: healthy(broker, "done-b"))
        # The same body bytes as the SDK sent (a request id's body digest is of its bytes).
        raw = await nc.request("reach.task.done-b.bill", b'{"n":7}', timeout=5,
                               headers={H_REQUEST_ID: rid})  # fmt: skip
    assert (record.state, record.agent_id) == ("completed", "done-a")
    assert record.result == {"agent": "done-a", "n": 7}  # decoded, as wait() returns it
    assert (raw.headers or {}).get(schema.H_STATUS) == "completed"
    assert msgspec.json.decode(raw.data) == {"agent": "done-a", "n": 7}
    assert runs == [("done-a", rid)]
    assert (broker.replayer.sender.replayed, broker.replayer.sender.claimed) == (0, 1)
    assert broker.metrics.compensation_result["claimed"]._value.get() == 1


async def released_as_replaced(nc: NATS, caplog: pytest.LogCaptureFixture, orphan: str,
                               agent: reach_agent.Agent) -> None:  # fmt: skip
    """``orphan``'s claim, the dead process's, released for ``agent``'s new process."""
    aid = agent.agent_id
    claim = await claim_becomes(nc, orphan, "released")
    assert (claim.agent_id, claim.instance) == (aid, "dead-process")
    assert claim.reason == (
        f"claim of request {orphan} released: holder {aid!r} declared offline before "
        f"finishing (a new process of it announced (instance {agent.instance}))"
    )
    assert [r.getMessage() for r in caplog.records if "replaced_unseen" in r.getMessage()] == [
        f"announce.replaced_unseen agent={aid} instance={agent.instance} old=dead-process: "
        "its running claims are released"
    ]


async def test_a_restart_its_broker_never_knew_frees_its_dead_predecessors_claims(
    nats_server: NatsServer, broker: Broker, agents: Any, nc: NATS,
    caplog: pytest.LogCaptureFixture,
) -> None:  # fmt: skip
    """An agent's previous process died holding a claim, and the broker that owns the agent
    now never knew that process (it took the agent's partition, or restarted, after the
    death): the new process announces to a registry that does not know the agent. Claims of
    the agent id run under another instance, which answers no probe: taken as replaced, its
    claims are released. They stayed ``running`` for nobody until some later fault (nemesis
    seed 66: six claims of a2 for 11 s, six calls told TIMEOUT)."""
    caplog.set_level(logging.INFO, logger="reach_broker.service.identity")
    orphan = await dead_process_claim(nc, "phoenix", "ph.cap")
    await wait_for(lambda: broker.releaser.claiming("phoenix") == {"dead-process"},
                   what="the broker told of the running claim")  # fmt: skip
    assert "phoenix" not in broker.registry.agents
    agent = slow_agent("phoenix", "ph.cap", [])
    await agents(agent)
    await released_as_replaced(nc, caplog, orphan, agent)


async def test_a_dead_predecessors_claim_learnt_after_the_restart_is_released(
    nats_server: NatsServer, broker: Broker, agents: Any, nc: NATS,
    caplog: pytest.LogCaptureFixture,
) -> None:  # fmt: skip
    """The same, the other way round: the broker learns of the dead process's claim only
    after the new process announced (its read of the claims bucket behind: a restart, a
    takeover). A running claim of another process than the registry's, which answers no
    probe, is released the same way."""
    caplog.set_level(logging.INFO, logger="reach_broker.service.identity")
    agent = slow_agent("phoenix2", "ph2.cap", [])
    await agents(agent)
    await wait_for(lambda: healthy(broker, "phoenix2"))
    orphan = await dead_process_claim(nc, "phoenix2", "ph2.cap")
    await released_as_replaced(nc, caplog, orphan, agent)


async def test_a_replayed_entry_whose_claim_a_dead_process_left_is_taken_over_by_the_holder(
    nats_server: NatsServer, broker: Broker, agents: Any, nc: NATS,
    caplog: pytest.LogCaptureFixture,
) -> None:  # fmt: skip
    """A submitted request whose claim the holder's previous process left ``running``, while
    the broker cannot tell that process is gone (something still answers probes as it: the
    broker releases the claims of a process that answers none, see the test above) is sent
    to the holder itself, whose new process takes the claim over and runs it. It used to be
    held "running there" until the holder went offline for some other reason (nemesis seed
    46: 60 s). A holder that runs the request answers the copy from its duplicate window,
    and it runs once."""
    caplog.set_level(logging.INFO, logger="reach_broker.replay.replaysend")
    runs: list[tuple[str, str]] = []
    await agents(slow_agent("heir", "ledger6", runs, sleep=1.0))
    await wait_for(lambda: healthy(broker, "heir"))

    async def as_dead_process(msg: Any) -> None:
        reply = schema.ProbeReply(agent_id="heir", instance_id="dead-process")
        await nc.publish(msg.reply, schema.encoder.encode(reply))

    await nc.subscribe("reach.probe.heir", cb=as_dead_process)
    await flush_subscriptions(nc)
    orphan = await dead_process_claim(nc, "heir", "ledger6")
    async with reach_agent.Client(nats_server.url) as client:
        assert await client.submit("ledger6", {"n": 8}, request_id=orphan) == orphan
        record = await client.wait(orphan, timeout=10)
        assert (record.state, record.agent_id) == ("completed", "heir")
        assert record.result == {"agent": "heir", "n": 8}
        stored = await stored_claim(nc, orphan)
        assert stored is not None and stored.instance != "dead-process"
        # Running on heir now (its own claim): the replay's copy is a duplicate.
        running, first = await running_on(nc, "heir", "ledger6", b'{"n":9}', runs)
        assert await client.submit("ledger6", {"n": 9}, request_id=running) == running
        record = await client.wait(running, timeout=10)
        assert body_of(await first) == {"agent": "heir", "n": 9}
    assert (record.state, record.agent_id) == ("completed", "heir")
    assert runs == [("heir", orphan), ("heir", running)]
    await wait_for(lambda: len(broker.replayer.taken) == 0, 5, what="both entries removed")
    assert broker.replayer.sender.replayed == 2
    asked = [m for r in caplog.records if (m := r.getMessage()).startswith("replay.ask_holder")]
    assert asked == [f"replay.ask_holder request_id={rid} holder=heir: its claim is running "
                     "there" for rid in (orphan, running)]  # fmt: skip


def refusal_of(reply: Any) -> reach_agent.ReachError | None:
    return from_reply(reply.headers, reply.data)


async def test_without_jetstream_a_claimed_task_is_refused_retryably_never_run_and_logged_once(
    plain_server: str, caplog: pytest.LogCaptureFixture
) -> None:
    url = plain_server
    runs: list[tuple[str, str]] = []
    metrics = reach_agent.AgentMetrics()
    agent = slow_agent("nojs", "plain", runs, durable_acks=False, metrics=metrics)
    nc = None
    for _ in range(200):
        with contextlib.suppress(Exception):
            nc = await nats.connect(url, connect_timeout=1, allow_reconnect=False)
            break
        await asyncio.sleep(0.05)
    assert nc is not None
    caplog.set_level(logging.WARNING, logger="reach_agent.agent.claiming")
    await agent.start(url)
    try:
        for _ in range(3):
            reply = await nc.request("reach.task.nojs.plain", b"{}", timeout=5,
                                     headers={H_REQUEST_ID: "same"})  # fmt: skip
            err = refusal_of(reply)
            assert isinstance(err, reach_agent.StoreUnavailable)
            assert (err.code, err.retryable, err.retry_after_ms) == ("STORE_UNAVAILABLE", True, 500)
            assert (reply.headers or {})["Nats-Service-Error-Code"] == "503"
            assert (reply.headers or {})[H_REQUEST_ID] == "same"
            assert "the claims bucket 'reach_claims' does not exist on this server" in err.message
    finally:
        await agent.stop(grace=1)
        await nc.close()
    assert runs == []
    assert metrics.store_errors.labels("claims", "claim")._value.get() == 3
    assert metrics.tasks.labels("plain", "unclaimed")._value.get() == 3
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("claims.")]
    assert len(said) == 1, said  # at start; the refusals within WARN_EVERY_S add no line
    assert said[0].startswith("claims.unavailable agent=nojs bucket=reach_claims")
    assert "never run unclaimed; run nats-server with JetStream (-js)" in said[0]


async def test_agents_started_before_the_broker_never_run_one_request_id_twice(
    nats_server: NatsServer, broker_factory: Any, agents: Any, nc: NATS
) -> None:
    runs: list[tuple[str, str]] = []
    release = asyncio.Event()
    early = {}
    for name in ("early-a", "early-b"):
        agent = reach_agent.Agent(name, ["early"], heartbeat_interval=0.1,
                                  metrics=reach_agent.AgentMetrics())  # fmt: skip

        @agent.handler("early")
        async def handle(task: reach_agent.Task, name: str = name) -> dict[str, Any]:
            runs.append((name, task.request_id))
            await release.wait()
            return {"agent": name}

        early[name] = await agents(agent)
    rid = str(uuid.uuid4())

    async def both() -> list[Any]:
        return [asyncio.ensure_future(nc.request(f"reach.task.{n}.early", b"{}", timeout=10,
                                                 headers={H_REQUEST_ID: rid}))
                for n in early]  # fmt: skip

    before = await asyncio.wait_for(asyncio.gather(*await both()), 10)
    assert [type(refusal_of(r)) for r in before] == [reach_agent.StoreUnavailable] * 2
    assert runs == []
    for agent in early.values():
        assert agent.metrics.store_errors.labels("claims", "claim")._value.get() == 1

    broker = await broker_factory()  # provisions reach_claims
    await wait_for(lambda: healthy(broker, "early-a") and healthy(broker, "early-b"))
    after = await both()
    await wait_for(lambda: len(runs) == 1 and any(f.done() for f in after), 10,
                   what="one run, and the other agent's answer")  # fmt: skip
    holder = runs[0][0]
    waiting = next(f for f in after if f.done())
    err = refusal_of(waiting.result())
    assert isinstance(err, reach_agent.InProgress) and err.holder == holder
    release.set()
    results = await asyncio.wait_for(asyncio.gather(*after), 10)
    assert [msgspec.json.decode(r.data) for r in results if refusal_of(r) is None] == [
        {"agent": holder}]  # fmt: skip
    again = await asyncio.wait_for(asyncio.gather(*await both()), 10)
    assert [msgspec.json.decode(r.data) for r in again] == [{"agent": holder}] * 2
    assert runs == [(holder, rid)]


async def test_an_sdk_call_refused_for_a_missing_bucket_is_asked_again_within_its_deadline(
    nats_server: NatsServer, broker: Broker, agents: Any, nc: NATS
) -> None:
    runs: list[tuple[str, str]] = []
    metrics = reach_agent.AgentMetrics()
    await agents(slow_agent("back-a", "back", runs, metrics=metrics))
    await wait_for(lambda: healthy(broker, "back-a"))
    await nc.jetstream().delete_stream("KV_reach_claims")  # the bucket is gone for a while
    refused = metrics.store_errors.labels("claims", "claim")._value.get
    rid = str(uuid.uuid4())
    async with reach_agent.Client(nats_server.url) as client:
        call = asyncio.ensure_future(client.call("back", {"n": 3}, request_id=rid, timeout=30))
        await wait_for(lambda: refused() >= 2, 10, what="the call asked again after a refusal")
        assert runs == [] and not call.done()
        claims_def = [d for d in load_definitions() if d["name"] == "KV_reach_claims"]
        await provision(nc, claims_def)
        assert await asyncio.wait_for(call, 30) == {"agent": "back-a", "n": 3}
    assert runs == [("back-a", rid)]
    assert await ended_by(nc, rid) == ("back-a", "running", "back-a")


async def test_a_claim_end_the_store_did_not_confirm_is_retried_until_stored(
    provisioned: NatsServer, nc: NATS, caplog: pytest.LogCaptureFixture
) -> None:
    release = asyncio.Event()
    agent = reach_agent.Agent("ender", ["end"], heartbeat_interval=0.1, claim_timeout=0.5,
                              durable_acks=False, metrics=reach_agent.AgentMetrics())  # fmt: skip

    @agent.handler("end")
    async def handle(task: reach_agent.Task) -> str:
        await release.wait()
        return "done"

    caplog.set_level(logging.INFO, logger="reach_agent.agent.claiming")
    async with TcpProxy.to_url(provisioned.url) as proxy:
        await agent.start(proxy.url)
        try:
            rid = str(uuid.uuid4())
            # No reply subject: a reply sent into the cut link is lost, which is not the point.
            await nc.publish("reach.task.ender.end", b"{}", headers={H_REQUEST_ID: rid})
            await wait_for(lambda: agent.active == 1, what="the run")
            running = await stored_claim(nc, rid)
            assert running is not None and running.state == "running"
            await proxy.cut()  # the agent's link drops: its claim's end is not confirmed
            release.set()
            claimer = agent.tasks.claimer
            assert claimer is not None
            await wait_for(lambda: claimer.end_retries >= 1, 10, what="the end retried")
            await proxy.restore()

            await claim_becomes(nc, rid, "completed")
            await wait_for(lambda: len(claimer._settling) == 0, 10, what="the retry done")
        finally:
            await agent.stop(grace=1)
    said = [r.getMessage() for r in caplog.records]
    assert any(m.startswith(f"claims.end_retrying request_id={rid} state=completed") for m in said)
    assert f"claims.end_stored request_id={rid} state=completed" in said
    assert agent.metrics is not None
    assert agent.metrics.store_errors.labels("claims", "end")._value.get() == claimer.end_retries


async def test_a_release_the_bucket_did_not_take_is_tried_again_until_it_is(
    nats_server: NatsServer, nc: NATS
) -> None:
    async with TcpProxy.to_url(nats_server.url) as proxy:
        broker = Broker(fast_config(proxy.url), metrics=Metrics())
        await broker.start()
        try:
            rid = str(uuid.uuid4())
            ghost = schema.Claim(request_id=rid, agent_id="ghost", instance="i1",
                                 capability="cap", state="running", at_ms=1)  # fmt: skip
            await ClaimStore(nc).create(claim_key(rid), schema.encoder.encode(ghost))
            await wait_for(lambda: broker.releaser.held_by("ghost") == [rid])
            await proxy.cut()  # the broker's link is down: its release cannot be stored
            failed = broker.metrics.store_errors.labels("claims", "release")._value.get
            assert await broker.releaser.release("ghost", "gone in a test") == 0
            assert failed() == 1
            await proxy.restore()

            await claim_becomes(nc, rid, "released")
            await wait_for(lambda: broker.releaser.released == 1, what="counted as released")
        finally:
            await broker.stop()


class LostAnswers(ClaimStore):
    """The real bucket, with answers lost: ``creates`` creates are stored and then reported
    unanswered (a PubAck lost in a leader election), ``gets`` reads fail."""

    def __init__(self, nc: NATS, *, creates: int, gets: int) -> None:
        super().__init__(nc)
        self.creates, self.gets = creates, gets

    async def create(self, key: str, data: bytes) -> tuple[bool, Stored]:
        result = await super().create(key, data)
        if self.creates:
            self.creates -= 1
            raise ClaimsUnavailable(f"JetStream did not confirm the claim {key!r} (test)")
        return result

    async def get(self, key: str) -> Stored | None:
        if self.gets:
            self.gets -= 1
            raise ClaimsUnavailable(f"JetStream did not return the claim {key!r} (test)")
        return await super().get(key)


class LateCreate(ClaimStore):
    """The real bucket, with the create of ``key`` reported unanswered at once and stored
    only once the agent has looked for it (a publish a cluster took before a leader election,
    committed after its answer was given up: nemesis seed 20)."""

    def __init__(self, nc: NATS, key: str) -> None:
        super().__init__(nc)
        self.key = key
        self.looked, self.landed = asyncio.Event(), asyncio.Event()
        self._landing: asyncio.Task[None] | None = None

    async def create(self, key: str, data: bytes) -> tuple[bool, Stored]:
        if key != self.key or self._landing is not None:
            return await super().create(key, data)
        self._landing = asyncio.create_task(self._land(key, data))
        raise ClaimsUnavailable(f"JetStream did not confirm the claim {key!r} (test)")

    async def _land(self, key: str, data: bytes) -> None:
        await self.looked.wait()
        await super().create(key, data)
        self.landed.set()

    async def get(self, key: str) -> Stored | None:
        got = await super().get(key)
        if key == self.key:
            self.looked.set()
        return got


class HeldCreate(ClaimStore):
    """The real bucket, but the create of ``key`` waits for ``gate``, then is refused (no
    answer: nothing stored) or stored, as ``refuse`` says."""

    def __init__(self, nc: NATS, key: str, *, refuse: bool) -> None:
        super().__init__(nc)
        self.key, self.refuse = key, refuse
        self.waiting, self.gate = asyncio.Event(), asyncio.Event()

    async def create(self, key: str, data: bytes) -> tuple[bool, Stored]:
        if key != self.key:
            return await super().create(key, data)
        self.waiting.set()
        await self.gate.wait()
        if self.refuse:
            raise ClaimsUnavailable(f"JetStream did not confirm the claim {key!r} (test)")
        return await super().create(key, data)


async def held_agent(
    nc: NATS, agent_id: str, rid: str, refuse: bool
) -> tuple[TaskServer, HeldCreate, list[str]]:
    """An agent serving ``cap`` on ``nc`` whose claim create of ``rid`` is held
    (:class:`HeldCreate`), and the request ids its handler ran."""
    runs: list[str] = []
    server = TaskServer(agent_id, 4, SUBJECTS, dedup=DedupCache(100, 60.0), metrics=None)

    async def handle(task: reach_agent.Task) -> dict[str, Any]:
        runs.append(task.request_id)
        return {"n": 1}

    server.handlers["cap"] = (handle, kind_of(handle))
    store = HeldCreate(nc, claim_key(rid), refuse=refuse)
    claimer = Claimer(nc, agent_id, "i1", SUBJECTS, store=store)
    await server.subscribe(nc, ["cap"], claimer=claimer, ack_sink=None)
    return server, store, runs


@pytest.mark.parametrize("refuse", [True, False])
async def test_a_copy_gets_its_receipt_only_once_the_first_copys_claim_is_taken(
    provisioned: NatsServer, nc: NATS, refuse: bool
) -> None:
    """A copy of a request whose first copy is still being claimed got its receipt at
    once; when that claim was then refused (STORE_UNAVAILABLE), a replay holding the copy
    as taken waited for a run that never came, then removed the entry unrun (found by
    loadtest.nemesis: three submits lost in a JetStream outage). The copy now waits for
    the claim: refused, it gets the refusal and no receipt; taken, the receipt and the
    result."""
    rid, later = str(uuid.uuid4()), str(uuid.uuid4())
    server, store, runs = await held_agent(nc, "dup", rid, refuse)
    caller = await nats.connect(provisioned.url)
    try:
        task = SUBJECTS.task("dup", "cap")
        copy = {schema.H_RECEIPT: "1", H_REQUEST_ID: rid}
        first = await caller.subscribe("_INBOX.first")
        second = await caller.subscribe("_INBOX.second")
        await caller.publish(task, b"{}", reply="_INBOX.first", headers=copy)
        await asyncio.wait_for(store.waiting.wait(), 5)
        await caller.publish(task, b"{}", reply="_INBOX.second", headers=copy)
        # A later task on the same subscription: once it is answered, the copy was handled
        # (one callback at a time, in order), and anything it sent came first.
        reply = await caller.request(task, b"{}", headers={H_REQUEST_ID: later}, timeout=5)
        assert msgspec.json.decode(reply.data) == {"n": 1}
        assert (first.pending_msgs, second.pending_msgs) == (0, 0)  # the claim is undecided
        store.gate.set()
        for sub in (first, second):
            got = [await sub.next_msg(timeout=5) for _ in range(1 if refuse else 2)]
            statuses = [(m.headers or {}).get(schema.H_STATUS) for m in got]
            if refuse:
                err = from_reply(got[0].headers, got[0].data)
                assert (statuses, err and err.code) == ([None], "STORE_UNAVAILABLE")
            else:
                assert statuses == ["received", "completed"]
                assert msgspec.json.decode(got[1].data) == {"n": 1}
        assert runs == ([later] if refuse else [later, rid])
    finally:
        await caller.close()
        await server.drain(1.0)


@pytest.mark.parametrize("refuse", [True, False])
async def test_a_cancel_while_the_run_takes_its_claim_is_unknown_until_the_claim_is_its_own(
    provisioned: NatsServer, nc: NATS, refuse: bool
) -> None:
    """A cancel that reaches a run still taking its claim answered ``cancelled``, though the
    claim might turn out another's or undecided, and then nothing durable said so (the asker
    settled nothing). It answers ``unknown`` (the asker has the brokers settle it); the run
    does not start: with the claim its own it ends ``CANCELLED``, claim and record behind it;
    refused, the cancel stays noted for the next copy. A run that never reaches its handler
    does not read its body (a malformed one ends it CANCELLED, not INVALID_REQUEST) and
    adds no task duration to the heartbeats' figures."""
    rid = str(uuid.uuid4())
    server, store, runs = await held_agent(nc, "cut", rid, refuse)
    caller = await nats.connect(provisioned.url)
    try:
        inbox = await caller.subscribe("_INBOX.cut")
        await caller.publish(SUBJECTS.task("cut", "cap"), b"{not json", reply="_INBOX.cut",
                             headers={H_REQUEST_ID: rid})  # fmt: skip
        await asyncio.wait_for(store.waiting.wait(), 5)
        assert server.cancel(rid, "a test") == "unknown"
        assert server.cancel(rid, "a test") == "unknown"  # asked again: still undecided
        store.gate.set()
        got = await inbox.next_msg(timeout=5)
        err = from_reply(got.headers, got.data)
        assert err is not None
        if refuse:
            assert err.code == "STORE_UNAVAILABLE"
            assert await stored_claim(nc, rid) is None
            entry = server.dedup.lookup(rid, time.monotonic())
            assert entry is not None and entry.remembered == "a test"  # the note stays
        else:
            assert (err.code, err.message) == (
                "CANCELLED",
                f"request_id {rid!r} was cancelled on agent 'cut': a test",
            )
            claim = await claim_becomes(nc, rid, "failed")
            assert (claim.agent_id, claim.reason) == ("cut", schema.CLAIM_CANCELLED)
            assert server.cancel(rid, "a test") == "cancelled"  # now it is durable
        assert (runs, server.load_figures()) == ([], (None, None))
    finally:
        await caller.close()
        await server.drain(1.0)


async def test_a_claim_stored_although_unconfirmed_is_run_or_released_never_left_running(
    provisioned: NatsServer, nc: NATS
) -> None:
    metrics = reach_agent.AgentMetrics()
    # Read back at once: the claim is ours, run it.
    ours = Claimer(nc, "lossy", "i1", SUBJECTS, store=LostAnswers(nc, creates=1, gets=0))
    claimed = await ours.claim("lost-1", "cap")
    assert claimed.held is not None and claimed.held.claim.instance == "i1"
    # Not readable either: refused, and released once it can be read.
    refusing = Claimer(nc, "lossy", "i2", SUBJECTS, metrics=metrics,
                       store=LostAnswers(nc, creates=1, gets=1))  # fmt: skip
    with pytest.raises(ClaimsUnavailable):
        await refusing.claim("lost-2", "cap")

    claim = await claim_becomes(nc, "lost-2", "released")
    assert claim.reason == "lossy refused the task: its claim was not confirmed"
    await wait_for(lambda: metrics.store_errors.labels("claims", "orphan")._value.get() == 1)
    await refusing.stop()
    # Another agent takes a released claim over.
    other = Claimer(nc, "other", "i3", SUBJECTS)
    assert (await other.claim("lost-2", "cap")).held is not None


async def test_a_predecessors_result_still_in_the_outbox_ends_its_claim(
    provisioned: NatsServer, nc: NATS
) -> None:
    """A process finished a run and died before its result was stored (the record waits in
    the durable acks' outbox, which its restart adopts); the restart is asked the same
    request: the record in its outbox ends the claim, and the request is not run again
    (nemesis seed 73: c3-001146 run again by a1's restart, the first result stored 1.2 s
    after the second run began). A record of another agent id, or one that does not end a
    claim, is not taken."""
    orphan = await dead_process_claim(nc, "heir2", "cap")
    done = schema.AckRecord(request_id=orphan, agent_id="heir2", capability="cap",
                            state="completed", at_ms=2, result=msgspec.Raw(b'{"n":1}'))  # fmt: skip
    outbox = {orphan: schema.encoder.encode(done)}
    claimer = Claimer(nc, "heir2", "i2", SUBJECTS, unsent=outbox.get)
    claimed = await claimer.claim(orphan, "cap")
    assert (claimed.held, claimed.verdict) == (None, "stored")
    assert claimed.record is not None and claimed.record.result == msgspec.Raw(b'{"n":1}')
    assert (await stored_claim(nc, orphan)).instance == "dead-process"  # type: ignore[union-attr]
    busy = {"code": "TARGET_BUSY", "message": "busy"}
    retryable = msgspec.structs.replace(done, state="failed", result=None, error=busy)
    outbox[orphan] = schema.encoder.encode(retryable)
    taken = await claimer.claim(orphan, "cap")
    assert taken.held is not None and taken.held.claim.instance == "i2"
    await claimer.stop()


async def test_a_claim_that_lands_after_its_agent_looked_for_it_is_released_when_it_does(
    provisioned: NatsServer, nc: NATS, caplog: pytest.LogCaptureFixture
) -> None:
    """The create is not confirmed, the read-back finds nothing, the task is refused (said);
    then the create lands. The agent, still looking, releases it: never ``running`` for
    nobody."""
    metrics = reach_agent.AgentMetrics()
    store = LateCreate(nc, claim_key("late-1"))
    claimer = Claimer(nc, "late", "i1", SUBJECTS, metrics=metrics, store=store)
    with (
        caplog.at_level(logging.INFO, logger="reach_agent.agent.claiming"),
        pytest.raises(ClaimsUnavailable),
    ):
        await claimer.claim("late-1", "cap")
    assert [r.getMessage() for r in caplog.records if "claims.unconfirmed" in r.getMessage()] == [
        "claims.unconfirmed request_id=late-1 agent=late: the store did not confirm the claim, "
        "the task is refused; released if it lands within 30s"
    ]
    await asyncio.wait_for(store.landed.wait(), 5)
    claim = await claim_becomes(nc, "late-1", "released")
    assert (claim.agent_id, claim.instance, claim.reason) == (
        "late", "i1", "late refused the task: its claim was not confirmed")  # fmt: skip
    await wait_for(lambda: metrics.store_errors.labels("claims", "orphan")._value.get() == 1)
    await claimer.stop()


# --- agent processes: stalls, restarts, deaths ------------------------------------------


slow = pytest.mark.slow


@slow
async def test_a_forced_not_delivered_runs_the_handler_once_in_total(
    nats_server: NatsServer, broker: Broker, tmp_path: Path
) -> None:
    """The first agent claims, then its event loop stalls past the caller's receipt timeout
    (but well short of being declared offline: heartbeats every second); the retry reaches
    the second agent, which answers IN_PROGRESS; the first finishes."""
    stalling = worker(nats_server.url, tmp_path, "stall-a", "pay", "--stall", "1.5",
                      "--delay", "0.2", "--hb", "1")  # fmt: skip
    other = worker(nats_server.url, tmp_path, "stall-b", "pay", "--delay", "0.2")
    try:
        await wait_for(lambda: healthy(broker, "stall-a") and healthy(broker, "stall-b"), 30,
                       what="both agents healthy")  # fmt: skip
        metrics = reach_agent.ClientMetrics()
        async with reach_agent.Client(nats_server.url, metrics=metrics) as client:
            key = await sticky_key_for(client, "pay", "stall-a")
            rid = str(uuid.uuid4())
            result = await asyncio.wait_for(
                client.call("pay", {"n": 1}, sticky_key=key, request_id=rid, timeout=15), 20
            )
        assert result == {"agent": "stall-a", "n": 1}
        assert metrics.requests.labels("stall-a", "not_delivered")._value.get() == 1
        assert metrics.requests.labels("stall-b", "IN_PROGRESS")._value.get() == 1
        assert lines(tmp_path / "stall-a.log", "stall") == [rid]
        assert lines(tmp_path / "stall-a.log", "start") == [rid]
        assert lines(tmp_path / "stall-b.log", "start") == []
    finally:
        stalling.stop()
        other.stop()


@slow
async def test_an_agent_stalled_before_it_claims_never_runs_the_request_its_retry_ran(
    nats_server: NatsServer, broker: Broker, tmp_path: Path
) -> None:
    """The other order: the first agent is stopped before it even reads the task; the retry
    runs on the second; the first, resumed, finds the claim taken and does not run it."""
    stopped = worker(nats_server.url, tmp_path, "stop-a", "pay", "--delay", "0.2")
    other = worker(nats_server.url, tmp_path, "stop-b", "pay", "--delay", "0.2")
    try:
        await wait_for(lambda: healthy(broker, "stop-a") and healthy(broker, "stop-b"), 30,
                       what="both agents healthy")  # fmt: skip
        async with reach_agent.Client(nats_server.url) as client:
            key = await sticky_key_for(client, "pay", "stop-a")
            rid = str(uuid.uuid4())
            stopped.signal(signal.SIGSTOP)
            try:
                result = await asyncio.wait_for(
                    client.call("pay", {"n": 2}, sticky_key=key, request_id=rid, timeout=15), 20
                )
            finally:
                stopped.signal(signal.SIGCONT)
            assert result == {"agent": "stop-b", "n": 2}
            # Once stop-a has served a later task on the same subscription, it has read the
            # stale one (one callback at a time, in order) and answered it from the claim.
            # Sent to stop-a's own task subject, not routed: a freeze shorter than the probe
            # timeout leaves a late probe answer (a large RTT sample) that may keep it out of
            # the routes for a while, which is not what this test is about.
            await wait_for(lambda: healthy(broker, "stop-a"), 15, what="stop-a healthy again")
            later = str(uuid.uuid4())
            nc = await nats.connect(nats_server.url)
            try:
                task = SUBJECTS.task("stop-a", "pay")
                hdrs = {H_REQUEST_ID: later}
                reply = await nc.request(task, b'{"n": 3}', timeout=15, headers=hdrs)
            finally:
                await nc.close()
            assert msgspec.json.decode(reply.data) == {"agent": "stop-a", "n": 3}
        assert lines(tmp_path / "stop-a.log", "start") == [later]
        assert lines(tmp_path / "stop-b.log", "start") == [rid]
    finally:
        stopped.stop()
        other.stop()


async def sticky_key_for(client: reach_agent.Client, cap: str, agent_id: str) -> str:
    for i in range(500):
        if (await client.route(cap, sticky_key=f"k{i}"))[0].agent_id == agent_id:
            return f"k{i}"
    raise AssertionError(f"no sticky key routes {cap!r} to {agent_id!r}")


@slow
async def test_a_completed_request_is_not_run_again_by_its_restarted_agent(
    nats_server: NatsServer, broker: Broker, tmp_path: Path
) -> None:
    first = worker(nats_server.url, tmp_path, "phoenix", "mail", "--delay", "0.1")
    second = None
    try:
        await wait_for(lambda: healthy(broker, "phoenix"), 30, what="phoenix healthy")
        rid = str(uuid.uuid4())
        async with reach_agent.Client(nats_server.url) as client:
            assert await client.call("mail", {"n": 5}, request_id=rid, timeout=10) == {
                "agent": "phoenix", "n": 5}  # fmt: skip
            first.signal(signal.SIGKILL)
            assert first.wait(10) == -signal.SIGKILL
            await wait_for(lambda: not healthy(broker, "phoenix"), 15, what="phoenix gone")
            second = worker(nats_server.url, tmp_path, "phoenix", "mail", "--delay", "0.1")
            await wait_for(lambda: healthy(broker, "phoenix"), 30, what="phoenix back")
            again = await client.call("mail", {"n": 5}, request_id=rid, timeout=10)
        assert again == {"agent": "phoenix", "n": 5}
        assert lines(tmp_path / "phoenix.log", "start") == [rid]
    finally:
        first.stop()
        if second is not None:
            second.stop()


@slow
async def call_killing_its_taker(
    url: str, broker: Broker, tmp_path: Path, cfg: ClientConfig, doomed: str, heir: str,
    n: int, *, doomed_delay: str,
) -> tuple[str, Any]:  # fmt: skip
    """A call sticky to worker ``doomed``, SIGKILLed once it runs it (a running claim, no
    record), while worker ``heir`` of the same capability stands by: (request id, result)."""
    workers = (worker(url, tmp_path, doomed, "ship", "--delay", doomed_delay),
               worker(url, tmp_path, heir, "ship", "--delay", "0.3"))  # fmt: skip
    try:
        await wait_for(lambda: healthy(broker, doomed) and healthy(broker, heir), 30,
                       what="both agents healthy")  # fmt: skip
        rid = str(uuid.uuid4())
        async with reach_agent.Client(url, config=cfg) as client:
            key = await sticky_key_for(client, "ship", doomed)
            call = asyncio.create_task(
                client.call("ship", {"n": n}, sticky_key=key, request_id=rid, timeout=20)
            )
            log = tmp_path / f"{doomed}.log"
            await wait_for(lambda: lines(log, "start") == [rid], 10, what=f"running on {doomed}")
            held = await stored_claim(client.nc, rid)
            assert held is not None and (held.agent_id, held.state) == (doomed, "running")
            workers[0].signal(signal.SIGKILL)
            return rid, await asyncio.wait_for(call, 15)
    finally:
        for w in workers:
            w.stop()


async def test_a_holder_killed_mid_task_is_released_once_offline_and_runs_once_elsewhere(
    nats_server: NatsServer, broker: Broker, nc: NATS, tmp_path: Path
) -> None:
    events = await EventLog().start(nc)
    cfg = ClientConfig(claim_poll_s=30)  # the release event, not the poll, ends the wait
    rid, result = await call_killing_its_taker(
        nats_server.url, broker, tmp_path, cfg, "hold-a", "hold-b", 9, doomed_delay="2"
    )
    assert result == {"agent": "hold-b", "n": 9}
    released = [e for e in events.events if e["kind"] == "released"]
    assert [(e["agent_id"], e["request_id"]) for e in released] == [("hold-a", rid)]
    assert "declared offline before finishing" in released[0]["reason"]
    kinds = events.of("hold-a")
    assert kinds.index(("state", "suspect", "offline")) < kinds.index(("released", None, None))
    assert await ended_by(nc, rid) == ("hold-b", "running", "hold-b")
    assert lines(tmp_path / "hold-a.log", "start") == [rid]
    assert lines(tmp_path / "hold-a.log", "done") == []
    assert lines(tmp_path / "hold-b.log", "start") == [rid]
    assert lines(tmp_path / "hold-b.log", "done") == [rid]
    assert broker.releaser.released == 1
    assert broker.metrics.claims_released._value.get() == 1


async def test_a_call_whose_retries_ran_out_runs_again_once_its_claim_is_released(
    nats_server: NatsServer, broker: Broker, nc: NATS, tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:  # fmt: skip
    """A call with no retry left loses its taker mid-task: it waits for a record until its
    deadline, and its claim's release says nobody will store one, so it tries again at
    once, elsewhere (nemesis seeds 74 and 75: three calls told TIMEOUT after waiting 4.8-5 s
    on agents whose claims had been released). Waited out on the parent: ``Timeout``."""
    caplog.set_level(logging.INFO, logger="reach_agent.client.client")
    cfg = ClientConfig(retries=0, claim_poll_s=30)  # the release event ends the wait
    rid, result = await call_killing_its_taker(
        nats_server.url, broker, tmp_path, cfg, "last-a", "last-b", 4, doomed_delay="30"
    )
    assert result == {"agent": "last-b", "n": 4}
    said = [r.getMessage().split(" ")[0] for r in caplog.records
            if r.getMessage().startswith("call.")]  # fmt: skip
    assert said == ["call.waiting_for_record", "call.run_again"]
    assert await ended_by(nc, rid) == ("last-b", "running", "last-b")
    assert lines(tmp_path / "last-a.log", "done") == []
    assert lines(tmp_path / "last-b.log", "done") == [rid]


async def ghost_claim(nc: NATS, rid: str, *, state: schema.ClaimState = "running",
                      instance: str = "i1", capability: str = "cap") -> None:  # fmt: skip
    """Store "ghost"'s claim of ``rid`` (an agent no test runs), with its result location."""
    claim = schema.Claim(request_id=rid, agent_id="ghost", instance=instance,
                         capability=capability, state=state, at_ms=1,
                         ack_subject=SUBJECTS.ack("ghost", rid))  # fmt: skip
    created, _ = await ClaimStore(nc).create(claim_key(rid), schema.encoder.encode(claim))
    assert created is True


async def test_a_broker_learns_running_claims_written_before_it_started_and_can_release_them(
    nc: NATS, broker_factory: Any
) -> None:
    from jetstream.provision import provision

    await provision(nc)
    rid = str(uuid.uuid4())
    await ghost_claim(nc, rid)
    events = await EventLog().start(nc)
    broker = await broker_factory()
    await wait_for(lambda: broker.releaser.held_by("ghost") == [rid], 5, what="claim learnt")
    assert await broker.releaser.release("ghost", "test") == 1
    assert await broker.releaser.release("ghost", "test") == 0  # already released
    stored = await stored_claim(nc, rid)
    assert stored is not None and (stored.agent_id, stored.state) == ("ghost", "released")
    assert stored.reason is not None and "declared offline before finishing (test)" in stored.reason
    await wait_for(lambda: [e["request_id"] for e in events.events] == [rid], 5,
                   what="the released event")  # fmt: skip
    await wait_for(lambda: broker.releaser.held_by("ghost") == [], 5, what="claim forgotten")


async def claims_of_gone(nc: NATS, n: int) -> list[str]:
    """``n`` running claims of agent "gone" stored (their request ids)."""
    rids = [str(uuid.uuid4()) for _ in range(n)]
    store = ClaimStore(nc)
    for rid in rids:
        claim = schema.Claim(request_id=rid, agent_id="gone", instance="i1", capability="cap",
                             state="running", at_ms=1,
                             ack_subject=SUBJECTS.ack("gone", rid))  # fmt: skip
        assert (await store.create(claim_key(rid), schema.encoder.encode(claim)))[0]
    return rids


async def test_claims_learnt_for_an_offline_agent_are_each_read_once_not_once_per_claim(
    nc: NATS, broker_factory: Any
) -> None:
    """Nemesis seed 24: a broker's catch-up delivered ~110 claims of an agent already offline,
    each arrival started a release of all of the agent's claims, and with the ack store slow
    one claim was read and retried 110 times in one second. Each arrival now releases its
    own claim: n claims, n reads of the ack store."""
    from jetstream.provision import provision

    await provision(nc)
    broker = await broker_factory()
    releaser = broker.releaser
    releaser.state_of = lambda agent: "offline" if agent == "gone" else None
    # Every message get on the ack stream, as the server saw it.
    gets = await nc.subscribe(f"$JS.API.STREAM.MSG.GET.{ACK_STREAM}")
    await flush_subscriptions(nc)
    rids = await claims_of_gone(nc, 12)
    await wait_for(lambda: releaser.released == len(rids), 10, what="every claim released")
    for rid in rids:
        stored = await stored_claim(nc, rid)
        assert stored is not None and stored.state == "released"
    await flush_subscriptions(nc)  # every get made so far is in the subscription's queue
    queries = [json.loads((await gets.next_msg(timeout=1)).data) for _ in range(gets.pending_msgs)]
    # A read of a request's records starts at seq 1: one read a claim.
    reads = [q["next_by_subj"].rsplit(".", 1)[1] for q in queries if q.get("seq") == 1]
    assert sorted(reads) == sorted(rids)


async def test_a_replaced_process_has_its_claims_released_also_those_learnt_after(
    nc: NATS, broker_factory: Any
) -> None:
    """A new process of an agent id accepted over the first (which no longer answers its
    probe) releases the first's running claims — and one of the first process's claims that
    the broker learns of only after the replacement (its follow behind the announce: a
    stalled broker, a lost consumer, the catch-up at start) is released on arrival, where it
    used to stay ``running`` for good (the agent id stays healthy, so nothing else releases
    it). The new process's claims are kept."""
    broker = await broker_factory()
    events = await EventLog().start(nc)
    store = ClaimStore(nc)

    async def announce(instance: str) -> Any:
        body = schema.Announce(agent_id="phoenix", capabilities=["cap"], max_concurrency=1,
                               heartbeat_interval_ms=60_000, instance_id=instance)  # fmt: skip
        return await nc.request(SUBJECTS.announce("phoenix"), schema.encoder.encode(body),
                                timeout=5)  # fmt: skip

    async def claimed(instance: str) -> str:
        rid = str(uuid.uuid4())
        claim = schema.Claim(request_id=rid, agent_id="phoenix", instance=instance,
                             capability="cap", state="running", at_ms=1,
                             ack_subject=SUBJECTS.ack("phoenix", rid))  # fmt: skip
        assert (await store.create(claim_key(rid), schema.encoder.encode(claim)))[0]
        return rid

    def released() -> list[str]:
        return [e["request_id"] for e in events.events if e["kind"] == "released"]

    assert (await announce("first")).headers is None
    early = await claimed("first")
    await wait_for(lambda: broker.releaser.held_by("phoenix") == [early], 5, what="claim learnt")
    assert (await announce("second")).headers is None  # the first answers no probe: gone
    await wait_for(lambda: released() == [early], 5, what="the first process's claim released")
    kept = await claimed("second")
    late = await claimed("first")
    await wait_for(lambda: released() == [early, late], 5, what="the late claim released")
    for rid, state in ((early, "released"), (late, "released"), (kept, "running")):
        stored = await stored_claim(nc, rid)
        assert stored is not None and stored.state == state
    assert broker.releaser.held_by("phoenix") == [kept]
    late_event = next(e for e in events.events if e.get("request_id") == late)
    assert "process first had been replaced by a new one" in late_event["reason"]


async def test_a_probe_answered_by_a_new_process_releases_the_dead_ones_claims(
    nc: NATS, broker: Broker, caplog: pytest.LogCaptureFixture
) -> None:
    """An agent gone silent is probed, and another process of its agent id answers (a
    restart whose announce has not come here): the process the registry knows is asked as at
    an announce and, answering no more, its running claims are released (nemesis seed 73:
    a2's two claims kept 10.8 s, until its new process's announce). Kept on the parent."""
    caplog.set_level(logging.INFO, logger="reach_broker.service.identity")
    events = await EventLog().start(nc)
    body = schema.Announce(agent_id="phx", capabilities=["cap"], max_concurrency=1,
                           heartbeat_interval_ms=200, instance_id="dead")  # fmt: skip
    reply = await nc.request(SUBJECTS.announce("phx"), schema.encoder.encode(body), timeout=5)
    assert reply.headers is None
    rid = str(uuid.uuid4())
    claim = schema.Claim(request_id=rid, agent_id="phx", instance="dead", capability="cap",
                         state="running", at_ms=1,
                         ack_subject=SUBJECTS.ack("phx", rid))  # fmt: skip
    assert (await ClaimStore(nc).create(claim_key(rid), schema.encoder.encode(claim)))[0]
    await wait_for(lambda: broker.releaser.held_by("phx") == [rid], 5, what="claim learnt")
    answer = schema.encoder.encode(schema.ProbeReply(agent_id="phx", instance_id="new"))

    async def new_process(msg: Any) -> None:
        await msg.respond(answer)

    responder = await nc.subscribe(SUBJECTS.probe("phx"), cb=new_process)
    await flush_subscriptions(nc)
    try:
        released = await claim_becomes(nc, rid, "released", limit_s=10)
    finally:
        await responder.unsubscribe()
    assert released.reason is not None
    assert "a new process of it announced (instance new)" in released.reason
    await wait_for(lambda: [e["request_id"] for e in events.events if e["kind"] == "released"]
                   == [rid], 5, what="the released event")  # fmt: skip
    said = [r.getMessage() for r in caplog.records if "replaced_unseen" in r.getMessage()]
    assert said == ["announce.replaced_unseen agent=phx instance=new old=dead: its running "
                    "claims are released"]  # fmt: skip


async def test_an_sdk_agent_s_claims_name_the_process_its_announces_name(
    nats_server: NatsServer, nc: NATS, broker_factory: Any
) -> None:
    """The SDK's claims carry the ``instance_id`` of its announces, so a broker accepting a
    restart of the agent id matches the dead process's claims (above); they were two
    randoms, and a claim of a replaced process learnt after its restart stayed running
    (nemesis seed 46: an entry held 60 s behind it)."""
    broker = await broker_factory()
    release = asyncio.Event()
    agent = reach_agent.Agent("same1", ["same"], heartbeat_interval=0.1, durable_acks=False)

    @agent.handler("same")
    async def handle(task: reach_agent.Task) -> str:
        await release.wait()
        return "done"

    await agent.start(nats_server.url)
    try:
        await wait_for(lambda: healthy(broker, "same1"), 10, what="same1 healthy")
        rid = str(uuid.uuid4())
        await nc.publish("reach.task.same1.same", b"{}", headers={H_REQUEST_ID: rid})
        await wait_for(lambda: agent.active == 1, what="the run")
        claim = await stored_claim(nc, rid)
        assert claim is not None and claim.state == "running"
        assert claim.instance == broker.registry.agents["same1"].announce.instance_id
        release.set()
    finally:
        await agent.stop(grace=1)


async def test_a_release_pass_the_bucket_cannot_take_says_one_line(
    nc: NATS, broker_factory: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """Claims of an agent declared offline while the bucket cannot take a release: one
    warning for the pass, naming how many failed and the first request ids, not one a claim
    (nemesis seed 39: 50 lines in one second)."""
    from jetstream.provision import provision

    await provision(nc)
    for _ in range(7):
        await ghost_claim(nc, str(uuid.uuid4()))
    broker = await broker_factory()
    await wait_for(lambda: len(broker.releaser.held_by("ghost")) == 7, 10, what="claims learnt")
    held = broker.releaser.held_by("ghost")
    await nc.jetstream().delete_stream(CLAIMS_STREAM)
    with caplog.at_level(logging.WARNING, logger="reach_broker.service.releases"):
        assert await broker.releaser.release("ghost", "test") == 0
        said = [r.getMessage() for r in caplog.records if "release_failed" in r.getMessage()]
    assert len(said) == 1, said
    assert said[0].startswith(f"claims.release_failed agent=ghost failed=7 of 7 request_ids="
                              f"{','.join(held[:5])},... error=")  # fmt: skip
    assert said[0].endswith(": tried again in 0.5s")


async def test_a_release_pass_the_store_does_not_answer_waits_one_timeout_not_one_a_claim(
    nc: NATS, broker_factory: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """A release pass whose first write the store does not answer ends there: the agent's
    other claims are not each tried in turn, each waiting its 2 s timeout (14 s and seven
    writes on the parent), but counted failed with it and tried again together."""
    from jetstream.provision import provision

    await provision(nc)
    for _ in range(7):
        await ghost_claim(nc, str(uuid.uuid4()))
    broker = await broker_factory()
    await wait_for(lambda: len(broker.releaser.held_by("ghost")) == 7, 10, what="claims learnt")
    await nc.jetstream().delete_stream(CLAIMS_STREAM)
    writes = await nc.subscribe(f"$KV.{CLAIMS_BUCKET}.>")  # takes them, answers none
    await flush_subscriptions(nc)
    with caplog.at_level(logging.WARNING, logger="reach_broker.service.releases"):
        assert await broker.releaser.release("ghost", "test") == 0
        said = [r.getMessage() for r in caplog.records if "release_failed" in r.getMessage()]
    await flush_subscriptions(nc)
    assert writes.pending_msgs == 1
    assert len(said) == 1 and "failed=7 of 7" in said[0], said
    await writes.unsubscribe()


async def test_claims_arriving_for_an_offline_agent_are_released_in_one_pass_at_a_time(
    nc: NATS, broker_factory: Any
) -> None:
    """A catch-up delivering an offline agent's claims one after another starts one release
    pass, and the claims that arrive during it make the next, not a pass each (nemesis seed
    75: 366 ``claims.release_failed`` lines from one broker in 4 s, the store not
    answering)."""
    from jetstream.provision import provision

    await provision(nc)
    broker = await broker_factory()
    releaser = broker.releaser
    releaser.state_of = lambda agent: "offline" if agent == "gone" else None
    passes: list[frozenset[str]] = []
    let_go = asyncio.Event()

    async def release(agent_id: str, why: str, *_: Any, keys: Any = None, **__: Any) -> int:
        passes.append(keys)
        await let_go.wait()  # the first pass lasts until every claim has arrived
        return 0

    releaser.release = release  # type: ignore[method-assign]
    rids = await claims_of_gone(nc, 12)
    await wait_for(lambda: len(releaser.held_by("gone")) == 12, 10, what="every claim arrived")
    let_go.set()
    first = len(passes[0])
    await wait_for(lambda: sum(map(len, passes)) == 12, 5, what="every claim in a pass")
    assert len(passes) == (1 if first == 12 else 2), [len(p) for p in passes]
    assert set().union(*passes) == {claim_key(rid) for rid in rids}
    await wait_for(lambda: not releaser._arrived, 5, what="no pass pending")


class Beats:
    """A raw agent announced on the test's connection (200 ms heartbeats, no probe
    responder), beating while :attr:`on`."""

    def __init__(self, nc: NATS, agent_id: str) -> None:
        self.nc, self.agent_id, self.on = nc, agent_id, True
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        body = {"agent_id": self.agent_id, "capabilities": ["lz.cap"], "max_concurrency": 1,
                "heartbeat_interval_ms": 200}  # fmt: skip
        reply = await self.nc.request(f"reach.announce.{self.agent_id}",
                                      json.dumps(body).encode(), timeout=5)  # fmt: skip
        self._task = asyncio.create_task(self._beat(json.loads(reply.data)["token"]))

    async def _beat(self, token: str) -> None:
        for seq in itertools.count(1):
            if self.on:
                hb = {"agent_id": self.agent_id, "token": token, "seq": seq}
                await self.nc.publish(f"reach.hb.{self.agent_id}", json.dumps(hb).encode())
            await asyncio.sleep(0.2)

    async def stop(self) -> None:
        if self._task is not None:
            await stop_loops(self._task)


async def claim_at(nc: NATS, agent_id: str, at_ms: int) -> str:
    """A running claim of ``agent_id`` made at ``at_ms``."""
    rid = str(uuid.uuid4())
    claim = schema.Claim(request_id=rid, agent_id=agent_id, instance="i1", capability="lz.cap",
                         state="running", at_ms=at_ms)  # fmt: skip
    assert (await ClaimStore(nc).create(claim_key(rid), schema.encoder.encode(claim)))[0]
    return rid


@pytest.mark.parametrize("heard", [True, False], ids=["heard-again", "offline-still"])
async def test_a_claim_made_after_its_agent_was_declared_offline_waits_to_be_released(
    broker: Broker, nc: NATS, caplog: pytest.LogCaptureFixture, heard: bool
) -> None:
    """A claim an agent made after this broker declared it offline (its heartbeats behind
    the claim in the broker's backlog: a stall) is not released on arrival, as one from
    before the verdict is: heard again, the agent keeps it; offline still 5 s later, it is
    released then (nemesis seed 68: b2, out of a stall, released five claims a2 had taken
    1-4 ms before; c1-000925 ran on a2 and a4 at once)."""
    caplog.set_level(logging.INFO, logger="reach_broker.service.releases")
    agent = Beats(nc, "lazarus")
    await agent.start()
    try:
        await wait_for(lambda: healthy(broker, "lazarus"))
        agent.on = False
        await wait_for(lambda: broker.registry.agents["lazarus"].state == "offline", 10,
                       what="lazarus offline")  # fmt: skip
        # Made 100 ms after the verdict (a claim of the same millisecond counts as before it).
        verdict = broker.registry.offline_at_ms("lazarus", time.monotonic(),
                                                int(time.time() * 1000))  # fmt: skip
        assert verdict is not None
        rid = await claim_at(nc, "lazarus", verdict + 100)
        said = f"claims.offline_claimed request_id={rid} agent=lazarus: "

        def lines_of(key: str) -> list[str]:
            return [r.getMessage() for r in caplog.records if key in r.getMessage()]

        await wait_for(lambda: lines_of(said), 5, what="the claim deferred")
        assert (await stored_claim(nc, rid)).state == "running"  # type: ignore[union-attr]
        if heard:
            agent.on = True
            await wait_for(lambda: lines_of("offline_claim_kept"), 10, what="kept")
            assert (await stored_claim(nc, rid)).state == "running"  # type: ignore[union-attr]
        else:
            claim = await claim_becomes(nc, rid, "released", limit_s=10)
            assert claim.reason == (
                f"claim of request {rid} released: holder 'lazarus' declared offline before "
                "finishing (offline still, after a claim it made once declared so)"
            )
    finally:
        await agent.stop()


async def test_a_broker_started_later_does_not_keep_claims_their_completed_record_ended(
    nc: NATS, broker_factory: Any
) -> None:
    from jetstream.provision import provision

    await provision(nc)
    done, running = str(uuid.uuid4()), str(uuid.uuid4())
    for rid in (done, running):
        await ghost_claim(nc, rid)
    # ghost's completed record of one of them: that claim's end
    record = schema.AckRecord(request_id=done, agent_id="ghost", capability="cap",
                              state="completed", at_ms=2)  # fmt: skip
    await acks.publish_record(nc.jetstream(), f"reach.ack.ghost.{done}",
                              acks.ack_msg_id("ghost", done, "completed"),
                              schema.encoder.encode(record))  # fmt: skip
    broker = await broker_factory()
    await wait_for(lambda: broker.releaser.held_by("ghost") == [running], 10,
                   what="only the running claim kept")  # fmt: skip
    assert await broker.releaser.release("ghost", "test") == 1
    assert await ended_by(nc, done) == ("ghost", "running", "ghost")
    released = await stored_claim(nc, running)
    assert released is not None and released.state == "released"


async def failed_record(nc: NATS, agent_id: str, rid: str, code: str) -> None:
    """Store ``agent_id``'s ``failed`` record of ``rid`` with error ``code``."""
    error = {"code": code, "message": f"{agent_id} said {code}"}
    record = schema.AckRecord(request_id=rid, agent_id=agent_id, capability="cap",
                              state="failed", at_ms=2, error=error)  # fmt: skip
    await publish_record(nc.jetstream(), SUBJECTS.ack(agent_id, rid),
                         ack_msg_id(agent_id, rid, "failed"),
                         schema.encoder.encode(record))  # fmt: skip


async def test_a_claim_its_holders_failure_ended_is_not_released_and_runs_nowhere_again(
    nc: NATS, broker_factory: Any
) -> None:
    """The holder of a claim stored its ``failed`` record with an error that is not
    retryable, and its own ``failed`` end of the claim was lost (it died before the store
    took it): the record is the claim's end. The holder declared offline, the claim is not
    released (it was, and the request ran again elsewhere); a replay takes it as finished. A
    retryable error's record ends nothing: that claim is released as one without a record."""
    from jetstream.provision import provision

    await provision(nc)
    rejected, timed_out, bare = (str(uuid.uuid4()) for _ in range(3))
    for rid in (rejected, timed_out, bare):
        await ghost_claim(nc, rid)
    await failed_record(nc, "ghost", rejected, "BIZ_REJECT")
    await failed_record(nc, "ghost", timed_out, "TIMEOUT")
    broker = await broker_factory()
    await wait_for(lambda: len(broker.releaser.held_by("ghost")) == 3, 10, what="claims learnt")
    assert await broker.releaser.claim_of(rejected) == ("ghost", "failed", None)
    assert await broker.releaser.release("ghost", "test") == 2
    # The finished one forgotten at once; the released ones once the follow brings them.
    await wait_for(lambda: broker.releaser.held_by("ghost") == [], 10, what="none held")
    states = {rid: (c.state if (c := await stored_claim(nc, rid)) else None)
              for rid in (rejected, timed_out, bare)}  # fmt: skip
    assert states == {rejected: "running", timed_out: "released", bare: "released"}
    holder, state, author = await ended_by(nc, rejected)
    assert (holder, state, author) == ("ghost", "running", "ghost")


async def test_a_new_process_answers_its_predecessors_stored_failure_and_runs_nothing(
    nats_server: NatsServer, broker: Broker, agents: Any, nc: NATS
) -> None:
    """The previous process of an agent stored its ``failed`` ``BIZ_REJECT`` record of a
    request and died before its ``failed`` end of the claim was stored: a copy reaching the
    new process is answered that stored error, and the handler does not run (it took the
    claim over and ran the request again)."""
    runs: list[tuple[str, str]] = []
    await agents(slow_agent("heir2", "ledger7", runs))
    await wait_for(lambda: healthy(broker, "heir2"))
    orphan = await dead_process_claim(nc, "heir2", "ledger7")
    await failed_record(nc, "heir2", orphan, "BIZ_REJECT")
    reply = await nc.request(SUBJECTS.task("heir2", "ledger7"), b'{"n": 1}',
                             headers={H_REQUEST_ID: orphan}, timeout=10)  # fmt: skip
    err = from_reply(reply.headers, reply.data)
    assert err is not None and (err.code, err.message) == ("BIZ_REJECT", "heir2 said BIZ_REJECT")
    assert (reply.headers or {}).get(schema.H_HOLDER) == "heir2"
    assert runs == []
    stored = await stored_claim(nc, orphan)
    assert stored is not None and (stored.state, stored.instance) == ("running", "dead-process")


async def completed_record(nc: NATS, agent_id: str, rid: str, result: bytes) -> None:
    """Store ``agent_id``'s ``completed`` record of ``rid`` with ``result``."""
    record = schema.AckRecord(request_id=rid, agent_id=agent_id, capability="cap",
                              state="completed", at_ms=2, result=msgspec.Raw(result))  # fmt: skip
    await publish_record(nc.jetstream(), SUBJECTS.ack(agent_id, rid),
                         ack_msg_id(agent_id, rid, "completed"),
                         schema.encoder.encode(record))  # fmt: skip


async def test_an_earlier_holders_stored_result_ends_a_claim_taken_over_since(
    nats_server: NatsServer, broker: Broker, agents: Any, nc: NATS
) -> None:
    """Agent "first" ran a request and stored its result after a broker had released its
    claim (declared offline while it ran); another ("ghost") took the claim over and was
    lost in turn, its claim released again. A copy reaching a third agent is answered
    first's stored result, naming it the holder, and nothing runs (nemesis seed 59:
    c2-000028 ran a third time 170 s after its first run's result was stored: only the
    claim's holder's records were read).
    Likewise a broker does not release the claim of an agent that took it over when an
    earlier holder's result is stored."""
    runs: list[tuple[str, str]] = []
    await agents(slow_agent("third", "ledger8", runs))
    await wait_for(lambda: healthy(broker, "third"))
    rid = str(uuid.uuid4())
    await ghost_claim(nc, rid, state="released", capability="ledger8")
    await completed_record(nc, "first", rid, b'{"agent":"first","n":1}')
    reply = await nc.request(SUBJECTS.task("third", "ledger8"), b'{"n": 1}',
                             headers={H_REQUEST_ID: rid}, timeout=10)  # fmt: skip
    assert (reply.headers or {}).get(schema.H_STATUS) == "completed"
    assert (reply.headers or {}).get(schema.H_HOLDER) == "first"
    assert msgspec.json.decode(reply.data) == {"agent": "first", "n": 1}
    assert runs == []
    stored = await stored_claim(nc, rid)
    assert stored is not None and (stored.agent_id, stored.state) == ("ghost", "released")

    running = str(uuid.uuid4())
    await ghost_claim(nc, running)  # taken over by ghost, running
    await completed_record(nc, "first", running, b'{"agent":"first","n":2}')
    await wait_for(lambda: running in broker.releaser.held_by("ghost"), 10, what="claim learnt")
    assert await broker.releaser.claim_of(running) == ("ghost", "completed", None)
    assert await broker.releaser.release("ghost", "test") == 0
    kept = await stored_claim(nc, running)
    assert kept is not None and kept.state == "running"


async def finished_by_ghost(nc: NATS, broker: Broker, agents: Any, runs: list[tuple[str, str]],
                            metrics: reach_agent.AgentMetrics) -> str:  # fmt: skip
    """Agent "reader" (``ledger``) healthy, and a new request id whose claim "ghost" holds
    ``completed`` (its result record not stored): the request id."""
    await agents(slow_agent("reader", "ledger", runs, metrics=metrics))
    await wait_for(lambda: healthy(broker, "reader"))
    rid = str(uuid.uuid4())
    await ghost_claim(nc, rid, state="completed", instance="g1", capability="ledger")
    return rid


async def test_a_finished_claim_whose_result_is_not_stored_yet_is_read_again_on_the_next_copy(
    nats_server: NatsServer, broker: Broker, agents: Any, nc: NATS
) -> None:
    """The holder ended its claim ``completed`` but its ack writer has not stored the record
    yet (a stream leader election): the copy gets a retryable TIMEOUT, and that answer is
    not remembered as the request's — the next copy reads the store again and gets the
    result (found by loadtest.nemesis: an agent kept answering TIMEOUT from its duplicate
    window for two minutes after the record was stored)."""
    runs: list[tuple[str, str]] = []
    metrics = reach_agent.AgentMetrics()
    rid = await finished_by_ghost(nc, broker, agents, runs, metrics)
    task = SUBJECTS.task("reader", "ledger")
    first = await nc.request(task, b'{"n": 3}', headers={H_REQUEST_ID: rid}, timeout=10)
    assert (first.headers or {}).get("Nats-Service-Error-Code") == "503"
    assert msgspec.json.decode(first.data)["error"]["code"] == "TIMEOUT"
    record = schema.AckRecord(request_id=rid, agent_id="ghost", capability="ledger",
                              state="completed", at_ms=2,
                              result=msgspec.Raw(b'{"agent":"ghost","n":3}'))  # fmt: skip
    await publish_record(nc.jetstream(), SUBJECTS.ack("ghost", rid),
                         ack_msg_id("ghost", rid, "completed"),
                         schema.encoder.encode(record))  # fmt: skip
    second = await nc.request(task, b'{"n": 3}', headers={H_REQUEST_ID: rid}, timeout=10)
    assert (second.headers or {}).get(schema.H_STATUS) == "completed"
    assert msgspec.json.decode(second.data) == {"agent": "ghost", "n": 3}
    assert runs == []
    sample = metrics.registry.get_sample_value
    labels = {"capability": "ledger"}
    assert sample("reach_agent_tasks_total", {**labels, "result": "unstored"}) == 1.0
    assert sample("reach_agent_tasks_total", {**labels, "result": "duplicate"}) == 1.0


async def test_a_finished_claim_whose_result_cannot_be_read_is_answered_store_unavailable(
    nats_server: NatsServer, broker: Broker, agents: Any, nc: NATS,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    """``REACH_ACKS`` answers the read of a finished claim's result with JetStream's 503 (an
    election): the copy is answered ``STORE_UNAVAILABLE`` (retryable) and not run (nemesis
    seed 38: the error ended the agent's task unanswered, 'Task exception was never
    retrieved'). Only the read is made to fail; the rest is the real server."""
    runs: list[tuple[str, str]] = []
    metrics = reach_agent.AgentMetrics()
    rid = await finished_by_ghost(nc, broker, agents, runs, metrics)

    async def electing(*args: Any, **kwargs: Any) -> Any:
        raise ServiceUnavailableError(
            code=503, err_code=10008, description="JetStream system temporarily unavailable"
        )

    monkeypatch.setattr(ackreads, "wait_final_at", electing)
    task = SUBJECTS.task("reader", "ledger")
    reply = await nc.request(task, b'{"n": 3}', headers={H_REQUEST_ID: rid}, timeout=5)
    assert (reply.headers or {}).get("Nats-Service-Error-Code") == "503"
    err = from_reply(reply.headers, reply.data)
    assert err is not None
    assert (err.code, err.retryable, err.retry_after_ms) == ("STORE_UNAVAILABLE", True, 500)
    assert err.message == (
        f"request_id {rid!r} already completed on agent 'ghost', but REACH_ACKS could not be "
        f"read (reach.ack.ghost.{rid}: ServiceUnavailableError: nats: ServiceUnavailableError: "
        "code=503 err_code=10008 description='JetStream system temporarily unavailable'): not "
        "run again; ask again"
    )
    assert runs == []
    labels = {"capability": "ledger", "result": "unstored"}
    assert metrics.registry.get_sample_value("reach_agent_tasks_total", labels) == 1.0


async def holders_claim(nc: NATS, holder: str, capability: str,
                        state: schema.ClaimState) -> str:  # fmt: skip
    """A new request id claimed by ``holder`` (an agent no test runs), in ``state``."""
    rid = str(uuid.uuid4())
    claim = schema.Claim(request_id=rid, agent_id=holder, instance="k1", capability=capability,
                         state=state, at_ms=1, ack_subject=SUBJECTS.ack(holder, rid))  # fmt: skip
    assert (await ClaimStore(nc).create(claim_key(rid), schema.encoder.encode(claim)))[0]
    return rid


async def test_a_caller_answered_from_another_agents_claim_waits_for_the_holders_record(
    nats_server: NatsServer, broker: Broker, agents: Any, nc: NATS
) -> None:
    """An agent answering a repeat with the holder's stored result names the holder
    (``Reach-Holder``), and the caller's ``wait`` then believes the holder's record — not
    the answering agent's, which never writes one (found by loadtest.nemesis: a submitted
    task repeated with ``call`` and answered by another agent was never found by ``wait``)."""
    runs: list[tuple[str, str]] = []
    await agents(slow_agent("relay", "ledger2", runs))
    await wait_for(lambda: healthy(broker, "relay"))
    rid = await holders_claim(nc, "keeper", "ledger2", "completed")
    record = schema.AckRecord(request_id=rid, agent_id="keeper", capability="ledger2",
                              state="completed", at_ms=2,
                              result=msgspec.Raw(b'{"agent":"keeper","n":4}'))  # fmt: skip
    await publish_record(nc.jetstream(), SUBJECTS.ack("keeper", rid),
                         ack_msg_id("keeper", rid, "completed"),
                         schema.encoder.encode(record))  # fmt: skip
    async with reach_agent.Client(nats_server.url) as client:
        assert await client.call("ledger2", {"n": 4}, request_id=rid, timeout=10) == {
            "agent": "keeper", "n": 4}  # fmt: skip
        assert client.takers.get(rid) == "keeper"
        stored = await client.wait(rid, timeout=5)
    assert (stored.agent_id, stored.state) == ("keeper", "completed")
    assert stored.result == {"agent": "keeper", "n": 4}
    assert runs == []
    raw = await nc.request(SUBJECTS.task("relay", "ledger2"), b'{"n":4}',
                           headers={H_REQUEST_ID: rid}, timeout=10)  # fmt: skip
    assert (raw.headers or {}).get(schema.H_HOLDER) == "keeper"
    # A copy asking for a receipt (a replay's): the receipt names the holder too, or the
    # replay took relay for the taker and a wait waited for relay's record (nemesis seed 52).
    inbox = nc.new_inbox()
    replies = await nc.subscribe(inbox)
    await flush_subscriptions(nc)
    await nc.publish(SUBJECTS.task("relay", "ledger2"), b'{"n":4}', reply=inbox,
                     headers={H_REQUEST_ID: rid, schema.H_RECEIPT: "1"})  # fmt: skip
    receipt, result = await replies.next_msg(5), await replies.next_msg(5)
    assert [(m.headers or {}).get(schema.H_STATUS) for m in (receipt, result)] == [
        "received", "completed"]  # fmt: skip
    assert [(m.headers or {}).get(schema.H_HOLDER) for m in (receipt, result)] == [
        "keeper", "keeper"]  # fmt: skip
    # Only the receipt asked for (Reach-Ack-Mode: received): it names the holder, and a
    # caller's receipt says whose the request is.
    async with reach_agent.Client(nats_server.url) as client:
        got = await client.call("ledger2", {"n": 4}, request_id=rid, timeout=10,
                                ack_mode="received")  # fmt: skip
        assert (got.request_id, got.agent_id) == (rid, "keeper")
        assert client.takers.get(rid) == "keeper"
    assert runs == []


async def test_a_caller_waiting_for_a_holder_takes_an_earlier_holders_record_that_ends_it(
    nats_server: NatsServer, broker: Broker, agents: Any, nc: NATS,
    caplog: pytest.LogCaptureFixture,
) -> None:  # fmt: skip
    """A caller told ``IN_PROGRESS`` waits for the claim's holder; an earlier holder, whose
    claim was released and taken over, stores its completed record after all: that record
    ends the claim and answers the call (nemesis seed 82: c3-000638 waited for a4 while a2's
    completed record was stored 1.07 s before its deadline, and ended TIMEOUT; on the
    parent only the holder's records were read)."""
    caplog.set_level(logging.INFO, logger="reach_agent.client.holder")
    runs: list[tuple[str, str]] = []
    await agents(slow_agent("relay3", "ledger3", runs))
    await wait_for(lambda: healthy(broker, "relay3"))
    rid = await holders_claim(nc, "keeper3", "ledger3", "running")
    waiting = f"call.in_progress request_id={rid} holder=keeper3"
    async with reach_agent.Client(nats_server.url) as client:
        call = asyncio.ensure_future(client.call("ledger3", {"n": 7}, request_id=rid, timeout=30))
        await wait_for(lambda: any(r.getMessage().startswith(waiting) for r in caplog.records),
                       10, what="waiting for keeper3")  # fmt: skip
        await completed_record(nc, "early3", rid, b'{"agent":"early3","n":7}')
        assert await asyncio.wait_for(call, 10) == {"agent": "early3", "n": 7}
        assert client.takers.get(rid) == "early3"
    assert runs == []


async def test_a_claim_this_process_created_without_seeing_the_answer_is_taken_over(
    nats_server: NatsServer, broker: Broker, agents: Any, nc: NATS
) -> None:
    """The agent's create of a claim landed but its PubAck was lost (a timeout: the task was
    refused, retryably). The next copy finds a claim ``running`` under the agent's own id
    and process, which runs nothing under that request id: it takes the claim over and runs
    the task — instead of answering ``IN_PROGRESS`` naming itself to every copy, so that no
    copy ever ran it (found by loadtest.nemesis: two calls answered 'still running on agent
    a1' for 50 s after every fault had healed, with no run anywhere)."""
    runs: list[tuple[str, str]] = []
    agent = await agents(slow_agent("orphan", "ledger3", runs))
    await wait_for(lambda: healthy(broker, "orphan"))
    rid = str(uuid.uuid4())
    lost = schema.Claim(request_id=rid, agent_id="orphan", instance=agent.instance,
                        capability="ledger3", state="running", at_ms=1,
                        ack_subject=SUBJECTS.ack("orphan", rid))  # fmt: skip
    assert (await ClaimStore(nc).create(claim_key(rid), schema.encoder.encode(lost)))[0]
    reply = await nc.request(SUBJECTS.task("orphan", "ledger3"), b'{"n": 5}',
                             headers={H_REQUEST_ID: rid}, timeout=10)  # fmt: skip
    assert msgspec.json.decode(reply.data) == {"agent": "orphan", "n": 5}
    assert runs == [("orphan", rid)]
    stored = await stored_claim(nc, rid)
    assert stored is not None and (stored.agent_id, stored.instance) == ("orphan", agent.instance)
    assert await ended_by(nc, rid) == ("orphan", "running", "orphan")  # its record ends it


async def test_a_caller_told_in_progress_asks_the_holder_which_answers_or_takes_over(
    nats_server: NatsServer, broker: Broker, agents: Any, nc: NATS
) -> None:
    """``IN_PROGRESS`` from another agent: the call asks the holder itself, once. A claim
    left ``running`` by the holder's previous process (killed and restarted at once, so never
    declared offline, and never released) is taken over by the new process and run — where
    the caller used to wait for a release that never comes until its deadline (found by
    loadtest.nemesis: a call and five recalls all ``TIMEOUT``, no run anywhere). A holder
    that runs the request answers the copy with that run's result; it runs once."""
    runs: list[tuple[str, str]] = []
    await agents(slow_agent("keeper", "ledger4", runs, sleep=1.0))
    await agents(slow_agent("other", "ledger4", runs))
    await wait_for(lambda: healthy(broker, "keeper") and healthy(broker, "other"))
    cfg = ClientConfig(claim_poll_s=30)  # nothing releases these claims: no poll helps either
    metrics = reach_agent.ClientMetrics()
    async with reach_agent.Client(nats_server.url, config=cfg, metrics=metrics) as client:
        key = await sticky_key_for(client, "ledger4", "other")
        # The claim of keeper's previous process, which died before running it.
        orphan = await dead_process_claim(nc, "keeper", "ledger4")
        result = await client.call("ledger4", {"n": 6}, sticky_key=key, request_id=orphan,
                                   timeout=10)  # fmt: skip
        assert result == {"agent": "keeper", "n": 6}
        assert runs == [("keeper", orphan)]
        stored = await stored_claim(nc, orphan)
        assert stored is not None and stored.instance != "dead-process"
        # A request keeper runs now: the copy the call sends it waits for that run.
        running, first = await running_on(nc, "keeper", "ledger4", b'{"n":7}', runs)
        result = await client.call("ledger4", {"n": 7}, sticky_key=key, request_id=running,
                                   timeout=10)  # fmt: skip
        assert result == {"agent": "keeper", "n": 7}
        assert body_of(await first) == {"agent": "keeper", "n": 7}
    assert runs == [("keeper", orphan), ("keeper", running)]
    assert metrics.requests.labels("other", "IN_PROGRESS")._value.get() == 2
    assert metrics.requests.labels("keeper", "ok")._value.get() == 2


# --- idempotency keys are checked: one request id, one body ---------------------------------


def body_of(reply: Any) -> Any:
    return msgspec.json.decode(reply.data)


async def test_a_request_id_reused_with_another_body_is_refused_never_answered_with_the_first(
    nats_server: NatsServer, broker: Broker, agents: Any, nc: NATS
) -> None:
    runs: list[tuple[str, str]] = []
    await agents(slow_agent("idem-1", "pay", runs, metrics=reach_agent.AgentMetrics()))
    await agents(slow_agent("idem-2", "pay", runs))
    await wait_for(lambda: healthy(broker, "idem-1") and healthy(broker, "idem-2"))
    rid = str(uuid.uuid4())
    first, other = b'{"n":1}', b'{"n":2}'

    async def ask(agent: str, body: bytes) -> Any:
        return await nc.request(f"reach.task.{agent}.pay", body, timeout=5,
                                headers={H_REQUEST_ID: rid})  # fmt: skip

    assert body_of(await ask("idem-1", first)) == {"agent": "idem-1", "n": 1}
    cases = [("idem-1", "per agent 'idem-1''s recent tasks"),  # its duplicate window
             ("idem-2", "per its claim, held by agent 'idem-1'")]  # fmt: skip
    for agent, seen in cases:
        reply = await ask(agent, other)
        err = refusal_of(reply)
        assert isinstance(err, reach_agent.IdempotencyMismatch), (agent, err)
        assert (err.code, err.status, err.retryable) == ("IDEMPOTENCY_MISMATCH", 422, False)
        assert (reply.headers or {})["Nats-Service-Error-Code"] == "422"
        assert err.message == (
            f"request_id {rid!r} was already used with another body (body digest "
            f"{schema.body_digest(first)[:12]}..., this body {schema.body_digest(other)[:12]}..., "
            f"{seen}): a request id names one request; send a new body with a new request id"
        )  # fmt: skip
    # The first body again, on the other agent: its stored result, as before.
    assert body_of(await ask("idem-2", first)) == {"agent": "idem-1", "n": 1}
    assert runs == [("idem-1", rid)]
    stored = await stored_claim(nc, rid)
    assert stored is not None and stored.body_digest == schema.body_digest(first)
    records = await ackreads.all_records(nc, rid, subjects=SUBJECTS, author="idem-1")
    digests = {r.state: decode_ack_record(r.data).body_digest for r in records}
    # A run this short stores one record: its received folded into the final one (which
    # then carries received_ms; docs/protocol.md, Acks).
    assert digests == {"completed": schema.body_digest(first)}
    assert decode_ack_record(records[-1].data).received_ms is not None
    # An SDK call reusing the request id with another payload gets the same refusal.
    async with reach_agent.Client(nats_server.url) as client:
        assert await client.call("pay", {"n": 1}, request_id=rid) == {"agent": "idem-1", "n": 1}
        with pytest.raises(reach_agent.IdempotencyMismatch, match=f"request_id {rid!r} was"):
            await client.call("pay", {"n": 2}, request_id=rid)
    assert runs == [("idem-1", rid)]


async def test_records_and_claims_without_a_digest_are_still_accepted(
    provisioned: NatsServer, agents: Any, nc: NATS
) -> None:
    """A claim and an ack record written by an older agent (no body_digest): any body under
    the request id gets the stored result, as before digests."""
    runs: list[tuple[str, str]] = []
    await agents(slow_agent("newer", "legacy", runs))
    rid = str(uuid.uuid4())
    old = schema.Claim(request_id=rid, agent_id="older", instance="i0", capability="legacy",
                       state="completed", at_ms=1)  # fmt: skip
    await ClaimStore(nc).create(claim_key(rid), schema.encoder.encode(old))
    record = schema.AckRecord(request_id=rid, agent_id="older", capability="legacy",
                              state="completed", at_ms=1, result=msgspec.Raw(b'"old"'))  # fmt: skip
    await acks.publish_record(nc.jetstream(), SUBJECTS.ack("older", rid),
                              acks.ack_msg_id("older", rid, "completed"),
                              schema.encoder.encode(record))  # fmt: skip
    reply = await nc.request("reach.task.newer.legacy", b'{"any":"body"}', timeout=5,
                             headers={H_REQUEST_ID: rid})  # fmt: skip
    assert refusal_of(reply) is None and body_of(reply) == "old"
    assert runs == []


async def test_submit_refuses_a_request_id_already_used_with_another_body(
    nats_server: NatsServer, broker: Broker, agents: Any, nc: NATS
) -> None:
    runs: list[tuple[str, str]] = []
    await agents(slow_agent("sub-1", "ship", runs))
    await wait_for(lambda: healthy(broker, "sub-1"))
    metrics = reach_agent.ClientMetrics()
    called, queued = str(uuid.uuid4()), str(uuid.uuid4())
    async with reach_agent.Client(nats_server.url, metrics=metrics) as client:
        await client.call("ship", {"n": 1}, request_id=called)
        with pytest.raises(reach_agent.IdempotencyMismatch, match="per its claim"):
            await client.submit("ship", {"n": 2}, request_id=called)  # the claim says n=1
        first = await client.submit("nobody.ships", {"n": 3}, request_id=queued)
        assert first.duplicate is False
        again = await client.submit("nobody.ships", {"n": 3}, request_id=queued)
        assert again.duplicate is True  # the same body: the entry already queued
        with pytest.raises(reach_agent.IdempotencyMismatch, match="the compensation queue"):
            await client.submit("nobody.ships", {"n": 4}, request_id=queued)
    assert metrics.compensation.labels("mismatch")._value.get() == 2
    left = await compensation.scan(nc, "nobody.ships", subjects=SUBJECTS)
    assert [(e.request_id, msgspec.json.decode(e.data)) for e in left] == [(queued, {"n": 3})]
    assert runs == [("sub-1", called)]


async def test_a_queued_entry_whose_request_id_was_claimed_for_another_body_is_not_run(
    nats_server: NatsServer, broker: Broker, agents: Any, nc: NATS
) -> None:
    runs: list[tuple[str, str]] = []
    await agents(slow_agent("rep-1", "mail", runs))
    await wait_for(lambda: healthy(broker, "rep-1"))
    rid = str(uuid.uuid4())
    async with reach_agent.Client(nats_server.url) as client:
        await client.call("mail", {"n": 1}, request_id=rid)
    body = b'{"n":2}'  # queued past submit's check (a raw publisher, or a race)
    await compensation.enqueue(nc, "mail", body, request_id=rid, expires_at_ms=0,
                               subjects=SUBJECTS, body_digest=schema.body_digest(body))  # fmt: skip
    mismatched = broker.metrics.compensation_result["mismatch"]._value.get
    await wait_for(lambda: mismatched() == 1, 10, what="the entry seen as another request")
    assert await compensation.scan(nc, "mail", subjects=SUBJECTS) == []
    assert runs == [("rep-1", rid)]
