"""`specgate bench structured`: structured outputs (JSON schemas) with and without speculation.

    specgate bench structured --max-tokens 256 --json results/bench_structured_256.json

The shipped set (tools/data/structured_schemas.jsonl: nested objects, arrays, enums, numbers,
strings with patterns) is asked for through the chat template, each prompt naming its schema
as an application's would, with `response_format` json_schema as the constraint. The same prompts
run under every drafter, single stream, greedy, in one process, each prompt under the four
back to back (a drift in the machine's speed weighs on all alike):

    plain      plain constrained decoding: no drafts (the baseline)
    grammar    the grammar drafter alone (the forced runs: keys, punctuation, closing brackets)
    ngram      the n-gram drafter alone (prompt lookup: the schema's keys are in the prompt)
    merged     both merged into one tree, what a constrained request gets when served

Reported per drafter: tokens/s (generated tokens over the wall time of the whole set), its
ratio to plain's, τ (tokens per verification step), acceptance (accepted ÷ drafted), the share
of outputs that parse and validate against their schema, and how many outputs are token-identical
to plain constrained decoding's (greedy: all must be). `--warmup` prompts run first, unmeasured.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from workers.model.loader import DEFAULT_MODEL
from workers.model.placement import add_placement_arguments
from loadtest.results import write_result

SCHEMAS = Path(__file__).parent / "data" / "structured_schemas.jsonl"
DRAFTERS = ("plain", "grammar", "ngram", "merged")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=DEFAULT_MODEL)
    add_placement_arguments(p)
    p.add_argument("--schemas", type=Path, default=SCHEMAS, help="JSONL of {name, task, schema}")
    p.add_argument("--limit", type=int, default=0, help="first N schemas only (0: all)")
    p.add_argument("--max-tokens", type=int, default=160)
    p.add_argument("--tree-nodes", type=int, default=16)
    p.add_argument("--tree-depth", type=int, default=12)
    p.add_argument("--warmup", type=int, default=2, help="unmeasured prompts per drafter first")
    p.add_argument("--json", type=Path, help="write the report here")


def run(args: argparse.Namespace) -> int:
    report = bench_structured(model=args.model, dtype=args.dtype, device=args.device, schemas=args.schemas, limit=args.limit,
                              max_tokens=args.max_tokens, tree_nodes=args.tree_nodes,
                              tree_depth=args.tree_depth, warmup=args.warmup)
    text = json.dumps(report, indent=1)
    if args.json:
        write_result(args.json, report)
    print(text)
    return 0


def load_schemas(path: Path, limit: int = 0) -> list[dict[str, Any]]:
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    return rows[:limit] if limit else rows


def messages(row: dict[str, Any]) -> list[dict[str, str]]:
    return [{"role": "system", "content": "You answer with one JSON object and nothing else."},
            {"role": "user", "content": f"{row['task']}\nAnswer with a JSON object that follows this "
                                        f"schema: {json.dumps(row['schema'])}"}]


def bench_structured(*, model: str = DEFAULT_MODEL, dtype: str = "float32", device: str = "auto", schemas: Path = SCHEMAS,
                     limit: int = 0, max_tokens: int = 160, tree_nodes: int = 16, tree_depth: int = 12,
                     warmup: int = 2) -> dict[str, Any]:
    from scheduler.generation import Engine, GenerationRequest
    from workers.contract import NO_SPECULATION, SamplingParams, TreeBudget
    from workers.drafters.base import NoneDrafter
    from workers.drafters.merge import MergeDrafter
    from workers.drafters.registry import create_drafter
    from workers.prompts import encode_record
    from workers.runtime import load_runtime

    rt = load_runtime(model, dtype=dtype, device=device, progress=False)
    rows = load_schemas(schemas, limit)
    budget = TreeBudget(tree_nodes, tree_depth)
    make = {"plain": (NoneDrafter, NO_SPECULATION),
            "grammar": (rt.grammar_drafter, budget),
            "ngram": (lambda: create_drafter("ngram"), budget),
            "merged": (lambda: MergeDrafter([rt.grammar_drafter(), create_drafter("ngram")]), budget)}

    def request(i: int, row: dict[str, Any]) -> GenerationRequest:
        c = json.dumps({"type": "json_schema", "schema": row["schema"]})
        return GenerationRequest(f"{i}-{row['name']}", tuple(encode_record(rt.tokenizer, {"messages": messages(row)})),
                                 max_tokens, SamplingParams(constraint=c), rt.stop_token_ids)

    reqs = [request(i, row) for i, row in enumerate(rows)]
    out: dict[str, Any] = {"settings": {"model": model, "dtype": dtype, "schemas": len(rows),
                                        "max_tokens": max_tokens, "tree": [tree_nodes, tree_depth],
                                        "warmup": warmup, "single_stream": True, "greedy": True},
                           "drafters": {}}
    engines = {}
    for name in DRAFTERS:
        factory, b = make[name]
        engines[name] = Engine(rt.verifier(max_tree_tokens=max(64, tree_nodes)), factory(), b, adaptive=False)
        for req in reqs[:warmup]:
            engines[name].generate([req])
    # Each prompt runs under every drafter back to back, so a drift in the machine's speed (other
    # processes) weighs on all drafters alike.
    results: dict[str, list] = {name: [] for name in DRAFTERS}
    wall = dict.fromkeys(DRAFTERS, 0.0)
    for i, req in enumerate(reqs):
        for name in DRAFTERS:
            t0 = time.perf_counter()
            results[name].append(engines[name].generate([req])[0])
            wall[name] += time.perf_counter() - t0
        print(f"{i + 1}/{len(reqs)} {req.request_id}: " + ", ".join(
            f"{n} {len(results[n][-1].token_ids)}/{results[n][-1].steps}" for n in DRAFTERS),
            file=sys.stderr, flush=True)
    plain_ids = [r.token_ids for r in results["plain"]]
    for name in DRAFTERS:
        res_list = results[name]
        tokens = sum(len(r.token_ids) for r in res_list)
        steps = sum(r.steps for r in res_list)
        drafted, accepted = sum(r.drafted for r in res_list), sum(r.accepted for r in res_list)
        invalid = [row["name"] for row, r in zip(rows, res_list)
                   if not _valid(rt.tokenizer.decode(r.token_ids, skip_special_tokens=True), row["schema"])]
        out["drafters"][name] = {
            "tokens_per_s": round(tokens / wall[name], 2), "wall_s": round(wall[name], 2), "tokens": tokens,
            "tau": round(tokens / steps, 3), "acceptance": round(accepted / drafted, 3) if drafted else None,
            "valid_pct": round(100 * (len(rows) - len(invalid)) / len(rows), 1), "invalid": invalid,
            "identical_to_plain": sum(r.token_ids == p for r, p in zip(res_list, plain_ids)),
            "stopped": sum(r.finish_reason == "stop" for r in res_list)}
    plain = out["drafters"]["plain"]["tokens_per_s"]
    for d in out["drafters"].values():
        d["speedup_vs_plain"] = round(d["tokens_per_s"] / plain, 3)
    return out


def _valid(text: str, schema: dict[str, Any]) -> bool:
    import jsonschema

    try:
        jsonschema.validate(json.loads(text), schema)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    raise SystemExit(run(parser.parse_args()))
