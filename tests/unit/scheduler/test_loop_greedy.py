"""Greedy output through the step loop, on a tiny random-weight Llama and the real verifier, is
token-identical to plain greedy (transformers `generate`) whatever the policy, batch size, drafter
and preemption or eviction in between; seeded sampling is the same however the request is batched."""
from __future__ import annotations

import numpy as np
import pytest

from scheduler.sizing import SizingConfig
from scheduler.loop import Delta, StepLoop
from scheduler.policies import make_policy
from scheduler.request import Request, RequestStats
from tests.helpers import OracleDrafter, hf_greedy
from workers.contract import SamplingParams
from workers.batch_worker import BatchWorker
from workers.drafters.registry import create_drafter
from workers.model.llama_forward import LlamaForward
from workers.speculation.verifier import Verifier

EOS = 2
VOCAB = 128


def prompts(n: int = 6, seed: int = 3) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        length = int(rng.integers(2, 40))
        motif = rng.integers(3, VOCAB, size=int(rng.integers(2, 6))).tolist()
        out.append((motif * 20)[:length] if i % 2 else rng.integers(3, VOCAB, size=length).tolist())
    return out


MAX_NEW = [12, 30, 7, 25, 18, 30]


@pytest.fixture(scope="module")
def forward(tiny_model):
    return LlamaForward(tiny_model)


@pytest.fixture(scope="module")
def references(tiny_model):
    return [hf_greedy(tiny_model, p, n, eos=EOS) for p, n in zip(prompts(), MAX_NEW)]


def serve(forward, policy, max_batch, drafters, *, max_resident, sampling=SamplingParams(),
          drafter_of=lambda i: None, only=None, chunk=0, prefix_cache=None, kv_budget=None):
    verifier = Verifier(forward, max_tree_tokens=16, prefix_cache=prefix_cache, kv_block=8)
    worker = BatchWorker(verifier, default_drafter=next(iter(drafters)), drafters=drafters)
    pol = make_policy(policy, max_batch=max_batch, token_budget=48,
                      sizing=SizingConfig(max_tree_tokens=12, max_depth=6), aging_bound_s=None,
                      prefill_chunk_tokens=chunk, kv_budget_tokens=kv_budget, kv_block=8,
                      kv_tree_tokens=17)
    loop = StepLoop(pol, worker, max_resident=max_resident)
    out: dict[str, list[int]] = {}

    def sink(event):
        if isinstance(event, Delta):
            out.setdefault(event.request_id, []).extend(event.token_ids)

    for i, (p, n) in enumerate(zip(prompts(), MAX_NEW)):
        if only is not None and i not in only:
            continue
        stats = RequestStats(f"r{i}", "t", float(i), prompt_len=len(p), max_tokens=n)
        loop.submit(Request(stats, list(p), sampling, stop_token_ids=(EOS,), drafter=drafter_of(i)), sink)
    while loop.step():
        pass
    assert worker.resident() == []
    return out


@pytest.mark.parametrize("policy,max_batch,max_resident", [
    ("fcfs", 1, 1), ("fcfs", 4, 4), ("sjf", 2, 3), ("las", 2, 2), ("las", 3, 6), ("laps", 2, 3),
    ("laps", 6, 6)])
@pytest.mark.parametrize("drafter", ["ngram", "oracle"])
def test_greedy_through_the_loop_is_plain_greedy(forward, references, policy, max_batch, max_resident,
                                                 drafter):
    if drafter == "oracle":
        truth = {f"r{i}": ref for i, ref in enumerate(references)}
        drafters = {"oracle": OracleDrafter(truth, VOCAB, "mixed", seed=max_batch),
                    "none": create_drafter("none")}
    else:
        drafters = {"ngram": create_drafter("ngram"), "none": create_drafter("none")}
    # Every third request turns speculation off, so batches mix trees and plain rows.
    out = serve(forward, policy, max_batch, drafters, max_resident=max_resident,
                drafter_of=lambda i: "none" if i % 3 == 2 else None)
    for i, ref in enumerate(references):
        assert out[f"r{i}"] == ref, f"request r{i} differs under {policy}, batch {max_batch}"


def test_seeded_sampling_does_not_depend_on_batching_or_eviction(forward):
    drafters = lambda: {"ngram": create_drafter("ngram")}          # noqa: E731
    sampling = SamplingParams(temperature=0.9, top_k=20, seed=7)
    alone = {}
    for i in range(len(MAX_NEW)):
        alone.update(serve(forward, "fcfs", 1, drafters(), max_resident=1, sampling=sampling, only={i}))
    batched = serve(forward, "las", 3, drafters(), max_resident=3, sampling=sampling)
    assert batched == alone
    assert len({tuple(v) for v in alone.values()}) == len(alone)   # not all the same text


@pytest.mark.parametrize("policy,max_batch,max_resident,chunk", [
    ("fcfs", 4, 4, 1), ("fcfs", 2, 2, 7), ("las", 2, 2, 16), ("las", 3, 6, 5), ("laps", 2, 3, 64),
    ("sjf", 3, 3, 3)])
def test_greedy_with_chunked_prefill_is_plain_greedy(forward, references, policy, max_batch,
                                                     max_resident, chunk):
    """Chunks of every size, beside trees, through preemption (las) and eviction (max_resident
    at a batch), with prefix-cache hits (the odd prompts repeat a motif): plain greedy."""
    from workers.model.prefix_cache import PrefixCache

    truth = {f"r{i}": ref for i, ref in enumerate(references)}
    drafters = {"oracle": OracleDrafter(truth, VOCAB, "mixed", seed=max_batch),
                "none": create_drafter("none")}
    out = serve(forward, policy, max_batch, drafters, max_resident=max_resident, chunk=chunk,
                drafter_of=lambda i: "none" if i % 3 == 2 else None, prefix_cache=PrefixCache(64, block=4))
    for i, ref in enumerate(references):
        assert out[f"r{i}"] == ref, f"request r{i} differs with chunks of {chunk} under {policy}"


def test_seeded_sampling_is_the_same_with_chunked_prefill(forward):
    """Without drafts (chunks shrink the trees a step can afford, and a different tree draws
    differently): each position's draw is the same whether its context came whole or in chunks."""
    sampling = SamplingParams(temperature=0.9, top_k=20, seed=7)
    whole = serve(forward, "las", 3, {"none": create_drafter("none")}, max_resident=3, sampling=sampling)
    chunked = serve(forward, "las", 3, {"none": create_drafter("none")}, max_resident=3,
                    sampling=sampling, chunk=6)
    assert chunked == whole


@pytest.mark.parametrize("policy,chunk", [("fcfs", 0), ("las", 0), ("las", 5), ("laps", 16)])
def test_greedy_under_a_tight_kv_budget_is_plain_greedy(forward, references, policy, chunk):
    """A budget of about two requests' KV: starts wait, growing requests are preempted and
    re-prefilled (KV blocks of 8, so caches grow often), and the output is plain greedy."""
    from workers.model.prefix_cache import PrefixCache

    truth = {f"r{i}": ref for i, ref in enumerate(references)}
    drafters = {"oracle": OracleDrafter(truth, VOCAB, "mixed", seed=2)}
    out = serve(forward, policy, 3, drafters, max_resident=6, chunk=chunk, kv_budget=150,
                prefix_cache=PrefixCache(64, block=4))
    for i, ref in enumerate(references):
        assert out[f"r{i}"] == ref, f"request r{i} differs under a KV budget ({policy}, chunks {chunk})"
