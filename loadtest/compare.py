"""`specgate loadtest compare`: the scheduling policies side by side on one workload.

    specgate loadtest compare --policies fcfs,sjf,laps --rate 8 --duration 60 --json cmp.json
    specgate loadtest compare --fake-worker --fake-step-ms 20 --rate 40 --duration 10 --plot cmp.png

For each policy, one embedded gateway (`gateway.builders.embedded.build_embedded`) is started in a fresh child
process, the same tenants are created in it with known keys, and `loadgen.loadtest` runs the same
arrivals (same seed, rate, duration, workloads, max tokens) against it; then the gateway stops and
the next policy gets a new one. The report has, per policy, the end-to-end latency mean/p50/p99,
TTFT p50/p99, completed and errors, and `laps_reduction_vs`: how much lower laps' mean latency is
than each other policy's, as a fraction of that policy's (0.25: laps is 25% faster on average).
From each gateway's /metrics, read once its load is done: `server_mean_latency_s` (arrival at the
gateway to the last token), `mean_in_steps_s` (inside the verification steps the request was in)
and `mean_wait_s`, their difference: the time spent queued or preempted, the only part of latency
an order of service moves directly, so the most any policy can take off the mean.

NOTE: a child process per policy, not the gateway in this process. In process, the gateway's
event loop and step loop would share the GIL with the load generator, so the client's own timing
would be part of every latency; and a fresh process per policy leaves nothing (warm caches, a
grown heap, a queue not yet drained) from one policy's run to the next. The cost is a start-up per
policy (short with the fake worker; the model load with a real one).

`--rounds N` runs every policy N times: round r uses seed + r (the same arrivals for every policy
within a round) and reverses the order of the policies every other round (fcfs,laps then laps,fcfs).
Each policy's row pools its rounds' requests; `rounds` keeps each round's means and laps'
reductions, whose spread is the run-to-run noise. Why: on these 2-core VMs the policy run first
was the slowest in both of two real-model runs, so that laps came out far ahead of fcfs in one
order and far behind it in the other.
One pass of each policy measures the machine's drift as much as the policies.

`srpt` among the policies: the clairvoyant bound on the real engine (scheduler/length_oracle.py).
First a truth pass asks a fresh gateway for every prompt of the workloads once, greedily, `max_batch`
at a time, and keeps each answer's length; the srpt gateway gets that table and ranks by the true
remaining tokens. Its row's `oracle_exact` is the share of its requests whose length the table
had exactly (greedy answers can differ by batch, where two tokens' scores are near ties).

`--seeds 1,4,7` runs the whole comparison (every round) once per seed: seed s's round r offers
the arrivals of seed s + r, and the order keeps alternating across them. Rows pool every seed's
rounds. `intervals` gives, for the mean, p99 and TTFT figures of each policy and for each
policy's ratio against fcfs and sjf, a 95% bootstrap interval (loadtest/bootstrap.py) paired by
(seed, round): with a few dozen requests per policy and round, a handful of long answers
decide a mean, and one seed's gap between policies can be mostly noise, which the interval shows.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import multiprocessing
import os
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from loadtest.loadgen import MAX_TOKENS_HELP, MaxTokens, max_tokens_label, parse_max_tokens
from loadtest.workload import WORKLOADS, load_workload
from scheduler.length_oracle import LengthOracle, prompt_key
from loadtest.results import write_result
from loadtest.bootstrap import RESAMPLES, LEVEL, STATISTICS, intervals

POLICIES = ("laps", "fcfs", "sjf", "las", "srpt")
ADMIN_KEY = "sk-loadtest-admin"             # each compare gateway's, to read its /metrics
# the server-side histograms whose sums and counts give the latency split (module docstring)
SPLIT_SERIES = {"e2e": "specgate_e2e_request_latency_seconds",
                "in_steps": "specgate_time_in_steps_seconds"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--policies", default="fcfs,sjf,laps",
                   help=f"comma-separated, from: {', '.join(POLICIES)}")
    p.add_argument("--rate", type=float, default=4.0, help="mean arrivals per second (with --load: "
                   "the rate of the capacity pass, which must saturate the gateway)")
    p.add_argument("--load", type=float, help="first measure capacity (one fcfs pass at --rate: "
                   "its completions per second), then offer LOAD x capacity to every policy")
    p.add_argument("--duration", type=float, default=30.0, help="seconds of arrivals per policy")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--seeds", help="comma-separated seeds (e.g. 1,4,7): the whole comparison once "
                   "per seed, rows pooled, intervals paired by (seed, round); overrides --seed")
    p.add_argument("--workloads", default="chat",
                   help=f"comma-separated, from: {', '.join(WORKLOADS)}")
    p.add_argument("--max-tokens", type=parse_max_tokens, default=64, help=MAX_TOKENS_HELP)
    p.add_argument("--tenants", type=int, default=2, help="number of tenants (keys made here)")
    p.add_argument("--bursty", action="store_true", help="gamma arrivals (see specgate loadtest)")
    p.add_argument("--model", help="model for the gateways (default: serve's default)")
    p.add_argument("--max-batch", type=int, help="requests per verification step")
    p.add_argument("--prefill-chunk-tokens", help="the gateways' --prefill-chunk-tokens; several "
                   "(comma-separated, e.g. 0,32): every policy runs once per value, as "
                   "POLICY@chunkN rows (chunked against whole prefill on the same load)")
    p.add_argument("--fake-worker", action="store_true",
                   help="no model: the scheduler's fake worker")
    p.add_argument("--fake-step-ms", type=float, default=10.0, help="fake worker sleep per step")
    p.add_argument("--rounds", type=int, default=1,
                   help="run every policy this many times, seed + round, the order reversed every "
                        "other round; rows pool the rounds (see the module docstring)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per request")
    p.add_argument("--json", type=Path, help="write the comparison here")
    p.add_argument("--plot", type=Path, help="end-to-end latency CDF per policy (PNG)")


def run(args: argparse.Namespace) -> int:
    policies = [x.strip() for x in args.policies.split(",") if x.strip()]
    chunks = [int(c) for c in (args.prefill_chunk_tokens or "").split(",") if c.strip()]
    variants = {f"chunk{c}": {"prefill_chunk_tokens": c} for c in chunks} if len(chunks) > 1 else None
    seeds = parse_seeds(args.seeds) if args.seeds else [args.seed]
    report = compare(policies, gateway_settings(args), tenants=args.tenants, rate=args.rate,
                     duration=args.duration, seeds=seeds, workloads=args.workloads.split(","),
                     max_tokens=args.max_tokens, bursty=args.bursty, timeout=args.timeout,
                     rounds=args.rounds, load=args.load, variants=variants)
    if args.json:
        write_result(args.json, report)
    if args.plot:
        plot(report, args.plot)
    print(table(report))
    return 0


def gateway_settings(args: argparse.Namespace) -> dict:
    """The `Settings` fields every policy's gateway shares (the policy is set per run)."""
    s: dict[str, Any] = {"redis_url": None, "tenants_file": None, "log_level": "warning"}
    if args.model:
        s["model"] = args.model
    if args.max_batch:
        s["max_batch"] = args.max_batch
    chunks = [c for c in (getattr(args, "prefill_chunk_tokens", None) or "").split(",") if c.strip()]
    if len(chunks) == 1:
        s["prefill_chunk_tokens"] = int(chunks[0])
    if args.fake_worker:
        s.update(fake_worker=True, fake_step_ms=args.fake_step_ms)
    return s


