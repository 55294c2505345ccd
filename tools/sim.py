"""Discrete-event simulator: the real policy code (scheduler.policies) against a workload model and
a measured step-cost model, one verification step at a time.

    while requests remain:
        admit arrivals up to now (admission control), plan = policy.plan(state, now),
        step time = prefill passes of planned requests without KV + profile(batch, tree tokens),
        sample each request's τ from its true α and its tree budget, now += step time,
        policy.update(state, records, now, step time)

**Prefill and KV** follow the step loop (scheduler/loop.py): a planned request without KV is
prefilled first, in a pass of its own at batch 1 (`Verifier.prefill`), and the step waits for it;
at most `max_resident` requests (32, the gateway's default) hold KV, least recently served evicted
first, and an evicted request pays a new prefill of prompt + committed output when it is next
planned (`KVResidency`). The policies get the same limit (`PolicyConfig.max_resident`), so they
start no request the KV cannot hold and eviction never happens; without that gate, aging and
least-attained-service ordering thrash the cache once more than 32 requests are live (every
aging promotion of an evicted request is a re-prefill that lengthens the step, which puts more
requests at risk: the engine ends up doing nothing but prefills).

**Chunked prefill** (`--prefill-chunk-tokens N`, as the gateway's flag): a planned request
without KV claims it without a pass of its own; the policy plans chunks of its context beside the
other requests' trees (`Plan.prefill`), and the step that completes the context verifies its
root and tree. Such a step costs profile(batch of the decoding requests, their tree tokens) plus
each chunk's measured cost (`StepCostModel.chunk`: its rows, and its attention over the keys
before it), the mixed step as the verifier runs it.

**Load** is defined as load = λ · E[L] ÷ C: λ the arrival rate (requests/s), E[L] the mean output
length of the generated requests, and C the engine's saturated goodput, i.e. committed output
tokens per second over the steps that ran at full batch when every request of an independent
sample of the same workload (1,000 requests) is queued at t = 0 and served FCFS with the same tree
budgets and prefill charges (at most 20,000 steps of it). At load 1 the arrivals ask for exactly
what a full engine can commit. NOTE: a step costs much less at a small batch on the CPU profile
(a batch of 8 commits little more than a batch of 4 does), so load 0.85 keeps the engine busy
nearly all the time, at a mean batch well below max_batch (README.md, "Scheduling policies in
the simulator").

Acceptance in a step: a request with tree budget (n nodes, depth d) drafts width w = n ÷ d per
depth; each depth is accepted with p = 1 − (1 − α_t)^w (w = 1: p = α_t), α_t its true α mixed
with its opening α (workload_gen.py); accepted = consecutive successes (≤ d), τ = accepted + 1,
verified = 1 + n. Each request draws from its own seeded RNG, so every policy sees the same
acceptance luck per request and step (common random numbers).

Output per policy: latency = finish − arrival (mean, p50, p99, max, per tenant); `max_wait_s` =
the longest gap any request spent unserved (arrival → first step, or between two of its steps),
which aging bounds; the clairvoyant `srpt` runs without aging, as the lower bound. Also: the
share of engine time spent prefilling and the number of re-prefills (evictions), and latency
split in two, `mean_in_steps_s` (time inside the steps a request was planned into, its own
prefill and its batch-mates' included) and `mean_wait_s` (the rest): an order of service moves
the waiting directly and the in-steps part only through the batch sizes it leads to, so the
split shows in every run how much a policy has to work with.
Engine defaults: max_batch 8 and token_budget 64, the range the default profile measured.

How much the order of service can matter here, and why the issue's targets are out of reach on
this engine, is written up in scheduler/policies/laps.py; the figures are in README.md,
"Scheduling policies in the simulator".
"""
from __future__ import annotations

import json
import math
import os
import random
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from scheduler.admission import ADMITTED, AdmissionControl, AdmissionLimits
from scheduler.length_learner import better
from scheduler.policies import Policy, PolicyConfig, make_policy
from scheduler.profile import StepCostModel, prefill_steps
from scheduler.request import RequestStats, StepRecord
from scheduler.sizing import expected_tau, size_trees
from scheduler.state import SchedulerState
from tools.workload_gen import (LOADTEST_TENANTS, SimRequest, WorkloadSpec, generate,
                                    with_arrivals)
from loadtest.results import write_result

