"""A length predictor that reads the target's own hidden state (issue 29; the TRAIL idea, arXiv
2410.01035): the remaining output length of a request, from the final-normed hidden state the
verifier computed where it read the request's last committed token (`StepResult.features`; at
the first step, the prompt's last token), and how many tokens it has committed.

Model: ridge regression of ln(remaining tokens) on x = [1, ln(1 + committed), features]:

    ln R = wᵀx + ε,    ε ~ N(0, σ²)

Why linear in log space: output lengths are heavy-tailed, so errors are ratios, and a linear head
over a frozen model's last hidden state is the probe the length-prediction literature starts from;
it trains in closed form from sufficient statistics (Σ x xᵀ, Σ x y, Σ y²), so training online from
finished requests costs O(d²) per sample to record and one O(d³) solve, done in the background
(`fit`), never inside a step. σ (the residual spread, in log space) is the predictor's calibrated
uncertainty: E[R] = e^(wᵀx + σ²/2).

Weights are plain data (`PredictorWeights.to_dict`) with a version, so that a state store can
keep them for every replica and across restarts; until `min_samples` samples have been seen
`fit` returns None and callers fall back (tenant records, then max_tokens). Pure numpy: no torch.

A `prior` (weights trained elsewhere: those shipped for the default model, trained offline by
`specgate bench lengths`) is where the ridge pulls towards instead of zero,

    w = argmin Σ(y − wᵀx)² + λ‖w − w₀‖²,

so predictions start from the shipped weights and move to what this deployment's traffic says
as its samples outweigh λ; σ likewise starts from the prior's (as `PRIOR_SIGMA_SAMPLES` samples).

>>> import numpy as np
>>> rng = np.random.default_rng(0)
>>> p = LengthPredictor(dim=2, min_samples=10)
>>> for _ in range(200):                      # a request's length doubles with features[0]
...     f = rng.normal(size=2)
...     p.observe(f, committed=0, remaining=int(np.exp(4 + np.log(2) * f[0])))
>>> w = p.fit()
>>> round(w.predict([1.0, 0.0], 0) / w.predict([0.0, 0.0], 0), 1)
2.0
"""
from __future__ import annotations

import math
import threading
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

FORMAT = 1        # the dict layout of PredictorWeights
PRIOR_SIGMA_SAMPLES = 10


def _row(features: Sequence[float], committed: int, dim: int) -> np.ndarray:
    """x = [1, ln(1 + committed), features]: what the regression reads."""
    if len(features) != dim:
        raise ValueError(f"{len(features)} features; this predictor reads {dim}")
    return np.concatenate(([1.0, math.log1p(committed)], np.asarray(features, dtype=np.float64)))


@dataclass(frozen=True)
class PredictorWeights:
    """A fitted predictor: w over [1, ln(1 + committed), features], σ, and what it was fitted on."""
    version: int                  # increases with every fit (replicas keep the newest)
    w: tuple[float, ...]
    sigma: float
    samples: int

    @property
    def dim(self) -> int:
        return len(self.w) - 2

    def log_mean(self, features: Sequence[float], committed: int) -> float:
        """E[ln R]: the median remaining length's log."""
        return float(np.dot(self.w, _row(features, committed, self.dim)))

    def predict(self, features: Sequence[float], committed: int) -> float:
        """E[R], remaining output tokens (the log-normal's mean)."""
        return math.exp(self.log_mean(features, committed) + self.sigma ** 2 / 2)

    def to_dict(self) -> dict[str, Any]:
        return {"format": FORMAT, "version": self.version, "w": list(self.w),
                "sigma": self.sigma, "samples": self.samples}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "PredictorWeights":
        if d.get("format") != FORMAT:
            raise ValueError(f"length predictor weights of format {d.get('format')!r}; "
                             f"this build reads {FORMAT}")
        return cls(int(d["version"]), tuple(float(v) for v in d["w"]), float(d["sigma"]),
                   int(d["samples"]))


class LengthPredictor:
    """Sufficient statistics of finished requests' samples, and the fit over them. Thread-safe:
    the step loop's thread records samples, a background thread fits."""

    def __init__(self, dim: int, *, ridge: float = 1.0, min_samples: int = 32,
                 prior: PredictorWeights | None = None) -> None:
        if dim < 1 or ridge < 0 or min_samples < 1:
            raise ValueError("need dim >= 1, ridge >= 0, min_samples >= 1")
        if prior is not None and prior.dim != dim:
            raise ValueError(f"prior weights read {prior.dim} features; this predictor {dim}")
        self.dim, self.ridge, self.min_samples = dim, ridge, min_samples
        self.prior = prior
        k = dim + 2
        self._xx = np.zeros((k, k))          # Σ x xᵀ
        self._xy = np.zeros(k)               # Σ x y
        self._yy = 0.0                       # Σ y²
        self._n = 0
        self._version = 0
        self._lock = threading.Lock()

    @property
    def samples(self) -> int:
        return self._n

    def version_from(self, version: int) -> None:
        """Number the next fit after `version` (weights loaded from a store: a restart, or another
        replica's), so that newest-wins keeps the fits made here."""
        with self._lock:
            self._version = max(self._version, version)

    def observe(self, features: Sequence[float], committed: int, remaining: int) -> None:
        """One sample: at a point where the request had committed `committed` tokens, it still
        had `remaining` to produce (known once it finished)."""
        if remaining < 1 or committed < 0:
            raise ValueError("need remaining >= 1 and committed >= 0")
        x = _row(features, committed, self.dim)
        y = math.log(remaining)
        with self._lock:
            self._xx += np.outer(x, x)
            self._xy += x * y
            self._yy += y * y
            self._n += 1

    def fit(self) -> PredictorWeights | None:
        """The ridge solution over every sample so far; None below `min_samples`. Without a prior
        the intercept is not shrunk."""
        with self._lock:
            if self._n < self.min_samples:
                return None
            xx, xy, yy, n = self._xx.copy(), self._xy.copy(), self._yy, self._n
            self._version += 1
            version = self._version
        # each weight's penalty scaled by its feature's variance: ridge on standardised features,
        # weights kept in raw units (hidden-state coordinates differ in scale by orders of
        # magnitude; `bench lengths` ranked better with it)
        mean = xx[0] / n
        var = np.maximum(np.diag(xx) / n - mean * mean, 1e-12)
        w0 = np.zeros(len(xy))
        if self.prior is None:
            var[0] = 0.0                        # the intercept is not shrunk
        else:
            var[0] = 1.0                        # pulled to the prior's like the rest: `ridge`
            w0 = np.asarray(self.prior.w)       # samples move a weight halfway from the prior
        penalty = self.ridge * np.diag(var)
        w = np.linalg.solve(xx + penalty, xy + penalty @ w0)
        # residual sum of squares from the statistics: Σ(y − wᵀx)² = Σy² − 2wᵀΣxy + wᵀΣxxᵀw
        rss = max(yy - 2 * w @ xy + w @ xx @ w, 0.0)
        if self.prior is None:
            sigma = math.sqrt(rss / max(n - 1, 1))
        else:
            k = PRIOR_SIGMA_SAMPLES
            sigma = math.sqrt((rss + k * self.prior.sigma ** 2) / (n + k))
        return PredictorWeights(version, tuple(float(v) for v in w), sigma, n)
