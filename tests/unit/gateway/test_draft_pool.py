"""Ray mode's remote drafter without Ray: a fake handle stands in for the draft deployment (the
DraftService behind it is the real one), so prefetching, budgets, failures and releases are
checked call by call. The real deployment is exercised in tests/integration/test_ray_serve.py."""
from __future__ import annotations

import threading


from gateway.ray_serve.draft_pool import DraftService, RemoteDrafter
from gateway.ray_serve.releases import Evicted
from tests.helpers import hf_greedy
from tests.unit.test_engine import prompts
from workers.contract import SamplingParams
from workers.batch_worker import BatchWorker
from workers.contract import WorkItem
from workers.contract import DraftContext, TreeBudget
from workers.model.llama_forward import LlamaForward
from workers.speculation.tree import TokenTree
from workers.speculation.verifier import Verifier


class _Response:
    def __init__(self, handle, fn):
        self.handle, self.fn = handle, fn

    def result(self, timeout_s=None):
        self.handle.waited_in.append(threading.get_ident())
        return self.fn()


class FakeDraftHandle:
    """`handle.propose.remote(wire, drafter=, affinity=, release=)` over a real DraftService."""

    def __init__(self, fail: bool = False):
        self.service = DraftService()
        self.fail = fail
        self.calls: list[tuple[list, list]] = []
        self.made_in: list[int] = []
        self.waited_in: list[int] = []
        self.propose = self

    def remote(self, wire, *, drafter, affinity, release):
        self.calls.append(([ctx.request_id for ctx, _ in wire], list(release)))
        self.made_in.append(threading.get_ident())

        def answer():
            if self.fail:
                raise TimeoutError("draft replica gone")
            return self.service.propose(wire, drafter, release)
        return _Response(self, answer)


def ctx(rid: str, tokens: list[int]) -> DraftContext:
    return DraftContext(rid, "t", tokens, 2)


REPEAT = [5, 6, 7, 8, 5, 6, 7]          # ngram finds "8 5 6 7 ..." after the last "5 6 7"
BUDGET = TreeBudget(4, 4)


def test_a_prefetched_tree_is_used_without_another_call():
    handle = FakeDraftHandle()
    d = RemoteDrafter(handle, "ngram", affinity="v1")
    items = [(ctx("a", REPEAT), BUDGET), (ctx("b", REPEAT[:5]), BUDGET)]
    d.prefetch_batch(items)
    trees = d.propose_batch(items)
    assert len(handle.calls) == 1 and d.prefetch_hits == 2
    assert trees[0] == TokenTree.chain([8, 5, 6, 7])
    assert set(handle.made_in) == set(handle.waited_in) and threading.get_ident() not in handle.made_in


def test_a_changed_context_or_a_bigger_budget_asks_again():
    handle = FakeDraftHandle()
    d = RemoteDrafter(handle, "ngram", affinity="v1")
    d.prefetch_batch([(ctx("a", REPEAT), BUDGET), (ctx("b", REPEAT), BUDGET), (ctx("c", REPEAT), BUDGET)])
    trees = d.propose_batch([(ctx("a", REPEAT + [8]), BUDGET),          # a committed token since
                             (ctx("b", REPEAT), TreeBudget(8, 8)),       # a bigger budget
                             (ctx("c", REPEAT), TreeBudget(2, 2))])      # a smaller one: cut later
    assert handle.calls[1][0] == ["a", "b"] and d.prefetch_hits == 1
    assert trees[0].tokens[:3] == (5, 6, 7) and len(trees[2]) == 4   # the worker cuts it


def test_failing_draft_workers_cost_only_the_drafts():
    handle = FakeDraftHandle(fail=True)
    d = RemoteDrafter(handle, "ngram", affinity="v1")
    d.prefetch_batch([(ctx("a", REPEAT), BUDGET)])
    assert d.propose_batch([(ctx("a", REPEAT), BUDGET), (ctx("b", REPEAT), BUDGET)]) == [TokenTree.empty()] * 2
    assert d.failures == 2


def test_a_release_drops_the_prefetch_and_travels_with_the_next_call():
    handle = FakeDraftHandle()
    d = RemoteDrafter(handle, "ngram", affinity="v1")
    d.prefetch_batch([(ctx("a", REPEAT), BUDGET)])
    d.release("a")
    d.propose_batch([(ctx("a", REPEAT), BUDGET)])
    assert len(handle.calls) == 2 and handle.calls[1] == (["a"], ["a"]) and d.prefetch_hits == 0


def test_an_eviction_travels_marked_and_the_suffix_cache_learns_only_finished_outputs():
    handle = FakeDraftHandle()
    d = RemoteDrafter(handle, "suffix", affinity="v1")
    d.propose_batch([(ctx("a", REPEAT), BUDGET), (ctx("b", REPEAT[:5]), BUDGET)])
    d.evict("a")
    d.release("b")
    d.propose_batch([(ctx("c", REPEAT[:3]), BUDGET)])
    assert handle.calls[1] == (["c"], [Evicted("a"), "b"])
    assert len(handle.service.drafters["suffix"]._tenants["t"].lengths) == 1   # b's, not a's


def test_the_worker_prefetches_each_next_step_and_output_stays_greedy(tiny_model):
    handle = FakeDraftHandle()
    remote = RemoteDrafter(handle, "ngram", affinity="v1")
    worker = BatchWorker(Verifier(LlamaForward(tiny_model), max_tree_tokens=8),
                         drafters={"ngram": remote})
    ps = [p for p in prompts(6) if len(p) > 3][:3]
    for i, p in enumerate(ps):
        worker.prefill(f"r{i}", p, prompt_len=len(p), sampling=SamplingParams(), max_new_tokens=24,
                       drafter="ngram")
    out = {f"r{i}": [] for i in range(len(ps))}
    steps = 0
    while any(len(v) < 24 for v in out.values()):
        live = [WorkItem(r, BUDGET) for r, v in out.items() if len(v) < 24]
        for res in worker.step(live):
            out[res.request_id].extend(res.tokens)
        steps += 1
    for i, p in enumerate(ps):
        assert out[f"r{i}"][:24] == hf_greedy(tiny_model, p, 24)
    assert remote.prefetch_hits > 0
    assert remote.calls <= steps + 2      # about one call per step, made while results travel