DEFAULT_POLICIES = ("fcfs", "sjf", "las", "laps", "srpt")
# `specgate bench lengths --json` of the real predictor on the default model: its error at arrival
# and as requests progress sets the simulated predictor's (`--predictor`)
MEASURED_PREDICTOR = Path(__file__).parent / "data" / "bench_lengths.json"
WORKLOADS = {"default": WorkloadSpec(),
             "loadtest": WorkloadSpec(tenants=LOADTEST_TENANTS, predictor_sigma=None)}


@dataclass(frozen=True)
class SimSettings:
    """Everything that defines a run besides the policy name."""
    n_requests: int = 10_000
    load: float = 0.85
    seed: int = 1
    profile: str | None = None                 # None: scheduler/profiles/default.json
    workload: WorkloadSpec = WorkloadSpec()
    max_batch: int = 8
    token_budget: int = 64
    aging_bound_s: float | None = 60.0
    admission: AdmissionLimits = AdmissionLimits()
    policy_options: dict[str, dict[str, Any]] = field(default_factory=dict)  # by policy name
    calibration_requests: int = 1000
    calibration_steps: int = 20_000
    max_resident: int | None = 32              # requests holding KV at once (the step loop's)
    prefill_chunk_tokens: int = 0              # 0: whole prefills, each in a pass of its own


@dataclass
class RunOutcome:
    finished: list[RequestStats]
    refused: int
    steps: int
    busy_s: float
    end_s: float
    aged: int
    batch_sum: int
    committed: int
    prefill_s: float = 0.0
    reprefills: int = 0
    max_step_s: float = 0.0       # the longest step: the longest a decoding stream waits for a token


class KVResidency:
    """Which requests hold KV, as the step loop keeps it (scheduler/loop.py): at most `limit` at
    once, least recently served evicted first (never one planned for this step); a planned
    request without KV is prefilled first, with its prompt plus the output it has committed, in a
    pass of its own at batch 1 (`Verifier.prefill`), and the step waits for it. `chunked`: it
    only claims the KV (`prefill_left` set to its whole context), its steps' chunks compute it."""

    def __init__(self, cost: StepCostModel, limit: int | None, enabled: bool = True,
                 chunked: bool = False) -> None:
        self.cost, self.limit, self.enabled, self.chunked = cost, limit, enabled, chunked
        self._held: dict[str, None] = {}
        self.prefill_s = 0.0                  # time spent prefilling, in all
        self.reprefills = 0                   # prefills of evicted requests (preemption's cost)

    def admit(self, planned: list[str], live: dict[str, RequestStats]) -> float:
        """Make every planned request resident; returns the prefill time this costs."""
        held, dt = self._held, 0.0
        for rid in planned:
            if rid in held:
                held[rid] = held.pop(rid)     # most recently served last
                continue
            if self.limit is not None:
                while len(held) >= self.limit:
                    victim = next((r for r in held if r not in planned), None)
                    if victim is None:
                        break
                    del held[victim]
                    if victim in live:
                        live[victim].prefill_left = None
            held[rid] = None
            if self.enabled:
                s = live[rid]
                if s.n_steps:
                    self.reprefills += 1
                if self.chunked:
                    s.prefill_left = s.unprefilled_context
                else:
                    dt += self.cost.prefill(max(1, s.unprefilled_context))
        self.prefill_s += dt
        return dt

    def release(self, request_id: str) -> None:
        self._held.pop(request_id, None)


