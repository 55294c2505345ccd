"""`specgate bench profile` on the tiny random model: the grid it measures, and a profile JSON the
step-cost model loads."""
import argparse
import json

import pytest

from tools import bench_profile
from workers.speculation import profiling
from scheduler.profile import StepCostModel
from workers.model.llama_forward import LlamaForward
from workers.speculation.verifier import Verifier


@pytest.fixture(scope="module")
def verifier(tiny_model):                       # tests/conftest.py: tiny_llama(), 512 positions
    return Verifier(LlamaForward(tiny_model), max_tree_tokens=16)


def test_measures_every_batch_and_tree_size(verifier):
    got = profiling.measure_profile(verifier, batches=(2, 1), nodes=(3, 0, 1), prompt_len=20,
                                        repeats=2, prefill_tokens=(16, 64))
    assert [c["batch"] for c in got["curves"]] == [1, 2]
    for c in got["curves"]:
        b = c["batch"]
        assert c["nodes"] == [0, 1, 3]
        assert c["tokens"] == [b * (1 + n) for n in (0, 1, 3)]
        assert all(s > 0 for s in c["step_s_raw"])
        assert c["step_s"] == sorted(c["step_s"])           # made non-decreasing
        assert all(m >= r for m, r in zip(c["step_s"], c["step_s_raw"]))
    assert got["prefill"]["tokens"] == [15, 63]             # tokens whose KV a prefill computes
    assert verifier.active() == []                          # every request released


def test_rejects_trees_the_verifier_cannot_take(verifier):
    with pytest.raises(ValueError, match="max_tree_tokens"):
        profiling.measure_profile(verifier, nodes=(0, 32), repeats=1)
    with pytest.raises(ValueError, match="context"):
        profiling.measure_profile(verifier, nodes=(0, 15), prompt_len=500, repeats=1)


def test_cli_writes_a_profile_the_step_cost_model_loads(tmp_path, verifier, monkeypatch,
                                                        capsys):
    monkeypatch.setattr(bench_profile, "_load_verifier", lambda model, dtype, nodes, device="auto": verifier)
    parser = argparse.ArgumentParser()
    bench_profile.add_arguments(parser)
    out = tmp_path / "profile.json"
    args = parser.parse_args(["--batches", "1,2,4", "--nodes", "0,1,7", "--repeats", "2",
                              "--prompt-len", "24", "--prefill-tokens", "32,128",
                              "--model", "tiny", "--json", str(out)])
    assert bench_profile.run(args) == 0
    assert "| batch | nodes |" in capsys.readouterr().out
    doc = json.loads(out.read_text())
    assert {"source", "device", "date", "curves", "prefill"} <= set(doc)
    assert doc["model"] == "tiny" and doc["dtype"] == "float32"
    model = StepCostModel.from_json(out)
    assert model.batches == [1, 2, 4]
    for b, (tokens, _) in zip(model.batches, model.curves):
        assert tokens == sorted(tokens) and len(set(tokens)) == 3 and tokens[0] == b
    assert model(2, 4) > 0 and model.prefill(100) > 0
    assert model(4, 32) >= model(4, 4)


def test_old_profiles_without_prefill_still_load(tmp_path):
    old = tmp_path / "old.json"                             # the format before prefill curves
    old.write_text(json.dumps({"source": "old", "curves": [
        {"batch": 1, "tokens": [1, 8, 16, 64], "step_s": [0.040, 0.076, 0.080, 0.140]},
        {"batch": 8, "tokens": [8, 64], "step_s": [0.088, 0.168]}]}))
    model = StepCostModel.from_json(old)
    assert model.prefill(799) == pytest.approx(model(1, 799))
    assert model.contexts == [None] and model(1, 8, 5000) == model(1, 8)   # one context: any


def test_the_shipped_default_profile_was_measured_with_prefill():
    model = StepCostModel.from_json()
    assert model.prefill(1000) > model.prefill(100) > 0
    assert model(1, 16) > model(1, 1) > 0


def test_contexts_measure_the_grid_again_and_the_model_interpolates_them(tmp_path, verifier):
    got = profiling.measure_profile(verifier, batches=(1, 2), nodes=(0, 3), prompt_len=20,
                                        repeats=1, prefill_tokens=(), contexts=(80, 20, 40))
    assert [g["context"] for g in got["contexts"]] == [40, 80]   # prompt_len's grid: top level
    for g in got["contexts"]:
        assert [c["batch"] for c in g["curves"]] == [1, 2]
        assert all(c["tokens"] == [c["batch"], 4 * c["batch"]] for c in g["curves"])
    path = tmp_path / "ctx.json"
    path.write_text(json.dumps(bench_profile.profile_document(
        got, model="tiny", dtype="float32", device="cpu", prompt_len=20, repeats=1)))
    model = StepCostModel.from_json(path)
    assert model.contexts == [20, 40, 80]
    lo, hi = model(2, 8, 40), model(2, 8, 80)
    assert min(lo, hi) <= model(2, 8, 60) <= max(lo, hi)
    assert model(2, 8) == model(2, 8, 20)                   # no context: the top-level curves
    assert verifier.active() == []
    assert "| 80 | 2 | 3 | 8 |" in bench_profile.table(json.loads(path.read_text()))


def test_interleaved_grid_times_every_point_and_releases_its_requests(verifier):
    got = profiling.measure_profile(verifier, batches=(1, 3), nodes=(0, 2, 5), prompt_len=30,
                                        repeats=3, prefill_tokens=(), interleaved=True)
    assert [c["batch"] for c in got["curves"]] == [1, 3]
    for c in got["curves"]:
        assert c["tokens"] == [c["batch"] * (1 + n) for n in (0, 2, 5)]
        assert all(s > 0 for s in c["step_s_raw"]) and c["step_s"] == sorted(c["step_s"])
    assert "prefill" not in got
    assert verifier.active() == []


