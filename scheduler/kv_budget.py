"""How many KV slots a request holds or will hold: the one model the planner admits, defers and
preempts by (scheduler/policies/base.py `_fit_kv`), matching how the verifier allocates
(workers/verifier.py): a request starts with room for its context, one block of output (less if
fewer tokens are wanted) and one tree; when a step's tree would not fit, its KV grows by a block
or by half of what it holds, whichever is more.

Pure functions of a request's stats. Slots, not bytes: the builder turns the byte budget
(`--kv-cache-mb`) into slots once, at the model's bytes per slot (every layer's K and V).

>>> from scheduler.request import RequestStats
>>> s = RequestStats("r", "t", 0.0, prompt_len=1000, max_tokens=8192)
>>> s.kv_tokens = start_slots(s, block=256, tree=65)
>>> s.kv_tokens, growth_slots(s, block=256, tree=65)
(1321, 0)
>>> s.committed = 260                  # 1,260 tokens of context and a tree no longer fit
>>> growth_slots(s, block=256, tree=65)
660
"""
from __future__ import annotations

from scheduler.request import RequestStats


def start_slots(s: RequestStats, *, block: int, tree: int) -> int:
    """Slots a request not holding KV takes when it starts: its context (prompt + committed),
    one block of output or what it still wants if less, and one tree (root included)."""
    wanted = max(s.max_tokens - s.committed, 1)
    return s.prompt_len + s.committed + min(wanted, block) + tree


def growth_slots(s: RequestStats, *, block: int, tree: int) -> int:
    """Slots a resident request may add in its next step: none while its context and a tree
    fit what it holds, else a block or half of what it holds, whichever is more."""
    if s.prompt_len + s.committed + tree <= s.kv_tokens:
        return 0
    return max(block, s.kv_tokens // 2)
