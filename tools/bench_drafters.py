"""`specgate bench drafters`: tokens per step (τ) of several drafters on the same mixed workload.

    specgate bench drafters --drafters ngram,suffix,merge:ngram+suffix --json drafters.json

What it answers: does a merged tree beat its parts? Every drafter runs the same prompts, single
stream, greedy, in one process: first `--warmup` prompts of each workload (unmeasured: they fill
learning drafters' caches, as a deployment that has served this traffic before), then
`--per-workload` measured prompts of each, workloads interleaved, one tenant. By default every
step drafts the whole `--tree-nodes`/`--tree-depth` budget (`--adaptive`: per-request sizing, as
served), so τ compares the drafters' trees at equal verification budget.

Report, per drafter: τ overall and per workload, acceptance (accepted ÷ drafted), drafted nodes
per step, wall time; `best_single`: the non-merge drafter with the highest τ, and per merge
`tau_vs_best_single`. Greedy output must not depend on the drafter: `identical` compares every
drafter's tokens with the first one's.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any, Sequence

from loadtest.workload import WORKLOADS, load_workload
from workers.contract import SamplingParams
from workers.contract import TreeBudget
from workers.drafters.registry import MERGE_PREFIX, create_drafter
from scheduler.profile import StepCostModel
from scheduler.generation import Engine, GenerationRequest
from workers.loader import DEFAULT_MODEL


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--drafters", default="ngram,suffix,merge:ngram+suffix",
                   help="comma-separated drafter names; the first one's output is the reference")
    p.add_argument("--workloads", default=",".join(WORKLOADS), help="comma-separated, mixed")
    p.add_argument("--per-workload", type=int, default=4, help="measured prompts per workload")
    p.add_argument("--warmup", type=int, default=2,
                   help="unmeasured prompts per workload first (the ones after the measured ones)")
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--tree-nodes", type=int, default=32)
    p.add_argument("--tree-depth", type=int, default=24)
    p.add_argument("--adaptive", action="store_true",
                   help="size each request's tree from its acceptance, as served (default: the "
                        "whole budget every step)")
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--json", type=Path, help="write the report here")


def run(args: argparse.Namespace) -> int:
    from workers.runtime import encode_record, load_runtime

    drafters = [d.strip() for d in args.drafters.split(",") if d.strip()]
    workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    if not drafters or args.per_workload < 1 or args.warmup < 0:
        raise ValueError("name at least one drafter; --per-workload must be >= 1, --warmup >= 0")
    rt = load_runtime(args.model, progress=False)
    measured, warm = split_prompts({w: load_workload(w) for w in workloads}, args.per_workload, args.warmup)
    encode = lambda pairs: [(w, encode_record(rt.tokenizer, r)) for w, r in pairs]   # noqa: E731
    report = bench_drafters(rt, drafters, encode(measured), encode(warm),
                            TreeBudget(args.tree_nodes, args.tree_depth), adaptive=args.adaptive,
                            max_tokens=args.max_tokens)
    text = json.dumps(report, indent=1)
    if args.json:
        args.json.write_text(text + "\n", encoding="utf-8")
    print(text)
    return 0


def split_prompts(records: dict[str, list], per_workload: int,
                  warmup: int) -> tuple[list[tuple[str, Any]], list[tuple[str, Any]]]:
    """(measured, warm-up) lists of (workload, record): each workload's first `per_workload`
    records are measured and the next `warmup` warm up; both interleaved by workload.

    >>> split_prompts({"a": [1, 2, 3], "b": [7, 8, 9]}, 2, 1)
    ([('a', 1), ('b', 7), ('a', 2), ('b', 8)], [('a', 3), ('b', 9)])
    """
    for name, recs in records.items():
        if len(recs) < per_workload + warmup:
            raise ValueError(f"workload {name!r} has {len(recs)} prompts: fewer than "
                             f"--per-workload {per_workload} + --warmup {warmup}")
    return (_interleave({w: r[:per_workload] for w, r in records.items()}),
            _interleave({w: r[per_workload:per_workload + warmup] for w, r in records.items()}))


def _interleave(groups: dict[str, list]) -> list[tuple[str, Any]]:
    longest = max((len(g) for g in groups.values()), default=0)
    return [(w, g[i]) for i in range(longest) for w, g in groups.items() if i < len(g)]


def merge_ratios(taus: dict[str, float]) -> dict[str, Any]:
    """The best non-merge drafter, and each merge's τ against it.

    >>> merge_ratios({"ngram": 2.0, "suffix": 2.2, "merge:ngram+suffix": 2.42})
    {'best_single': 'suffix', 'tau_vs_best_single': {'merge:ngram+suffix': 1.1}}
    """
    singles = {d: t for d, t in taus.items() if not d.startswith(MERGE_PREFIX)}
    best = max(singles, key=singles.get) if singles else None
    return {"best_single": best,
            "tau_vs_best_single": {d: round(t / singles[best], 3) for d, t in taus.items()
                                   if d.startswith(MERGE_PREFIX) and best is not None}}


def bench_drafters(rt: Any, drafters: Sequence[str], measured: Sequence[tuple[str, list[int]]],
                   warm: Sequence[tuple[str, list[int]]], budget: TreeBudget, *, adaptive: bool = False,
                   max_tokens: int = 96) -> dict:
    """Run every drafter over the same prompts (see the module docstring); the report."""
    cost = StepCostModel.from_doc(rt.step_profile(1, budget.max_nodes)) if adaptive else None
    results: dict[str, dict] = {}
    outputs: dict[str, list[list[int]]] = {}
    for name in drafters:
        engine = Engine(rt.verifier(max_tree_tokens=max(64, budget.max_nodes)), create_drafter(name),
                        budget, adaptive=adaptive, step_cost=cost)

        def generate(i: int, ids: list[int], tag: str):
            req = GenerationRequest(f"{tag}{i}", tuple(ids), max_tokens, SamplingParams(), rt.stop_token_ids)
            return engine.generate([req])[0]

        for i, (_, ids) in enumerate(warm):
            generate(i, ids, "w")
        per: dict[str, list[int]] = {}          # workload -> [tokens, steps, drafted, accepted]
        outs = []
        t0 = time.perf_counter()
        for i, (workload, ids) in enumerate(measured):
            res = generate(i, ids, "m")
            outs.append(res.token_ids)
            acc = per.setdefault(workload, [0, 0, 0, 0])
            for j, v in enumerate((len(res.token_ids), res.steps, res.drafted, res.accepted)):
                acc[j] += v
        wall = time.perf_counter() - t0
        tokens, steps, drafted, accepted = (sum(a[j] for a in per.values()) for j in range(4))
        outputs[name] = outs
        results[name] = {
            "tau": round(tokens / steps, 3), "alpha": round(accepted / drafted, 3) if drafted else 0.0,
            "drafted_per_step": round(drafted / steps, 2), "tokens": tokens, "steps": steps,
            "wall_s": round(wall, 2),
            "tau_by_workload": {w: round(a[0] / a[1], 3) for w, a in per.items()},
        }
        print(f"{name}: tau {results[name]['tau']} ({wall:.0f} s)", file=sys.stderr, flush=True)
    reference = outputs[drafters[0]]
    return {
        "prompts": len(measured), "warmup_prompts": len(warm), "max_tokens": max_tokens,
        "tree_budget": {"max_nodes": budget.max_nodes, "max_depth": budget.max_depth},
        "adaptive": adaptive, "drafters": results,
        **merge_ratios({d: r["tau"] for d, r in results.items()}),
        "identical": all(outputs[d] == reference for d in drafters),
    }
