"""Discrete-event simulator: the real step loop (scheduler.loop.StepLoop), with its planner,
policies, tree sizing and KV residency, against a workload model and a measured step-cost model.

    while requests remain:
        submit the requests that have arrived by the simulated clock (the loop's admission),
        loop.step(): plan, evict, prefill, step, commit, exactly as serving runs it,
        and when nothing is live, move the clock on to the next arrival

Nothing of the loop is written here. What has a model behind it is simulated (tools/sim_worker.py):
the worker samples each request's acceptance from its true α and the tree budget the planner
gave it, and advances the simulated clock by what the measured profile says the loop's prefills,
chunks and steps cost; the length predictor's beliefs carry the measured error. The loop writes
to a `NullStore` (no persistence to pay for) and runs on this thread, one `step()` at a time.

**Prefill and KV** are the loop's (scheduler/residency.py): a planned request without KV is
prefilled first, in a pass of its own at batch 1, and the step waits for it; at most
`max_resident` requests (32, the gateway's default) hold KV, and an evicted request pays a new
prefill of prompt + committed output when it is next planned. The policies get the same limit
(`PolicyConfig.max_resident`), so they start no request the KV cannot hold; without that gate,
aging and least-attained-service ordering thrash the cache once more than 32 requests are live.

**Chunked prefill** (`--prefill-chunk-tokens N`, as the gateway's flag): the loop admits a
planned request without a pass of its own, the plan carries chunks of its context beside the
other requests' trees, and the step that completes the context verifies its root and tree. Such
a step costs profile(batch of the verified requests, their tree tokens) plus each chunk's
measured cost (`StepCostModel.chunk`), the mixed step as the verifier runs it.

**Load** is defined as load = λ · E[L] ÷ C: λ the arrival rate (requests/s), E[L] the mean output
length of the generated requests, and C the engine's saturated goodput, i.e. committed output
tokens per second over the steps that ran at full batch when every request of an independent
sample of the same workload (1,000 requests) is queued at t = 0 and served FCFS with the same tree
budgets and prefill charges (at most 20,000 steps of it). At load 1 the arrivals ask for exactly
what a full engine can commit. A step costs much less at a small batch on the CPU profile, so a
load below 1 keeps the engine busy nearly all the time at a mean batch well below max_batch.

Output per policy: latency = finish − arrival (mean, p50, p99, max, per tenant); `max_wait_s` =
the longest gap any request spent unserved (arrival → first step, or between two of its steps),
which aging bounds; the clairvoyant `srpt` runs without aging, as the lower bound. Also: the
share of engine time spent prefilling and the number of re-prefills (evictions), and latency
split in two, `mean_in_steps_s` (time inside the steps a request was planned into, its own
prefill and its batch-mates' included) and `mean_wait_s` (the rest): an order of service moves
the waiting directly and the in-steps part only through the batch sizes it leads to, so the
split shows in every run how much a policy has to work with.
Engine defaults: max_batch 8 and token_budget 64, the range the default profile measured.

How much the order of service can matter here is written up in scheduler/policies/laps.py; the
figures are in docs/benchmarks.md (`specgate docs`, from results/sim_*.json).
"""
from __future__ import annotations

import json
import math
import os
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from scheduler.admission import ADMITTED, AdmissionControl, AdmissionLimits
from scheduler.events import Event, Finished, FinishedOnly
from scheduler.loop import StepLoop
from scheduler.policies import Policy, PolicyConfig, make_policy
from scheduler.profile import StepCostModel, prefill_steps
from scheduler.request import Request, RequestStats
from scheduler.tiers import TIERS
from scheduler.sizing import expected_tau, size_trees
from scheduler.store.null import NullStore
from tools.workload_gen import (LOADTEST_TENANTS, SimRequest, WorkloadSpec, generate,
                                    with_arrivals)
