"""`specgate distill`: train a draft against the target on text the target itself generates.

Why the target's own text: a draft is judged by how often it predicts what the *target* will say,
not what a corpus says; training on the target's greedy continuations (and its distributions at
every position) teaches exactly that (EAGLE, Medusa and SPIRe do the same).

A run, all under one wall-clock budget (``--minutes``):
1. Evaluation set (once per draft directory, cached): the target's greedy continuations of the
   ``chat`` workload's prompts. ``alpha`` = the share of those continuation tokens the draft's top-1
   predicts, given the text so far: the per-token acceptance of greedy speculation with this draft.
2. Training data (``--gen-share`` of the budget, cached and extended across runs): the target
   continues training prompts greedily — by default questions about Python's standard library
   (`training_prompts`), not the evaluation prompts — and one target pass over each whole sequence
   keeps its top-``TOP_K`` log-probabilities at every position.
3. Training: AdamW on the draft's blocks and final norm (the embedding and unembedding, shared with
   the target, stay frozen unless ``--train-embeddings``), with the draft's own sparse attention
   mask (`workers.drafters.neural.draft_model.sparse_mask`), so it learns to see what it will see when drafting.
   Loss per position, with p the target's top-k distribution (renormalised) and q the draft's:

       cross-entropy(p, q) + λ · (1 − Σ_k min(p_k, q_k))

   The first term is distillation (KL up to a constant); the second is one minus the acceptance
   probability of speculative sampling with q against p (Leviathan et al.), the quantity drafting
   is paid by.

Checkpoints (``DIR/distill/checkpoint.pt``: trainable weights, optimiser, counters) are written
every ``--checkpoint-every`` seconds and at the end; a later run resumes from it unless
``--fresh``. The trained weights are written back into the draft directory at the end, and
``specgate_draft.json`` counts the optimiser steps.

``--device`` (workers/model/device.py; ``auto`` takes CUDA when torch sees a GPU): the target that
generates the text, the draft, its optimiser and every batch run there; cached samples and
checkpoints are kept on the host, so a run can resume on another device. Timings synchronise
the device before reading the clock, so ``trained_minutes`` and ``step_s`` are the work's own.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import torch

from workers.model.device import resolve_device, synchronize
from workers.drafters.neural.draft_model import DraftSpec, read_spec, sparse_mask, write_spec
from loadtest.results import write_result

__all__ = ["TOP_K", "training_prompts", "distill_loss", "alpha", "distill", "add_arguments", "run"]

TOP_K = 32                      # target log-probabilities kept per position
EVAL_TOKENS = 128               # continuation tokens per evaluation prompt
STATE_DIR = "distill"

_TEMPLATES = (
    "What is the Python module `{m}` for? Give a short example.",
    "Explain how to use `{m}` in Python to someone new to the language.",
    "Write a small Python function that uses the `{m}` module, and explain it.",
    "What are common mistakes when using Python's `{m}` module?",
    "Compare `{m}` with an alternative in Python. When would you pick each?",
)


def training_prompts(seed: int = 0) -> list[dict]:
    """Chat records asking about the standard library's public modules, shuffled (seeded)."""
    mods = sorted(m for m in sys.stdlib_module_names if not m.startswith("_"))
    records = [{"messages": [{"role": "user", "content": t.format(m=m)}]} for m in mods for t in _TEMPLATES]
    random.Random(seed).shuffle(records)
    return records


@dataclass
class Sample:
    """One training or evaluation sequence: prompt + the target's greedy continuation."""
    ids: torch.Tensor           # [T] long
    prompt_len: int
    top_lp: torch.Tensor | None = None    # [T, TOP_K] float16: the target's top log-probs per position
    top_ix: torch.Tensor | None = None    # [T, TOP_K] int32: their token ids


@dataclass
class _Progress:
    steps: int = 0
    tokens: int = 0
    elapsed_s: float = 0.0
    losses: list[float] = field(default_factory=list)


# -- pure pieces ----------------------------------------------------------------------------------