# ---- pure parts ----------------------------------------------------------------------------------
def parse_seeds(text: str) -> list[int]:
    """`--seeds 1,4,7` as a list; ValueError naming the bad entry."""
    try:
        seeds = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--seeds must be comma-separated integers, got {text!r}") from None
    if not seeds or len(set(seeds)) != len(seeds):
        raise ValueError(f"--seeds must name at least one seed, each once, got {text!r}")
    return seeds


def units(seeds: list[int], rounds: int) -> list[tuple[int, int, int]]:
    """(seed, round, arrivals seed) of every run of the comparison: seed + round, as a single
    seed's rounds always were. Two runs on the same arrivals would count one draw twice in the
    intervals, so seeds closer than `rounds` apart are refused."""
    out = [(s, r, s + r) for s in seeds for r in range(rounds)]
    arrivals = [a for _, _, a in out]
    if len(set(arrivals)) != len(arrivals):
        raise ValueError(f"--seeds {','.join(map(str, seeds))} with --rounds {rounds} offer the same "
                         f"arrivals twice (seed s, round r uses seed s + r): space the seeds at "
                         f"least {rounds} apart")
    return out


# the interval figures: row key -> (the per-request samples it is over, the statistic)
INTERVAL_FIGURES = {"mean_latency_s": ("e2e_s", "mean"), "p99_latency_s": ("e2e_s", "p99"),
                    "ttft_p50_s": ("ttft_s", "p50"), "ttft_p99_s": ("ttft_s", "p99")}


