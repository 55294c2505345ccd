"""`specgate bench front`: does one client's huge prompt stall the gateway for everyone else?

One gateway on the real default model in a child process (`loadtest.compare.gateway_process`), a
thread here asking GET /health every `--probe-ms` over its own keep-alive connection, and, one at
a time, the requests under test from another connection:

    huge        a chat prompt of `--huge-chars` characters (2 MB by default, under the body
                limit): refused with 413 before tokenization (more characters than the context
                could hold at the tokenizer's longest token, gateway/text.py max_token_chars);
    tokenized   a prompt just under that bound: tokenized in full, off the event loop, then 413
                (the context); the slowest path a prompt under the body limit can take;
    over_rpm    the huge prompt again from a tenant already over its requests per minute: 429
                before any work on the prompt (not 413).

For each: its status and seconds, and the /health probes that overlapped it: the worst probe
latency against the idle probes' median (`health_delay_ms`: worst − idle median), the figure the
issue bounds (≤ 50 ms for a 2 MB prompt). Machines are noisy: each request is sent `--repeat`
times and the worst of all overlapping probes is reported.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

from loadtest.results import write_result

FREE_KEY, METERED_KEY = "sk-bench-front-free", "sk-bench-front-metered"
WORDS = "the quick brown fox jumps over a lazy dog while seven tired otters hum "


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="model for the gateway (default: serve's default)")
    p.add_argument("--huge-chars", type=int, default=2_000_000)
    p.add_argument("--probe-ms", type=float, default=5.0, help="pause between /health probes")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--json", type=Path, help="write the report here")


def run(args: argparse.Namespace) -> int:
    report = bench_front(model=args.model, huge_chars=args.huge_chars, probe_s=args.probe_ms / 1000,
                         repeat=args.repeat)
    text = json.dumps(report, indent=1)
    if args.json:
        write_result(args.json, report)
    print(text)
    return 0


def prompt_of(chars: int) -> str:
    return (WORDS * (chars // len(WORDS) + 1))[:chars]


def bench_front(*, model: str | None = None, huge_chars: int = 2_000_000, probe_s: float = 0.005,
                repeat: int = 3) -> dict[str, Any]:
    import httpx

    from loadtest.compare import ADMIN_KEY, gateway_process

    bound = tokenized_bound(model)
    settings: dict[str, Any] = {"redis_url": None, "tenants_file": None, "log_level": "warning",
                                "admin_key": ADMIN_KEY}
    if model:
        settings["model"] = model
    with gateway_process(settings, [("free", FREE_KEY)]) as gw:
        admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
        r = httpx.post(gw.url + "/admin/tenants", headers=admin, timeout=30,
                       json={"name": "metered", "api_keys": [METERED_KEY], "rpm": 1})
        r.raise_for_status()
        with httpx.Client(base_url=gw.url, timeout=120) as c:
            model_id = c.get("/v1/models", headers=_auth(FREE_KEY)).json()["data"][0]["id"]
            # the metered tenant's one request a minute, spent
            assert _chat(c, METERED_KEY, model_id, "hi")[0] == 200
            probes = _Probes(gw.url, probe_s)
            probes.start()
            try:
                time.sleep(1.0)
                cases = {"huge": (FREE_KEY, huge_chars), "tokenized": (FREE_KEY, bound),
                         "over_rpm": (METERED_KEY, huge_chars)}
                sent: dict[str, list[tuple[float, float, int]]] = {k: [] for k in cases}
                for _ in range(repeat):
                    for name, (key, chars) in cases.items():
                        text = prompt_of(chars)
                        t0 = time.perf_counter()
                        status, _ = _chat(c, key, model_id, text)
                        sent[name].append((t0, time.perf_counter(), status))
                        time.sleep(0.5)
            finally:
                probes.stop()
    idle = [lat for t, lat in probes.samples
            if not any(a - 0.2 <= t <= b + 0.2 for runs in sent.values() for a, b, _ in runs)]
    idle_median = statistics.median(idle) if idle else None
    out: dict[str, Any] = {"settings": {"model": model or "default", "huge_chars": huge_chars,
                                        "tokenized_chars": bound, "probe_ms": probe_s * 1000,
                                        "repeat": repeat},
                           "idle_health_ms": {"median": _ms(idle_median),
                                              "max": _ms(max(idle, default=None)),
                                              "probes": len(idle)}}
    for name, runs in sent.items():
        overlapping = [lat for t, lat in probes.samples
                       for a, b, _ in runs if a <= t + lat and t <= b]
        worst = max(overlapping, default=None)
        out[name] = {"chars": cases[name][1], "statuses": sorted({s for _, _, s in runs}),
                     "seconds": [round(b - a, 3) for a, b, _ in runs],
                     "probes_during": len(overlapping), "worst_health_ms": _ms(worst),
                     "health_delay_ms": _ms(worst - idle_median)
                     if worst is not None and idle_median is not None else None}
    return out


def _ms(x: float | None) -> float | None:
    return None if x is None else round(1000 * x, 2)


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def _chat(c: Any, key: str, model: str, text: str) -> tuple[int, dict]:
    r = c.post("/v1/chat/completions", headers=_auth(key),
               json={"model": model, "max_tokens": 4, "temperature": 0,
                     "messages": [{"role": "user", "content": text}]})
    return r.status_code, r.json()


def tokenized_bound(model: str | None) -> int:
    """The longest prompt, in characters, the gateway still tokenizes: (context − 1) tokens of
    the tokenizer's longest token (gateway/service/sizes.py `check`), less a margin."""
    from transformers import AutoConfig

    from gateway.text import max_token_chars
    from workers.model.loader import DEFAULT_MODEL, load_tokenizer, resolve_model

    name = model or DEFAULT_MODEL
    context = AutoConfig.from_pretrained(resolve_model(name, progress=False)).max_position_embeddings
    return (context - 1) * max_token_chars(load_tokenizer(name, progress=False)) - 1000


class _Probes:
    """GET /health every `pause_s` on one keep-alive connection: (start, latency) samples."""

    def __init__(self, url: str, pause_s: float) -> None:
        self.url, self.pause_s = url, pause_s
        self.samples: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)

    def _run(self) -> None:
        import httpx

        with httpx.Client(base_url=self.url, timeout=30) as c:
            while not self._stop.is_set():
                t0 = time.perf_counter()
                c.get("/health").raise_for_status()
                self.samples.append((t0, time.perf_counter() - t0))
                time.sleep(self.pause_s)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="specgate bench front", description=__doc__.split("\n")[0])
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
