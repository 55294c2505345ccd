"""SPIRe's training loss: a mix of distillation and expected acceptance.

    MixedLoss(ω) = ω · CE(p, q) + (1 − ω) · (−Σ_x min(p(x), q(x)))

p is the target's next-token distribution (its top-k, renormalised: what `specgate distill`
keeps per position), q the draft's softmax read at those tokens. Σ min(p, q) is the probability
that speculative sampling accepts a token drawn from q (Leviathan et al.): the quantity drafting
is paid by; the cross-entropy term keeps the gradient informative where q and p barely overlap
(the acceptance term's gradient vanishes there). ω = 1 is pure distillation, ω = 0 pure
acceptance.
"""
from __future__ import annotations

import torch

__all__ = ["mixed_loss"]


def mixed_loss(logits: torch.Tensor, top_lp: torch.Tensor, top_ix: torch.Tensor, mask: torch.Tensor,
               weight: float) -> tuple[torch.Tensor, dict[str, float]]:
    """Mean over positions where `mask` of MixedLoss(weight), and its parts' means (ce, accept).

    logits: [N, V] the draft's; top_lp/top_ix: [N, K] the target's top-k log-probs and ids;
    mask: [N] bool.

    Worked example: p = (0.5, 0.5) on tokens 1 and 3; the draft's logits (0, ln 2, 0, 0) give
    q = (0.2, 0.4, 0.2, 0.2), so CE = −(0.5 ln 0.4 + 0.5 ln 0.2) = 1.26286, Σ min(p, q) = 0.4 +
    0.2 = 0.6, and with ω = 0.3 the loss is 0.3 · 1.26286 − 0.7 · 0.6 = −0.04114.

    >>> lg = torch.log(torch.tensor([[1.0, 2.0, 1.0, 1.0]]))
    >>> loss, parts = mixed_loss(lg, torch.log(torch.tensor([[0.5, 0.5]])), torch.tensor([[1, 3]]),
    ...                          torch.tensor([True]), 0.3)
    >>> round(float(loss), 5), round(parts["ce"], 5), round(parts["accept"], 5)
    (-0.04114, 1.26286, 0.6)
    """
    if not 0.0 <= weight <= 1.0:
        raise ValueError(f"the mix weight must be in [0, 1], got {weight}")
    logq = torch.log_softmax(logits.float(), dim=-1).gather(-1, top_ix.long())   # [N, K]
    p = torch.softmax(top_lp.float(), dim=-1)                                     # [N, K]
    ce = -(p * logq).sum(-1)                                                      # [N]
    accept = torch.minimum(p, logq.exp()).sum(-1)                                 # [N]
    m = mask.float()
    n = m.sum().clamp(min=1.0)
    mean = lambda v: (v * m).sum() / n                                            # noqa: E731
    loss = weight * mean(ce) - (1.0 - weight) * mean(accept)
    return loss, {"ce": float(mean(ce).detach()), "accept": float(mean(accept).detach())}
