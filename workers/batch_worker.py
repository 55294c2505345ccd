"""Draft + verify for a batch of admitted requests: what one step of any loop asks of the workers.

Both loops drive this one class: `workers.engine.Engine` (whole generations, `specgate generate`
and the benches) and the scheduler's step loop (serving, which picks the batch and a tree budget
per request each step). The worker owns what lives next to the KV cache: each request's context
(prompt + committed output), its drafter and its speculation state (`workers.speculation`), so a
request's drafting backs off on its own evidence whichever loop drives it.

A step: for each item, size the tree (the goodput-best depth for this request's acceptance, within
the budget the caller allows), let the request's drafter propose it, then verify every tree in one
forward pass and extend the contexts with what was committed.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Mapping, Sequence

from workers.acceptance import SamplingParams
from workers.drafters.base import NO_SPECULATION, DraftContext, Drafter, TreeBudget
from workers.drafters.registry import create_drafter
from workers.speculation import SpeculationConfig, SpeculationState, next_budget, record, record_draft_time
from workers.tree import TokenTree, depths, truncate
from workers.verifier import StepResult, Verifier, VerifyItem

_EMPTY = TokenTree.empty()


@dataclass(frozen=True)
class WorkItem:
    request_id: str
    budget: TreeBudget        # the most this step may draft for the request (NO_SPECULATION: none)


@dataclass
class _Resident:
    tenant: str
    context: list[int]        # prompt + committed output; the last token is the root
    prompt_len: int
    drafter: Drafter
    spec: SpeculationState


class BatchWorker:
    def __init__(self, verifier: Verifier, *, default_drafter: str = "ngram", adaptive: bool = True,
                 speculation: SpeculationConfig | None = None,
                 drafters: Mapping[str, Drafter] | None = None):
        """`drafters`: instances by name (created from the registry on first use otherwise); one
        instance serves every request that names it, keyed by request id inside."""
        self.verifier = verifier
        self.default_drafter = default_drafter
        self.adaptive = adaptive          # else every step drafts the full budget it is given
        self.speculation = speculation or SpeculationConfig()
        self._drafters: dict[str, Drafter] = dict(drafters or {})
        self._resident: dict[str, _Resident] = {}
        self.draft_s = 0.0                # time spent proposing trees, accumulated

    @property
    def context_limit(self) -> int:
        return self.verifier.context_limit

    def drafter(self, name: str | None) -> Drafter:
        """The shared instance for a drafter name (ValueError for an unknown name)."""
        name = name or self.default_drafter
        if name not in self._drafters:
            self._drafters[name] = create_drafter(name)
        return self._drafters[name]

    def resident(self) -> list[str]:
        """Requests whose KV is held, in admission order."""
        return list(self._resident)

    def prefix_cache_usage(self) -> tuple[int, int] | None:
        """(bytes held, capacity in bytes) of the verifier's prefix cache; None without one."""
        pc = self.verifier.prefix_cache
        return None if pc is None else pc.usage_bytes()

    def prefill(self, request_id: str, token_ids: Sequence[int], *, prompt_len: int,
                sampling: SamplingParams, max_new_tokens: int, tenant: str = "default",
                drafter: str | None = None) -> int:
        """Make a request resident: `token_ids` = prompt + output committed so far (a recovered or
        evicted request re-prefills; its drafter rebuilds its index from the context). Returns the
        tokens whose KV came from the prefix cache."""
        chosen = self.drafter(drafter)
        cached = self.verifier.prefill(request_id, token_ids, sampling, max_new_tokens, tenant)
        self._resident[request_id] = _Resident(tenant, list(token_ids), prompt_len, chosen,
                                               SpeculationState(self.speculation))
        return cached

    def release(self, request_id: str) -> None:
        """Free a finished request's KV and drafter state (idempotent)."""
        res = self._resident.pop(request_id, None)
        self.verifier.release(request_id)
        if res is not None:
            res.drafter.release(request_id)

    def evict(self, request_id: str) -> None:
        """Free the KV and drafter state of a request that is not finished and will be prefilled
        again: drafters that learn from finished outputs (suffix) must not learn from it yet."""
        res = self._resident.pop(request_id, None)
        self.verifier.release(request_id)
        if res is not None:
            getattr(res.drafter, "evict", res.drafter.release)(request_id)

    def step(self, items: Sequence[WorkItem]) -> list[StepResult]:
        """Draft for every item, verify all trees in one pass, commit. Results in item order."""
        t0 = time.perf_counter()
        trees = [VerifyItem(item.request_id, tree) for item, tree in zip(items, self._draft(items))]
        self.draft_s += time.perf_counter() - t0
        results = self.verifier.verify(trees)
        for step in results:
            res = self._resident[step.request_id]
            res.spec = record(res.spec, step.drafted, step.accepted)
            res.context.extend(step.tokens)
        self._prefetch(items)
        return results

    def _prefetch(self, items: Sequence[WorkItem]) -> None:
        """Let drafters that can (remote ones: `prefetch_batch`) start drafting the next step now,
        for these requests at the budgets they would get again, while the step's results travel."""
        groups: dict[int, tuple[Drafter, list[tuple[DraftContext, TreeBudget]]]] = {}
        for item in items:
            res = self._resident.get(item.request_id)
            if res is None or not hasattr(res.drafter, "prefetch_batch"):
                continue
            budget = self._budget(res, item.budget)
            if budget.speculates:
                ctx = DraftContext(item.request_id, res.tenant, res.context, res.prompt_len)
                groups.setdefault(id(res.drafter), (res.drafter, []))[1].append((ctx, budget))
        for drafter, group in groups.values():
            drafter.prefetch_batch(group)

    def _draft(self, items: Sequence[WorkItem]) -> list[TokenTree]:
        """One tree per item. A drafter with `propose_batch` (a remote one: Ray mode's draft
        workers) gets all its requests of the step in one call instead of one call each."""
        trees: list[TokenTree | None] = [None] * len(items)
        batched: dict[int, list[tuple[int, DraftContext, TreeBudget]]] = {}
        by_id: dict[int, Drafter] = {}
        for i, item in enumerate(items):
            res = self._resident_for(item.request_id)
            budget = self._budget(res, item.budget)
            if not budget.speculates:
                trees[i] = _EMPTY
                continue
            ctx = DraftContext(item.request_id, res.tenant, res.context, res.prompt_len)
            if hasattr(res.drafter, "propose_batch"):
                batched.setdefault(id(res.drafter), []).append((i, ctx, budget))
                by_id[id(res.drafter)] = res.drafter
            else:
                t0 = time.perf_counter()
                trees[i] = res.drafter.propose(ctx, budget)
                self._charge(res, time.perf_counter() - t0, trees[i])
        for key, group in batched.items():   # a remote drafter may have prefetched these trees
            t0 = time.perf_counter()
            proposed = by_id[key].propose_batch([(ctx, budget) for _, ctx, budget in group])
            share = (time.perf_counter() - t0) / len(group)    # one call drafted for all of them
            for (i, _, budget), tree in zip(group, proposed):
                trees[i] = truncate(tree, budget.max_nodes, budget.max_depth)   # held to the budget here
                self._charge(self._resident[items[i].request_id], share, trees[i])
        return trees

    def _charge(self, res: _Resident, seconds: float, tree: TokenTree) -> None:
        """Book drafting time against the request, per tree level, so its sizing weighs it."""
        if len(tree):
            res.spec = record_draft_time(res.spec, seconds, max(depths(tree)))

    def _budget(self, res: _Resident, allowed: TreeBudget) -> TreeBudget:
        if not allowed.speculates:
            return NO_SPECULATION
        return next_budget(res.spec, allowed) if self.adaptive else allowed

    def _resident_for(self, request_id: str) -> _Resident:
        try:
            return self._resident[request_id]
        except KeyError:
            raise KeyError(f"request {request_id!r} is not resident (not prefilled, or released)") from None