def unit_label(seed: int, rnd: int) -> str:
    return f"seed {seed} round {rnd}"


def comparison_intervals(by_unit: dict[str, dict[str, dict[str, list[float]]]],
                         resamples: int = RESAMPLES, seed: int = 0) -> dict:
    """`by_unit`: policy -> unit label -> {"e2e_s": [...], "ttft_s": [...]} (each run's
    loadgen samples). For every figure of `INTERVAL_FIGURES`, each policy's interval and each
    policy's ratio to fcfs and to sjf (policy ÷ base), paired by unit."""
    out: dict[str, Any] = {"level": LEVEL, "resamples": resamples,
                           "units": list(next(iter(by_unit.values()), {}))}
    for key, (series, stat) in INTERVAL_FIGURES.items():
        samples = {p: {u: s.get(series, []) for u, s in runs.items()} for p, runs in by_unit.items()}
        out[key] = intervals(samples, STATISTICS[stat], resamples=resamples, seed=seed)
    return out


def reduction(base: float | None, new: float | None) -> float | None:
    """How much lower `new` is than `base`, as a fraction of `base`: reduction(2.0, 1.5) == 0.25;
    negative when `new` is higher; None when either is missing or `base` is not positive."""
    if base is None or new is None or base <= 0:
        return None
    return (base - new) / base


def policy_row(report: dict) -> dict:
    """One policy's line of the comparison, from a `loadgen` report."""
    o = report["overall"]
    return {"mean_latency_s": o["e2e_s"]["mean"], "p50_latency_s": o["e2e_s"]["p50"],
            "p99_latency_s": o["e2e_s"]["p99"], "ttft_p50_s": o["ttft_s"]["p50"],
            "ttft_p99_s": o["ttft_s"]["p99"], "requests": o["requests"],
            "completed": o["completed"], "errors": o["requests"] - o["completed"],
            "errors_by_type": o["errors_by_type"], "output_tokens_per_s": o["output_tokens_per_s"],
            # completions a second over the run: near the server's capacity when the rate
            # saturates it, which is how "~85% of capacity" is found
            "completed_per_s": o["completed_per_s"],
            # time between a stream's token events (one round only: rounds keep no samples)
            "itl_p99_s": (o.get("itl_s") or {}).get("p99"),
            "generator_lag_p99_ms": report["generator_lag_ms"]["p99"],
            **latency_split(report.get("server"))}


def metrics_text(url: str, admin_key: str) -> str | None:
    """The gateway's /metrics page, or None where it does not answer."""
    import httpx

    try:
        r = httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {admin_key}"}, timeout=30)
        r.raise_for_status()
    except httpx.HTTPError:
        return None
    return r.text


