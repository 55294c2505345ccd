"""Feedback memory (SPIRe): shapes, that the draft's logits read the memory, that k-step training
computes what drafting computes, that the verifier's taps are the target's own activations and
reach the drafter, greedy exactness, and a draft state constant in the context's length.

Target: a tiny random Llama of 4 blocks; draft: its blocks 0 and 1 with memory from the
target's blocks 1 and 3 (what `specgate draft build --memory` makes, at tiny scale).
"""
from __future__ import annotations

import functools

import pytest
import torch

from scheduler.generation import Engine, GenerationRequest
from tests.conftest import tiny_llama
from tests.helpers import hf_greedy
from tests.unit.test_engine import prompts
from tools.draft_build import prune
from workers.contract import DraftContext, SamplingParams, TapSpec, TreeBudget
from workers.drafters.neural.draft_memory import GATE_OFF, MemoryDraft, default_memory_layers, memory_masks
from workers.drafters.neural.draft_model import DraftSpec, SparseKV, sparse_mask
from workers.drafters.memory import MemoryDrafter
from workers.drafters.model import MAX_TREE_ROWS, PREFILL_CHUNK
from workers.model.llama_forward import LlamaForward, Segment
from workers.drafters.neural.memory_forward import MemoryForward
from workers.speculation.target_taps import gather, pack, unpack
from workers.speculation.verifier import Verifier

EOS = 2
MEMORY_LAYERS = (1, 3)


@pytest.fixture(scope="module")
def target():
    return tiny_llama(3, layers=4, max_positions=4608)


@functools.lru_cache(maxsize=None)
def _draft(sink: int, window: int | None, seed: int = 0) -> MemoryDraft:
    model = tiny_llama(3, layers=4, max_positions=4608)
    spec = DraftSpec(sink=sink, window=window, source_layers=(0, 1), memory_layers=MEMORY_LAYERS)
    torch.manual_seed(seed)
    return MemoryDraft(prune(model, (0, 1)), spec, torch.randn(2, 3))   # a mix that is not uniform


def target_taps(target, ids: torch.Tensor) -> torch.Tensor:
    """The target's taps [B, T, S, H] from transformers (the reference): the embedding, then the
    outputs of MEMORY_LAYERS' blocks (hooked: transformers' last hidden state is normed)."""
    seen: dict[int, torch.Tensor] = {}
    hooks = [target.model.layers[li].register_forward_hook(
        lambda mod, args, out, li=li: seen.__setitem__(li, out[0] if isinstance(out, tuple) else out))
        for li in MEMORY_LAYERS]
    try:
        with torch.no_grad():
            hs = target(input_ids=ids, output_hidden_states=True).hidden_states
    finally:
        for h in hooks:
            h.remove()
    return torch.stack([hs[0]] + [seen[li] for li in MEMORY_LAYERS], dim=2)


def test_default_memory_layers_spread_to_the_last_block():
    assert default_memory_layers(30, 3) == (9, 19, 29)
    assert default_memory_layers(4, 2) == (1, 3)
    assert default_memory_layers(30, 1) == (29,)


def test_a_memory_draft_needs_one_memory_layer_per_block():
    with pytest.raises(ValueError, match="one memory layer per block"):
        MemoryDraft(prune(tiny_llama(3, layers=4), (0, 1)), DraftSpec(memory_layers=(3,)))


def test_shapes_and_the_logits_read_the_memory(target):
    draft = _draft(0, None)
    ids = torch.randint(3, 128, (2, 12))
    taps = target_taps(target, ids)
    assert taps.shape == (2, 12, 3, 64)
    assert draft.memory(0, taps).shape == (2, 12, 64)
    with torch.no_grad():
        logits = draft.train_logits(ids, taps, k=1)
        assert logits.shape == (2, 12, 128)
        other = taps.clone()
        other[:, 5] += torch.randn_like(other[:, 5])        # the target's state at position 5 only
        changed = draft.train_logits(ids, other, k=1)
    diff = (logits - changed).abs().amax(dim=(0, 2))         # [T]
    assert torch.all(diff[:6] == 0)                          # rows <= 5 read no memory at 5
    assert torch.all(diff[6:] > 1e-4)                        # every later row does


