"""The paired two-stage bootstrap (loadtest/bootstrap.py) on synthetic data whose truth is known."""
from __future__ import annotations

import numpy as np
import pytest

from loadtest.bootstrap import intervals, point, row_mean, row_quantile, units_of
from loadtest.loadgen import stats

UNITS = [(seed, rnd) for seed in (1, 2, 3) for rnd in (0, 1)]     # 3 seeds x 2 rounds


def synthetic(rng: np.random.Generator, ratio: float, *, unit_sigma: float = 0.5,
              n: int = 40) -> dict:
    """fcfs and laps on the same units: each unit scales both policies' latencies by a shared
    factor (its arrivals, the machine's state), and laps' requests are `ratio` x fcfs's in
    distribution, so the true ratio of their means is `ratio` whatever the units drew."""
    out: dict = {"fcfs": {}, "laps": {}}
    for u in UNITS:
        shared = rng.lognormal(0.0, unit_sigma)
        out["fcfs"][u] = list(shared * rng.lognormal(0.0, 0.8, size=n))
        out["laps"][u] = list(shared * ratio * rng.lognormal(0.0, 0.8, size=n - int(rng.integers(0, 5))))
    return out


def test_the_ratio_interval_covers_the_true_ratio_in_at_least_90_percent_of_trials():
    rng = np.random.default_rng(11)
    covered = 0
    for trial in range(200):
        r = intervals(synthetic(rng, 0.7), bases=("fcfs",), resamples=400, seed=trial)
        ci = r["ratios"]["laps/fcfs"]
        covered += ci["low"] <= 0.7 <= ci["high"]
    assert covered >= 180, covered


def test_the_interval_is_not_wide_enough_to_cover_everything():
    """No difference at all (a ratio of 1) is outside most intervals when laps is 30% faster: a
    test that the interval says something, not only that it is wide. (The two-stage interval is
    conservative: the second stage resamples the requests the first stage's spread already
    holds, so it covers a little more often than 95%.)"""
    rng = np.random.default_rng(5)
    hits = sum(intervals(synthetic(rng, 0.7), bases=("fcfs",), resamples=400, seed=t)
               ["ratios"]["laps/fcfs"]["high"] >= 1.0 for t in range(50))
    assert hits <= 10, hits


def test_pairing_by_unit_narrows_the_ratio_interval_when_units_share_a_component():
    data = synthetic(np.random.default_rng(3), 0.7, unit_sigma=0.8, n=60)
    paired = intervals(data, bases=("fcfs",), resamples=1000)["ratios"]["laps/fcfs"]
    unpaired = intervals(data, bases=("fcfs",), resamples=1000, paired=False)["ratios"]["laps/fcfs"]
    width = lambda ci: ci["high"] - ci["low"]                        # noqa: E731
    assert paired["estimate"] == unpaired["estimate"]
    assert width(paired) < 0.6 * width(unpaired), (paired, unpaired)


def test_point_estimates_are_the_comparisons_own_figures():
    """The estimate is the statistic over every pooled request, with loadgen's nearest-rank
    quantile, so an interval sits around the figure the comparison's row shows."""
    data = synthetic(np.random.default_rng(8), 0.5)
    pooled = [x for xs in data["laps"].values() for x in xs]
    want = stats(pooled)
    assert point(data["laps"], row_mean) == pytest.approx(want["mean"])
    assert point(data["laps"], row_quantile(0.99)) == want["p99"]
    assert point(data["laps"], row_quantile(0.5)) == want["p50"]
    r = intervals(data, row_quantile(0.99), bases=("fcfs",), resamples=300)
    ci = r["policies"]["laps"]
    assert ci["estimate"] == want["p99"] and ci["low"] <= ci["high"]
    fcfs = point(data["fcfs"], row_quantile(0.99))
    assert r["ratios"]["laps/fcfs"]["estimate"] == pytest.approx(want["p99"] / fcfs)


def test_one_unit_still_has_spread_from_its_requests():
    """The second stage: with one unit the first stage always draws it, and the spread comes
    from resampling its requests."""
    rng = np.random.default_rng(1)
    data = {"fcfs": {0: list(rng.exponential(1.0, 200))}, "laps": {0: list(rng.exponential(0.5, 200))}}
    ci = intervals(data, resamples=500)["policies"]["fcfs"]
    assert ci["low"] < ci["estimate"] < ci["high"]
    assert 0.1 < ci["high"] - ci["low"] < 0.6         # about 4 standard errors of 1/sqrt(200)


def test_every_policy_against_every_base_present():
    rng = np.random.default_rng(2)
    data = {p: {u: list(rng.exponential(1.0, 20)) for u in UNITS} for p in ("fcfs", "sjf", "laps")}
    r = intervals(data, resamples=100)
    assert set(r["ratios"]) == {"sjf/fcfs", "laps/fcfs", "fcfs/sjf", "laps/sjf"}
    assert set(r["policies"]) == {"fcfs", "sjf", "laps"}


def test_a_policy_without_requests_has_no_interval_and_missing_units_are_refused():
    data = {"fcfs": {0: [1.0, 2.0]}, "laps": {0: []}}
    r = intervals(data, resamples=50)
    assert r["policies"]["laps"] == {"estimate": None, "low": None, "high": None}
    assert r["ratios"]["laps/fcfs"]["estimate"] is None
    with pytest.raises(ValueError, match="unit 1"):
        units_of({"fcfs": {0: [1.0], 1: [2.0]}, "laps": {0: [1.0]}})
