"""The broker's NATS wiring: ``Broker`` and its components (handlers, probes, advisories,
snapshot, observer, identity, outcomes, rules, releases, assets, metrics)."""
