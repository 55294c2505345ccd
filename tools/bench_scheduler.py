"""`specgate bench scheduler`: what the central scheduler costs per step at scale: `plan` +
`update` of the real batch planner (scheduler/policies/planner.py, laps by default) over a real
`SchedulerState`, against the number of waiting and running requests, no model.

Issue 51's target: plan + update ≤ 2 ms per step with 10,000 waiting and 1,000 running requests,
well inside a GPU step, and the growth with queue length shown. Running requests are one step's
batch over many verifier replicas: `max_batch` is the running count, spread over `homes` KV homes
(`SchedulerState.kv_budgets`, Ray mode's replicas, `--batch-per-home` requests each), each with
a KV budget of its own, so placement, growth and eviction (scheduler/kv_budget.py) are in the
timed path as they are in the step loop.

The workload is kept in a steady state as the step loop keeps it: after each plan the bench
plays the worker (evicted requests free their KV, starts take theirs on the planned home,
residents grow when their tree no longer fits) and reports a synthetic step to `update`
(τ drawn per request, a request finishing once it reaches its length); every finished request is
replaced by a new arrival, so the live count stays `waiting + running`. Only `plan` and `update`
are timed. The first `warmup` steps are not counted (every request starts fresh there).
"""
from __future__ import annotations

import random
import statistics
import time
from typing import Any

from scheduler.kv_budget import growth_slots, start_slots
from scheduler.policies import POLICIES, Plan, make_policy
from scheduler.profile import StepCostModel
from scheduler.request import RequestStats, StepRecord
from scheduler.state import SchedulerState
from loadtest.results import write_result

TENANTS = ("chat", "code", "rag", "agent")
BLOCK, TREE = 256, 65                 # the planner's defaults (PolicyConfig.kv_block, kv_tree_tokens)
MEAN_START_SLOTS = 1400               # about a start's KV: a ~1,000-token prompt, a block, a tree


def _request(rng: random.Random, i: int, now: float) -> tuple[RequestStats, int]:
    """A new request and its true length (which only the bench's worker knows)."""
    length = max(1, int(rng.lognormvariate(5.0, 1.0)))
    return RequestStats(f"r{i}", rng.choice(TENANTS), now, prompt_len=rng.randint(50, 2000),
                        max_tokens=4096,
                        predicted_len=max(1, int(length * rng.lognormvariate(0, .7)))), length


def _hold(state: SchedulerState, s: RequestStats, kv_tokens: int, home: str | None) -> None:
    """The worker's side of KV (what scheduler/residency.py records): `s` now holds
    `kv_tokens` slots on `home`, and the state's totals follow."""
    state.kv_tokens += kv_tokens - s.kv_tokens
    held = state.kv_held
    if s.kv_home is not None:
        held[s.kv_home] -= s.kv_tokens
    s.kv_tokens, s.kv_home = kv_tokens, home if kv_tokens else None
    if s.kv_home is not None:
        held[s.kv_home] = held.get(s.kv_home, 0) + kv_tokens


