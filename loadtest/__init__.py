"""Load generation, workloads, reports."""