def distill_loss(logits: torch.Tensor, top_lp: torch.Tensor, top_ix: torch.Tensor, mask: torch.Tensor,
                 accept_weight: float = 1.0) -> torch.Tensor:
    """Mean over positions where `mask` of  CE(p, q) + λ (1 − Σ min(p, q)) on the target's top-k.

    logits: [N, V] the draft's; top_lp/top_ix: [N, K] the target's top-k log-probs and ids;
    mask: [N] bool. p is renormalised over its top k; q is the draft's full softmax, read at the k ids.

    >>> V = 5; lp = torch.log(torch.tensor([[0.5, 0.5]])); ix = torch.tensor([[1, 3]])
    >>> perfect = torch.full((1, V), -1e9); perfect[0, 1] = perfect[0, 3] = 0.0
    >>> round(float(distill_loss(perfect, lp, ix, torch.tensor([True]))), 4)   # CE = entropy of p
    0.6931
    """
    logq = torch.log_softmax(logits.float(), dim=-1).gather(-1, top_ix.long())   # [N, K]
    p = torch.softmax(top_lp.float(), dim=-1)                                     # [N, K]
    ce = -(p * logq).sum(-1)                                                      # [N]
    accept = torch.minimum(p, logq.exp()).sum(-1)                                 # [N]
    per = ce + accept_weight * (1.0 - accept)
    m = mask.float()
    return (per * m).sum() / m.sum().clamp(min=1.0)


def _band(length: int, spec: DraftSpec, device: torch.device | str = "cpu") -> torch.Tensor:
    pos = torch.arange(length, device=device)
    return sparse_mask(pos, pos, spec.sink, spec.window)                          # [T, T]