def simulate(policy: Policy, requests: list[SimRequest], cost: StepCostModel,
             spec: WorkloadSpec, admission: AdmissionLimits | None = None,
             stop_when_not_full: bool = False, max_steps: int | None = None,
             max_resident: int | None = 32) -> RunOutcome:
    """Run `requests` (sorted by arrival) through `policy` until all admitted ones finish.
    `max_resident`: requests holding KV at once (None: no limit), as the step loop's."""
    state = SchedulerState()
    ac = AdmissionControl(admission)
    chunked = policy.config.prefill_chunk_tokens > 0 and spec.prefill
    kv = KVResidency(cost, max_resident, spec.prefill, chunked)
    truth: dict[str, tuple[SimRequest, random.Random]] = {}
    finished: list[RequestStats] = []
    now = busy = 0.0
    i = refused = steps = aged = batch_sum = committed_total = 0
    max_step = 0.0
    n = len(requests)
    fade = [math.exp(-k / spec.early_steps) for k in range(int(12 * spec.early_steps))]
    while i < n or state.requests:
        while i < n and requests[i].arrival_s <= now:
            r = requests[i]
            i += 1
            if ac.admit(r.tenant) is not ADMITTED:
                refused += 1
                continue
            truth[r.request_id] = (r, random.Random(r.seed))
            stats = RequestStats(r.request_id, r.tenant, r.arrival_s, r.prompt_len, r.max_tokens,
                                 r.priority, r.predicted_len)
            if spec.repredict is not None:
                stats.length_belief = _belief(r, spec, 0)
            policy.add(state, stats)
        if not state.requests:
            now = requests[i].arrival_s
            continue
        if stop_when_not_full and len(state.requests) < policy.config.max_batch:
            break                               # too few left for a full batch
        plan = policy.plan(state, now)
        if max_steps is not None and steps >= max_steps:
            break
        live = state.requests
        dt = kv.admit(plan.request_ids, live)
        records, tokens, chunk_s = [], 0, 0.0
        chunks = plan.prefill if chunked and plan.prefill else [0] * len(plan)
        first_warm = len(plan) - plan.warm
        for j, (rid, budget, k) in enumerate(zip(plan.request_ids, plan.budgets, chunks)):
            r, rng = truth[rid]
            s = live[rid]
            if k:                               # a chunk of its context, in this step's pass
                left = s.unprefilled
                k = min(k, left)
                chunk_s += cost.chunk(k, s.unprefilled_context - left)
                s.prefill_left = left - k
                if s.prefill_left or j >= first_warm:
                    continue                    # no root yet: nothing verified, nothing committed
            tokens += 1 + budget.max_nodes
            rec = _sample_step(r, s, budget.max_nodes, budget.max_depth, rng, fade)
            if spec.repredict is not None and rec.finish is None:
                at = spec.repredict_at(s.committed + rec.committed)[0]
                if at > r.extra.get("checkpoint", 0):
                    r.extra["checkpoint"] = at
                    new = _belief(r, spec, at)
                    if better(new, s.length_belief):        # as the step loop keeps them
                        s.length_belief = new
            committed_total += rec.committed
            records.append(rec)
        dt += cost(max(len(records), 1), max(tokens, 1)) + chunk_s
        kv.prefill_s += chunk_s
        max_step = max(max_step, dt)
        now += dt
        busy += dt
        steps += 1
        aged += plan.aged
        batch_sum += len(records)
        for s in policy.update(state, records, now, dt):
            ac.release(s.tenant)
            kv.release(s.request_id)
            finished.append(s)
            del truth[s.request_id]
    return RunOutcome(finished, refused, steps, busy, now, aged, batch_sum, committed_total,
                      kv.prefill_s, kv.reprefills, max_step)


def _belief(r: SimRequest, spec: WorkloadSpec, committed: int) -> tuple[float, float, int]:
    """The predictor's (μ, σ, committed) for `r` at a checkpoint: ln of the true remaining length
    (before any max_tokens cut) plus N(0, σ(c)²) error. At arrival the error is the one its
    `predicted_len` has; at each later checkpoint a fresh draw, from a stream of its own (so that
    acceptance luck stays the same across policies)."""
    at, sigma = spec.repredict_at(committed)
    z = r.pred_err if at == 0 else random.Random(r.seed * 1_000_003 + at).gauss(0.0, 1.0)
    return math.log(max(1, r.natural_len - at)) + sigma * z, sigma, at


def _sample_step(r: SimRequest, s: RequestStats, nodes: int, depth: int, rng: random.Random,
                 fade: list[float]) -> StepRecord:
    accepted = tried = 0
    if nodes and depth:
        k = s.n_steps
        a = r.alpha if k >= len(fade) else r.alpha + fade[k] * (r.alpha_early - r.alpha)
        p = a if nodes <= depth else 1.0 - (1.0 - a) ** (nodes / depth)
        while accepted < depth and rng.random() < p:
            accepted += 1
        tried = accepted + (accepted < depth)
    tau = accepted + 1
    left = r.output_len - s.committed
    drafted = nodes if depth else 0
    if tau >= left:
        return StepRecord(r.request_id, 1 + nodes, left,
                          "length" if r.hits_length else "stop", tried, drafted, accepted)
    return StepRecord(r.request_id, 1 + nodes, tau, None, tried, drafted, accepted)


