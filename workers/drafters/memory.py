"""The feedback-memory drafter: a `ModelDrafter` whose draft also reads the target's activations.

It grows trees exactly as `ModelDrafter` does, with `workers.drafters.neural.memory_forward.MemoryForward` as its
forward; what it adds is keeping each request's target taps (`DraftContext.taps`: what the
verifier computed at committed positions, workers/speculation/target_taps.py) and handing them to every pass
over committed tokens, so the draft's memory at those positions is the target's. A root's taps
arrive with the step after it was drafted from: its cached memory (the draft's own until then)
is replaced in place. Taps the draft can no longer read (outside its sink + window) are dropped,
so what it keeps per request is bounded like its KV.
"""
from __future__ import annotations

from pathlib import Path

import torch

from workers.drafters.neural.cheap_head import CheapHead, read_head
from workers.contract import DraftContext, TapSpec
from workers.drafters.neural.draft_memory import MemoryDraft
from workers.drafters.neural.draft_model import DraftSpec, read_spec
from workers.drafters.model import ModelDrafter, _State
from workers.model.llama_forward import Segment
from workers.drafters.neural.memory_forward import MemoryForward
from workers.speculation.target_taps import unpack

__all__ = ["MemoryDrafter", "load_draft"]


class MemoryDrafter(ModelDrafter):
    def __init__(self, forward: MemoryForward, spec: DraftSpec, **options):
        super().__init__(forward, spec, **options)
        self.target_taps = TapSpec(spec.memory_layers, spec.sink, spec.window)
        self._taps: dict[str, dict[int, torch.Tensor]] = {}   # request -> position -> [S, H]

    @classmethod
    def load(cls, path: str | Path, *, dtype: torch.dtype | None = None,
             device: str | torch.device = "auto", **options) -> "MemoryDrafter":
        """As `ModelDrafter.load`."""
        from transformers import AutoModelForCausalLM

        from workers.model.device import resolve_device

        spec = read_spec(path)
        dtype = dtype or spec.torch_dtype
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
        draft = MemoryDraft.from_spec(model, spec).to(dtype).to(resolve_device(device))
        options.setdefault("name", str(path))
        forward = MemoryForward(draft)
        kept = read_head(path)
        if kept is not None:
            forward.head = CheapHead(model.lm_head.weight, kept, forward.gemm)
        return cls(forward, spec, **options)

    def propose_batch(self, items):
        for ctx, _ in items:
            self._take(ctx)
        return super().propose_batch(items)

    def release(self, request_id: str) -> None:
        super().release(request_id)
        self._taps.pop(request_id, None)

    def taps_held(self, request_id: str) -> int:
        """Positions whose target taps are kept for a request: bounded by sink + window."""
        return len(self._taps.get(request_id, {}))

    def _take(self, ctx: DraftContext) -> None:
        """Keep the context's new taps; replace the memory of positions already cached."""
        if ctx.taps is None:
            return
        positions, values = unpack(ctx.taps)
        store = self._taps.setdefault(ctx.request_id, {})
        store.update(zip(positions, values))
        newest = len(ctx.tokens) - 1
        for p in [p for p in store if not self.target_taps.keeps(p, newest)]:
            del store[p]
        state = self._states.get(ctx.request_id)
        if state is None:
            return
        kv = state.kv
        cached = {p: slot for slot, p in enumerate(kv.pos[: kv.length].tolist())}
        hits = [(cached[p], p) for p in positions if p in cached and p in store]
        if hits:
            slots, pos = (torch.tensor(c) for c in zip(*hits))
            self.forward.write_memory(kv.cache, slots, pos, torch.stack([store[p] for p in pos.tolist()]))

    def _feed(self, ids: torch.Tensor, positions: torch.Tensor, segments: list[Segment],
              logit_rows: torch.Tensor | None, states: list[_State]) -> torch.Tensor | None:
        d = self.forward.draft
        taps = torch.zeros(ids.numel(), d.taps, d.hidden)                          # [T, S, H]
        known = torch.zeros(ids.numel(), dtype=torch.bool)
        for seg, state in zip(segments, states):
            store = self._taps.get(state.request_id, {})
            for row in range(seg.start, seg.start + seg.rows):
                value = store.get(int(positions[row]))
                if value is not None:
                    taps[row], known[row] = value, True
        return self.forward.forward(ids, positions, segments, logit_rows, taps, known)


def load_draft(path: str | Path, **options) -> ModelDrafter:
    """The drafter of a draft directory: with feedback memory if its spec names memory layers."""
    cls = MemoryDrafter if read_spec(path).memory_layers else ModelDrafter
    return cls.load(path, **options)

