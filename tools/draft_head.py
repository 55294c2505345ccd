"""`specgate draft head`: give a draft a cheap head over the target's most frequent tokens.

    specgate draft head --draft DRAFT --tokens 8192 [--data DIR]

Counts token frequencies in text the tools already have, most relevant first: the training
sequences `specgate draft train` / `specgate distill` generated (the target's own replies, in
``--data``, ``DRAFT/spire`` or ``DRAFT/distill``), else the shipped workloads' prompts, and
writes the ``--tokens`` most frequent ids (plus the stop tokens) beside the draft; it reports
the share of held-out target replies (the evaluation set's chat continuations) the head covers,
the figure to choose ``--tokens`` by
(workers/drafters/neural/cheap_head.py). Drafting then computes only those rows of the unembedding; the target
still verifies every token, so output is unchanged. ``--tokens 0`` removes the cheap head.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from workers.drafters.neural.cheap_head import HEAD_FILE, count_tokens, frequent_tokens, write_head

__all__ = ["corpus", "build_head", "add_arguments", "run"]


def corpus(draft: Path, data: Path | None) -> tuple[list[list[int]], str, list[int]]:
    """Token sequences to count, where they came from, and held-out text to check the head on
    (the evaluation set's continuations, the target's chat replies; [] when there is none)."""
    from tools.distill import _load_samples

    for d in ([data] if data else []) + [draft / "spire", draft / "distill"]:
        samples = _load_samples(d / "data.pt")
        if samples:
            held = [t for s in _load_samples(d / "eval.pt") for t in s.ids[s.prompt_len:].tolist()]
            return [s.ids.tolist() for s in samples], str(d / "data.pt"), held
    from transformers import AutoTokenizer

    from loadtest.workload import WORKLOADS, load_workload
    from workers.prompts import encode_record

    tok = AutoTokenizer.from_pretrained(draft)
    return [encode_record(tok, r) for w in WORKLOADS for r in load_workload(w)], "the workloads' prompts", []


def build_head(draft: str | Path, tokens: int, data: str | Path | None = None) -> dict:
    """Write the draft's cheap head; a summary (tokens kept, share of the corpus they cover)."""
    draft = Path(draft)
    cfg = json.loads((draft / "config.json").read_text())
    if tokens == 0:
        (draft / HEAD_FILE).unlink(missing_ok=True)
        return {"draft": str(draft), "tokens": cfg["vocab_size"]}
    seqs, source, held = corpus(draft, Path(data) if data else None)
    counts = count_tokens(seqs, cfg["vocab_size"])
    eos = cfg.get("eos_token_id")
    kept = frequent_tokens(counts, tokens, always=eos if isinstance(eos, list) else [eos] if eos is not None else [])
    write_head(draft, kept)
    covered = float(counts[kept].sum()) / max(float(counts.sum()), 1.0)
    keep = set(kept.tolist())
    return {"draft": str(draft), "tokens": len(kept), "vocab": cfg["vocab_size"], "corpus": source,
            "corpus_tokens": int(counts.sum()), "corpus_distinct": int((counts > 0).sum()),
            "coverage": round(covered, 4),
            # the share of held-out target replies a draft with this head could still propose
            "held_out_coverage": round(sum(t in keep for t in held) / len(held), 4) if held else None}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--draft", required=True, type=Path, help="the draft directory")
    p.add_argument("--tokens", type=int, default=8192, help="tokens the head keeps (0: the whole vocabulary)")
    p.add_argument("--data", type=Path, help="a `specgate draft train --data` directory to count from")


def run(args: argparse.Namespace) -> int:
    if args.tokens < 0:
        raise ValueError("--tokens must be >= 0")
    summary = build_head(args.draft, args.tokens, args.data)
    print(json.dumps(summary, indent=2))
    print(f"cheap head: {summary['tokens']} tokens kept", file=sys.stderr)
    return 0
