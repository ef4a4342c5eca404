"""The broker on NATS: the message handlers and the components (probes, advisories, snapshot,
observer, identity, outcomes, rules, releases), the pipeline of transitions, the context they
share, assets and metrics. They are built and wired in :mod:`reach_broker.broker`."""
