"""`specgate plan`: the throughput model's predicted tokens/s and multiplier over plain decoding
(tools/throughput.py) for every drafter × tree shape × batch size × context length, and,
with `--measure`, the same figures measured on the real target beside the predictions.

What is calibrated, and on what; what is predicted:

- step cost (t_verify, t_target) comes from the profile (`--profile`, default the shipped one),
  measured beforehand by `specgate bench profile` on random tokens: no run of this command.
- each drafter's acceptance (α, coverage, reach) and draft cost (seconds per call, fixed + per
  node) are given (`--alpha ngram=0.7`: coverage and reach 1, draft cost 0) or, by default,
  fitted (`tools.throughput.fit_acceptance`) on calibration runs (batch 1,
  `--calibration-shape`) that never see the measured steps:
  `--calibrate-on steps` (default): the measured records themselves, each from its start until
  it has committed `--lead-in` tokens; the measured runs start after those tokens (prompt + the
  target's first `--lead-in` tokens). A request's earlier steps predict its later ones, as its
  acceptance history does for the step planner.
  `--calibrate-on prompts`: the workload's first `--calibration-prompts` records; the measured
  runs use the next `--measure-prompts` records.
  The loop's own per-request overhead per step is measured on the calibration runs too.
- predicted: τ, drafted nodes, step seconds, tokens/s and the multiplier of every configuration,
  at its shape, batch size and context: no configuration is fitted at its own shape or batch.
- measured (`--measure`): each configuration of `--configs` run for real on `--steps` steps of
  each of `--measure-prompts` records (after the lead-in, or after the calibration records), through
  `workers.batch_worker.BatchWorker` as the engine and the step loop drive it (scheduler/
  plan_measure.py). The prediction for a measured configuration uses the context it will hold
  on average: the measured prompts' mean length plus half the tokens the model predicts it will
  commit (not the measured run's own count). error = predicted ÷ measured − 1. Each measured
  row also carries `hindsight`: the run's own fitted acceptance and what the model predicts with
  it, a diagnostic (never the prediction) that separates acceptance-transfer error from
  cost-model error.

`--json OUT` writes {"configurations": [...], "grid": [...], "calibration": {...}, ...}: the
measured configurations (when `--measure`, else the predicted grid) each with
`predicted_tokens_per_s`, `measured_tokens_per_s` and `error` where measured. Timings are only
as good as the machine is idle: each measured configuration records `foreign_cpu_share`, the CPU
other processes used per second of its run (from /proc; ~0 on an idle machine), and the document
the load average before and after.
"""
from __future__ import annotations

import datetime
import os
import sys
from dataclasses import asdict, dataclass
from typing import Any, Sequence

from scheduler.profile import StepCostModel
from tools.throughput import Acceptance, DrafterCost, ThroughputModel, TreeShape, prediction_row
from loadtest.results import write_result

DEFAULT_DRAFTERS = "ngram,suffix"
DEFAULT_SHAPES = "chain:1,chain:2,chain:4,chain:8,widths:2x2x1"
DEFAULT_BATCHES = "1,4"
# drafter/shape/batch: batch 1 and 4, two lookup drafters, chains of 4 and 8, and plain decoding.
DEFAULT_CONFIGS = ("ngram/chain:4/1,ngram/chain:8/1,suffix/chain:4/1,"
                   "ngram/chain:4/4,suffix/chain:8/4,none/none/4")


@dataclass(frozen=True)
class DrafterModel:
    """What the throughput model knows of one drafter."""
    name: str
    acceptance: Acceptance
    cost: DrafterCost = DrafterCost()
    source: str = "given"                # "given" (--alpha) | "calibrated"


@dataclass(frozen=True)
class Config:
    drafter: str
    shape: TreeShape
    batch: int

    @classmethod
    def parse(cls, text: str) -> "Config":
        try:
            drafter, shape, batch = text.strip().split("/")
            return cls(drafter, TreeShape.parse(shape), int(batch))
        except ValueError as e:
            raise ValueError(f"configuration {text!r}: use drafter/shape/batch, "
                             f"e.g. ngram/chain:4/1 ({e})") from None


