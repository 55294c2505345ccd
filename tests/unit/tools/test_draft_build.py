"""`specgate draft build`: which blocks a draft keeps, and that it is a loadable model directory."""
from __future__ import annotations

import json

import pytest
import torch

from tests.conftest import tiny_llama
from tests.helpers import tiny_model_dir
from tools.draft_build import build_draft, parse_layers, prune
from workers.drafters.neural.draft_model import SPEC_FILE, read_spec
from workers.contract import DraftContext, TreeBudget
from workers.drafters.model import ModelDrafter
from workers.drafters.registry import create_drafter, is_drafter_name


@pytest.mark.parametrize("text, n, want", [
    ("last2", 30, (28, 29)), ("last1", 2, (1,)), ("first3", 30, (0, 1, 2)), ("0,15,-1", 30, (0, 15, 29)),
    ("5", 30, (5,)),
])
def test_parse_layers(text, n, want):
    assert parse_layers(text, n) == want


@pytest.mark.parametrize("text", ["last0", "last31", "30", "-31", "1,1", "", "middle2", "a,b"])
def test_parse_layers_refuses(text):
    with pytest.raises(ValueError):
        parse_layers(text, 30)


def test_pruning_every_block_keeps_the_model_and_pruning_some_keeps_their_weights():
    target = tiny_llama(3, layers=4)
    ids = torch.tensor([[5, 9, 33, 7, 100]])
    with torch.no_grad():
        same = prune(target, range(4))(input_ids=ids).logits
        torch.testing.assert_close(same, target(input_ids=ids).logits)
    draft = prune(target, (1, 3))
    assert draft.config.num_hidden_layers == 2 and target.config.num_hidden_layers == 4
    for new, old in ((0, 1), (1, 3)):
        torch.testing.assert_close(draft.model.layers[new].mlp.down_proj.weight,
                                   target.model.layers[old].mlp.down_proj.weight)
    assert draft.lm_head.weight.data_ptr() == draft.model.embed_tokens.weight.data_ptr()   # still tied


def test_build_writes_a_draft_directory_the_registry_loads(tmp_path):
    target = tiny_model_dir(tmp_path / "target")
    out = build_draft(str(target), tmp_path / "draft", layers="last1", sink=2, window=16, progress=False)
    spec = read_spec(out)
    assert (spec.sink, spec.window, spec.source_layers) == (2, 16, (1,))
    assert json.loads((out / SPEC_FILE).read_text())["target"] == str(target)
    assert is_drafter_name(str(out)) and not is_drafter_name(str(tmp_path / "nothing"))
    drafter = create_drafter(str(out), mode="widths")
    assert isinstance(drafter, ModelDrafter) and drafter.spec.window == 16 and drafter.mode == "widths"
    tree = drafter.propose(DraftContext("r", "t", [1, 2, 3, 4], 4), TreeBudget(4, 2))
    assert 1 <= len(tree) <= 4
    with pytest.raises(ValueError, match="not empty"):
        build_draft(str(target), out, progress=False)


def test_a_draft_directory_merges_with_ngram_and_output_stays_greedy(tmp_path, tiny_model):
    """merge:ngram+DIR (SpecInfer: a small model and prompt lookup in one tree) is still exact."""
    draft_dir = tmp_path / "d"
    tiny_llama(5).save_pretrained(draft_dir)           # another random model, same vocabulary
    drafter = create_drafter(f"merge:ngram+{draft_dir}")
    assert [d.name for d in drafter.drafters] == ["ngram", str(draft_dir)]
    assert_greedy_with(tiny_model, drafter)


def assert_greedy_with(target, drafter) -> None:
    """Greedy output with `drafter`'s trees is the target's own, and it drafted."""
    from tests.helpers import hf_greedy
    from tests.unit.test_engine import prompts
    from workers.contract import SamplingParams
    from scheduler.generation import Engine, GenerationRequest
    from workers.model.llama_forward import LlamaForward
    from workers.speculation.verifier import Verifier

    reqs = [GenerationRequest(f"r{i}", tuple(p), 24, SamplingParams(), frozenset({2}))
            for i, p in enumerate(prompts(4))]
    results = Engine(Verifier(LlamaForward(target), max_tree_tokens=16), drafter, TreeBudget(8, 4),
                     adaptive=False).generate(reqs)
    assert [r.token_ids for r in results] == [hf_greedy(target, p, 24, eos=2) for p in prompts(4)]
    assert sum(r.drafted for r in results) > 0


def test_build_with_memory_writes_a_memory_draft_the_registry_loads(tmp_path):
    from workers.drafters.memory import MemoryDrafter

    target = tiny_model_dir(tmp_path / "target")                 # 2 blocks
    out = build_draft(str(target), tmp_path / "draft", layers="first1", sink=2, window=16, memory=True,
                      progress=False)
    assert read_spec(out).memory_layers == (1,)                  # one per draft block, the target's last
    drafter = create_drafter(str(out))
    assert isinstance(drafter, MemoryDrafter) and drafter.target_taps.layers == (1,)
    tree = drafter.propose(DraftContext("r", "t", [1, 2, 3, 4], 4), TreeBudget(4, 2))
    assert 1 <= len(tree) <= 4


@pytest.mark.parametrize("memory", [False, True], ids=["plain", "memory"])
def test_a_bfloat16_draft_drafts_in_bfloat16_and_output_stays_greedy(tmp_path, memory):
    """`draft build --dtype bfloat16`: the spec says so, the registry loads the draft (merged with
    n-gram, as served) in bfloat16, its KV too, and the float32 target's output is unchanged."""
    from transformers import AutoModelForCausalLM

    target_dir = tiny_model_dir(tmp_path / "target")
    out = build_draft(str(target_dir), tmp_path / "draft", layers="first1", sink=2, window=16, memory=memory,
                      dtype="bfloat16", progress=False)
    assert read_spec(out).dtype == "bfloat16" and read_spec(out).torch_dtype == torch.bfloat16
    drafter = create_drafter(f"merge:ngram+{out}")
    model_drafter = drafter.drafters[1]
    assert model_drafter.forward.dtype == torch.bfloat16
    assert create_drafter(str(out)).forward.dtype == torch.bfloat16
    assert_greedy_with(AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval(), drafter)
    model_drafter.propose(DraftContext("kv", "t", [1, 2, 3, 4], 4), TreeBudget(4, 2))
    # its KV: bfloat16, except a plain draft on a CPU without the bf16 attention kernel, where
    # the lean forward keeps float32 KV on purpose (workers/model/llama_forward.py says why)
    fwd = model_drafter.forward
    kept = torch.float32 if not memory and fwd.device.type == "cpu" and not fwd.fused_attention else torch.bfloat16
    assert model_drafter._states["kv"].kv.cache.k.dtype == kept


def test_build_refuses_an_unknown_dtype(tmp_path):
    with pytest.raises(ValueError, match="dtype must be one of"):
        build_draft(str(tmp_path / "not-loaded"), tmp_path / "draft", dtype="int8", progress=False)
    assert not (tmp_path / "draft").exists()