def metric_sums(text: str, names: set[str]) -> dict[str, float]:
    """The samples of a /metrics page named in `names`, each summed over its labels; a name
    without samples is left out."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in names:
                out[sample.name] = out.get(sample.name, 0.0) + sample.value
    return out


def server_sums(text: str) -> dict[str, float]:
    """`{e2e,in_steps}_{sum,count}` over every tenant, from a gateway's /metrics text."""
    names = {f"{series}_{part}": f"{key}_{part}" for key, series in SPLIT_SERIES.items()
             for part in ("sum", "count")}
    found = metric_sums(text, set(names))
    return {key: found.get(name, 0.0) for name, key in names.items()}


def latency_split(sums: dict[str, float] | None) -> dict[str, float | None]:
    """Server-side mean latency, mean time in steps and their difference, the mean wait.

    >>> latency_split({"e2e_sum": 30.0, "e2e_count": 10, "in_steps_sum": 20.0, "in_steps_count": 10})
    {'server_mean_latency_s': 3.0, 'mean_in_steps_s': 2.0, 'mean_wait_s': 1.0}
    """
    mean = lambda k: (sums[k + "_sum"] / sums[k + "_count"]          # noqa: E731
                      if sums and sums.get(k + "_count") else None)
    e2e, in_steps = mean("e2e"), mean("in_steps")
    wait = e2e - in_steps if e2e is not None and in_steps is not None else None
    return {"server_mean_latency_s": e2e, "mean_in_steps_s": in_steps, "mean_wait_s": wait}


def read_server_sums(url: str) -> dict[str, float] | None:
    """`server_sums` of the compare gateway at `url`, or None where /metrics cannot be read."""
    text = metrics_text(url, ADMIN_KEY)
    if text is None:
        print(f"compare: could not read {url}/metrics", file=sys.stderr)
        return None
    return server_sums(text)


def laps_reductions(rows: dict[str, dict], key: str) -> dict[str, float | None]:
    """laps' reduction of `key` against each other policy's (`rows` holds laps)."""
    return {p: reduction(r[key], rows["laps"][key]) for p, r in rows.items() if p != "laps"}


def comparison(reports: dict[str, dict], settings: dict) -> dict:
    """Per policy rows, laps' reductions against the others (mean and p99 latency) and each
    policy's end-to-end samples (for the CDF)."""
    rows = {name: policy_row(rep) for name, rep in reports.items()}
    out: dict[str, Any] = {"settings": settings, "policies": rows}
    if "laps" in rows:
        out["laps_reduction_vs"] = laps_reductions(rows, "mean_latency_s")
        out["laps_p99_reduction_vs"] = laps_reductions(rows, "p99_latency_s")
    out["samples"] = {name: rep["samples"]["overall"]["e2e_s"] for name, rep in reports.items()}
    return out


def round_order(policies: list[str], r: int) -> list[str]:
    """The order of round `r`: as given in even rounds, reversed in odd ones."""
    return list(policies) if r % 2 == 0 else list(reversed(policies))


def pooled(reports: list[dict]) -> dict:
    """One policy's rounds (`loadgen` reports) as one report of the fields `policy_row` reads:
    latency figures over every round's requests, counts summed, rates averaged over the rounds,
    the generator's worst p99 lag."""
    from loadtest.loadgen import stats

    if len(reports) == 1:
        return reports[0]
    e2e = [x for rep in reports for x in rep["samples"]["overall"]["e2e_s"]]
    ttft = [x for rep in reports for x in rep["samples"]["overall"].get("ttft_s", [])]
    overall = [rep["overall"] for rep in reports]
    types: dict[str, int] = {}
    for o in overall:
        for t, n in o["errors_by_type"].items():
            types[t] = types.get(t, 0) + n

    def mean_of(key: str) -> float | None:
        xs = [o[key] for o in overall if o[key] is not None]
        return sum(xs) / len(xs) if xs else None

    lags = [rep["generator_lag_ms"]["p99"] for rep in reports
            if rep["generator_lag_ms"]["p99"] is not None]
    servers = [rep["server"] for rep in reports if rep.get("server")]
    return {"server": {k: sum(x[k] for x in servers) for k in servers[0]} if servers else None,
            "overall": {"e2e_s": stats(e2e), "ttft_s": stats(ttft),
                        "requests": sum(o["requests"] for o in overall),
                        "completed": sum(o["completed"] for o in overall), "errors_by_type": types,
                        "output_tokens_per_s": mean_of("output_tokens_per_s"),
                        "completed_per_s": mean_of("completed_per_s")},
            "generator_lag_ms": {"p99": max(lags, default=None)},
            "samples": {"overall": {"e2e_s": e2e, "ttft_s": ttft}}}