def _list(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def _ints(text: str) -> list[int]:
    return [int(x) for x in _list(text)]


def parse_alphas(text: str, drafters: Sequence[str]) -> dict[str, float | None]:
    """`measured`, one α for every drafter (`0.7`), or per drafter (`ngram=0.7,suffix=0.4`);
    None = measured (calibrated).

    >>> parse_alphas("ngram=0.7", ["ngram", "suffix"]), parse_alphas("0.5", ["ngram"])
    ({'ngram': 0.7, 'suffix': None}, {'ngram': 0.5})
    """
    out: dict[str, float | None] = {d: None for d in drafters}
    for part in _list(text):
        if part == "measured":
            continue
        name, eq, value = part.rpartition("=")
        if not eq:
            out = {d: float(value) for d in drafters}
        elif name in out:
            out[name] = float(value)
        else:
            raise ValueError(f"--alpha names {name!r}, which is not among --drafters {list(drafters)}")
    return out


def grid(model: ThroughputModel, drafters: Sequence[DrafterModel], shapes: Sequence[TreeShape],
         batches: Sequence[int], contexts: Sequence[int | None]) -> list[dict[str, Any]]:
    """The predicted table: one row per drafter × shape × batch × context."""
    rows = []
    for d in drafters:
        for shape in shapes if d.name != "none" else [TreeShape()]:
            for batch in batches:
                for context in contexts:
                    p = model.predict(d.acceptance, shape, batch, context, d.cost)
                    rows.append(prediction_row(d.name, shape, batch, context, p))
    return rows


def format_grid(rows: Sequence[dict[str, Any]], drafters: dict[str, DrafterModel]) -> str:
    out = ["| drafter | α | coverage | reach | shape | batch | context | E[τ] | step ms | tok/s | × plain |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        a = drafters[r["drafter"]].acceptance
        out.append(f"| {r['drafter']} | {a.alpha:.2f} | {a.coverage:.2f} | {a.reach:.2f} | "
                   f"{r['shape']} | {r['batch']} | {r['context'] if r['context'] is not None else '-'} | "
                   f"{r['predicted_tau']:.2f} | {r['predicted_step_ms']:.1f} | "
                   f"{r['predicted_tokens_per_s']:.1f} | {r['predicted_multiplier']:.2f} |")
    return "\n".join(out)


def format_measured(rows: Sequence[dict[str, Any]]) -> str:
    out = ["| drafter | shape | batch | context | E[τ] pred | τ meas | tok/s pred | tok/s meas | error |",
           "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['drafter']} | {r['shape']} | {r['batch']} | {r['context']} | "
                   f"{r['predicted_tau']:.2f} | {r['measured_tau']:.2f} | "
                   f"{r['predicted_tokens_per_s']:.1f} | {r['measured_tokens_per_s']:.1f} | "
                   f"{100 * r['error']:+.1f}% |")
    return "\n".join(out)


def _load_avg() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


# ---- CLI (wired as `specgate plan` by specgate/cli.py) ------------------------------------------
def add_arguments(parser) -> None:
    parser.add_argument("--profile", default=None,
                        help="step-cost profile JSON (default: the shipped scheduler/profiles/default.json)")
    parser.add_argument("--drafters", default=DEFAULT_DRAFTERS,
                        help="comma-separated drafter names (as the registry knows them)")
    parser.add_argument("--alpha", default="measured",
                        help="'measured' (calibrate on the workload), one α for all (0.7), or per "
                             "drafter (ngram=0.7,suffix=0.4; the others measured)")
    parser.add_argument("--shapes", default=DEFAULT_SHAPES,
                        help="comma-separated tree shapes: chain:D, widths:K1xK2x…, none")
    parser.add_argument("--batches", default=DEFAULT_BATCHES, help="comma-separated batch sizes")
    parser.add_argument("--contexts", default="",
                        help="comma-separated context lengths (default: the profile's contexts)")
    parser.add_argument("--measure", action="store_true",
                        help="run each of --configs on the real target and compare")
    parser.add_argument("--configs", default=DEFAULT_CONFIGS,
                        help="configurations --measure runs: comma-separated drafter/shape/batch")
    parser.add_argument("--model", default=None, help="target model (default: the default model)")
    parser.add_argument("--workload", default="copy", help="loadtest workload the prompts come from")
    parser.add_argument("--calibration-prompts", type=int, default=6,
                        help="--calibrate-on prompts: the workload's first N records calibrate")
    parser.add_argument("--calibration-shape", default="chain:8",
                        help="the tree shape the calibration runs draft")
    parser.add_argument("--measure-prompts", type=int, default=8,
                        help="records the measured runs use (after the calibration records "
                             "with --calibrate-on prompts)")
    parser.add_argument("--calibrate-on", choices=("prompts", "steps"), default="steps",
                        help="prompts: calibrate on other records of the workload than those "
                             "measured; steps: on the measured records' first --lead-in tokens, "
                             "measuring from there on")
    parser.add_argument("--lead-in", type=int, default=96,
                        help="--calibrate-on steps: tokens of each record calibration sees")
    parser.add_argument("--steps", type=int, default=48, help="steps per request in every run")
    parser.add_argument("--threads", type=int, default=None, help="torch threads")
    parser.add_argument("--json", dest="json_out", default=None, help="write the results here")


def run(args) -> int:
    drafter_names = _list(args.drafters)
    shapes = [TreeShape.parse(s) for s in _list(args.shapes)]
    configs = [Config.parse(c) for c in _list(args.configs)] if args.measure else []
    alphas = parse_alphas(args.alpha, drafter_names)
    for c in configs:
        alphas.setdefault(c.drafter, None)
    profile = StepCostModel.from_json(args.profile)
    doc: dict[str, Any] = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(
        timespec="seconds"), "profile": args.profile or "scheduler/profiles/default.json",
        "profile_source": profile.source}

    bench = None
    overhead_s = 0.0
    if args.measure or any(a is None and d != "none" for d, a in alphas.items()):
        from tools.plan_measure import PlanBench
        bench = PlanBench.load(args)
        doc.update(bench.describe())
    models: dict[str, DrafterModel] = {}
    for name, alpha in alphas.items():
        if name == "none":
            models[name] = DrafterModel(name, Acceptance(0.0, coverage=0.0))
        elif alpha is not None:
            models[name] = DrafterModel(name, Acceptance(alpha))
        else:
            cal = bench.calibrate(name)
            models[name] = DrafterModel(name, cal.acceptance, cal.cost, "calibrated")
            overhead_s = max(overhead_s, cal.overhead_s)
    doc["calibration"] = {name: {"source": m.source, **asdict(m.acceptance),
                                 "draft_cost": asdict(m.cost)} for name, m in models.items()}
    doc["overhead_s_per_request_step"] = overhead_s
    model = ThroughputModel(profile, overhead_s=overhead_s)

    contexts: list[int | None] = _ints(args.contexts) or (
        profile.contexts if len(profile.contexts) > 1 else [profile.contexts[0]])
    rows = grid(model, [models[d] for d in drafter_names], shapes, _ints(args.batches), contexts)
    print(format_grid(rows, models))
    doc["grid"] = rows
    doc["configurations"] = rows
    if configs:
        doc["load_avg_before"] = _load_avg()       # other work on the machine distorts the timings
        measured = [bench.measure(model, models[c.drafter], c.shape, c.batch) for c in configs]
        doc["load_avg_after"] = _load_avg()
        print()
        print(format_measured(measured))
        doc["configurations"] = measured
        worst = max(abs(r["error"]) for r in measured)
        print(f"\nlargest |error| {100 * worst:.1f}% over {len(measured)} configurations",
              file=sys.stderr)
    if args.json_out:
        write_result(args.json_out, doc)
    return 0
