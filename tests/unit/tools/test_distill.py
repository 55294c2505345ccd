"""`specgate distill`: the loss, the prompt set, and a short real run on a tiny target that must raise
acceptance, resume from its checkpoint and write the trained draft back."""
from __future__ import annotations

import json

import pytest
import torch

from specgate.cli import main
from loadtest.workload import load_workload
from tests.helpers import tiny_model_dir
from tools.distill import distill_loss, training_prompts
from tools.draft_build import build_draft
from workers.model.device import resolve_device
from workers.drafters.neural.draft_model import read_spec


def _topk(p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    lp, ix = torch.log(p).topk(p.shape[-1], dim=-1)
    return lp, ix


def test_loss_is_the_target_entropy_when_the_draft_matches():
    p = torch.softmax(torch.randn(6, 10), -1)
    lp, ix = _topk(p)
    loss = distill_loss(torch.log(p), lp, ix, torch.ones(6, dtype=torch.bool))
    entropy = float(-(p * p.log()).sum(-1).mean())
    assert abs(float(loss) - entropy) < 1e-5        # CE = H(p), and the acceptance term is 0


def test_loss_falls_as_the_draft_moves_towards_the_target():
    torch.manual_seed(0)
    p = torch.softmax(2 * torch.randn(8, 20), -1)
    lp, ix = _topk(p)
    far = torch.randn(8, 20)
    mask = torch.ones(8, dtype=torch.bool)
    losses = [float(distill_loss((1 - t) * far + t * torch.log(p), lp, ix, mask)) for t in (0, 0.5, 1)]
    assert losses[0] > losses[1] > losses[2]
    # The acceptance term alone: 1 − Σ min(p, q) is what a sampled draft loses.
    no_ce = distill_loss(far, lp, ix, mask, accept_weight=1.0) - distill_loss(far, lp, ix, mask, accept_weight=0.0)
    q = torch.softmax(far, -1)
    assert abs(float(no_ce) - float((1 - torch.minimum(p, q).sum(-1)).mean())) < 1e-5


def test_masked_positions_do_not_count():
    p = torch.softmax(torch.randn(4, 10), -1)
    lp, ix = _topk(p)
    logits = torch.randn(4, 10)
    mask = torch.tensor([True, True, False, False])
    torch.testing.assert_close(distill_loss(logits, lp, ix, mask), distill_loss(logits[:2], lp[:2], ix[:2], mask[:2]))
    logits[2:] = 1e3 * torch.randn(2, 10)        # anything at masked positions
    torch.testing.assert_close(distill_loss(logits, lp, ix, mask), distill_loss(logits[:2], lp[:2], ix[:2], mask[:2]))


def test_training_prompts_are_seeded_and_not_the_evaluation_prompts():
    a, b = training_prompts(0), training_prompts(1)
    assert len(a) > 1000 and sorted(map(str, a)) == sorted(map(str, b)) and a != b
    chat = {r["messages"][0]["content"] for r in load_workload("chat")}
    assert not chat & {r["messages"][0]["content"] for r in a}


def test_distill_raises_acceptance_resumes_and_writes_the_draft(tmp_path, capsys):
    target = tiny_model_dir(tmp_path / "target")
    draft = build_draft(str(target), tmp_path / "draft", layers="last1", sink=2, window=32, progress=False)
    before = (draft / "model.safetensors").read_bytes()
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps(r) for r in training_prompts(0)[:12]) + "\n")
    common = ["distill", "--target", str(target), "--draft", str(draft), "--prompts", str(prompts),
              "--max-new", "24", "--lr", "3e-3", "--gen-share", "0.5"]
    assert main(common + ["--minutes", "0.3", "--json", str(tmp_path / "one.json")]) == 0
    one = json.loads((tmp_path / "one.json").read_text())
    assert one["steps"] > 3 and one["train_sequences"] > 0
    assert one["alpha_after"] > one["alpha_before"] + 0.05, one
    assert one["loss_last"] < one["loss_first"], one
    assert (draft / "model.safetensors").read_bytes() != before
    assert read_spec(draft).distilled_steps == one["steps"]

    assert one["device"] == str(resolve_device("auto")) and one["step_s"] > 0
    ckpt = torch.load(draft / "distill" / "checkpoint.pt")
    assert all(t.device.type == "cpu" for t in ckpt["weights"].values())   # resumes on any device

    assert main(common + ["--minutes", "0.15", "--device", "cpu", "--json", str(tmp_path / "two.json")]) == 0
    two = json.loads((tmp_path / "two.json").read_text())
    assert two["device"] == "cpu"
    assert two["alpha_before"] == one["alpha_before"]          # the untrained figure is kept
    assert two["steps"] > one["steps"]                          # resumed, not restarted
    assert read_spec(draft).distilled_steps == two["steps"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here")
def test_a_gpu_asked_for_where_there_is_none_stops_distill_and_draft_build_before_any_work(tmp_path, capsys):
    target = tiny_model_dir(tmp_path / "target")
    draft = build_draft(str(target), tmp_path / "draft", layers="last1", sink=2, window=32, progress=False)
    before = sorted(p.name for p in draft.iterdir())
    assert main(["distill", "--target", str(target), "--draft", str(draft), "--minutes", "0.1",
                 "--device", "cuda"]) == 2
    assert "sees no CUDA GPU" in capsys.readouterr().err
    assert sorted(p.name for p in draft.iterdir()) == before          # nothing generated or written
    assert main(["draft", "build", "--target", str(target), "--out", str(tmp_path / "d2"), "--device", "cuda:0"]) == 2
    assert "sees no CUDA GPU" in capsys.readouterr().err and not (tmp_path / "d2").exists()
    assert main(["draft", "build", "--target", str(target), "--out", str(tmp_path / "d3"), "--layers", "first1",
                 "--device", "cpu"]) == 0
    assert "built on cpu in" in capsys.readouterr().err and (tmp_path / "d3" / "model.safetensors").is_file()
