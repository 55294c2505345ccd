"""`specgate draft build`: prune a SPIRe-style draft from the target.

The draft keeps the target's token embedding, a chosen few of its blocks (SPIRe takes the last two),
its final norm and its unembedding, so it speaks the target's tokenizer and starts from weights that
already map into the target's output space. It is written as a plain Hugging Face model directory
(so `ModelDrafter.load`, transformers and `specgate distill` all read it) plus
``specgate_draft.json`` with its static sparse attention: an attention sink of ``sink`` tokens and
a sliding window of ``window`` tokens, which keep its KV constant-size (`workers.drafters.neural.draft_model`).

Untrained, such a draft agrees with the target on about 1% of tokens; `specgate distill` is
what makes it useful.

Which blocks: SPIRe keeps the target's last two. On SmolLM2-135M the first blocks learn faster:
given the same training sequences and the same short `specgate distill` run, drafts built from the
first blocks reached a higher greedy acceptance on the chat workload than the last two, and the
first three the lowest loss. The first blocks
already read token embeddings; the last ones expect the deep residual stream. So the default is
the first three; `--layers last2` builds SPIRe's choice.

``--device`` (workers/model/device.py; ``auto`` takes CUDA when torch sees a GPU): where the target is
loaded and the draft assembled, so a large target never needs its whole weight in host memory;
the draft directory written is the same on any device.
"""
from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from pathlib import Path
from typing import Sequence

import torch
from safetensors.torch import load_file

from workers.model.device import resolve_device, synchronize
from workers.drafters.neural.draft_memory import default_memory_layers
from workers.drafters.neural.draft_model import DRAFT_DTYPES, DraftSpec, write_spec
from workers.model.loader import DEFAULT_MODEL, load_target, resolve_model

__all__ = ["parse_layers", "prune", "build_draft", "add_arguments", "run"]


def parse_layers(text: str, n_layers: int) -> tuple[int, ...]:
    """Block indices from "last2" (SPIRe's choice), "first3" (the default), or "0,14,29"; negative
    indices count from the end.

    >>> parse_layers("last2", 30), parse_layers("first3", 30), parse_layers("0,-1", 30)
    ((28, 29), (0, 1, 2), (0, 29))
    """
    text = text.strip()
    for word in ("last", "first"):
        if text.startswith(word) and text[len(word):].isdigit():
            k = int(text[len(word):])
            if not 1 <= k <= n_layers:
                raise ValueError(f"--layers {text}: the target has {n_layers} blocks")
            return tuple(range(n_layers - k, n_layers)) if word == "last" else tuple(range(k))
    try:
        picked = [int(p) for p in text.split(",") if p.strip()]
    except ValueError:
        raise ValueError(f"--layers {text!r}: use lastK, firstK or a comma list of block indices") from None
    out = tuple(i % n_layers if -n_layers <= i < n_layers else -1 for i in picked)
    if not out or -1 in out:
        raise ValueError(f"--layers {text!r}: indices must lie in [-{n_layers}, {n_layers})")
    if len(set(out)) != len(out):
        raise ValueError(f"--layers {text!r}: a block is named twice")
    return out


def prune(target, layers: Sequence[int]):
    """A new model of the target's class holding only `layers` (in the order given) between the
    target's embedding and unembedding, on the target's device. The target is left untouched."""
    config = copy.deepcopy(target.config)
    config.num_hidden_layers = len(layers)
    if getattr(config, "layer_types", None):
        config.layer_types = [config.layer_types[i] for i in layers]
    with torch.device(target.device):
        draft = type(target)(config).to(target.dtype).eval()
    src = target.model
    with torch.no_grad():
        draft.model.embed_tokens.load_state_dict(src.embed_tokens.state_dict())
        draft.model.norm.load_state_dict(src.norm.state_dict())
        for new, old in enumerate(layers):
            draft.model.layers[new].load_state_dict(src.layers[old].state_dict())
        if not config.tie_word_embeddings:
            draft.lm_head.load_state_dict(target.lm_head.state_dict())
    draft.tie_weights()
    draft.generation_config = copy.deepcopy(target.generation_config)
    return draft


def build_draft(target_name: str, out: str | Path, *, layers: str = "first3", sink: int = 4,
                window: int | None = 256, memory: bool = False, device: str = "auto",
                dtype: str = "float32", progress: bool = True) -> Path:
    """Prune, write the draft directory (weights, config, tokenizer, spec); returns its path.
    `memory`: give the draft SPIRe's feedback memory over the target's activations
    (workers/drafters/neural/draft_memory.py), read from `default_memory_layers` of the target. `device`: where
    the target is loaded and the draft assembled (workers/model/device.py). `dtype`: what it drafts in
    (`DraftSpec.dtype`; its weights are kept in float32 for training)."""
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise ValueError(f"{out} exists and is not empty; pass a new directory")
    dev = resolve_device(device)     # a GPU asked for where there is none: refused before loading
    DraftSpec(dtype=dtype)           # an unknown dtype: refused before loading too
    target, tokenizer = load_target(target_name, device=dev, progress=progress)
    picked = parse_layers(layers, target.config.num_hidden_layers)
    draft = prune(target, picked)
    out.mkdir(parents=True, exist_ok=True)
    draft.save_pretrained(out)
    tokenizer.save_pretrained(out)
    memory_layers = default_memory_layers(target.config.num_hidden_layers, len(picked)) if memory else ()
    write_spec(out, DraftSpec(sink=sink, window=window, source_layers=picked,
                              target=str(resolve_model(target_name, progress=False)),
                              memory_layers=memory_layers, dtype=dtype))
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default=DEFAULT_MODEL, help="the target: built-in name, HF directory or .gguf file")
    p.add_argument("--out", required=True, type=Path, help="the new draft directory")
    p.add_argument("--layers", default="first3", help="target blocks to keep: firstK (default first3), lastK "
                                                      "(last2 is SPIRe's choice) or a comma list of indices")
    p.add_argument("--sink", type=int, default=4, help="attention-sink tokens every position sees")
    p.add_argument("--window", type=int, default=256, help="sliding-window length; 0 = full attention")
    p.add_argument("--device", default="auto", help="where the target is loaded and the draft built: auto "
                                                    "(CUDA when torch sees a GPU, else the CPU), cpu, cuda or cuda:N")
    p.add_argument("--dtype", choices=DRAFT_DTYPES, default="float32",
                   help="what the draft drafts in (training is float32 either way; the target verifies "
                        "every token, so output does not change): bfloat16 halves the bytes a draft "
                        "token reads and uses AMX / AVX-512 BF16 where the CPU has them")
    p.add_argument("--memory", action="store_true",
                   help="feedback memory over the target's activations (SPIRe; train with `specgate draft train`)")


def run(args: argparse.Namespace) -> int:
    dev = resolve_device(args.device)
    synchronize(dev)
    t0 = time.perf_counter()
    out = build_draft(args.target, args.out, layers=args.layers, sink=args.sink,
                      window=args.window or None, memory=args.memory, device=str(dev), dtype=args.dtype)
    synchronize(dev)
    seconds = time.perf_counter() - t0
    spec = json.loads((out / "specgate_draft.json").read_text())
    n = sum(t.numel() for t in load_file(str(out / "model.safetensors")).values())
    print(f"draft written to {out}: blocks {spec['source_layers']} of the target, sink {spec['sink']}, "
          f"window {spec['window']}, memory from blocks {spec['memory_layers'] or 'none'}, drafts in {spec['dtype']}, "
          f"{n / 1e6:.1f}M parameters; built on {dev} in {seconds:.1f} s", file=sys.stderr)
    print(out)
    return 0
