"""bf16 exactness accounting: a divergence is a near-tie only where the two tokens' logits are close."""
from __future__ import annotations

import numpy as np
import torch

from workers.model.llama_forward import LlamaForward
from tools.near_tie import NEAR_TIE_LOGITS, classify, first_divergence, logit_gap


def _logits(model, ids):
    with torch.inference_mode():
        return model(torch.tensor([ids])).logits[0, -1]


def test_logit_gap_is_the_reference_models_gap(tiny_model):
    fwd = LlamaForward(tiny_model)
    ids = [5, 17, 99, 3, 42, 8]
    ref = _logits(tiny_model, ids)
    a, b = int(ref.argmax()), int(ref.argsort()[-2])
    assert abs(logit_gap(fwd, ids, a, b) - float(ref[a] - ref[b])) < 1e-4
    assert logit_gap(fwd, ids, a, a) == 0.0


def test_classify_tells_near_ties_from_real_divergences(tiny_model):
    fwd = LlamaForward(tiny_model)
    rng = np.random.default_rng(0)
    found = {}
    for _ in range(200):
        prompt = rng.integers(3, 128, size=int(rng.integers(2, 12))).tolist()
        ref = _logits(tiny_model, prompt)
        top, second = int(ref.argmax()), int(ref.argsort()[-2])
        gap = float(ref[top] - ref[second])
        kind = "near_tie" if gap < NEAR_TIE_LOGITS else "divergent"
        # plain picked `top`; a speculative output that picked `second` diverges at position 0
        found.setdefault(kind, (prompt, top, second))
        if len(found) == 2:
            break
    assert set(found) == {"near_tie", "divergent"}
    for kind, (prompt, top, second) in found.items():
        assert classify(fwd, prompt, [second, 7], [top, 7]) == kind
    prompt, top, _ = found["divergent"]
    assert classify(fwd, prompt, [top, 9], [top, 9]) == "identical"
    assert classify(fwd, prompt, [top], [top, 9]) == "divergent"       # stopped early
    assert first_divergence([1, 2], [1, 3]) == 1
