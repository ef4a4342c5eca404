"""The README's example agent, verbatim: started as a process by tests (NATS_URL from env)."""

import reach_agent

agent = reach_agent.Agent("alpha", capabilities=["text_processing"], max_concurrency=8)


@agent.handler("text_processing")
async def text_processing(task: reach_agent.Task) -> dict:
    return {"chars": len(task.payload["text"])}


reach_agent.run(agent)  # NATS_URL or nats://127.0.0.1:4222; SIGTERM drains