class Workload:
    """A planner, its state and a seeded stream of requests kept at `waiting + running` live."""

    def __init__(self, waiting: int, running: int, *, policy: str = "laps", seed: int = 0,
                 batch_per_home: int = 8, kv_headroom: float = 1.5, step_s: float = 0.05,
                 **config: Any) -> None:
        """`kv_headroom`: each home's KV budget in starts' worth of its share of the batch
        (below 1 starts are deferred and residents evicted); `config`: more PolicyConfig fields."""
        self.rng, self.now, self.next_id, self.step_s = random.Random(seed), 0.0, 0, step_s
        self.lengths: dict[str, int] = {}
        self.homes = max(1, running // batch_per_home)
        opts: dict[str, Any] = {"max_batch": running, "token_budget": 8 * running,
                                "step_cost": StepCostModel.from_json(None), **config}
        if policy == "srpt":       # no ground truth here: the predicted length stands in for it
            opts["oracle"] = lambda s: (s.predicted_len or 1) - s.committed
        self.policy = make_policy(policy, **opts)
        per_home = int(kv_headroom * running / self.homes * MEAN_START_SLOTS)
        self.state = SchedulerState(kv_budgets={f"v{h}": per_home for h in range(self.homes)})
        for _ in range(waiting + running):
            self.arrive(self.now - self.rng.uniform(0, 30))
        self.evictions = 0

    def arrive(self, at: float) -> None:
        s, length = _request(self.rng, self.next_id, at)
        self.lengths[s.request_id] = length
        self.policy.add(self.state, s)
        self.next_id += 1

    def step(self) -> tuple[int, int, int, int]:
        """One step: plan, the worker's part, update, arrivals. (plan ns, update ns, their CPU
        ns, batch)."""
        return self.step_plan()[:4]

    def step_plan(self) -> tuple[int, int, int, int, Plan]:
        """`step`, and the plan it ran."""
        state, rng, requests = self.state, self.rng, self.state.requests
        c0, t0 = time.thread_time_ns(), time.perf_counter_ns()
        plan = self.policy.plan(state, self.now)
        t1, c1 = time.perf_counter_ns(), time.thread_time_ns()
        for rid in plan.evict:
            _hold(state, requests[rid], 0, None)
        self.evictions += len(plan.evict)
        records = []
        for rid, budget in zip(plan.request_ids, plan.budgets):
            s = requests[rid]
            if not s.kv_tokens:
                _hold(state, s, start_slots(s, block=BLOCK, tree=TREE), plan.homes.get(rid))
            elif growth_slots(s, block=BLOCK, tree=TREE):
                _hold(state, s, s.kv_tokens + growth_slots(s, block=BLOCK, tree=TREE), s.kv_home)
            depth = budget.max_depth
            tau = 1 + sum(1 for _ in range(depth) if rng.random() < 0.6)
            done = s.committed + tau >= self.lengths[rid]
            records.append(StepRecord(rid, 1 + budget.max_nodes, tau, "stop" if done else None,
                                      drafted=budget.max_nodes, accepted=tau - 1,
                                      draft_depth=depth))
        self.now += self.step_s
        c2, t2 = time.thread_time_ns(), time.perf_counter_ns()
        finished = self.policy.update(state, records, self.now, self.step_s)
        t3, c3 = time.perf_counter_ns(), time.thread_time_ns()
        for s in finished:
            _hold(state, s, 0, None)
            del self.lengths[s.request_id]
            self.arrive(self.now)
        return t1 - t0, t3 - t2, (c1 - c0) + (c3 - c2), len(plan.request_ids), plan


def _quantile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def bench_scheduler(waiting: int, running: int, *, policy: str = "laps", steps: int = 100,
                    warmup: int = 20, seed: int = 0, batch_per_home: int = 8) -> dict[str, Any]:
    """Per-step cost of plan + update with `waiting` + `running` live requests (ms)."""
    w = Workload(waiting, running, policy=policy, seed=seed, batch_per_home=batch_per_home)
    plan_ms, update_ms, cpu_ms, batches = [], [], [], []
    for i in range(warmup + steps):
        p, u, c, n = w.step()
        if i >= warmup:
            plan_ms.append(p / 1e6)
            update_ms.append(u / 1e6)
            cpu_ms.append(c / 1e6)
            batches.append(n)
    total = [p + u for p, u in zip(plan_ms, update_ms)]
    return {"policy": policy, "waiting": waiting, "running": running, "homes": w.homes,
            "steps": steps, "median_ms": statistics.median(total), "p99_ms": _quantile(total, 0.99),
            "plan_median_ms": statistics.median(plan_ms),
            "update_median_ms": statistics.median(update_ms),
            # the thread's own CPU time: on a shared machine, wall time also holds others' work
            "cpu_median_ms": statistics.median(cpu_ms),
            "mean_batch": statistics.fmean(batches), "evictions": w.evictions}


def growth(configs: list[dict]) -> dict[str, float]:
    """For each running count: median cost at the longest queue ÷ at the shortest."""
    out = {}
    for running in sorted({c["running"] for c in configs}):
        rows = sorted((c for c in configs if c["running"] == running), key=lambda c: c["waiting"])
        if len(rows) > 1:
            out[f"running {running}: waiting {rows[0]['waiting']} -> {rows[-1]['waiting']}"] = (
                rows[-1]["median_ms"] / rows[0]["median_ms"])
    return out


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def add_arguments(parser) -> None:
    parser.add_argument("--waiting", default="100,1000,10000", help="comma-separated queue lengths")
    parser.add_argument("--running", default="100,1000",
                        help="comma-separated running counts (a step's batch over every home)")
    parser.add_argument("--batch-per-home", type=int, default=8,
                        help="requests per verifier replica: running ÷ this KV homes")
    parser.add_argument("--policy", default="laps", choices=sorted(POLICIES))
    parser.add_argument("--steps", type=int, default=100, help="timed steps per configuration")
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", dest="json_out", default=None, help="write results here")


def run(args) -> int:
    waiting, running = _ints(args.waiting), _ints(args.running)
    if not waiting or not running or min(waiting + running) < 1 or args.batch_per_home < 1:
        raise ValueError("--waiting and --running need positive counts, --batch-per-home ≥ 1")
    configs = []
    print("| waiting | running | homes | median ms | p99 ms | plan ms | update ms | CPU ms | "
          "mean batch |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in running:
        for q in waiting:
            c = bench_scheduler(q, r, policy=args.policy, steps=args.steps, warmup=args.warmup,
                                seed=args.seed, batch_per_home=args.batch_per_home)
            configs.append(c)
            print(f"| {q} | {r} | {c['homes']} | {c['median_ms']:.3f} | {c['p99_ms']:.3f} | "
                  f"{c['plan_median_ms']:.3f} | {c['update_median_ms']:.3f} | "
                  f"{c['cpu_median_ms']:.3f} | "
                  f"{c['mean_batch']:.0f} |", flush=True)
    grown = growth(configs)
    for label, x in grown.items():
        print(f"growth, {label}: {x:.2f}x the median")
    if args.json_out:
        write_result(args.json_out, {"settings": {"policy": args.policy, "steps": args.steps,
                                                  "warmup": args.warmup, "seed": args.seed,
                                                  "batch_per_home": args.batch_per_home},
                                     "configs": configs, "growth": grown})
    return 0
