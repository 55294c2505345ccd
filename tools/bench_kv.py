"""`specgate bench kv`: many requests without max_tokens under a KV budget: do they fit, wait or
get preempted, and never fail, with the process's memory bounded?

For each `--budgets-mb` value, a fresh process (spawned: its RSS is its own) loads the default
model, builds the serving worker with that KV pool (`--kv-cache-mb`) and the planner's budget in
slots exactly as the gateway does (`gateway.assembly.target.kv_budget`), submits `--requests`
requests of `--prompt-tokens` distinct tokens each with no max_tokens (each may run to the
model's context), and runs the step loop for `--seconds`. After every step it samples the
process's RSS and the KV slots held. Reported per budget: RSS before any request (the model and
runtime), peak RSS and peak minus that baseline, the most KV held (bytes) against the budget,
requests ever resident at once, preemptions, failures, tokens generated. The issue's bound:
peak RSS ≤ budget + model + 1 GiB, and no failure.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import time
from pathlib import Path
from typing import Any

from loadtest.results import write_result


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="model (default: serve's default)")
    p.add_argument("--budgets-mb", default="4096,1024", help="comma-separated --kv-cache-mb values")
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--prompt-tokens", type=int, default=1500)
    p.add_argument("--seconds", type=float, default=150.0, help="how long each budget runs")
    p.add_argument("--json", type=Path, help="write the report here")


def run(args: argparse.Namespace) -> int:
    budgets = [float(b) for b in args.budgets_mb.split(",") if b.strip()]
    report = bench_kv(model=args.model, budgets_mb=budgets, requests=args.requests,
                      prompt_tokens=args.prompt_tokens, seconds=args.seconds)
    text = json.dumps(report, indent=1)
    if args.json:
        write_result(args.json, report)
    print(text)
    return 0


def bench_kv(*, model: str | None = None, budgets_mb: list[float] = (4096.0, 1024.0),
             requests: int = 32, prompt_tokens: int = 1500, seconds: float = 150.0) -> dict[str, Any]:
    ctx = multiprocessing.get_context("spawn")
    out: dict[str, Any] = {"settings": {"model": model or "default", "requests": requests,
                                        "prompt_tokens": prompt_tokens, "seconds": seconds},
                           "runs": {}}
    for mb in budgets_mb:
        with ctx.Pool(1) as pool:
            out["runs"][f"{mb:g}"] = pool.apply(_one, (model, mb, requests, prompt_tokens, seconds))
    return out


def rss_bytes() -> int:
    """This process's resident set (Linux /proc)."""
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def _one(model: str | None, kv_mb: float, n: int, prompt_tokens: int, seconds: float) -> dict[str, Any]:
    import numpy as np

    from gateway.assembly.target import batch_worker, kv_budget
    from gateway.settings import Settings
    from scheduler.loop import Finished, StepLoop
    from scheduler.policies import make_policy
    from scheduler.request import Request, RequestStats, Status
    from workers.runtime import load_runtime

    settings = Settings(kv_cache_mb=kv_mb, length_predictor=False, **({"model": model} if model else {}))
    rt = load_runtime(settings.model, progress=False)
    worker = batch_worker(settings, rt)
    kv, _ = kv_budget(worker.verifier)
    policy = make_policy("laps", max_batch=settings.max_batch, token_budget=settings.token_budget,
                         max_resident=n, prefill_chunk_tokens=settings.prefill_chunk_tokens, **kv)
    loop = StepLoop(policy, worker, max_resident=n)
    baseline = rss_bytes()
    ended: dict[str, Status] = {}
    produced = [0]

    def sink(event: Any) -> None:
        if isinstance(event, Finished):
            ended[event.request_id] = event.status
        else:
            produced[0] += len(event.token_ids)

    rng = np.random.default_rng(0)
    context = worker.context_limit
    for i in range(n):
        prompt = rng.integers(100, 20000, size=prompt_tokens).tolist()
        stats = RequestStats(f"r{i}", "t", time.time(), prompt_len=prompt_tokens,
                             max_tokens=context - prompt_tokens)      # no max_tokens: the context
        loop.submit(Request(stats, prompt, stop_token_ids=()), sink)
    evictions = [0]
    evict = worker.evict

    def counted(rid: str) -> None:
        evictions[0] += 1
        evict(rid)

    worker.evict = counted
    peak_rss = peak_kv = most_resident = steps = 0
    t_end = time.monotonic() + seconds
    while time.monotonic() < t_end and loop.step():
        steps += 1
        peak_rss = max(peak_rss, rss_bytes())
        peak_kv = max(peak_kv, worker.verifier.kv_tokens())
        most_resident = max(most_resident, len(worker.resident()))
    slot = worker.verifier.slot_bytes
    pc = worker.prefix_cache_usage()
    gib = 2**30
    return {"kv_cache_mb": kv_mb, "budget_tokens": kv.get("kv_budget_tokens"),
            "slot_bytes": slot, "steps": steps,
            "rss_before_requests_gib": round(baseline / gib, 3),
            "peak_rss_gib": round(peak_rss / gib, 3),
            "peak_rss_over_baseline_gib": round((peak_rss - baseline) / gib, 3),
            "bound_gib": round(kv_mb / 1024 + baseline / gib + 1, 3),
            "within_bound": peak_rss <= kv_mb * 2**20 + baseline + gib,
            "peak_kv_gib": round(peak_kv * slot / gib, 3),
            "prefix_cache_bytes_at_end": None if pc is None else pc[0],
            "most_resident": most_resident, "preemptions": evictions[0],
            "failed": sum(1 for s in ended.values() if s is Status.FAILED),
            "finished": sum(1 for s in ended.values() if s is Status.FINISHED),
            "tokens_generated": produced[0]}
