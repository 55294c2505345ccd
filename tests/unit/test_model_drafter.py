"""The model drafter: exact output, KV in step with commits, constant-size KV, budgets, sampling.

Target: the tiny random Llama (vocab 128). Drafts: the target itself (a perfect draft: with full
attention every drafted chain token must be accepted, which only holds if the drafter's KV matches
the committed text after every step) and another random model with a sliding window.
"""
from __future__ import annotations

import functools
import zlib

import numpy as np
import pytest
import torch

from tests.conftest import tiny_llama
from tests.helpers import DeviceAudit, device_generic, hf_greedy
from tests.unit.test_engine import prompts
from tests.unit.test_sampling_distribution import g_test_pvalue
from workers.speculation.acceptance import accept_sampling, warp
from workers.contract import SamplingParams
from workers.drafters.neural.draft_model import DraftSpec, sparse_mask
from workers.contract import DraftContext, TreeBudget
from workers.drafters.model import MAX_TREE_ROWS, PREFILL_CHUNK, ModelDrafter
from scheduler.generation import Engine, GenerationRequest
from workers.model.llama_forward import LlamaForward
from workers.speculation.tree import depths
from workers.speculation.verifier import Verifier

EOS = 2
MAX_NEW = 32
N = 5


@pytest.fixture(scope="module")
def forward(tiny_model):
    return LlamaForward(tiny_model)


@pytest.fixture(scope="module")
def other_model():
    return tiny_llama(1)


@pytest.fixture(scope="module")
def references(tiny_model):
    return [hf_greedy(tiny_model, p, MAX_NEW, eos=EOS) for p in prompts(N)]


def generate(forward, drafter, budget=TreeBudget(8, 4), sampling=SamplingParams()):
    reqs = [GenerationRequest(f"r{i}", tuple(p), MAX_NEW, sampling, frozenset({EOS}))
            for i, p in enumerate(prompts(N))]
    return Engine(Verifier(forward, max_tree_tokens=16), drafter, budget, adaptive=False).generate(reqs)


@pytest.mark.parametrize("options", [
    {"mode": "dynamic"}, {"mode": "dynamic", "width": 1, "top_k": 2}, {"mode": "widths", "widths": (3, 2, 1)},
    {"sample": True}], ids=["dynamic", "narrow", "widths", "sample"])
@pytest.mark.parametrize("window", [None, 8])
def test_greedy_output_is_identical_whatever_the_draft(forward, other_model, references, options, window):
    drafter = ModelDrafter(LlamaForward(other_model), DraftSpec(sink=2, window=window), **options)
    results = generate(forward, drafter)
    assert [r.token_ids for r in results] == references
    assert sum(r.drafted for r in results) > 0


def test_a_perfect_draft_has_every_chain_token_accepted(forward, references):
    """The target as its own draft, full attention, a chain: all accepted, every step. Any drift of
    the drafter's KV from the committed text (a stale root, a tree row left behind, a wrong
    position) makes some draft token differ from the target's argmax."""
    drafter = ModelDrafter(forward, DraftSpec(), top_k=1, width=1)
    results = generate(forward, drafter, budget=TreeBudget(4, 4))
    assert [r.token_ids for r in results] == references
    drafted = sum(r.drafted for r in results)
    assert drafted > 50 and sum(r.accepted for r in results) == drafted


def test_incremental_kv_equals_the_training_forward_with_the_sparse_mask(forward, other_model):
    """After a generation's worth of commits, the drafter's logits at the root equal a one-shot
    transformers forward over the whole context with `sparse_mask`: what distillation trains."""
    spec = DraftSpec(sink=3, window=10)
    drafter = ModelDrafter(LlamaForward(other_model), spec, top_k=1, width=1)
    rng = np.random.default_rng(5)
    context = list(rng.integers(3, 128, size=40))
    for _ in range(6):  # steps committing 1-4 tokens, the tree thrown away each time
        drafter.propose(DraftContext("a", "t", context, 40), TreeBudget(4, 4))
        context += list(rng.integers(3, 128, size=int(rng.integers(1, 5))))
    drafter.propose(DraftContext("a", "t", context, 40), TreeBudget(1, 1))
    got = drafter._states["a"].root_logits
    n = len(context)
    mask = sparse_mask(torch.arange(n), torch.arange(n), spec.sink, spec.window)[None, None]
    with torch.no_grad():
        want = other_model(input_ids=torch.tensor([context]), attention_mask=mask).logits[0, -1]
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    # And the window matters: full attention gives other logits.
    with torch.no_grad():
        full = other_model(input_ids=torch.tensor([context])).logits[0, -1]
    assert (full - want).abs().max() > 1e-2


