"""The online length model LAPS-SD ranks perceptible requests by (policies/length_model.py)."""
import doctest
import math
import random

import pytest

from scheduler.policies import length_model
from scheduler.policies.length_model import LengthModel, mean_beyond


def test_doctests():
    assert doctest.testmod(length_model).failed == 0


def test_learns_the_shrinkage_a_noisy_predictor_calls_for():
    # ln L ~ N(5, 0.9²) and the predictor errs by as much again: the best guess from a
    # prediction lies halfway between it and the typical length, with σ = 0.9 / √2
    rng, m = random.Random(1), LengthModel(horizon=10**9)
    for _ in range(20_000):
        y = rng.gauss(5.0, 0.9)
        m.observe("t", round(math.exp(y + rng.gauss(0, 0.9))), round(math.exp(y)))
    mu, sigma = m.belief("t", round(math.exp(7.0)))
    assert mu == pytest.approx(6.0, abs=0.05) and sigma == pytest.approx(0.9 / 2 ** 0.5, abs=0.03)
    mu, sigma = m.belief("t", None)                           # no prediction: the tenant's own
    assert mu == pytest.approx(5.0, abs=0.03) and sigma == pytest.approx(0.9, abs=0.03)
    assert m.belief("other", None) is None and m.belief("other", 100) == (math.log(100), 0.9)
    # no prediction and no record: the client's max_tokens stands in for the prediction
    assert m.belief("other", None, 64) == (math.log(64), 0.9)
    assert m.belief("t", None, 64) == m.belief("t", None)     # a record outranks the bound


def test_without_a_prediction_or_record_the_smaller_bound_and_the_nearer_end_come_first():
    m = LengthModel()
    assert m.expected_remaining("new", None, 0, 32) < m.expected_remaining("new", None, 0, 512)
    assert m.expected_remaining("new", None, 60, 96) < m.expected_remaining("new", None, 10, 96)


def test_expected_remaining_grows_as_a_request_outlives_its_belief():
    m = LengthModel()
    rem = [m.expected_remaining("t", 100, c, 10_000) for c in (0, 50, 100, 200, 400, 1600)]
    assert rem[0] > rem[1]                                    # early on it gets shorter ...
    assert rem[3] < rem[4] < rem[5]                           # ... then overruns push it up
    assert 1.0 < m.expected_remaining("t", 100, 1600, 1700) < 100  # never past max_tokens
    assert m.expected_remaining("t", 100, 9999, 10_000) == 1.0


def test_mean_beyond_with_a_cap_matches_sampling_and_falls_to_zero_at_the_cap():
    rng = random.Random(5)
    xs = [math.exp(rng.gauss(4.0, 1.0)) for _ in range(200_000)]
    for c, cap in [(0, 80), (30, 120), (100, 140), (10, 5000)]:
        tail = [min(x, cap) - c for x in xs if x > c]
        assert mean_beyond(4.0, 1.0, c, cap=cap) == pytest.approx(sum(tail) / len(tail), rel=0.02)
    near = [mean_beyond(4.0, 1.0, c, cap=256) for c in (150, 200, 240, 255, 256)]
    assert near == sorted(near, reverse=True) and near[-1] == 0.0
    # uncapped, the same belief says a request at 200 tokens has more to go than at 150: the
    # cap is what lets a request near its max_tokens rank as nearly done
    assert mean_beyond(4.0, 1.0, 200) > mean_beyond(4.0, 1.0, 150)


def test_mean_beyond_matches_sampling():
    rng = random.Random(2)
    xs = [math.exp(rng.gauss(4.0, 0.7)) for _ in range(200_000)]
    for c in (0.0, 30.0, 100.0):
        tail = [x - c for x in xs if x > c]
        assert mean_beyond(4.0, 0.7, c) == pytest.approx(sum(tail) / len(tail), rel=0.02)
    assert mean_beyond(0.0, 0.5, 1e6) > 0                     # far tail: no division by zero
