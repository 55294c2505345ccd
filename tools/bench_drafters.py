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

Costs, per drafter: drafting time per step and per level drafted (a model drafter runs one pass
per level: its cost per draft token, also as a share of a plain target step), verification time
per step, tokens/s over the measured prompts (wall time, prefills included). With ``none``
(plain decoding) among the drafters (the CLI runs it first unless named), each drafter gets its
measured multiplier (tokens/s ÷ plain tokens/s) beside SPIRe's predicted one, TM = τ ÷
((k·t_draft + t_verify) ÷ t_target) from the same run's per-step costs (tools/throughput.py);
what the prediction leaves out (prefills, the loop's bookkeeping) is the gap between them.
``--rounds R`` repeats every drafter's pass R times, alternating the order, and reports the sums
with each round's multipliers (`bench_drafters`): one pass measures a noisy machine's drift too.

``self`` or ``self:SINK:WINDOW`` names MagicDec-style self-speculation, SPIRe's baseline: the
target itself drafts, attending only to a sink and a sliding window (default 4 and 256).

    specgate bench drafters --workload chat --drafters none,ngram,self,DRAFT_DIR,merge:DRAFT_DIR+ngram
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
from workers.drafters.neural.draft_model import DraftSpec
from workers.drafters.base import Drafter
from workers.drafters.model import ModelDrafter, is_model_dir
from workers.drafters.registry import MERGE_PREFIX, create_drafter
from tools.throughput import spire_multiplier
from scheduler.profile import StepCostModel
from scheduler.generation import Engine, GenerationRequest
from workers.model.loader import DEFAULT_MODEL
from loadtest.results import write_result


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--drafters", default="ngram,suffix,merge:ngram+suffix",
                   help="comma-separated drafter names; the first one's output is the reference")
    p.add_argument("--workloads", "--workload", default=",".join(WORKLOADS), help="comma-separated, mixed")
    p.add_argument("--per-workload", type=int, default=4, help="measured prompts per workload")
    p.add_argument("--warmup", type=int, default=2,
                   help="unmeasured prompts per workload first (the ones after the measured ones)")
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--tree-nodes", type=int, default=32)
    p.add_argument("--tree-depth", type=int, default=24)
    p.add_argument("--chain", action="store_true",
                   help="model drafters (a draft directory, self) draft one chain (SPIRe's k-token chain) "
                        "rather than a dynamic tree")
    p.add_argument("--adaptive", action="store_true",
                   help="size each request's tree from its acceptance, as served (default: the "
                        "whole budget every step)")
    p.add_argument("--rounds", type=int, default=1,
                   help="passes of every drafter, the order reversed every other round; the figures "
                        "are the sums (bench_drafters)")
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--json", type=Path, help="write the report here")


def run(args: argparse.Namespace) -> int:
    from workers.prompts import encode_record
    from workers.runtime import load_runtime

    drafters = [d.strip() for d in args.drafters.split(",") if d.strip()]
    if drafters and "none" not in drafters:
        drafters.insert(0, "none")          # plain decoding: the reference output and tokens/s
    workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    if not drafters or args.per_workload < 1 or args.warmup < 0:
        raise ValueError("name at least one drafter; --per-workload must be >= 1, --warmup >= 0")
    rt = load_runtime(args.model, progress=False)
    measured, warm = split_prompts({w: load_workload(w) for w in workloads}, args.per_workload, args.warmup)
    encode = lambda pairs: [(w, encode_record(rt.tokenizer, r)) for w, r in pairs]   # noqa: E731
    report = bench_drafters(rt, drafters, encode(measured), encode(warm),
                            TreeBudget(args.tree_nodes, args.tree_depth), adaptive=args.adaptive,
                            max_tokens=args.max_tokens, chain=args.chain, rounds=args.rounds)
    text = json.dumps(report, indent=1)
    if args.json:
        write_result(args.json, report)
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


