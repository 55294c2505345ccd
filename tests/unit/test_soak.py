"""Soak: growth and drift arithmetic on hand-made series, then a short fake-worker run over a real
Redis (a warm-up window and three more of 1.5 s)."""
from __future__ import annotations

import argparse
import json
import os

import pytest

from loadtest.soak import (growth, growths, levelled, open_fds, rss_bytes, trend, warnings,
                           window_count)


@pytest.mark.parametrize("values, warmup, want", [
    ([50, 100, 105, 110], 1, 0.10),      # the first window (warm-up) left out
    ([50, 100, 105, 110], 0, 1.20),
    ([100, 90], 1, -0.10),               # too few windows: the last but one is the base
    ([100, 90], 5, -0.10),
    ([7], 1, 0.0),                       # one window: no growth
    ([], 1, None),
    ([100, None, 110], 1, None),          # a missing value (e.g. no completed request)
    ([1, 0, 5], 1, None),                 # no base to divide by
])
def test_growth_table(values, warmup, want):
    got = growth(values, warmup)
    assert got == pytest.approx(want) if want is not None else got is None


@pytest.mark.parametrize("values, change, beyond", [
    ([1.0, 2.0, 3.0, 4.0], 1.2, True),               # a clean rise: 3 over a mean of 2.5
    ([2.0, 2.0, 2.0], 0.0, False),                   # flat, no scatter
    ([1.0, 3.0, 1.0, 3.0, 1.0, 3.0], 3 / 7, False),  # a slope lost in big swings
    ([1.0, 1.1, 1.2, 1.3, 1.4, 1.5, 1.6, 1.7], 0.7 / 1.35, True),
    ([3.0, 1.0, 3.0, 1.0, 3.1, 1.0], None, False),
])
def test_trend_separates_drift_from_noise(values, change, beyond):
    t = trend(values)
    assert t["beyond_noise"] is beyond
    if change is not None:
        assert t["change"] == pytest.approx(change, abs=1e-9)


def test_no_trend_without_enough_windows():
    assert trend([1.0, 2.0]) is None and trend([1.0, None, 2.0]) is None and trend([0, 0, 0]) is None


def test_growths_and_warnings():
    series = [{"rss_bytes": r, "open_fds": f, "redis_used_memory": None, "p50_latency_s": p}
              for r, f, p in ((100, 10, 0.1), (200, 20, 0.2), (240, 20, 0.21))]
    g = growths(series, 1)
    assert set(g) == {"rss_growth_after_warmup", "fd_growth_after_warmup",
                      "redis_memory_growth_after_warmup", "latency_drift", "latency_trend"}
    assert g["rss_growth_after_warmup"] == pytest.approx(0.2)
    assert g["fd_growth_after_warmup"] == 0.0 and g["redis_memory_growth_after_warmup"] is None
    assert g["latency_drift"] == pytest.approx(0.05)
    assert g["latency_trend"] is None                     # two windows after warm-up: no line
    lines = warnings(g, 0.10)
    assert len(lines) == 1 and lines[0].startswith("WARN") and "rss_growth" in lines[0]
    rising = [{**series[0], "p50_latency_s": 0.1 * (1 + i)} for i in range(6)]
    assert any("latency_trend" in line for line in warnings(growths(rising, 1), 0.10))


@pytest.mark.parametrize("cache, want", [
    ([None], True),                                 # no prefix cache: nothing to fill
    ([(0, 1000)], False),                           # one sample: no change seen yet
    ([(0, 1000), (400, 1000)], False),              # filling
    ([(990, 1000), (1000, 1000)], False),           # grew 1% of its capacity: not less
    ([(995, 1000), (1000, 1000)], True),            # full: LRU keeps it there
    ([(300, 1000), (305, 1000)], True),             # the workload's prompts all cached
    ([None, (10, 1000)], False),                    # the gauge appeared: not levelled yet
])
def test_levelled(cache, want):
    assert levelled(cache) is want


