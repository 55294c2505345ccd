"""The length predictor over the target's hidden states (scheduler/length_predictor.py): it fits
what it is shown, ranks held-out requests, round-trips as plain data, and says when it knows
nothing yet."""
from __future__ import annotations

import doctest
import math

import numpy as np
import pytest

import scheduler.length_predictor as lp
from scheduler.length_predictor import LengthPredictor, PredictorWeights


def spearman(a, b) -> float:
    ra, rb = np.argsort(np.argsort(a)), np.argsort(np.argsort(b))
    return float(np.corrcoef(ra, rb)[0, 1])


def test_doctests():
    assert doctest.testmod(lp).failed == 0


def test_it_ranks_held_out_requests_and_its_sigma_is_the_noise():
    rng = np.random.default_rng(1)
    true_w = rng.normal(size=16) * 0.3
    p = LengthPredictor(dim=16)

    def sample():
        f = rng.normal(size=16)
        return f, math.exp(4.0 + f @ true_w + rng.normal(0, 0.5))

    for _ in range(2000):
        f, length = sample()
        p.observe(f, 0, max(1, round(length)))
    w = p.fit()
    held = [sample() for _ in range(300)]
    assert spearman([w.predict(f, 0) for f, _ in held], [L for _, L in held]) > 0.7
    assert w.sigma == pytest.approx(0.5, abs=0.05)
    assert w.samples == 2000 and w.dim == 16


def test_remaining_length_shrinks_as_the_request_commits():
    """Samples at several points of each request: what is left falls as committed grows."""
    rng = np.random.default_rng(2)
    p = LengthPredictor(dim=4, min_samples=5)
    for _ in range(500):
        f = rng.normal(size=4)
        total = int(math.exp(5 + 0.5 * f[0]))
        for c in (0, total // 4, total // 2, 3 * total // 4):
            p.observe(f, c, total - c)
    w = p.fit()
    f = np.zeros(4)
    left = [w.predict(f, c) for c in (0, 40, 80, 120)]
    assert left == sorted(left, reverse=True)


def test_cold_start_and_bad_input():
    p = LengthPredictor(dim=3, min_samples=4)
    for _ in range(3):
        p.observe([0.1, 0.2, 0.3], 0, 10)
    assert p.fit() is None                       # below min_samples: callers fall back
    p.observe([0.0, 0.0, 0.0], 0, 20)
    assert p.fit() is not None
    with pytest.raises(ValueError):
        p.observe([1.0], 0, 10)                  # wrong width
    with pytest.raises(ValueError):
        p.observe([1.0, 2.0, 3.0], 0, 0)         # nothing remaining


def test_weights_round_trip_as_plain_data_and_versions_increase():
    p = LengthPredictor(dim=2, min_samples=1)
    p.observe([1.0, 2.0], 3, 50)
    p.observe([0.5, -1.0], 0, 8)
    a, b = p.fit(), p.fit()
    assert b.version == a.version + 1
    back = PredictorWeights.from_dict(a.to_dict())
    assert back == a and back.predict([1.0, 2.0], 3) == a.predict([1.0, 2.0], 3)
    with pytest.raises(ValueError, match="format"):
        PredictorWeights.from_dict({**a.to_dict(), "format": 99})


def test_it_learns_lengths_from_a_real_models_hidden_states(tiny_model):
    """Features from a (tiny, random) target's own hidden states, through the verifier: prompts of
    two kinds whose answers differ in length are told apart on held-out prompts."""
    from workers.contract import SamplingParams
    from workers.model.llama_forward import LlamaForward
    from workers.speculation.tree import TokenTree
    from workers.speculation.verifier import Verifier, VerifyItem

    rng = np.random.default_rng(3)
    v = Verifier(LlamaForward(tiny_model), max_tree_tokens=4, features=True)

    def features(prompt: list[int]) -> tuple[float, ...]:
        v.prefill("p", prompt, SamplingParams(), 2)
        (res,) = v.verify([VerifyItem("p", TokenTree.empty())])
        v.release("p")
        return res.features

    def request(kind: int):                       # kind 0 opens with 5 5 5, kind 1 with 9 9 9
        opening = [5, 5, 5] if kind == 0 else [9, 9, 9]
        prompt = opening + [int(t) for t in rng.integers(10, 120, size=int(rng.integers(3, 8)))]
        return features(prompt), (200 if kind == 0 else 12) * float(np.exp(rng.normal(0, 0.3)))

    dim = tiny_model.config.hidden_size
    p = LengthPredictor(dim=dim, ridge=1.0, min_samples=10)
    for i in range(80):
        f, length = request(i % 2)
        p.observe(f, 0, round(length))
    w = p.fit()
    held = [request(i % 2) for i in range(20)]
    predicted = [w.predict(f, 0) for f, _ in held]
    assert spearman(predicted, [L for _, L in held]) > 0.6
    long_ = np.median([x for x, (_, L) in zip(predicted, held) if L > 60])
    short = np.median([x for x, (_, L) in zip(predicted, held) if L <= 60])
    assert long_ > 4 * short