def make_drafter(rt: Any, name: str, chain: bool = False) -> Drafter:
    """A drafter by name: ``self[:SINK:WINDOW]`` is the target drafting for itself under a sink +
    window mask (module docstring), anything else comes from the registry. `chain`: a model
    drafter (self, a draft directory) drafts a single chain."""
    options = {"mode": "widths", "widths": (1,)} if chain else {}
    if name == "self" or name.startswith("self:"):
        parts = name.split(":")[1:]
        if len(parts) not in (0, 2):
            raise ValueError(f"drafter {name!r}: self or self:SINK:WINDOW")
        sink, window = (int(parts[0]), int(parts[1])) if parts else (4, 256)
        return ModelDrafter(rt.forward, DraftSpec(sink=sink, window=window), name=name, **options)
    return create_drafter(name, **options) if chain and is_model_dir(name) else create_drafter(name)


def costs(tau: float, tokens: int, steps: int, levels: int, draft_s: float, verify_s: float, wall_s: float,
          plain: dict | None) -> dict:
    """A drafter's per-step costs and tokens/s; with `plain` (the ``none`` run's figures), its
    measured and predicted multipliers (module docstring).

    >>> plain = costs(1.0, 100, 100, 0, 0.0, 4.0, 4.4, None)
    >>> c = costs(2.5, 100, 40, 160, 0.4, 2.0, 2.6, plain)
    >>> c["draft_ms_per_level"], c["draft_vs_target"], c["multiplier_measured"], c["multiplier_predicted"]
    (2.5, 0.062, 1.692, 1.667)
    """
    out = {"draft_ms_per_step": round(1e3 * draft_s / steps, 3) if steps else 0.0,
           "draft_ms_per_level": round(1e3 * draft_s / levels, 3) if levels else 0.0,
           "verify_ms_per_step": round(1e3 * verify_s / steps, 3) if steps else 0.0,
           "tokens_per_s": round(tokens / wall_s, 2) if wall_s else 0.0}
    if plain is not None and plain["verify_ms_per_step"] and steps:
        target_s = plain["verify_ms_per_step"] / 1e3
        out["draft_vs_target"] = round(draft_s / levels / target_s, 3) if levels else 0.0
        out["multiplier_measured"] = round(out["tokens_per_s"] / plain["tokens_per_s"], 3)
        out["multiplier_predicted"] = round(spire_multiplier(tau, draft_s / steps, verify_s / steps, target_s), 3)
        out["prediction_error"] = round(out["multiplier_predicted"] / out["multiplier_measured"] - 1, 3)
    return out


_COUNTERS = ("tokens", "steps", "drafted", "accepted", "levels", "draft_s", "verify_s", "wall_s")


def _serve(rt: Any, name: str, measured: Sequence[tuple[str, list[int]]],
           warm: Sequence[tuple[str, list[int]]], budget: TreeBudget, *, adaptive: bool, max_tokens: int,
           chain: bool, cost: Any) -> tuple[dict[str, float], dict[str, list[int]], list[list[int]]]:
    """One pass of one drafter, from a fresh engine and drafter (so a learning drafter has seen
    the warm-up prompts only): its counters (`_COUNTERS`), [tokens, steps] per workload, outputs."""
    engine = Engine(rt.verifier(max_tree_tokens=max(64, budget.max_nodes)), make_drafter(rt, name, chain),
                    budget, adaptive=adaptive, step_cost=cost)

    def generate(i: int, ids: list[int], tag: str):
        req = GenerationRequest(f"{tag}{i}", tuple(ids), max_tokens, SamplingParams(), rt.stop_token_ids)
        return engine.generate([req])[0]

    for i, (_, ids) in enumerate(warm):
        generate(i, ids, "w")
    n = dict.fromkeys(_COUNTERS, 0.0)
    per: dict[str, list[int]] = {}
    outs = []
    timings = engine.verifier.timings
    draft0, verify0 = engine.worker.draft_s, timings.forward_s + timings.other_s
    t0 = time.perf_counter()
    for i, (workload, ids) in enumerate(measured):
        res = generate(i, ids, "m")
        outs.append(res.token_ids)
        for k, v in (("tokens", len(res.token_ids)), ("steps", res.steps), ("drafted", res.drafted),
                     ("accepted", res.accepted), ("levels", res.draft_levels)):
            n[k] += v
        acc = per.setdefault(workload, [0, 0])
        acc[0] += len(res.token_ids)
        acc[1] += res.steps
    n["wall_s"] = time.perf_counter() - t0
    n["draft_s"] = engine.worker.draft_s - draft0
    n["verify_s"] = timings.forward_s + timings.other_s - verify0
    return n, per, outs


