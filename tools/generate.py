"""`specgate generate`: run a JSONL file of prompts as one batch through the speculative engine."""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from workers.contract import SamplingParams
from workers.contract import TreeBudget
from workers.drafters.registry import create_drafter, drafter_names, is_drafter_name
from scheduler.profile import StepCostModel
from scheduler.generation import Engine, GenerationRequest
from workers.model.loader import DEFAULT_MODEL
from workers.prompts import encode_record
from workers.model.placement import add_placement_arguments
from workers.runtime import load_runtime

# The ceiling; each step sizes each request's tree below it from its acceptance and the cost curve.
DEFAULT_BUDGET = TreeBudget(max_nodes=32, max_depth=24)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=DEFAULT_MODEL, help="built-in name, HF model directory or .gguf file")
    p.add_argument("--prompts", required=True, type=Path, help='JSONL: {"prompt": ...} or {"messages": [...]} per line')
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--drafter", default="ngram", help="drafter name from the registry (ngram, none)")
    p.add_argument("--tree-nodes", type=int, default=DEFAULT_BUDGET.max_nodes)
    p.add_argument("--tree-depth", type=int, default=DEFAULT_BUDGET.max_depth)
    add_placement_arguments(p)
    p.add_argument("--json", type=Path, help="write the results here (a JSON list, one record per prompt)")


def read_prompts(path: Path) -> list[dict]:
    if not path.exists():
        raise FileNotFoundError(f"prompts file {path} does not exist")
    records = []
    for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}:{lineno}: not valid JSON ({exc.msg})") from None
        if not isinstance(rec, dict):
            raise ValueError(f"{path}:{lineno}: each line must be a JSON object")
        records.append(rec)
    if not records:
        raise ValueError(f"{path} holds no prompts")
    return records


def run(args: argparse.Namespace) -> int:
    # Validate everything cheap before loading the model.
    records = read_prompts(args.prompts)
    sampling = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed)
    if args.max_tokens < 1:
        raise ValueError(f"--max-tokens must be >= 1, got {args.max_tokens}")
    if not is_drafter_name(args.drafter):
        raise ValueError(f"unknown drafter {args.drafter!r}; available: {', '.join(drafter_names())}")
    budget = TreeBudget(args.tree_nodes, args.tree_depth)
    rt = load_runtime(args.model, dtype=args.dtype, device=args.device)
    requests = []
    for i, rec in enumerate(records):
        try:
            ids = encode_record(rt.tokenizer, rec)
        except ValueError as exc:
            raise ValueError(f"prompt {i + 1}: {exc}") from None
        # Each prompt gets its own seed so its output does not depend on its neighbours.
        req_sampling = SamplingParams(sampling.temperature, sampling.top_k, sampling.top_p, args.seed + i)
        requests.append(GenerationRequest(f"p{i}", tuple(ids), args.max_tokens, req_sampling, rt.stop_token_ids))
    engine = Engine(rt.verifier(), create_drafter(args.drafter), budget,
                    step_cost=StepCostModel.from_doc(rt.step_profile(1, budget.max_nodes)))
    t0 = time.perf_counter()
    results = engine.generate(requests)
    elapsed = time.perf_counter() - t0
    out = []
    for rec, res in zip(records, results):
        text = rt.tokenizer.decode(res.token_ids, skip_special_tokens=True)
        out.append({"text": text, "token_ids": res.token_ids, "steps": res.steps, "tau_mean": round(res.tau_mean, 4),
                    "alpha": round(res.alpha, 4), "finish_reason": res.finish_reason})
        print(f"--- {rec.get('prompt') or rec['messages'][-1]['content']!s:.60}\n{text}\n", file=sys.stderr)
    total = sum(len(r.token_ids) for r in results)
    print(f"{total} tokens in {elapsed:.2f} s ({total / elapsed:.1f} tok/s), "
          f"mean tau {total / max(1, sum(r.steps for r in results)):.2f}", file=sys.stderr)
    # One record per line inside a JSON list: valid JSON that still reads well in a terminal.
    text = "[\n" + ",\n".join(json.dumps(r) for r in out) + "\n]\n"
    if args.json:
        args.json.write_text(text, encoding="utf-8")
    else:
        print(text, end="")
    return 0
