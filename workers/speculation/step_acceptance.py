"""One request's acceptance from a verification step's logits rows: its logit rules applied to
every tree row, then the greedy, seeded (coupled) or unseeded (SpecInfer) rule of
workers/speculation/acceptance.py; and the committed tokens' log-probabilities."""
from __future__ import annotations

from typing import Callable

import numpy as np
import torch

from workers.contract import TokenLogprob
from workers.speculation.acceptance import Acceptance, accept_coupled, accept_greedy, accept_sampling, warp
from workers.speculation.kv_book import Slot
from workers.speculation.tree import TokenTree


def accept(slot: Slot, tree: TokenTree, lo: int, logits: torch.Tensor, greedy_rows: list[int] | None,
           root_pos: int, argmax: Callable[[torch.Tensor], list[int]]) -> Acceptance:
    """Acceptance of the tree whose root's logits are row `lo` of the step's logits rows;
    `greedy_rows`: every row's argmax (computed once a step), `argmax`: the forward's, for rows
    the request's rules changed; `root_pos`: the root's absolute position."""
    n = 1 + len(tree)
    rows = logits[lo: lo + n]                                                   # [n, V]
    if slot.processors:
        # every row judged from its own path (workers/speculation/processors.py), in float32 so a
        # bias or penalty is not rounded away in a bf16 logit
        rows = rows.to(torch.float32, copy=True)
        for rule in slot.processors:
            rule.adjust(rows, tree)
        if slot.sampling.greedy:
            return accept_greedy(tree, argmax(rows))
    if slot.sampling.greedy:
        return accept_greedy(tree, greedy_rows[lo: lo + n])

    def target_probs(row: int) -> np.ndarray:
        return warp(rows[row].double().cpu().numpy(), slot.sampling)   # [V] on the host

    if slot.sampling.seed is not None:
        # A seeded request: one uniform per (seed, absolute position), and the coupled rule,
        # so its text depends on its seed alone: the same with any drafts, tree, batch, after an
        # eviction or a restart (positions never repeat, so the draws stay independent)
        return accept_coupled(tree, target_probs,
                              lambda depth: np.random.default_rng([slot.seed, root_pos + depth]).random())
    # Unseeded: SpecInfer's rule (it accepts drafts sampled from a draft model more often),
    # with one RNG per (seed drawn at admission, position)
    rng = np.random.default_rng([slot.seed, root_pos])
    return accept_sampling(tree, target_probs, rng)


def committed_logprobs(rows: torch.Tensor, acc: Acceptance, k: int) -> tuple[TokenLogprob, ...]:
    """Each committed token's log-probability, and the `k` likeliest tokens at its position, from
    one tree's logits rows [1 + n, V] (row 0 = the root): committed token j was predicted by the
    root's row for j = 0, else by the row of the j-th accepted node, `acc.path[j - 1] + 1`.

    Read from the RAW rows, before penalties, logit_bias or a grammar change them (vLLM's default
    too): what the model itself thinks of the text, so a client can score it. The rows are the
    verification pass's own: nothing runs again.

    Example: tree (a, b) as a chain, both accepted, bonus c -> a from row 0, b from row 1, c from
    row 2.
    """
    picked = rows[[0, *(p + 1 for p in acc.path)]].to(torch.float32)            # [tau, V]
    logp = torch.log_softmax(picked, dim=-1)                                    # [tau, V]
    chosen = logp[torch.arange(len(acc.tokens)), torch.tensor(acc.tokens)].tolist()   # [tau]
    if k:
        top_v, top_i = torch.topk(logp, k, dim=-1)                              # [tau, k]
        tops = [tuple(zip(i, v)) for i, v in zip(top_i.tolist(), top_v.tolist())]
    else:
        tops = [()] * len(chosen)
    return tuple((lp, top) for lp, top in zip(chosen, tops))
