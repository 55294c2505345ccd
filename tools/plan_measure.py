"""Real runs for `specgate plan`: calibrate each drafter's acceptance and cost, and measure the
tokens per second of a configuration (drafter × tree shape × batch size) on the real verifier.

Both drive `workers.batch_worker.BatchWorker` — the class the engine (`specgate bench engine`) and
the scheduler's step loop drive — with a fixed tree budget per step (`adaptive=False`: the shape
under test is drafted every step, not the controller's choice). A run prefills a group of
`batch` prompts (not timed), then times `steps` steps of the whole group; tokens/s = tokens
committed ÷ the wall time of those steps (drafting, verification and the loop's bookkeeping).

Stop tokens are ignored (every request runs all its steps), so the batch size holds for the
whole run; the loop is greedy (the target's output is what plain decoding gives).

A `RecordingDrafter` wraps the drafter under test: it times every `propose` call and keeps what
each proposed (nodes, depth), which, with each step's accepted count, is the acceptance history
that `tools.throughput.fit_acceptance` fits.
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field, replace
from typing import Sequence

from tools.throughput import (Acceptance, DrafterCost, TreeShape, fit_acceptance, fit_drafter_cost,
                              prediction_row)
from workers.contract import SamplingParams
from workers.batch_worker import BatchWorker
from workers.contract import WorkItem
from workers.drafters.base import Drafter
from workers.contract import DraftContext, TreeBudget
from workers.drafters.registry import create_drafter
from workers.speculation.tree import TokenTree, depths


def cpu_seconds() -> tuple[float, float] | None:
    """(CPU seconds all processes have been busy, CPU seconds of this process) from /proc, or
    None off Linux: their differences over a run show how much other work shared the machine."""
    import os
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
        with open("/proc/self/stat") as f:
            own = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    tick = os.sysconf("SC_CLK_TCK")
    busy = sum(fields) - fields[3] - (fields[4] if len(fields) > 4 else 0)   # minus idle, iowait
    return busy / tick, (int(own[11]) + int(own[12])) / tick                 # utime + stime


def foreign_cpu_s(before: tuple[float, float] | None, after: tuple[float, float] | None) -> float | None:
    """CPU seconds other processes used between two `cpu_seconds()` readings."""
    if before is None or after is None:
        return None
    return max(0.0, (after[0] - before[0]) - (after[1] - before[1]))


class RecordingDrafter(Drafter):
    """A drafter that times and remembers each proposal of the drafter it wraps; every other
    capability is the inner drafter's."""

    def __init__(self, inner: Drafter) -> None:
        self.inner, self.name = inner, inner.name
        self.batched = inner.batched                        # a model drafter: one call per step
        self.calls: list[tuple[int, float]] = []            # (nodes proposed, seconds)
        self.last: dict[str, tuple[int, int, int]] = {}     # request → (budget depth, nodes, depth)

    def propose(self, ctx: DraftContext, budget: TreeBudget) -> TokenTree:
        t0 = time.perf_counter()
        tree = self.inner.propose(ctx, budget)
        self.calls.append((len(tree), time.perf_counter() - t0))
        self._remember(ctx, budget, tree)
        return tree

    def propose_batch(self, items: Sequence[tuple[DraftContext, TreeBudget]]) -> list[TokenTree]:
        if not self.batched:                                # one timed call per request
            return [self.propose(ctx, budget) for ctx, budget in items]
        t0 = time.perf_counter()
        trees = self.inner.propose_batch(items)
        self.calls.append((sum(map(len, trees)), time.perf_counter() - t0))
        for (ctx, budget), tree in zip(items, trees):
            self._remember(ctx, budget, tree)
        return trees

    def _remember(self, ctx: DraftContext, budget: TreeBudget, tree: TokenTree) -> None:
        nodes = min(len(tree), budget.max_nodes)           # BatchWorker holds a batch's trees to the budget
        depth = min(max(depths(tree), default=0), budget.max_depth)
        self.last[ctx.request_id] = (budget.max_depth, nodes, depth)

    def prefetch_batch(self, items: Sequence[tuple[DraftContext, TreeBudget]]) -> None:
        self.inner.prefetch_batch(items)

    def release(self, request_id: str) -> None:
        self.last.pop(request_id, None)
        self.inner.release(request_id)

    def evict(self, request_id: str) -> None:
        self.last.pop(request_id, None)
        self.inner.evict(request_id)