def round_summary(order: list[str], reports: dict[str, dict]) -> dict:
    """One round: its order, each policy's mean latency, laps' reductions of the mean."""
    rows = {p: policy_row(reports[p]) for p in order}
    out: dict[str, Any] = {"order": order,
                           "mean_latency_s": {p: r["mean_latency_s"] for p, r in rows.items()}}
    if "laps" in rows:
        out["laps_reduction_vs"] = laps_reductions(rows, "mean_latency_s")
    return out


def tenant_keys(n: int) -> list[tuple[str, str]]:
    """(name, key) of the `n` tenants every gateway gets: the same in every run."""
    if n < 1:
        raise ValueError("--tenants must be at least 1")
    return [(f"t{i}", f"sk-loadtest-{i}") for i in range(n)]


# ---- the runs ------------------------------------------------------------------------------------
def compare(policies: list[str], settings: dict, *, tenants: int = 2, rate: float,
            duration: float, seed: int = 0, seeds: list[int] | None = None,
            workloads: list[str] = ("chat",),
            max_tokens: MaxTokens = 64, bursty: bool = False, timeout: float = 300.0,
            rounds: int = 1, load: float | None = None,
            variants: dict[str, dict] | None = None) -> dict:
    """Run the same load against one fresh gateway per policy (per round); the comparison.
    `load`: first measure capacity with one fcfs pass at `rate` (its completions per second, a
    seed of its own), then offer `load` × capacity instead of `rate`. `variants`: settings to
    run every policy under, by name: the rows are then POLICY@NAME. `seeds`: run the whole
    comparison once per seed (module docstring); default: [`seed`]."""
    bad = [p for p in policies if p not in POLICIES]
    if bad or not policies:
        raise ValueError(f"unknown policy {bad[0] if bad else ''!r}; from: {', '.join(POLICIES)}")
    if rounds < 1:
        raise ValueError("--rounds must be at least 1")
    seeds = list(seeds) if seeds else [seed]
    runs, seed = units(seeds, rounds), seeds[0]
    if load is not None and not load > 0:
        raise ValueError(f"--load must be > 0, got {load}")
    keys = tenant_keys(tenants)
    oracle, per_policy = None, {p: settings for p in policies}
    if "srpt" in policies:
        print("compare: truth pass (every prompt's length, for srpt)", file=sys.stderr, flush=True)
        oracle = truth_pass(settings, keys, workloads, max_tokens, timeout)
        # removed with its files once compare returns or raises (its finalizer, at the last reference)
        table_dir = tempfile.TemporaryDirectory(prefix="specgate-oracle-")
        path = Path(table_dir.name) / "oracle.json"
        oracle.save(path)
        per_policy["srpt"] = {**settings, "length_oracle": str(path)}

    def one(name: str, at: float, run_seed: int) -> dict:
        policy, _, variant = name.partition("@")
        run = {**per_policy.get(policy, settings), **(variants or {}).get(variant, {})}
        report = _one_gateway(run, policy, keys, rate=at,
                              duration=duration, seed=run_seed, workloads=workloads,
                              max_tokens=max_tokens, bursty=bursty, timeout=timeout)
        if policy == "srpt" and oracle is not None:
            report["oracle_exact"] = oracle_exact(oracle, report["samples"]["overall"]["lengths"])
        return report

    capacity = None
    if load is not None:
        print(f"compare: capacity pass, fcfs at {rate}/s", file=sys.stderr, flush=True)
        probe = one("fcfs", rate, seed + 10_007)["overall"]
        # a saturated gateway is busy until its backlog drains: completions ÷ elapsed is its rate
        done_per_s = probe["completed_per_s"]
        capacity = {"probe_rate": rate, "completed_per_s": done_per_s, "load": load,
                    "probe_errors": probe["requests"] - probe["completed"]}
        if not done_per_s:
            raise RuntimeError("the capacity pass completed nothing; raise --duration")
        rate = load * done_per_s
        print(f"compare: capacity {done_per_s:.3f}/s; offering {rate:.3f}/s",
              file=sys.stderr, flush=True)
    names = [f"{p}@{v}" for p in policies for v in variants] if variants else list(policies)
    by_round: list[tuple[list[str], dict[str, dict]]] = []
    for i, (s, r, arrivals) in enumerate(runs):
        order, reports = round_order(names, i), {}
        for policy in order:
            print(f"compare: seed {s}, round {r + 1}/{rounds}, policy {policy}: starting a gateway",
                  file=sys.stderr, flush=True)
            reports[policy] = one(policy, rate, arrivals)
        by_round.append((order, reports))
    run_settings = {"policies": list(names), "rate": rate, "duration": duration, "seed": seed,
                    "seeds": seeds, "capacity": capacity,
                    "rounds": rounds,
                    "workloads": list(workloads), "max_tokens": max_tokens_label(max_tokens),
                    "tenants": tenants,
                    "bursty": bursty, "gateway": {k: v for k, v in settings.items()
                                                  if k not in ("redis_url", "tenants_file")}}
    out = comparison({p: pooled([reps[p] for _, reps in by_round]) for p in names}, run_settings)
    out["rounds"] = [{"seed": s, "round": r, "arrivals_seed": a, **round_summary(order, reps)}
                     for (s, r, a), (order, reps) in zip(runs, by_round)]
    out["intervals"] = comparison_intervals(
        {p: {unit_label(s, r): reps[p]["samples"]["overall"]
             for (s, r, _), (_, reps) in zip(runs, by_round)} for p in names})
    rows = out["policies"]
    if {"fcfs", "laps", "srpt"} <= set(rows):
        # the part of the clairvoyant bound's reduction of fcfs's mean that laps takes
        f, l, b = (rows[p]["mean_latency_s"] for p in ("fcfs", "laps", "srpt"))
        out["laps_share_of_srpt"] = (f - l) / (f - b) if None not in (f, l, b) and f != b else None
    if oracle is not None:
        exact = [reps["srpt"]["oracle_exact"] for _, reps in by_round]
        out["policies"]["srpt"]["oracle_exact"] = sum(exact) / len(exact)
        out["oracle"] = {"prompts": len(oracle.lengths), "cap": oracle.cap,
                         "ran_to_cap": sum(n >= oracle.cap for n in oracle.lengths.values())}
    return out


