"""`specgate soak`: mixed load for a while, watching the gateway for leaks and latency drift.

    specgate soak --minutes 30 --rate 20 --workloads chat,copy --json soak.json --plot soak.png
    specgate soak --minutes 0.5 --window-s 5 --redis-url redis://localhost:6379/0   # the CI run

One embedded gateway runs in a child process (`compare.gateway_process`; the fake worker unless
`--model` names a real one), optionally over Redis. The load (`loadgen.loadtest`) runs in windows
of `--window-s` seconds, back to back, each with its own seed; after each window (its requests all
finished) the gateway process is sampled: RSS and open file descriptors (from /proc, or psutil
when installed), Redis `used_memory` and the number of keys under the store prefix when Redis is
used, and the window's latency p50/p99 and errors.

The report has the series and, comparing the last window with the first one after the warm-up,
`rss_growth_after_warmup`, `fd_growth_after_warmup`, `redis_memory_growth_after_warmup` and
`latency_drift` (p50), each a fraction (0.1: 10% more). A growth past `--warn-growth` (default
0.10) is printed as a WARN line; the exit code stays 0, since one short run is a hint, not a
verdict (the Redis memory is the whole server's, and a short run's p50 is noisy).

Warm-up: a new gateway's RSS grows at first by what it is meant to keep: the verifier's prefix
cache (256 MiB by default, full only after a few hundred distinct prompt blocks), the allocator's
high-water mark, lazily built kernels. Counting that as growth would call a bounded cache a leak
(a real-model soak whose RSS growth looked alarming after a one-window warm-up was flat once the
prefix cache had filled). By default
(`--warmup-windows auto`) warm-up windows run before the measured `--minutes`, until the
gateway's `specgate_prefix_cache_bytes` gauge has levelled off (grew by less than 1% of its
capacity over a window; one window where there is no prefix cache), at most
`--max-warmup-windows`; `warmup_levelled` says whether it did. `--warmup-windows N` instead
leaves the first N of the `--minutes` windows out.

Because one window's p50 against another's is mostly noise, `latency_trend` also fits a line to
every post-warm-up window's p50 (`trend`): the change the line makes over the run as a fraction of
the mean (`change`), the windows' scatter around it (`noise`), and `beyond_noise`, whether the
slope is more than two standard errors from zero (a t-test on the slope, ~95%).

`--ended-ttl-s` sets how long the gateway keeps ended requests' records (the Redis store's
plateau is about rate x TTL x a few keys; the default hour cannot level off within a short soak).
"""
from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from pathlib import Path
from typing import Any

from loadtest.compare import gateway_process, metric_sums, metrics_text, tenant_keys
from loadtest.workload import WORKLOADS
from loadtest.results import write_result