# ---- workload at a load ---------------------------------------------------------------------
def saturated_goodput(settings: SimSettings, cost: StepCostModel) -> float:
    """C in the load definition: committed tokens/s while a saturated engine runs full batches."""
    reqs = generate(settings.workload, settings.calibration_requests, settings.seed + 10_007)
    policy = make_policy("fcfs", _config(settings, cost), aging_bound_s=None)
    out = simulate(policy, reqs, cost, settings.workload, AdmissionLimits(10**9, 10**9),
                   stop_when_not_full=True, max_steps=settings.calibration_steps,
                   max_resident=settings.max_resident)
    return out.committed / out.busy_s


def build_workload(settings: SimSettings, rate: float) -> list[SimRequest]:
    reqs = generate(settings.workload, settings.n_requests, settings.seed)
    return with_arrivals(reqs, rate, settings.seed + 1, settings.workload.arrival_cv)


def arrival_rate(settings: SimSettings, cost: StepCostModel) -> tuple[float, float]:
    """(λ, C) for the settings' load."""
    c = saturated_goodput(settings, cost)
    mean_len = float(np.mean([r.output_len for r in
                              generate(settings.workload, settings.n_requests, settings.seed)]))
    return settings.load * c / mean_len, c


# ---- one policy -----------------------------------------------------------------------------
def _config(settings: SimSettings, cost: StepCostModel) -> PolicyConfig:
    # learn_priors off: each simulated request's tree sizes follow its own α draws only, so its
    # time in steps is the same under every order of service (the common random numbers the
    # policy comparisons and the waiting / time-in-steps split rest on)
    return PolicyConfig(max_batch=settings.max_batch, token_budget=settings.token_budget,
                        aging_bound_s=settings.aging_bound_s, step_cost=cost,
                        max_resident=settings.max_resident,
                        prefill_chunk_tokens=settings.prefill_chunk_tokens, learn_priors=False)


def srpt_oracle(truth: dict[str, SimRequest], settings: SimSettings, cost: StepCostModel):
    """True remaining steps: remaining tokens ÷ E[τ] at the depth a full batch would give."""
    b = settings.max_batch
    mean_alpha = float(np.mean([r.alpha for r in truth.values()])) if truth else 0.5
    theta_batch = size_trees([mean_alpha] * b, settings.token_budget - b, cost=cost)
    depth = max(1, theta_batch[0].max_depth)
    theta = mean_alpha ** depth           # the gain of the last node given to a mean request
    tau = {}
    for rid, r in truth.items():
        d = 0 if r.alpha <= theta else (8 if r.alpha >= 0.999 else
                                        min(8, int(math.log(theta) / math.log(r.alpha))))
        tau[rid] = expected_tau(r.alpha, d)

    def oracle(s: RequestStats) -> float:
        r = truth[s.request_id]
        # a request not yet started still has its prompt's prefill to go
        prefill = 0.0 if s.n_steps else prefill_steps(cost, r.prompt_len, b)
        return (r.output_len - s.committed) / tau[s.request_id] + prefill
    return oracle


def run_policy(name: str, settings: SimSettings, rate: float) -> dict[str, Any]:
    cost = StepCostModel.from_json(settings.profile)
    reqs = build_workload(settings, rate)
    opts = dict(settings.policy_options.get(name, {}))
    if name == "srpt":
        opts.setdefault("oracle", srpt_oracle({r.request_id: r for r in reqs}, settings, cost))
        opts.setdefault("aging_bound_s", None)        # the clairvoyant bound, unconstrained
    policy = make_policy(name, _config(settings, cost), **opts)
    t0 = time.perf_counter()
    out = simulate(policy, reqs, cost, settings.workload, settings.admission,
                   max_resident=settings.max_resident)
    wall = time.perf_counter() - t0
    return summarize(name, out, policy, wall)


