"""The load generator: pure parts on hand-made inputs, then short runs against a fake-worker
gateway on loopback."""
from __future__ import annotations

import argparse
import asyncio
import json

import numpy as np
import pytest

from loadtest.loadgen import (Result, arrival_schedule, build_report, draw_max_tokens, meets_slo,
                              parse_max_tokens, parse_tenants,
                              plot, quantile, slo_attainment, stats, throughput_series)


# ---- pure parts -----------------------------------------------------------------------------------
def test_schedule_mean_rate_and_determinism():
    a = arrival_schedule(50, 100, np.random.default_rng(1))
    b = arrival_schedule(50, 100, np.random.default_rng(1))
    c = arrival_schedule(50, 100, np.random.default_rng(2))
    assert np.array_equal(a, b) and not np.array_equal(a, c)
    assert abs(len(a) / 100 - 50) < 50 * 0.05              # 5000 ± ~70 (1 sd): 5% is > 3 sd
    assert np.all(np.diff(a) >= 0) and a[0] >= 0 and a[-1] < 100
    gaps = np.diff(a)
    assert abs(gaps.std() / gaps.mean() - 1) < 0.1          # exponential: CV 1


def test_bursty_same_rate_higher_cv():
    poisson = np.diff(arrival_schedule(50, 200, np.random.default_rng(3)))
    bursty_times = arrival_schedule(50, 200, np.random.default_rng(3), bursty=True)
    bursty = np.diff(bursty_times)
    assert abs(len(bursty_times) / 200 - 50) < 50 * 0.15   # CV 3: a wider spread of counts
    assert bursty.std() / bursty.mean() > 2 * poisson.std() / poisson.mean()


def test_schedule_rejects_bad_rate():
    with pytest.raises(ValueError):
        arrival_schedule(0, 1, np.random.default_rng(0))


def test_quantile_and_stats():
    assert quantile([4, 1, 3, 2], 0.5) == 2
    assert quantile(list(range(1, 101)), 0.99) == 99
    assert quantile(list(range(1, 101)), 0.9) == 90
    assert quantile([7], 0.99) == 7
    assert stats([1.0, 2.0, 3.0, 10.0]) == {"mean": 4.0, "p50": 2.0, "p90": 10.0, "p99": 10.0}
    assert stats([]) == {"mean": None, "p50": None, "p90": None, "p99": None}


def _r(tenant="a", ttft=0.1, itls=(0.01,), status=200, error=None, tokens=4, end=1.0):
    return Result(tenant, "chat", 0.0, started=0.0, ended=end, status=status, error_type=error,
                  ttft=ttft, itls=list(itls), output_tokens=tokens)


def test_slo_attainment_table():
    ok = _r()
    slow_first = _r(ttft=3.0)
    slow_tokens = _r(itls=(0.1, 0.5))                 # mean 0.3 s > 0.2 s
    one_chunk = _r(itls=())                           # no ITL: passes on it
    failed = _r(status=429, error="rate_limit_error", ttft=None, itls=())
    assert meets_slo(ok, 2.0, 0.2) and meets_slo(one_chunk, 2.0, 0.2)
    assert not meets_slo(slow_first, 2.0, 0.2) and not meets_slo(slow_tokens, 2.0, 0.2)
    assert not meets_slo(failed, 2.0, 0.2)
    # failed requests are not in the denominator: 2 of 4 completed meet the SLO
    assert slo_attainment([ok, slow_first, slow_tokens, one_chunk, failed], 2.0, 0.2) == 0.5
    assert slo_attainment([failed], 2.0, 0.2) is None


def test_throughput_series_bins_by_end_second():
    rs = [_r(end=0.2, tokens=3), _r(end=0.9, tokens=2), _r(end=2.5, tokens=7),
          _r(end=1.5, status=500, error="server_error", tokens=100)]
    assert throughput_series(rs, 2.6) == [5, 0, 7]


def test_report_groups_and_errors():
    rs = [_r("a"), _r("b", end=2.0), _r("b", status=401, error="authentication_error")]
    rep = build_report(rs, {"duration": 2.0}, 2.0, 2.0, 0.2)
    assert rep["overall"]["requests"] == 3 and rep["overall"]["completed"] == 2
    assert rep["overall"]["errors_by_status"] == {"401": 1}
    assert rep["tenants"]["b"]["errors_by_type"] == {"authentication_error": 1}
    assert rep["tenants"]["a"]["requests"] + rep["tenants"]["b"]["requests"] == 3
    assert rep["overall"]["output_tokens_per_s"] == 4.0
    assert rep["achieved_request_rate"] == 1.5


def test_parse_tenants():
    assert parse_tenants("a=sk-1, sk-2") == [("a", "sk-1"), ("t1", "sk-2")]
    with pytest.raises(ValueError):
        parse_tenants(" , ")