GROWTH_KEYS = {"rss_growth_after_warmup": "rss_bytes", "fd_growth_after_warmup": "open_fds",
               "redis_memory_growth_after_warmup": "redis_used_memory",
               "latency_drift": "p50_latency_s"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--minutes", type=float, default=10.0, help="how long to run the load")
    p.add_argument("--window-s", type=float, default=30.0, help="seconds per sampling window")
    p.add_argument("--warmup-windows", type=_warmup_arg, default="auto",
                   help="'auto': warm up until the prefix cache levels off, before --minutes; "
                        "N: leave the first N windows of --minutes out of the figures")
    p.add_argument("--max-warmup-windows", type=int, default=40,
                   help="with --warmup-windows auto: measure anyway after this many")
    p.add_argument("--rate", type=float, default=10.0, help="mean arrivals per second")
    p.add_argument("--seed", type=int, default=0, help="window i uses seed + i")
    p.add_argument("--workloads", default="chat,copy",
                   help=f"comma-separated, from: {', '.join(WORKLOADS)}")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--tenants", type=int, default=3, help="number of tenants (keys made here)")
    p.add_argument("--model", help="serve this real model (default: the fake worker)")
    p.add_argument("--fake-step-ms", type=float, default=5.0, help="fake worker sleep per step")
    p.add_argument("--policy", choices=["laps", "fcfs", "sjf", "las"])
    p.add_argument("--max-batch", type=int)
    p.add_argument("--redis-url", help="run the gateway's state over this Redis")
    p.add_argument("--ended-ttl-s", type=float,
                   help="how long ended requests' records stay (gateway setting ended_ttl_s)")
    p.add_argument("--store-prefix", default="specgate-soak:", help="key prefix in Redis")
    p.add_argument("--warn-growth", type=float, default=0.10)
    p.add_argument("--json", type=Path, help="write the report here")
    p.add_argument("--plot", type=Path, help="RSS, fds and latency per window (PNG)")


def run(args: argparse.Namespace) -> int:
    settings: dict[str, Any] = {"tenants_file": None, "log_level": "warning",
                                "redis_url": args.redis_url, "store_prefix": args.store_prefix}
    if args.model:
        settings["model"] = args.model
    else:
        settings.update(fake_worker=True, fake_step_ms=args.fake_step_ms)
    if args.policy:
        settings["policy"] = args.policy
    if args.max_batch:
        settings["max_batch"] = args.max_batch
    if args.ended_ttl_s:
        settings["ended_ttl_s"] = args.ended_ttl_s
    report = soak(settings, windows=window_count(args.minutes, args.window_s),
                  window_s=args.window_s, warmup=args.warmup_windows,
                  max_warmup=args.max_warmup_windows, rate=args.rate,
                  seed=args.seed, workloads=args.workloads.split(","),
                  max_tokens=args.max_tokens, tenants=args.tenants)
    if args.json:
        write_result(args.json, report)
    if args.plot:
        plot(report, args.plot)
    print(summary(report))
    for line in warnings(report, args.warn_growth):
        print(line, file=sys.stderr)
    return 0


def _warmup_arg(text: str) -> int | str:
    if text == "auto":
        return text
    n = int(text)
    if n < 0:
        raise argparse.ArgumentTypeError("--warmup-windows must be 'auto' or >= 0")
    return n


# ---- pure parts ----------------------------------------------------------------------------------
def levelled(cache: list[tuple[int, int] | None], tolerance: float = 0.01) -> bool:
    """Whether the prefix cache has levelled off by the last of the windows' (bytes held,
    capacity) samples: it grew by less than `tolerance` of its capacity since the one before, or
    there is no cache to fill. Needs two samples where there is a cache.

    >>> levelled([(0, 100), (50, 100)]), levelled([(100, 100), (100, 100)]), levelled([None])
    (False, True, True)
    """
    if not cache or cache[-1] is None:
        return True
    if len(cache) < 2 or cache[-2] is None:
        return False
    (before, _), (now, capacity) = cache[-2], cache[-1]
    return now - before < tolerance * capacity


def window_count(minutes: float, window_s: float) -> int:
    """Whole windows in the run, at least one: window_count(0.075, 1.5) == 3."""
    if minutes <= 0 or window_s <= 0:
        raise ValueError("--minutes and --window-s must be > 0")
    return max(1, round(minutes * 60 / window_s))


def growth(values: list[float | None], warmup: int) -> float | None:
    """The last value against the first one after `warmup` windows, as a fraction of the latter:
    growth([50, 100, 105, 110], 1) == 0.1. With too few windows the first one after warm-up is the
    last but one (or the only one); None when a value is missing or the base is not positive."""
    if len(values) < 2:
        return 0.0 if values and values[0] is not None else None
    base, last = values[min(warmup, len(values) - 2)], values[-1]
    if base is None or last is None or base <= 0:
        return None
    return (last - base) / base


def trend(values: list[float | None]) -> dict[str, float | bool] | None:
    """Least-squares line through values at x = 0, 1, ...: `change` = slope x (n - 1) / mean (what
    the line adds over the run, as a fraction), `noise` = residuals' standard deviation / mean, and
    `beyond_noise` = |slope| > 2 standard errors. None with fewer than 3 values, a missing one, or
    a mean that is not positive.

    >>> t = trend([1.0, 2.0, 3.0, 4.0]); (t["change"], t["noise"], t["beyond_noise"])
    (1.2, 0.0, True)
    """
    if len(values) < 3 or any(v is None for v in values):
        return None
    n = len(values)
    mean_x, mean_y = (n - 1) / 2, sum(values) / n
    if mean_y <= 0:
        return None
    sxx = sum((x - mean_x) ** 2 for x in range(n))
    slope = sum((x - mean_x) * (y - mean_y) for x, y in enumerate(values)) / sxx
    residuals = [y - (mean_y + slope * (x - mean_x)) for x, y in enumerate(values)]
    sse = sum(r * r for r in residuals)
    stderr = (sse / (n - 2) / sxx) ** 0.5
    return {"change": slope * (n - 1) / mean_y, "noise": (sse / (n - 2)) ** 0.5 / mean_y,
            "beyond_noise": abs(slope) > 2 * stderr}


def growths(series: list[dict], warmup: int) -> dict[str, Any]:
    """Every growth figure of the report (GROWTH_KEYS) from the per-window series, and the p50
    latency's trend over the windows after warm-up."""
    out: dict[str, Any] = {name: growth([w[key] for w in series], warmup)
                           for name, key in GROWTH_KEYS.items()}
    out["latency_trend"] = trend([w["p50_latency_s"] for w in series[warmup:]])
    return out


def warnings(report: dict, limit: float) -> list[str]:
    """A WARN line for each growth figure above `limit`, and for a latency trend that rises by more
    than `limit` over the run and stands out of the noise."""
    lines = [f"WARN: soak: {name} {value:+.1%} (over {limit:.0%})"
             for name in GROWTH_KEYS if (value := report[name]) is not None and value > limit]
    t = report.get("latency_trend")
    if t is not None and t["beyond_noise"] and t["change"] > limit:
        lines.append(f"WARN: soak: latency_trend {t['change']:+.1%} (over {limit:.0%}, beyond noise)")
    return lines


# ---- sampling the gateway process ---------------------------------------------------------------
def rss_bytes(pid: int) -> int:
    """Resident set size of process `pid` (psutil when installed, else /proc/<pid>/status)."""
    try:
        import psutil
        return int(psutil.Process(pid).memory_info().rss)
    except ImportError:
        pass
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024          # "VmRSS:   123456 kB"
    raise RuntimeError(f"no VmRSS for process {pid}")


def open_fds(pid: int) -> int:
    """Open file descriptors of process `pid` (/proc/<pid>/fd, or psutil when /proc is absent)."""
    fd_dir = Path(f"/proc/{pid}/fd")
    if fd_dir.is_dir():
        return len(os.listdir(fd_dir))
    import psutil
    return int(psutil.Process(pid).num_fds())


def redis_sample(client: Any, prefix: str) -> dict[str, int]:
    """The Redis server's `used_memory` and the number of keys under `prefix`."""
    keys = sum(1 for _ in client.scan_iter(match=f"{prefix}*", count=1000))
    return {"redis_used_memory": int(client.info("memory")["used_memory"]), "redis_keys": keys}


def prefix_cache_usage(url: str, admin_key: str) -> tuple[int, int] | None:
    """The gateway's prefix cache gauges (bytes held, capacity); None where it has no prefix
    cache (the fake worker) or /metrics does not answer."""
    held, capacity = "specgate_prefix_cache_bytes", "specgate_prefix_cache_capacity_bytes"
    text = metrics_text(url, admin_key)
    values = metric_sums(text, {held, capacity}) if text is not None else {}
    if len(values) < 2:
        return None
    return int(values[held]), int(values[capacity])


# ---- the run -------------------------------------------------------------------------------------
def soak(settings: dict, *, windows: int, window_s: float, warmup: int | str = "auto",
         max_warmup: int = 40, rate: float, seed: int = 0,
         workloads: list[str] = ("chat", "copy"), max_tokens: int = 32, tenants: int = 3) -> dict:
    """Run the load against one gateway process, window by window: with `warmup` "auto", warm-up
    windows until the prefix cache levels off (at most `max_warmup`), then `windows` more; with
    an int, `windows` in all, the first `warmup` of them warm-up. The report: module docstring."""
    from gateway.tenancy.records import new_api_key
    from loadtest.loadgen import loadtest

    keys = tenant_keys(tenants)
    settings = {**settings, "admin_key": new_api_key()}    # to read the gateway's /metrics
    redis_client = None
    if settings.get("redis_url"):
        import redis
        redis_client = redis.Redis.from_url(settings["redis_url"])
    series: list[dict] = []
    caches: list[tuple[int, int] | None] = []
    with gateway_process(settings, keys) as gw:
        t0 = time.monotonic()

        def sample() -> dict:
            caches.append(prefix_cache_usage(gw.url, settings["admin_key"]))
            return {**_sample(gw.pid, redis_client, settings.get("store_prefix", "")),
                    "prefix_cache_bytes": None if caches[-1] is None else caches[-1][0]}

        def window(i: int, phase: str) -> None:
            rep = asyncio.run(loadtest(gw.url, keys, rate=rate, duration=window_s, seed=seed + i,
                                       workloads=list(workloads), max_tokens=max_tokens))
            o = rep["overall"]
            series.append({"window": i, "warmup": phase == "warm-up",
                           "t_s": round(time.monotonic() - t0, 3),
                           "requests": o["requests"], "completed": o["completed"],
                           "errors": o["requests"] - o["completed"],
                           "p50_latency_s": o["e2e_s"]["p50"], "p99_latency_s": o["e2e_s"]["p99"],
                           "ttft_p99_s": o["ttft_s"]["p99"], **sample()})
            w = series[-1]
            print(f"soak: {phase} window {i + 1}: {o['completed']}/{o['requests']} completed, "
                  f"p50 {_ms(w['p50_latency_s'])}, RSS {w['rss_bytes'] / 2**20:.1f} MiB, "
                  f"{w['open_fds']} fds" + _cache_text(w["prefix_cache_bytes"]),
                  file=sys.stderr, flush=True)

        baseline = sample()
        if warmup == "auto":
            while len(series) < max_warmup and not (series and levelled(caches)):
                window(len(series), "warm-up")
            n_warm = len(series)
            for _ in range(windows):
                window(len(series), "measured")
        else:
            n_warm = min(int(warmup), windows)
            for i in range(windows):
                window(i, "warm-up" if i < n_warm else "measured")
    if redis_client is not None:
        redis_client.close()
    return {"settings": {"windows": len(series), "window_s": window_s, "warmup_windows": n_warm,
                         "warmup": warmup, "rate": rate, "seed": seed,
                         "workloads": list(workloads), "max_tokens": max_tokens,
                         "tenants": tenants,
                         "gateway": {k: v for k, v in settings.items()
                                     if k not in ("redis_url", "admin_key")},
                         "redis": redis_client is not None},
            "warmup_levelled": levelled(caches),
            "before_load": baseline, "series": series, **growths(series, n_warm)}


def _sample(pid: int, redis_client: Any, prefix: str) -> dict:
    sample = {"rss_bytes": rss_bytes(pid), "open_fds": open_fds(pid),
              "redis_used_memory": None, "redis_keys": None}
    if redis_client is not None:
        sample.update(redis_sample(redis_client, prefix))
    return sample


# ---- output --------------------------------------------------------------------------------------
def _ms(x: float | None) -> str:
    return "-" if x is None else f"{1000 * x:.1f} ms"


def _cache_text(nbytes: int | None) -> str:
    return "" if nbytes is None else f", prefix cache {nbytes / 2**20:.1f} MiB"


def summary(report: dict) -> str:
    s, series = report["settings"], report["series"]
    pct = lambda x: "-" if x is None else f"{x:+.1%}"        # noqa: E731
    done = sum(w["completed"] for w in series)
    sent = sum(w["requests"] for w in series)
    warm = "" if report.get("warmup_levelled", True) else ", the prefix cache still filling"
    return (f"soak: {s['windows']} windows of {s['window_s']:g} s at {s['rate']:g}/s "
            f"({s['warmup_windows']} of them warm-up{warm}): "
            f"{done}/{sent} completed; after warm-up: RSS "
            f"{pct(report['rss_growth_after_warmup'])}, "
            f"fds {pct(report['fd_growth_after_warmup'])}, Redis memory "
            f"{pct(report['redis_memory_growth_after_warmup'])}, p50 latency "
            f"{pct(report['latency_drift'])}" + _trend_text(report.get("latency_trend")))


def _trend_text(t: dict | None) -> str:
    if t is None:
        return ""
    verdict = "beyond noise" if t["beyond_noise"] else "within noise"
    return f"; p50 trend {t['change']:+.1%} over the run ({verdict}; scatter {t['noise']:.1%})"


def plot(report: dict, path: Path) -> None:
    """RSS, open fds and latency p50/p99 against time, one panel each."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = report["series"]
    t = [w["t_s"] for w in series]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    axes[0].plot(t, [w["rss_bytes"] / 2**20 for w in series], marker="o")
    axes[0].set(title="gateway RSS", xlabel="seconds", ylabel="MiB")
    axes[1].plot(t, [w["open_fds"] for w in series], marker="o")
    axes[1].set(title="open file descriptors", xlabel="seconds")
    for key in ("p50_latency_s", "p99_latency_s"):
        axes[2].plot(t, [w[key] for w in series], marker="o", label=key[:3])
    axes[2].set(title="end-to-end latency per window", xlabel="seconds", ylabel="seconds")
    axes[2].legend()
    warm = [w["t_s"] for w in series if w.get("warmup")]
    if warm:                                       # where the measured windows begin
        for ax in axes:
            ax.axvline(warm[-1], color="grey", linestyle="--", linewidth=1)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
