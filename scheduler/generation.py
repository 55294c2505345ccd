"""A minimal batch generation loop: size -> draft -> verify -> commit, for `specgate generate`,
the benches and distillation.

Every request in the batch takes part in every step until it finishes. The step loop
(scheduler/loop.py) drives the same worker for serving, with admission, priorities and per-step
batch choice; this loop is the smallest thing that produces whole generations. Its trees are
sized by the planner's own rule (scheduler/sizing.py): each request's α estimate, its drafting
time and the measured step cost, within the loop's budget (`adaptive=False`: the whole budget
every step).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Sequence

from scheduler.alpha import AlphaEstimate, learn
from scheduler.sizing import SizingConfig, size_trees
from scheduler.step_cost import StepCost
from workers.contract import ContextLengthError, SamplingParams, TreeBudget, WorkItem
from workers.drafters.base import Drafter
from workers.stopping import cut

if TYPE_CHECKING:
    from workers.speculation.verifier import Verifier


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
    draft_levels: int = 0                                 # tree levels drafted: a model's draft passes
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
                 step_cost: StepCost | None = None):
        """One drafter for every request. `budget`: the most a request may draft per step;
        `adaptive`: size each request's tree within it (scheduler/sizing.py) by its acceptance,
        its drafting time and `step_cost` (the measured profile; None: nodes worth ≥ 0.1 token),
        else draft the whole budget every step."""
        self.budget = budget
        self.adaptive = adaptive
        self.step_cost = step_cost
        self.sizing = SizingConfig(max_tree_tokens=budget.max_nodes, max_depth=budget.max_depth)
        # the worker (and torch with it) only when an engine is made: the request types and
        # `validate_request` above serve callers that load no device code
        from workers.batch_worker import BatchWorker

        self.worker = BatchWorker(verifier, default_drafter=drafter.name,
                                  drafters={drafter.name: drafter})

    @property
    def verifier(self) -> Verifier:
        return self.worker.verifier

    def generate(self, requests: Sequence[GenerationRequest]) -> list[GenerationResult]:
        """Run all requests as one batch to completion; results in request order."""
        worker = self.worker
        for req in requests:
            validate_request(req, worker.context_limit)
        if len({r.request_id for r in requests}) != len(requests):
            raise ValueError("request ids must be unique within a batch")
        results = {r.request_id: GenerationResult(r.request_id) for r in requests}
        by_id = {r.request_id: r for r in requests}
        estimates = {r.request_id: AlphaEstimate() for r in requests}
        live = list(requests)
        try:
            for req in requests:
                worker.prefill(req.request_id, req.prompt_ids, prompt_len=len(req.prompt_ids),
                               sampling=req.sampling, max_new_tokens=self._limit(req), tenant=req.tenant)
            while live:
                items = self._plan([r.request_id for r in live], estimates)
                for step in worker.step(items):
                    estimates[step.request_id] = learn(estimates[step.request_id], step.drafted,
                                                       step.accepted, step.draft_s, step.draft_depth)
                    res = results[step.request_id]
                    res.steps += 1
                    res.drafted += step.drafted
                    res.accepted += step.accepted
                    res.draft_levels += step.draft_depth
                    self._commit(by_id[step.request_id], res, step.tokens)
                live = [r for r in live if results[r.request_id].finish_reason is None]
        finally:
            for req in requests:
                worker.release(req.request_id)
        return [results[r.request_id] for r in requests]

    def _plan(self, ids: list[str], estimates: dict[str, AlphaEstimate]) -> list[WorkItem]:
        if not self.adaptive or not self.budget.speculates:
            return [WorkItem(rid, self.budget) for rid in ids]
        est = [estimates[rid] for rid in ids]
        budgets = size_trees([e.alpha for e in est], len(ids) * self.budget.max_nodes,
                             cost=self.step_cost, config=self.sizing, draft_s=[e.draft_s for e in est])
        return [WorkItem(rid, b) for rid, b in zip(ids, budgets)]

    def _limit(self, req: GenerationRequest) -> int:
        return min(req.max_new_tokens, self.worker.context_limit - len(req.prompt_ids))

    def _commit(self, req: GenerationRequest, res: GenerationResult, tokens: Sequence[int]) -> None:
        kept, cause = cut(tokens, produced=len(res.token_ids), limit=self._limit(req),
                          stop_token_ids=req.stop_token_ids)
        res.token_ids.extend(kept)
        if cause is not None:
            res.finish_reason = "stop" if cause == "stop_token" else cause

