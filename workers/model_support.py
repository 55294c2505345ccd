"""What of a transformers checkpoint the lean forward computes, and what makes it refuse one.

The lean forward (workers/llama_forward.py) implements the Llama-family block: RMSNorm, rotary
attention with grouped KV heads (any rope scaling transformers knows: it reuses the model's own
rotary module), q/k/v biases, and a SiLU-gated MLP. A checkpoint whose config or weights ask for
more would decode text that is not its model's, so the forward refuses it at load, naming each
such feature (`unsupported`), instead of running it silently wrong.

Sliding-window attention (Mistral; Qwen2 with `use_sliding_window`) is exact as long as no
sequence is longer than the window: every key is then inside every query's window. The forward
serves such a model with its context limited to the window (`attention_window`), so a longer
request is refused with a context-length error rather than decoded wrong.
"""
from __future__ import annotations

from typing import Any

SILU = ("silu", "swish")


def _nonzero(bias: Any) -> bool:
    # a bias of zeros (e.g. a config's attention_bias=True on freshly built weights) changes nothing
    return bias is not None and bool(bias.detach().abs().max() > 0)


def unsupported(hf_model: Any) -> list[str]:
    """Every feature of `hf_model` that changes the math and the lean forward does not compute,
    in words a user can find in the config or the weights. Empty: the forward is exact."""
    cfg = hf_model.config
    found = []
    act = getattr(cfg, "hidden_act", "silu")
    if act not in SILU:
        found.append(f"hidden_act={act!r} (only a SiLU-gated MLP is implemented)")
    factor = getattr(cfg, "partial_rotary_factor", 1.0)
    if factor not in (None, 1, 1.0):
        found.append(f"partial_rotary_factor={factor} (rotary embedding over part of each head)")
    for name in ("attn_logit_softcapping", "final_logit_softcapping"):
        if getattr(cfg, name, None) is not None:
            found.append(f"{name}={getattr(cfg, name)}")
    layers = hf_model.model.layers
    if any(_nonzero(layer.self_attn.o_proj.bias) for layer in layers):
        found.append("an o_proj bias (attention_bias=True with trained output biases)")
    mlp = [getattr(layer.mlp, n, None) for layer in layers for n in ("gate_proj", "up_proj", "down_proj")]
    if any(m is not None and _nonzero(getattr(m, "bias", None)) for m in mlp):
        found.append("MLP biases (mlp_bias=True)")
    if layers:
        att = layers[0].self_attn
        if len({p.bias is None for p in (att.q_proj, att.k_proj, att.v_proj)}) > 1:
            found.append("biases on some of q/k/v but not all")
    return found


def attention_window(cfg: Any) -> int | None:
    """The sliding window any layer of this config attends within (keys a query sees, itself
    included), or None when every layer attends over the whole context."""
    window = getattr(cfg, "sliding_window", None)
    if not window:
        return None
    types = getattr(cfg, "layer_types", None)
    if types is not None:
        return int(window) if "sliding_attention" in types else None
    if getattr(cfg, "model_type", "") == "qwen2":
        return int(window) if getattr(cfg, "use_sliding_window", False) else None
    return int(window)