def test_windowed_kv_stays_constant_size(forward, other_model):
    spec = DraftSpec(sink=4, window=16)
    drafter = ModelDrafter(LlamaForward(other_model), spec)
    context = list(np.random.default_rng(0).integers(3, 128, size=300))   # longer than a prefill chunk
    lengths = []
    for step in range(40):
        drafter.propose(DraftContext("a", "t", context, 300), TreeBudget(8, 4))
        lengths.append(drafter.kv_length("a"))
        context.append(int(step % 100) + 3)
    cap = drafter._states["a"].kv.cache.capacity
    assert cap == spec.sink + spec.window + PREFILL_CHUNK + MAX_TREE_ROWS
    assert max(lengths[1:]) <= spec.sink + spec.window + MAX_TREE_ROWS
    drafter.release("a")
    assert drafter.kv_length("a") == 0


@pytest.mark.parametrize("options", [{"mode": "dynamic"}, {"mode": "widths", "widths": (4, 3, 2)}, {"sample": True}])
@pytest.mark.parametrize("budget", [TreeBudget(1, 1), TreeBudget(3, 8), TreeBudget(12, 3), TreeBudget(20, 6)])
def test_trees_respect_the_budget(other_model, options, budget):
    drafter = ModelDrafter(LlamaForward(other_model), DraftSpec(sink=2, window=32), **options)
    tree = drafter.propose(DraftContext("a", "t", prompts(1)[0] + [5, 6], 2), budget)
    assert 1 <= len(tree) <= budget.max_nodes
    assert max(depths(tree)) <= budget.max_depth
    if options.get("sample"):
        assert tree.draft_probs is not None and all(q is not None for q in tree.draft_probs)
        assert all(p < i for i, p in enumerate(tree.parents))      # a chain
    else:
        assert tree.draft_probs is None


def test_dynamic_trees_hold_the_most_likely_nodes(other_model):
    """EAGLE-2's re-ranking: with a budget smaller than what was drafted, the kept nodes are the
    most likely ones by cumulative draft probability, so a flat draft goes wide, not deep."""
    drafter = ModelDrafter(LlamaForward(other_model), DraftSpec(), top_k=4, width=4)
    ctx = DraftContext("a", "t", prompts(1)[0] + [5], 1)
    wide = drafter.propose(ctx, TreeBudget(6, 6))
    root = torch.log_softmax(drafter._states["a"].root_logits, -1)
    first = [t for t, p in zip(wide.tokens, wide.parents) if p == -1]
    assert set(first) <= set(torch.topk(root, 4).indices.tolist())
    assert len(first) >= 2            # a random draft is unsure: the tree branches at the root


# --- sampling: drafts drawn from q, carried as draft_probs, keep the target's distribution ---------

TRIALS = 1_500
PARAMS = SamplingParams(temperature=1.0)


@pytest.fixture(scope="module")
def sampling_setup(tiny_model, other_model):
    prompt = prompts(3)[2]
    forward = LlamaForward(tiny_model)

    @functools.lru_cache(maxsize=None)
    def target_probs(prefix: tuple[int, ...]) -> np.ndarray:
        with torch.no_grad():
            logits = tiny_model(input_ids=torch.tensor([list(prefix)])).logits[0, -1]
        return warp(logits.double().numpy(), PARAMS)

    return prompt, forward, target_probs, LlamaForward(other_model)


def _first_tokens(setup, keep_q: bool) -> np.ndarray:
    prompt, _, target_probs, draft_forward = setup
    drafter = ModelDrafter(draft_forward, DraftSpec(), sample=True, seed=1)
    rng = np.random.default_rng(zlib.crc32(b"first tokens"))
    counts = np.zeros(128)
    accepted = 0
    for t in range(TRIALS):
        tree = drafter.propose(DraftContext(f"t{t}", "x", prompt, len(prompt)), TreeBudget(2, 2))
        drafter.release(f"t{t}")
        if not keep_q:  # the bug this test exists for: a sampled draft treated as deterministic
            tree = type(tree)(tree.tokens, tree.parents)

        def probs(row: int) -> np.ndarray:
            path = []
            node = row - 1
            while node >= 0:
                path.append(tree.tokens[node])
                node = tree.parents[node]
            return target_probs(tuple(prompt) + tuple(reversed(path)))

        a = accept_sampling(tree, probs, rng)
        counts[a.tokens[0]] += 1
        accepted += a.accepted > 0
    return counts, accepted


def test_sampled_drafts_keep_the_target_distribution(sampling_setup):
    prompt, _, target_probs, _ = sampling_setup
    counts, accepted = _first_tokens(sampling_setup, keep_q=True)
    assert accepted > TRIALS // 10, "drafts must be accepted often for the test to mean anything"
    assert g_test_pvalue(counts, target_probs(tuple(prompt))) > 1e-3


def test_carrying_q_is_what_makes_sampled_drafts_pay(sampling_setup):
    """Without q a drawn token is accepted with p(x) (one-hot q: still exact, but rarely); with q,
    with min(1, p(x) / q(x)), which is the point of sending q along."""
    _, with_q = _first_tokens(sampling_setup, keep_q=True)
    _, without_q = _first_tokens(sampling_setup, keep_q=False)
    assert with_q > 1.5 * without_q, (with_q, without_q)


# --- device: what the drafter builds lives where its forward runs ---------------------------------

