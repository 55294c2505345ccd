"""How many output tokens a request still has to produce: its length prediction, calibrated online
on the requests that finished, and conditioned on what it has already committed.

A length predictor is noisy (learned predictors rank ShareGPT / LMSYS-Chat answers with a Kendall
τ of only 0.5–0.6), and how noisy, and how biased, differs by tenant. So per tenant we regress the
log of the true length on the log of the prediction over finished requests,

    ln L = a + b · ln p + ε,    ε ~ N(0, r²)

(exponentially weighted, forgetting over ~`horizon` finished requests), which gives each live
request a log-normal belief about its length; b < 1 is the shrinkage towards the tenant's typical
length that a noisy predictor calls for. A request that has committed c tokens is known to be
longer than c, so its expected remaining length is the log-normal's mean beyond c:

    E[L − c | L > c] = e^(μ + r²/2) · Φ((μ + r² − ln c) ÷ r) ÷ Φ((μ − ln c) ÷ r) − c

This replaces a fixed rule for a request that outruns its prediction: the longer it has run past
it, the more the belief moves up, by exactly as much as the tenant's record says it should.
Requests without a prediction get the tenant's length distribution (mean and spread of ln L).
Until a tenant has `min_samples` finished requests the prediction is taken at face value with
spread `prior_sigma`; a request with no prediction then has only its max_tokens to go on, and
that bound is taken as the prediction. Why not "nothing known": the gateway has no length
predictor, so for its first `min_samples` requests per tenant LAPS-SD would be plain least
attained service, which is round robin on traffic of similar lengths, the worst order there is
for mean latency (`specgate loadtest compare` measured it well behind FCFS: README.md,
"Scheduling policies on the real gateway"). max_tokens is what the client itself said about the
length: requests asking for few tokens are short, and among requests asking for the same bound
the one nearest to it is nearest to done. A request that hit its max_tokens counts with L =
max_tokens (censored, a slight underestimate). The model is soft state: after a restart it is
relearned from scratch.

>>> m = LengthModel(min_samples=2)
>>> round(m.expected_remaining("t", 100, 0, 4096))          # the prior: face value, σ 0.9
150
>>> for p, l in [(100, 200), (200, 400), (400, 800)] * 10:   # this predictor is 2x too low
...     m.observe("t", p, l)
>>> round(m.expected_remaining("t", 100, 0, 4096)), round(m.expected_remaining("t", 100, 150, 4096))
(201, 51)
"""
from __future__ import annotations

import math
from dataclasses import dataclass

_SQRT2 = math.sqrt(2.0)


def _PHI(x: float) -> float:
    """The standard normal CDF: `statistics.NormalDist().cdf`'s formula, to the bit, without its
    method call (the scheduler evaluates it for every served request every step)."""
    return 0.5 * (1.0 + math.erf(x / _SQRT2))


@dataclass(slots=True)
class _Fit:
    """Exponentially weighted sums for one tenant (x = ln prediction, y = ln length)."""
    n: float = 0.0            # weight of requests with a prediction
    x: float = 0.0
    y: float = 0.0
    xx: float = 0.0
    xy: float = 0.0
    yy: float = 0.0
    m: float = 0.0            # every request, prediction or not: weight, Σy, Σy²
    my: float = 0.0
    myy: float = 0.0
    samples: int = 0
    coef: tuple[float, float, float] | None = None   # (a, b, r), cached
    marginal: tuple[float, float] | None = None      # (mean, sd) of ln L, cached