def summarize(name: str, out: RunOutcome, policy: Policy, wall_s: float) -> dict[str, Any]:
    lat = np.array([s.finished_s - s.arrival_s for s in out.finished])
    in_steps = np.array([s.in_steps_s for s in out.finished])
    tenants: dict[str, list[float]] = {}
    for s, x in zip(out.finished, lat):
        tenants.setdefault(s.tenant, []).append(float(x))
    return {
        "policy": name,
        "mean_latency_s": float(lat.mean()),
        "p50_latency_s": float(np.percentile(lat, 50)),
        "p99_latency_s": float(np.percentile(lat, 99)),
        "max_latency_s": float(lat.max()),
        "max_wait_s": max(s.max_wait_s for s in out.finished),
        # latency = time waiting + time inside its steps; only the first is the order's to move
        "mean_wait_s": float((lat - in_steps).mean()),
        "mean_in_steps_s": float(in_steps.mean()),
        "p99_first_step_wait_s": float(np.percentile(
            [s.first_served_s - s.arrival_s for s in out.finished], 99)),
        "per_tenant_mean_latency_s": {t: float(np.mean(v)) for t, v in sorted(tenants.items())},
        "finished": len(out.finished),
        "refused": out.refused,
        "steps": out.steps,
        "mean_batch": out.batch_sum / max(out.steps, 1),
        "utilization": out.busy_s / out.end_s if out.end_s else 0.0,
        "prefill_share": out.prefill_s / out.busy_s if out.busy_s else 0.0,
        "reprefills": out.reprefills,
        "max_step_s": out.max_step_s,
        "committed_tokens_per_s": out.committed / out.end_s if out.end_s else 0.0,
        "aged_promotions": out.aged,
        "aging_bound_s": policy.config.aging_bound_s,
        "wall_s": wall_s,
        "latencies_s": lat.tolist(),
    }


# ---- several policies -----------------------------------------------------------------------
def run_sim(policies: list[str], settings: SimSettings, jobs: int = 1) -> dict[str, Any]:
    cost = StepCostModel.from_json(settings.profile)
    rate, capacity = arrival_rate(settings, cost)
    if jobs > 1 and len(policies) > 1:
        # the clairvoyant run is the quickest: start it last so the workers finish together
        order = sorted(policies, key=lambda p: p == "srpt")
        with ProcessPoolExecutor(min(jobs, len(policies))) as pool:
            done = dict(zip(order, pool.map(run_policy, order, [settings] * len(order),
                                            [rate] * len(order))))
        results = [done[p] for p in policies]
    else:
        results = [run_policy(p, settings, rate) for p in policies]
    return {
        "settings": {"n_requests": settings.n_requests, "load": settings.load,
                     "seed": settings.seed, "max_batch": settings.max_batch,
                     "token_budget": settings.token_budget,
                     "aging_bound_s": settings.aging_bound_s,
                     "max_resident": settings.max_resident,
                     "prefill_chunk_tokens": settings.prefill_chunk_tokens,
                     "arrival_cv": settings.workload.arrival_cv,
                     "predictor_sigma": settings.workload.predictor_sigma,
                     "repredict": settings.workload.repredict,
                     "profile_source": cost.source, "arrival_rate_per_s": rate,
                     "saturated_goodput_tokens_per_s": capacity},
        "policies": {r["policy"]: r for r in results},
    }


def measured_predictor(path: str | Path | None = MEASURED_PREDICTOR) -> dict[str, Any] | None:
    """WorkloadSpec fields for the predictor `bench lengths` measured (its JSON at `path`):
    the arrival error and the re-prediction error per checkpoint. None: no such file."""
    if path is None or not Path(path).is_file():
        return None
    doc = json.loads(Path(path).read_text())
    table = tuple((int(c["committed"]), float(c["sigma"])) for c in doc["checkpoints"])
    if not table or table[0][0] != 0:
        raise ValueError(f"{path}: checkpoints must start at committed 0")
    return {"predictor_sigma": table[0][1], "repredict": table}


def table(result: dict[str, Any]) -> str:
    tenants = list(next(iter(result["policies"].values()))["per_tenant_mean_latency_s"])
    rows = ["| policy | mean s | p50 s | p99 s | max wait s | mean waiting s | mean in steps s | "
            + " | ".join(f"{t} mean s" for t in tenants) + " |",
            "|" + "---|" * (7 + len(tenants))]
    for name, r in result["policies"].items():
        per = " | ".join(f"{v:.1f}" for v in r["per_tenant_mean_latency_s"].values())
        rows.append(f"| {name} | {r['mean_latency_s']:.2f} | {r['p50_latency_s']:.2f} | "
                    f"{r['p99_latency_s']:.1f} | {r['max_wait_s']:.1f} | {r['mean_wait_s']:.2f} | "
                    f"{r['mean_in_steps_s']:.2f} | {per} |")
    return "\n".join(rows)


