"""A Synadia Agent Protocol agent hosted by their PyPI host SDK, with no reach code in it.

    python -m tests.agents.synadia_agent --server URL [--agent echo-bot] [--owner tests]
        [--session main] [--capabilities text.echo,text.upper] [--delay-s 0] [--pause-s 0]

Its prompt handler answers in two response chunks (``--pause-s`` apart): ``"echo:"`` and
the prompt text (upper-
cased when the prompt starts with ``upper ``); a prompt ``fail`` raises (their error frame,
500), a prompt ``refuse`` is refused with 429 (every prompt with ``--busy``). It prints
``ready <instance_id>`` once registered (the micro service id their heartbeats carry) and
runs until killed.
"""

from __future__ import annotations

import argparse
import asyncio
import signal

import nats
from synadia_ai.agent_service import AgentService, PromptStream, RequestRejectedError
from synadia_ai.agents import Envelope


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--server", required=True)
    ap.add_argument("--agent", default="echo-bot")
    ap.add_argument("--owner", default="tests")
    ap.add_argument("--session", default="main")
    ap.add_argument("--capabilities", default="")
    ap.add_argument("--delay-s", type=float, default=0.0)
    ap.add_argument("--pause-s", type=float, default=0.0, help="between the two chunks")
    ap.add_argument("--heartbeat-s", type=int, default=30)
    ap.add_argument("--busy", action="store_true", help="refuse every prompt with 429")
    args = ap.parse_args()
    nc = await nats.connect(args.server)  # unnamed, as in their quickstart
    service = AgentService(
        agent=args.agent, owner=args.owner, session_name=args.session, nc=nc,
        description="echo agent for reach's interop tests", heartbeat_interval_s=args.heartbeat_s,
        extra_metadata={"capabilities": args.capabilities} if args.capabilities else None,
    )  # fmt: skip

    async def on_prompt(envelope: Envelope, stream: PromptStream) -> None:
        text = envelope.prompt
        if text == "fail":
            raise RuntimeError("asked to fail")
        if text == "refuse" or args.busy:
            raise RequestRejectedError(429, "busy, come back later")
        if args.delay_s:
            await asyncio.sleep(args.delay_s)
        await stream.send("echo:")
        if args.pause_s:
            await asyncio.sleep(args.pause_s)
        await stream.send(text[6:].upper() if text.startswith("upper ") else text)

    service.on_prompt(on_prompt)
    await service.start()
    print(f"ready {service.instance_id}", flush=True)
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    await stop.wait()
    await service.stop()
    await nc.close()


if __name__ == "__main__":
    asyncio.run(main())