class LengthModel:
    def __init__(self, *, prior_sigma: float = 0.9, min_samples: int = 30,
                 horizon: float = 2000.0, min_sigma: float = 0.1) -> None:
        self.prior_sigma = prior_sigma
        self.min_samples = min_samples
        self.decay = 1.0 - 1.0 / horizon
        self.min_sigma = min_sigma
        self._fits: dict[str, _Fit] = {}

    def observe(self, tenant: str, predicted: int | None, length: int) -> None:
        """A request of `tenant` finished with `length` output tokens (`predicted` at arrival)."""
        f = self._fits.get(tenant)
        if f is None:
            f = self._fits[tenant] = _Fit()
        d, y = self.decay, math.log(max(1, length))
        f.m, f.my, f.myy = d * f.m + 1, d * f.my + y, d * f.myy + y * y
        if predicted is not None:
            x = math.log(max(1, predicted))
            f.n, f.x, f.y = d * f.n + 1, d * f.x + x, d * f.y + y
            f.xx, f.xy, f.yy = d * f.xx + x * x, d * f.xy + x * y, d * f.yy + y * y
        f.samples += 1
        f.coef = f.marginal = None

    def belief(self, tenant: str, predicted: int | None,
               max_tokens: int | None = None) -> tuple[float, float] | None:
        """(μ, σ) of ln L for a new request, or None when nothing is known yet (no prediction,
        no max_tokens, no record)."""
        f = self._fits.get(tenant)
        ready = f is not None and f.samples >= self.min_samples
        if predicted is None:
            if ready:
                return self._marginal(f)
            return None if max_tokens is None else (math.log(max(1, max_tokens)), self.prior_sigma)
        if not ready or f.n < self.min_samples / 2:
            return math.log(max(1, predicted)), self.prior_sigma
        a, b, r = self._coef(f)
        return a + b * math.log(max(1, predicted)), r

    def expected_remaining(self, tenant: str, predicted: int | None, committed: int,
                           max_tokens: int) -> float:
        """E[min(L, max_tokens) − committed | L > committed], at least 1 (max_tokens stands in for
        a missing prediction while the tenant has no record, so there is always a belief)."""
        bel = self.belief(tenant, predicted, max_tokens)
        # the cap keeps it within max_tokens − committed; 1: a live request has a token to go
        return float(max(1.0, mean_beyond(*bel, committed, cap=max_tokens)))

    def _coef(self, f: _Fit) -> tuple[float, float, float]:
        if f.coef is None:
            mx, my = f.x / f.n, f.y / f.n
            vx = f.xx / f.n - mx * mx
            cxy = f.xy / f.n - mx * my
            b = min(1.5, max(0.0, cxy / vx)) if vx > 1e-9 else 1.0
            a = my - b * mx
            res = f.yy / f.n - my * my - 2 * b * cxy + b * b * vx
            f.coef = (a, b, max(self.min_sigma, math.sqrt(max(0.0, res))))
        return f.coef

    def _marginal(self, f: _Fit) -> tuple[float, float]:
        if f.marginal is None:
            mean = f.my / f.m
            f.marginal = (mean, max(self.min_sigma, math.sqrt(max(0.0, f.myy / f.m - mean ** 2))))
        return f.marginal


def mean_beyond(mu: float, sigma: float, c: float, cap: float | None = None) -> float:
    """E[min(L, cap) − c | L > c] for ln L ~ N(μ, σ²): the output still to come of a request that
    has committed c tokens and will be cut at `cap` (its max_tokens; None: never).

    Why the cap matters: without it a log-normal's expected remaining length grows with c, so a
    request well into its run always looks longer than a newcomer and keeps being put off, right
    up to the bound where it was certain to end (least attained service on bounded lengths: the
    round robin that makes mean latency worse than FCFS). With it, the expectation falls to 0 as
    c nears the bound.

    >>> round(mean_beyond(math.log(100), 0.5, 0), 1), round(mean_beyond(math.log(100), 0.5, 300), 1)
    (113.3, 62.8)
    >>> round(mean_beyond(math.log(100), 0.5, 300, cap=320), 1)
    17.0
    """
    mean = math.exp(mu + sigma * sigma / 2)
    if cap is not None:
        if c >= cap:
            return 0.0
        a, b = (math.log(max(c, 1e-9)) - mu) / sigma, (math.log(cap) - mu) / sigma
        tail = 1.0 - _PHI(a)
        if tail > 1e-12:
            inside = mean * (_PHI(b - sigma) - _PHI(a - sigma)) - c * (_PHI(b) - _PHI(a))
            return max(0.0, (inside + (cap - c) * (1.0 - _PHI(b))) / tail)
        return min(cap - c, mean_beyond(mu, sigma, c))
    if c <= 0:
        return mean
    z = (math.log(c) - mu) / sigma
    if z > 8.0:                       # far into the tail: the log-normal's tail ~ c·σ²/(ln c − μ)
        return c * sigma * sigma / (math.log(c) - mu)
    return mean * _PHI(sigma - z) / _PHI(-z) - c