@pytest.mark.parametrize("window", [None, 4])
def test_a_closed_gate_leaves_the_pruned_draft_as_it_was(target, window):
    """Gates shut: the memory draft's logits are the pruned draft's own under its sink + window
    mask; at GATE_OFF (how `draft build --memory` starts) they stay close to them; open, not."""
    model = prune(tiny_llama(3, layers=4, max_positions=4608), (0, 1))
    spec = DraftSpec(sink=1, window=window, source_layers=(0, 1), memory_layers=MEMORY_LAYERS)
    ids = torch.randint(3, 128, (1, 14))
    taps = target_taps(target, ids)
    pos = torch.arange(14)
    with torch.no_grad():
        plain = model(input_ids=ids, attention_mask=sparse_mask(pos, pos, 1, window)[None, None]).logits
        shut = MemoryDraft(model, spec, gate=torch.full((2,), -1e4)).train_logits(ids, taps, k=2)
        start = MemoryDraft(model, spec).train_logits(ids, taps, k=2)
        assert float(MemoryDraft(model, spec).gate.max()) == GATE_OFF
        opened = MemoryDraft(model, spec, gate=torch.zeros(2)).train_logits(ids, taps, k=2)
    torch.testing.assert_close(shut, plain, atol=1e-5, rtol=1e-4)
    assert (start - plain).abs().max() < 0.1 * (opened - plain).abs().max()


def test_memory_masks_follow_the_window():
    m = memory_masks(6, 3, 1, 2)
    visible = lambda name: (m[name] == 0).int().tolist()[4]   # noqa: E731
    # row 4 (block start 3, sink 1, window 2): of what precedes its block, the sink only
    assert visible("context") == [1, 0, 0, 0, 0, 0]
    assert visible("target") == [1, 0, 0, 0, 0, 0]
    assert visible("block") == [0, 0, 0, 1, 1, 0]
    assert visible("own") == [0, 0, 0, 1, 0, 0]
    assert visible("first") == [1, 0, 0, 1, 0, 0]


@pytest.mark.parametrize("k", [1, 2, 3])
@pytest.mark.parametrize("window", [None, 4])
def test_k_step_training_computes_what_drafting_computes(target, k, window):
    """Training's k passes against drafting, done the slow way: for every block start j, feed
    the prefix [0, j) with the target's taps, then draft rows j .. j+k-1 one pass each (their
    memory the draft's own), as `ModelDrafter` grows a chain from a root at j."""
    draft = _draft(1, window)
    fwd = MemoryForward(draft)
    t = 11
    ids = torch.randint(3, 128, (1, t))
    taps = target_taps(target, ids)
    with torch.no_grad():
        trained = draft.train_logits(ids, taps, k=k)[0]                                # [T, V]
    spec = draft.spec
    for j in range(0, t, k):
        kv = SparseKV(fwd.new_cache, spec, 16)
        rows = [(range(0, j), True)] if j else []
        rows += [(range(q, q + 1), False) for q in range(j, min(j + k, t))]
        for span, known in rows:
            pos = torch.tensor(list(span))
            kv.make_room(len(pos), int(pos[0]))
            seg = Segment(kv.cache, 0, len(pos), sparse_mask(pos, pos, spec.sink, spec.window), kv.past_mask(pos))
            logits = fwd.forward(ids[0, pos], pos, [seg], torch.arange(len(pos)), taps[0, pos],
                                 torch.full((len(pos),), known))
            kv.append(pos)
            if not known:
                torch.testing.assert_close(logits[0], trained[int(pos[0])], atol=2e-5, rtol=1e-4)