def test_window_count():
    assert window_count(0.075, 1.5) == 3
    assert window_count(10, 30) == 20
    assert window_count(0.001, 30) == 1
    with pytest.raises(ValueError):
        window_count(0, 30)


def test_samplers_on_this_process():
    assert rss_bytes(os.getpid()) > 10 * 2**20
    assert open_fds(os.getpid()) >= 3


def test_fake_worker_soak_over_redis(redis_url, redis_prefix, tmp_path, capsys):
    from loadtest.soak import add_arguments, run

    p = argparse.ArgumentParser()
    add_arguments(p)
    out = tmp_path / "soak.json"
    args = p.parse_args(["--minutes", "0.075", "--window-s", "1.5", "--rate", "8",
                         "--max-tokens", "8", "--fake-step-ms", "2", "--redis-url", redis_url,
                         "--store-prefix", redis_prefix, "--json", str(out), "--ended-ttl-s", "30",
                         "--plot", str(tmp_path / "soak.png")])
    assert run(args) == 0
    rep = json.loads(out.read_text())
    series = rep["series"]
    # auto warm-up: the fake worker keeps no prefix cache, so one warm-up window, then 3 measured
    assert len(series) == 4 and [w["window"] for w in series] == [0, 1, 2, 3]
    assert [w["warmup"] for w in series] == [True, False, False, False]
    assert rep["settings"]["warmup_windows"] == 1 and rep["warmup_levelled"] is True
    assert all(w["prefix_cache_bytes"] is None for w in series)
    for w in series:
        assert w["rss_bytes"] > 0 and w["open_fds"] > 0
        assert w["redis_used_memory"] > 0 and w["redis_keys"] > 0     # tenants, at least
        assert w["requests"] > 0 and w["completed"] == w["requests"] and w["errors"] == 0
        assert 0 < w["p50_latency_s"] <= w["p99_latency_s"]
    assert series[0]["t_s"] < series[1]["t_s"] < series[2]["t_s"] < series[3]["t_s"]
    for key in ("rss_growth_after_warmup", "fd_growth_after_warmup",
                "redis_memory_growth_after_warmup", "latency_drift"):
        assert isinstance(rep[key], float)
    assert rep["settings"]["redis"] is True and "redis_url" not in rep["settings"]["gateway"]
    # the gateway kept ended requests' records for --ended-ttl-s, not the default hour
    import redis
    client = redis.Redis.from_url(redis_url)
    ttls = [client.pttl(k) for k in client.scan_iter(match=f"{redis_prefix}sched:*", count=1000)]
    client.close()
    expiring = [t for t in ttls if t > 0]
    assert expiring and max(expiring) <= 30_000
    assert "soak: 4 windows" in capsys.readouterr().out
    assert (tmp_path / "soak.png").stat().st_size > 1000


def test_prefix_cache_usage_reads_both_gauges_from_metrics():
    import http.server
    import threading

    from loadtest.soak import prefix_cache_usage

    pages = {"/metrics": b"# TYPE specgate_prefix_cache_bytes gauge\nspecgate_prefix_cache_bytes 123.0\n"
                         b"# TYPE specgate_prefix_cache_capacity_bytes gauge\n"
                         b"specgate_prefix_cache_capacity_bytes 4096.0\n"}

    class Page(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            ok = self.headers.get("Authorization") == "Bearer sk-admin" and self.path in pages
            self.send_response(200 if ok else 401)
            self.end_headers()
            self.wfile.write(pages[self.path] if ok else b"")

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Page)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_port}"
    try:
        assert prefix_cache_usage(url, "sk-admin") == (123, 4096)
        assert prefix_cache_usage(url, "sk-wrong") is None              # /metrics refused
        pages["/metrics"] = b"specgate_prefix_cache_bytes 5.0\n"          # no capacity gauge
        assert prefix_cache_usage(url, "sk-admin") is None
    finally:
        server.shutdown()
        server.server_close()