@dataclass
class RunStats:
    """What a set of runs measured: totals over every request-step."""
    tokens: int = 0
    seconds: float = 0.0
    steps: int = 0                      # verification steps
    request_steps: int = 0
    context_sum: float = 0.0            # Σ over request-steps of the request's context
    verify_s: float = 0.0
    draft_s: float = 0.0
    history: list[tuple[int, int, int, int]] = field(default_factory=list)
    calls: list[tuple[int, float]] = field(default_factory=list)
    batched: bool = False               # the drafter drafts a step's requests in one call
    outputs: list[list[int]] = field(default_factory=list)     # committed tokens, prompt order

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    @property
    def tau(self) -> float:
        return self.tokens / self.request_steps if self.request_steps else 0.0

    @property
    def mean_context(self) -> float:
        return self.context_sum / self.request_steps if self.request_steps else 0.0

    @property
    def overhead_s(self) -> float:
        """Seconds per request-step outside verification and drafting."""
        rest = self.seconds - self.verify_s - self.draft_s
        return max(0.0, rest) / self.request_steps if self.request_steps else 0.0


def run_configuration(verifier, drafter: str, shape: TreeShape, batch: int,
                      prompts: Sequence[Sequence[int]], steps: int,
                      until_tokens: int | None = None) -> RunStats:
    """Every prompt of `prompts`, `batch` at a time (a last short group is dropped), `steps`
    steps per group with `shape`'s budget, through one BatchWorker and a fresh drafter; a group
    stops early once each of its requests has committed `until_tokens`."""
    recorder = RecordingDrafter(create_drafter(drafter))
    worker = BatchWorker(verifier, default_drafter=drafter, drafters={drafter: recorder})
    budget = shape.budget()
    stats = RunStats()
    for g in range(len(prompts) // batch):
        group = prompts[g * batch:(g + 1) * batch]
        ids = [f"plan-{drafter}-{shape.name}-{batch}-{g}-{i}" for i in range(batch)]
        for rid, prompt in zip(ids, group):
            worker.prefill(rid, prompt, prompt_len=len(prompt), sampling=SamplingParams(),
                           max_new_tokens=steps * (shape.depth + 1))
        try:
            _steps(worker, recorder, ids, [len(p) for p in group], budget, steps, stats,
                   until_tokens)
        finally:
            for rid in ids:
                worker.release(rid)
    stats.calls, stats.batched = recorder.calls, recorder.batched
    return stats


def _steps(worker: BatchWorker, recorder: RecordingDrafter, ids: list[str], lengths: list[int],
           budget: TreeBudget, steps: int, stats: RunStats, until_tokens: int | None) -> None:
    timings = worker.verifier.timings
    verify0, draft0 = timings.forward_s + timings.other_s, worker.draft_s
    contexts = dict(zip(ids, lengths))          # each request's context: prompt + committed
    outputs: dict[str, list[int]] = {rid: [] for rid in ids}
    items = [WorkItem(rid, budget) for rid in ids]
    t0 = time.perf_counter()
    for _ in range(steps):
        if until_tokens is not None and min(map(len, outputs.values())) >= until_tokens:
            break
        for step in worker.step(items):
            rid = step.request_id
            stats.context_sum += contexts[rid]
            contexts[rid] += len(step.tokens)
            outputs[rid].extend(step.tokens)
            stats.tokens += len(step.tokens)
            if budget.speculates:
                budget_depth, nodes, depth = recorder.last.get(rid, (budget.max_depth, 0, 0))
                stats.history.append((budget_depth, nodes, depth, step.accepted))
        stats.steps += 1
        stats.request_steps += len(ids)
    stats.seconds += time.perf_counter() - t0
    stats.verify_s += timings.forward_s + timings.other_s - verify0
    stats.draft_s += worker.draft_s - draft0
    stats.outputs.extend(outputs[rid] for rid in ids)


@dataclass(frozen=True)
class Calibration:
    """A drafter's fitted acceptance and cost, from the calibration prompts."""
    acceptance: Acceptance
    cost: DrafterCost
    overhead_s: float
    request_steps: int


def calibrate(verifier, drafter: str, shape: TreeShape, prompts: Sequence[Sequence[int]],
              steps: int, until_tokens: int | None = None) -> Calibration:
    """Run `prompts` one at a time with `shape` and fit α, coverage, reach and draft cost."""
    stats = run_configuration(verifier, drafter, shape, 1, prompts, steps, until_tokens)
    acc = fit_acceptance(stats.history) if shape.depth else Acceptance(0.0, coverage=0.0)
    cost = replace(fit_drafter_cost(stats.calls), batched=stats.batched)
    return Calibration(acc, cost, stats.overhead_s, stats.request_steps)


class PlanBench:
    """The target, the prompts and the runs of one `specgate plan` invocation. Calibration never
    sees what is measured:

    - `calibrate_on="prompts"`: calibration runs the workload's first records, the measured runs
      the next ones;
    - `calibrate_on="steps"`: the same records, at different steps. Calibration runs each prompt
      from its start until it has committed `lead_in` tokens; the measured runs start after those
      tokens (prompt + the target's first `lead_in` tokens, from a plain run) and go on from there.
    """

    def __init__(self, verifier, calibration_prompts: Sequence[Sequence[int]],
                 measured_prompts: Sequence[Sequence[int]], *, calibration_shape: TreeShape,
                 steps: int, meta: dict, lead_in: int | None = None) -> None:
        if not calibration_prompts or not measured_prompts:
            raise ValueError("need at least one calibration prompt and one measured prompt")
        self.verifier, self.steps, self.meta = verifier, steps, meta
        self.calibration_prompts, self.measured_prompts = calibration_prompts, measured_prompts
        self.calibration_shape, self.lead_in = calibration_shape, lead_in
        self._calibrations: dict[str, Calibration] = {}

    @classmethod
    def load(cls, args) -> "PlanBench":
        """The real target (float32) and the workload's prompts, as `specgate bench engine` loads them."""
        import os

        from loadtest.workload import load_workload
        from workers.model.loader import DEFAULT_MODEL
        from workers.prompts import encode_record
        from workers.runtime import load_runtime

        if args.threads:
            import torch
            torch.set_num_threads(args.threads)
        model = args.model or DEFAULT_MODEL
        rt = load_runtime(model, dtype="float32", progress=False)
        records = load_workload(args.workload)
        by_steps = args.calibrate_on == "steps"
        n_cal, n_meas = (0 if by_steps else args.calibration_prompts), args.measure_prompts
        if n_cal + n_meas > len(records):
            raise ValueError(f"workload {args.workload!r} has {len(records)} records; "
                             f"{n_cal} calibration + {n_meas} measured prompts asked for")
        prompts = [encode_record(rt.tokenizer, r) for r in records[:n_cal + n_meas]]
        shape = TreeShape.parse(args.calibration_shape)
        verifier = rt.verifier(max_tree_tokens=max(64, shape.nodes))
        ids = [r.get("id") for r in records[:n_cal + n_meas]]
        meta = {"model": os.path.basename(str(model)), "dtype": "float32", "workload": args.workload,
                "calibrate_on": args.calibrate_on,
                "calibration_prompts": ids[:n_cal] if not by_steps else ids,
                "measured_prompts": ids[n_cal:], "calibration_shape": shape.name,
                "steps": args.steps}
        if by_steps:
            meta.update(calibration_tokens=args.lead_in, measured_from_token=args.lead_in)
            bench = cls(verifier, prompts, prompts, calibration_shape=shape, steps=args.steps,
                        meta=meta, lead_in=args.lead_in)
            bench.measured_prompts = bench.continue_prompts(prompts, args.lead_in)
        else:
            bench = cls(verifier, prompts[:n_cal], prompts[n_cal:], calibration_shape=shape,
                        steps=args.steps, meta=meta)
        bench.warm_up()
        return bench

    def continue_prompts(self, prompts: Sequence[Sequence[int]], tokens: int) -> list[list[int]]:
        """Each prompt followed by the target's first `tokens` tokens (plain greedy decoding,
        the whole set in one batch: one token per step)."""
        stats = run_configuration(self.verifier, "none", TreeShape(), len(prompts), prompts, tokens)
        return [list(p) + out[:tokens] for p, out in zip(prompts, stats.outputs)]

    def describe(self) -> dict:
        return dict(self.meta)

    def warm_up(self) -> None:
        """First calls pay one-off allocation and dispatch costs: a few unmeasured steps."""
        run_configuration(self.verifier, "ngram", TreeShape.chain(4), 1,
                          [self.calibration_prompts[0][:64]], steps=4)

    def calibrate(self, drafter: str) -> Calibration:
        if drafter not in self._calibrations:
            steps = self.steps if self.lead_in is None else self.lead_in   # ≥ 1 token a step
            self._calibrations[drafter] = calibrate(self.verifier, drafter, self.calibration_shape,
                                                    self.calibration_prompts, steps, self.lead_in)
        return self._calibrations[drafter]

    def measure(self, model, drafter, shape: TreeShape, batch: int) -> dict:
        """Predict, then run, one configuration (`drafter`: a plan_cmd.DrafterModel)."""

        if len(self.measured_prompts) < batch:
            raise ValueError(f"batch {batch} needs ≥ {batch} measured prompts")
        used = self.measured_prompts[:len(self.measured_prompts) // batch * batch]
        tau = drafter.acceptance.tau(shape)
        context = sum(map(len, used)) / len(used) + tau * (self.steps - 1) / 2
        p = model.predict(drafter.acceptance, shape, batch, round(context), drafter.cost)
        before, t0 = cpu_seconds(), time.perf_counter()
        stats = run_configuration(self.verifier, drafter.name, shape, batch, used, self.steps)
        foreign, wall = foreign_cpu_s(before, cpu_seconds()), time.perf_counter() - t0
        row = prediction_row(drafter.name, shape, batch, context, p)
        if stats.history:
            # Hindsight, a diagnostic only (never the prediction): the run's own acceptance, and
            # what the model predicts with it; separates acceptance transfer from cost errors.
            seen = fit_acceptance(stats.history)
            hind = model.predict(seen, shape, batch, round(stats.mean_context), drafter.cost)
            row["hindsight"] = {**{k: round(v, 4) for k, v in asdict(seen).items()},
                                "tau": round(hind.tau, 3),
                                "tokens_per_s": round(hind.tokens_per_s, 2)}
        row.update(measured_tokens_per_s=round(stats.tokens_per_s, 2),
                   measured_tau=round(stats.tau, 3),
                   measured_nodes=round(sum(h[1] for h in stats.history) / stats.request_steps, 3),
                   measured_step_ms=round(1000 * stats.seconds / stats.steps, 3),
                   measured_context=round(stats.mean_context),
                   measured_request_steps=stats.request_steps,
                   error=round(p.tokens_per_s / stats.tokens_per_s - 1, 4),
                   # CPU seconds other processes took per second of this run: ~0 on an idle machine
                   foreign_cpu_share=None if foreign is None else round(foreign / wall, 3))
        return row