def truth_pass(settings: dict, keys: list[tuple[str, str]], workloads, max_tokens: MaxTokens,
               timeout: float) -> LengthOracle:
    """Every prompt of `workloads` asked once of a fresh fcfs gateway (greedy, `max_batch` at a
    time, the largest max_tokens the load test draws): the table of their lengths."""
    cap = max_tokens if isinstance(max_tokens, int) else max_tokens[1]
    records = [rec for w in workloads for rec in load_workload(w)]
    with gateway_process({**settings, "policy": "fcfs", "admin_key": ADMIN_KEY}, keys) as gw:
        lengths = asyncio.run(_answer_lengths(gw.url, keys[0][1], records, cap,
                                              settings.get("max_batch", 8), timeout))
    return LengthOracle(cap, lengths)


async def _answer_lengths(url: str, key: str, records: list[dict], cap: int, at_once: int,
                          timeout: float) -> dict[str, int]:
    import httpx

    from loadtest.loadgen import _discover_model

    gate = asyncio.Semaphore(at_once)
    async with httpx.AsyncClient(base_url=url, timeout=timeout) as client:
        model = await _discover_model(client, [key])

        async def one(rec: dict) -> tuple[str, int]:
            body = {"model": model, "messages": rec["messages"], "max_tokens": cap,
                    "temperature": 0}
            async with gate:
                resp = await client.post("/v1/chat/completions", json=body,
                                         headers={"Authorization": f"Bearer {key}"})
            resp.raise_for_status()
            return prompt_key(messages=rec["messages"]), resp.json()["usage"]["completion_tokens"]

        return dict(await asyncio.gather(*(one(r) for r in records)))