def test_k_step_gradients_match_a_rollout_per_prefix(target):
    """The loss's gradient of k-step training equals the one of a rollout per block start (the
    expensive full training), on a short sequence."""
    draft = _draft(0, None, seed=1)
    ids = torch.randint(3, 128, (1, 6))
    taps = target_taps(target, ids)
    k = 2
    draft.zero_grad()
    draft.train_logits(ids, taps, k=k).logsumexp(-1).sum().backward()
    cheap = draft.mix.grad.clone(), draft.gate.grad.clone()
    assert bool(cheap[1].abs().gt(0).all())                  # every block's gate gets a gradient
    draft.zero_grad()
    total = 0
    for j in range(0, 6, k):     # prefix up to j + k, training k-step with one block: rows j..j+k-1
        sub = draft.train_logits(ids[:, : j + k], taps[:, : j + k], k=j + k if j == 0 else k)
        total = total + sub[:, j: j + k].logsumexp(-1).sum()
    total.backward()
    torch.testing.assert_close(cheap, (draft.mix.grad, draft.gate.grad), atol=1e-5, rtol=1e-4)
    draft.zero_grad()


def test_verifier_taps_are_the_targets_activations(target):
    """Prefill and step taps against transformers' hidden states, at the committed positions."""
    forward = LlamaForward(target)
    spec = TapSpec(MEMORY_LAYERS)
    verifier = Verifier(forward, taps=spec)
    prompt = prompts(3)[2]
    done = verifier.prefill("r", prompt, SamplingParams(), 8)
    pos, values = unpack(done.taps)
    assert pos == list(range(len(prompt) - 1))               # every context token; not the root
    ref = target_taps(target, torch.tensor([prompt]))[0]
    torch.testing.assert_close(values, ref[: len(prompt) - 1], atol=1e-4, rtol=1e-4)
    from workers.speculation.verifier import VerifyItem
    from workers.speculation.tree import TokenTree
    (res,) = verifier.verify([VerifyItem("r", TokenTree.empty())])
    pos, values = unpack(res.taps)
    assert pos == [len(prompt) - 1]                          # the root this step read
    torch.testing.assert_close(values[0], ref[len(prompt) - 1], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("layers", [MEMORY_LAYERS, (0,), (2,), (0, 1, 2, 3)], ids=str)
def test_taps_on_the_decoder_stack_equal_the_layer_loop(target, layers):
    """A step that returns taps runs the one-call decoder stack in pieces: the same logits, taps
    and KV as the per-layer loop, for a prefill (no logits) and a step after it."""
    stacked, loop = LlamaForward(target), LlamaForward(target)
    if stacked._stack is None:
        pytest.skip("the decoder stack does not serve this model on this machine")
    loop._stack = None
    ids = torch.tensor(prompts(3)[2][:14])
    results = []
    for fwd in (stacked, loop):
        cache = fwd.new_cache(32)
        causal = lambda n: torch.full((n, n), float("-inf")).triu(1)         # noqa: E731
        first = fwd.forward_taps(ids[:11], torch.arange(11), [Segment(cache, 0, 11, causal(11))], None, layers)
        cache.length = 11
        step = fwd.forward_taps(ids[11:], torch.arange(11, 14), [Segment(cache, 0, 3, causal(3))],
                                torch.arange(3), layers)
        results.append((first[2], step[0], step[2], cache.k[:, :, :14].clone(), cache.v[:, :, :14].clone()))
    assert layers in stacked._tap_pieces and not loop._tap_pieces      # the stack ran; the loop did not
    assert results[0][0].shape == (11, len(layers) + 1, 64)
    for got, want in zip(*results):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_taps_are_bounded_by_the_window():
    spec = TapSpec((0,), sink=2, window=3)
    vals = torch.arange(10 * 2 * 1, dtype=torch.float32).view(10, 2, 1)
    both = gather([pack(range(5), vals[:5]), None, pack(range(5, 10), vals[5:])], spec)
    pos, got = unpack(both)
    assert pos == [0, 1, 7, 8, 9]
    assert torch.equal(got, vals[[0, 1, 7, 8, 9]])
    lone = pack(range(5, 10), vals[5:])
    assert gather([lone], spec) is lone and gather([], spec) is None


def test_a_request_given_no_drafts_keeps_its_taps_in_bounded_chunks(target):
    """The worker keeps a step's taps as they came until the drafter drafts (no re-packing of
    the whole window every step), gathers them once there are TAP_CHUNKS, and hands the drafter
    exactly the rows it can read."""
    from workers.batch_worker import TAP_CHUNKS, BatchWorker
    from workers.contract import WorkItem

    worker = BatchWorker(Verifier(LlamaForward(target), max_tree_tokens=16), default_drafter="memory")
    worker._drafters["memory"] = _drafter(window=8, sink=2)
    prompt = prompts(3)[2]
    worker.prefill("r", prompt, prompt_len=len(prompt), sampling=SamplingParams(), max_new_tokens=80)
    res = worker._resident["r"]
    for n in range(TAP_CHUNKS + 3):
        worker.step([WorkItem("r", TreeBudget(0, 0))])       # the planner gives it no drafts
        assert len(res.taps) <= TAP_CHUNKS
    pos, _ = unpack(res.draft_context("r").taps)
    newest = len(res.context) - 1
    assert pos == [p for p in range(newest) if p < 2 or newest - p < 8]


def _drafter(window=None, sink=0):
    draft = _draft(sink, window)
    return MemoryDrafter(MemoryForward(draft), draft.spec, name="memory")


@pytest.mark.parametrize("merged", [False, True], ids=["alone", "merged-with-ngram"])
def test_greedy_output_is_identical_with_a_memory_draft(target, merged):
    from workers.drafters.merge import MergeDrafter
    from workers.drafters.ngram import NgramDrafter

    forward = LlamaForward(target)
    drafter = _drafter(window=8, sink=2)
    if merged:
        drafter = MergeDrafter([drafter, NgramDrafter()])
        assert drafter.target_taps == TapSpec(MEMORY_LAYERS, 2, 8)
    reqs = [GenerationRequest(f"r{i}", tuple(p), 24, SamplingParams(), frozenset({EOS}))
            for i, p in enumerate(prompts(4))]
    out = Engine(Verifier(forward, max_tree_tokens=16), drafter, TreeBudget(8, 4), adaptive=False).generate(reqs)
    for res, p in zip(out, prompts(4)):
        assert res.token_ids == hf_greedy(target, p, 24, eos=EOS)
    assert sum(r.drafted for r in out) > 0


def test_the_drafter_reads_the_taps_it_is_handed(target):
    """Same context, with and without the target's taps: the root's draft logits differ, and
    the taps handed later replace the root's own memory (later roots see it)."""
    forward = LlamaForward(target)
    verifier = Verifier(forward, taps=TapSpec(MEMORY_LAYERS))
    prompt = prompts(3)[2]
    done = verifier.prefill("r", prompt, SamplingParams(), 8)
    with_taps, without = _drafter(), _drafter()
    budget = TreeBudget(4, 2)
    with_taps.propose(DraftContext("r", "t", prompt, len(prompt), taps=done.taps), budget)
    without.propose(DraftContext("r", "t", prompt, len(prompt)), budget)
    a, b = with_taps._states["r"].root_logits, without._states["r"].root_logits
    assert not torch.allclose(a, b)
    assert with_taps.taps_held("r") == len(prompt) - 1


@pytest.mark.parametrize("sink,window", [(4, 64)])
def test_draft_kv_and_taps_are_constant_in_context_length(target, sink, window):
    """A request's draft KV slots and kept taps after a 1k- and a 4k-token context: the same."""
    forward = LlamaForward(target)
    held = {}
    for n in (1024, 4096):
        verifier = Verifier(forward, taps=TapSpec(MEMORY_LAYERS, sink, window))
        prompt = torch.randint(3, 128, (n,), generator=torch.Generator().manual_seed(n)).tolist()
        done = verifier.prefill("r", prompt, SamplingParams(), 4)
        assert len(done.taps.positions) == sink + window - 1    # the root (the newest) has none yet
        drafter = _drafter(window=window, sink=sink)
        drafter.propose(DraftContext("r", "t", prompt, n, taps=done.taps), TreeBudget(8, 4))
        held[n] = (drafter.kv_length("r"), drafter.taps_held("r"), drafter._states["r"].kv.cache.capacity)
    assert held[1024] == held[4096]
    # KV: sink + window and the room for one pass (workers/drafters/neural/draft_model.py SparseKV); taps: sink + window
    assert held[1024][0] <= held[1024][2] == sink + window + PREFILL_CHUNK + MAX_TREE_ROWS
    assert held[1024][1] <= sink + window


def test_the_worker_hands_each_steps_taps_to_the_drafter(target):
    """Prefill's taps reach the drafter with its first proposal, each step's with the next; the
    results that go up to the scheduler carry none."""
    from workers.batch_worker import BatchWorker
    from workers.contract import WorkItem

    drafter = _drafter()
    worker = BatchWorker(Verifier(LlamaForward(target), max_tree_tokens=16), default_drafter="memory",
                         drafters={"memory": drafter})
    prompt = prompts(3)[2]
    done = worker.prefill("r", prompt, prompt_len=len(prompt), sampling=SamplingParams(), max_new_tokens=16)
    assert done.taps is None and worker.verifier.taps == drafter.target_taps
    held = []
    for _ in range(3):
        (res,) = worker.step([WorkItem("r", TreeBudget(4, 3))])
        assert res.taps is None and res.tokens
        held.append(drafter.taps_held("r"))
    # the first proposal had the prompt's context; each later one also the taps of the step before
    context = len(worker._resident["r"].context)
    assert held[0] == len(prompt) - 1 and held[-1] == context - 1 - len(res.tokens)


def test_a_drafter_names_taps_without_loading_it(tmp_path):
    """What a verifier whose drafters run elsewhere (Ray mode) reads to return the taps."""
    from workers.drafters.neural.draft_model import write_spec
    from workers.drafters.registry import taps_of

    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}")
    write_spec(tmp_path / "m", DraftSpec(sink=4, window=32, memory_layers=(1, 3)))
    (tmp_path / "p").mkdir()
    (tmp_path / "p" / "config.json").write_text("{}")
    write_spec(tmp_path / "p", DraftSpec(sink=4, window=32))
    assert taps_of(str(tmp_path / "m")) == TapSpec((1, 3), 4, 32)
    assert taps_of(f"merge:ngram+{tmp_path / 'm'}") == TapSpec((1, 3), 4, 32)
    assert taps_of(str(tmp_path / "p")) is None and taps_of("ngram") is None


def test_taps_round_trip_and_refuse_a_wrong_size():
    from workers.contract import TargetTaps
    from workers.speculation.target_taps import committed_taps

    vals = torch.randn(4, 3, 5)
    pos, back = unpack(pack([7, 8, 9, 10], vals))
    assert pos == [7, 8, 9, 10] and torch.equal(back, vals)
    with pytest.raises(ValueError, match="do not hold"):
        TargetTaps((1, 2), 3, 5, b"\0" * 4 * 3 * 5)
    # sink 1, window 2, newest 6: of positions 0..5 only the sink and 5 can still be read
    kept = committed_taps(TapSpec((0,), 1, 2), range(6), torch.randn(6, 3, 5), 6)
    assert kept.positions == (0, 5)
    assert committed_taps(TapSpec((0,), 0, 1), range(3), torch.randn(3, 3, 5), 9) is None
