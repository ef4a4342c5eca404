"""An A2A agent served by the a2a-sdk alone (its request handler, task store and JSON-RPC
routes under uvicorn), with no reach code in it.

    python -m tests.agents.a2a_agent [--card 1.0|0.3] [--no-streaming]

Skills ``Echo Text`` (id ``echo-text``) and ``summarize``. What a message's text asks:

* ``slow N``: works N seconds, then completes ``done`` (a cancel ends it ``canceled``);
  ``slow N late D``: the same, its task named only D seconds after the message came;
* ``ask``: ``input-required`` with the question ``which language?``;
* ``fail`` / ``reject``: the task ``failed`` / ``rejected`` with a status message;
* ``direct``: answers with a ``Message`` (no task);
* anything else: a task whose artifact streams ``echo:`` and then the text (a data part is
  echoed back as a data part ``{"echo": value}``).

It prints ``ready <port>`` once it serves. ``GET /_seen`` lists every message it received
(``message_id``, the ``request_id`` of its metadata, the skill), ``GET /_cancelled`` the
tasks whose execution saw the cancel (``asyncio.CancelledError``) — what the tests check.
With ``--card 0.3`` the card is an A2A 0.3 card (``url``, ``protocolVersion`` 0.3.0), and
the endpoint speaks 0.3's ``message/send`` (and 1.0 beside it).
"""

from __future__ import annotations

import argparse
import asyncio
import socket
from typing import Any

import uvicorn
from a2a.compat.v0_3.conversions import to_compat_agent_card
from a2a.server.agent_execution import AgentExecutor, RequestContext
from a2a.server.events.event_queue_v2 import EventQueue
from a2a.server.request_handlers import DefaultRequestHandler
from a2a.server.routes import create_agent_card_routes, create_jsonrpc_routes
from a2a.server.tasks import InMemoryTaskStore, TaskUpdater
from a2a.types import a2a_pb2 as pb
from google.protobuf import struct_pb2
from google.protobuf.json_format import MessageToDict, ParseDict
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

SEEN: list[dict[str, Any]] = []
CANCELLED: list[str] = []


def text_part(text: str) -> pb.Part:
    return pb.Part(text=text, media_type="text/plain")


class Executor(AgentExecutor):
    async def execute(self, context: RequestContext, event_queue: EventQueue) -> None:
        msg = context.message
        assert msg is not None
        meta = MessageToDict(msg.metadata) if msg.metadata.fields else {}
        SEEN.append({"message_id": msg.message_id, "request_id": meta.get("request_id"),
                     "skill": meta.get("skill"), "text": context.get_user_input()})  # fmt: skip
        text = context.get_user_input().strip()
        task_id, context_id = context.task_id or "", context.context_id or ""
        words = text.split()
        if "late" in words:  # the message is seen (SEEN) before its task is named
            await asyncio.sleep(float(words[words.index("late") + 1]))
        if text == "direct":
            await event_queue.enqueue_event(pb.Message(
                message_id=f"m-{task_id}", context_id=context_id, role=pb.ROLE_AGENT,
                parts=[text_part("direct answer")],
            ))  # fmt: skip
            return
        await event_queue.enqueue_event(pb.Task(
            id=task_id, context_id=context_id,
            status=pb.TaskStatus(state=pb.TASK_STATE_SUBMITTED),
        ))  # fmt: skip
        updater = TaskUpdater(event_queue, task_id, context_id)
        await updater.start_work()
        if text.startswith("slow"):
            try:
                await asyncio.sleep(float(text.split()[1]))
            except asyncio.CancelledError:
                CANCELLED.append(task_id)
                raise
            await updater.add_artifact([text_part("done")], name="result")
            await updater.complete()
        elif text == "ask":
            await updater.requires_input(updater.new_agent_message([text_part("which language?")]))
        elif text == "fail":
            await updater.failed(updater.new_agent_message([text_part("the model crashed")]))
        elif text == "reject":
            await updater.reject(updater.new_agent_message([text_part("not my kind of task")]))
        else:
            data = [p for p in msg.parts if p.WhichOneof("content") == "data"]
            if data:
                echo = {"echo": MessageToDict(data[0].data)}
                part = pb.Part(data=ParseDict(echo, struct_pb2.Value()))
                await updater.add_artifact([part], artifact_id="a1", name="result")
            else:
                await updater.add_artifact([text_part("echo:")], artifact_id="a1", name="result")
                await asyncio.sleep(0.05)  # two chunks apart, as a model streams
                await updater.add_artifact([text_part(text)], artifact_id="a1", append=True,
                                           last_chunk=True)  # fmt: skip
            await updater.complete()

    async def cancel(self, context: RequestContext, event_queue: EventQueue) -> None:
        updater = TaskUpdater(event_queue, context.task_id or "", context.context_id or "")
        await updater.cancel()


def card(url: str, streaming: bool) -> pb.AgentCard:
    return pb.AgentCard(
        name="Echo Agent", description="echoes, slowly when asked", version="1.0.0",
        supported_interfaces=[pb.AgentInterface(url=url, protocol_binding="JSONRPC",
                                                protocol_version="1.0")],
        capabilities=pb.AgentCapabilities(streaming=streaming),
        default_input_modes=["text/plain", "application/json"],
        default_output_modes=["text/plain", "application/json"],
        skills=[
            pb.AgentSkill(id="echo-text", name="Echo Text", description="echo", tags=["echo"]),
            pb.AgentSkill(id="summarize", name="Summarize", description="echo too",
                          tags=["text"]),
        ],
    )  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--card", choices=("1.0", "0.3"), default="1.0")
    ap.add_argument("--no-streaming", action="store_true")
    args = ap.parse_args()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    url = f"http://127.0.0.1:{port}/"
    agent_card = card(url, not args.no_streaming)
    handler = DefaultRequestHandler(Executor(), InMemoryTaskStore(), agent_card)

    async def seen(request: Request) -> JSONResponse:
        return JSONResponse(SEEN)

    async def cancelled(request: Request) -> JSONResponse:
        return JSONResponse(CANCELLED)

    routes = [Route("/_seen", seen), Route("/_cancelled", cancelled)]
    if args.card == "0.3":
        old = pb.AgentCard()
        old.CopyFrom(agent_card)
        old.supported_interfaces[0].protocol_version = "0.3.0"
        legacy = to_compat_agent_card(old).model_dump(mode="json", exclude_none=True)
        legacy.update(protocolVersion="0.3.0", url=url, preferredTransport="JSONRPC")
        legacy.pop("supportedInterfaces", None)

        async def card_03(request: Request) -> JSONResponse:
            return JSONResponse(legacy)

        routes.append(Route("/.well-known/agent-card.json", card_03))
    else:
        routes += create_agent_card_routes(agent_card)
    routes += create_jsonrpc_routes(handler, "/", enable_v0_3_compat=True)
    app = Starlette(routes=routes)
    config = uvicorn.Config(app, log_level="warning", lifespan="off")
    server = uvicorn.Server(config)

    async def serve() -> None:
        task = asyncio.create_task(server.serve(sockets=[sock]))
        while not server.started:  # uvicorn offers no event to wait on  # noqa: ASYNC110
            await asyncio.sleep(0.01)
        print(f"ready {port}", flush=True)
        await task

    asyncio.run(serve())


if __name__ == "__main__":
    main()
