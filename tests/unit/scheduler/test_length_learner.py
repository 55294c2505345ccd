"""The length predictor at work (scheduler/length_learner.py): samples at checkpoints, censored
requests as lower bounds, weights through both stores and a restart, the background refit, and the step
loop predicting from a tiny real model's hidden states, with greedy output unchanged."""
from __future__ import annotations

import time
from dataclasses import replace

import numpy as np
import pytest

from scheduler.length_learner import CHECKPOINTS, LengthLearner
from scheduler.loop import Delta, StepLoop
from scheduler.policies import make_policy
from scheduler.request import Request, RequestStats
from scheduler.sizing import SizingConfig
from scheduler.store import MemoryStore
from tests.helpers import hf_greedy
from workers.batch_worker import BatchWorker
from workers.contract import SamplingParams
from workers.model.llama_forward import LlamaForward
from workers.speculation.verifier import Verifier

DIM = 4


def teach(learner: LengthLearner, n: int, rng: np.random.Generator, prefix: str = "r") -> None:
    """n finished requests whose length doubles with feature 0 (samples at arrival only)."""
    for i in range(n):
        f = rng.normal(size=DIM)
        learner.note(f"{prefix}{i}", f, 0)
        learner.finish(f"{prefix}{i}", int(np.exp(4 + np.log(2) * f[0])))


def test_samples_are_kept_at_checkpoints_and_censored_requests_teach_only_news():
    learner = LengthLearner(min_samples=1)
    f = [0.1] * DIM
    for c in range(0, 80):                     # a step at every committed count
        learner.note("a", f, c)
    assert [c for _, c in learner._pending["a"]] == [c for c in CHECKPOINTS if c < 80]
    learner.finish("a", 100)
    assert learner.samples == 3                  # c = 0, 16, 64: remaining 100, 84, 36
    for c in range(300, 320):                  # re-admitted 300 tokens in: one sample, not five
        learner.note("late", f, c)
    assert [c for _, c in learner._pending.pop("late")] == [300]
    learner.note("c", f, 0)
    learner.forget("c")                          # cancelled
    learner.finish("c", 10)
    assert learner.samples == 3

    taught = LengthLearner(min_samples=10)
    teach(taught, 200, np.random.default_rng(5))
    taught.refit()                               # features [0, 0, 0, 0]: about e⁴ ≈ 55 tokens
    zero = [0.0] * DIM
    taught.note("b", zero, 0)
    taught.finish("b", 20, censored=True)        # cut at 20: consistent with ~55, no news
    assert taught.samples == 200
    taught.note("b", zero, 0)
    taught.finish("b", 400, censored=True)       # at least 400: news, counted at 400
    assert taught.samples == 201


def test_cold_start_has_no_belief_then_predicts_after_a_fit():
    rng = np.random.default_rng(0)
    learner = LengthLearner(min_samples=20)
    assert learner.belief([1.0, 0, 0, 0], 0) is None
    teach(learner, 10, rng)
    assert learner.refit() is None and learner.belief([1.0, 0, 0, 0], 0) is None
    teach(learner, 200, rng, "s")
    w = learner.refit()
    assert w is not None and w.samples == 210
    hi, lo = learner.belief([1.0, 0, 0, 0], 0), learner.belief([-1.0, 0, 0, 0], 0)
    assert hi[0] - lo[0] == pytest.approx(2 * np.log(2), abs=0.1) and hi[2] == 0
    assert learner.belief([1.0, 0], 0) is None             # another model's width: no belief


@pytest.mark.parametrize("kind", ["memory", "redis"])
def test_weights_are_shared_through_the_store_and_survive_a_restart(kind, request):
    if kind == "memory":
        store = MemoryStore()
    else:
        from scheduler.store.redis_store import RedisStore
        store = RedisStore.from_url(request.getfixturevalue("redis_url"),
                                    request.getfixturevalue("redis_prefix"))
    rng = np.random.default_rng(1)
    first = LengthLearner(store, name="m", min_samples=10)
    teach(first, 100, rng)
    w = first.refit()
    restarted = LengthLearner(store, name="m", min_samples=10)   # another replica, or a restart
    assert restarted.load() == w
    f = rng.normal(size=DIM)
    assert restarted.belief(f, 5) == first.belief(f, 5)
    assert LengthLearner(store, name="another-model").load() is None
    teach(restarted, 20, rng)                  # its own next fit is numbered after the loaded one
    w2 = restarted.refit()
    assert w2.version > w.version
    assert first.load() == w2                  # and the first replica adopts the newer weights
    stale = LengthLearner(store, name="m", min_samples=10)
    teach(stale, 30, rng)
    assert stale.refit().version == 1          # never loaded: an older version …
    assert LengthLearner(store, name="m").load() == w2      # … does not replace the newer one


