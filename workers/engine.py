"""A minimal batch generation loop: draft -> verify -> commit, for `specgate generate` and the benches.

Every request in the batch takes part in every step until it finishes. The scheduler's step loop
(scheduler/) drives the same BatchWorker for serving, with admission, priorities and per-step
batch choice; this loop is the smallest thing that produces whole generations.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from workers.acceptance import SamplingParams
from workers.batch_worker import BatchWorker, WorkItem
from workers.drafters.base import Drafter, TreeBudget
from workers.speculation import SpeculationConfig
from workers.stopping import cut
from workers.verifier import ContextLengthError, Verifier


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
        self.budget = budget
        # One drafter for every request; `adaptive`: size each request's tree from its acceptance.
        self.worker = BatchWorker(verifier, default_drafter=drafter.name, adaptive=adaptive,
                                  speculation=speculation, drafters={drafter.name: drafter})

    @property
    def verifier(self) -> Verifier:
        return self.worker.verifier

    @property
    def speculation(self) -> SpeculationConfig:
        return self.worker.speculation

    def generate(self, requests: Sequence[GenerationRequest]) -> list[GenerationResult]:
        """Run all requests as one batch to completion; results in request order."""
        worker = self.worker
        for req in requests:
            validate_request(req, worker.context_limit)
        if len({r.request_id for r in requests}) != len(requests):
            raise ValueError("request ids must be unique within a batch")
        results = {r.request_id: GenerationResult(r.request_id) for r in requests}
        by_id = {r.request_id: r for r in requests}
        live = list(requests)
        try:
            for req in requests:
                worker.prefill(req.request_id, req.prompt_ids, prompt_len=len(req.prompt_ids),
                               sampling=req.sampling, max_new_tokens=self._limit(req), tenant=req.tenant)
            while live:
                for step in worker.step([WorkItem(r.request_id, self.budget) for r in live]):
                    res = results[step.request_id]
                    res.steps += 1
                    res.drafted += step.drafted
                    res.accepted += step.accepted
                    self._commit(by_id[step.request_id], res, step.tokens)
                live = [r for r in live if results[r.request_id].finish_reason is None]
        finally:
            for req in requests:
                worker.release(req.request_id)
        return [results[r.request_id] for r in requests]

    def _limit(self, req: GenerationRequest) -> int:
        return min(req.max_new_tokens, self.worker.context_limit - len(req.prompt_ids))

    def _commit(self, req: GenerationRequest, res: GenerationResult, tokens: Sequence[int]) -> None:
        kept, cause = cut(tokens, produced=len(res.token_ids), limit=self._limit(req),
                          stop_token_ids=req.stop_token_ids)
        res.token_ids.extend(kept)
        if cause is not None:
            res.finish_reason = "stop" if cause == "stop_token" else cause
