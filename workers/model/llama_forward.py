"""A lean forward pass for Llama-family targets over packed, tree-shaped inputs.

Why not call the transformers model directly: a transformers forward spends most of its time on
per-operation overhead, its cache layout forces every batch row to share one column index (so
requests of different lengths would be re-packed, i.e. copied, every step), and it computes logits
for every input row. Here the rows of all requests in a step are packed into one sequence; the
linear layers run once over all rows, attention runs per request against that request's own
preallocated KV (`KVCache`), and logits are computed only for the rows acceptance needs.

The weights are taken from a transformers `LlamaForCausalLM`-shaped model (Llama, SmolLM, Mistral,
Qwen2, Qwen3, Phi-3: what of their configs is computed and what is refused is workers/model/model_support.py);
transformers stays the reference in the exactness tests (tests/unit/test_conformance.py).

Sliding-window attention: a layer with a window hides from a row at position p every key at
position p - window or earlier, on top of the segment's own masks. The forward works the
windowed masks out from the rows' `positions` and the cache's slots, since a target's cache
slot j holds position j (the verifier and the prefix cache keep it so), once a pass and only when
some row is that far along. The KV keeps every slot, including those no query can see again:
exact, and no more memory than a model without a window, since the planner's KV budget bounds
every request's cache anyway; trimming the cache to the window would save memory for long
contexts, at the cost of slots that no longer equal positions. A draft model's cache does not
keep slots at their positions (workers/drafters/neural/draft_model.py packs it to sink + window), so a draft
builds its forward with `windowed=False` and its own `past` masks say what each row sees.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch
import torch.nn.functional as F

from workers.model import batched_attention, small_gemm
from workers.model.cpu_linear import Linear, pick_backend
from workers.model.kv_cache import KVCache
from workers.model.model_support import layer_windows, unsupported


@dataclass
class Segment:
    """One request's rows in a packed forward pass."""
    cache: KVCache
    start: int            # first packed row of this request
    rows: int             # pending tokens + tree nodes
    mask: torch.Tensor    # [rows, rows] additive float mask among the new rows (0 = visible, -inf = hidden)
    # [rows, cache.length] additive float mask over the cached slots; None = every slot visible.
    # Drafts use it: sliding-window attention, and tree nodes kept in the cache while drafting.
    past: torch.Tensor | None = None