def runtime_over(model):
    from workers.runtime import Runtime

    return Runtime(tokenizer=None, forward=LlamaForward(model), hf_model=None, stop_token_ids=frozenset())


def test_startup_profile_covers_the_batches_the_planner_will_run(tiny_model):
    doc = profiling.startup_profile(runtime_over(tiny_model), max_batch=6)
    assert [c["batch"] for c in doc["curves"]] == [1, 2, 4, 6]
    deep = doc["curves"][0]["nodes"]                    # one stream: deeper trees, as room allows
    assert deep == list(profiling.STARTUP_BATCH1_NODES[:len(deep)]) and len(deep) > len(profiling.STARTUP_NODES)
    assert doc["curves"][1]["nodes"] == list(profiling.STARTUP_NODES)
    assert "start-up" in doc["source"] and doc["dtype"] == "float32"
    model = StepCostModel.from_doc(doc)
    assert model.batches == [1, 2, 4, 6] and model(6, 48) >= model(6, 6) > 0


def test_startup_profile_fits_a_short_context_model():
    from tests.conftest import tiny_llama

    doc = profiling.startup_profile(runtime_over(tiny_llama(max_positions=64)), max_batch=2)
    nodes = doc["curves"][0]["nodes"]
    assert nodes[0] == 0 and 1 < len(nodes) < len(profiling.STARTUP_BATCH1_NODES)   # fewer, not none
    assert StepCostModel.from_doc(doc)(2, 2) > 0


def test_startup_profile_measures_one_stream_as_deep_as_the_cap_allows(tiny_model):
    doc = profiling.startup_profile(runtime_over(tiny_model), max_batch=1, max_tree_tokens=7)
    assert [c["batch"] for c in doc["curves"]] == [1]
    assert doc["curves"][0]["nodes"] == [0, 1, 3, 7]


def test_a_runtime_measures_its_profile_once_per_shape(tiny_model):
    rt = runtime_over(tiny_model)
    first = rt.step_profile(2, 7)
    assert rt.step_profile(2, 7) is first
    assert rt.step_profile(1, 7) is not first


def test_measures_what_a_prefill_chunk_adds_to_a_step(verifier):
    got = profiling.measure_chunks(verifier, chunk_tokens=(4, 16), offsets=(0, 200), batch=2,
                                   nodes=1, prompt_len=16, repeats=3)
    assert [(k) for _, k, _ in got["points"]] == [4, 16, 4, 16]
    # each point's offset is where its median chunk started: past the series' offset
    assert [o >= base for (o, _, _), base in zip(got["points"], (0, 0, 200, 200))] == [True] * 4
    assert got["batch"] == 2 and got["nodes"] == 1
    assert verifier.active() == []
    # offsets with no room for their chunks in the context are left out, not failed
    none_fit = profiling.measure_chunks(verifier, chunk_tokens=(64,), offsets=(500,), repeats=2)
    assert none_fit == {}
    # the step-cost model fits the points when it loads them
    model = StepCostModel.from_doc({"curves": [{"batch": 1, "tokens": [1, 9], "step_s": [0.04, 0.08]}],
                                    "chunk": got})
    assert model.chunk(16, 200) >= model.chunk(16, 0) > 0


def test_a_profile_with_a_chunk_entry_charges_chunks_from_its_fit(tmp_path):
    doc = {"curves": [{"batch": 1, "tokens": [1, 9], "step_s": [0.04, 0.08]}],
           "prefill": {"tokens": [64, 1024], "step_s": [0.1, 1.0]},
           "chunk": {"row_s": 0.002, "key_s": 4e-6, "points": []}}
    path = tmp_path / "p.json"
    path.write_text(json.dumps(doc))
    m = StepCostModel.from_json(path)
    assert m.chunk(10, 500) == pytest.approx(0.002 * 10 + 4e-6 * 10 * 504.5)
    assert m.keys_per_row == pytest.approx(500)
    del doc["chunk"]                            # none measured: the prefill curve's slope
    path.write_text(json.dumps(doc))
    old = StepCostModel.from_json(path)
    assert old.keys_per_row is None
    assert old.chunk(96, 128) == pytest.approx(96 * 0.9 / 960)
    with pytest.raises(ValueError, match="chunk"):
        StepCostModel([(1, [1, 9], [0.04, 0.08])], chunk=(-1.0, 0.0))


def test_chunks_that_measured_nothing_above_noise_are_charged_as_if_none_were_measured():
    # on busy cores a small chunk can time at or below zero extra: the fit is 0 and 0, and the
    # profile must still load (by the prefill curve), not refuse the whole profile
    curves = [{"batch": 1, "tokens": [1, 9], "step_s": [0.04, 0.08]}]
    noise = {"batch": 2, "nodes": 1, "points": [[0, 4, -0.001], [0, 16, 0.0], [200, 4, -5e-4],
                                                [200, 16, -0.002]]}
    measured = StepCostModel.from_doc({"curves": curves, "chunk": noise})
    none = StepCostModel.from_doc({"curves": curves})
    assert measured.keys_per_row is None
    assert measured.chunk(16, 200) == none.chunk(16, 200) > 0
    with pytest.raises(ValueError, match="not both 0"):
        StepCostModel([(1, [1, 9], [0.04, 0.08])], chunk=(0.0, 0.0))
