"""The pure core: records, states, the registry, detection, scoring, routing, rules and quotas.
No I/O; the clock is an argument, results are returned."""
