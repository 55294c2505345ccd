"""Measure what a verification pass costs on this machine, relative to a plain one-token pass.

The speculation sizing (workers/speculation.py) needs the curve cost(n nodes); it depends on the
hardware (gemv vs gemm on CPU, almost flat on a GPU), the dtype and the model, so engines measure
it at start-up (~1-2 s on a 135M model on 2 CPU cores) instead of trusting a table.
"""
from __future__ import annotations

import time

import torch

from workers.llama_forward import LlamaForward, Segment

DEFAULT_NODES = (1, 3, 7, 11, 15, 23, 31)


def measure_step_costs(forward: LlamaForward, *, nodes=DEFAULT_NODES, context: int = 128,
                       reps: int = 3) -> tuple[tuple[tuple[int, float], ...], float]:
    """(((0, 1.0), (n, cost(n) / cost(0)), ...), seconds of one plain pass): the fastest of `reps`
    timings of each size."""
    cache = forward.new_cache(context + max(nodes) + 1)
    ids = torch.randint(0, forward.vocab_size, (context + max(nodes) + 1,), generator=torch.Generator().manual_seed(0))
    causal = torch.full((context, context), float("-inf")).triu(1)
    forward.forward(ids[:context], torch.arange(context), [Segment(cache, 0, context, causal)], None)
    cache.length = context

    def timed(rows: int) -> float:
        mask = torch.full((rows, rows), float("-inf")).triu(1)  # a chain: same cost as any tree shape
        best = float("inf")
        for _ in range(reps):
            t0 = time.perf_counter()
            forward.forward(ids[:rows], torch.arange(context, context + rows), [Segment(cache, 0, rows, mask)],
                            torch.arange(rows))
            best = min(best, time.perf_counter() - t0)
        return best

    timed(1)  # warm-up
    plain = timed(1)
    table = [(0, 1.0)]
    for n in sorted(nodes):
        # Costs never fall with size; noise could make a measured point dip below its predecessor.
        table.append((n, max(timed(n + 1) / plain, table[-1][1])))
    return tuple(table), plain
