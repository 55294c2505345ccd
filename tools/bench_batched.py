"""`specgate bench engine --concurrency N`: N concurrent streams on a mixed workload, one run.

Requests are drawn round-robin from every workload (copy, extract, summarize, chat, code) and
served by the scheduler's step loop over the real verifier — continuous batching: up to N
requests share each verification step, and a finished one is replaced by the next queued one at
the next step boundary. The same requests are served three ways, in one process:

    speculative   the deployment's drafter, tree budgets sized per request and per step;
    plain         the same loop and batch size, no drafts (what speculation must beat);
    reference     transformers fp32 `generate`, single stream, greedy, on a few of the prompts
                  (the baseline every `speedup_vs_hf_greedy` in the benches is relative to).

Greedy only, so the speculative and plain outputs must be identical token for token.
"""
from __future__ import annotations

import sys
import time

import torch

from loadtest.workload import WORKLOADS, load_workload
from scheduler.loop import Delta, StepLoop
from scheduler.policies import make_policy
from scheduler.profile import StepCostModel
from scheduler.sizing import SizingConfig
from scheduler.request import Request, RequestStats
from workers.contract import SamplingParams
from workers.batch_worker import BatchWorker
from workers.contract import TreeBudget
from workers.prompts import encode_record
from workers.runtime import Runtime, load_runtime


