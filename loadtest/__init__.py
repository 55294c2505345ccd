"""A client of a running gateway: open-loop load, workloads, policy comparison, soak."""