def plot_cdfs(result: dict[str, Any], path: str | Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, r in result["policies"].items():
        x = np.sort(np.asarray(r["latencies_s"]))
        ax.plot(x, np.arange(1, len(x) + 1) / len(x), label=f"{name} (mean {x.mean():.1f} s)")
    s = result["settings"]
    ax.set_xscale("log")
    ax.set_xlabel("latency (s, log scale)")
    ax.set_ylabel("fraction of requests")
    ax.set_title(f"latency CDF: {s['n_requests']} requests, load {s['load']}, "
                 f"batch ≤ {s['max_batch']}, seed {s['seed']}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---- CLI (wired as `specgate sim` by specgate/cli.py) ------------------------------------------
def add_arguments(parser) -> None:
    parser.add_argument("--policies", default=",".join(DEFAULT_POLICIES),
                        help="comma-separated policy names")
    parser.add_argument("--requests", type=int, default=10_000)
    parser.add_argument("--load", type=float, default=0.85,
                        help="offered output tokens/s ÷ saturated goodput (see tools.sim)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--profile", default=None, help="step-cost profile JSON")
    parser.add_argument("--max-batch", type=int, default=8)
    parser.add_argument("--laps", default=None, metavar="JSON",
                        help='laps options, e.g. \'{"wait_weight": 0.05}\' (measuring a setting)')
    parser.add_argument("--token-budget", type=int, default=64)
    parser.add_argument("--aging-bound", type=float, default=60.0,
                        help="seconds; a negative value disables aging")
    parser.add_argument("--max-resident", type=int, default=32,
                        help="requests holding KV at once (the step loop's); 0: no limit")
    parser.add_argument("--prefill-chunk-tokens", type=int, default=0,
                        help="chunked prefill, as `specgate serve`'s flag (0: whole prefills, "
                             "each in a pass of its own)")
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="default",
                        help="default: four tenants with a length predictor; loadtest: what "
                             "`loadtest compare --max-tokens 8-256` sends (no predictor)")
    parser.add_argument("--predictor", default=str(MEASURED_PREDICTOR),
                        help="a `specgate bench lengths --json` file: the simulated length "
                             "predictor's error at arrival and as requests run is the measured "
                             "one (default: the shipped measurement of the default model); "
                             "'synthetic': the workload's own (arrival only)")
    parser.add_argument("--arrival-cv", type=float, default=1.0,
                        help="coefficient of variation of arrival gaps (1: Poisson, >1: bursty)")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1,
                        help="policies simulated in parallel (processes)")
    parser.add_argument("--json", dest="json_out", default=None, help="write results here")
    parser.add_argument("--plot", default=None, help="write latency CDFs (PNG) here")
    parser.add_argument("--keep-latencies", action="store_true",
                        help="keep every request's latency in the JSON")


def run(args) -> int:
    workload = replace(WORKLOADS[args.workload], arrival_cv=args.arrival_cv)
    if args.predictor != "synthetic" and workload.predictor_sigma is not None:
        measured = measured_predictor(args.predictor)
        if measured is None:
            raise SystemExit(f"no length-predictor measurement at {args.predictor}")
        workload = replace(workload, **measured)
    settings = SimSettings(n_requests=args.requests, load=args.load, seed=args.seed,
                           profile=args.profile, max_batch=args.max_batch,
                           token_budget=args.token_budget,
                           aging_bound_s=None if args.aging_bound < 0 else args.aging_bound,
                           max_resident=(max(args.max_resident, args.max_batch)
                                         if args.max_resident > 0 else None),
                           workload=workload, prefill_chunk_tokens=args.prefill_chunk_tokens,
                           calibration_requests=min(1000, max(200, args.requests)))
    if args.laps:
        settings = replace(settings, policy_options={"laps": json.loads(args.laps)})
    names = [p.strip() for p in args.policies.split(",") if p.strip()]
    result = run_sim(names, settings, jobs=args.jobs)
    if args.plot:
        plot_cdfs(result, args.plot)
    if not args.keep_latencies:
        for r in result["policies"].values():
            r.pop("latencies_s")
    if args.json_out:
        write_result(args.json_out, result)
    print(table(result))
    return 0
