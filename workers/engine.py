"""A minimal batch generation loop: draft -> verify -> commit, for `specgate generate` and the benches.

Every request in the batch takes part in every step until it finishes. The scheduler's step loop
(scheduler/) drives the same Verifier and drafters for serving, with admission, priorities and
per-step batch choice; this loop is the smallest thing that produces whole generations.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Sequence

from workers.acceptance import SamplingParams
from workers.drafters.base import DraftContext, Drafter, TreeBudget
from workers.speculation import SpeculationConfig, SpeculationState, next_budget, record
from workers.verifier import ContextLengthError, Verifier, VerifyItem


@dataclass(frozen=True)
class GenerationRequest:
    request_id: str
    prompt_ids: tuple[int, ...]
    max_new_tokens: int
    sampling: SamplingParams = SamplingParams()
    stop_token_ids: frozenset[int] = frozenset()
    tenant: str = "default"


@dataclass
class GenerationResult:
    request_id: str
    token_ids: list[int] = field(default_factory=list)   # generated ids only (a stop token included)
    steps: int = 0
    drafted: int = 0
    accepted: int = 0
    finish_reason: str | None = None                      # "stop" | "length"

    @property
    def tau_mean(self) -> float:
        """Tokens delivered per verification step (the last step may be cut by max_new_tokens)."""
        return len(self.token_ids) / self.steps if self.steps else 0.0

    @property
    def alpha(self) -> float:
        """Acceptance rate: accepted ÷ drafted tokens."""
        return self.accepted / self.drafted if self.drafted else 0.0


def validate_request(req: GenerationRequest, context_limit: int) -> None:
    if len(req.prompt_ids) == 0:
        raise ValueError("prompt is empty: at least one token is needed")
    if req.max_new_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {req.max_new_tokens}")
    if len(req.prompt_ids) >= context_limit:
        raise ContextLengthError(
            f"prompt has {len(req.prompt_ids)} tokens; the model's context is {context_limit} tokens")


class Engine:
    def __init__(self, verifier: Verifier, drafter: Drafter, budget: TreeBudget, *, adaptive: bool = True,
                 speculation: SpeculationConfig | None = None):
        self.verifier = verifier
        self.drafter = drafter
        self.budget = budget
        self.adaptive = adaptive   # size each request's tree from its acceptance; else always `budget`
        self.speculation = speculation or SpeculationConfig()
        self.draft_s = 0.0

    def generate(self, requests: Sequence[GenerationRequest]) -> list[GenerationResult]:
        """Run all requests as one batch to completion; results in request order."""
        for req in requests:
            validate_request(req, self.verifier.context_limit)
        if len({r.request_id for r in requests}) != len(requests):
            raise ValueError("request ids must be unique within a batch")
        results = {r.request_id: GenerationResult(r.request_id) for r in requests}
        contexts = {r.request_id: list(r.prompt_ids) for r in requests}
        spec = {r.request_id: SpeculationState(self.speculation) for r in requests}
        live = list(requests)
        by_id = {r.request_id: r for r in requests}
        try:
            for req in requests:
                max_new = min(req.max_new_tokens, self.verifier.context_limit - len(req.prompt_ids))
                self.verifier.prefill(req.request_id, req.prompt_ids, req.sampling, max_new)
            while live:
                items = [VerifyItem(r.request_id, self._draft(r, contexts, spec)) for r in live]
                for step in self.verifier.verify(items):
                    req = by_id[step.request_id]
                    res = results[step.request_id]
                    res.steps += 1
                    res.drafted += step.drafted
                    res.accepted += step.accepted
                    spec[req.request_id] = record(spec[req.request_id], step.drafted, step.accepted)
                    contexts[req.request_id].extend(step.tokens)
                    self._commit(req, res, step.tokens)
                live = [r for r in live if results[r.request_id].finish_reason is None]
        finally:
            for req in requests:
                self.verifier.release(req.request_id)
                self.drafter.release(req.request_id)
        return [results[r.request_id] for r in requests]

    def _draft(self, req: GenerationRequest, contexts, spec):
        budget = next_budget(spec[req.request_id], self.budget) if self.adaptive else self.budget
        t0 = time.perf_counter()
        ctx = DraftContext(req.request_id, req.tenant, contexts[req.request_id], len(req.prompt_ids))
        tree = self.drafter.propose(ctx, budget)
        self.draft_s += time.perf_counter() - t0
        return tree

    def _commit(self, req: GenerationRequest, res: GenerationResult, tokens: Sequence[int]) -> None:
        limit = min(req.max_new_tokens, self.verifier.context_limit - len(req.prompt_ids))
        for tok in tokens:
            res.token_ids.append(tok)
            if tok in req.stop_token_ids:
                res.finish_reason = "stop"
                return
            if len(res.token_ids) >= limit:
                res.finish_reason = "length"
                return
