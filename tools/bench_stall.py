"""`specgate bench stall`: does one long prompt's prefill stall the streams already running?

For each `--chunks` value (0: each prompt prefilled whole, alone; N: chunked prefill of up to N
tokens a step, `--prefill-chunk-tokens`), one gateway on the real default model in a child process
(`loadtest.compare.gateway_process`), and in it, in order:

    streams   `--streams` streaming completions that count upwards (long, steady outputs);
    baseline  `--baseline-s` seconds of their token events;
    long      one completion of a `--prompt-tokens`-token prompt (max_tokens 4), sent while they
              stream; its latency is the price chunking asks of the long prompt itself;
    after     `--after-s` seconds more (the streams' pace once the prompt is done), then the
              streams are closed.

Per stream, the gaps between its token events (an SSE event carries the tokens one step
committed): the median gap before the long prompt was sent (its normal pace), and the longest gap
that overlaps the long prompt's life. The report's `stall_ratio` is the worst stream's longest gap
over its median, the figure the issue bounds (≤ 3 with chunking; the whole prefill's gap is the
prefill itself). Both settings run in the same invocation, one after the other, on one machine.

A stream's own steps slow down as its context grows (every row attends over every earlier key),
and a chunked prefill takes long enough for the counting streams to be thousands of tokens deeper
at its end than when their median was taken. So each stream also reports its median gap *after*
the prompt finished, at about the depth its last gaps during it had, and `stall_ratio_vs_after`
is the worst stream's longest gap during over that: what the prompt added, the streams' growth
left out (None where a stream ended before the prompt did).
"""
from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from pathlib import Path
from typing import Any

from loadtest.results import write_result

KEY = "sk-bench-stall"
COUNTING = "Count from 1 to 1000, separated by commas: 1, 2, 3, 4, 5, 6, 7, 8, 9, 10,"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="model for the gateway (default: serve's default)")
    p.add_argument("--prompt-tokens", type=int, default=4000, help="the long prompt's length")
    p.add_argument("--streams", type=int, default=4, help="streams running beside it")
    p.add_argument("--chunks", default="0,24", help="comma-separated --prefill-chunk-tokens values")
    p.add_argument("--baseline-s", type=float, default=4.0)
    p.add_argument("--after-s", type=float, default=4.0,
                   help="seconds the streams run on after the long prompt finished")
    p.add_argument("--json", type=Path, help="write the report here")


def run(args: argparse.Namespace) -> int:
    chunks = [int(c) for c in args.chunks.split(",") if c.strip()]
    report = bench_stall(model=args.model, prompt_tokens=args.prompt_tokens, streams=args.streams,
                         chunks=chunks, baseline_s=args.baseline_s, after_s=args.after_s)
    text = json.dumps(report, indent=1)
    if args.json:
        write_result(args.json, report)
    print(text)
    return 0


def long_prompt(model: str | None, tokens: int) -> str:
    """Text of about `tokens` tokens for the model's tokenizer (varied words: no drafter can
    copy its way through the answer, and the prefix cache has never seen it)."""
    import numpy as np

    from workers.model.loader import DEFAULT_MODEL, load_tokenizer

    tok = load_tokenizer(model or DEFAULT_MODEL, progress=False)
    rng = np.random.default_rng(0)
    words = ["river", "lantern", "quietly", "seven", "copper", "meadow", "argue", "velvet", "north",
             "tumble", "orchard", "signal", "brisk", "harbor", "ember", "puzzle", "glacier", "wander"]
    text = " ".join(rng.choice(words, size=tokens * 2).tolist())
    ids = tok(text, add_special_tokens=False)["input_ids"][:tokens]
    return tok.decode(ids)


def bench_stall(*, model: str | None = None, prompt_tokens: int = 4000, streams: int = 4,
                chunks: list[int] = (0, 24), baseline_s: float = 4.0,
                after_s: float = 4.0) -> dict[str, Any]:
    text = long_prompt(model, prompt_tokens)
    out: dict[str, Any] = {"settings": {"model": model or "default", "prompt_tokens": prompt_tokens,
                                        "streams": streams, "baseline_s": baseline_s,
                                        "after_s": after_s},
                           "runs": {}}
    for chunk in chunks:
        out["runs"][str(chunk)] = _one(model, chunk, text, streams, baseline_s, after_s)
    runs = out["runs"]
    if "0" in runs and len(runs) > 1:
        whole = runs["0"]["long_latency_s"]
        out["long_latency_vs_whole"] = {k: round(r["long_latency_s"] / whole, 3)
                                        for k, r in runs.items() if k != "0"}
    return out