from tools.sim_slo import TierObjectivesMet, assign_tiers, parse_tiers, tier_wait_s
from tools.sim_worker import STOP, TOKEN, SimPredictor, SimWorker, belief
from workers.fake_worker import FakeClock
from loadtest.bootstrap import LEVEL, RESAMPLES, STATISTICS, intervals
from loadtest.results import write_result

DEFAULT_POLICIES = ("fcfs", "sjf", "las", "laps", "srpt")
TOP_TIER = TIERS[0]
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
    tiers: tuple[tuple[str, float], ...] = ()  # (service tier, share of requests); (): all default


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
    loop: StepLoop | None = None  # the loop that ran them
    slo: dict[str, Any] | None = None   # with tiers: `TierObjectivesMet.summary`


def simulate(policy: Policy, requests: list[SimRequest], cost: StepCostModel,
             spec: WorkloadSpec, admission: AdmissionLimits | None = None,
             stop_when_not_full: bool = False, max_steps: int | None = None,
             max_resident: int | None = 32, tiers: list[str] | None = None) -> RunOutcome:
    """Run `requests` (sorted by arrival) through the real step loop planned by `policy` until
    all admitted ones finish (module docstring). `max_resident`: requests holding KV at once
    (None: no limit), the loop's own. `tiers`: each request's service tier, by index (None: all
    default); then whether each met its tier's objectives is judged (tools/sim_slo.py)."""
    clock = FakeClock(0.0)
    worker = SimWorker(cost, clock, spec)
    lengths = SimPredictor(spec, worker.truth) if spec.repredict is not None else None
    loop = StepLoop(policy, worker, NullStore(), admission=AdmissionControl(admission),
                    max_resident=max_resident if max_resident is not None else 1 << 30,
                    clock=clock, lengths=lengths)
    finished: list[RequestStats] = []
    slo = TierObjectivesMet(clock, policy.config.aging_bound_s, cost=cost) \
        if tiers is not None else None

    def done(event: Finished) -> None:
        event.stats.tau_history = []            # the summary never reads it: 100k requests' worth
        finished.append(event.stats)

    def judged(event: Event) -> None:           # the tiers' objectives follow every token
        slo.event(event)
        if isinstance(event, Finished):
            done(event)

    # without tiers nothing reads the tokens: no `Delta` is built for them
    sink = judged if slo is not None else FinishedOnly(done)

    live, inbox = loop.state.requests, loop.intake.inbox
    i = refused = 0
    n = len(requests)
    max_step = 0.0
    while True:
        while i < n and requests[i].arrival_s <= clock.now:
            r = requests[i]
            i += 1
            worker.expect(r)
            req = _request(r, spec)
            if slo is not None:
                req.stats.tier = tiers[r.index]
                slo.arrived(req.stats)
            if loop.submit(req, sink) is not ADMITTED:
                worker.release(r.request_id)
                refused += 1
        if not live and not inbox:
            if i >= n:
                break
            clock.now = requests[i].arrival_s   # idle: on to the next arrival
            continue
        if stop_when_not_full and len(live) + len(inbox) < policy.config.max_batch:
            break                               # too few left for a full batch
        if max_steps is not None and loop.steps >= max_steps:
            break
        t0 = clock.now
        if loop.step():
            max_step = max(max_step, clock.now - t0)
        elif live:                              # nothing runnable: only an arrival changes that
            if i >= n:
                raise RuntimeError(f"the step loop planned nothing for {len(live)} live requests")
            clock.now = max(clock.now, requests[i].arrival_s)
    return RunOutcome(finished, refused, worker.steps, worker.busy_s, clock.now, loop.aged,
                      worker.batch_sum, worker.committed, worker.prefill_s, worker.reprefills,
                      max_step, loop, slo.summary(clock.now) if slo is not None else None)


