"""`specgate loadtest`: an open-loop load generator for a running gateway.

    specgate loadtest --url http://127.0.0.1:8000 --tenants a=sk-a,b=sk-b --rate 20 --duration 30 \\
        --workloads chat,copy --json out.json --plot out.png

Arrivals are fixed before the run: Poisson at `--rate` (exponential gaps), or `--bursty` (gamma
gaps with CV 3 at the same mean rate, so requests come in clumps). Each arrival is fired at its
time whatever the earlier ones are doing (open loop: a slow gateway gets a queue, not a slower
client). A request is a streaming POST /v1/chat/completions (usage included, temperature 0) from
a tenant key and a workload record, both drawn with the seeded RNG, over one shared keep-alive
`httpx.AsyncClient`.

Per request: TTFT (first non-empty content delta), inter-token latencies (between content
chunks), end-to-end latency, output tokens (from usage), and the status and OpenAI error type of a
failure. The report has these overall and per tenant (mean/p50/p90/p99), SLO attainment (the
fraction of completed requests with TTFT ≤ `--slo-ttft-ms` and mean ITL ≤ `--slo-itl-ms`),
output tokens/s and goodput (tokens/s of the requests that met the SLO), a per-second series of
completed tokens, and `generator_lag_ms`: how late each request started against its schedule.
A small lag (p99 of a few ms) shows the generator itself is not what limits the run.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from loadtest.workload import WORKLOADS, load_workload
from scheduler.length_oracle import prompt_key
from loadtest.results import write_result

BURSTY_CV = 3.0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", required=True, help="gateway base URL, e.g. http://127.0.0.1:8000")
    p.add_argument("--tenants", required=True,
                   help="comma-separated API keys, each optionally NAME=KEY (the name labels the "
                        "tenant in the report; keys never appear there)")
    p.add_argument("--rate", type=float, required=True, help="mean arrivals per second")
    p.add_argument("--duration", type=float, required=True, help="seconds of arrivals")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workloads", default="chat",
                   help=f"comma-separated, from: {', '.join(WORKLOADS)}")
    p.add_argument("--max-tokens", type=parse_max_tokens, default=64, help=MAX_TOKENS_HELP)
    p.add_argument("--model", help="model id (default: the first one /v1/models lists)")
    p.add_argument("--bursty", action="store_true",
                   help=f"gamma inter-arrival gaps with CV {BURSTY_CV:g} instead of Poisson")
    p.add_argument("--slo-ttft-ms", type=float, default=2000.0)
    p.add_argument("--slo-itl-ms", type=float, default=200.0)
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per request")
    p.add_argument("--json", type=Path, required=True, help="write the report here")
    p.add_argument("--plot", type=Path, help="latency CDFs and per-tenant means (PNG)")


def run(args: argparse.Namespace) -> int:
    report = asyncio.run(loadtest(
        args.url, parse_tenants(args.tenants), rate=args.rate, duration=args.duration,
        seed=args.seed, workloads=args.workloads.split(","), max_tokens=args.max_tokens,
        model=args.model, bursty=args.bursty, slo_ttft_s=args.slo_ttft_ms / 1000,
        slo_itl_s=args.slo_itl_ms / 1000, timeout=args.timeout, progress=True))
    write_result(args.json, report)
    if args.plot:
        plot(report, args.plot)
    print(summary(report), file=sys.stderr)
    return 0


# ---- pure parts -----------------------------------------------------------------------------------
MAX_TOKENS_HELP = ("max_tokens of every request (64), or a range LO-HI (8-512) drawn log-uniformly "
                   "per request: clients ask for different lengths, and only then does the order "
                   "in which a scheduler serves requests have something to work with")

MaxTokens = int | tuple[int, int]


def parse_max_tokens(text: str) -> MaxTokens:
    """"64" → 64; "8-512" → (8, 512). Both ends ≥ 1, LO ≤ HI."""
    lo, sep, hi = str(text).partition("-")
    try:
        bounds = (int(lo), int(hi)) if sep else (int(lo), int(lo))
    except ValueError:
        raise argparse.ArgumentTypeError(f"max tokens must be N or LO-HI, not {text!r}") from None
    if bounds[0] < 1 or bounds[0] > bounds[1]:
        raise argparse.ArgumentTypeError(f"max tokens needs 1 <= LO <= HI, not {text!r}")
    return bounds[0] if not sep else bounds


def draw_max_tokens(spec: MaxTokens, n: int, seed: int) -> list[int]:
    """Each request's max_tokens: the number itself, or log-uniform over [LO, HI] (as many
    requests in 8-16 as in 256-512), from an RNG of its own so that the arrivals and the records
    drawn for a seed stay the same whatever the lengths."""
    if isinstance(spec, int):
        return [spec] * n
    lo, hi = spec
    rng = np.random.default_rng([seed, 1])
    draws = np.exp(rng.uniform(np.log(lo), np.log(hi + 1), n))
    return [int(min(hi, max(lo, x))) for x in draws]


def max_tokens_label(spec: MaxTokens) -> int | str:
    return spec if isinstance(spec, int) else f"{spec[0]}-{spec[1]}"


def parse_tenants(text: str) -> list[tuple[str, str]]:
    """"a=sk-1,sk-2" → [("a", "sk-1"), ("t1", "sk-2")]: (label, key) pairs."""
    out = []
    for i, item in enumerate(x.strip() for x in text.split(",") if x.strip()):
        name, sep, key = item.partition("=")
        out.append((name, key) if sep else (f"t{i}", item))
    if not out:
        raise ValueError("--tenants needs at least one API key")
    return out


def arrival_schedule(rate: float, duration: float, rng: np.random.Generator, *,
                     bursty: bool = False, cv: float = BURSTY_CV) -> np.ndarray:
    """Arrival times in [0, duration), seconds. Poisson: exponential gaps of mean 1/rate. Bursty:
    gamma gaps, shape 1/cv², scale cv²/rate: the same mean 1/rate, standard deviation cv/rate.
    Example: rate 10, duration 1 → about 10 times, e.g. [0.08, 0.21, 0.24, ...]."""
    if rate <= 0 or duration <= 0:
        raise ValueError("rate and duration must be > 0")
    n = int(rate * duration * 1.5 + 10 * np.sqrt(rate * duration) + 10)  # enough, nearly always
    times = np.empty(0)
    while times.size == 0 or times[-1] < duration:
        gaps = (rng.gamma(1 / cv**2, cv**2 / rate, n) if bursty
                else rng.exponential(1 / rate, n))
        times = np.concatenate([times, (times[-1] if times.size else 0.0) + np.cumsum(gaps)])
    return times[times < duration]


def quantile(xs: list[float], frac: float) -> float:
    """Nearest rank: quantile([4, 1, 3, 2], 0.5) == 2; quantile([1..100], 0.99) == 99."""
    s = sorted(xs)
    return s[max(0, int(np.ceil(frac * len(s))) - 1)]


def stats(xs: list[float]) -> dict[str, float | None]:
    """mean/p50/p90/p99 of `xs` (None for each when empty)."""
    if not xs:
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    return {"mean": float(np.mean(xs)), "p50": quantile(xs, 0.5), "p90": quantile(xs, 0.9),
            "p99": quantile(xs, 0.99)}


@dataclass
class Result:
    """One request's outcome; times in seconds, `scheduled`/`started`/`ended` from the run's
    start. `status` 0: no HTTP answer (connection error, timeout); an error event inside a 200
    stream keeps 200 and sets `error_type`."""
    tenant: str
    workload: str
    scheduled: float
    started: float = 0.0
    ended: float = 0.0
    status: int = 0
    error_type: str | None = None
    ttft: float | None = None
    itls: list[float] = field(default_factory=list)
    output_tokens: int = 0
    prompt: str = ""                   # the prompt's key (scheduler/length_oracle.prompt_key)
    limit: int = 0                     # its max_tokens

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.error_type is None

    @property
    def e2e(self) -> float:
        return self.ended - self.started


def meets_slo(r: Result, ttft_s: float, itl_s: float) -> bool:
    """Completed, TTFT within `ttft_s` and mean inter-token latency within `itl_s` (a request with
    fewer than two content chunks has no ITL and passes on it)."""
    if not r.ok or r.ttft is None or r.ttft > ttft_s:
        return False
    return not r.itls or float(np.mean(r.itls)) <= itl_s


def slo_attainment(results: list[Result], ttft_s: float, itl_s: float) -> float | None:
    """Fraction of the completed requests that meet the SLO; None when none completed."""
    done = [r for r in results if r.ok]
    return sum(meets_slo(r, ttft_s, itl_s) for r in done) / len(done) if done else None


def throughput_series(results: list[Result], seconds: float) -> list[int]:
    """Output tokens of the requests completed in each second of the run: [tokens in [0,1), ...]."""
    series = [0] * max(1, int(np.ceil(seconds)))
    for r in results:
        if r.ok:
            series[min(len(series) - 1, int(r.ended))] += r.output_tokens
    return series


def group_report(results: list[Result], elapsed: float, ttft_s: float, itl_s: float) -> dict:
    """Counts, latency stats, SLO attainment and rates of one group (all requests, or a tenant's)."""
    done = [r for r in results if r.ok]
    errors: dict[str, int] = {}
    types: dict[str, int] = {}
    for r in results:
        if not r.ok:
            errors[str(r.status)] = errors.get(str(r.status), 0) + 1
            types[r.error_type or "unknown"] = types.get(r.error_type or "unknown", 0) + 1
    tokens = sum(r.output_tokens for r in done)
    good = sum(r.output_tokens for r in done if meets_slo(r, ttft_s, itl_s))
    return {
        "requests": len(results), "completed": len(done), "errors_by_status": errors,
        "errors_by_type": types,
        "ttft_s": stats([r.ttft for r in done if r.ttft is not None]),
        "itl_s": stats([x for r in done for x in r.itls]),
        "e2e_s": stats([r.e2e for r in done]),
        "output_tokens": tokens,
        "output_tokens_per_s": tokens / elapsed if elapsed > 0 else None,
        "goodput_tokens_per_s": good / elapsed if elapsed > 0 else None,
        "slo_attainment": slo_attainment(results, ttft_s, itl_s),
        "completed_per_s": len(done) / elapsed if elapsed > 0 else None,
    }


def build_report(results: list[Result], settings: dict, elapsed: float, ttft_s: float,
                 itl_s: float) -> dict:
    """The whole report: settings, overall, per tenant, generator lag, tokens per second."""
    lag_ms = [1000 * (r.started - r.scheduled) for r in results]
    last_arrival = max((r.scheduled for r in results), default=0.0)
    tenants = sorted({r.tenant for r in results})
    return {
        "settings": settings, "elapsed_s": elapsed,
        "achieved_request_rate": len(results) / settings["duration"],
        "generator_lag_ms": {"p50": quantile(lag_ms, 0.5) if lag_ms else None,
                             "p99": quantile(lag_ms, 0.99) if lag_ms else None,
                             "max": max(lag_ms, default=None)},
        "last_arrival_s": last_arrival,
        "overall": group_report(results, elapsed, ttft_s, itl_s),
        "tenants": {t: group_report([r for r in results if r.tenant == t], elapsed, ttft_s, itl_s)
                    for t in tenants},
        "tokens_per_second_series": throughput_series(results, elapsed),
        # completed requests' latencies, for CDFs (the plot) and run-to-run comparisons
        "samples": {g: _samples([r for r in results if g == "overall" or r.tenant == g])
                    for g in ["overall", *tenants]},
    }


def _samples(results: list[Result]) -> dict[str, list[float]]:
    done = [r for r in results if r.ok]
    return {"ttft_s": [round(r.ttft, 6) for r in done if r.ttft is not None],
            "e2e_s": [round(r.e2e, 6) for r in done],
            # what each request asked for and got: how well an oracle of lengths knew them
            "lengths": [[r.prompt, r.limit, r.output_tokens] for r in done]}


# ---- the run --------------------------------------------------------------------------------------
async def loadtest(url: str, tenants: list[tuple[str, str]], *, rate: float, duration: float,
                   seed: int = 0, workloads: list[str] = ("chat",), max_tokens: MaxTokens = 64,
                   model: str | None = None, bursty: bool = False, slo_ttft_s: float = 2.0,
                   slo_itl_s: float = 0.2, timeout: float = 300.0,
                   progress: bool = False) -> dict:
    """Run the load against `url` and return the report (see the module docstring)."""
    import httpx

    records = [(w, rec) for w in workloads for rec in load_workload(w)]
    rng = np.random.default_rng(seed)
    times = arrival_schedule(rate, duration, rng, bursty=bursty)
    picks = [(tenants[int(rng.integers(len(tenants)))], records[int(rng.integers(len(records)))])
             for _ in times]
    limits_each = draw_max_tokens(max_tokens, len(times), seed)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=timeout) as client:
        model = model or await _discover_model(client, [k for _, k in tenants])
        results: list[Result] = []
        tasks = []
        reporter = asyncio.ensure_future(_progress(results, len(times))) if progress else None
        clock, t0 = time.perf_counter, time.perf_counter()
        for t, ((label, key), (wname, rec)), limit in zip(times, picks, limits_each):
            if (delay := t0 + t - clock()) > 0:
                await asyncio.sleep(delay)
            r = Result(label, wname, float(t), prompt=prompt_key(messages=rec["messages"]),
                       limit=limit)
            results.append(r)
            body = {"model": model, "messages": rec["messages"], "max_tokens": limit,
                    "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
            tasks.append(asyncio.ensure_future(_fire(client, key, body, r, t0)))
        await asyncio.gather(*tasks)
        elapsed = time.perf_counter() - t0
        if reporter is not None:
            reporter.cancel()
    settings = {"url": url, "tenants": [n for n, _ in tenants], "rate": rate,
                "duration": duration, "seed": seed, "workloads": list(workloads),
                "max_tokens": max_tokens_label(max_tokens), "model": model, "bursty": bursty,
                "arrivals": "gamma cv %g" % BURSTY_CV if bursty else "poisson",
                "slo_ttft_ms": 1000 * slo_ttft_s, "slo_itl_ms": 1000 * slo_itl_s}
    return build_report(results, settings, elapsed, slo_ttft_s, slo_itl_s)


async def _fire(client: Any, key: str, body: dict, r: Result, t0: float) -> None:
    """One streaming request, its measurements written into `r`."""
    clock = time.perf_counter
    r.started = clock() - t0
    last = None
    try:
        async with client.stream("POST", "/v1/chat/completions", json=body,
                                 headers={"Authorization": f"Bearer {key}"}) as resp:
            r.status = resp.status_code
            if resp.status_code != 200:
                r.error_type = _error_type(await resp.aread())
                return
            async for line in resp.aiter_lines():
                if not line.startswith("data:") or (data := line[5:].strip()) == "[DONE]":
                    continue
                event = json.loads(data)
                if "error" in event:
                    r.error_type = (event["error"] or {}).get("type") or "stream_error"
                    continue
                if event.get("usage"):
                    r.output_tokens = event["usage"].get("completion_tokens", 0)
                if any(c.get("delta", {}).get("content") for c in event.get("choices", ())):
                    now = clock() - t0
                    if last is None:
                        r.ttft = now - r.started
                    else:
                        r.itls.append(now - last)
                    last = now
    except Exception as exc:       # connection refused, timeout, a malformed stream: an error
        r.error_type = r.error_type or type(exc).__name__
    finally:
        r.ended = clock() - t0


def _error_type(body: bytes) -> str:
    """The OpenAI error "type" of an error body, or "unknown"."""
    try:
        return json.loads(body)["error"]["type"] or "unknown"
    except (ValueError, KeyError, TypeError):
        return "unknown"


async def _discover_model(client: Any, keys: list[str]) -> str:
    """The first model /v1/models lists for the first key that may list them."""
    for key in keys:
        resp = await client.get("/v1/models", headers={"Authorization": f"Bearer {key}"})
        if resp.status_code == 200 and resp.json().get("data"):
            return resp.json()["data"][0]["id"]
    raise RuntimeError("no tenant key could list /v1/models; pass --model")


async def _progress(results: list[Result], planned: int) -> None:
    t0 = time.perf_counter()
    while True:
        await asyncio.sleep(1.0)
        done = sum(1 for r in results if r.ended and r.ok)
        errors = sum(1 for r in results if r.ended and not r.ok)
        print(f"loadtest {time.perf_counter() - t0:5.0f}s: sent {len(results)}/{planned}, "
              f"completed {done}, errors {errors}", file=sys.stderr, flush=True)


# ---- output -----------------------------------------------------------------------------------------
def summary(report: dict) -> str:
    o, lag, s = report["overall"], report["generator_lag_ms"], report["settings"]
    ms = lambda x: "-" if x is None else f"{1000 * x:.1f} ms"   # noqa: E731
    num = lambda x: "-" if x is None else f"{x:.2f}"              # noqa: E731
    att = o["slo_attainment"]
    return "\n".join([
        f"loadtest: {s['arrivals']} at {s['rate']:g}/s for {s['duration']:g} s: "
        f"{o['requests']} sent, {o['completed']} completed, errors {o['errors_by_status'] or 0}",
        f"  TTFT p50 {ms(o['ttft_s']['p50'])} p99 {ms(o['ttft_s']['p99'])}; ITL p50 "
        f"{ms(o['itl_s']['p50'])} p99 {ms(o['itl_s']['p99'])}; e2e p50 {ms(o['e2e_s']['p50'])} "
        f"p99 {ms(o['e2e_s']['p99'])}",
        f"  {o['output_tokens_per_s'] or 0:.0f} output tokens/s, goodput "
        f"{o['goodput_tokens_per_s'] or 0:.0f}; SLO attainment "
        f"{'-' if att is None else f'{att:.3f}'}; generator lag p50 {num(lag['p50'])} ms "
        f"p99 {num(lag['p99'])} ms"])


def plot(report: dict, path: Path) -> None:
    """Latency CDFs (e2e, TTFT; overall and per tenant, from the report's samples) and per-tenant
    mean TTFT and e2e bars, as one PNG."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    names = list(report["tenants"])
    for ax, metric, title in ((axes[0], "e2e_s", "end-to-end"), (axes[1], "ttft_s", "TTFT")):
        for name in ["overall", *names]:
            xs = report.get("samples", {}).get(name, {}).get(metric, [])
            if xs:
                s = np.sort(xs)
                ax.step(s, np.arange(1, len(s) + 1) / len(s), where="post", label=name)
        ax.set(title=f"{title} latency CDF", xlabel="seconds", ylabel="fraction of requests")
        ax.legend(fontsize=8)
    x = np.arange(len(names))
    for i, (metric, label) in enumerate((("ttft_s", "TTFT"), ("e2e_s", "e2e"))):
        means = [report["tenants"][n][metric]["mean"] or 0 for n in names]
        axes[2].bar(x + 0.4 * i, means, 0.4, label=label)
    axes[2].set_xticks(x + 0.2, names)
    axes[2].set(title="per-tenant mean latency", ylabel="seconds")
    axes[2].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