class LlamaForward:
    def __init__(self, hf_model, *, gemm: str | None = None, windowed: bool = True,
                 attention: str | None = None):
        """`gemm`: the linears' weight layout, one of workers.model.cpu_linear.BACKENDS; None: the fastest
        known for this machine, device and dtype (`pick_backend`). `windowed`: apply the model's
        sliding windows (False: the caller's masks alone say what a row sees, for a cache whose
        slots are not positions: a draft's). `attention`: how the segments torch attends for
        are batched, loop, padded or flex (workers/model/batched_attention.py; None: SPECGATE_ATTENTION,
        else auto)."""
        cfg = hf_model.config
        if getattr(cfg, "model_type", "") not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"model type {cfg.model_type!r} is not supported by the lean forward; "
                             f"supported: {', '.join(sorted(SUPPORTED_MODEL_TYPES))}")
        problems = unsupported(hf_model)
        if problems:
            raise ValueError(f"this {cfg.model_type} checkpoint uses what the lean forward does not "
                             f"compute, so it would not decode as its model does: {'; '.join(problems)}")
        self.n_layers = cfg.num_hidden_layers
        self.n_heads = cfg.num_attention_heads
        self.n_kv_heads = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.hidden = cfg.hidden_size
        self.eps = cfg.rms_norm_eps
        # per layer, the sliding window it attends within (None: the whole context)
        self.windows: list[int | None] = layer_windows(cfg) if windowed else [None] * self.n_layers
        self.max_positions = cfg.max_position_embeddings
        self.vocab_size = cfg.vocab_size
        inner = hf_model.model
        self.dtype = inner.embed_tokens.weight.dtype
        self.device = inner.embed_tokens.weight.device
        self.gemm = pick_backend(self.device, self.dtype, gemm)
        self.attention = batched_attention.resolve_attention(attention, self.device)
        # The fused CPU ops (workers/model/small_gemm.py) where they run: RMSNorm with the residual add
        # and SwiGLU
        self.fused = small_gemm.available(self.dtype, self.device)
        # The fused CPU kernels also do the step's rope + KV write and its attention
        # (workers/model/csrc/attention.cpp), for the head sizes that kernel is built for.
        self.fused_attention = self.fused and self.head_dim in small_gemm.ATTENTION_HEAD_DIMS
        # KV in the weights' dtype, except bf16 weights on CPU without that kernel: torch's bf16
        # flash attention there is slow for few query rows (the whole forward ran markedly faster
        # with a float32 KV). The kernel reads bf16 KV into float32 arithmetic: half the bytes of
        # a float32 KV, and faster for both many requests and one deep tree (README.md, "CPU
        # kernels and weight layouts").
        self.kv_dtype = (torch.float32 if self.device.type == "cpu" and self.dtype == torch.bfloat16
                         and not self.fused_attention else self.dtype)
        with torch.no_grad():
            self.embed = inner.embed_tokens.weight.detach()              # [V, H]
            self.lm_head = Linear(hf_model.lm_head.weight, None, self.gemm)   # [V, H]
            self.final_norm = inner.norm.weight.detach()                 # [H]
            self.layers = [self._layer_weights(layer) for layer in inner.layers]
            self.cos, self.sin = self._rope_tables(inner.rotary_emb)     # [P, D] each
            # rotate_half(x) * sin == roll(x, D/2) * sin with its first half negated: one op
            # instead of four (slice, slice, neg, cat), and bitwise the same result.
            half = self.head_dim // 2
            self.sin_signed = torch.cat([-self.sin[:, :half], self.sin[:, half:]], dim=-1)   # [P, D]
        self._stack_of, self._stack_rows = self._layer_stacks(cfg.intermediate_size)
        self._stack = None if self._stack_of is None else self._stack_of(0, self.n_layers)
        self._tap_pieces: dict[tuple[int, ...], list] = {}     # tapped blocks -> `_tap_stacks`

    def _layer_stacks(self, intermediate: int):
        """Decoder layers for one kernel call (small_gemm.layer_stack) where the step's kernels
        all run: the fused attention and every linear on the few-row kernel (q/k norms too,
        where their eps is the layer norms'; it is in Qwen3). Returns a maker of the stack of
        layers [lo, hi) (the same weights, not copies; None where the kernels do not serve the
        model) and the most rows a stack serves (every linear's own limit). The whole stack
        serves a step; a step that returns taps runs it in pieces (`_tap_stacks`)."""
        linears = [w[k] for w in self.layers for k in ("wqkv", "wo", "wgu", "wdown")]
        if (not self.fused_attention or any(lin.small is None for lin in linears)
                or any(w.get("qk_eps", self.eps) != self.eps for w in self.layers)):
            return None, 0
        empty = torch.empty(0)
        bias = lambda lin: empty if lin.small_bias is None else lin.small_bias   # noqa: E731
        layers = [[w["ln1"].contiguous(), w["wqkv"].small, bias(w["wqkv"]), w["wo"].small, bias(w["wo"]),
                   w["ln2"].contiguous(), w["wgu"].small, bias(w["wgu"]), w["wdown"].small, bias(w["wdown"]),
                   w.get("q_norm", empty).contiguous(), w.get("k_norm", empty).contiguous()]
                  for w in self.layers]
        stack_of = lambda lo, hi: small_gemm.layer_stack(   # noqa: E731
            layers[lo:hi], self.n_heads, self.n_kv_heads, self.head_dim, self.hidden, intermediate, self.eps)
        return stack_of, min(lin.small_max_rows for lin in linears)

    def _tap_stacks(self, tap_layers: tuple[int, ...]) -> list[tuple[int, int, object]]:
        """(lo, hi, stack) pieces of the layer stack, each ending after a tapped block (the last
        one at the last layer), built once per set of tapped blocks."""
        pieces = self._tap_pieces.get(tap_layers)
        if pieces is None:
            ends = [li + 1 for li in tap_layers if li + 1 < self.n_layers] + [self.n_layers]
            pieces = [(lo, hi, self._stack_of(lo, hi)) for lo, hi in zip([0] + ends[:-1], ends)]
            self._tap_pieces[tap_layers] = pieces
        return pieces

    def _layer_weights(self, layer) -> dict:
        att, mlp = layer.self_attn, layer.mlp
        # Fusing q/k/v and gate/up into one matmul each halves the per-layer op count.
        b = self.gemm
        w = {
            "ln1": layer.input_layernorm.weight.detach(),
            "wqkv": Linear(*_fused(att, "qkv_proj", "q_proj", "k_proj", "v_proj"), b),  # [(Hq+2Hkv)D, H]
            "wo": Linear(att.o_proj.weight, _fused_bias(att.o_proj), b),             # [H, HqD]
            "ln2": layer.post_attention_layernorm.weight.detach(),
            "wgu": Linear(*_fused(mlp, "gate_up_proj", "gate_proj", "up_proj"), b),  # [2I, H]
            "wdown": Linear(mlp.down_proj.weight, _fused_bias(mlp.down_proj), b),    # [H, I]
        }
        if getattr(att, "q_norm", None) is not None:     # Qwen3: RMSNorm over each head before the rope
            w["q_norm"], w["k_norm"] = att.q_norm.weight.detach(), att.k_norm.weight.detach()   # [D] each
            w["qk_eps"] = att.q_norm.variance_epsilon
        return w

    def _rope_tables(self, rotary_emb) -> tuple[torch.Tensor, torch.Tensor]:
        # Reuse the model's own rotary module so every rope scaling type transformers knows is honoured.
        positions = torch.arange(self.max_positions, device=self.device)[None, :]
        probe = torch.zeros(1, dtype=self.dtype, device=self.device)
        cos, sin = rotary_emb(probe, positions)
        return cos[0].contiguous(), sin[0].contiguous()

    def new_cache(self, capacity: int) -> KVCache:
        return KVCache(self.n_layers, self.n_kv_heads, self.head_dim, capacity, self.kv_dtype, self.device)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, segments: list[Segment],
                logit_rows: torch.Tensor | None) -> torch.Tensor | None:
        """Run the packed rows through the model, writing each segment's new KV into its cache at
        slots [cache.length, cache.length + rows) (cache.length itself is not advanced: the caller
        commits what acceptance keeps). Returns logits for `logit_rows` ([R, V]) or None.

        input_ids: [T]; positions: [T]; T = sum of segment rows.
        """
        return self.forward_hidden(input_ids, positions, segments, logit_rows)[0]

    @torch.inference_mode()
    def forward_hidden(self, input_ids: torch.Tensor, positions: torch.Tensor,
                       segments: list[Segment], logit_rows: torch.Tensor | None
                       ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """`forward`, also returning the final-normed hidden states of `logit_rows` ([R, H]: what
        the LM head reads, transformers' `last_hidden_state`), at no extra cost: features of the
        text so far for predictors that read the target's own state (a length predictor)."""
        return self._run(input_ids, positions, segments, logit_rows, None)[:2]

    @torch.inference_mode()
    def forward_taps(self, input_ids: torch.Tensor, positions: torch.Tensor, segments: list[Segment],
                     logit_rows: torch.Tensor | None, tap_layers: Sequence[int]
                     ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor]:
        """`forward_hidden`, also returning every row's taps [T, 1 + len(tap_layers), H]: the
        token embedding, then the output of each block in `tap_layers` (the residual stream after
        it), what a feedback-memory draft reads (workers/speculation/target_taps.py). The same pass: on the
        decoder stack, in pieces that end at the tapped blocks, where the stack serves the step."""
        if any(not 0 <= li < self.n_layers for li in tap_layers) or list(tap_layers) != sorted(set(tap_layers)):
            raise ValueError(f"tap layers {tuple(tap_layers)}: increasing block indices of the "
                             f"target's {self.n_layers} are wanted")
        return self._run(input_ids, positions, segments, logit_rows, tuple(tap_layers))

    def _run(self, input_ids: torch.Tensor, positions: torch.Tensor, segments: list[Segment],
             logit_rows: torch.Tensor | None, tap_layers: tuple[int, ...] | None):
        for seg in segments:
            if seg.cache.length + seg.rows > seg.cache.capacity:
                raise ValueError(f"KV capacity {seg.cache.capacity} exceeded "
                                 f"({seg.cache.length} + {seg.rows} rows)")
        host_positions = positions      # the masks are worked out on the host (_plan), as built
        if self.device.type != "cpu":
            # callers build a step's ids, positions and masks on the host: one small copy each
            input_ids, positions = input_ids.to(self.device), positions.to(self.device)
            logit_rows = None if logit_rows is None else logit_rows.to(self.device)
        x = self.embed[input_ids]                                   # x: [T, H]
        cos, sin = self.cos[positions], self.sin_signed[positions]  # [T, D] each
        plan = self._plan(segments, host_positions)
        one_mask_set = all(m is plan.layer_masks[0] for m in plan.layer_masks)
        if (self._stack is not None and plan.kernel and not plan.long and plan.padded is None and one_mask_set
                and x.shape[0] <= self._stack_rows):
            # every layer in one call (csrc/decoder.cpp): the loop below, without its Python
            masks = plan.layer_masks[0]
            args = (plan.starts, plan.rows, plan.lengths, masks.short_masks,
                    [small_gemm.no_past(p) for p in masks.short_pasts], plan.short_causal)
            if tap_layers is not None:
                return self._stacked_taps(x, cos, sin, plan, args, logit_rows, tap_layers)
            delta = self._stack.forward(x, cos, sin, plan.k_caches, plan.v_caches, *args, logit_rows is not None)
            return (None, None, None) if logit_rows is None else (*self._logits(x, delta, logit_rows), None)
        taps = [x.clone()] if tap_layers is not None else None   # tap 0: the embedding [T, H]
        wanted = {li: j for j, li in enumerate(tap_layers or ())}
        last_needed = max(tap_layers) if tap_layers else -1
        delta = None                    # the MLP output not yet added to x (added by the next norm)
        for li, w in enumerate(self.layers):
            h = self._norm(x, w["ln1"], delta)                                   # x += delta first
            if li - 1 in wanted:
                taps.append(x.clone())                                           # block li-1's output
            qkv = w["wqkv"](h)                                                   # [T, (Hq+2Hkv)D]
            if "q_norm" in w:
                qkv = self._qk_norm(qkv, w)
            q = self._rope_store(li, qkv, cos, sin, plan)                        # [T, Hq, D]
            if logit_rows is None and li == self.n_layers - 1 and last_needed < li:
                # Nothing reads the last layer's output but logits: with none wanted (a
                # prefill), its KV is all that is needed (a few percent of a prefill).
                return None, None, _stacked(taps)
            att = self._attention(li, q, plan)                                   # [T, Hq*D]
            h = self._norm(x, w["ln2"], w["wo"](att))                            # x += attention out
            delta = w["wdown"](self._swiglu(w["wgu"](h)))                        # [T, H]
        return self._tail(x, delta, logit_rows, taps, self.n_layers - 1 in wanted)

    def _stacked_taps(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, plan, args: tuple,
                      logit_rows: torch.Tensor | None, tap_layers: tuple[int, ...]):
        """`_run` with taps on the layer stack: one call per piece (`_tap_stacks`), each tapped
        block's output read between them: a step that feeds a memory draft keeps the stack's
        speed instead of paying the per-layer loop's Python (csrc/decoder.cpp says how much)."""
        taps = [x.clone()]                                                       # tap 0: the embedding
        wanted = set(tap_layers)
        delta = None
        for lo, hi, stack in self._tap_stacks(tap_layers):
            last = hi == self.n_layers
            full = not last or logit_rows is not None or (hi - 1) in wanted      # else stop at the KV
            delta = stack.forward(x, cos, sin, [k[lo:hi] for k in plan.k_caches],     # each [hi-lo, Hkv, S, D]
                                  [v[lo:hi] for v in plan.v_caches], *args, full)
            if not last:
                x.add_(delta)                     # the next piece starts from the block's output
                taps.append(x.clone())
        return self._tail(x, delta, logit_rows, taps, self.n_layers - 1 in wanted)

    def _tail(self, x: torch.Tensor, delta: torch.Tensor, logit_rows: torch.Tensor | None,
              taps: list[torch.Tensor] | None, tap_last: bool):
        """What `_run` returns after the last block, x + delta its output: (logits, hidden) of
        `logit_rows` (None, None without), and the taps, the last block's added if `tap_last`."""
        if tap_last:
            taps.append(x + delta)
        if logit_rows is None:
            return None, None, _stacked(taps)
        return (*self._logits(x, delta, logit_rows), _stacked(taps))

    def _logits(self, x: torch.Tensor, delta: torch.Tensor,
                logit_rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The final norm of rows x + delta ([R, H]) and the LM head over it ([R, V])."""
        hidden = self._norm(x[logit_rows], self.final_norm, delta[logit_rows])
        return self.lm_head(hidden), hidden

    def argmax(self, logits: torch.Tensor) -> list[int]:
        """Each logits row's greedy token (the first index of its largest value)."""
        if self.fused:
            return small_gemm.argmax_rows(logits).tolist()
        # float32 first: torch's CPU argmax over bf16 rows is several times slower than converting
        # first (measured on a step's logits: README.md, "CPU kernels and weight layouts"), and
        # the index is the same either way.
        return logits.float().argmax(-1).tolist()

    def _qk_norm(self, qkv: torch.Tensor, w: dict) -> torch.Tensor:
        """Qwen3's RMSNorm over each query head's and each key head's D (the values untouched),
        between the q/k/v linear and the rope, as its modeling does. qkv: [T, (Hq+2Hkv)D]."""
        nq, nkv, d = self.n_heads, self.n_kv_heads, self.head_dim
        heads = qkv.view(-1, nq + 2 * nkv, d)                                    # [T, Hq+2Hkv, D]
        heads[:, :nq] = F.rms_norm(heads[:, :nq], (d,), w["q_norm"], w["qk_eps"])
        heads[:, nq: nq + nkv] = F.rms_norm(heads[:, nq: nq + nkv], (d,), w["k_norm"], w["qk_eps"])
        return qkv

    def _rope_store(self, li: int, qkv: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor,
                    plan: _AttentionPlan) -> torch.Tensor:
        """Rotate the rows' queries and keys and write every segment's keys and values to its
        cache; returns the queries [T, Hq, D] (kv dtype where the kernel runs, else the model's).
        qkv: [T, (Hq+2Hkv)D]; cos, sin_signed: [T, D]."""
        nq, nkv, d = self.n_heads, self.n_kv_heads, self.head_dim
        if plan.kernel:
            return small_gemm.rope_store(qkv, cos, sin_signed, plan.k_caches, plan.v_caches, li, plan.starts,
                                         plan.rows, plan.lengths, nq, nkv)
        qkv = qkv.view(-1, nq + 2 * nkv, d)                                      # [T, Hq+2Hkv, D]
        qk = qkv[:, : nq + nkv]
        qk = qk * cos[:, None] + qk.roll(d // 2, -1) * sin_signed[:, None]        # [T, Hq+Hkv, D]
        for seg in plan.segments:
            self._store_kv(li, seg, qk[:, nq:], qkv[:, nq + nkv:])
        return qk[:, :nq]

    def _attention(self, li: int, q: torch.Tensor, plan: _AttentionPlan) -> torch.Tensor:
        """Every segment's rows attend over its cache: q [T, Hq, D] -> [T, Hq*D] in the model's dtype.
        The CPU kernel serves tree steps and prefills up to _KERNEL_MAX_KEYS keys in one call;
        torch's kernel longer prefills, in blocks of rows that skip the keys they cannot see."""
        nq, d = self.n_heads, self.head_dim
        masks = plan.layer_masks[li]
        if plan.short:
            att = small_gemm.tree_attention(q, *plan.short_caches, li, *plan.short_rows, masks.short_masks,
                                            masks.short_pasts, self.dtype, plan.short_causal)  # [T, Hq*D]
            if not plan.long and plan.padded is None:
                return att
        elif len(plan.segments) == 1:   # one request: its attention output is the whole step's
            seg = plan.segments[0]
            return self._attend(li, seg, masks.full_masks[0], q, plan.chunked[0]).reshape(-1, nq * d)
        else:
            att = torch.empty(q.shape[0], nq * d, dtype=self.dtype, device=q.device)
        rows = att.view(-1, nq, d)                                                # [T, Hq, D]
        if plan.padded is not None:     # the tree-sized segments in one call (batched_attention.py)
            out = batched_attention.attend(self.attention, q, plan.padded, li, masks.batched, self.n_kv_heads,
                                           self.kv_dtype)                        # [T_b, Hq, D]
            rows.index_copy_(0, plan.padded.out_rows, out.to(self.dtype))
        for i in plan.long:
            seg = plan.segments[i]
            rows[seg.start: seg.start + seg.rows] = self._attend(li, seg, masks.full_masks[i], q, plan.chunked[i])
        return att

    def _plan(self, segments: list[Segment], positions: torch.Tensor) -> _AttentionPlan:
        """Work out once a pass what every layer's attention needs (masks, cache lists)."""
        plan = _AttentionPlan(segments, kernel=self.fused_attention and bool(segments))
        if plan.kernel:
            plan.k_caches = [seg.cache.k for seg in segments]
            plan.v_caches = [seg.cache.v for seg in segments]
            plan.starts = [seg.start for seg in segments]
            plan.rows = [seg.rows for seg in segments]
            plan.lengths = [seg.cache.length for seg in segments]
            max_keys = _KERNEL_MAX_KEYS.get(self.kv_dtype, 0)
            plan.short = [i for i, seg in enumerate(segments)
                          if seg.rows <= _KERNEL_MAX_ROWS or seg.cache.length + seg.rows <= max_keys]
            pick = lambda values: [values[i] for i in plan.short]   # noqa: E731
            plan.short_caches = (pick(plan.k_caches), pick(plan.v_caches))
            plan.short_rows = (pick(plan.starts), pick(plan.rows), pick(plan.lengths))
            plan.short_causal = [_chunkable(segments[i]) for i in plan.short]
        short = set(plan.short)
        plan.long = [i for i in range(len(segments)) if i not in short]
        plan.padded = batched_attention.plan_batch(self.attention, segments, plan.long, self.device)
        if plan.padded is not None:     # those attend in one call a layer; the rest one call each
            plan.long = [i for i in plan.long if i not in plan.padded.picked]
        plan.chunked = {i: _chunkable(segments[i]) for i in plan.long}
        # One mask set per window that some row reaches past (a windowed mask hides more keys,
        # so a prefill stays causal and `chunked` holds); the other layers share the plain one
        # (None), built only if some layer reads it.
        top = int(positions.max()) if positions.numel() and any(self.windows) else -1
        keys = [w if w is not None and top >= w else None for w in self.windows]
        sets: dict[int | None, _MaskSet] = {}
        for window in dict.fromkeys(keys):
            if window is None:
                own, past = [seg.mask for seg in segments], [seg.past for seg in segments]
            else:
                own, past = zip(*(_windowed(seg, positions[seg.start: seg.start + seg.rows], window)
                                  for seg in segments))
            sets[window] = self._mask_set(plan, list(own), list(past))
        plan.layer_masks = [sets[k] for k in keys]
        return plan

    def _mask_set(self, plan: _AttentionPlan, masks: list[torch.Tensor],
                  pasts: list[torch.Tensor | None]) -> _MaskSet:
        """Each segment's masks in the form its attention path reads: float32 for the kernel's
        (`short`) segments, torch's [rows, length + rows] for the others."""
        batched = None if plan.padded is None else batched_attention.pass_mask(
            self.attention, plan.padded, masks, pasts, self.n_heads // self.n_kv_heads, self.kv_dtype, self.device)
        return _MaskSet(
            short_masks=[masks[i].to(torch.float32).contiguous() for i in plan.short],
            short_pasts=[None if pasts[i] is None else pasts[i].to(torch.float32).contiguous() for i in plan.short],
            full_masks={i: self._full_mask(plan.segments[i], masks[i], pasts[i]) for i in plan.long},
            batched=batched)

    def _norm(self, x: torch.Tensor, weight: torch.Tensor, delta: torch.Tensor | None) -> torch.Tensor:
        """RMSNorm of x after the residual add x += delta (in place: x is this pass's own tensor).
        One fused call where the CPU kernels exist: F.rms_norm and the add are ~7 ops, whose
        dispatch on these CPUs costs more than their arithmetic for tree-sized inputs."""
        if self.fused:
            return small_gemm.rms_norm(x, weight, self.eps, delta)
        if delta is not None:
            x += delta
        return F.rms_norm(x, (self.hidden,), weight, self.eps)

    def _swiglu(self, gate_up: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up of the fused gate/up output [T, 2I] -> [T, I]; one call where the CPU
        kernels exist (faster than torch's three ops for tree-sized inputs: small_gemm.py)."""
        if self.fused:
            return small_gemm.silu_mul(gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    @staticmethod
    def _store_kv(li: int, seg: Segment, k: torch.Tensor, v: torch.Tensor) -> None:
        cache, lo, n = seg.cache, seg.start, seg.rows
        cache.k[li, :, cache.length: cache.length + n] = k[lo: lo + n].transpose(0, 1)   # [Hkv, n, D]
        cache.v[li, :, cache.length: cache.length + n] = v[lo: lo + n].transpose(0, 1)

    def _attend(self, li: int, seg: Segment, mask: torch.Tensor, q: torch.Tensor,
                chunked: bool) -> torch.Tensor:
        """Attention of the segment's rows over its cache, which holds their own KV already."""
        cache, lo, n = seg.cache, seg.start, seg.rows
        end = cache.length + n
        keys, values = cache.k[li, :, :end][None], cache.v[li, :, :end][None]   # [1, Hkv, S, D]
        q = q[lo: lo + n]
        if q.dtype != self.kv_dtype:
            q = q.to(self.kv_dtype)
        nkv, d = self.n_kv_heads, self.head_dim
        g = self.n_heads // nkv
        if chunked:
            # Rows never see later rows, so a block of rows needs only the keys up to its own
            # last row: about half the work of one call over the whole square (and about that
            # much faster on a prefill), since torch's CPU kernel cannot skip masked blocks.
            qt = q.transpose(0, 1)[None]                                                # [1, Hq, n, D]
            out = torch.empty(n, self.n_heads, d, dtype=q.dtype, device=q.device)      # [n, Hq, D]
            for s in range(0, n, _CHUNK_ROWS):
                e = min(s + _CHUNK_ROWS, n)
                upto = cache.length + e
                part = F.scaled_dot_product_attention(
                    qt[:, :, s:e], keys[:, :, :upto], values[:, :, :upto],
                    attn_mask=mask[s:e, :upto], enable_gqa=True)                        # [1, Hq, e-s, D]
                out[s:e] = part[0].transpose(0, 1)
        elif not self._folds(n):
            out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], keys, values,
                                                 attn_mask=mask, enable_gqa=True)   # [1, Hq, n, D]
            out = out[0].transpose(0, 1)                                           # [n, Hq, D]
        else:
            # The g query heads that share a KV head become g * n rows of that head (the mask
            # repeated g times): less attention time for tree-sized n than enable_gqa.
            qf = q.view(n, nkv, g, d).permute(1, 2, 0, 3).reshape(1, nkv, g * n, d)   # [1, Hkv, g*n, D]
            out = F.scaled_dot_product_attention(qf, keys, values, attn_mask=mask)    # [1, Hkv, g*n, D]
            out = out.view(nkv, g, n, d).permute(2, 0, 1, 3).reshape(n, nkv * g, d)     # [n, Hq, D]
        return out if out.dtype == self.dtype else out.to(self.dtype)

    def _full_mask(self, seg: Segment, own: torch.Tensor, past: torch.Tensor | None) -> torch.Tensor:
        # The new rows see the committed context through `past` (None: all of it), each other
        # through `own` ([rows, rows]).
        # NOTE: the mask must be additive float: a boolean mask is silently wrong under eager attention.
        if past is not None:
            past = past.to(self.device, self.kv_dtype)
        else:
            past = torch.zeros(seg.rows, seg.cache.length, dtype=self.kv_dtype, device=self.device)
        mask = torch.cat([past, own.to(self.device, self.kv_dtype)], dim=1)        # [rows, length + rows]
        if self._folds(seg.rows):
            mask = mask.repeat(self.n_heads // self.n_kv_heads, 1)     # [g * rows, length + rows]
        return mask

    def _folds(self, rows: int) -> bool:
        """Whether a segment of `rows` attends with its query-head groups folded into rows (see
        _attend); its mask is built for that (_full_mask), so both ask here."""
        return rows <= _FOLD_MAX_ROWS and self.n_heads > self.n_kv_heads


SUPPORTED_MODEL_TYPES = {"llama", "mistral", "qwen2", "qwen3", "phi3"}


def _stacked(taps: list[torch.Tensor] | None) -> torch.Tensor | None:
    """Captured taps (each [T, H]) as [T, S, H]; None when none were asked for."""
    return None if taps is None else torch.stack(taps, dim=1)


def _fused(module, fused: str, *parts: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The weight [sum of outs, in] and bias of `parts` stacked in that order, or of the one
    linear `fused` where the checkpoint already stacks them so (Phi-3's qkv_proj and gate_up_proj:
    q, k, v and gate, up, the order the forward reads them in)."""
    if getattr(module, fused, None) is not None:
        lin = getattr(module, fused)
        return lin.weight, _fused_bias(lin)
    linears = [getattr(module, name) for name in parts]
    return torch.cat([lin.weight for lin in linears]), _fused_bias(*linears)


def _fused_bias(*linears) -> torch.Tensor | None:
    """The bias of the linears' weights stacked into one, zeros for any without one (so one
    projection's bias never needs the others'); None where none has one."""
    if all(lin.bias is None for lin in linears):
        return None
    return torch.cat([lin.weight.new_zeros(lin.weight.shape[0]) if lin.bias is None else lin.bias.detach()
                      for lin in linears])


def _windowed(seg: Segment, positions: torch.Tensor, window: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The segment's masks (own [rows, rows], past [rows, length]) with a sliding window on top:
    a row at position p no longer sees keys at position p - window or earlier. Cache slot j holds
    position j (a target's cache); positions: the segment's rows' [rows]. Example: rows at
    positions 4 and 5 over 4 cached slots, window 3: row 4 sees slots 2, 3 and itself; row 5
    sees slot 3, row 4 and itself (and what the segment's own masks let each see of those).
    """
    if not positions.numel() or int(positions.max()) < window:   # not that far along
        return seg.mask, seg.past
    slots = torch.arange(seg.cache.length, device=positions.device)
    past = _hidden(positions[:, None] - slots[None, :] >= window)                         # [rows, length]
    if seg.past is not None:
        past = past + seg.past.to(torch.float32)
    own = seg.mask.to(torch.float32) + _hidden(positions[:, None] - positions[None, :] >= window)  # [rows, rows]
    return own, past


def _hidden(far: torch.Tensor) -> torch.Tensor:
    """An additive float32 mask: -inf where `far`, else 0."""
    return torch.zeros(far.shape, dtype=torch.float32, device=far.device).masked_fill_(far, float("-inf"))


@dataclass
class _MaskSet:
    """Every segment's masks as one group of layers reads them (those sharing a window)."""
    short_masks: list[torch.Tensor]                 # the `short` segments' [rows, rows] float32
    short_pasts: list[torch.Tensor | None]          # their [rows, length] float32, None: all visible
    full_masks: dict[int, torch.Tensor]             # the `long` ones': torch's [rows, length + rows]
    batched: object = None                          # the batched ones' (batched_attention.py), if any


@dataclass
class _AttentionPlan:
    """What one pass's attention needs, per segment, worked out once a pass rather than once a layer.
    `kernel`: the CPU kernels rope every row and write every segment's KV, and attend for the
    `short` segments (indices: tree steps, prefills of up to _KERNEL_MAX_KEYS keys); torch attends
    for the `long` ones."""
    segments: list[Segment]
    kernel: bool
    k_caches: list[torch.Tensor] = field(default_factory=list)     # per segment [L, Hkv, cap, D]
    v_caches: list[torch.Tensor] = field(default_factory=list)
    starts: list[int] = field(default_factory=list)
    rows: list[int] = field(default_factory=list)
    lengths: list[int] = field(default_factory=list)
    short: list[int] = field(default_factory=list)
    short_caches: tuple = ()                                       # (k, v) lists of the short ones
    short_rows: tuple = ()                                         # (starts, rows, lengths) of the short ones
    short_causal: list[bool] = field(default_factory=list)
    long: list[int] = field(default_factory=list)
    chunked: dict[int, bool] = field(default_factory=dict)
    padded: batched_attention.PaddedLayout | None = None          # the batched segments' layout
    layer_masks: list[_MaskSet] = field(default_factory=list)      # per layer (shared where windows agree)

# Up to this many rows a segment's attention folds its query-head groups into rows (measured with
# SmolLM2's 9/3 heads: faster than enable_gqa for tree-sized segments); longer runs such as
# prefill are as fast or faster with enable_gqa. Figures: README.md, "CPU kernels and weight
# layouts".
_FOLD_MAX_ROWS = 32
# Segments longer than this (prefills) attend in blocks of this many rows (see _attend); measured
# on prefill-sized segments, blocks of 64 beat 128 and 256.
_CHUNK_ROWS = 64
# Segments of up to this many rows attend through the CPU kernel (tree steps, drafts' steps), and
# longer ones (prefills) up to this many keys, by KV dtype: past that torch's blocked path (above)
# is faster. Measured on SmolLM2 prefills of growing length, kernel against torch: over a float32
# KV the kernel leads until somewhere between 700 and 1,500 rows, over a bf16 KV (torch's bf16
# flash attention is fast for many rows) only for short prefills; figures: README.md, "CPU
# kernels and weight layouts".
_KERNEL_MAX_ROWS = 64
_KERNEL_MAX_KEYS = {torch.float32: 768, torch.bfloat16: 256}


def _chunkable(seg: Segment) -> bool:
    """Whether the segment is long enough to attend in blocks and no row sees a later row (true
    of prefills, trees in topological order and drafts' windows; checked, since a block drops
    the keys of later rows)."""
    n = seg.rows
    if n <= _CHUNK_ROWS:
        return False
    later = torch.ones(n, n, dtype=torch.bool, device=seg.mask.device).triu(1)
    return bool(torch.isneginf(seg.mask[later]).all())
