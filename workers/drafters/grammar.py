"""Grammar drafter: the tokens a request's grammar forces, proposed as a chain at no model call.

In a JSON schema much of the output is fixed: keys, quotes, colons, commas, closing brackets,
the stop token once the object is closed. Where the grammar allows exactly one token, the masked
target can only pick that token, so a draft of it is always accepted. Where the grammar forces a
*string* but several tokenizations of it are allowed (`{"` or `{` then `"`), the drafter proposes
the engine's greedy tokenization of the forced string (xgrammar's jump-forward tokens), what the
tokenizer itself writes and so what the target most likely picks; a different pick only stops
acceptance there. The chain goes on as long as something is forced, up to the budget.

Only requests with a constraint (`DraftContext.constraint`) get a chain; for the rest it proposes
nothing. BatchWorker merges it with the request's own drafter (workers/drafters/merge.py), so the
n-gram or suffix drafter still drafts the free parts (string values, numbers).

State per request: a matcher advanced incrementally over the committed output (a request's
tokens only grow), dropped in `release`.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import xgrammar as xgr

from workers.contract import DraftContext, TreeBudget
from workers.drafters.base import Drafter
from workers.speculation.grammar import Grammars, advance
from workers.speculation.tree import TokenTree

__all__ = ["GrammarDrafter"]


@dataclass
class _State:
    matcher: xgr.GrammarMatcher
    seen: int                 # tokens of the context the matcher has accepted (prompt included)


class GrammarDrafter(Drafter):
    name = "grammar"

    def __init__(self, grammars: Grammars):
        self.grammars = grammars
        self._mask = grammars.bitmask(1)                          # [1, ceil(V / 32)] int32
        self._states: dict[str, _State] = {}

    def propose(self, ctx: DraftContext, budget: TreeBudget) -> TokenTree:
        if not ctx.constraint or not budget.speculates:
            return TokenTree.empty()
        state = self._state(ctx)
        m = state.matcher
        chain: list[int] = []
        most = min(budget.max_nodes, budget.max_depth)
        while len(chain) < most and not m.is_terminated():
            forced = self._forced(m)
            if not forced:
                break
            for t in forced[: most - len(chain)]:
                if not m.accept_token(t):
                    break
                chain.append(t)
            else:
                continue
            break
        if chain:
            m.rollback(len(chain))
        return TokenTree.chain(chain)

    def _forced(self, m: xgr.GrammarMatcher) -> list[int]:
        """What the grammar forces next: its jump-forward tokens; else, when the forced text is
        one token (`":` before a free value: the engine leaves out a last token that a longer
        one extends), that token; else the one token it allows."""
        jump = m.find_jump_forward_tokens()
        if jump:
            return list(jump)
        text = m.find_jump_forward_string()
        whole = self.grammars.token_of(text) if text else None
        if whole is not None:
            return [whole]
        m.fill_next_token_bitmask(self._mask, 0)
        words = self._mask[0].numpy().view(np.uint32)
        nonzero = np.flatnonzero(words)
        if len(nonzero) != 1:
            return []
        word = int(words[nonzero[0]])
        if word & (word - 1):                   # more than one bit set
            return []
        return [int(nonzero[0]) * 32 + word.bit_length() - 1]

    def _state(self, ctx: DraftContext) -> _State:
        state = self._states.get(ctx.request_id)
        if state is None:
            m = self.grammars.matcher(ctx.constraint)
            state = self._states[ctx.request_id] = _State(m, ctx.prompt_len)
        if len(ctx.tokens) > state.seen:
            advance(state.matcher, ctx.tokens[state.seen:])
            state.seen = len(ctx.tokens)
        return state

    def release(self, request_id: str) -> None:
        self._states.pop(request_id, None)