def _request(r: SimRequest, spec: WorkloadSpec) -> Request:
    """What a client would send for `r`: a prompt of its length, its bound, its tenant; the
    belief at arrival when the predictor re-predicts (the gateway's, before its first step)."""
    stats = RequestStats(r.request_id, r.tenant, r.arrival_s, r.prompt_len, r.max_tokens,
                         r.priority, r.predicted_len)
    if spec.repredict is not None:
        stats.length_belief = belief(r, spec, 0)
    return Request(stats, [TOKEN] * r.prompt_len, stop_token_ids=(STOP,))


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
                        prefill_chunk_tokens=settings.prefill_chunk_tokens, learn_priors=False,
                        tier_wait_s=tier_wait_s() if settings.tiers else {})


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
    tiers = assign_tiers(len(reqs), settings.tiers, settings.seed) if settings.tiers else None
    t0 = time.perf_counter()
    out = simulate(policy, reqs, cost, settings.workload, settings.admission,
                   max_resident=settings.max_resident, tiers=tiers)
    wall = time.perf_counter() - t0
    result = summarize(name, out, policy, wall)
    if tiers is not None and TOP_TIER in tiers:
        # the top tier's requests again, every lower tier's removed: what this policy attains
        # for them when nothing else competes, the most an order of the lower tiers could leave
        alone = simulate(make_policy(name, _config(settings, cost), **opts),
                         [r for r in reqs if tiers[r.index] == TOP_TIER], cost,
                         settings.workload, settings.admission,
                         max_resident=settings.max_resident, tiers=tiers)
        result["slo_attainment_alone"] = {TOP_TIER: alone.slo["slo_attainment"][TOP_TIER]}
    return result


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
        **(out.slo or {}),                # with tiers: slo_attainment, goodput_tok_s
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
                     "saturated_goodput_tokens_per_s": capacity,
                     **({"tiers": dict(settings.tiers)} if settings.tiers else {})},
        "policies": {r["policy"]: r for r in results},
    }


def latency_intervals(result: dict[str, Any], resamples: int = RESAMPLES) -> dict[str, Any]:
    """95% bootstrap intervals (loadtest/bootstrap.py) of each policy's mean and p99 latency and
    of their ratios to fcfs and sjf (policy ÷ base). A run is one unit, one seed whose arrivals
    every policy was offered, so only the second stage moves: requests resampled within the run.
    The interval is this run's sampling spread, not the spread over arrival sequences (run seeds
    for that). Needs every request's latency (`latencies_s`); memory grows as resamples × requests."""
    unit = f"seed {result['settings']['seed']}"
    samples = {p: {unit: r["latencies_s"]} for p, r in result["policies"].items()}
    return {"level": LEVEL, "resamples": resamples, "units": [unit],
            **{key: intervals(samples, STATISTICS[stat], resamples=resamples)
               for key, stat in (("mean_latency_s", "mean"), ("p99_latency_s", "p99"))}}


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
    parser.add_argument("--tiers", type=parse_tiers, default=(),
                        metavar="TIER=SHARE,...",
                        help="service tiers of the requests, e.g. priority=0.2,default=0.5,flex=0.3: "
                             "each policy also reports the share of each tier's requests that met "
                             "the gateway's objectives for it and the goodput of those (default: "
                             "every request in the default tier, nothing judged)")
    parser.add_argument("--intervals", action="store_true",
                        help="add 95%% bootstrap intervals of each policy's mean and p99 latency "
                             "and of their ratios to fcfs and sjf (requests resampled within the run)")
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
                           calibration_requests=min(1000, max(200, args.requests)),
                           tiers=args.tiers)
    if args.laps:
        settings = replace(settings, policy_options={"laps": json.loads(args.laps)})
    names = [p.strip() for p in args.policies.split(",") if p.strip()]
    result = run_sim(names, settings, jobs=args.jobs)
    if args.plot:
        plot_cdfs(result, args.plot)
    if args.intervals:
        result["intervals"] = latency_intervals(result)
    if not args.keep_latencies:
        for r in result["policies"].values():
            r.pop("latencies_s")
    if args.json_out:
        write_result(args.json_out, result)
    print(table(result))
    return 0
