"""reach broker: registry, failure detection, scoring, routing and the `reach` CLI."""

__version__ = "0.1.0"