# ---- against a fake-worker gateway ----------------------------------------------------------------
@pytest.fixture(scope="module")
def gateway_url():
    from gateway.settings import Settings
    from tests.helpers import serving

    with serving(Settings(fake_worker=True, fake_step_ms=2.0, redis_url=None, tenants_file=None,
                          log_level="warning"), {"a": ["sk-a"], "b": ["sk-b"]}) as (_, url):
        yield url


def test_end_to_end_against_fake_gateway(gateway_url, tmp_path):
    from loadtest.loadgen import loadtest

    rep = asyncio.run(loadtest(gateway_url, [("a", "sk-a"), ("b", "sk-b")], rate=20, duration=2,
                               seed=5, workloads=["chat", "copy"], max_tokens=8))
    o = rep["overall"]
    assert o["requests"] > 10 and o["completed"] == o["requests"], o["errors_by_type"]
    assert sum(t["requests"] for t in rep["tenants"].values()) == o["requests"]
    assert set(rep["tenants"]) == {"a", "b"}
    assert o["ttft_s"]["p99"] <= o["e2e_s"]["p99"] and o["ttft_s"]["mean"] <= o["e2e_s"]["mean"]
    assert all(t <= e for t, e in zip(rep["samples"]["overall"]["ttft_s"],
                                      rep["samples"]["overall"]["e2e_s"]))
    assert o["output_tokens"] > 0 and sum(rep["tokens_per_second_series"]) == o["output_tokens"]
    assert rep["generator_lag_ms"]["p99"] < 50
    assert 0 <= o["slo_attainment"] <= 1
    out_json, out_png = tmp_path / "r.json", tmp_path / "r.png"
    out_json.write_text(json.dumps(rep))
    plot(rep, out_png)
    assert json.loads(out_json.read_text())["settings"]["rate"] == 20
    assert out_png.stat().st_size > 1000


def test_max_tokens_is_a_number_or_a_range():
    assert parse_max_tokens("64") == 64 and parse_max_tokens("8-512") == (8, 512)
    assert parse_max_tokens("5-5") == (5, 5)
    for bad in ("0", "9-8", "x", "8-", "-3", "1-2-3"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_max_tokens(bad)


def test_max_tokens_ranges_are_drawn_log_uniformly_and_reproducibly():
    assert draw_max_tokens(64, 3, seed=0) == [64, 64, 64]
    xs = draw_max_tokens((8, 512), 4000, seed=3)
    assert min(xs) >= 8 and max(xs) <= 512 and xs == draw_max_tokens((8, 512), 4000, seed=3)
    assert xs != draw_max_tokens((8, 512), 4000, seed=4)
    # log-uniform: as many below the geometric midpoint (64) as above it
    below = sum(x < 64 for x in xs) / len(xs)
    assert 0.45 < below < 0.55 and min(xs) < 10 and max(xs) > 450


def test_a_max_tokens_range_reaches_the_gateway_request_by_request(gateway_url):
    # the fake worker never stops early: each request's output is exactly its max_tokens
    from loadtest.loadgen import loadtest

    rep = asyncio.run(loadtest(gateway_url, [("a", "sk-a")], rate=20, duration=1.5, seed=7,
                               max_tokens=(2, 40)))
    o = rep["overall"]
    assert o["completed"] == o["requests"] > 5
    assert o["output_tokens"] == sum(draw_max_tokens((2, 40), o["requests"], seed=7))
    assert rep["settings"]["max_tokens"] == "2-40"


def test_bad_key_is_counted_as_401(gateway_url):
    from loadtest.loadgen import loadtest

    rep = asyncio.run(loadtest(gateway_url, [("a", "sk-a"), ("bad", "sk-nope")], rate=20,
                               duration=1, seed=2, max_tokens=4, bursty=True))
    bad = rep["tenants"]["bad"]
    assert bad["requests"] > 0 and bad["completed"] == 0
    assert bad["errors_by_status"] == {"401": bad["requests"]}
    assert rep["tenants"]["a"]["completed"] == rep["tenants"]["a"]["requests"]


def test_cli_run_writes_json_and_plot(gateway_url, tmp_path):
    import argparse

    from loadtest.loadgen import add_arguments, run

    p = argparse.ArgumentParser()
    add_arguments(p)
    args = p.parse_args(["--url", gateway_url, "--tenants", "a=sk-a", "--rate", "10",
                         "--duration", "0.5", "--max-tokens", "4",
                         "--json", str(tmp_path / "o.json"), "--plot", str(tmp_path / "o.png")])
    assert run(args) == 0
    assert json.loads((tmp_path / "o.json").read_text())["overall"]["requests"] >= 0
    assert (tmp_path / "o.png").exists()
