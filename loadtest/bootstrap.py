"""A paired, two-stage bootstrap for comparing scheduling policies: a 95% interval for each
policy's statistic (mean latency, p99, TTFT) and for each ratio between two policies.

The data are per-request values keyed by policy and by **unit**, the pairing unit of a
comparison: one (seed, round) of `loadtest compare` (or one seed of `sim`), in which every policy
was offered the same arrivals. A replicate resamples in two stages, as the data were made:

1. units, with replacement: the same draw of units for every policy (paired). A unit's arrivals,
   its machine state and its handful of long requests move every policy's figure together; drawing
   units jointly keeps that shared part out of a ratio, where it cancels, instead of counting it
   as a difference between the policies. `paired=False` draws them for each policy on its own
   (what the interval would be if the policies had been run on unrelated arrivals);
2. requests within each drawn unit, with replacement, for each policy on its own: policies
   complete different requests (errors, timeouts), so requests are not paired across them.

A statistic is then computed over a replicate's pooled requests, exactly as the point figure is
computed over all requests, and the interval is the 2.5th and 97.5th percentile of the replicates
(the percentile interval). With few units (2-3 seeds × 2 rounds) the first stage has few distinct
draws; the second stage then carries most of the spread, and the interval is wide, which is the
honest answer for so few runs.

Pure functions on plain data (lists of floats in dicts); numpy does the resampling, no loop per
request or per replicate. Quantiles are nearest-rank (`loadgen.quantile`'s definition), so a point
estimate here equals the figure in the comparison's rows.
"""
from __future__ import annotations

from typing import Callable, Hashable, Mapping, Sequence

import numpy as np

Samples = Mapping[str, Mapping[Hashable, Sequence[float]]]   # policy -> unit -> per-request values
Interval = dict[str, float | None]                             # {"estimate", "low", "high"}
# a statistic over each row of a 2-D array whose missing entries are NaN
RowStatistic = Callable[[np.ndarray], np.ndarray]
LEVEL = 0.95
RESAMPLES = 2000


def row_mean(x: np.ndarray) -> np.ndarray:
    """The mean of each row, NaNs (padding) left out."""
    n = np.sum(~np.isnan(x), axis=1)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(n > 0, np.nansum(x, axis=1) / np.maximum(n, 1), np.nan)


def row_quantile(q: float) -> RowStatistic:
    """The nearest-rank `q` quantile of each row, NaNs left out (a row of NaNs gives NaN)."""
    def stat(x: np.ndarray) -> np.ndarray:
        n = np.sum(~np.isnan(x), axis=1)
        s = np.sort(x, axis=1)                       # NaNs sort last
        rank = np.clip(np.ceil(q * n).astype(int) - 1, 0, max(x.shape[1] - 1, 0))
        if not x.shape[1]:
            return np.full(len(x), np.nan)
        out = np.take_along_axis(s, rank[:, None], axis=1)[:, 0]
        return np.where(n > 0, out, np.nan)
    return stat


STATISTICS: dict[str, RowStatistic] = {"mean": row_mean, "p50": row_quantile(0.5),
                                       "p99": row_quantile(0.99)}


def units_of(samples: Samples, paired: bool = True) -> list[Hashable]:
    """The units, in first-seen order; paired, every policy must have the same ones."""
    units = list(dict.fromkeys(u for by_unit in samples.values() for u in by_unit))
    if paired:
        for policy, by_unit in samples.items():
            missing = [u for u in units if u not in by_unit]
            if missing:
                raise ValueError(f"policy {policy!r} has no data for unit {missing[0]!r}: a paired "
                                 "bootstrap needs every policy run on every unit")
    return units


def _padded(by_unit: Mapping[Hashable, Sequence[float]],
            units: list[Hashable]) -> tuple[np.ndarray, np.ndarray]:
    """Each unit's values as a row, NaN-padded to the longest; and each row's length."""
    rows = [np.asarray(by_unit.get(u, ()), dtype=float) for u in units]
    n = np.array([len(r) for r in rows], dtype=int)
    out = np.full((len(units), max(1, int(n.max(initial=0)))), np.nan)
    for i, r in enumerate(rows):
        out[i, :len(r)] = r
    return out, n


def _resample(values: np.ndarray, n: np.ndarray, picks: np.ndarray,
              rng: np.random.Generator) -> np.ndarray:
    """Replicates × (drawn units × longest unit): each drawn unit's requests resampled with
    replacement, NaN past the unit's own count."""
    width = values.shape[1]
    counts = n[picks]                                              # (B, U)
    idx = np.floor(rng.random((*picks.shape, width)) * np.maximum(counts, 1)[..., None]).astype(int)
    drawn = values[picks[..., None], idx]                          # (B, U, width)
    drawn[np.arange(width) >= counts[..., None]] = np.nan
    return drawn.reshape(picks.shape[0], -1)


def replicates(samples: Samples, statistic: RowStatistic, *, resamples: int = RESAMPLES,
               seed: int = 0, paired: bool = True) -> dict[str, np.ndarray]:
    """Each policy's statistic over `resamples` two-stage replicates (module docstring)."""
    units = units_of(samples, paired)
    rng = np.random.default_rng(seed)
    shared = rng.integers(0, len(units), size=(resamples, len(units)))
    out = {}
    for policy, by_unit in samples.items():
        values, n = _padded(by_unit, units)
        picks = shared if paired else rng.integers(0, len(units), size=shared.shape)
        out[policy] = statistic(_resample(values, n, picks, rng))
    return out


def interval(estimate: float | None, reps: np.ndarray, level: float = LEVEL) -> Interval:
    """The point estimate and the percentile interval of `reps` (NaN replicates left out)."""
    ok = reps[~np.isnan(reps)]
    if estimate is None or not ok.size or np.isnan(estimate):
        return {"estimate": None, "low": None, "high": None}
    tail = 100 * (1 - level) / 2
    low, high = np.percentile(ok, [tail, 100 - tail])
    return {"estimate": float(estimate), "low": float(low), "high": float(high)}


def point(by_unit: Mapping[Hashable, Sequence[float]], statistic: RowStatistic) -> float | None:
    """The statistic over every request of every unit, pooled."""
    xs = np.array([x for values in by_unit.values() for x in values], dtype=float)
    if not xs.size:
        return None
    v = float(statistic(xs[None, :])[0])
    return None if np.isnan(v) else v


def intervals(samples: Samples, statistic: RowStatistic = row_mean,
              bases: Sequence[str] = ("fcfs", "sjf"), *, resamples: int = RESAMPLES,
              seed: int = 0, paired: bool = True, level: float = LEVEL) -> dict:
    """For each policy its statistic's interval, and for each policy against each base present
    the ratio's (policy ÷ base, on the same replicates: < 1 means the policy's figure is lower):
    `{"policies": {p: Interval}, "ratios": {"p/base": Interval}}`."""
    reps = replicates(samples, statistic, resamples=resamples, seed=seed, paired=paired)
    points = {p: point(by_unit, statistic) for p, by_unit in samples.items()}
    out: dict = {"policies": {p: interval(points[p], reps[p], level) for p in samples},
                 "ratios": {}}
    for base in (b for b in bases if b in samples):
        for p in samples:
            if p == base:
                continue
            est = (points[p] / points[base] if points[p] is not None and points[base]
                   else None)
            with np.errstate(invalid="ignore", divide="ignore"):
                ratio = np.where(reps[base] > 0, reps[p] / reps[base], np.nan)
            out["ratios"][f"{p}/{base}"] = interval(est, ratio, level)
    return out
