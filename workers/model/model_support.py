"""What of a transformers checkpoint the lean forward computes, and what makes it refuse one.

The lean forward (workers/model/llama_forward.py) implements the Llama-family block: RMSNorm, rotary
attention with grouped KV heads (the rope scalings whose frequencies depend on the position
alone: it reuses the model's own rotary module), biases on any of the q/k/v/o projections and on the MLP's, Qwen3's per-head q/k
RMSNorm, a SiLU-gated MLP, and sliding-window attention per layer (`layer_windows`). A checkpoint
whose config or weights ask for more would decode text that is not its model's, so the forward
refuses it at load, naming each such feature (`unsupported`), instead of running it silently wrong.

Sliding windows follow transformers' own masks (masking_utils.sliding_window_overlay): a query at
position q sees a key at position k iff k <= q and q - k < window. Mistral and Phi-3 apply their
window on every layer (their modeling ignores `layer_types`); Qwen2 and Qwen3 only with
`use_sliding_window`, on the layers `layer_types` marks "sliding_attention" (by default those from
`max_window_layers` on).

Rope: the forward tabulates cos/sin once per position, which is exact for every rope type whose
frequencies depend on the position alone, and for "dynamic" (transformers rescales only past
`max_position_embeddings`, which the forward never reaches). "longrope" (Phi-3's 128k models)
switches every position's frequencies when a forward's sequence passes
`original_max_position_embeddings`, keys already cached included, so it is refused where the
context can pass that.
"""
from __future__ import annotations

from typing import Any

SILU = ("silu", "swish")
# The attention kinds of `config.layer_types` the forward computes (`layer_windows`).
LAYER_TYPES = ("full_attention", "sliding_attention")
# Model types whose modeling applies `sliding_window` on every layer, whatever `layer_types` says.
WINDOW_ON_EVERY_LAYER = ("mistral", "phi3")


def unsupported(hf_model: Any) -> list[str]:
    """Every feature of `hf_model` that changes the math and the lean forward does not compute,
    in words a user can find in the config or the weights. Empty: the forward is exact."""
    cfg = hf_model.config
    found = []
    act = getattr(cfg, "hidden_act", "silu")
    if act not in SILU:
        found.append(f"hidden_act={act!r} (only a SiLU-gated MLP is implemented)")
    rope = getattr(cfg, "rope_parameters", None) or {}
    for factor in (getattr(cfg, "partial_rotary_factor", None), rope.get("partial_rotary_factor")):
        if factor not in (None, 1, 1.0):
            found.append(f"partial_rotary_factor={factor} (rotary embedding over part of each head)")
            break
    for name in ("attn_logit_softcapping", "final_logit_softcapping"):
        if getattr(cfg, name, None) is not None:
            found.append(f"{name}={getattr(cfg, name)}")
    if rope.get("rope_type") == "longrope":
        original = rope.get("original_max_position_embeddings") or getattr(cfg, "original_max_position_embeddings", None)
        if original is not None and cfg.max_position_embeddings > original:
            found.append(f"rope_type 'longrope' past original_max_position_embeddings={original} "
                         f"(its frequencies change with the sequence's length)")
    kinds = sorted(set(getattr(cfg, "layer_types", None) or ()) - set(LAYER_TYPES))
    if kinds and getattr(cfg, "model_type", "") not in WINDOW_ON_EVERY_LAYER:
        found.append(f"layer_types {', '.join(map(repr, kinds))} (only full and sliding-window "
                     f"attention are implemented)")
    return found


def layer_windows(cfg: Any) -> list[int | None]:
    """Per decoder layer, the sliding window it attends within (keys a query sees, itself
    included), or None where the layer attends over the whole context."""
    n = cfg.num_hidden_layers
    window = getattr(cfg, "sliding_window", None)
    if getattr(cfg, "model_type", "") in ("qwen2", "qwen3") and not getattr(cfg, "use_sliding_window", False):
        window = None                     # their configs keep a window that is off by default
    if not window:
        return [None] * n
    types = getattr(cfg, "layer_types", None)
    if types is None or getattr(cfg, "model_type", "") in WINDOW_ON_EVERY_LAYER:
        if getattr(cfg, "model_type", "") in ("qwen2", "qwen3"):
            start = getattr(cfg, "max_window_layers", 0)
            return [int(window) if i >= start else None for i in range(n)]
        return [int(window)] * n
    return [int(window) if t == "sliding_attention" else None for t in types]
