"""Micro-benchmark: how long `Policy.plan` takes with n live requests (target: ≤ 100 µs median at
1,000 for every policy). Wired as `specgate bench plan` by specgate/cli.py.

The queue is kept in a steady state like the step loop's: 1,000 live requests from four tenants
with a mix of histories (fresh, demoted, perceptible); after each timed `plan` the chosen
requests get a synthetic step through `update` (finished ones are replaced by new arrivals), so
heaps carry stale entries and aging sees real waits. Only `plan` is timed; `update` is reported
separately.
"""
from __future__ import annotations

import random
import statistics
import time
from typing import Any

from scheduler.policies import POLICIES, make_policy
from scheduler.profile import StepCostModel
from scheduler.request import RequestStats, StepRecord
from scheduler.state import SchedulerState
from loadtest.results import write_result

TENANTS = ("chat", "code", "rag", "agent")


def _request(rng: random.Random, i: int, now: float) -> RequestStats:
    length = max(1, int(rng.lognormvariate(5.0, 1.0)))
    return RequestStats(f"r{i}", rng.choice(TENANTS), now, prompt_len=rng.randint(50, 2000),
                        max_tokens=4096, predicted_len=max(1, int(length * rng.lognormvariate(0, .7))))


def bench_plan(n_requests: int = 1000, policy: str = "laps", repeats: int = 2000,
               warmup: int = 300, seed: int = 0, max_batch: int = 8,
               token_budget: int = 64, step_s: float = 0.05) -> dict[str, Any]:
    """Median and p99 of `plan()` in µs with `n_requests` live requests."""
    rng = random.Random(seed)
    # the shipped step-cost profile, as the gateway plans with its model's (goodput-aware tree
    # budgets, LAPS-SD's prefill term and wait credit all read it)
    opts: dict[str, Any] = {"max_batch": max_batch, "token_budget": token_budget,
                            "step_cost": StepCostModel.from_json(None)}
    if policy == "srpt":   # no ground truth here: the predicted length stands in for it
        opts["oracle"] = lambda s: (s.predicted_len or 1) - s.committed
    pol = make_policy(policy, **opts)
    state, now, next_id = SchedulerState(), 0.0, 0
    for _ in range(n_requests):
        pol.add(state, _request(rng, next_id, now - rng.uniform(0, 30)))
        next_id += 1
    plan_ns, update_ns = [], []
    for i in range(warmup + repeats):
        t0 = time.perf_counter_ns()
        plan = pol.plan(state, now)
        t1 = time.perf_counter_ns()
        records = []
        for rid, budget in zip(plan.request_ids, plan.budgets):
            nodes, depth = budget.max_nodes, budget.max_depth
            s = state.requests[rid]
            tau = 1 + sum(1 for _ in range(depth) if rng.random() < 0.6)
            done = s.committed + tau >= (s.predicted_len or 100) * 1.2
            records.append(StepRecord(rid, 1 + nodes, tau, "stop" if done else None, depth))
        now += step_s
        t2 = time.perf_counter_ns()
        finished = pol.update(state, records, now, step_s)
        t3 = time.perf_counter_ns()
        for _ in finished:
            pol.add(state, _request(rng, next_id, now))
            next_id += 1
        if i >= warmup:
            plan_ns.append(t1 - t0)
            update_ns.append(t3 - t2)
    plan_us = sorted(x / 1000 for x in plan_ns)
    return {
        "policy": policy,
        "n_requests": n_requests,
        "repeats": repeats,
        "max_batch": max_batch,
        "token_budget": token_budget,
        "median_us": statistics.median(plan_us),
        "p99_us": plan_us[min(len(plan_us) - 1, int(0.99 * len(plan_us)))],
        "mean_us": statistics.fmean(plan_us),
        "update_median_us": statistics.median(update_ns) / 1000,
    }


def add_arguments(parser) -> None:
    parser.add_argument("--requests", type=int, default=1000, help="live requests in the queue")
    parser.add_argument("--policies", default=",".join(POLICIES),
                        help="comma-separated policy names")
    parser.add_argument("--repeats", type=int, default=2000)
    parser.add_argument("--max-batch", type=int, default=8)
    parser.add_argument("--token-budget", type=int, default=64)
    parser.add_argument("--json", dest="json_out", default=None, help="write results here")


def run(args) -> int:
    results = [bench_plan(args.requests, p.strip(), args.repeats, max_batch=args.max_batch,
                          token_budget=args.token_budget)
               for p in args.policies.split(",") if p.strip()]
    print(f"plan() with {args.requests} live requests (µs)")
    print("| policy | median | p99 | update median |")
    print("|---|---|---|---|")
    for r in results:
        print(f"| {r['policy']} | {r['median_us']:.1f} | {r['p99_us']:.1f} | "
              f"{r['update_median_us']:.1f} |")
    if args.json_out:
        write_result(args.json_out, {"requests": args.requests, "policies": results})
    return 0