def bench_drafters(rt: Any, drafters: Sequence[str], measured: Sequence[tuple[str, list[int]]],
                   warm: Sequence[tuple[str, list[int]]], budget: TreeBudget, *, adaptive: bool = False,
                   max_tokens: int = 96, chain: bool = False, rounds: int = 1) -> dict:
    """Run every drafter over the same prompts (see the module docstring); the report.

    `rounds` > 1: every drafter serves the prompts that many times, each pass from a fresh
    engine, the drafters' order reversed every other round, and the figures are the sums. Why:
    a pass here lasts seconds, and on a shared machine plain decoding's own speed moved by a
    third between passes a minute apart, so one pass of each drafter measures the drift as much
    as the drafter. `multiplier_by_round`: each round's tokens/s over plain decoding's in the
    same round (the spread says how far to trust the sums)."""
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    cost = StepCostModel.from_doc(rt.step_profile(1, budget.max_nodes)) if adaptive else None
    sums = {name: dict.fromkeys(_COUNTERS, 0.0) for name in drafters}
    per_workload: dict[str, dict[str, list[int]]] = {name: {} for name in drafters}
    by_round: dict[str, list[float]] = {name: [] for name in drafters}
    outputs: dict[str, list[list[int]]] = {}
    identical = True
    for r in range(rounds):
        rate: dict[str, float] = {}
        for name in (drafters if r % 2 == 0 else list(reversed(drafters))):
            n, per, outs = _serve(rt, name, measured, warm, budget, adaptive=adaptive,
                                  max_tokens=max_tokens, chain=chain, cost=cost)
            for k in _COUNTERS:
                sums[name][k] += n[k]
            for w, (t, s) in per.items():
                acc = per_workload[name].setdefault(w, [0, 0])
                acc[0] += t
                acc[1] += s
            rate[name] = n["tokens"] / n["wall_s"] if n["wall_s"] else 0.0
            identical = identical and outputs.setdefault(name, outs) == outs   # every round the same
            print(f"round {r + 1}: {name}: tau {n['tokens'] / max(n['steps'], 1):.3f} "
                  f"{rate[name]:.2f} tokens/s ({n['wall_s']:.0f} s)", file=sys.stderr, flush=True)
        if "none" in rate and rate["none"]:
            for name in drafters:
                by_round[name].append(round(rate[name] / rate["none"], 3))
    results: dict[str, dict] = {}
    for name in drafters:
        n = sums[name]
        tokens, steps = int(n["tokens"]), int(n["steps"])
        results[name] = {
            "tau": round(tokens / steps, 3), "alpha": round(n["accepted"] / n["drafted"], 3) if n["drafted"] else 0.0,
            "drafted_per_step": round(n["drafted"] / steps, 2), "tokens": tokens, "steps": steps,
            "wall_s": round(n["wall_s"], 2),
            "tau_by_workload": {w: round(a[0] / a[1], 3) for w, a in per_workload[name].items()},
        }
        results[name].update(costs(tokens / steps, tokens, steps, int(n["levels"]), n["draft_s"], n["verify_s"],
                                   n["wall_s"], results.get("none") if name != "none" else None))
        if rounds > 1 and by_round[name]:
            results[name]["multiplier_by_round"] = by_round[name]
        r = results[name]
        print(f"{name}: tau {r['tau']} alpha {r['alpha']} draft {r['draft_ms_per_level']} ms/level "
              f"({r.get('draft_vs_target', '-')} of a target step) {r['tokens_per_s']} tokens/s, "
              f"x{r.get('multiplier_measured', '-')} measured, x{r.get('multiplier_predicted', '-')} "
              f"predicted ({r['wall_s']:.0f} s)", file=sys.stderr, flush=True)
    reference = outputs[drafters[0]]
    return {
        "prompts": len(measured), "warmup_prompts": len(warm), "max_tokens": max_tokens,
        "tree_budget": {"max_nodes": budget.max_nodes, "max_depth": budget.max_depth},
        "adaptive": adaptive, "chain": chain, "rounds": rounds, "drafters": results,
        **merge_ratios({d: r["tau"] for d, r in results.items()}),
        "identical": identical and all(outputs[d] == reference for d in drafters),
    }
