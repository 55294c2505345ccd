"""Feedback memory for a pruned draft (SPIRe, after the Feedback Transformer).

Attention in draft block i reads, besides the tokens' keys and values, one *memory vector* per
earlier position t:

    m_i(t) = Σ_s softmax(w_i)_s · tap_s(t)

a learned softmax mix (`mix`, [blocks, taps]) of that position's taps. At a committed position
the taps are the **target's** (its token embedding and the outputs of the blocks in
`DraftSpec.memory_layers`: the verifier computed them in the pass that committed the position,
workers/speculation/target_taps.py); at a position the target has not read yet (the root, the tree's nodes)
they are the draft's own (its embedding and each of its blocks' outputs), so the draft needs as
many memory layers as it has blocks. The memory enters attention through the block's own input
norm and key/value projections (rotated at position t), so it adds no weights but `mix` and one
*gate* per block: a learned bias on the attention scores of its memory keys. The gate starts
nearly closed (`GATE_OFF`): a pruned draft's blocks were not made to read memory, and an open,
untrained memory perturbs them (their greedy acceptance starts far below the same draft's
without memory), so training opens it as far as it pays.

What a row at position q sees of the memory: positions t < q only (a position's memory exists
once every block has run on it), under the draft's sink + window rule
(`workers.drafters.neural.draft_model.sparse_mask`), so the memory is as bounded as the KV.

Training (`train_logits`) mirrors drafting exactly with SPIRe's cheap k-step scheme: for every
k-th prefix (block start j = q − q mod k) the positions before j read the target's taps and the
positions j..q−1 the draft's own, as when drafting k tokens from a root at j. Pass s (0..k−1) of
the k passes over the whole sequence computes the rows with q mod k == s; the draft's own taps of
the earlier rows of each block come from the earlier passes. With k = 1 every row reads the
target's memory only: one parallel pass. Inference lives in workers/drafters/neural/memory_forward.py.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from workers.drafters.neural.draft_model import DraftSpec, sparse_mask

__all__ = ["MemoryDraft", "memory_masks", "default_memory_layers", "MIX_KEY", "GATE_KEY", "GATE_OFF"]

MIX_KEY = "memory_mix"      # specgate_draft.json: the learned mix, [blocks][taps]
GATE_KEY = "memory_gate"    # specgate_draft.json: the learned gate, [blocks]
# e^-4 ≈ 0.018: the memory's keys weigh about 2% of what the same scores would give a token's
# key, small enough to leave the pruned blocks as they were, large enough for a gradient
GATE_OFF = -4.0


def default_memory_layers(target_layers: int, draft_blocks: int) -> tuple[int, ...]:
    """Target blocks whose outputs feed the memory: evenly spaced, the last block last.

    NOTE: SPIRe's memory reads the target's activations; which blocks, and how many, is ours:
    one per draft block (so the draft's own outputs can stand in where the target has not run),
    spread over the target's depth so the draft sees its deepest state too.

    >>> default_memory_layers(30, 3), default_memory_layers(2, 2)
    ((9, 19, 29), (0, 1))
    """
    return tuple(round((j + 1) * target_layers / draft_blocks) - 1 for j in range(draft_blocks))


def memory_masks(length: int, k: int, sink: int, window: int | None) -> dict[str, torch.Tensor]:
    """Additive masks [T, T] of k-step training, all under the sink + window rule. Row q with
    block start j = q − q mod k reads, as when drafting from a root at j:

    * ``context``: the tokens before j, as the committed text computed them (pass 0, where every
      row reads the target's memory only), t < j;
    * ``block``: the tokens j..q of this pass;
    * ``target``: the target's memory, t < j (``first``: pass 0's, t < q);
    * ``own``: the draft's own memory, j <= t < q.

    >>> m = memory_masks(4, 2, 0, None)
    >>> [(m[n] == 0).int().tolist()[3] for n in ("context", "block", "target", "own", "first")]
    [[1, 1, 0, 0], [0, 0, 1, 1], [1, 1, 0, 0], [0, 0, 1, 0], [1, 1, 1, 0]]
    """
    pos = torch.arange(length)
    band = sparse_mask(pos, pos, sink, window)                                    # [T, T]
    start = (pos - pos % k)[:, None]
    t, q = pos[None, :], pos[:, None]
    hidden = lambda visible: torch.zeros(length, length).masked_fill_(~visible, float("-inf"))  # noqa: E731
    return {"context": band + hidden(t < start), "block": band + hidden(t >= start),
            "target": band + hidden(t < start), "own": band + hidden((t >= start) & (t < q)),
            "first": band + hidden(t < q)}


class MemoryDraft(torch.nn.Module):
    """A pruned Llama-family draft (a transformers model) with feedback memory: the block math
    both training and inference use, and the k-step training forward."""

    def __init__(self, hf_model, spec: DraftSpec, mix: torch.Tensor | None = None,
                 gate: torch.Tensor | None = None):
        super().__init__()
        cfg = hf_model.config
        self.hf = hf_model
        self.spec = spec
        self.blocks = cfg.num_hidden_layers
        if len(spec.memory_layers) != self.blocks:
            raise ValueError(f"a memory draft needs one memory layer per block: {self.blocks} blocks, "
                             f"memory_layers {spec.memory_layers}")
        self.taps = self.blocks + 1
        self.n_heads = cfg.num_attention_heads
        self.n_kv_heads = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.hidden = cfg.hidden_size
        self.vocab_size = cfg.vocab_size
        # zeros: every tap weighs the same at first; training finds the mix
        self.mix = torch.nn.Parameter(torch.zeros(self.blocks, self.taps) if mix is None else mix.clone().float())
        self.gate = torch.nn.Parameter(torch.full((self.blocks,), GATE_OFF) if gate is None
                                       else gate.clone().float().reshape(self.blocks))
        with torch.no_grad():
            positions = torch.arange(cfg.max_position_embeddings)[None]
            probe = hf_model.model.embed_tokens.weight[:1]
            cos, sin = hf_model.model.rotary_emb(probe, positions)
        self.register_buffer("cos", cos[0].float(), persistent=False)            # [P, D]
        self.register_buffer("sin", sin[0].float(), persistent=False)            # [P, D]

    @classmethod
    def from_spec(cls, hf_model, spec: DraftSpec) -> "MemoryDraft":
        """The draft with the mix and gate its spec saved (`learned`), or fresh ones."""
        mix, gate = spec.extra.get(MIX_KEY), spec.extra.get(GATE_KEY)
        return cls(hf_model, spec, None if mix is None else torch.tensor(mix),
                   None if gate is None else torch.tensor(gate))

    def learned(self) -> dict[str, list]:
        """What a spec's `extra` keeps of this draft besides the transformers weights."""
        return {MIX_KEY: self.mix.detach().float().tolist(), GATE_KEY: self.gate.detach().float().tolist()}

    # -- block math, shared with inference ------------------------------------------------------

    def memory(self, i: int, taps: torch.Tensor) -> torch.Tensor:
        """Block i's memory vectors: taps [..., S, H] -> [..., H]."""
        w = torch.softmax(self.mix[i], dim=-1)                                     # [S]
        return torch.einsum("s,...sh->...h", w.to(taps.dtype), taps)

    def project(self, i: int, x: torch.Tensor, positions: torch.Tensor, queries: bool = True):
        """Block i's rotated queries (if `queries`), keys and values of inputs x [..., T, H] (the
        residual stream, or memory vectors) at `positions` [T]: q [..., Hq, T, D], k and v
        [..., Hkv, T, D]."""
        att = self.hf.model.layers[i].self_attn
        h = self.hf.model.layers[i].input_layernorm(x)
        shape = (*h.shape[:-1], -1, self.head_dim)                                 # [..., T, heads, D]
        k = att.k_proj(h).view(shape)
        v = att.v_proj(h).view(shape).transpose(-2, -3)
        if getattr(att, "k_norm", None) is not None:                               # Qwen3
            k = att.k_norm(k)
        cos, sin = self.cos[positions].to(h.dtype), self.sin[positions].to(h.dtype)   # [T, D]
        k = _rope(k.transpose(-2, -3), cos, sin)
        if not queries:
            return None, k, v
        q = att.q_proj(h).view(shape)
        if getattr(att, "q_norm", None) is not None:
            q = att.q_norm(q)
        return _rope(q.transpose(-2, -3), cos, sin), k, v

    def finish(self, i: int, x: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        """The rest of block i after attention: attended [..., Hq, T, D] -> the block's output."""
        layer = self.hf.model.layers[i]
        out = attended.transpose(-2, -3).flatten(-2)                               # [..., T, Hq*D]
        x = x + layer.self_attn.o_proj(out)
        return x + layer.mlp(layer.post_attention_layernorm(x))

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return self.hf.lm_head(self.hf.model.norm(x))

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.hf.model.embed_tokens(ids)

    # -- training -----------------------------------------------------------------------------

    def train_logits(self, ids: torch.Tensor, target_taps: torch.Tensor, k: int = 1) -> torch.Tensor:
        """The draft's logits [B, T, V] for every position of ids [B, T], reading the target's
        taps target_taps [B, T, S, H] before each row's block start and its own after (module
        docstring); k passes over the sequence. Pass 0 is the committed text's own pass (every
        row reads the target's memory); its keys and values are what later passes read of the
        tokens before a block, as drafting reads the cached KV of the committed text. Pass s
        runs only the rows at offsets 0..s of their block (what its rows at offset s read), so
        k passes cost about (k + 1) / 2 full ones."""
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        b, t = ids.shape
        pos = torch.arange(t, device=ids.device)
        m = {n: v.to(ids.device) for n, v in memory_masks(t, k, self.spec.sink, self.spec.window).items()}
        band = sparse_mask(pos, pos, self.spec.sink, self.spec.window).to(ids.device)   # [T, T]
        target_kv: list[tuple[torch.Tensor, torch.Tensor]] = []     # per block, the same every pass
        context_kv: list[tuple[torch.Tensor, torch.Tensor]] = []    # per block, pass 0's token KV
        own = torch.zeros(b, t, self.taps, self.hidden, dtype=target_taps.dtype, device=ids.device)
        parts, order = [], []
        for s in range(min(k, t)):
            live = pos % k <= s if s else torch.ones(t, dtype=torch.bool, device=ids.device)   # [T]
            at = pos[live]                                                         # [T_s] positions
            rows = at % k == s                                                     # [T_s] this pass's
            x = self.embed(ids[:, live])                                           # [B, T_s, H]
            outs = [x]
            for i in range(self.blocks):
                q, kt, vt = self.project(i, x, at)
                if s == 0:
                    target_kv.append(self.project(i, self.memory(i, target_taps), pos, queries=False)[1:])
                    context_kv.append((kt, vt))
                    keys, values = [kt, target_kv[i][0]], [vt, target_kv[i][1]]
                    masks = [band, m["first"] + self.gate[i]]
                else:
                    _, dk, dv = self.project(i, self.memory(i, own), pos, queries=False)
                    keys = [context_kv[i][0], kt, target_kv[i][0], dk]
                    values = [context_kv[i][1], vt, target_kv[i][1], dv]
                    masks = [m["context"][live], m["block"][live][:, live], m["target"][live] + self.gate[i],
                             m["own"][live] + self.gate[i]]
                att = F.scaled_dot_product_attention(q, torch.cat(keys, -2), torch.cat(values, -2),
                                                     attn_mask=torch.cat(masks, -1), enable_gqa=True)
                x = self.finish(i, x, att)
                outs.append(x)
            parts.append(self.logits(x[:, rows]))                                  # [B, n_s, V]
            order.append(at[rows])
            if s < k - 1:                       # this pass's rows: the draft's own taps from now on
                mine = torch.zeros(t, dtype=torch.bool, device=ids.device)
                mine[at[rows]] = True
                fresh = torch.zeros_like(own)
                fresh[:, at[rows]] = torch.stack(outs, dim=2)[:, rows]
                own = torch.where(mine[None, :, None, None], fresh, own)
        logits = torch.cat(parts, dim=1)                                           # [B, T, V] by pass
        return logits[:, torch.argsort(torch.cat(order))]


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of x [..., heads, T, D] with cos, sin [T, D] (transformers' rotate_half)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin
