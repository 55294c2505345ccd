"""bench drafters: prompt split and merge ratios (pure), then a run on the tiny model."""
from __future__ import annotations

import pytest

from tools.bench_drafters import bench_drafters, merge_ratios, split_prompts
from tests.unit.test_engine import prompts
from workers.contract import TreeBudget
from workers.model.llama_forward import LlamaForward
from workers.runtime import Runtime


def test_split_interleaves_workloads_and_keeps_warmup_apart():
    measured, warm = split_prompts({"a": list("abcde"), "b": list("vwxyz")}, 2, 2)
    assert measured == [("a", "a"), ("b", "v"), ("a", "b"), ("b", "w")]
    assert warm == [("a", "c"), ("b", "x"), ("a", "d"), ("b", "y")]
    with pytest.raises(ValueError, match="fewer than"):
        split_prompts({"a": [1, 2]}, 2, 1)


def test_merge_ratios_against_the_best_single_drafter():
    r = merge_ratios({"ngram": 2.5, "suffix": 2.0, "merge:ngram+suffix": 2.0, "merge:a+b": 3.0})
    assert r == {"best_single": "ngram",
                 "tau_vs_best_single": {"merge:ngram+suffix": 0.8, "merge:a+b": 1.2}}
    assert merge_ratios({"merge:a+b": 2.0}) == {"best_single": None, "tau_vs_best_single": {}}


def test_a_run_on_the_tiny_model(tiny_model):
    rt = Runtime(tokenizer=None, forward=LlamaForward(tiny_model), hf_model=None,
                 stop_token_ids=frozenset({2}))
    ps = [p for p in prompts(8) if len(p) > 4]
    measured = [("x" if i % 2 else "y", p) for i, p in enumerate(ps[:4])]
    warm = [("y", p) for p in ps[4:]]
    rep = bench_drafters(rt, ["none", "ngram", "suffix", "merge:ngram+suffix"], measured, warm,
                         TreeBudget(8, 4), max_tokens=16)
    assert rep["identical"] is True and rep["prompts"] == 4
    assert rep["drafters"]["none"]["tau"] == 1.0 and rep["drafters"]["none"]["alpha"] == 0.0
    for name in ("ngram", "suffix", "merge:ngram+suffix"):
        d = rep["drafters"][name]
        assert d["tau"] >= 1.0 and set(d["tau_by_workload"]) == {"x", "y"}
        assert d["tokens"] == rep["drafters"]["none"]["tokens"]
    best = rep["best_single"]
    assert rep["drafters"][best]["tau"] == max(rep["drafters"][n]["tau"] for n in ("none", "ngram", "suffix"))
    assert rep["tau_vs_best_single"]["merge:ngram+suffix"] == pytest.approx(
        rep["drafters"]["merge:ngram+suffix"]["tau"] / rep["drafters"][best]["tau"], abs=2e-3)


def test_costs_multipliers_and_self_speculation_on_the_tiny_model(tiny_model):
    """Self-speculation drafts (the target under a sink + window mask: on a context shorter than
    the window it is the target itself, so its likeliest child of the root, always in its tree,
    is always accepted), and every drafter after plain decoding gets its costs and both
    multipliers."""
    rt = Runtime(tokenizer=None, forward=LlamaForward(tiny_model), hf_model=None,
                 stop_token_ids=frozenset({2}))
    ps = [p for p in prompts(8) if len(p) > 4]
    measured = [("x", p) for p in ps[:3]]
    rep = bench_drafters(rt, ["none", "ngram", "self:2:64"], measured, [], TreeBudget(4, 4), max_tokens=12)
    assert rep["identical"] is True
    selfspec = rep["drafters"]["self:2:64"]
    assert selfspec["tau"] >= 1.9 and selfspec["alpha"] >= 0.24     # >= 1 of its 4 nodes each step
    for name in ("ngram", "self:2:64"):
        d = rep["drafters"][name]
        assert d["multiplier_measured"] > 0 and d["multiplier_predicted"] > 0
        assert d["verify_ms_per_step"] > 0 and d["tokens_per_s"] > 0
    assert selfspec["draft_ms_per_level"] > 0 and selfspec["draft_vs_target"] > 0
    chained = bench_drafters(rt, ["none", "self:2:64"], measured, [], TreeBudget(4, 4), max_tokens=12, chain=True)
    d = chained["drafters"]["self:2:64"]
    assert d["alpha"] == 1.0 and d["tau"] > 3.0 and chained["identical"]     # the target's own chain
    with pytest.raises(ValueError):
        bench_drafters(rt, ["self:2"], measured, [], TreeBudget(4, 4), max_tokens=4)


def test_rounds_sum_every_pass_and_report_each_rounds_multiplier(tiny_model):
    """Two rounds: every drafter serves the prompts twice from a fresh engine (the same output
    both times), the figures are the sums, and each round has its own multiplier."""
    rt = Runtime(tokenizer=None, forward=LlamaForward(tiny_model), hf_model=None,
                 stop_token_ids=frozenset({2}))
    ps = [p for p in prompts(8) if len(p) > 4]
    measured = [("x", p) for p in ps[:2]]
    once = bench_drafters(rt, ["none", "suffix"], measured, [("x", ps[3])], TreeBudget(4, 4), max_tokens=10)
    twice = bench_drafters(rt, ["none", "suffix"], measured, [("x", ps[3])], TreeBudget(4, 4), max_tokens=10,
                           rounds=2)
    assert twice["rounds"] == 2 and twice["identical"] is True
    for name in ("none", "suffix"):
        # a fresh suffix cache each pass: the second round does not copy the first round's outputs
        assert twice["drafters"][name]["tokens"] == 2 * once["drafters"][name]["tokens"]
        assert twice["drafters"][name]["steps"] == 2 * once["drafters"][name]["steps"]
        assert len(twice["drafters"][name]["multiplier_by_round"]) == 2
    assert twice["drafters"]["none"]["multiplier_by_round"] == [1.0, 1.0]
    assert "multiplier_by_round" not in once["drafters"]["suffix"]
    with pytest.raises(ValueError, match="rounds"):
        bench_drafters(rt, ["none"], measured, [], TreeBudget(4, 4), rounds=0)
