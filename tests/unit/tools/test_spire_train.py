"""`specgate draft train`: the mixed loss against a hand computation, and short real runs on a tiny
target (a draft with feedback memory and k-step training, and a plain one) that must learn,
log every step as JSON, resume from the checkpoint and write the draft (and its memory mix) back."""
from __future__ import annotations

import json
import math

import pytest
import torch

from specgate.cli import main
from tests.helpers import tiny_model_dir
from tools.distill import training_prompts
from tools.draft_build import build_draft
from tools.spire_loss import mixed_loss
from workers.drafters.neural.draft_model import read_spec
from workers.drafters.neural.draft_memory import GATE_KEY, GATE_OFF, MIX_KEY


def test_mixed_loss_against_a_hand_computation():
    # p = (0.7, 0.2, 0.1) on tokens 0, 2, 4 (already normalised); q = softmax(0, 1, 2, 0, 1)
    logits = torch.tensor([[0.0, 1.0, 2.0, 0.0, 1.0]])
    z = 1 + math.e + math.e ** 2 + 1 + math.e
    q = {0: 1 / z, 2: math.e ** 2 / z, 4: math.e / z}
    p = {0: 0.7, 2: 0.2, 4: 0.1}
    ce = -sum(p[t] * math.log(q[t]) for t in p)
    accept = sum(min(p[t], q[t]) for t in p)
    lp = torch.log(torch.tensor([[0.7, 0.2, 0.1]]))
    ix = torch.tensor([[0, 2, 4]])
    for w in (0.0, 0.25, 1.0):
        loss, parts = mixed_loss(logits, lp, ix, torch.tensor([True]), w)
        assert float(loss) == pytest.approx(w * ce - (1 - w) * accept, rel=1e-5)
        assert parts["ce"] == pytest.approx(ce, rel=1e-5) and parts["accept"] == pytest.approx(accept, rel=1e-5)
    with pytest.raises(ValueError):
        mixed_loss(logits, lp, ix, torch.tensor([True]), 1.5)


def test_masked_positions_do_not_count_in_the_mixed_loss():
    logits = torch.randn(3, 7)
    lp, ix = torch.log_softmax(torch.randn(3, 4), -1), torch.randint(0, 7, (3, 4))
    keep = torch.tensor([True, False, True])
    full, _ = mixed_loss(logits, lp, ix, keep, 0.5)
    part, _ = mixed_loss(logits[keep], lp[keep], ix[keep], torch.ones(2, dtype=torch.bool), 0.5)
    assert float(full) == pytest.approx(float(part))


@pytest.mark.parametrize("memory,k", [(True, 3), (False, 1)], ids=["memory-k3", "plain"])
def test_draft_train_learns_logs_resumes_and_writes_the_draft(tmp_path, memory, k):
    target = tiny_model_dir(tmp_path / "target")
    draft = build_draft(str(target), tmp_path / "draft", layers="first1", sink=2, window=32, memory=memory,
                        progress=False)
    before = (draft / "model.safetensors").read_bytes()
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps(r) for r in training_prompts(0)[:12]) + "\n")
    common = ["draft", "train", "--target", str(target), "--draft", str(draft), "--prompts", str(prompts),
              "--max-new", "24", "--lr", "3e-3", "--gen-share", "0.5", "--k", str(k), "--weight", "0.5",
              "--data", str(tmp_path / "data")]
    # bounded by steps, not by the clock: these cores are shared
    assert main(common + ["--minutes", "10", "--max-steps", "24", "--json", str(tmp_path / "one.json")]) == 0
    one = json.loads((tmp_path / "one.json").read_text())
    assert one["steps"] == 24 and one["train_sequences"] == 12
    assert one["alpha_after"] > one["alpha_before"] + 0.05, one
    assert one["loss_last"] < one["loss_first"], one
    assert (draft / "model.safetensors").read_bytes() != before
    log = [json.loads(line) for line in (draft / "spire" / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == list(range(1, one["steps"] + 1))
    assert {"loss", "ce", "accept", "lr", "trained_s"} <= set(log[0])
    spec = read_spec(draft)
    assert spec.distilled_steps == one["steps"]
    assert (MIX_KEY in spec.extra) == memory
    if memory:      # the gates moved off their start (their own learning rate), and were saved
        assert spec.extra[GATE_KEY] == one["memory_gate"] and min(one["memory_gate"]) != GATE_OFF

    assert main(common + ["--minutes", "10", "--max-steps", "30", "--json", str(tmp_path / "two.json")]) == 0
    two = json.loads((tmp_path / "two.json").read_text())
    assert two["alpha_before"] == one["alpha_before"] and two["steps"] == 30   # resumed at 24
    assert read_spec(draft).distilled_steps == two["steps"]
    assert len((draft / "spire" / "log.jsonl").read_text().splitlines()) == two["steps"]
