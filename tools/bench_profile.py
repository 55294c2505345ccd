"""`specgate bench profile`: measure the step-cost profile the scheduler and the simulator read
(scheduler/profile.py) on the real verifier, by batch size and tree tokens, and write it to a file.

The measurement itself is `workers.speculation.profiling.measure_profile` (the grid, the medians, the monotone
curves). Here the requests are re-prefilled before each tree size, so the context stays near
`prompt_len` (a step commits at least one token). A prefill curve (prompt tokens → seconds of one
request's `Verifier.prefill`, a pass of its own) is measured too: the simulator charges a new or
evicted request's prefill from it.

`contexts` (`--contexts 512,1536`): the same grid again with the requests prefilled to each of
these lengths instead of `prompt_len`, written as `"contexts": [{"context": c, "curves": [...]}]`
beside the top-level curves (which stay those at `prompt_len`); the step-cost model interpolates
between contexts. Off by default: each context costs as much as the default grid.

The `"chunk"` entry (`--chunk-tokens`, `--chunk-offsets`; '' to skip) is what a prefill chunk adds
to a step, by its size and how deep into its prompt it starts (`workers.speculation.profiling.measure_chunks`).

Run it on an otherwise idle machine; `--json` writes the profile (`scheduler/profiles/default.json`
is such a file). Serving measures its own at start-up instead of trusting a shipped file
(docs/design.md): a step's cost is the serving machine's, not that of the machine a file was
measured on.
"""
from __future__ import annotations

import os
from typing import Any

from scheduler.profile import fit_chunk_cost
from workers.model.placement import add_placement_arguments
from workers.speculation.profiling import (DEFAULT_BATCHES, DEFAULT_CHUNK_OFFSETS, DEFAULT_CHUNK_TOKENS,
                               DEFAULT_NODES, DEFAULT_PREFILL, describe_device, measure_chunks,
                               measure_profile, profile_document)
from loadtest.results import write_result


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x.strip())


def table(doc: dict[str, Any]) -> str:
    rows = ["| context | batch | nodes | tokens | step ms | ms per request |",
            "|---|---|---|---|---|---|"]
    grids = [(doc.get("prompt_len", "?"), doc["curves"])]
    grids += [(g["context"], g["curves"]) for g in doc.get("contexts", ())]
    for context, curves in grids:
        for c in curves:
            for n, t, s in zip(c["nodes"], c["tokens"], c["step_s"]):
                rows.append(f"| {context} | {c['batch']} | {n} | {t} | {1000 * s:.1f} | "
                            f"{1000 * s / c['batch']:.1f} |")
    chunk = doc.get("chunk")
    if chunk:
        rows.append("")
        rows.append(f"chunk (beside a batch of {chunk['batch']}): "
                    + ", ".join(f"{k} tokens at {o} {1000 * x:.1f} ms" for o, k, x in chunk["points"])
                    + f"; fit {1e3 * chunk['row_s']:.3f} ms a row + {1e6 * chunk['key_s']:.3f} µs "
                      "a row per earlier key")
    pre = doc.get("prefill")
    if pre:
        rows.append("")
        rows.append("prefill: " + ", ".join(f"{t} tokens {1000 * s:.0f} ms"
                                            for t, s in zip(pre["tokens"], pre["step_s"])))
    return "\n".join(rows)


# ---- CLI (wired as `specgate bench profile` by specgate/cli.py) ---------------------------------
def add_arguments(parser) -> None:
    parser.add_argument("--model", default=None,
                        help="target model, as `specgate serve` takes it (default: its default)")
    add_placement_arguments(parser)
    parser.add_argument("--batches", default=",".join(map(str, DEFAULT_BATCHES)),
                        help="comma-separated batch sizes")
    parser.add_argument("--nodes", default=",".join(map(str, DEFAULT_NODES)),
                        help="comma-separated draft nodes per request (chain trees)")
    parser.add_argument("--prefill-tokens", default=",".join(map(str, DEFAULT_PREFILL)),
                        help="comma-separated prompt lengths to time prefill at ('' to skip)")
    parser.add_argument("--prompt-len", type=int, default=200,
                        help="context each request holds while steps are timed")
    parser.add_argument("--contexts", default="",
                        help="comma-separated further context lengths to measure the same grid at "
                             "(default: none, only --prompt-len)")
    parser.add_argument("--chunk-tokens", default=",".join(map(str, DEFAULT_CHUNK_TOKENS)),
                        help="comma-separated prefill chunk sizes to time beside a batch "
                             "('' to skip the chunk measurement)")
    parser.add_argument("--chunk-offsets", default=",".join(map(str, DEFAULT_CHUNK_OFFSETS)),
                        help="comma-separated context already computed when the chunks start")
    parser.add_argument("--repeats", type=int, default=7, help="timed steps per point (median)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads (default: torch's choice)")
    parser.add_argument("--json", dest="json_out", default=None, help="write the profile here")


def _load_verifier(model: str, dtype: str, max_tree_tokens: int, device: str = "auto"):
    from workers.runtime import load_runtime

    return load_runtime(model, dtype=dtype, device=device).verifier(max_tree_tokens=max_tree_tokens)


def run(args) -> int:
    from workers.model.loader import DEFAULT_MODEL

    if args.threads:
        import torch
        torch.set_num_threads(args.threads)
    model = args.model or DEFAULT_MODEL
    nodes = _ints(args.nodes)
    verifier = _load_verifier(model, args.dtype, max(64, max(nodes)), args.device)
    measured = measure_profile(verifier, batches=_ints(args.batches), nodes=nodes,
                               prompt_len=args.prompt_len, repeats=args.repeats,
                               prefill_tokens=_ints(args.prefill_tokens),
                               contexts=_ints(args.contexts))
    if _ints(args.chunk_tokens):
        chunk = measure_chunks(verifier, chunk_tokens=_ints(args.chunk_tokens),
                               offsets=_ints(args.chunk_offsets) or (0,),
                               batch=min(4, max(_ints(args.batches))), repeats=args.repeats)
        if chunk:
            chunk["row_s"], chunk["key_s"] = fit_chunk_cost(chunk["points"])
            measured["chunk"] = chunk
    doc = profile_document(measured, model=os.path.basename(str(model)), dtype=args.dtype,
                           device=describe_device(verifier.target), prompt_len=args.prompt_len,
                           repeats=args.repeats)
    print(table(doc))
    if args.json_out:
        write_result(args.json_out, doc)
    return 0
