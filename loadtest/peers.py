"""Other engines in `specgate bench engine --peers`, on the same prompt token ids in the same run.

Ratios between systems only mean something when measured side by side (these machines are
noisy), so a peer generates each prompt right after transformers and specgate did.

Peers are optional: one whose package is missing is reported with the reason ("llama-cpp-python
is not installed") and the run goes on. None is a dependency of specgate or of its CI.

- `llama.cpp` (llama-cpp-python): greedy, once plain and once with prompt lookup of as many tokens
  as transformers' prompt lookup gets, on a built-in model's GGUF dequantized to float32 (the
  values specgate computes with; llama.cpp multiplies a quantized GGUF in its quantized form), or
  on `--peer-gguf FILE`. Even in float32 its kernels sum in another order than torch's, so its
  output can differ from transformers' at near-ties; `identical` says whether it did.
"""
from __future__ import annotations

import importlib.util
import os
import time
from typing import Callable, Sequence

__all__ = ["PEERS", "parse_peers", "load_peers", "PeerRunner"]

PEERS = ("llama.cpp",)

# (prompt token ids, max new tokens) -> (new token ids, seconds)
PeerRunner = Callable[[Sequence[int], int], tuple[list[int], float]]


def parse_peers(text: str | None) -> tuple[str, ...]:
    """`--peers` as a tuple of known peer names ('' or None: no peers).

    >>> parse_peers("llama.cpp"), parse_peers("")
    (('llama.cpp',), ())
    """
    names = tuple(dict.fromkeys(p.strip() for p in (text or "").split(",") if p.strip()))
    unknown = [n for n in names if n not in PEERS]
    if unknown:
        raise ValueError(f"unknown peer(s) {', '.join(unknown)}; known: {', '.join(PEERS)}")
    return names


def load_peers(names: Sequence[str], *, model: str, gguf: str | None, prompt_lookup: int,
               stop_token_ids: Sequence[int], threads: int | None = None
               ) -> tuple[dict[str, PeerRunner], dict[str, str]]:
    """(runners by configuration name, e.g. 'llama.cpp' and 'llama.cpp+lookup10'; why each peer
    that could not be loaded was not)."""
    runners: dict[str, PeerRunner] = {}
    missing: dict[str, str] = {}
    for name in names:
        if name == "llama.cpp":
            if importlib.util.find_spec("llama_cpp") is None:
                missing[name] = "llama-cpp-python is not installed (pip install llama-cpp-python)"
                continue
            from workers.loader import gguf_file
            # float32 unless a file is given: llama.cpp then computes with specgate's own weights.
            path = str(gguf_file(gguf) if gguf else gguf_file(model, float32=True))
            runners[name] = _llama_cpp(path, None, stop_token_ids, threads)
            if prompt_lookup:
                runners[f"{name}+lookup{prompt_lookup}"] = _llama_cpp(path, prompt_lookup, stop_token_ids, threads)
    return runners, missing


def _llama_cpp(path: str, lookup: int | None, stop_token_ids: Sequence[int],
               threads: int | None) -> PeerRunner:
    from llama_cpp import Llama
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    n_threads = threads or len(os.sched_getaffinity(0))
    # logits_all with a draft model: llama-cpp-python 0.3 verifies drafts from logits it keeps
    # for every position, but sizes that buffer for n_batch rows unless told at construction
    # (prompts longer than that fail with a broadcast error).
    llm = Llama(model_path=path, n_ctx=4096, n_batch=512, n_threads=n_threads, n_threads_batch=n_threads,
                verbose=False, logits_all=bool(lookup),
                draft_model=LlamaPromptLookupDecoding(num_pred_tokens=lookup) if lookup else None)
    stops = set(stop_token_ids) | {llm.token_eos()}

    def run(prompt: Sequence[int], max_tokens: int) -> tuple[list[int], float]:
        out: list[int] = []
        t0 = time.perf_counter()
        # temp 0 is argmax decoding; reset=True still reuses the KV of a prefix shared with the
        # previous prompt, as specgate's prefix cache does.
        for tok in llm.generate(list(prompt), top_k=1, top_p=1.0, min_p=0.0, temp=0.0,
                                repeat_penalty=1.0, reset=True):
            out.append(int(tok))    # a stop token included, as transformers and specgate keep it
            if tok in stops or len(out) >= max_tokens:
                break
        return out, time.perf_counter() - t0

    return run
