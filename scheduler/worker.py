"""What the step loop drives: the worker's calls, as the scheduler sees them.

`workers.batch_worker.BatchWorker` is one; `workers.fake_worker.FakeWorker` (tests,
benches) another; in Ray mode `gateway.ray_serve.verifier_pool.VerifierPool`.
"""
from __future__ import annotations

from typing import Protocol, Sequence

from workers.contract import Prefilled, SamplingParams, StepResult, WorkItem


class Worker(Protocol):
    """What the loop drives: `workers.batch_worker.BatchWorker`, or a fake with the same calls.
    `step` drafts each item's tree within the budget it is given (the plan sizes them)."""
    context_limit: int

    def prefill(self, request_id: str, token_ids: Sequence[int], *, prompt_len: int,
                sampling: SamplingParams, max_new_tokens: int, tenant: str = "default",
                drafter: str | None = None, defer: bool = False) -> Prefilled:
        """Make a request resident; `defer`: compute none of its context's KV now (steps do,
        in the chunks `WorkItem.prefill` asks for; the loop passes it only when chunking)."""

    def step(self, items: Sequence[WorkItem]) -> list[StepResult]:
        """One result per item, in item order; a result without tokens only prefilled."""

    def release(self, request_id: str) -> None:
        """Free a finished request's KV and drafter state."""

    def evict(self, request_id: str) -> None:
        """Free the KV of a request that is not finished (it is prefilled again when planned)."""

    def drop_tenant(self, tenant: str) -> None:
        """Free what is kept for a removed tenant across requests (prefix cache, drafters'
        caches) and keep nothing more for it; `tenant` is its immutable id, as `prefill` got it."""