def test_the_background_thread_refits_and_saves():
    store = MemoryStore()
    learner = LengthLearner(store, name="m", min_samples=10, refit_every=10, poll_s=0.05)
    learner.start()
    try:
        teach(learner, 40, np.random.default_rng(2))
        deadline = time.monotonic() + 5
        while store.load_model("m") is None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert store.load_model("m") is not None and learner.weights is not None
    finally:
        learner.stop()


# ---- the step loop on a tiny real model -----------------------------------------------------------
EOS = 2


def prompt_of(kind: int, i: int) -> list[int]:
    """Two kinds of prompt the tiny model's hidden states tell apart (see test_length_predictor)."""
    rng = np.random.default_rng(100 + i)
    opening = [5, 5, 5] if kind == 0 else [9, 9, 9]
    return opening + [int(t) for t in rng.integers(10, 120, size=int(rng.integers(3, 8)))]


@pytest.fixture(scope="module")
def trained(tiny_model):
    """A learner taught that kind-0 prompts run long and kind-1 prompts short, from the tiny
    model's own prefill features."""
    lf = LlamaForward(tiny_model)
    v = Verifier(lf, max_tree_tokens=4, features=True)
    learner = LengthLearner(min_samples=10)
    for i in range(60):
        kind, p = i % 2, prompt_of(i % 2, i)
        f = v.prefill("p", p, SamplingParams(), 2).features
        v.release("p")
        learner.note(f"t{i}", f, 0)
        learner.finish(f"t{i}", 200 if kind == 0 else 12)
    assert learner.refit() is not None
    return lf, learner


def serve(lf, learner, policy: str, prompts: list[list[int]], max_new: int, *, max_batch=1,
          max_resident=8):
    worker = BatchWorker(Verifier(lf, max_tree_tokens=8, features=learner is not None))
    pol = make_policy(policy, max_batch=max_batch, token_budget=16,
                      sizing=SizingConfig(max_tree_tokens=4, max_depth=4), aging_bound_s=None)
    loop = StepLoop(pol, worker, lengths=learner, max_resident=max_resident)
    out: dict[str, list[int]] = {}
    order: list[str] = []

    def sink(event):
        if isinstance(event, Delta):
            if event.request_id not in out:
                order.append(event.request_id)
            out.setdefault(event.request_id, []).extend(event.token_ids)

    stats = []
    for i, p in enumerate(prompts):
        s = RequestStats(f"r{i}", "t", float(i), prompt_len=len(p), max_tokens=max_new)
        stats.append(s)
        loop.submit(Request(s, list(p), SamplingParams(), stop_token_ids=(EOS,)), sink)
    loop._apply_inbox()                        # admitted: prefilled on arrival, predicted
    arrival = [s.predicted_len for s in stats]
    beliefs: list[tuple] = []
    while loop.step():
        beliefs += [s.length_belief for s in stats if s.n_steps and s.length_belief]
    return out, order, arrival, beliefs, worker


def test_the_loop_predicts_on_arrival_and_sjf_serves_the_short_kind_first(trained, tiny_model):
    lf, learner = trained
    prompts = [prompt_of(i % 2, 1000 + i) for i in range(6)]     # long, short, long, short, …
    out, order, arrival, beliefs, worker = serve(lf, learner, "sjf", prompts, 6)
    assert all(p is not None for p in arrival)
    assert min(arrival[0::2]) > max(arrival[1::2])
    assert set(order[:3]) == {"r1", "r3", "r5"}                  # the short kind first
    for i, p in enumerate(prompts):                              # greedy output unchanged
        assert out[f"r{i}"] == hf_greedy(tiny_model, p, 6, eos=EOS)
    assert beliefs and all(b[2] >= 0 for b in beliefs)           # re-predicted as they ran
    assert worker.resident() == []


@pytest.mark.parametrize("policy", ["fcfs", "laps"])
def test_greedy_output_is_the_same_with_predictions(trained, tiny_model, policy):
    lf, learner = trained
    prompts = [prompt_of(i % 2, 2000 + i) for i in range(5)]
    with_, *_ = serve(lf, learner, policy, prompts, 9, max_batch=2, max_resident=3)
    without, *_ = serve(lf, None, policy, prompts, 9, max_batch=2, max_resident=3)
    assert with_ == without
    for i, p in enumerate(prompts):
        assert with_[f"r{i}"] == hf_greedy(tiny_model, p, 9, eos=EOS)


