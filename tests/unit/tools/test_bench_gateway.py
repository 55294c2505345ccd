"""`specgate bench gateway` at toy sizes: the report's shape and sanity (not its targets: test
machines are shared), both placements of the gateway, the CLI, and the client's framing."""
from __future__ import annotations

import argparse
import json

import pytest

from tools import bench_gateway
from tools.bench_gateway import quantile
from loadtest.http_client import parse_head

TINY = dict(requests=5, throughput_requests=40, concurrency=4, warmup=2)


def check_figures(r: dict) -> None:
    for path in ("direct", "gateway"):
        for q in ("median", "p90", "p99"):
            assert r[f"{path}_latency_ms_{q}"] > 0
        assert r[f"{path}_latency_ms_median"] <= r[f"{path}_latency_ms_p99"]
    for q in ("median", "p90", "p99"):
        added = r[f"gateway_latency_ms_{q}"] - r[f"direct_latency_ms_{q}"]
        assert r[f"added_latency_ms_{q}"] == pytest.approx(added, abs=1e-3)
    assert r["requests_per_s"] > 0 and r["direct_requests_per_s"] > 0
    assert r["errors"] == 0 and r["throughput_seconds"] > 0
    assert 0 < r["throughput_latency_ms_median"] <= r["throughput_latency_ms_p99"]
    assert r["server_cpu_share"] >= 0 and r["client_cpu_share"] >= 0


def test_both_placements_report_latencies_and_throughput():
    r = bench_gateway.bench_gateway(server="both", **TINY)
    assert (r["benchmark"], r["server"], r["requests"], r["concurrency"]) == ("gateway", "process", 5, 4)
    assert (r["throughput_requests"], r["max_tokens"], r["fake_step_ms"]) == (40, 4, 0.0)
    assert r["uvicorn_http"] in ("h11", "httptools") and r["uvicorn_loop"] in ("asyncio", "uvloop")
    check_figures(r)
    check_figures(r["same_process"])
    assert set(r["targets_met"]) == set(r["targets"]) == {"added_latency_ms_median", "requests_per_s"}
    assert all(isinstance(v, bool) for v in r["targets_met"].values())
    json.dumps(r)                                     # comparable run to run: plain JSON


def test_the_cli_writes_the_json_and_a_summary(tmp_path, capsys):
    parser = argparse.ArgumentParser()
    bench_gateway.add_arguments(parser)
    out = tmp_path / "gateway.json"
    args = parser.parse_args(["--requests", "3", "--throughput-requests", "20", "--concurrency",
                              "2", "--server", "thread", "--step-ms", "0.1", "--json", str(out)])
    assert bench_gateway.run(args) == 0
    report = json.loads(out.read_text())
    captured = capsys.readouterr()
    assert report.pop("meta")["command"] and json.loads(captured.out) == report
    assert "added" in captured.err and "requests/s" in captured.err
    assert report["server"] == "thread" and "same_process" not in report
    assert report["fake_step_ms"] == 0.1
    check_figures(report)


def test_bad_sizes_and_placements_are_refused():
    with pytest.raises(ValueError, match="server"):
        bench_gateway.bench_gateway(server="cloud")
    with pytest.raises(ValueError, match=">= 1"):
        bench_gateway.bench_gateway(requests=0)


@pytest.mark.parametrize("head, expected", [
    (b"HTTP/1.1 200 OK\r\ncontent-length: 12\r\ncontent-type: application/json", (200, 12)),
    (b"HTTP/1.1 429 Too Many Requests\r\nRetry-After: 1\r\nContent-Length: 0", (429, 0)),
])
def test_response_heads(head, expected):
    assert parse_head(head) == expected


def test_a_response_without_a_length_is_refused():
    with pytest.raises(RuntimeError, match="Content-Length"):
        parse_head(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked")


def test_quantiles_are_nearest_rank():
    xs = [float(x) for x in range(100, 0, -1)]      # 1 … 100, unsorted
    assert (quantile(xs, "median"), quantile(xs, "p90"), quantile(xs, "p99")) == (50, 90, 99)
    assert quantile([4.0, 1.0, 3.0, 2.0], "median") == 2.0
    assert quantile([7.0], "p99") == 7.0