def oracle_exact(oracle: LengthOracle, lengths: list[list]) -> float | None:
    """The share of (prompt key, max_tokens, output tokens) whose length the oracle had exactly."""
    if not lengths:
        return None
    return sum(oracle.length(k, limit) == n for k, limit, n in lengths) / len(lengths)


def _one_gateway(settings: dict, policy: str, keys: list[tuple[str, str]], *, rate: float,
                 duration: float, seed: int, workloads, max_tokens: MaxTokens, bursty: bool,
                 timeout: float) -> dict:
    """One policy's load against a fresh gateway: the loadgen report, with the server's sums."""
    from loadtest.loadgen import loadtest

    with gateway_process({**settings, "policy": policy, "admin_key": ADMIN_KEY}, keys) as gw:
        report = asyncio.run(loadtest(gw.url, keys, rate=rate, duration=duration, seed=seed,
                                      workloads=list(workloads), max_tokens=max_tokens,
                                      bursty=bursty, timeout=timeout))
        report["server"] = read_server_sums(gw.url)
    return report


@dataclass
class GatewayProcess:
    """A gateway serving in a child process: its base URL and process id."""
    url: str
    pid: int


@contextlib.contextmanager
def gateway_process(settings: dict, tenants: list[tuple[str, str]],
                    start_timeout: float = 600.0) -> Iterator[GatewayProcess]:
    """An embedded gateway over `Settings(**settings)` in a child process, serving HTTP on a free
    loopback port, with `tenants` ((name, key) pairs) created, until the block ends. A real model
    loads in the child, hence the long default `start_timeout`."""
    ctx = multiprocessing.get_context("spawn")        # never fork a process that holds threads
    here, there = ctx.Pipe()
    # not daemonic: a gateway starts processes of its own (grammar compiles), which a daemonic
    # process may not; it still ends with this one, whose pipe closing is its "stop"
    child = ctx.Process(target=_child_main, args=(settings, tenants, there),
                        name="specgate-gateway", daemon=False)
    child.start()
    there.close()
    try:
        if not here.poll(start_timeout):
            raise RuntimeError(f"the gateway process did not start within {start_timeout:g} s")
        answer = recv_or_none(here)
        if answer is None:
            raise RuntimeError(f"the gateway process died (exit code {child.exitcode})")
        if isinstance(answer, BaseException):
            raise answer
        yield GatewayProcess(*answer)
    finally:
        with contextlib.suppress(OSError):
            here.send("stop")
        child.join(15)
        if child.is_alive():
            child.terminate()
            child.join(5)
        here.close()


def _child_main(settings: dict, tenants: list[tuple[str, str]], conn: Any) -> None:
    """The gateway process: build, add the tenants, serve until "stop" or the parent is gone."""
    try:
        from gateway.http.server import background_server
        from gateway.builders.embedded import build_embedded
        from gateway.settings import Settings
        from gateway.tenancy.records import Tenant

        emb = build_embedded(Settings(**settings), progress=False)
        for name, key in tenants:
            emb.tenants.put(Tenant(name), [key])
        emb.start()
        try:
            with background_server(emb.app) as url:
                conn.send((url, os.getpid()))
                recv_or_none(conn)                         # "stop", or None: the parent is gone
        finally:
            emb.stop()
    except Exception as exc:
        with contextlib.suppress(OSError):
            conn.send(RuntimeError(f"the gateway process failed: {exc!r}"))


