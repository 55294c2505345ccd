"""Measure what a verification pass costs on this machine, relative to a plain one-token pass.

The speculation sizing (workers/speculation.py) needs the curve cost(n nodes); it depends on the
hardware (gemv vs gemm on CPU, almost flat on a GPU), the dtype and the model, so engines measure
it at start-up (~1-2 s on a 135M model on 2 CPU cores) instead of trusting a table.
"""
from __future__ import annotations

import statistics
import time

import torch

from workers.llama_forward import LlamaForward, Segment

DEFAULT_NODES = (1, 3, 7, 11, 15, 23, 31)


def measure_step_costs(forward: LlamaForward, *, nodes=DEFAULT_NODES, context: int = 128,
                       reps: int = 5) -> tuple[tuple[tuple[int, float], ...], float]:
    """(((0, 1.0), (n, cost(n) / cost(0)), ...), seconds of one plain pass). The sizes take turns,
    one timing each a round, and each size is compared with the plain pass of its own round (the
    median over `reps` rounds): a slow or fast spell of a noisy machine (seconds long on these VMs)
    then moves a whole round, not the ratios. (Before: the fastest of 3 timings of each size, one
    size after another; three start-ups on one machine gave 16 nodes 1.15x, 1.48x and 1.17x.)"""
    cache = forward.new_cache(context + max(nodes) + 1)
    ids = torch.randint(0, forward.vocab_size, (context + max(nodes) + 1,), generator=torch.Generator().manual_seed(0))
    causal = torch.full((context, context), float("-inf")).triu(1)
    forward.forward(ids[:context], torch.arange(context), [Segment(cache, 0, context, causal)], None)
    cache.length = context
    sizes = [0, *sorted(nodes)]
    masks = {n: torch.full((n + 1, n + 1), float("-inf")).triu(1) for n in sizes}  # chains: any tree shape costs the same

    def timed(n: int) -> float:
        t0 = time.perf_counter()
        forward.forward(ids[: n + 1], torch.arange(context, context + n + 1), [Segment(cache, 0, n + 1, masks[n])],
                        torch.arange(n + 1))
        return time.perf_counter() - t0

    for n in sizes:     # warm-up: first calls of a shape pay one-off allocation costs
        timed(n)
    rounds = [{n: timed(n) for n in sizes} for _ in range(reps)]
    plain = statistics.median(r[0] for r in rounds)
    table = [(0, 1.0)]
    for n in sizes[1:]:
        # each size against the plain pass of its own round, the median over rounds; costs never
        # fall with size, though noise could make a measured point dip below its predecessor
        cost = statistics.median(r[n] / r[0] for r in rounds)
        table.append((n, max(cost, table[-1][1])))
    return tuple(table), plain