def _pad_batch(samples: Sequence[Sample], device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """ids [B, T] (padded with 0) and a [B, T] bool mask of real positions, on `device`
    (built on the host from the host samples, then one copy each)."""
    t = max(len(s.ids) for s in samples)
    ids = torch.zeros(len(samples), t, dtype=torch.long)
    real = torch.zeros(len(samples), t, dtype=torch.bool)
    for b, s in enumerate(samples):
        ids[b, : len(s.ids)] = s.ids
        real[b, : len(s.ids)] = True
    return ids.to(device), real.to(device)


def _draft_logits(draft, ids: torch.Tensor, spec: DraftSpec) -> torch.Tensor:
    """The draft's logits [B, T, V] under its own sparse attention (on the ids' device)."""
    mask = _band(ids.shape[1], spec, ids.device)[None, None].expand(ids.shape[0], 1, -1, -1)
    return draft(input_ids=ids, attention_mask=mask).logits


@torch.no_grad()
def alpha(draft, samples: Sequence[Sample], spec: DraftSpec, batch: int = 4) -> float:
    """Share of continuation tokens the draft's argmax predicts from the true prefix (teacher forced)."""
    hit = total = 0
    for i in range(0, len(samples), batch):
        chunk = samples[i: i + batch]
        ids, _ = _pad_batch(chunk, draft.device)
        pred = _draft_logits(draft, ids, spec).argmax(-1).cpu()                   # [B, T] on the host
        for b, s in enumerate(chunk):
            n = len(s.ids)
            # Position t predicts token t + 1; count predictions of continuation tokens only.
            hit += int((pred[b, s.prompt_len - 1: n - 1] == s.ids[s.prompt_len: n]).sum())
            total += n - s.prompt_len
    return hit / max(total, 1)


# -- data -------------------------------------------------------------------------------------------


def _generate(runtime, records: Sequence[dict], max_new: int, *, deadline: float | None = None,
              batch: int = 16, top_k: int = TOP_K) -> list[Sample]:
    """The target's greedy continuations of `records`, with its top-k at every position when
    top_k > 0; stops between batches once `deadline` (time.monotonic) has passed."""
    from workers.contract import SamplingParams
    from workers.contract import NO_SPECULATION
    from workers.drafters.registry import create_drafter
    from scheduler.generation import Engine, GenerationRequest
    from workers.model.llama_forward import Segment
    from workers.prompts import encode_record

    engine = Engine(runtime.verifier(), create_drafter("none"), NO_SPECULATION, adaptive=False)
    out: list[Sample] = []
    for i in range(0, len(records), batch):
        if deadline is not None and time.monotonic() > deadline:
            break
        prompts = [encode_record(runtime.tokenizer, r) for r in records[i: i + batch]]
        reqs = [GenerationRequest(f"d{i + k}", tuple(p), max_new, SamplingParams(), runtime.stop_token_ids)
                for k, p in enumerate(prompts)]
        for p, res in zip(prompts, engine.generate(reqs)):
            ids = torch.tensor(p + res.token_ids)
            s = Sample(ids, len(p))
            if top_k:
                n = len(ids)
                cache = runtime.forward.new_cache(n)
                causal = torch.full((n, n), float("-inf")).triu(1)
                logits = runtime.forward.forward(ids, torch.arange(n), [Segment(cache, 0, n, causal)],
                                                 torch.arange(n))
                lp, ix = torch.log_softmax(logits.float(), -1).topk(top_k, dim=-1)
                s.top_lp, s.top_ix = lp.half().cpu(), ix.int().cpu()     # kept on the host
            out.append(s)
    return out


def state_directory(path: Path, fresh: bool) -> Path:
    """A training run's state directory (checkpoint, logs, cached data), created; emptied of
    its files first when `fresh`, so the run starts over instead of resuming."""
    if fresh and path.exists():
        for f in path.iterdir():
            if f.is_file():
                f.unlink()
    path.mkdir(parents=True, exist_ok=True)
    return path


def _save_samples(path: Path, samples: Sequence[Sample]) -> None:
    torch.save([s.__dict__ for s in samples], path)


def _load_samples(path: Path) -> list[Sample]:
    return [Sample(**d) for d in torch.load(path)] if path.is_file() else []


# -- training -----------------------------------------------------------------------------------------


def _trainable(draft, train_embeddings: bool) -> list[torch.nn.Parameter]:
    for p in draft.parameters():
        p.requires_grad_(False)
    params = [p for layer in draft.model.layers for p in layer.parameters()] + list(draft.model.norm.parameters())
    if train_embeddings:
        params += list(draft.model.embed_tokens.parameters())
    for p in params:
        p.requires_grad_(True)
    return params


def distill(target: str, draft_dir: str | Path, *, minutes: float, prompts: Sequence[dict] | None = None,
            eval_prompts: Sequence[dict] | None = None, lr: float = 5e-4, batch: int = 4,
            max_new: int = 160, eval_tokens: int = EVAL_TOKENS, gen_share: float = 0.3,
            accept_weight: float = 1.0, train_embeddings: bool = False, checkpoint_every: float = 300.0,
            fresh: bool = False, seed: int = 0, device: str = "auto", progress: bool = True) -> dict:
    """Train the draft in `draft_dir` for `minutes` of wall time (this module's docstring); returns
    the summary `specgate distill --json` writes. `device`: where the target and the draft run."""
    from transformers import AutoModelForCausalLM

    from loadtest.workload import load_workload
    from workers.runtime import load_runtime

    dev = resolve_device(device)          # a GPU asked for where there is none: refused before any work
    t_start = time.monotonic()
    deadline = t_start + minutes * 60.0
    draft_dir = Path(draft_dir)
    state_dir = state_directory(draft_dir / STATE_DIR, fresh)
    torch.manual_seed(seed)
    spec = read_spec(draft_dir)
    runtime = load_runtime(target, device=str(dev), progress=False)
    draft = AutoModelForCausalLM.from_pretrained(draft_dir, dtype=torch.float32).to(dev)
    if draft.config.vocab_size != runtime.forward.vocab_size:
        raise ValueError(f"the draft's vocabulary ({draft.config.vocab_size}) is not the target's "
                         f"({runtime.forward.vocab_size}): a draft must share the target's tokenizer")

    say = (lambda msg: print(f"distill: {msg}", file=sys.stderr, flush=True)) if progress else (lambda msg: None)
    eval_path = state_dir / "eval.pt"
    evals = _load_samples(eval_path)
    if not evals:
        say("generating the evaluation set (the target's greedy continuations of the chat prompts)")
        evals = _generate(runtime, eval_prompts if eval_prompts is not None else load_workload("chat"),
                          eval_tokens, top_k=0)
        _save_samples(eval_path, evals)

    ckpt_path = state_dir / "checkpoint.pt"
    params = _trainable(draft, train_embeddings)
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    prog = _Progress()
    summary_path = state_dir / "summary.json"
    first = json.loads(summary_path.read_text()) if summary_path.is_file() and not fresh else {}
    if ckpt_path.is_file():
        ck = torch.load(ckpt_path, map_location="cpu")   # the optimiser moves its state to the params
        draft.load_state_dict(ck["weights"], strict=False)
        opt.load_state_dict(ck["optimizer"])
        prog = _Progress(ck["steps"], ck["tokens"], ck["elapsed_s"], ck["losses"])
        say(f"resumed at step {prog.steps} ({prog.elapsed_s / 60:.1f} minutes trained before)")
    draft.eval()
    alpha_before = first.get("alpha_before")
    if alpha_before is None:
        alpha_before = alpha(draft, evals, spec)
        first = {"alpha_before": alpha_before}
        summary_path.write_text(json.dumps(first))
    say(f"alpha before: {alpha_before:.3f} on {sum(len(s.ids) - s.prompt_len for s in evals)} tokens")

    data_path = state_dir / "data.pt"
    data = _load_samples(data_path)
    records = list(prompts) if prompts is not None else training_prompts(seed)
    gen_deadline = time.monotonic() + gen_share * (deadline - time.monotonic())
    if len(data) < len(records) and time.monotonic() < gen_deadline:
        say(f"generating training text ({len(data)} sequences cached)")
        data += _generate(runtime, records[len(data):], max_new, deadline=gen_deadline)
        _save_samples(data_path, data)
    data = [s for s in data if s.top_lp is not None]
    if not data:
        raise ValueError("no training data: raise --minutes or --gen-share")
    say(f"training on {len(data)} sequences, {sum(len(s.ids) for s in data)} tokens")

    rng = random.Random(seed + prog.steps)
    steps_at_start = prog.steps
    synchronize(dev)
    train_start = time.monotonic()
    budget_s = max(deadline - train_start, 1e-9)
    last_ckpt = time.monotonic()
    bar = _bar(budget_s, progress)
    draft.train()
    while time.monotonic() < deadline:
        frac = (time.monotonic() - train_start) / budget_s
        for g in opt.param_groups:   # linear warm-up over 20 steps, then cosine to 10% by the deadline
            g["lr"] = lr * min(1.0, (prog.steps + 1) / 20) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))
        chunk = rng.sample(data, min(batch, len(data)))
        ids, real = _pad_batch(chunk, dev)
        logits = _draft_logits(draft, ids, spec)                                   # [B, T, V]
        # Position t is trained on the target's distribution at t (what follows token t).
        lp = torch.zeros(*ids.shape, TOP_K, dtype=torch.float32)                  # [B, T, K] on the host
        ix = torch.zeros(*ids.shape, TOP_K, dtype=torch.int64)
        for b, s in enumerate(chunk):
            lp[b, : len(s.ids)] = s.top_lp.float()
            ix[b, : len(s.ids)] = s.top_ix.long()
        lp, ix = lp.to(dev), ix.to(dev)
        loss = distill_loss(logits.flatten(0, 1), lp.flatten(0, 1), ix.flatten(0, 1), real.flatten(),
                            accept_weight)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        prog.steps += 1
        prog.tokens += int(real.sum())
        prog.losses.append(float(loss.detach()))
        bar(time.monotonic() - train_start, f"step {prog.steps} loss {prog.losses[-1]:.3f}")
        if time.monotonic() - last_ckpt > checkpoint_every:
            synchronize(dev)
            _checkpoint(ckpt_path, draft, opt, prog, params, time.monotonic() - train_start)
            last_ckpt = time.monotonic()
    bar(budget_s, "done", end=True)
    synchronize(dev)
    trained_s = time.monotonic() - train_start
    _checkpoint(ckpt_path, draft, opt, prog, params, trained_s)
    steps_now = prog.steps - steps_at_start
    prog.elapsed_s += trained_s
    draft.eval()
    alpha_after = alpha(draft, evals, spec)
    say(f"alpha after: {alpha_after:.3f}")
    draft.save_pretrained(draft_dir)
    write_spec(draft_dir, dataclasses.replace(
        spec, distilled_steps=spec.distilled_steps + (prog.steps - _steps_before(first))))
    first["steps_written"] = prog.steps
    summary_path.write_text(json.dumps(first))
    window = max(1, len(prog.losses) // 10)
    return {
        "alpha_before": alpha_before, "alpha_after": alpha_after,
        "loss_first": sum(prog.losses[:window]) / window if prog.losses else None,
        "loss_last": sum(prog.losses[-window:]) / window if prog.losses else None,
        "steps": prog.steps, "train_tokens": prog.tokens, "train_sequences": len(data),
        "eval_sequences": len(evals), "eval_tokens": sum(len(s.ids) - s.prompt_len for s in evals),
        "trained_minutes": prog.elapsed_s / 60, "wall_minutes": (time.monotonic() - t_start) / 60,
        "step_s": trained_s / max(steps_now, 1), "device": str(dev),
        "draft": str(draft_dir), "target": target, "sink": spec.sink, "window": spec.window,
        "source_layers": list(spec.source_layers),
    }


def _steps_before(first: dict) -> int:
    return int(first.get("steps_written", 0))


def _checkpoint(path: Path, draft, opt, prog: _Progress, params, trained_s: float) -> None:
    keep = {id(p) for p in params}
    # on the host, so a checkpoint resumes on any device
    weights = {k: v.detach().to("cpu", copy=True) for k, v in draft.named_parameters() if id(v) in keep}
    tmp = path.with_suffix(".tmp")
    torch.save({"weights": weights, "optimizer": _to_host(opt.state_dict()), "steps": prog.steps,
                "tokens": prog.tokens, "elapsed_s": prog.elapsed_s + trained_s, "losses": prog.losses}, tmp)
    tmp.replace(path)


def _to_host(state):
    """An optimiser state dict with every tensor copied to the host (nested dicts and lists)."""
    if isinstance(state, torch.Tensor):
        return state.detach().to("cpu", copy=True)
    if isinstance(state, dict):
        return {k: _to_host(v) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(_to_host(v) for v in state)
    return state


def _bar(total_s: float, enabled: bool, desc: str = "distill"):
    """A progress bar over wall time; returns update(done_s, text, end=False)."""
    if not enabled:
        return lambda done, text, end=False: None
    from tqdm import tqdm

    bar = tqdm(total=round(total_s), unit="s", desc=desc, file=sys.stderr, mininterval=1.0)

    def update(done: float, text: str, end: bool = False) -> None:
        bar.n = min(round(done), bar.total)
        bar.set_postfix_str(text, refresh=False)
        bar.refresh() if end else bar.update(0)
        if end:
            bar.close()
    return update


# -- CLI ------------------------------------------------------------------------------------------------


def add_arguments(p: argparse.ArgumentParser) -> None:
    from workers.model.loader import DEFAULT_MODEL

    p.add_argument("--target", default=DEFAULT_MODEL)
    p.add_argument("--draft", required=True, type=Path, help="the draft directory (`specgate draft build`)")
    p.add_argument("--minutes", type=float, required=True, help="wall-clock budget of this run")
    p.add_argument("--prompts", type=Path, help="JSONL of training prompts ({prompt} or {messages}); "
                                                "default: questions about Python's standard library")
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--batch", type=int, default=4, help="sequences per optimiser step")
    p.add_argument("--max-new", type=int, default=160, help="tokens the target generates per training prompt")
    p.add_argument("--gen-share", type=float, default=0.3, help="share of the budget spent generating text")
    p.add_argument("--accept-weight", type=float, default=1.0, help="λ of the acceptance term")
    p.add_argument("--train-embeddings", action="store_true", help="also train the (shared) embedding")
    p.add_argument("--checkpoint-every", type=float, default=300.0, help="seconds between checkpoints")
    p.add_argument("--fresh", action="store_true", help="ignore an existing checkpoint and cached data")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="auto", help="where the target and the draft run: auto (CUDA when "
                                                    "torch sees a GPU, else the CPU), cpu, cuda or cuda:N")
    p.add_argument("--json", type=Path, help="write alpha_before, alpha_after and the run's figures here")


def run(args: argparse.Namespace) -> int:
    if args.minutes <= 0:
        raise ValueError("--minutes must be > 0")
    if not 0 <= args.gen_share < 1:
        raise ValueError("--gen-share must be in [0, 1)")
    prompts = None
    if args.prompts:
        prompts = [json.loads(line) for line in args.prompts.read_text().splitlines() if line.strip()]
    summary = distill(args.target, args.draft, minutes=args.minutes, prompts=prompts, lr=args.lr,
                      batch=args.batch, max_new=args.max_new, gen_share=args.gen_share,
                      accept_weight=args.accept_weight, train_embeddings=args.train_embeddings,
                      checkpoint_every=args.checkpoint_every, fresh=args.fresh, seed=args.seed,
                      device=args.device)
    print(json.dumps(summary, indent=2))
    if args.json:
        write_result(args.json, summary)
    return 0
