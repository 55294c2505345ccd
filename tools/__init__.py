"""Offline tools, outside the serving path: the simulator, the throughput model and `plan`, the
benches, `generate`, draft building and distillation."""
