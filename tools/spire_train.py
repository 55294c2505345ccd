"""`specgate draft train`: train a draft SPIRe's way, with or without feedback memory.

    specgate draft train --draft DRAFT --minutes 30 --k 4 --weight 0.5 --data shared-data/

What it adds to `specgate distill` (whose data, evaluation set and progress bar it reuses):
* SPIRe's mixed loss (tools/spire_loss.py): ω · cross-entropy against the target's distribution
  + (1 − ω) · (−expected acceptance), ``--weight`` ω;
* for a draft with feedback memory (`specgate draft build --memory`), the target's activations at
  every position (the verifier's own `forward_taps`, once per sequence, kept in float16) and SPIRe's
  cheap k-step training (``--k``: k passes, each prefix ending at a multiple of k drafts k
  tokens from its own memory, workers/drafters/neural/draft_memory.py); a plain draft ignores ``--k``;
* ``--data``: a directory for the generated training text and evaluation set, so two drafts
  trained side by side see the same sequences (default: the draft's own ``spire/``);
* a JSON log, one line per optimiser step (``spire/log.jsonl``: step, loss, ce, accept, lr,
  seconds), besides the checkpoint (``spire/checkpoint.pt``) a later run resumes from unless
  ``--fresh``.

``alpha`` (before and after) is teacher-forced greedy acceptance at depth 1 on the chat
workload's target continuations, as `specgate distill` reports it; a memory draft reads the
target's memory there (k = 1), as a root does when drafting.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import random
import sys
import time
from pathlib import Path
from typing import Callable, Sequence

import torch

from tools.distill import (TOP_K, Sample, _bar, _generate, _load_samples, _pad_batch, _save_samples,
                           state_directory, training_prompts)
from tools.spire_loss import mixed_loss
from workers.drafters.neural.draft_memory import MemoryDraft
from workers.drafters.neural.draft_model import read_spec, sparse_mask, write_spec
from workers.model.llama_forward import Segment
from loadtest.results import write_result

__all__ = ["target_taps", "train", "add_arguments", "run"]

STATE_DIR = "spire"


def target_taps(forward, samples: Sequence[Sample], layers: Sequence[int], length: int) -> torch.Tensor:
    """The target's taps of every sample [B, length, S, H] (zeros past a sample's end): one lean
    pass over the packed samples, no logits."""
    ids, pos, segs, start = [], [], [], 0
    for s in samples:
        n = len(s.ids)
        segs.append(Segment(forward.new_cache(n), start, n, torch.full((n, n), float("-inf")).triu(1)))
        ids += s.ids.tolist()
        pos += range(n)
        start += n
    _, _, taps = forward.forward_taps(torch.tensor(ids), torch.tensor(pos), segs, None, layers)   # [T, S, H]
    out = torch.zeros(len(samples), length, taps.shape[1], taps.shape[2])
    for b, seg in enumerate(segs):
        out[b, : seg.rows] = taps[seg.start: seg.start + seg.rows].float()
    return out


class _Draft:
    """The draft under training: its logits over a batch, whichever kind it is."""

    def __init__(self, hf, spec, forward):
        self.hf, self.spec, self.forward = hf, spec, forward
        self.memory = MemoryDraft.from_spec(hf, spec) if spec.memory_layers else None
        # each sample's target taps, float16 [T, S, H]: computed once (a target pass per batch
        # otherwise costs more than the draft's own step), ~4.6 kB a token for SmolLM2
        self._taps: dict[int, torch.Tensor] = {}

    def taps(self, samples: Sequence[Sample], length: int) -> torch.Tensor:
        """[B, length, S, H] float32, from the cache, computing the missing samples in one pass."""
        missing = [s for s in samples if id(s) not in self._taps]
        if missing:
            fresh = target_taps(self.forward, missing, self.spec.memory_layers, max(len(s.ids) for s in missing))
            for s, row in zip(missing, fresh):
                self._taps[id(s)] = row[: len(s.ids)].half()
        first = self._taps[id(samples[0])]
        out = torch.zeros(len(samples), length, *first.shape[1:])
        for b, s in enumerate(samples):
            out[b, : len(s.ids)] = self._taps[id(s)].float()
        return out

    def logits(self, samples: Sequence[Sample], ids: torch.Tensor, k: int) -> torch.Tensor:
        if self.memory is not None:
            return self.memory.train_logits(ids, self.taps(samples, ids.shape[1]), k)   # [B, T, V]
        pos = torch.arange(ids.shape[1])
        mask = sparse_mask(pos, pos, self.spec.sink, self.spec.window)[None, None].expand(ids.shape[0], 1, -1, -1)
        return self.hf(input_ids=ids, attention_mask=mask).logits

    def params(self) -> tuple[list[torch.nn.Parameter], list[torch.nn.Parameter]]:
        """(the blocks' and final norm's weights, the memory's mix and gates)."""
        for p in self.hf.parameters():
            p.requires_grad_(False)
        weights = [p for layer in self.hf.model.layers for p in layer.parameters()] + list(self.hf.model.norm.parameters())
        memory = [self.memory.mix, self.memory.gate] if self.memory is not None else []
        for p in weights + memory:
            p.requires_grad_(True)
        return weights, memory


@torch.no_grad()
def _alpha(logits: Callable[[Sequence[Sample], torch.Tensor], torch.Tensor], samples: Sequence[Sample],
           batch: int = 4) -> float:
    """Share of continuation tokens the draft's argmax predicts from the true prefix."""
    hit = total = 0
    for i in range(0, len(samples), batch):
        chunk = samples[i: i + batch]
        ids, _ = _pad_batch(chunk)
        pred = logits(chunk, ids).argmax(-1)                                       # [B, T]
        for b, s in enumerate(chunk):
            n = len(s.ids)
            hit += int((pred[b, s.prompt_len - 1: n - 1] == s.ids[s.prompt_len: n]).sum())
            total += n - s.prompt_len
    return hit / max(total, 1)


def _data(runtime, data_dir: Path, records, eval_records, *, max_new: int, deadline: float, share: float,
          say) -> tuple[list, list]:
    """(evaluation samples, training samples with the target's top-k), cached in data_dir; the
    training text is extended for `share` of the time left once the evaluation set exists."""
    from loadtest.workload import load_workload

    data_dir.mkdir(parents=True, exist_ok=True)
    evals = _load_samples(data_dir / "eval.pt")
    if not evals:
        say("generating the evaluation set (the target's greedy continuations of the chat prompts)")
        evals = _generate(runtime, eval_records if eval_records is not None else load_workload("chat"), 128, top_k=0)
        _save_samples(data_dir / "eval.pt", evals)
    data = _load_samples(data_dir / "data.pt")
    deadline = time.monotonic() + share * (deadline - time.monotonic())
    if len(data) < len(records) and time.monotonic() < deadline:
        say(f"generating training text ({len(data)} sequences cached)")
        data += _generate(runtime, records[len(data):], max_new, deadline=deadline, top_k=TOP_K)
        _save_samples(data_dir / "data.pt", data)
    return evals, [s for s in data if s.top_lp is not None]


def train(target: str, draft_dir: str | Path, *, minutes: float, k: int = 1, weight: float = 0.5,
          lr: float = 2e-3, memory_lr: float = 0.05, batch: int = 4, max_new: int = 160, gen_share: float = 0.3,
          data_dir: str | Path | None = None, prompts: Sequence[dict] | None = None,
          eval_prompts: Sequence[dict] | None = None, checkpoint_every: float = 300.0,
          fresh: bool = False, seed: int = 0, max_steps: int | None = None, progress: bool = True) -> dict:
    """Train the draft in `draft_dir` for `minutes` of wall time, or until `max_steps` optimiser
    steps in all (module docstring); the summary."""
    from transformers import AutoModelForCausalLM

    from workers.runtime import load_runtime

    t_start = time.monotonic()
    deadline = t_start + minutes * 60.0
    draft_dir = Path(draft_dir)
    state = state_directory(draft_dir / STATE_DIR, fresh)
    torch.manual_seed(seed)
    say = (lambda m: print(f"draft train: {m}", file=sys.stderr, flush=True)) if progress else (lambda m: None)
    spec = read_spec(draft_dir)
    runtime = load_runtime(target, progress=False)
    draft = _Draft(AutoModelForCausalLM.from_pretrained(draft_dir, dtype=torch.float32), spec, runtime.forward)
    records = list(prompts) if prompts is not None else training_prompts(seed)
    evals, data = _data(runtime, Path(data_dir) if data_dir else state, records, eval_prompts,
                        max_new=max_new, deadline=deadline, share=gen_share, say=say)
    if not data:
        raise ValueError("no training data: raise --minutes or --gen-share")
    weights, memory = draft.params()
    params = weights + memory
    # the mix and gates are a few scalars each that must travel several units (a gate from
    # GATE_OFF to open), where Adam moves a weight about lr a step: their own, larger rate
    groups = [{"params": weights, "scale": 1.0}] + ([{"params": memory, "scale": memory_lr / lr}] if memory else [])
    opt = torch.optim.AdamW(groups, lr=lr, weight_decay=0.0)
    ckpt, log_path, summary_path = state / "checkpoint.pt", state / "log.jsonl", state / "summary.json"
    first = json.loads(summary_path.read_text()) if summary_path.is_file() else {}
    steps = tokens = 0
    trained_before = 0.0
    if ckpt.is_file():
        ck = torch.load(ckpt)
        for p, saved in zip(params, ck["params"]):
            p.data.copy_(saved)
        opt.load_state_dict(ck["optimizer"])
        steps, tokens, trained_before = ck["steps"], ck["tokens"], ck["trained_s"]
        say(f"resumed at step {steps} ({trained_before / 60:.1f} minutes trained before)")
    draft.hf.eval()
    evaluate = lambda: _alpha(lambda chunk, ids: draft.logits(chunk, ids, 1), evals)   # noqa: E731
    if "alpha_before" not in first:
        first = {"alpha_before": evaluate(), "steps_written": 0}
        summary_path.write_text(json.dumps(first))
    say(f"alpha before: {first['alpha_before']:.3f}; training on {len(data)} sequences, k {k}, weight {weight}")

    rng = random.Random(seed + steps)
    train_start = time.monotonic()
    budget_s = max(deadline - train_start, 1e-9)
    last_ckpt, losses = train_start, []
    bar = _bar(budget_s, progress, "draft train")
    draft.hf.train()
    with log_path.open("a") as log:
        while time.monotonic() < deadline and (max_steps is None or steps < max_steps):
            frac = (time.monotonic() - train_start) / budget_s
            rate = lr * min(1.0, (steps + 1) / 20) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))
            for g in opt.param_groups:      # warm-up over 20 steps, then cosine to 10% by the deadline
                g["lr"] = rate * g["scale"]
            chunk = rng.sample(data, min(batch, len(data)))
            ids, real = _pad_batch(chunk)
            lp = torch.zeros(*ids.shape, TOP_K)
            ix = torch.zeros(*ids.shape, TOP_K, dtype=torch.int64)
            for b, s in enumerate(chunk):   # position t is trained on the target's distribution at t
                lp[b, : len(s.ids)] = s.top_lp.float()
                ix[b, : len(s.ids)] = s.top_ix.long()
            loss, parts = mixed_loss(draft.logits(chunk, ids, k).flatten(0, 1), lp.flatten(0, 1),
                                     ix.flatten(0, 1), real.flatten(), weight)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            steps += 1
            tokens += int(real.sum())
            losses.append(float(loss.detach()))
            elapsed = time.monotonic() - train_start
            log.write(json.dumps({"step": steps, "loss": round(losses[-1], 5), "ce": round(parts["ce"], 5),
                                  "accept": round(parts["accept"], 5), "lr": rate, "tokens": tokens,
                                  "trained_s": round(trained_before + elapsed, 2)}) + "\n")
            log.flush()
            bar(elapsed, f"step {steps} loss {losses[-1]:.3f} accept {parts['accept']:.3f}")
            if time.monotonic() - last_ckpt > checkpoint_every:
                _checkpoint(ckpt, params, opt, steps, tokens, trained_before + elapsed)
                last_ckpt = time.monotonic()
    trained = time.monotonic() - train_start
    bar(budget_s, "done", end=True)
    _checkpoint(ckpt, params, opt, steps, tokens, trained_before + trained)
    draft.hf.eval()
    alpha_after = evaluate()
    say(f"alpha after: {alpha_after:.3f}")
    draft.hf.save_pretrained(draft_dir)
    extra = dict(spec.extra)
    if draft.memory is not None:
        extra.update(draft.memory.learned())
    write_spec(draft_dir, dataclasses.replace(
        spec, distilled_steps=spec.distilled_steps + steps - first.get("steps_written", 0), extra=extra))
    first["steps_written"] = steps
    summary_path.write_text(json.dumps(first))
    window = max(1, len(losses) // 10)
    return {"alpha_before": first["alpha_before"], "alpha_after": alpha_after, "steps": steps,
            "loss_first": sum(losses[:window]) / window if losses else None,
            "loss_last": sum(losses[-window:]) / window if losses else None,
            "train_tokens": tokens, "train_sequences": len(data), "eval_sequences": len(evals),
            "trained_minutes": (trained_before + trained) / 60, "wall_minutes": (time.monotonic() - t_start) / 60,
            "k": k, "weight": weight, "memory_layers": list(spec.memory_layers), "draft": str(draft_dir),
            "memory_gate": draft.memory.gate.detach().tolist() if draft.memory is not None else None,
            "target": target, "log": str(log_path)}


def _checkpoint(path: Path, params, opt, steps: int, tokens: int, trained_s: float) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save({"params": [p.detach().clone() for p in params], "optimizer": opt.state_dict(),
                "steps": steps, "tokens": tokens, "trained_s": trained_s}, tmp)
    tmp.replace(path)


def add_arguments(p: argparse.ArgumentParser) -> None:
    from workers.model.loader import DEFAULT_MODEL

    p.add_argument("--target", default=DEFAULT_MODEL)
    p.add_argument("--draft", required=True, type=Path, help="the draft directory (`specgate draft build`)")
    p.add_argument("--minutes", type=float, required=True, help="wall-clock budget of this run")
    # defaults: the best of the measured 30-minute runs (docs/benchmarks.md, "draft train"): k 1 beat k 4
    # (a k-step pass costs more, so fewer steps fit), ω 0.5 matched or beat 0.2, and a learning
    # rate of 2e-3 beat 5e-4 and 1e-3 and matched 4e-3 (in 30 minutes a draft is far from
    # converged: the larger steps are what the budget buys)
    p.add_argument("--k", type=int, default=1, help="k-step training: tokens drafted from each k-th prefix "
                                                   "(a memory draft only)")
    p.add_argument("--weight", type=float, default=0.5, help="ω of the mixed loss: ω·CE + (1-ω)·(-acceptance)")
    p.add_argument("--data", type=Path, help="directory of the generated text (shared by drafts trained side by side)")
    p.add_argument("--prompts", type=Path, help="JSONL of training prompts; default: questions about Python's "
                                                "standard library")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--memory-lr", type=float, default=0.05, help="learning rate of the memory's mix and gates")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--max-new", type=int, default=160)
    p.add_argument("--gen-share", type=float, default=0.3)
    p.add_argument("--checkpoint-every", type=float, default=300.0)
    p.add_argument("--fresh", action="store_true", help="ignore an existing checkpoint and log")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-steps", type=int, help="stop after this many optimiser steps in all (resumed ones count)")
    p.add_argument("--json", type=Path, help="write the run's summary here")


def run(args: argparse.Namespace) -> int:
    if args.minutes <= 0 or args.k < 1 or not 0 <= args.gen_share < 1:
        raise ValueError("--minutes must be > 0, --k >= 1, --gen-share in [0, 1)")
    prompts = None
    if args.prompts:
        prompts = [json.loads(line) for line in args.prompts.read_text().splitlines() if line.strip()]
    summary = train(args.target, args.draft, minutes=args.minutes, k=args.k, weight=args.weight, lr=args.lr, memory_lr=args.memory_lr,
                    batch=args.batch, max_new=args.max_new, gen_share=args.gen_share, data_dir=args.data,
                    prompts=prompts, checkpoint_every=args.checkpoint_every, fresh=args.fresh, seed=args.seed,
                    max_steps=args.max_steps)
    print(json.dumps(summary, indent=2))
    if args.json:
        write_result(args.json, summary)
    return 0
