"""The routing decision every router makes, whoever runs it: the broker answering
``<prefix>.route.<capability>``, or a caller choosing from a route table (pure: neither
``nats`` nor ``asyncio``; the clock and the random source are arguments)."""
