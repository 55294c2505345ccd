"""`specgate bench lengths`: how well the length predictor (scheduler/length_predictor.py) ranks
requests of mixed work by their output length, offline, beside a tenant-record-only baseline.

On the shipped prompt set (tools/length_data.py: six kinds of work, each with the default model's
own greedy answer), split by a seeded shuffle within each kind (2/3 train, 1/3 test):

1. Features: one forward pass of the target over prompt + answer gives the final-normed hidden
   state at every checkpoint at once (`LlamaForward.forward_hidden`): after `c` committed tokens,
   the row of the last committed token, prompt_len - 1 + c; at arrival (c = 0) the prompt's last
   token. The same numbers the verifier reports as `StepResult.features` at that point.
2. Train: `LengthPredictor` on the train split, a sample at every checkpoint c < length
   (features at c, committed c, remaining = length - c). The ridge strength is chosen by k-fold
   cross-validation on the train split alone (folds by record: a record's checkpoints are
   correlated), by the held-out mean squared error of ln remaining.
3. Report on the test split: at arrival, Spearman ρ of predicted vs true length and the median
   |ln(pred/true)|; then per checkpoint the same for the remaining length, and σ, the spread of
   ln(true remaining) - log_mean: how the predictor's error shrinks as a request progresses,
   which a simulator's predictor model reads.

The prediction is the log-normal's median, exp(log_mean), for the model and the baseline alike
(ρ is the same for the mean, which only scales every prediction of one checkpoint by one
factor; the median is what |ln(pred/true)| rewards). Predictions are clipped at the answer cap:
a request's max_tokens is known at arrival.

Baseline: each tenant's record of finished lengths on the train split, its log-mean as the
prediction (at checkpoint c: the log-mean remaining of its records still running at c). Each
kind of work is one tenant here: a tenant that sends one kind of work only is the strongest form
of this baseline, so beating it means the hidden state knows about the request, not just its
kind.

`--save-weights PATH` also fits the predictor, with the chosen ridge, on every record that the
load tests do not send (`loadtest/workloads/`) and writes it there: the weights shipped for the
default model (`scheduler/predictors/`, read by scheduler/length_learner.py), so that the
gateway predicts from its first request without having seen the prompts it is measured on.

`--loadtest-mix chat,copy,... --max-tokens 512`: instead, the shipped weights on the load test's
own prompts (`loadtest/workloads/`, never trained on), each answered greedily under that cap, as
`loadtest compare` sends them: Spearman ρ at arrival overall and per workload, and how many ran
to the cap. What the gateway's policies have to rank with in that comparison.

Capped answers (no stop token within the cap) stay in, with the cap as their length: it is what
the gateway would have produced under that max_tokens, so it is the work the scheduler would
have had to plan for; dropping them would hide the longest requests from both predictors.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Sequence

import numpy as np

from scheduler.length_predictor import LengthPredictor, PredictorWeights
from tools.length_data import DATA_PATH, KINDS, load_length_set
from loadtest.results import write_result

CHECKPOINTS = (0, 16, 32, 64, 128, 256, 512)
RIDGES = (1e-2, 1e-1, 1.0, 10.0, 100.0, 1e3, 1e4)
FOLDS = 5
TRAIN_SHARE = 2 / 3


def add_arguments(p: argparse.ArgumentParser) -> None:
    from workers.model.loader import DEFAULT_MODEL

    p.add_argument("--data", type=Path, default=DATA_PATH, help="the prompt set (tools/length_data.py)")
    p.add_argument("--model", default=DEFAULT_MODEL, help="the model whose answers the set holds")
    p.add_argument("--seed", type=int, default=0, help="seeds the train/test shuffle")
    p.add_argument("--limit", type=int, default=0, help="use the first N records of each kind (0: all)")
    p.add_argument("--json", type=Path, help="write the results here")
    p.add_argument("--loadtest-mix", help="comma-separated load-test workloads: rank their prompts "
                   "with the shipped weights instead (module docstring)")
    p.add_argument("--max-tokens", type=int, default=512, help="the answer cap with --loadtest-mix")
    p.add_argument("--save-weights", type=Path,
                   help="fit on every record the load tests do not send and write the weights "
                        "here (scheduler/predictors/<model>.json ships them)")


def run(args: argparse.Namespace) -> int:
    if args.loadtest_mix:
        report = loadtest_mix(args.loadtest_mix.split(","), cap=args.max_tokens, model=args.model)
        text = json.dumps(_no_nan(report), indent=1)
        print(text)
        if args.json:
            write_result(args.json, _no_nan(report))
        return 0
    records = load_length_set(args.data)
    if args.limit:
        records = [r for k in KINDS for r in [r for r in records if r["kind"] == k][:args.limit]]
    report = bench_lengths(records, model=args.model, seed=args.seed,
                           save_weights=args.save_weights)
    print(format_table(report))
    if args.json:
        write_result(args.json, _no_nan(report))
    return 0


def _no_nan(x):
    """NaN (a ρ over constant values) as null: JSON has no NaN."""
    if isinstance(x, dict):
        return {k: _no_nan(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_no_nan(v) for v in x]
    return None if isinstance(x, float) and x != x else x


# --- metrics ---------------------------------------------------------------------------------------
def ranks(a: Sequence[float]) -> np.ndarray:
    """Ranks from 1, ties given their average rank (as Spearman's ρ needs)."""
    a = np.asarray(a, dtype=np.float64)
    order = np.argsort(a, kind="stable")
    r = np.empty(len(a))
    r[order] = np.arange(1, len(a) + 1)
    _, inverse, counts = np.unique(a, return_inverse=True, return_counts=True)
    sums = np.bincount(inverse, weights=r)
    return sums[inverse] / counts[inverse]


def spearman(a: Sequence[float], b: Sequence[float]) -> float:
    """Spearman's ρ: Pearson's correlation of the ranks; NaN where either side is constant."""
    ra, rb = ranks(a), ranks(b)
    if len(ra) < 2 or ra.std() == 0 or rb.std() == 0:
        return float("nan")
    return float(np.corrcoef(ra, rb)[0, 1])


def median_abs_log_error(pred: Sequence[float], true: Sequence[float]) -> float:
    """median |ln(pred / true)|: 0.69 means the typical prediction is off by a factor of 2."""
    return float(np.median(np.abs(np.log(np.asarray(pred, float) / np.asarray(true, float)))))


# --- features --------------------------------------------------------------------------------------
def checkpoint_features(forward, prompt_ids: Sequence[int], answer_ids: Sequence[int],
                        checkpoints: Sequence[int] = CHECKPOINTS) -> tuple[list[int], np.ndarray]:
    """The hidden state after c committed tokens, for each checkpoint c < len(answer_ids): one
    causal forward over prompt + answer, up to the last checkpoint's row (nothing later is read).
    Returns (the checkpoints kept, features [K, H])."""
    import torch

    from workers.model.llama_forward import Segment

    cs = [c for c in checkpoints if c < len(answer_ids)]
    rows = [len(prompt_ids) - 1 + c for c in cs]
    ids = (list(prompt_ids) + list(answer_ids))[: rows[-1] + 1]
    n = len(ids)
    causal = torch.full((n, n), float("-inf")).triu(1)
    _, hidden = forward.forward_hidden(torch.tensor(ids), torch.arange(n),
                                       [Segment(forward.new_cache(n), 0, n, causal)],
                                       torch.tensor(rows))                              # [K, H]
    return cs, hidden.float().numpy().astype(np.float64)


def all_features(forward, records: list[dict], log=None) -> list[tuple[list[int], np.ndarray]]:
    out = []
    for i, r in enumerate(records):
        out.append(checkpoint_features(forward, r["prompt_ids"], r["answer_ids"]))
        if log is not None and (i + 1) % 25 == 0:
            print(f"features: {i + 1}/{len(records)}", file=log, flush=True)
    return out


# --- split, training, baseline -----------------------------------------------------------------------
def split(records: list[dict], seed: int, share: float = TRAIN_SHARE) -> tuple[list[int], list[int]]:
    """Record indices (train, test): a seeded shuffle within each kind, `share` of it to train."""
    rng = np.random.default_rng(seed)
    train, test = [], []
    for kind in sorted({r["kind"] for r in records}):
        idx = [i for i, r in enumerate(records) if r["kind"] == kind]
        idx = [idx[j] for j in rng.permutation(len(idx))]
        cut = round(len(idx) * share)
        train += idx[:cut]
        test += idx[cut:]
    return sorted(train), sorted(test)


def train(records: list[dict], feats, idx: Sequence[int], ridge: float) -> PredictorWeights:
    """The predictor fitted on records `idx`, a sample at each of their checkpoints."""
    dim = feats[idx[0]][1].shape[1]
    p = LengthPredictor(dim, ridge=ridge, min_samples=1)
    for i in idx:
        for c, f in zip(*feats[i]):
            p.observe(f, c, records[i]["length"] - c)
    return p.fit()


def choose_ridge(records: list[dict], feats, idx: Sequence[int], ridges: Sequence[float] = RIDGES,
                 folds: int = FOLDS) -> tuple[float, dict[str, float]]:
    """The ridge strength with the least held-out mean squared error of ln remaining, over
    `folds` folds of the records `idx` (by record, dealt round-robin within each kind)."""
    fold = {}
    for kind in sorted({records[i]["kind"] for i in idx}):
        for j, i in enumerate(i for i in idx if records[i]["kind"] == kind):
            fold[i] = j % folds
    cv = {}
    for ridge in ridges:
        err = []
        for k in range(folds):
            w = train(records, feats, [i for i in idx if fold[i] != k], ridge)
            for i in (i for i in idx if fold[i] == k):
                for c, f in zip(*feats[i]):
                    err.append((w.log_mean(f, c) - np.log(records[i]["length"] - c)) ** 2)
        cv[f"{ridge:g}"] = float(np.mean(err))
    best = min(ridges, key=lambda r: cv[f"{r:g}"])
    return best, cv


def tenant_log_means(records: list[dict], idx: Sequence[int], c: int) -> dict[str, float]:
    """Each tenant's (kind's) log-mean remaining length at c, over its records of `idx` still
    running at c; "" is every tenant's together (for a tenant with no record at c)."""
    out = {}
    for kind in [""] + sorted({records[i]["kind"] for i in idx}):
        rem = [records[i]["length"] - c for i in idx
               if records[i]["length"] > c and kind in ("", records[i]["kind"])]
        if rem:
            out[kind] = float(np.mean(np.log(rem)))
    return out


# --- the bench -------------------------------------------------------------------------------------
def evaluate(records: list[dict], feats, w: PredictorWeights, train_idx: Sequence[int],
             test_idx: Sequence[int], c: int, cap: float) -> dict:
    """Test-split figures at checkpoint c, for the test records still running at c."""
    idx = [i for i in test_idx if records[i]["length"] > c]
    true = np.array([records[i]["length"] - c for i in idx], float)
    log_mean = np.array([w.log_mean(feats[i][1][feats[i][0].index(c)], c) for i in idx])
    pred = np.minimum(np.exp(log_mean), cap - c)
    base_lm = tenant_log_means(records, train_idx, c)
    base = np.minimum([np.exp(base_lm.get(records[i]["kind"], base_lm[""])) for i in idx], cap - c)
    return {"committed": c, "n": len(idx), "spearman": spearman(pred, true),
            "median_abs_log_error": median_abs_log_error(pred, true),
            "sigma": float(np.std(np.log(true) - log_mean)),
            "baseline": {"spearman": spearman(base, true),
                         "median_abs_log_error": median_abs_log_error(base, true)},
            "_pred": pred, "_base": base, "_true": true, "_idx": idx}


def per_kind(records: list[dict], at_arrival: dict) -> dict[str, dict]:
    out = {}
    kinds = np.array([records[i]["kind"] for i in at_arrival["_idx"]])
    for kind in sorted(set(kinds)):
        m = kinds == kind
        pred, base, true = at_arrival["_pred"][m], at_arrival["_base"][m], at_arrival["_true"][m]
        out[kind] = {"n": int(m.sum()), "median_length": float(np.median(true)),
                     "median_predicted": float(np.median(pred)),
                     "spearman": spearman(pred, true),      # within the kind: what the baseline lacks
                     "median_abs_log_error": median_abs_log_error(pred, true),
                     "baseline_median_abs_log_error": median_abs_log_error(base, true)}
    return out


def shippable(records: list[dict]) -> list[int]:
    """Indices of the records the load tests do not send."""
    from loadtest.workload import WORKLOADS, load_workload

    sent = {r["id"] for w in WORKLOADS for r in load_workload(w)}
    return [i for i, r in enumerate(records) if r["id"] not in sent]


def bench_lengths(records: list[dict], *, model: str | None = None, seed: int = 0,
                  forward=None, log=None, save_weights: Path | None = None) -> dict:
    """The whole bench; `forward` (a LlamaForward) instead of loading `model`."""
    import sys

    t0 = time.perf_counter()
    if forward is None:
        from workers.runtime import load_runtime
        forward = load_runtime(model, progress=False).forward
    feats = all_features(forward, records, log=sys.stderr if log is None else log)
    t_feat = time.perf_counter() - t0
    train_idx, test_idx = split(records, seed)
    ridge, cv = choose_ridge(records, feats, train_idx)
    w = train(records, feats, train_idx, ridge)
    capped = [r["length"] for r in records if r.get("capped")]
    cap = max(capped) if capped else float("inf")
    running = [c for c in CHECKPOINTS if sum(records[i]["length"] > c for i in test_idx) >= 2]
    points = [evaluate(records, feats, w, train_idx, test_idx, c, cap) for c in running]
    arrival = points[0]
    shipped = None
    if save_weights is not None:
        idx = shippable(records)
        doc = {**train(records, feats, idx, ridge).to_dict(), "ridge": ridge,
               "trained_on": len(idx), "model": model}
        save_weights.write_text(json.dumps(doc) + "\n", encoding="utf-8")
        shipped = {"path": str(save_weights), "trained_on": len(idx)}
    return {
        "model": model, "records": len(records), "train": len(train_idx), "test": len(test_idx),
        "capped": len(capped), "dim": w.dim, "ridge": ridge, "ridge_cv_mse": cv, "seed": seed,
        "prediction": "median: exp(log_mean), clipped at the cap",
        "spearman": arrival["spearman"], "median_abs_log_error": arrival["median_abs_log_error"],
        "baseline": arrival["baseline"],
        "checkpoints": [{k: v for k, v in p.items() if not k.startswith("_")} for p in points],
        "per_kind": per_kind(records, arrival),
        "fit_sigma": w.sigma, "saved_weights": shipped,
        "features_seconds": round(t_feat, 1), "seconds": round(time.perf_counter() - t0, 1),
    }


def format_table(report: dict) -> str:
    lines = [f"{report['records']} records ({report['train']} train, {report['test']} test, "
             f"{report['capped']} capped); ridge {report['ridge']:g} (cross-validated); "
             f"prediction = {report['prediction']}",
             f"{'committed':>9} {'n':>4} {'spearman':>9} {'|ln err|':>9} {'sigma':>6}   "
             f"{'base rho':>8} {'base err':>8}"]
    for p in report["checkpoints"]:
        b = p["baseline"]
        lines.append(f"{p['committed']:>9} {p['n']:>4} {p['spearman']:>9.3f} "
                     f"{p['median_abs_log_error']:>9.3f} {p['sigma']:>6.3f}   "
                     f"{b['spearman']:>8.3f} {b['median_abs_log_error']:>8.3f}")
    lines.append(f"{'kind':>10} {'n':>3} {'median len':>10} {'median pred':>11} {'rho in kind':>11} "
                 f"{'|ln err|':>8} {'base err':>8}")
    for kind, k in report["per_kind"].items():
        lines.append(f"{kind:>10} {k['n']:>3} {k['median_length']:>10.0f} {k['median_predicted']:>11.0f} "
                     f"{k['spearman']:>11.3f} {k['median_abs_log_error']:>8.3f} "
                     f"{k['baseline_median_abs_log_error']:>8.3f}")
    lines.append(f"{report['seconds']:.0f} s ({report['features_seconds']:.0f} s of features)")
    return "\n".join(lines)


# --- the load test's own prompts -------------------------------------------------------------------
def loadtest_mix(workloads: Sequence[str], *, cap: int, model: str) -> dict:
    """The shipped weights' ranking of the load test's prompts, answered greedily under `cap`."""
    from loadtest.workload import load_workload
    from scheduler.length_learner import shipped_predictor
    from tools.length_data import generate_answers

    shipped = shipped_predictor(model)
    if shipped is None:
        raise SystemExit(f"no shipped length predictor for {model!r}")
    w = shipped[0]
    from workers.runtime import load_runtime

    records = [dict(r, kind=k) for k in workloads for r in load_workload(k)]
    rt = load_runtime(model, progress=False)          # one load: answers, then their features
    answered = generate_answers(records, model=model, cap=cap, runtime=rt)
    forward = rt.forward
    pred, true = [], []
    for r in answered:
        _, f = checkpoint_features(forward, r["prompt_ids"], r["answer_ids"], (0,))
        pred.append(min(cap, float(np.exp(w.log_mean(f[0], 0)))))
        true.append(r["length"])
    kinds = {}
    for k in workloads:
        idx = [i for i, r in enumerate(answered) if r["kind"] == k]
        kinds[k] = {"spearman": spearman([pred[i] for i in idx], [true[i] for i in idx]),
                    "true_lengths": sorted(true[i] for i in idx),
                    "ran_to_cap": sum(answered[i]["capped"] for i in idx)}
    return {"model": model, "cap": cap, "prompts": len(answered),
            "spearman": spearman(pred, true), "median_abs_log_error": median_abs_log_error(pred, true),
            "ran_to_cap": sum(r["capped"] for r in answered), "per_workload": kinds}
