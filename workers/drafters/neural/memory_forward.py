"""Drafting with a feedback-memory draft: its forward over packed rows and per-request caches.

The same packed-rows interface as `workers.model.llama_forward.LlamaForward` (`forward(ids, positions,
segments, logit_rows)`, `new_cache`), so `workers.drafters.model.ModelDrafter` grows trees with
it unchanged. Each cache holds, per block, the tokens' keys and values in heads [0, Hkv) and the
memory's in heads [Hkv, 2·Hkv) of the same slot (`KVCache` with twice the KV heads): memory and
tokens share slots and positions, so `SparseKV` packs both to sink + window at once and a row's
`past` mask serves both. The math is `MemoryDraft`'s (workers/drafters/neural/draft_memory.py).

Which memory a slot holds: the target's taps where the caller gives them (`taps`, `known`: the
prompt and every committed token the verifier has read), else the draft's own, written after
the pass that computed the row (a row's memory needs every block's output at it). So inside one
pass a row reads the memory of earlier rows of that pass only where it is the target's; the
root's own memory is replaced by the target's once a later step's taps bring it (`write_memory`).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from workers.model.cpu_linear import Linear, pick_backend
from workers.drafters.neural.draft_memory import MemoryDraft, _rope
from workers.model.kv_cache import KVCache
from workers.model.llama_weights import fused, fused_bias
from workers.model.packed_attention import Segment

__all__ = ["MemoryForward"]


class MemoryForward:
    def __init__(self, draft: MemoryDraft, gemm: str | None = None):
        """`gemm`: the linears' layout (workers/model/cpu_linear.py; None: this machine's fastest).
        The blocks' linears are packed once as the lean forward packs the target's (q/k/v and
        gate/up fused): drafting is the few-row case those layouts are for. The draft must not
        be trained further after this (the packed copies would not follow)."""
        self.draft = draft.eval()
        self.n_layers = draft.blocks
        self.n_kv_heads = draft.n_kv_heads
        self.head_dim = draft.head_dim
        self.vocab_size = draft.vocab_size
        self.dtype = draft.hf.model.embed_tokens.weight.dtype
        self.device = draft.hf.model.embed_tokens.weight.device
        self.gemm = pick_backend(self.device, self.dtype, gemm)
        with torch.no_grad():
            self.blocks = [_pack(layer, self.gemm) for layer in draft.hf.model.layers]
            self.lm_head = Linear(draft.hf.lm_head.weight.detach(), None, self.gemm)
        self.eps = draft.hf.config.rms_norm_eps
        self.silu = getattr(draft.hf.config, "hidden_act", "silu") == "silu"
        self.head = None        # a CheapHead (workers/drafters/neural/cheap_head.py) in place of the full one

    def new_cache(self, capacity: int) -> KVCache:
        """Tokens' KV in heads [0, Hkv), the memory's in [Hkv, 2·Hkv) (module docstring)."""
        return KVCache(self.n_layers, 2 * self.n_kv_heads, self.head_dim, capacity, self.dtype, self.device)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, segments: list[Segment],
                logit_rows: torch.Tensor | None, taps: torch.Tensor | None = None,
                known: torch.Tensor | None = None) -> torch.Tensor | None:
        """Logits [R, V] of `logit_rows` (or None); writes every row's token KV and memory to its
        segment's cache at slots [length, length + rows) (the caller advances `length`).

        input_ids, positions: [T]; taps: [T, S, H] the target's taps of the rows where `known`
        [T] bool (None: none known)."""
        d = self.draft
        for seg in segments:
            if seg.cache.length + seg.rows > seg.cache.capacity:
                raise ValueError(f"KV capacity {seg.cache.capacity} exceeded ({seg.cache.length} + {seg.rows} rows)")
        t = input_ids.numel()
        if known is None:
            known = torch.zeros(t, dtype=torch.bool)
        x = d.embed(input_ids)                                                     # [T, H]
        outs = [x]
        masks = [self._masks(seg, known[seg.start: seg.start + seg.rows]) for seg in segments]
        for i in range(self.n_layers):
            q, k, v = self._project(i, x, positions)              # q [Hq, T, D]; k, v [Hkv, T, D]
            mk = mv = None
            if bool(known.any()):
                _, mk, mv = self._project(i, d.memory(i, taps[known].to(x.dtype)), positions[known], False)
            self._store(i, segments, k, v, known, mk, mv)
            att = torch.empty_like(q)                                              # [Hq, T, D]
            gate = d.gate[i].to(self.dtype)
            for seg, mask in zip(segments, masks):
                half = mask.shape[1] // 2              # tokens, then memory (`_masks`)
                gated = torch.cat([mask[:, :half], mask[:, half:] + gate], dim=1)
                att[:, seg.start: seg.start + seg.rows] = self._attend(i, seg, q, gated)
            x = self._finish(i, x, att)
            outs.append(x)
        own = torch.stack(outs, dim=1)                                             # [T, S, H]
        unknown = ~known
        if bool(unknown.any()):                 # the draft's own memory, for the rows after these
            for i in range(self.n_layers):
                _, mk, mv = self._project(i, d.memory(i, own[unknown]), positions[unknown], False)
                self._store_memory(i, segments, unknown, mk, mv)
        if logit_rows is None:
            return None
        hidden = F.rms_norm(x[logit_rows], (x.shape[-1],), d.hf.model.norm.weight, self.eps)   # [R, H]
        return (self.head or self.lm_head)(hidden)

    @torch.inference_mode()
    def write_memory(self, cache: KVCache, slots: torch.Tensor, positions: torch.Tensor,
                     taps: torch.Tensor) -> None:
        """Replace the memory at cached `slots` (positions `positions`, [n]) with the target's
        taps [n, S, H]: a root's memory, once the step that read it reports its taps."""
        d, h = self.draft, self.n_kv_heads
        for i in range(self.n_layers):
            _, mk, mv = self._project(i, d.memory(i, taps.to(self.dtype)), positions, False)   # [Hkv, n, D]
            cache.k[i, h:, slots] = mk
            cache.v[i, h:, slots] = mv

    # -- block math (MemoryDraft's, on the packed linears) ----------------------------------------

    def _project(self, i: int, x: torch.Tensor, positions: torch.Tensor, queries: bool = True):
        """`MemoryDraft.project` for rows x [T, H]: q [Hq, T, D] (None unless `queries`), k, v [Hkv, T, D]."""
        w, d = self.blocks[i], self.draft
        h = F.rms_norm(x, (x.shape[-1],), w["ln1"], w["eps1"])
        if queries:
            qkv = w["wqkv"](h).view(h.shape[0], -1, self.head_dim)                 # [T, Hq+2Hkv, D]
            nq = d.n_heads
            q, k, v = qkv[:, :nq], qkv[:, nq: nq + self.n_kv_heads], qkv[:, nq + self.n_kv_heads:]
        else:
            kv = w["wkv"](h).view(h.shape[0], -1, self.head_dim)                   # [T, 2Hkv, D]
            q, k, v = None, kv[:, : self.n_kv_heads], kv[:, self.n_kv_heads:]
        if "k_norm" in w:                                                          # Qwen3
            k = F.rms_norm(k, (self.head_dim,), w["k_norm"], w["qk_eps"])
            q = None if q is None else F.rms_norm(q, (self.head_dim,), w["q_norm"], w["qk_eps"])
        cos, sin = d.cos[positions].to(x.dtype), d.sin[positions].to(x.dtype)      # [T, D]
        k = _rope(k.transpose(0, 1), cos, sin)
        q = None if q is None else _rope(q.transpose(0, 1), cos, sin)
        return q, k, v.transpose(0, 1)

    def _finish(self, i: int, x: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        """`MemoryDraft.finish`: attended [Hq, T, D] -> block i's output [T, H]."""
        w = self.blocks[i]
        if not self.silu:
            return self.draft.finish(i, x, attended)
        x = x + w["wo"](attended.transpose(0, 1).flatten(1))
        gate, up = w["wgu"](F.rms_norm(x, (x.shape[-1],), w["ln2"], w["eps2"])).chunk(2, dim=-1)
        return x + w["wdown"](F.silu(gate) * up)

    # -- per segment -------------------------------------------------------------------------

    def _masks(self, seg: Segment, known: torch.Tensor) -> torch.Tensor:
        """[rows, 2·(length + rows)] additive: tokens (past, own), then memory (past, own rows
        strictly earlier and known), before each block's gate."""
        n, length = seg.rows, seg.cache.length
        past = seg.past if seg.past is not None else torch.zeros(n, length)
        own = seg.mask.float()
        earlier = own.clone()
        earlier.fill_diagonal_(float("-inf"))
        earlier[:, ~known] = float("-inf")
        return torch.cat([past.float(), own, past.float(), earlier], dim=1).to(self.dtype)

    def _attend(self, i: int, seg: Segment, q: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h, end = self.n_kv_heads, seg.cache.length + seg.rows
        k, v = seg.cache.k[i, :, :end], seg.cache.v[i, :, :end]                    # [2Hkv, end, D]
        keys = torch.cat([k[:h], k[h:]], dim=1)                                    # [Hkv, 2 end, D]
        values = torch.cat([v[:h], v[h:]], dim=1)
        rows = q[:, seg.start: seg.start + seg.rows]                               # [Hq, rows, D]
        return F.scaled_dot_product_attention(rows[None], keys[None], values[None], attn_mask=mask,
                                              enable_gqa=True)[0]

    def _store(self, i: int, segments: list[Segment], k: torch.Tensor, v: torch.Tensor, known: torch.Tensor,
               mk: torch.Tensor | None, mv: torch.Tensor | None) -> None:
        h = self.n_kv_heads
        for seg in segments:
            lo, hi, at = seg.start, seg.start + seg.rows, seg.cache.length
            seg.cache.k[i, :h, at: at + seg.rows] = k[:, lo:hi]
            seg.cache.v[i, :h, at: at + seg.rows] = v[:, lo:hi]
            seg.cache.k[i, h:, at: at + seg.rows] = 0      # masked until written, but never garbage
            seg.cache.v[i, h:, at: at + seg.rows] = 0      # (0 weight times NaN is NaN)
        if mk is not None:
            self._store_memory(i, segments, known, mk, mv)

    def _store_memory(self, i: int, segments: list[Segment], rows: torch.Tensor, mk: torch.Tensor,
                      mv: torch.Tensor) -> None:
        """Memory keys/values mk, mv [Hkv, n, D] of the packed rows where `rows` ([T] bool)."""
        h = self.n_kv_heads
        index = torch.cumsum(rows.long(), 0) - 1                                   # row -> its column in mk
        for seg in segments:
            mine = torch.nonzero(rows[seg.start: seg.start + seg.rows]).flatten()
            if mine.numel():
                slots = seg.cache.length + mine
                seg.cache.k[i, h:, slots] = mk[:, index[seg.start + mine]]
                seg.cache.v[i, h:, slots] = mv[:, index[seg.start + mine]]


def _pack(layer, gemm: str) -> dict:
    """One block's weights in the lean forward's packed layouts (workers/model/llama_weights.py)."""
    att, mlp = layer.self_attn, layer.mlp
    w = {"ln1": layer.input_layernorm.weight.detach(), "eps1": layer.input_layernorm.variance_epsilon,
         "ln2": layer.post_attention_layernorm.weight.detach(),
         "eps2": layer.post_attention_layernorm.variance_epsilon,
         "wqkv": Linear(*fused(att, "qkv_proj", "q_proj", "k_proj", "v_proj"), gemm),
         "wkv": Linear(torch.cat([att.k_proj.weight, att.v_proj.weight]).detach(),
                       fused_bias(att.k_proj, att.v_proj), gemm),
         "wo": Linear(att.o_proj.weight.detach(), fused_bias(att.o_proj), gemm),
         "wgu": Linear(*fused(mlp, "gate_up_proj", "gate_proj", "up_proj"), gemm),
         "wdown": Linear(mlp.down_proj.weight.detach(), fused_bias(mlp.down_proj), gemm)}
    if getattr(att, "q_norm", None) is not None:
        w.update(q_norm=att.q_norm.weight.detach(), k_norm=att.k_norm.weight.detach(),
                 qk_eps=att.q_norm.variance_epsilon)
    return w
