"""The README's example agent in an application that configures logging itself (WARNING,
its own format): ``reach_agent.run`` must leave that alone."""

import logging

import reach_agent

logging.basicConfig(level=logging.WARNING, format="app %(levelname)s %(name)s %(message)s")

agent = reach_agent.Agent("alpha", capabilities=["text_processing"], max_concurrency=8)


@agent.handler("text_processing")
async def text_processing(task: reach_agent.Task) -> dict:
    return {"chars": len(task.payload["text"])}


reach_agent.run(agent)
