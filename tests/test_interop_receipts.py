"""Receipts from any language: a JavaScript agent written from docs/protocol.md alone.

The agent (``tests/js/agent.mjs``, Node and the npm ``nats`` client) sends its receipt as a
bare body, without ``Reach-Status: received``, and its result without headers. The SDK
must take the first reply as the receipt (its body is exactly the receipt of the request id
it sent) and return the second as the result. ``npm ci --prefix tests/js`` installs the
client (``.ci/run`` does); without Node the test is skipped.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

import reach_agent
from reach_agent.wire import schema
from reach_broker.broker import Broker
from reach_broker.cluster.natsserver import NatsServer

from .conftest import wait_for

JS = Path(__file__).parent / "js"


def test_a_body_only_receipt_is_told_by_its_exact_body() -> None:
    rid = str(uuid.uuid4())
    body = schema.encoder.encode(schema.Receipt(request_id=rid))
    assert schema.is_body_receipt(body, rid) is True
    assert schema.is_body_receipt(body, str(uuid.uuid4())) is False  # another request's
    extra = f'{{"request_id": "{rid}", "status": "received", "n": 1}}'.encode()
    assert schema.is_body_receipt(extra, rid) is False  # not exactly a receipt: a result
    assert schema.is_body_receipt(b'"received"', rid) is False
    assert schema.is_body_receipt(b"{not json received", rid) is False


@pytest.fixture(scope="module")
def node() -> str:
    exe = shutil.which("node")
    if exe is None:
        pytest.skip("node is not installed (the JavaScript agent needs Node 18+)")
    if not (JS / "node_modules" / "nats").is_dir():
        npm = shutil.which("npm")
        if npm is None:
            pytest.skip("npm is not installed: run `npm ci --prefix tests/js`")
        done = subprocess.run([npm, "ci", "--no-audit", "--no-fund", "--prefix", str(JS)],
                              capture_output=True, timeout=180, check=False)  # fmt: skip
        if done.returncode != 0:
            pytest.skip(f"npm ci --prefix tests/js failed: {done.stderr.decode()[-300:]}")
    return exe


@pytest.fixture
def js_agent(node: str, nats_server: NatsServer, tmp_path: Path) -> Iterator[Path]:
    log = tmp_path / "js-agent.err"
    with open(log, "wb") as err:
        proc = subprocess.Popen([node, str(JS / "agent.mjs"), "js-alpha", "js.echo"],
                                env=dict(os.environ, NATS_URL=nats_server.url),
                                stdout=subprocess.DEVNULL, stderr=err)  # fmt: skip
        try:
            yield log
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(5)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(5)


async def test_a_javascript_agent_with_body_only_receipts_is_called_correctly(
    broker: Broker, js_agent: Path
) -> None:
    rec = await wait_for(lambda: broker.registry.agents.get("js-alpha"), 20,
                         what=f"the JS agent announced (its log: {js_agent})")  # fmt: skip
    assert rec.announce.agent_type == "javascript"
    async with reach_agent.Client(broker.cfg.nats.url) as client:
        rid = str(uuid.uuid4())
        result = await client.call("js.echo", {"text": "hi"}, request_id=rid, timeout=10)
        # The result, not the receipt that came first.
        assert result == {"by": "javascript", "agent": "js-alpha", "echo": {"text": "hi"}}
        # A repeat of the request id: the first result, not a second receipt taken as one.
        again = await client.call("js.echo", {"text": "other"}, request_id=rid, timeout=10)
        assert again == result
        # ack_mode="received": the body-only receipt is the answer.
        rid2 = str(uuid.uuid4())
        receipt = await client.call("js.echo", {"text": "hi"}, request_id=rid2,
                                    ack_mode="received", timeout=10)  # fmt: skip
        assert receipt == schema.Receipt(request_id=rid2, agent_id="js-alpha")
        assert client.breakers.state("js-alpha", "js.echo") == "closed"