def mixed_prompts(rt: Runtime, n: int, workloads=WORKLOADS) -> list[tuple[str, list[int]]]:
    """`n` (id, prompt ids) pairs, round-robin over `workloads`."""
    sets = [load_workload(w) for w in workloads]
    out = []
    for i in range(n):
        rec = sets[i % len(sets)][i // len(sets) % len(sets[i % len(sets)])]
        out.append((rec["id"], encode_record(rt.tokenizer, rec)))
    return out


def serve_all(rt: Runtime, prompts, *, concurrency: int, max_tokens: int, drafter: str,
              budget: TreeBudget, profile: StepCostModel | None,
              priors: dict | None = None) -> tuple[dict[str, list[int]], float, int, int]:
    """Serve every prompt through a step loop of batch `concurrency`: (outputs, seconds, steps,
    request-steps = Σ over requests of the steps each was in). `priors`: what an earlier pass's
    planner learned of the drafter (`Policy.priors`), updated in place, as a gateway's planner
    keeps it from one request to the next."""
    worker = BatchWorker(rt.verifier(max_tree_tokens=budget.max_nodes), default_drafter=drafter)
    policy = make_policy("fcfs", max_batch=concurrency, token_budget=concurrency * (1 + budget.max_nodes),
                         sizing=SizingConfig(max_tree_tokens=budget.max_nodes, max_depth=budget.max_depth),
                         step_cost=profile, aging_bound_s=None)
    if priors is not None:
        policy.priors = priors
    loop = StepLoop(policy, worker, max_resident=concurrency)
    worker.drafter(drafter)     # loaded before the clock: a draft model's load is not serving
    out: dict[str, list[int]] = {}
    request_steps = [0]

    def sink(event):
        if isinstance(event, Delta):
            out.setdefault(event.request_id, []).extend(event.token_ids)
        else:
            request_steps[0] += event.stats.n_steps

    t0 = time.perf_counter()
    for i, (_, ids) in enumerate(prompts):
        stats = RequestStats(f"b{i}", "bench", time.time(), prompt_len=len(ids), max_tokens=max_tokens)
        loop.submit(Request(stats, list(ids), SamplingParams(), stop_token_ids=tuple(rt.stop_token_ids)), sink)
    while loop.step():
        pass
    return out, time.perf_counter() - t0, loop.steps, request_steps[0]


def bench_concurrency(concurrency: int, *, model: str, max_tokens: int = 128, streams_per_slot: int = 2,
                      drafter: str = "ngram", budget: TreeBudget = TreeBudget(16, 8),
                      reference_prompts: int = 3, profile: str | None = None,
                      workloads: tuple[str, ...] = WORKLOADS, rounds: int = 1) -> dict:
    """`rounds` > 1: plain and speculative serve the prompts that many times each, alternating
    which goes first, and the figures are the sums: on a machine whose speed drifts, one pass
    of each measures the drift as much as speculation. One planner's learned priors serve every
    round, as in a gateway that keeps serving: the first speculative pass probes the drafter
    from nothing (`speedup_vs_plain_by_round` shows that pass apart)."""
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    rt = load_runtime(model, dtype="float32", keep_hf=True)
    prompts = mixed_prompts(rt, concurrency * streams_per_slot, workloads)
    # the planner's step costs: this machine's, as the gateway measures them at start-up, unless a
    # profile file is given
    cost = (StepCostModel.from_json(profile) if profile is not None
            else StepCostModel.from_doc(rt.step_profile(concurrency, budget.max_nodes)))
    # Warm-up: one-off allocation and dispatch costs.
    serve_all(rt, prompts[:1], concurrency=1, max_tokens=8, drafter=drafter, budget=budget, profile=cost)

    hf_tokens, hf_s = 0, 0.0
    for _, ids in prompts[:reference_prompts]:
        inp = torch.tensor([ids])
        t0 = time.perf_counter()
        with torch.inference_mode():
            gen = rt.hf_model.generate(inp, attention_mask=torch.ones_like(inp), max_new_tokens=max_tokens,
                                       do_sample=False, pad_token_id=rt.tokenizer.eos_token_id)
        hf_s += time.perf_counter() - t0
        hf_tokens += gen.shape[1] - len(ids)
    settings = {"plain": ("none", TreeBudget(0, 0)), "spec": (drafter, budget)}
    passes: dict[str, list[tuple]] = {"plain": [], "spec": []}     # serve_all's results, per pass
    learned: dict[str, dict] = {"plain": {}, "spec": {}}           # each planner's priors
    for r in range(rounds):
        for kind in ("plain", "spec") if r % 2 == 0 else ("spec", "plain"):
            name, b = settings[kind]
            passes[kind].append(serve_all(rt, prompts, concurrency=concurrency, max_tokens=max_tokens,
                                          drafter=name, budget=b, profile=cost, priors=learned[kind]))
    per_round = lambda kind, i: sum(p[i] for p in passes[kind]) / rounds   # noqa: E731  (a mean over passes)
    plain, plain_s, plain_steps = passes["plain"][0][0], per_round("plain", 1), int(per_round("plain", 2))
    spec, spec_s, spec_steps = passes["spec"][0][0], per_round("spec", 1), int(per_round("spec", 2))
    spec_request_steps = int(per_round("spec", 3))
    hf_rate = hf_tokens / hf_s
    spec_tokens = sum(len(v) for v in spec.values())
    plain_tokens = sum(len(v) for v in plain.values())
    report = {
        "concurrency": concurrency, "requests": len(prompts), "max_tokens": max_tokens, "dtype": "float32",
        "rounds": rounds,
        "drafter": drafter, "tree_budget": {"max_nodes": budget.max_nodes, "max_depth": budget.max_depth},
        "workloads": list(workloads), "step_profile": profile or "measured at start-up",
        "hf_greedy_tok_s": round(hf_rate, 2),
        "total_tokens_per_s": round(spec_tokens / spec_s, 2),
        "plain_total_tokens_per_s": round(plain_tokens / plain_s, 2),
        "speedup_vs_hf_greedy": round(spec_tokens / spec_s / hf_rate, 3),
        "plain_speedup_vs_hf_greedy": round(plain_tokens / plain_s / hf_rate, 3),
        "speedup_vs_plain": round((spec_tokens / spec_s) / (plain_tokens / plain_s), 3),
        "tau_mean": round(spec_tokens / max(1, spec_request_steps), 3),
        # round r's speculative tokens/s over its plain tokens/s (the same tokens when identical)
        "speedup_vs_plain_by_round": [round(p[1] / s[1], 3) for p, s in zip(passes["plain"], passes["spec"])],
        "steps": spec_steps, "plain_steps": plain_steps,
        "identical": all(p[0] == plain for kind in passes for p in passes[kind]),
    }
    print(f"concurrency {concurrency}: specgate {report['total_tokens_per_s']} tok/s "
          f"({report['speedup_vs_hf_greedy']}x hf greedy), plain {report['plain_total_tokens_per_s']} tok/s, "
          f"identical {report['identical']}", file=sys.stderr)
    return report
