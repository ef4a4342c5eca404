"""nats-server processes: the embedded server, the local dev cluster and its config, lifelines."""