def test_the_loop_learns_from_requests_that_stop_and_from_capped_ones_as_lower_bounds(tiny_model):
    lf = LlamaForward(tiny_model)
    prompts = [prompt_of(i % 2, 3000 + i) for i in range(4)]
    cold = LengthLearner(min_samples=1)
    serve(lf, cold, "fcfs", prompts, 5)
    assert cold.samples == 4                     # cut at 5 tokens: at least 5, news to nobody yet
    long_ = LengthLearner(min_samples=1, initial=cold.refit())
    long_.weights = replace(long_.weights, w=(10.0,) + long_.weights.w[1:])   # predicts e¹⁰
    serve(lf, long_, "fcfs", prompts, 5)
    assert long_.samples == 0                    # cut at 5, as expected of e¹⁰ tokens: no news
    # a stop token the model emits: the requests whose answers contain it end on their own
    refs = [hf_greedy(tiny_model, p, 40) for p in prompts]
    stop = refs[0][2]
    worker = BatchWorker(Verifier(lf, max_tree_tokens=8, features=True))
    loop = StepLoop(make_policy("fcfs", max_batch=2), worker, lengths=long_, max_resident=4)
    for i, p in enumerate(prompts):
        s = RequestStats(f"q{i}", "t", float(i), prompt_len=len(p), max_tokens=40)
        loop.submit(Request(s, list(p), SamplingParams(), stop_token_ids=(stop,)))
    while loop.step():
        pass
    stopped = sum(1 for r in refs if stop in r)
    assert stopped >= 1 and long_.samples >= stopped


def test_shipped_weights_predict_from_the_start_and_are_the_prior_of_online_fits():
    rng = np.random.default_rng(4)
    teacher = LengthLearner(min_samples=10)
    teach(teacher, 300, rng)
    shipped = teacher.refit()
    learner = LengthLearner(min_samples=5, ridge=50.0, initial=shipped)
    f = rng.normal(size=DIM)
    assert learner.belief(f, 0) == (pytest.approx(shipped.log_mean(f, 0)), shipped.sigma, 0)
    # a few samples of a deployment where everything is 4x longer: the fit moves from the prior
    # towards them, by as much as their weight against the ridge's
    for i in range(8):
        g = rng.normal(size=DIM)
        learner.note(f"x{i}", g, 0)
        learner.finish(f"x{i}", int(4 * np.exp(4 + np.log(2) * g[0])))
    w = learner.refit()
    assert w.version > shipped.version
    moved = w.log_mean(f, 0) - shipped.log_mean(f, 0)
    assert 0.05 < moved < np.log(4)
    assert LengthLearner(min_samples=5, ridge=50.0).belief(f, 0) is None


def test_the_default_models_shipped_weights_load():
    from scheduler.length_learner import shipped_predictor

    assert shipped_predictor("no-such-model") is None
    w, ridge = shipped_predictor("smollm2-135m")
    assert w.dim == 576 and w.sigma > 0 and ridge > 0


def test_beliefs_carry_the_out_of_sample_error_of_their_checkpoint():
    """σ is what the weights got wrong on requests they had not learned from, per checkpoint:
    here exact at arrival and noisy (σ 0.8) 16 tokens in; a vaguer belief does not replace a
    sharper one."""
    from scheduler.length_learner import better

    rng = np.random.default_rng(6)
    learner = LengthLearner(min_samples=10)
    teach(learner, 100, rng)
    learner.refit()
    for i in range(300):
        f = rng.normal(size=DIM)
        length = int(np.exp(4 + np.log(2) * f[0]))
        learner.note(f"e{i}", f, 0)
        g = rng.normal(size=DIM)                       # at 16 tokens: features that mislead
        learner.note(f"e{i}", g, 16)
        learner.finish(f"e{i}", length)
    assert learner.sigma_at(0) < 0.3 < 0.8 < learner.sigma_at(20)
    sharp, vague = learner.belief(f, 0), learner.belief(g, 20)
    assert better(sharp, None) and not better(vague, sharp) and better(sharp, vague)


def test_arrivals_are_prefilled_while_kv_room_is_left_and_evicted_first(trained):
    """With weights, a request is prefilled on arrival (so it waits with a prediction) while
    fewer than max_resident − max_batch hold KV; when KV runs short the loop evicts those never
    served before any that has been."""
    lf, learner = trained
    worker = BatchWorker(Verifier(lf, max_tree_tokens=4, features=True))
    loop = StepLoop(make_policy("fcfs", max_batch=1, aging_bound_s=None), worker,
                    lengths=learner, max_resident=4)
    stats = []
    for i in range(6):
        p = prompt_of(i % 2, 4000 + i)
        s = RequestStats(f"r{i}", "t", float(i), prompt_len=len(p), max_tokens=30)
        stats.append(s)
        loop.submit(Request(s, p, SamplingParams(), stop_token_ids=(EOS,)))
    loop._apply_inbox()
    assert worker.resident() == ["r0", "r1", "r2"]               # 4 − 1 room: three of six
    assert [s.predicted_len is not None for s in stats] == [True] * 3 + [False] * 3
    loop.step()                                                  # r0 runs, holds KV
    loop.kv.resident = {"r0": None, **{r: None for r in loop.kv.resident if r != "r0"}}  # r0 LRU
    assert loop.kv.ensure("r3", {"r3"})
    assert loop.kv.ensure("r4", {"r4"})                   # full: a never-served one goes
    assert "r0" in worker.resident() and len(worker.resident()) == 4