def _one(model: str | None, chunk: int, text: str, n_streams: int, baseline_s: float,
         after_s: float) -> dict[str, Any]:
    import httpx

    from loadtest.compare import ADMIN_KEY, gateway_process

    settings: dict[str, Any] = {"redis_url": None, "tenants_file": None, "log_level": "warning",
                                "admin_key": ADMIN_KEY, "prefill_chunk_tokens": chunk,
                                "max_batch": max(8, n_streams + 1)}
    if model:
        settings["model"] = model
    with gateway_process(settings, [("bench", KEY)]) as gw:
        headers = {"Authorization": f"Bearer {KEY}"}
        model_id = httpx.get(gw.url + "/v1/models", headers=headers, timeout=60).json()["data"][0]["id"]
        stop = threading.Event()
        events: list[list[float]] = [[] for _ in range(n_streams)]
        threads = [threading.Thread(target=_stream, args=(gw.url, headers, model_id, events[i], stop),
                                    daemon=True) for i in range(n_streams)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 600
        while min(len(e) for e in events) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(baseline_s)
        t_send = time.perf_counter()
        r = httpx.post(gw.url + "/v1/completions", headers=headers, timeout=900,
                       json={"model": model_id, "prompt": text, "max_tokens": 4, "temperature": 0})
        t_done = time.perf_counter()
        r.raise_for_status()
        prompt_used = r.json()["usage"]["prompt_tokens"]
        time.sleep(after_s)
        stop.set()
        for t in threads:
            t.join(30)
    per_stream = [g for g in (stream_gaps(ev, t_send, t_done) for ev in events) if g is not None]
    worst = max(per_stream, key=lambda s: s["ratio"], default=None)
    vs_after = [s["ratio_vs_after"] for s in per_stream if s["ratio_vs_after"] is not None]
    return {"prefill_chunk_tokens": chunk, "prompt_tokens": prompt_used,
            "long_latency_s": round(t_done - t_send, 3), "streams_measured": len(per_stream),
            "stall_ratio": None if worst is None else worst["ratio"],
            "stall_ratio_vs_after": max(vs_after, default=None),
            "worst_stream": worst, "streams": per_stream}


def stream_gaps(events: list[float], t_send: float, t_done: float) -> dict[str, Any] | None:
    """One stream's token events (times) → its median gap before `t_send` and the gaps that
    overlap [t_send, t_done]; None when it has too few of either (it ended early).

    >>> g = stream_gaps([0.0, 0.1, 0.2, 0.3, 0.4, 1.4, 1.5, 1.7, 1.9, 2.1], t_send=0.45, t_done=1.45)
    >>> g["median_gap_ms"], g["max_gap_during_ms"], g["ratio"], g["max_gap_at_s"]
    (100.0, 1000.0, 10.0, -0.05)
    >>> g["median_gap_after_ms"], g["ratio_vs_after"]
    (200.0, 5.0)
    """
    gaps = list(zip(events, events[1:]))
    before = [b - a for a, b in gaps if b <= t_send]
    during = [(b - a, a) for a, b in gaps if a <= t_done and b >= t_send]
    if len(before) < 3 or not during:
        return None
    median = statistics.median(before)
    worst, at = max(during)
    spans = sorted(g for g, _ in during)
    after = [b - a for a, b in gaps if a >= t_done]
    after_median = statistics.median(after) if len(after) >= 3 else None
    return {"median_gap_ms": round(1000 * median, 1),
            "median_gap_after_ms": None if after_median is None else round(1000 * after_median, 1),
            "ratio_vs_after": None if after_median is None else round(worst / after_median, 2),
            "max_gap_during_ms": round(1000 * worst, 1),
            "ratio": round(worst / median, 2),
            "max_gap_at_s": round(at - t_send, 3),      # where the longest gap began
            "gaps_during": len(spans),
            "p50_gap_during_ms": round(1000 * spans[len(spans) // 2], 1),
            "p90_gap_during_ms": round(1000 * spans[int(0.9 * (len(spans) - 1))], 1)}


def _stream(url: str, headers: dict, model_id: str, events: list[float], stop: threading.Event) -> None:
    import httpx

    body = {"model": model_id, "prompt": COUNTING, "max_tokens": 3000, "temperature": 0, "stream": True}
    with httpx.stream("POST", url + "/v1/completions", headers=headers, json=body, timeout=900) as r:
        for line in r.iter_lines():
            if stop.is_set():
                return
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(time.perf_counter())
