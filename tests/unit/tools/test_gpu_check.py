"""The prepared GPU check (tools/gpu_check.py) runs end to end here, on tiny shapes on the CPU, so
a session lent a GPU spends its minutes on the check, not on fixing the script; and what it
reports can fail: the engine must match transformers in float32 and serve every stream."""
from __future__ import annotations

import argparse
import json

import pytest

from tools.gpu_check import run, table
from workers.model.loader import resolve_model


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu") / "report.json"
    args = argparse.Namespace(device="cpu", quick=True, sections="exact,attention,steps,speed,draft,serve", serve_s=5.0,
                              tokenizer=resolve_model(progress=False), json=str(out))
    rep = run(args)
    written = json.loads(out.read_text())                               # written after each section
    assert written.pop("meta")["machine"] and written == json.loads(json.dumps(rep))
    rep["_dir"] = out.parent
    return rep


def test_every_section_runs_without_error(report):
    assert {n: s.get("error") for n, s in report["sections"].items()} == dict.fromkeys(
        ("exact", "attention", "steps", "speed", "draft", "serve"))


def test_float32_speculation_matches_transformers_and_bfloat16_only_at_near_ties(report):
    rows = report["sections"]["exact"]["result"]
    assert {r["dtype"] for r in rows} == {"float32", "bfloat16"}
    assert all(r["ok"] for r in rows), rows
    f32 = next(r for r in rows if r["dtype"] == "float32")
    assert f32["spec_vs_hf_identical"] == f32["prompts"] == f32["plain_vs_hf_identical"]


def test_the_step_grid_is_a_profile_the_simulator_reads(report, tmp_path):
    from scheduler.profile import StepCostModel
    from tools.sim import SimSettings, run_sim

    path = report["_dir"] / "profile_tiny.json"
    cost = StepCostModel.from_json(str(path))
    assert 0 < cost(1, 2) < 10 and 0 < cost(2, 10) < 10     # seconds, from the measured grid
    sim = run_sim(["fcfs"], SimSettings(profile=str(path), n_requests=40, max_batch=2, token_budget=10,
                                        calibration_requests=40, calibration_steps=400))
    assert sim["settings"]["profile_source"].endswith("random tiny")
    assert sim["policies"]["fcfs"]["finished"] == 40


def test_step_times_cover_the_grid_and_speed_compares_with_transformers(report):
    steps = report["sections"]["steps"]["result"]
    assert {r["batch"] for r in steps} == {1, 2} and all(len(r["step_ms"]) == 2 for r in steps)
    assert all(ms > 0 for r in steps for ms in r["step_ms"])
    (speed,) = report["sections"]["speed"]["result"]
    assert {"hf_single_tok_s", "engine_none_single_tok_s", "engine_ngram_batched_tok_s"} <= set(speed)


def test_every_attention_option_decodes_as_the_loop_and_is_timed_end_to_end(report):
    """The engine's own options (SPECGATE_ATTENTION): batched trees decode the same under each,
    and a verify step is timed under each at every point, so the GPU run can pick the default."""
    (speed,) = report["sections"]["speed"]["result"]
    assert speed["ok"] and speed["padded_same_as_loop"] == speed["flex_same_as_loop"] == speed["batch"]
    assert speed["engine_ngram_batched_padded_tok_s"] > 0 and speed["engine_ngram_batched_flex_tok_s"] > 0
    steps = [r for r in report["sections"]["attention"]["result"] if r.get("kind") == "step"]
    assert [r["attention"] for r in steps] == ["loop", "padded", "flex"]
    for r in steps:
        assert r["ok"] and [(p["batch"], p["nodes"]) for p in r["points"]] == [(2, 4)], r
        assert r["points"][0]["step_ms"] > 0
    assert "attention step" in table(report)


def test_the_batched_tree_attention_candidates_agree_with_the_forwards_own(report):
    (row,) = [r for r in report["sections"]["attention"]["result"] if r.get("kind") != "step"]
    assert row["ok"] and row["sdpa_padded_max_diff"] < 1e-4 and row["sdpa_loop_max_diff"] == 0.0


def test_a_model_drafter_runs_on_the_device_and_keeps_greedy_output(report):
    draft = report["sections"]["draft"]["result"]
    assert draft["ok"], draft
    assert draft["draft_on"] == ["cpu"] and draft["identical"] == draft["prompts"] and draft["drafted"] > 0


def test_the_served_gateway_answers_every_stream(report):
    serve = report["sections"]["serve"]["result"]
    assert serve["ok"], serve
    assert serve["completed"] > 0 and serve["failed"] == 0
    assert "serve:" in table(report)
