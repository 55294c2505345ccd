"""docs/benchmarks.md, written from the result files: `specgate docs` (specgate/docs.py) calls
`render`. The page is never edited by hand: a new result means re-running the benchmark with
`--json results/NAME.json` and then `specgate docs` (tests/unit/test_docs.py fails otherwise).

`BENCHES` is the page's text: per benchmark the command that writes its current result, what it
measures and what its figures show, in words only. Every figure comes from a result file through
the benchmark's table function (tools/bench_tables.py), beside the machine, date and commit of
its `meta` block (loadtest/results.py). A result no benchmark claims is an error, not a file the
page leaves out.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from tools import bench_refusals
from tools import bench_tables as t

ROOT = Path(__file__).resolve().parents[1]
PAGE = Path("docs/benchmarks.md")


@dataclass(frozen=True)
class Bench:
    name: str                   # the heading (and its anchor): "bench stall"
    command: str                # how its current result is written
    measures: str
    shows: str                  # what the current figures show; "" while none is recorded
    files: tuple[str, ...]      # glob patterns under the repository root
    table: t.Table


def _lengths(doc: Mapping[str, Any]) -> list[str]:
    return t.lengths_mix(doc) if "per_workload" in doc else t.lengths(doc)


BENCHES: tuple[Bench, ...] = (
    Bench("bench engine",
          "specgate bench engine --workload chat --concurrency 8 --max-tokens 128 --tree-nodes 4 "
          "--tree-depth 4 --rounds 12 --drafter DRAFT --json results/bench_engine_chat8.json",
          "Tokens/s of the engine with a drafter against transformers' greedy `generate` (and its "
          "prompt lookup) and against the same engine without drafts, on one workload, output "
          "checked token for token against greedy. `--concurrency N` runs N streams at once, "
          "`--rounds` alternating speculative and plain passes; `--peers llama.cpp,vllm` adds "
          "those engines to the same run.",
          "Speculation pays where the text is predictable (copy and extract prompts, which the "
          "n-gram drafter finds in the prompt) and least on open chat. At 8 concurrent chat "
          "streams verifying extra tree tokens costs about what their acceptance returns, so the "
          "planner drafts almost nothing and speculative serving stays level with plain decoding; "
          "the first round, in which the planner still probes the draft, is the lowest. Without "
          "AVX-512 the CPU kernels run on their AVX2 path (`CPU kernels`); the copy results "
          "ending `_torch` were measured with them off (SPECGATE_SMALL_GEMM=0), those ending "
          "`_avx2` with them on, on a 2-core machine shared with other heavy work at the time: "
          "their rates are very noisy and compare only roughly. `copy_avx512` ran on a quiet "
          "2-core AVX-512 BF16 machine with its kernels; `copy_avx512cpu_avx2path` on the same "
          "machine right after, with the AVX2 kernels forced (SPECGATE_SMALL_GEMM=avx2): the "
          "AVX2 path keeps about 70% of the AVX-512 path's speed there, both ahead of "
          "transformers' prompt lookup by 2.6× and 3.4×, output identical.",
          ("results/bench_engine*.json",), t.engine),
    Bench("bench drafters",
          "specgate bench drafters --workloads chat --per-workload 8 --warmup 2 --max-tokens 96 "
          "--tree-nodes 4 --tree-depth 4 --chain --rounds 3 --drafters none,ngram,DRAFT,"
          "merge:DRAFT+ngram --json results/bench_drafters_chat_chain.json",
          "τ, acceptance, drafting cost per tree level, tokens/s and SPIRe's predicted multiplier "
          "TM = τ ÷ ((k·t_draft + t_verify) ÷ t_target) beside the measured one, for several "
          "drafters and their merges on one workload, each drafter's pass repeated `--rounds` "
          "times in alternating order (one pass on a noisy VM measures its drift too); "
          "`--adaptive` has the planner size each request's tree, as serving does.",
          "The throughput model predicts the measured multiplier within a few percent for every "
          "drafter. On open chat a draft pruned from the target and trained 30 minutes, drafting "
          "in bfloat16 with a cheap head and merged with the n-gram drafter, gives the highest τ "
          "and multiplier with the whole budget; sized by the planner the gain is smaller and "
          "never a loss. The feedback-memory draft reaches the pruned draft's τ but costs more a "
          "level, so it does not pay. Where the CPU lacks AVX-512, a draft level costs a larger "
          "share of a target step and the planner gets back to about break-even.",
          ("results/bench_drafters*.json",), t.drafters),
    Bench("draft train",
          "specgate draft train --draft DRAFT --minutes 30 --gen-share 0 --data drafts/data "
          "--json results/draft_train_30min.json",
          "A draft trained for a fixed time with SPIRe's mixed loss ω·CE + (1 − ω)·(−expected "
          "acceptance) on text the target generated once (`--data`, shared by the runs): greedy "
          "acceptance at depth 1 on the chat workload's target continuations before and after, "
          "optimiser steps in the time, and the feedback memory's gates at the end.",
          "Training text and step size bound a 30-minute draft: all the generated text and a "
          "learning rate of 2e-3 (`draft train`'s default since) gave the best acceptance, twice "
          "that rate no better. The memory's gates stay nearly closed within the budget, so the "
          "memory draft ends level with the pruned one in fewer steps.",
          ("results/draft_train*.json",), t.draft_train),
    Bench("bench profile",
          "specgate bench profile --json tools/data/profile_intel_chunks.json",
          "Step time of the real verifier against batch size and tree tokens, a prefill's time "
          "against prompt length, and what a prefill chunk adds to a step beside a batch, fitted "
          "as a cost per row plus a cost per row per earlier key. The planner reads such a "
          "profile with `--step-profile`, the simulator with `sim --profile`; serving measures "
          "its own at start-up.",
          "At small batches a tree step costs little more than a plain one, so speculation is "
          "nearly free there; the cost grows with the tokens verified. A chunk deep into a long "
          "prompt costs several times one at its start (its rows read every earlier key), which "
          "is why the planner gives deep chunks fewer tokens.",
          ("tools/data/profile_*.json", "results/bench_profile*.json"), t.profile),
    Bench("bench plan", "specgate bench plan --json results/bench_plan.json",
          "Microseconds to plan one step (`Policy.plan`, and `update`) with many queued requests, "
          "per policy.", "", ("results/bench_plan*.json",), t.plan_policies),
    Bench("plan", "specgate plan --measure --json results/plan.json",
          "The throughput model's predicted tokens/s and multiplier per drafter × tree shape × "
          "batch × context from a step-cost profile; `--measure` runs the configurations on the "
          "engine and reports each prediction's error.", "", ("results/plan*.json",), t.scalars),
    Bench("bench structured",
          "specgate bench structured --max-tokens 256 --warmup 1 --json "
          "results/bench_structured_256.json",
          "JSON-schema outputs on the shipped schemas (tools/data/structured_schemas.jsonl), "
          "greedy, one stream: each prompt under plain constrained decoding and under the "
          "grammar, n-gram and merged drafters, back to back: validity, identity with plain "
          "constrained decoding, τ and tokens/s.",
          "Output is token-identical to plain constrained decoding under every drafter. The "
          "grammar drafter proposes what the grammar forces at no model call, n-gram copies from "
          "the prompt, and their merge is fastest. The outputs that do not validate are the "
          "model's own greedy loops inside strings the schema leaves unbounded, the same under "
          "plain constrained decoding: cut by max_tokens, not a grammar miss (a `maxLength` in "
          "the schema ends them). With room to finish, the drafters gain more.",
          ("results/bench_structured*.json",), t.structured),
    Bench("bench grammar-engines",
          "specgate bench grammar-engines --json results/bench_grammar_engines.json",
          "The cost of a next-token mask over the default tokenizer (fill, accept, rollback) per "
          "token for xgrammar and llguidance on a few schemas, and each schema's compile time.",
          "xgrammar fills and rolls back in the least time per token, which is why "
          "workers/speculation/grammar.py uses it (walking a tree needs rollback); compiled "
          "schemas are cached per process.",
          ("results/bench_grammar_engines*.json",), t.grammar_engines),
    Bench("bench gateway", "specgate bench gateway --json results/bench_gateway.json",
          "Added median latency and requests/s of the HTTP gateway over calling the step loop "
          "directly, with the model-free fake worker.", "", ("results/bench_gateway*.json",),
          t.scalars),
    Bench("bench front", "specgate bench front --json results/bench_front.json",
          "Whether one client's huge prompt stalls /health or other tenants: GET /health probed "
          "every few milliseconds on its own connection while a prompt past the characters "
          "bound, one just under it (tokenized in full) and an over-rpm tenant's huge prompt "
          "arrive, each sent several times: their statuses and times and the worst /health "
          "delay.",
          "Rate limits are checked before any work on the prompt, a prompt with more characters "
          "than the context could hold at the tokenizer's longest token is refused untokenized, "
          "and long prompts are tokenized on a worker thread: every refusal comes in "
          "milliseconds to a second, and /health waits a few milliseconds at most beside any of "
          "them.",
          ("results/bench_front*.json",), t.front),
    Bench("bench refusals", "specgate bench refusals --json results/bench_refusals.json",
          "CPU per refused request of a closed-loop flood over rpm, concurrency and tpm over "
          "REST, and over rpm over gRPC, and the event loop's lag, with early refusals on (fast) "
          "and off (full), over Redis.",
          "A key refused a moment ago is refused again before authentication, Redis and body "
          "parsing: over REST a refusal costs several times less CPU on every limit, tpm "
          "included while not even one token fits its window. Over gRPC the saving is smaller: "
          "what an early refusal still costs is about what grpc.aio spends on any call.",
          ("results/bench_refusals*.json",), bench_refusals.docs_table),
    Bench("bench stall", "specgate bench stall --chunks 0,24 --json results/bench_stall.json",
          "Streams' longest gap between tokens while a long prompt is prefilled: counting "
          "streams, then one long prompt; per stream the median gap before the prompt (and after "
          "it, at the depth the streams had reached) and the gaps while it was served, with "
          "whole prefill and each chunk size in one run (the worst stream shown).",
          "Whole prefill stops every stream for the prompt's whole prefill. With chunked prefill "
          "(the default) the longest gap is a small multiple of the streams' own pace, at the "
          "price of the long prompt's own latency: its chunks share steps with the streams, and "
          "a chunk deep into the prompt reads every earlier key. The longest gap left falls at "
          "the step that completes the prompt.",
          ("results/bench_stall*.json",), t.stall),
    Bench("bench kv",
          "specgate bench kv --budgets-mb 4096,1024 --requests 32 --prompt-tokens 1500 "
          "--seconds 150 --json results/bench_kv.json",
          "Many requests without max_tokens, with long distinct prompts, under each KV budget "
          "(`--kv-cache-mb`), a fresh process per budget: RSS before the requests and at peak "
          "against budget + baseline + 1 GiB, KV held, the most requests resident at once, "
          "preemptions, failures and tokens generated in a fixed time.",
          "KV is admitted by slots as requests grow, not reserved for the whole context, so the "
          "requests fit a budget that reserving would have multiplied. Under a tight budget "
          "requests wait for room and residents that outgrow it are preempted and re-prefilled "
          "from what they committed; none fails, and RSS stays within its bound.",
          ("results/bench_kv*.json",), t.kv),
    Bench("bench lengths",
          "specgate bench lengths --json tools/data/bench_lengths.json",
          "The output-length predictor (ridge over the target's own final-normed hidden state) "
          "on the shipped prompt set (tools/data/length_prompts.jsonl, the default model's own "
          "greedy answers): Spearman ρ and median |ln(pred ÷ true)| on a held-out split against "
          "the tenant-record baseline, the spread σ of ln(remaining) as a request is "
          "re-predicted, and per kind of work; `--loadtest-mix chat,copy,code,summarize,extract "
          "--max-tokens 512` runs the shipped weights on the load test's prompts instead. The "
          "simulator reads tools/data/bench_lengths.json as its measured predictor "
          "(`sim --predictor`), which is why that result stays beside the data it ships.",
          "The hidden state ranks lengths better than the tenant records and is about as far off "
          "in ratio. It ranks chat and code, not copy, extract or summarize: whether the model "
          "will loop to its limit on a passage does not show in the prompt's state. Re-predicted "
          "as a request runs, the error does not shrink until late, so a belief replaces an "
          "earlier one only when at least as precise. On the load test's prompts it mostly tells "
          "code from the rest.",
          ("tools/data/bench_lengths*.json", "results/bench_lengths*.json"), _lengths),
    Bench("bench resume",
          "specgate bench resume --redis-url redis://127.0.0.1:6379 --tries 20 --json "
          "results/bench_resume_embedded.json",
          "Durable streams: a background response is streamed, the gateway killed with SIGKILL "
          "at a random point (embedded: the process, then restarted; `--ray`: the scheduler and "
          "every ingress replica) and the stream resumed with `starting_after`. A try passes "
          "when the text put together equals an uninterrupted run's and every event came once, "
          "in order; greedy and seeded sampling. Add `--ray` (and --json "
          "results/bench_resume_ray.json) for the Ray Serve deployment.",
          "Every try passes in both modes: a response's events are a function of its committed "
          "tokens, which the step loop stores before it streams them, and a seeded request draws "
          "each token from its seed and position alone, so a restarted process continues the "
          "same text.",
          ("results/bench_resume*.json",), t.resume),
    Bench("bench scheduler", "specgate bench scheduler --json results/bench_scheduler.json",
          "What the central scheduler costs per step at scale: `plan` + `update` of the real "
          "batch planner (laps) over a real scheduler state, no model, against the number of "
          "waiting requests and of running ones (a step's batch over many verifier replicas, "
          "8 each, every replica a KV home with its own budget, so placement, growth and "
          "eviction are timed too). The bench plays the worker between steps and replaces each "
          "finished request with an arrival, keeping the queue's length. Wall and CPU time per "
          "step; the target is 2 ms per step at 10,000 waiting and 1,000 running.",
          "The cost follows the running count: every running request is placed, recorded, "
          "re-predicted and re-ranked each step in Python, while choosing reads only the tops of "
          "per-tenant heaps, so a queue a hundred times longer adds little beside it (what grows "
          "with the queue is placement counting each home's residents over every live request "
          "once per plan). The target is missed at 1,000 running by more than an order of "
          "magnitude even in CPU time, and at 100 running too. Wall time on these shared cores "
          "is several times the CPU time and moves between runs with the machine's load.",
          ("results/bench_scheduler*.json",), t.scheduler),
    Bench("bench ray", "specgate bench ray --json results/bench_ray.json",
          "Tokens/s of the Ray Serve deployment against the embedded gateway on one machine, "
          "output compared, and the scheduler's orchestration share of step time.", "",
          ("results/bench_ray*.json",), t.scalars),
    Bench("loadtest compare",
          "specgate loadtest compare --policies fcfs,sjf,laps,srpt --bursty --load 0.9 --rate 0.8 "
          "--duration 240 --seed 7 --rounds 2 --max-tokens 512 --workloads "
          "chat,copy,code,summarize,extract --tenants 3 --json results/loadtest_compare_policies.json",
          "The same open-loop multi-tenant load against a fresh gateway per policy (or per "
          "setting: `--prefill-chunk-tokens 0,24`), `--rounds` with other arrivals and the order "
          "reversed: latency, TTFT, each request's time waiting and in steps (from each "
          "gateway's /metrics), completions/s and errors. With srpt a truth pass first gives the "
          "clairvoyant bound on the real engine. `--seeds 1,4,7` repeats the whole comparison "
          "per seed; a run with several rounds or seeds gives each mean, p99 and TTFT figure and "
          "each ratio against fcfs and sjf a 95% bootstrap interval, paired by seed and round.",
          "On the bursty mix with long answers, LAPS-SD's mean is below FCFS's, by an amount "
          "that moves with the seed and the machine: the four-policy run (one seed, no "
          "interval) had it well below FCFS and SJF and below clairvoyant srpt's (srpt ranks by "
          "remaining tokens, LAPS-SD by predicted remaining steps, tokens ÷ E[τ]); the later "
          "fcfs/laps run on the same seed, with two rounds, puts it below FCFS with a 95% "
          "interval that excludes parity but is wide, and its p99 level with FCFS's: one seed's "
          "mean of ~100 requests is mostly noise, so compare policies over several seeds "
          "(`--seeds`). Single passes on these VMs measure the machine's "
          "drift as much as the policies, hence rounds in reversed order. Past saturation, "
          "chunked prefill keeps whole prefill's capacity and lowers the p99 gap between "
          "tokens, since a step prefills a chunk for each request waiting for its context.",
          ("results/loadtest_compare*.json",), t.compare),
    Bench("loadtest hostile",
          "specgate loadtest hostile --window-s 20 --json results/loadtest_hostile_before.json",
          "Whether one tenant can hurt another (issue 50): a victim tenant sends a short streamed "
          "chat every half second while an attacker, within its own generous quotas, runs seven "
          "patterns in turn (huge tool lists, costly JSON schemas, byte-token output replayed, "
          "a flood of stored responses, many followers of one stream, gRPC messages past the "
          "HTTP body cap, streams never read), the gateway waited out after each. Before them a "
          "reference phase, `busy`, is no attack: ordinary streamed chats keeping the batch "
          "full, what any busy neighbour costs the victim; each pattern's p99s are also given "
          "as ratios to it. Per pattern: "
          "the victim's p99 TTFT and time between tokens against its quiet baseline of the same "
          "run, /health latency probed every ~100 ms, status codes by tenant and the codes the "
          "attacker was refused with, Redis and RSS memory, whether any victim request lost "
          "anything, and PASS/FAIL against the targets (p99s within 1.5× the baseline, /health "
          "p99 within 100 ms, no 5xx, refusals naming their cap, Redis under its watermark, "
          "nothing lost). `--redis-url` runs it in Redis mode.",
          "Before issue 50's changes every pattern fails at least one target. The tools bomb "
          "and the schema bomb stall the event loop itself: /health waits seconds and the "
          "victim's first token comes tens of times later than in the baseline. The flood of "
          "stored responses and the streams never read fill the batch with the attacker's work "
          "and delay the victim's first token several-fold; byte-token replays and followers "
          "slow it less. Large gRPC messages leave the victim alone, but gRPC takes messages up "
          "to its own 4 MiB limit, twice the HTTP body cap, and refuses larger ones with "
          "RESOURCE_EXHAUSTED and no error code. The attacker's refusals are otherwise 4xx "
          "naming their cap (413 context_length_exceeded, 429 concurrency_exceeded), and no "
          "request got a 5xx. On these busy shared cores the quiet baseline's own /health p99 "
          "is above 100 ms (see the load average in the settings), so that target fails "
          "throughout; the ratios are what compare across runs. The `_after` run (Redis mode, the "
          "code after issue 50's changes; its machine is in its header) has large bodies parsed "
          "off the event loop one at a time per tenant, a tenant holding no resident slot "
          "starting in place of the tenant furthest over its share, a tenant over its rpm "
          "refused without a store call, and fair sharing that charges prefill at its measured "
          "cost, breaks equal keys toward the less served tenant and lets a tenant run one "
          "step ahead: no 5xx, nothing the victim sent lost, every refusal naming its cap "
          "(gRPC's own size refusal states the cap in its details), Redis far under its "
          "watermark, and the gRPC pattern passes. The busy phase shows why the 1.5× latency "
          "targets cannot hold on a CPU: an attacker within its quotas is entitled to its share "
          "of every step, and a step's cost grows with the tokens in it (the shipped profile: "
          "35 ms for one request of 5 tokens, 116 ms for a full batch of 8 and 64 tokens), so "
          "the victim's latency rises several-fold whenever another tenant fills the batch, "
          "benign or not. Measured against that phase (one run, 40 victim requests a phase: "
          "a p99 is its slowest), every pattern's TTFT p99 is within 0.6-1.8x a busy "
          "neighbour's but the unread streams' (3.2x), and TBT within 1.0-2.1x; /health stays "
          "within 30 ms in every phase, now that the kernels release the GIL, a flood's "
          "repeated refusals are answered at the door after a hold (gRPC, followers and tpm "
          "included), and a stream nobody reads is paused. Tenants' row shares (a tenant's "
          "chunks and draft nodes held to half of a step it shares) brought the victim's TBT "
          "p99 beside the stored flood from 2.4x to 1.8x a busy neighbour's and beside the "
          "schema bomb from 2.6x to 1.3x; beside the byte-token replays its median gap stayed "
          "at 125 ms (68 ms beside a busy neighbour): eight endless streams there hold the "
          "batch's slots, which the shares of a step's rows do not divide.",
          ("results/loadtest_hostile*.json",), t.hostile),
    Bench("soak", "specgate soak --minutes 10 --rate 1 --json results/soak.json",
          "Mixed load for N minutes after a warm-up that lasts until the prefix cache stops "
          "filling: the gateway's RSS, open fds, Redis memory and latency per window, with a "
          "line fitted to p50 and tested against the windows' scatter.", "",
          ("results/soak*.json",), t.scalars),
    Bench("sim",
          "specgate sim --policies fcfs,sjf,las,laps,srpt --requests 10000 --load 0.85 --seed 1 "
          "--json results/sim_default.json",
          "Discrete-event simulation of the scheduling policies: the gateway's own step loop, "
          "planner and policies, over a simulated worker that samples acceptance from each "
          "request's true α and charges the step-cost profile: per policy mean, p50 and p99 "
          "latency, the longest wait, and latency split into time waiting and time inside steps "
          "(only the waiting is the order of service's to move). `--arrival-cv 3 "
          "--prefill-chunk-tokens 24` is the bursty regime with chunked prefill. `--tiers "
          "priority=0.2,default=0.5,flex=0.3` sells the requests service tiers and reports the "
          "share of each tier's requests that met the gateway's objectives for it (a TTFT "
          "target that grows with the prompt's prefill, as /metrics judges it) and the goodput "
          "of those.",
          "At the engine's batch of 8 the CPU engine is close to processor sharing: a request "
          "spends most of its latency in the batch, which no order changes, so even clairvoyant "
          "srpt takes little off FCFS's mean. Where order matters (one sequence a step, load "
          "near capacity, bursty arrivals) LAPS-SD takes most of srpt's reduction and stays "
          "below SJF; the length predictor, not the policy, keeps it from more. With tiers, "
          "below capacity every policy serves the priority tier first and they attain about "
          "the same; no policy reaches the priority tier's 99 % on this CPU profile, where a "
          "long prompt's 24-token chunks ride in full-batch steps. The `priority alone` "
          "column runs the same priority requests again with every lower tier removed: the "
          "tier attains about as much alone as in the mix, so what it misses is its own bursts "
          "of long prompts (their prefill past the objective's allowance), which no order of "
          "the lower tiers can give back. Under overload strict "
          "priority keeps the most goodput: FCFS and LAPS age overdue default and flex "
          "requests into the resident slots, and a priority request then starts in place of "
          "one of them, paid for in re-prefills and a longer p99. Tenants' row shares (a "
          "tenant's chunks and draft nodes held to its share of a step it shares, for the "
          "others' gaps between tokens) cost the bursty regime 1-2 % of mean latency "
          "and lengthen its longest wait, that of the tenant whose burst is held to its share; "
          "with tiers they raise the priority tier's attainment slightly and, under overload "
          "(load 1.3), cost LAPS about a tenth of its goodput, rows a share leaves unused being "
          "rows no one computes; the whole-prefill regime, where only draft nodes are shared, "
          "is unchanged.",
          ("results/sim*.json",), t.sim),
)

INTRO = """# Benchmarks

