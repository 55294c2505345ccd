"""What "lossless" means in bfloat16: identical to the same engine's plain decoding, except at
near-ties.

In float32 a tree pass and a one-token pass give the same logits to ~1e-5, so speculative greedy
output is token-identical to plain greedy. In bfloat16 the two passes round differently (by less
than `NEAR_TIE_LOGITS` on SmolLM2's logits, as measured when the bfloat16 path was written), so
where the target's top two tokens are that close, either may win. A divergence is a
**near-tie** when, at the first position where the two outputs differ, the plain pass's logits of
the two tokens differ by less than `NEAR_TIE_LOGITS`; any other divergence would be a bug.
"""
from __future__ import annotations

from typing import Sequence

import torch

from workers.model.llama_forward import LlamaForward, Segment

NEAR_TIE_LOGITS = 0.5


def first_divergence(a: Sequence[int], b: Sequence[int]) -> int | None:
    """The first index where `a` and `b` differ (a prefix differs at its end); None if equal.

    >>> first_divergence([1, 2, 3], [1, 2, 4]), first_divergence([1, 2], [1, 2, 3]), first_divergence([5], [5])
    (2, 2, None)
    """
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def logit_gap(forward: LlamaForward, context: Sequence[int], token_a: int, token_b: int) -> float:
    """|logit(token_a) − logit(token_b)| for the token after `context`, from one plain causal pass."""
    n = len(context)
    cache = forward.new_cache(n)
    causal = torch.full((n, n), float("-inf")).triu(1)
    logits = forward.forward(torch.tensor(list(context)), torch.arange(n), [Segment(cache, 0, n, causal)],
                             torch.tensor([n - 1]))                       # [1, V]
    row = logits[0].float()
    return abs(float(row[token_a] - row[token_b]))


def classify(forward: LlamaForward, prompt: Sequence[int], speculative: Sequence[int],
             plain: Sequence[int]) -> str:
    """"identical", "near_tie" or "divergent" for one prompt's two outputs (generated ids only)."""
    i = first_divergence(speculative, plain)
    if i is None:
        return "identical"
    if i >= min(len(speculative), len(plain)):
        return "divergent"                      # one stopped early: not a tie between two tokens
    gap = logit_gap(forward, [*prompt, *plain[:i]], speculative[i], plain[i])
    return "near_tie" if gap < NEAR_TIE_LOGITS else "divergent"