# ---- output --------------------------------------------------------------------------------------
def table(report: dict) -> str:
    """The comparison as a fixed-width table, latencies in ms."""
    ms = lambda x: "-" if x is None else f"{1000 * x:.1f}"          # noqa: E731
    pct = lambda x: "-" if x is None else f"{100 * x:+.1f}%"        # noqa: E731
    red = report.get("laps_reduction_vs", {})
    per_s = lambda x: "-" if x is None else f"{x:.2f}"              # noqa: E731
    w = max([8, *(len(n) + 1 for n in report["policies"])])
    lines = [f"{'policy':<{w}}{'done':>7}{'done/s':>8}{'errors':>7}{'mean ms':>10}{'p50 ms':>10}{'p99 ms':>10}"
             f"{'ttft p50':>10}{'ttft p99':>10}{'itl p99':>10}{'wait ms':>10}{'steps ms':>10}"
             f"{'laps vs':>10}"]
    for name, r in report["policies"].items():
        lines.append(f"{name:<{w}}{r['completed']:>7}{per_s(r['completed_per_s']):>8}{r['errors']:>7}"
                     f"{ms(r['mean_latency_s']):>10}"
                     f"{ms(r['p50_latency_s']):>10}{ms(r['p99_latency_s']):>10}"
                     f"{ms(r['ttft_p50_s']):>10}{ms(r['ttft_p99_s']):>10}{ms(r.get('itl_p99_s')):>10}"
                     f"{ms(r.get('mean_wait_s')):>10}{ms(r.get('mean_in_steps_s')):>10}"
                     f"{pct(red[name]) if name in red else '':>10}")
    rounds = report.get("rounds", [])
    if len(rounds) > 1:
        for i, r in enumerate(rounds, 1):
            means = ", ".join(f"{p} {ms(x)}" for p, x in r["mean_latency_s"].items())
            vs = ", ".join(f"{p} {pct(x)}" for p, x in r.get("laps_reduction_vs", {}).items())
            lines.append(f"round {i}: mean ms {means}" + (f"; laps vs {vs}" if vs else ""))
    lines += interval_lines(report.get("intervals"))
    cap = report.get("settings", {}).get("capacity")
    if cap:
        lines.append(f"capacity {cap['completed_per_s']:.3f}/s (fcfs at {cap['probe_rate']}/s); "
                     f"offered {cap['load']} x capacity = {report['settings']['rate']:.3f}/s")
    return "\n".join(lines)


def interval_lines(iv: dict | None) -> list[str]:
    """The bootstrap intervals as lines: per figure, each policy's value [low, high] in ms,
    then each ratio [low, high]."""
    if not iv:
        return []
    ms = lambda x: "-" if x is None else f"{1000 * x:.1f}"          # noqa: E731
    ratio = lambda x: "-" if x is None else f"{x:.3f}"              # noqa: E731
    out = [f"{100 * iv['level']:g}% bootstrap intervals over {len(iv['units'])} runs "
           f"(paired by seed and round, {iv['resamples']} resamples):"]
    for key in INTERVAL_FIGURES:
        fig = iv.get(key)
        if not fig:
            continue
        values = ", ".join(f"{p} {ms(c['estimate'])} [{ms(c['low'])}, {ms(c['high'])}]"
                           for p, c in fig["policies"].items())
        out.append(f"  {key} ms: {values}")
        if fig["ratios"]:
            ratios = ", ".join(f"{name} {ratio(c['estimate'])} [{ratio(c['low'])}, {ratio(c['high'])}]"
                               for name, c in fig["ratios"].items())
            out.append(f"  {key} ratios: {ratios}")
    return out


def plot(report: dict, path: Path) -> None:
    """End-to-end latency CDF, one line per policy."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, xs in report["samples"].items():
        if xs:
            s = np.sort(xs)
            ax.step(s, np.arange(1, len(s) + 1) / len(s), where="post", label=name)
    s = report["settings"]
    ax.set(title=f"end-to-end latency, {s['rate']:g} req/s for {s['duration']:g} s",
           xlabel="seconds", ylabel="fraction of requests")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def recv_or_none(conn: Any) -> Any:
    """The next message on a multiprocessing pipe, or None once the other end is gone."""
    try:
        return conn.recv()
    except EOFError:
        return None