What each benchmark measures, the command that writes its current result, what the figures show,
and the figures themselves with the machine, date and commit they were measured on. This page is
written by `specgate docs` from `results/*.json` (and the two results the program also reads,
`tools/data/bench_lengths.json` and `tools/data/profile_intel_chunks.json`); to change a figure,
re-run the benchmark with `--json results/NAME.json` and then `specgate docs`, never edit the page.

The machines are 2-core cloud VMs shared with other work. Between runs a minute apart the same
figure can move by a third, and between a CPU with AVX-512 (where the engine's kernels load) and
one without, several-fold: compare ratios measured in the same run, and figures only within one
machine. Superseded runs are not kept here; `git log -- results/` has them.
"""


def render(root: Path = ROOT) -> str:
    """The whole page for the result files under `root`."""
    claimed: set[Path] = set()
    toc, body = [], []
    for bench in BENCHES:
        files = sorted({p for pat in bench.files for p in root.glob(pat)})
        claimed.update(files)
        toc.append(f"- [{bench.name}](#{bench.name.replace(' ', '-')})"
                   + ("" if files else " (no current result)"))
        body += _section(bench, files, root)
    _check_claimed(root, claimed)
    return "\n".join([INTRO, *toc, "", *body]).rstrip() + "\n"


def _section(bench: Bench, files: list[Path], root: Path) -> list[str]:
    out = [f"## {bench.name}", "", f"**Measures.** {bench.measures}", "",
           f"**Run.** {_code(bench.command)}", ""]
    if not files:
        return out + ["No current result in `results/`: run the command above.", ""]
    out += [f"**What the figures show.** {bench.shows}", ""] if bench.shows else []
    for path in files:
        doc = json.loads(path.read_text(encoding="utf-8"))
        rel = path.relative_to(root).as_posix()
        out += [f"### `{rel}`", "", *_meta_lines(doc.get("meta")), *bench.table(doc), ""]
    return out


def _meta_lines(meta: Mapping[str, Any] | None) -> list[str]:
    if not meta:
        return ["No `meta` block: machine, date and commit unknown (re-run to stamp them).", ""]
    m = meta.get("machine") or {}
    flags = ", ".join(f"{k} {_flag(v)}" for k, v in (m.get("flags") or {}).items())
    out = [f"**Machine** {m.get('cpu', 'unknown')}, {m.get('cores', '?')} cores; {flags}. "
           f"**Date** {meta.get('date')}. **Commit** {meta.get('commit')}. "
           f"**torch** {meta.get('torch')}.", "", f"**Command** {_code(meta.get('command'))}", ""]
    if meta.get("note"):
        out += [f"Note: {meta['note']}.", ""]
    return out


def _code(text: Any) -> str:
    """An inline code span that survives backticks in its text."""
    text = str(text)
    return f"`` {text} ``" if "`" in text else f"`{text}`"


def _flag(v: Any) -> str:
    return "unknown" if v is None else ("yes" if v else "no")


def _check_claimed(root: Path, claimed: set[Path]) -> None:
    """Every file in results/ belongs to a benchmark on the page (tools/data also holds data)."""
    stray = sorted(p.relative_to(root).as_posix() for p in (root / "results").glob("*.json")
                   if p not in claimed)
    if stray:
        raise ValueError(f"no benchmark in tools/bench_docs.py claims {', '.join(stray)}: add "
                         "it to BENCHES (or to a benchmark's files) so the page shows it")


def write(root: Path = ROOT) -> Path:
    path = root / PAGE
    path.write_text(render(root), encoding="utf-8")
    return path
