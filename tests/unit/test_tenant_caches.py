"""Caches across tenants at the worker (BatchWorker, Verifier, PrefixCache, SuffixDrafter on the
tiny model). The engine knows a tenant by its immutable id (`Tenant.id`): a tenant removed and
created again under its name arrives as another id, so it gets no prefix-cache hit and no suffix
draft from the old one, and `drop_tenant` frees what the old id held. That the id changes and
reaches the engine through the app is tests/unit/gateway/test_tenant_removal.py."""
from __future__ import annotations

import numpy as np

from workers.batch_worker import BatchWorker
from workers.contract import DraftContext, SamplingParams, TreeBudget, WorkItem
from workers.drafters.suffix import SuffixDrafter
from workers.model.llama_forward import LlamaForward
from workers.model.prefix_cache import PrefixCache
from workers.speculation.verifier import Verifier

BUDGET = TreeBudget(4, 4)


def _worker(tiny_model) -> tuple[BatchWorker, PrefixCache, SuffixDrafter]:
    pc, suffix = PrefixCache(64, block=16), SuffixDrafter()
    verifier = Verifier(LlamaForward(tiny_model), max_tree_tokens=8, prefix_cache=pc)
    return BatchWorker(verifier, default_drafter="suffix", drafters={"suffix": suffix}), pc, suffix


def _run(worker: BatchWorker, rid: str, prompt: list[int], tenant: str, steps: int = 6,
         defer: bool = False) -> tuple[int, list[int]]:
    """Prefill and step one request; returns (prefix-cache hit tokens, its output)."""
    done = worker.prefill(rid, prompt, prompt_len=len(prompt), sampling=SamplingParams(),
                          max_new_tokens=32, tenant=tenant, defer=defer)
    out: list[int] = []
    for _ in range(steps):
        (res,) = worker.step([WorkItem(rid, BUDGET, prefill=worker.verifier.pending(rid))])
        out += res.tokens
    return done.cached, out


def test_a_recreated_tenant_gets_no_prefix_hit_and_no_suffix_draft_from_the_old_one(tiny_model):
    worker, pc, suffix = _worker(tiny_model)
    prompt = np.random.default_rng(5).integers(3, 128, size=70).tolist()
    _, output = _run(worker, "a1", prompt, "t-old")
    worker.release("a1")                                  # finished: the suffix cache learns it
    cached, _ = _run(worker, "a2", prompt, "t-old")
    assert cached == 64                                   # the old tenant's own prefix hits
    worker.release("a2")
    # what the old tenant's outputs make the suffix drafter propose, and what a drafter that never
    # saw them proposes, for a context that ends like that output began
    probe = [127, 126, *output[:4]]
    blank = SuffixDrafter().propose(DraftContext("probe", "t-new", probe, 2), BUDGET)
    assert suffix.propose(DraftContext("p-old", "t-old", probe, 2), BUDGET) != blank
    held_before = pc.usage_bytes()[0]

    worker.drop_tenant("t-old")                           # the tenant was removed
    assert pc.tenant_len("t-old") == 0 and pc.usage_bytes()[0] < held_before
    assert suffix.cached_tokens("t-old") == 0

    # created again under its name: a new id, nothing inherited
    cached, _ = _run(worker, "b1", prompt, "t-new")
    assert cached == 0
    assert suffix.propose(DraftContext("p-new", "t-new", probe, 2), BUDGET) == blank
    assert suffix.propose(DraftContext("p-old2", "t-old", probe, 2), BUDGET) == blank


def test_a_removed_tenants_request_still_running_leaves_nothing_behind(tiny_model):
    """Its prompt is prefilled in chunks across the removal: no block is stored for it after the
    drop, and its output, when it ends, teaches the suffix drafter nothing."""
    worker, pc, suffix = _worker(tiny_model)
    prompt = np.random.default_rng(6).integers(3, 128, size=70).tolist()
    worker.prefill("late", prompt, prompt_len=len(prompt), sampling=SamplingParams(),
                   max_new_tokens=32, tenant="t-gone", defer=True)
    worker.step([WorkItem("late", BUDGET, prefill=20)])     # part of its prompt computed
    worker.drop_tenant("t-gone")
    for _ in range(6):
        worker.step([WorkItem("late", BUDGET, prefill=worker.verifier.pending("late"))])
    worker.release("late")
    assert pc.tenant_len("t-gone") == 0 and suffix.cached_tokens("t-gone") == 0
    # a drafter the worker creates after the removal refuses it too
    worker.drafter("merge:ngram+suffix")
    worker.prefill("late2", prompt, prompt_len=len(prompt), sampling=SamplingParams(),
                   max_new_tokens=8, tenant="t-gone", drafter="merge:ngram+suffix")
    worker.step([WorkItem("late2", BUDGET)])
    worker.release("late2")
    merged_suffix = worker.drafter("merge:ngram+suffix").drafters[1]
    assert merged_suffix.cached_tokens("t-gone") == 0 and pc.tenant_len("t-gone") == 0
