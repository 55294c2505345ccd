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

The rooms: this module is the layer loop (norms, linears, the decoder-stack kernel, taps and
logits); the attention of a pass, its plan, masks and KV writes, is workers/model/packed_attention.py;
the weights as the loop reads them, workers/model/llama_weights.py.

Sliding-window attention: a layer with a window hides from a row at position p every key at
position p - window or earlier, on top of the segment's own masks (packed_attention.py works the
windowed masks out, since a target's cache slot j holds position j). The KV keeps every slot,
including those no query can see again: exact, and no more memory than a model without a window, since the planner's KV budget bounds
every request's cache anyway; trimming the cache to the window would save memory for long
contexts, at the cost of slots that no longer equal positions. A draft model's cache does not
keep slots at their positions (workers/drafters/neural/draft_model.py packs it to sink + window), so a draft
builds its forward with `windowed=False` and its own `past` masks say what each row sees.
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F

from workers.model import batched_attention, packed_attention, small_gemm
from workers.model.cpu_linear import Linear, pick_backend
from workers.model.kv_cache import KVCache
from workers.model.llama_weights import layer_weights, rope_tables
from workers.model.model_support import layer_windows, unsupported
from workers.model.packed_attention import AttentionPlan, Segment

__all__ = ["LlamaForward", "Segment", "SUPPORTED_MODEL_TYPES"]


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
            self.layers = [layer_weights(layer, self.gemm) for layer in inner.layers]
            # [P, D] each
            self.cos, self.sin = rope_tables(inner.rotary_emb, self.max_positions, self.dtype, self.device)
            # rotate_half(x) * sin == roll(x, D/2) * sin with its first half negated: one op
            # instead of four (slice, slice, neg, cat), and bitwise the same result.
            half = self.head_dim // 2
            self.sin_signed = torch.cat([-self.sin[:, :half], self.sin[:, half:]], dim=-1)   # [P, D]
        self._stack_of, self._stack_rows = self._layer_stacks(cfg.intermediate_size)
        self._stack = None if self._stack_of is None else self._stack_of(0, self.n_layers)
        self._tap_pieces: dict[tuple[int, ...], list] = {}     # tapped blocks -> `_tap_stacks`

    @property
    def heads(self) -> packed_attention.Heads:
        """The attention's shape and types (read each pass: tests switch `fused_attention` off)."""
        return packed_attention.Heads(self.n_heads, self.n_kv_heads, self.head_dim, self.dtype, self.kv_dtype,
                                      self.device, self.attention, self.windows)

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
        host_positions = positions      # the masks are worked out on the host (the plan), as built
        if self.device.type != "cpu":
            # callers build a step's ids, positions and masks on the host: one small copy each
            input_ids, positions = input_ids.to(self.device), positions.to(self.device)
            logit_rows = None if logit_rows is None else logit_rows.to(self.device)
        x = self.embed[input_ids]                                   # x: [T, H]
        cos, sin = self.cos[positions], self.sin_signed[positions]  # [T, D] each
        heads = self.heads
        plan = packed_attention.plan(heads, segments, host_positions, self.fused_attention)
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
            q = packed_attention.rope_store(heads, li, qkv, cos, sin, plan)      # [T, Hq, D]
            if logit_rows is None and li == self.n_layers - 1 and last_needed < li:
                # Nothing reads the last layer's output but logits: with none wanted (a
                # prefill), its KV is all that is needed (a few percent of a prefill).
                return None, None, _stacked(taps)
            att = packed_attention.attention(heads, li, q, plan)                 # [T, Hq*D]
            h = self._norm(x, w["ln2"], w["wo"](att))                            # x += attention out
            delta = w["wdown"](self._swiglu(w["wgu"](h)))                        # [T, H]
        return self._tail(x, delta, logit_rows, taps, self.n_layers - 1 in wanted)

    def _stacked_taps(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, plan: AttentionPlan,
                      args: tuple, logit_rows: torch.Tensor | None, tap_layers: tuple[int, ...]):
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


SUPPORTED_MODEL_TYPES = {"llama", "mistral", "qwen2", "qwen3", "phi3"}


def _stacked(taps: list[torch.Tensor] | None) -> torch.Tensor | None:
    """Captured taps (each [T, H]) as [T, S, H]; None when none were asked for."""
    return None if taps is None else torch.stack(taps, dim=1)