DRAFT_CODE = ("workers/drafters/model.py", "workers/drafters/neural/draft_model.py", "workers/model/llama_forward.py",
              "workers/model/packed_attention.py",
              "workers/model/batched_attention.py")


@pytest.mark.parametrize("options,attention", [({"mode": "dynamic"}, "loop"),
                                               ({"mode": "widths", "widths": (3, 2, 1)}, "padded"),
                                               ({"sample": True}, "padded")], ids=["dynamic", "widths", "sample"])
def test_the_draft_builds_on_its_device_and_reads_to_the_host_once_a_pass(forward, other_model, references,
                                                                          options, attention):
    """The device-generic forward (what a GPU runs; its requests attended one call each, or
    batched): every tensor the drafter, its KV and its forward create names the draft's device,
    and the values the tree needs come to the host in one read per forward pass, whatever the
    tree shape; output stays the target's greedy."""
    draft = device_generic(other_model, windowed=False, attention=attention)
    drafter = ModelDrafter(draft, DraftSpec(sink=2, window=8), **options)
    audit, passes = DeviceAudit(*DRAFT_CODE), 0
    forward_pass, propose = draft.forward, drafter.propose_batch

    def counted(*args, **kw):
        nonlocal passes
        passes += 1
        return forward_pass(*args, **kw)

    def audited(*args, **kw):     # the drafter's calls only: the verifier reads its own step
        with audit:
            return propose(*args, **kw)

    draft.forward, drafter.propose_batch = counted, audited
    results = generate(forward, drafter)
    assert [r.token_ids for r in results] == references
    assert sum(r.drafted for r in results) > 0 and audit.made
    assert audit.off_device(drafter.device) == []
    assert 0 < len(audit.reads) <= passes, (len(audit.reads), passes, audit.reads[:10])


def test_model_drafters_follow_the_verifiers_device(tmp_path, tiny_model):
    """A BatchWorker creates model drafters, alone or in a merge, on its verifier's device; a
    drafter loaded on its own takes 'auto'; a GPU asked for where there is none is refused."""
    from tests.helpers import tiny_model_dir
    from tools.draft_build import build_draft
    from workers.batch_worker import BatchWorker
    from workers.drafters.registry import create_drafter

    target = tiny_model_dir(tmp_path / "target")
    out = build_draft(str(target), tmp_path / "draft", layers="last1", sink=2, window=16, progress=False)
    worker = BatchWorker(Verifier(LlamaForward(tiny_model)))
    alone = worker.drafter(str(out))
    merged = worker.drafter(f"merge:ngram+{out}")
    assert alone.device == tiny_model.device == merged.drafters[1].device
    alone.propose(DraftContext("r", "t", [5, 6, 7, 8], 4), TreeBudget(4, 2))
    kv = alone._states["r"].kv
    assert kv.cache.k.device == kv.pos.device == alone.forward.embed.device == tiny_model.device
    assert create_drafter(str(out)).device.type == ("cuda" if torch.cuda.is_available() else "cpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="sees no CUDA GPU"):
            create_drafter(str(out), device="cuda")


def test_a_prompts_catch_up_is_left_out_of_the_drafting_time_per_level(forward, other_model):
    """The first tree of a request also feeds the draft its whole prompt; that one-off is
    `catch_up_s`, and the worker reports the tree's drafting time without it (the planner sizes
    trees by that time per level). A later step feeds only what the last step committed, no
    one-off. A merge sums its parts' one-offs."""
    from workers.batch_worker import BatchWorker
    from workers.contract import WorkItem
    from workers.drafters.merge import MergeDrafter
    from workers.drafters.ngram import NgramDrafter

    drafter = ModelDrafter(LlamaForward(other_model), DraftSpec(sink=2, window=64), name="m")
    worker = BatchWorker(Verifier(forward, max_tree_tokens=8), drafters={"m": drafter})
    prompt = [int(t) for t in torch.randint(3, 128, (300,), generator=torch.Generator().manual_seed(0))]
    worker.prefill("r", prompt, prompt_len=len(prompt), sampling=SamplingParams(), max_new_tokens=16, drafter="m")
    before = worker.draft_s
    (first,) = worker.step([WorkItem("r", TreeBudget(2, 2))])
    spent = worker.draft_s - before
    assert drafter.catch_up_s > 0.5 * spent        # 300 prompt rows against 2 one-row levels
    assert 0 < first.draft_s <= spent - drafter.catch_up_s + 1e-6
    (second,) = worker.step([WorkItem("r", TreeBudget(2, 2))])
    assert drafter.catch_up_s == 0.0 and second.draft_s > 0

    merged = MergeDrafter([ModelDrafter(LlamaForward(other_model), DraftSpec(sink=2, window=64), name="m2"),
                           NgramDrafter()])
    ctx = DraftContext("q", "t", prompt, len(prompt))
    merged.propose_batch([(ctx, TreeBudget(2, 2))])
    assert merged.catch_up_s == merged.drafters[0].catch_up_s > 0
