"""The lean forward's weights, taken from a transformers `LlamaForCausalLM`-shaped model: each
decoder layer's norms and linears (q/k/v and gate/up fused into one linear each, since one matmul
costs less than three or two on tree-sized inputs), and the rope tables from the model's own
rotary module. Shared by the target's forward (workers/model/llama_forward.py) and the
feedback-memory draft's (workers/drafters/neural/memory_forward.py)."""
from __future__ import annotations

import torch

from workers.model.cpu_linear import Linear


def layer_weights(layer, gemm: str) -> dict:
    """One decoder layer's weights as the forward reads them, linears in the `gemm` layout."""
    att, mlp = layer.self_attn, layer.mlp
    # Fusing q/k/v and gate/up into one matmul each halves the per-layer op count.
    w = {
        "ln1": layer.input_layernorm.weight.detach(),
        "wqkv": Linear(*fused(att, "qkv_proj", "q_proj", "k_proj", "v_proj"), gemm),  # [(Hq+2Hkv)D, H]
        "wo": Linear(att.o_proj.weight, fused_bias(att.o_proj), gemm),             # [H, HqD]
        "ln2": layer.post_attention_layernorm.weight.detach(),
        "wgu": Linear(*fused(mlp, "gate_up_proj", "gate_proj", "up_proj"), gemm),  # [2I, H]
        "wdown": Linear(mlp.down_proj.weight, fused_bias(mlp.down_proj), gemm),    # [H, I]
    }
    # Qwen3: RMSNorm over each head before the rope (a transformers module's optional part)
    if getattr(att, "q_norm", None) is not None:
        w["q_norm"], w["k_norm"] = att.q_norm.weight.detach(), att.k_norm.weight.detach()   # [D] each
        w["qk_eps"] = att.q_norm.variance_epsilon
    return w


def rope_tables(rotary_emb, max_positions: int, dtype: torch.dtype,
                device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [P, D] of every position; from the model's own rotary module, so every rope
    scaling type transformers knows is honoured."""
    positions = torch.arange(max_positions, device=device)[None, :]
    probe = torch.zeros(1, dtype=dtype, device=device)
    cos, sin = rotary_emb(probe, positions)
    return cos[0].contiguous(), sin[0].contiguous()


def fused(module, fused_name: str, *parts: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The weight [sum of outs, in] and bias of `parts` stacked in that order, or of the one
    linear `fused_name` where the checkpoint already stacks them so (Phi-3's qkv_proj and
    gate_up_proj: q, k, v and gate, up, the order the forward reads them in)."""
    if getattr(module, fused_name, None) is not None:
        lin = getattr(module, fused_name)
        return lin.weight, fused_bias(lin)
    linears = [getattr(module, name) for name in parts]
    return torch.cat([lin.weight for lin in linears]), fused_bias(*linears)


def fused_bias(*linears) -> torch.Tensor | None:
    """The bias of the linears' weights stacked into one, zeros for any without one (so one
    projection's bias never needs the others'); None where none has one."""
    if all(lin.bias is None for lin in linears):
        return None
    return torch.cat([lin.weight.new_zeros(lin.weight.shape[0]) if lin.bias is None else lin.bias.detach()
                      for lin in linears])
