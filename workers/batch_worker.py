"""Draft + verify for a batch of admitted requests: what one step of any loop asks of the workers.

Both loops drive this one class: `scheduler.generation.Engine` (whole generations, `specgate
generate` and the benches) and the scheduler's step loop (serving). The worker owns what lives
next to the KV cache: each request's context (prompt + committed output) and its drafter.

A step carries out the plan it is handed: for each item, the request's drafter proposes a tree
within the item's budget (the planner alone decides how big: scheduler/sizing.py), every tree is
verified in one forward pass, and the contexts grow by what was committed. Each result reports
what the planner learns from: nodes drafted and accepted, and the request's share of the
drafting time.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Any, Mapping, Protocol, Sequence

from workers.contract import DraftContext, Prefilled, SamplingParams, StepResult, TargetTaps, TreeBudget, WorkItem
from workers.drafters.base import Drafter
from workers.drafters.merge import MergeDrafter
from workers.drafters.registry import create_drafter
from workers.speculation.target_taps import gather
from workers.speculation.tree import TokenTree, depths, truncate
from workers.speculation.verifier import Verifier, VerifyItem

_EMPTY = TokenTree.empty()
TAP_CHUNKS = 64     # a request's pending tap chunks before they are gathered (and bounded) in one
# one drafter's requests of a step: (item index, what the drafter sees, budget) each
_Group = tuple[Drafter, list[tuple[int, DraftContext, TreeBudget]]]


class GrammarHolder(Protocol):
    """What keeps a resident request's compiled grammar (workers.speculation.grammars.Grammars):
    `pin` returns a claim whose `release()` lets it go."""

    def pin(self, constraint: str) -> Any: ...


@dataclass
class _Resident:
    tenant: str               # the tenant's immutable id: what caches are keyed by
    context: list[int]        # prompt + committed output; the last token is the root
    prompt_len: int
    drafter: Drafter
    constraint: str | None = None   # SamplingParams.constraint: what the grammar drafter reads
    # target activations its drafter has not been handed yet: a chunk per step, gathered into
    # one only when it drafts (a request the planner gives no drafts would otherwise re-pack its
    # whole sink + window of taps every step)
    taps: list[TargetTaps] = field(default_factory=list)
    grammar_pin: Any = None         # its compiled grammar, held while it is resident

    def add_taps(self, taps: TargetTaps) -> None:
        self.taps.append(taps)
        if len(self.taps) > TAP_CHUNKS:             # bounded again: to the rows the draft can read
            self.taps = [gather(self.taps, self.drafter.target_taps, len(self.context) - 1)]

    def draft_context(self, request_id: str) -> DraftContext:
        return DraftContext(request_id, self.tenant, self.context, self.prompt_len, self.constraint,
                            gather(self.taps, self.drafter.target_taps, len(self.context) - 1))


class BatchWorker:
    def __init__(self, verifier: Verifier, *, default_drafter: str = "ngram",
                 drafters: Mapping[str, Drafter] | None = None, grammar: Drafter | None = None,
                 grammars: GrammarHolder | None = None):
        """`drafters`: instances by name (created from the registry on first use otherwise); one
        instance serves every request that names it, keyed by request id inside. `grammar`: the
        grammar drafter (workers/drafters/grammar.py), merged with the drafter of every request
        that has a constraint; None: constrained requests draft with their own drafter alone.
        `grammars`: the compiled grammars the verifier's rules and the grammar drafter read; a
        resident request's is held here until it leaves, so the grammar drafter's first proposal
        (steps after the prefill) finds it however many others came meanwhile."""
        self.verifier = verifier
        self.default_drafter = default_drafter
        self._drafters: dict[str, Drafter] = dict(drafters or {})
        self.grammar = grammar
        self.grammars = grammars
        self._with_grammar: dict[str, Drafter] = {}   # drafter name -> merged with the grammar's
        self._resident: dict[str, _Resident] = {}
        self._dropped: list[str] = []     # removed tenants' ids, for drafters created later
        self.draft_s = 0.0                # time spent proposing trees, accumulated

    @property
    def context_limit(self) -> int:
        return self.verifier.context_limit

    def drafter(self, name: str | None) -> Drafter:
        """The shared instance for a drafter name (ValueError for an unknown name)."""
        name = name or self.default_drafter
        if name not in self._drafters:
            # a model drafter runs where the target does (its weights, KV and tensors)
            drafter = self._drafters[name] = create_drafter(name, device=self.verifier.target.device)
            for tenant in self._dropped:  # so a removed tenant's late request teaches it nothing
                drafter.drop_tenant(tenant)
        return self._drafters[name]

    def resident(self) -> list[str]:
        """Requests whose KV is held, in admission order."""
        return list(self._resident)

    def prefix_cache_usage(self) -> tuple[int, int] | None:
        """(bytes held, capacity in bytes) of the verifier's prefix cache; None without one."""
        pc = self.verifier.prefix_cache
        return None if pc is None else pc.usage_bytes()

    def kv_slots(self) -> tuple[int, int] | None:
        """(budget, held) in KV slots: what the verifier's KV pool holds and what its requests
        hold now (Ray mode's replicas report it: `VerifierPool.kv_budgets`); None without a pool."""
        budget = self.verifier.kv_budget_slots
        return None if budget is None else (budget, self.verifier.kv_tokens())

    def prefill(self, request_id: str, token_ids: Sequence[int], *, prompt_len: int,
                sampling: SamplingParams, max_new_tokens: int, tenant: str = "default",
                drafter: str | None = None, defer: bool = False) -> Prefilled:
        """Make a request resident: `token_ids` = prompt + output committed so far (a recovered or
        evicted request re-prefills; its drafter rebuilds its index from the context). `tenant`:
        the tenant's immutable id, which the prefix cache and drafters key their state by. Reports the
        tokens whose KV came from the prefix cache, and the verifier's features if it makes them.
        `defer`: steps compute the context's KV in chunks (`WorkItem.prefill`), none is computed
        now; `Prefilled.pending` says how much."""
        chosen = self.drafter(drafter)
        if sampling.constraint and self.grammar is not None:
            chosen = self._grammar_merged(chosen)
        self._want_taps(chosen)
        pin = None
        if sampling.constraint and self.grammars is not None:
            pin = self.grammars.pin(sampling.constraint)
        done = self.verifier.prefill(request_id, token_ids, sampling, max_new_tokens, tenant, defer=defer,
                                     prompt_len=prompt_len)
        self._resident[request_id] = _Resident(tenant, list(token_ids), prompt_len, chosen,
                                               sampling.constraint,
                                               [done.taps] if done.taps is not None else [], pin)
        return replace(done, taps=None)

    def _want_taps(self, drafter: Drafter) -> None:
        """A drafter that reads the target's activations (`Drafter.target_taps`): the verifier
        returns them from now on. One spec per verifier: every pass computes the same taps."""
        spec = drafter.target_taps
        if spec is None or self.verifier.taps == spec:
            return
        if self.verifier.taps is not None:
            raise ValueError(f"drafter {drafter.name!r} reads target taps {spec}, but this verifier "
                             f"already returns {self.verifier.taps} for another drafter")
        self.verifier.taps = spec

    def _grammar_merged(self, drafter: Drafter) -> Drafter:
        """The request's drafter with the grammar drafter's forced chain merged in (one shared
        instance per drafter; `none` leaves the grammar's alone)."""
        if drafter.name in ("none", self.grammar.name):
            return self.grammar
        if drafter.name not in self._with_grammar:
            self._with_grammar[drafter.name] = MergeDrafter([self.grammar, drafter])
        return self._with_grammar[drafter.name]

    def release(self, request_id: str) -> None:
        """Free a finished request's KV and drafter state (idempotent)."""
        res = self._resident.pop(request_id, None)
        self.verifier.release(request_id)
        if res is not None:
            res.drafter.release(request_id)
            _unpin(res)

    def evict(self, request_id: str) -> None:
        """Free the KV and drafter state of a request that is not finished and will be prefilled
        again: drafters that learn from finished outputs (suffix) must not learn from it yet."""
        res = self._resident.pop(request_id, None)
        self.verifier.release(request_id)
        if res is not None:
            res.drafter.evict(request_id)
            _unpin(res)

    def drop_tenant(self, tenant: str) -> None:
        """A removed tenant (its immutable id, what `prefill` got as `tenant`): its prefix-cache
        blocks and every drafter's state for it go, and none is kept for it again. Its requests
        still resident run on (their own KV and per-request drafter state go when they end)."""
        self._dropped.append(tenant)
        self.verifier.drop_tenant(tenant)
        for drafter in self._drafters.values():
            drafter.drop_tenant(tenant)

    def step(self, items: Sequence[WorkItem]) -> list[StepResult]:
        """Draft every item's tree within its budget, verify all trees in one pass, commit.
        Results in item order."""
        t0 = time.perf_counter()
        groups = self._groups(items)
        trees, shares = self._draft(items, groups)
        self.draft_s += time.perf_counter() - t0
        results = self.verifier.verify([VerifyItem(it.request_id, tree, it.prefill, it.decode)
                                        for it, tree in zip(items, trees)])
        out = []
        for step, tree, share in zip(results, trees, shares):
            res = self._resident[step.request_id]
            res.context.extend(step.tokens)
            if step.taps is not None:
                res.add_taps(step.taps)
            if step.prefilled and step.pending:        # mid-prefill: index what is computed
                res.drafter.observe(DraftContext(step.request_id, res.tenant,
                                                 res.context[:len(res.context) - step.pending],
                                                 res.prompt_len, res.constraint))
            out.append(replace(step, draft_s=share, draft_depth=max(depths(tree), default=0), taps=None))
        # Let drafters start drafting the next step now (remote ones do, while the step's results
        # travel), for these requests at this step's budgets, from their grown contexts (with the
        # taps this step brought; they stay pending until a proposal hands them over).
        for drafter, group in groups:
            drafter.prefetch_batch([(self._resident[ctx.request_id].draft_context(ctx.request_id), budget)
                                    for _, ctx, budget in group])
        return out

    def _groups(self, items: Sequence[WorkItem]) -> list[_Group]:
        """The items that speculate this step, by drafter instance."""
        groups: dict[int, _Group] = {}
        for i, item in enumerate(items):
            if item.budget.speculates:
                res = self._resident_for(item.request_id)
                groups.setdefault(id(res.drafter), (res.drafter, []))[1].append(
                    (i, res.draft_context(item.request_id), item.budget))
        return list(groups.values())

    def _draft(self, items: Sequence[WorkItem], groups: list[_Group]) -> tuple[list[TokenTree], list[float]]:
        """One tree per item (empty where the budget drafts nothing), and each item's share of the
        drafting time. Each drafter gets all its requests of the step in one call (a draft model
        shares its passes, a remote drafter makes one round trip)."""
        trees: list[TokenTree] = [_EMPTY] * len(items)
        shares = [0.0] * len(items)
        for drafter, group in groups:
            t0 = time.perf_counter()
            proposed = drafter.propose_batch([(ctx, budget) for _, ctx, budget in group])
            for _, ctx, _ in group:
                if ctx.taps is not None:        # handed over
                    self._resident[ctx.request_id].taps = []
            # per request, the tree's own drafting: one-off catch-up is no cost of its levels
            share = max(0.0, time.perf_counter() - t0 - drafter.catch_up_s) / len(group)
            for (i, _, b), tree in zip(group, proposed):
                # held to the budget here: a remote drafter's tree may have been prefetched
                trees[i], shares[i] = truncate(tree, b.max_nodes, b.max_depth), share
        return trees, shares

    def _resident_for(self, request_id: str) -> _Resident:
        try:
            return self._resident[request_id]
        except KeyError:
            raise KeyError(f"request {request_id!r} is not resident (not prefilled, or released)") from None


def _unpin(res: _Resident) -> None:
    if res.grammar_pin is not None:
        res.grammar_pin.release()
