"""`specgate plan`: the predicted grid from given α (no model), and `--measure` on the tiny random
model (real tokenizer, random weights: steps of a millisecond or two). Keys and sane values only:
no timing assertions."""
import argparse
import json

import pytest

from tools import plan_cmd
from tests.helpers import tiny_model_dir


def parse(argv):
    parser = argparse.ArgumentParser()
    plan_cmd.add_arguments(parser)
    return parser.parse_args(argv)


def test_predicted_grid_from_given_alphas(tmp_path, capsys):
    out = tmp_path / "plan.json"
    args = parse(["--drafters", "ngram,none", "--alpha", "0.8", "--shapes", "chain:1,chain:4,widths:2x1",
                  "--batches", "1,8", "--contexts", "200,900", "--json", str(out)])
    assert plan_cmd.run(args) == 0
    assert "| drafter | α |" in capsys.readouterr().out
    doc = json.loads(out.read_text())
    rows = doc["configurations"]
    assert len(rows) == 3 * 2 * 2 + 1 * 2 * 2                # ngram: shapes × batches × contexts; none
    for r in rows:
        assert r["predicted_tokens_per_s"] > 0 and "measured_tokens_per_s" not in r
    plain = [r for r in rows if r["drafter"] == "none"]
    assert all(r["predicted_multiplier"] == 1.0 and r["shape"] == "none" for r in plain)
    by = {(r["shape"], r["batch"], r["context"]): r for r in rows if r["drafter"] == "ngram"}
    assert by[("chain:4", 1, 200)]["predicted_tau"] == pytest.approx(1 + .8 + .64 + .512 + .4096, abs=1e-3)
    assert by[("chain:4", 1, 200)]["predicted_multiplier"] > 1
    assert doc["calibration"]["ngram"]["source"] == "given"


@pytest.mark.parametrize("text", ["ngram/chain:4", "ngram/tree:4/1", "ngram/chain:4/x"])
def test_bad_configurations(text):
    with pytest.raises(ValueError, match="drafter/shape/batch"):
        plan_cmd.Config.parse(text)


def test_alpha_for_an_unknown_drafter():
    with pytest.raises(ValueError, match="--drafters"):
        plan_cmd.parse_alphas("suffix=0.3", ["ngram"])


def test_measure_on_the_tiny_model_writes_predicted_and_measured(tmp_path, capsys):
    model = tiny_model_dir(tmp_path / "tiny")
    out = tmp_path / "measured.json"
    args = parse(["--model", str(model), "--measure", "--drafters", "ngram", "--shapes", "chain:2",
                  "--batches", "1", "--configs", "ngram/chain:2/1,ngram/chain:4/2,none/none/2",
                  "--calibrate-on", "prompts", "--calibration-prompts", "2",
                  "--measure-prompts", "2", "--steps", "5",
                  "--calibration-shape", "chain:4", "--threads", "1", "--json", str(out)])
    assert plan_cmd.run(args) == 0
    assert "tok/s meas" in capsys.readouterr().out
    doc = json.loads(out.read_text())
    assert set(doc["calibration_prompts"]).isdisjoint(doc["measured_prompts"])
    assert len(doc["measured_prompts"]) == 2 and doc["steps"] == 5
    cal = doc["calibration"]["ngram"]
    assert cal["source"] == "calibrated"
    assert all(0 <= cal[k] <= 1 for k in ("alpha", "coverage", "reach"))
    assert cal["draft_cost"]["fixed_s"] >= 0 and doc["overhead_s_per_request_step"] >= 0
    rows = doc["configurations"]
    assert [(r["drafter"], r["shape"], r["batch"]) for r in rows] == [
        ("ngram", "chain:2", 1), ("ngram", "chain:4", 2), ("none", "none", 2)]
    for r in rows:
        assert r["predicted_tokens_per_s"] > 0 and r["measured_tokens_per_s"] > 0
        assert r["error"] == pytest.approx(r["predicted_tokens_per_s"] / r["measured_tokens_per_s"] - 1,
                                           abs=1e-3)
        assert r["measured_request_steps"] == 2 * 5       # two prompts, five steps each
        assert 1 <= r["measured_tau"] <= 1 + int(r["shape"].split(":")[-1] if ":" in r["shape"] else 0)
        assert r["context"] > 0 and r["measured_context"] > 0
    plain = rows[2]
    assert plain["measured_tau"] == 1 and plain["measured_nodes"] == 0
    assert plain["predicted_multiplier"] == 1.0


def test_calibrating_on_earlier_steps_of_the_measured_prompts(tmp_path):
    model = tiny_model_dir(tmp_path / "tiny")
    out = tmp_path / "steps.json"
    args = parse(["--model", str(model), "--measure", "--drafters", "suffix", "--shapes", "chain:2",
                  "--batches", "1", "--configs", "suffix/chain:2/2", "--calibrate-on", "steps",
                  "--lead-in", "6", "--measure-prompts", "2", "--steps", "4",
                  "--threads", "1", "--json", str(out)])
    assert plan_cmd.run(args) == 0
    doc = json.loads(out.read_text())
    assert doc["calibrate_on"] == "steps" and doc["calibration_prompts"] == doc["measured_prompts"]
    (row,) = doc["configurations"]
    assert row["measured_request_steps"] == 2 * 4 and row["measured_tokens_per_s"] > 0
    assert doc["calibration"]["suffix"]["source"] == "calibrated"


def test_the_lead_in_continues_each_prompt_with_the_targets_own_tokens(tiny_model):
    from tools.plan_measure import PlanBench, run_configuration
    from tools.throughput import TreeShape
    from workers.model.llama_forward import LlamaForward
    from workers.speculation.verifier import Verifier

    verifier = Verifier(LlamaForward(tiny_model), max_tree_tokens=16)
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    bench = PlanBench(verifier, prompts, prompts, calibration_shape=TreeShape.chain(4), steps=3,
                      meta={}, lead_in=5)
    continued = bench.continue_prompts(prompts, 5)
    assert [len(c) for c in continued] == [9, 8] and continued[0][:4] == prompts[0]
    alone = run_configuration(verifier, "none", TreeShape(), 1, prompts[1:], 5).outputs[0]
    assert continued[1][3:] == alone                       # batched or alone: the same greedy text
    cal = bench.calibrate("ngram")
    assert cal.request_steps <= 2 * 5                       # stops once 5 tokens are committed
    assert verifier.active() == []
