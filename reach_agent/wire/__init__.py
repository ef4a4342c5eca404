"""The wire contract every language implements: messages, subjects, headers, error codes, the
retry rule and the stream protocol. Imports neither ``nats`` nor ``asyncio``."""
