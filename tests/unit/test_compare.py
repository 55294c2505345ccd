"""Policy comparison: the pure parts on hand-made numbers, then a short fake-worker run of two
policies, each in its own gateway process."""
from __future__ import annotations

import argparse
import json

import pytest

from loadtest.compare import (comparison, latency_split, policy_row, pooled, reduction, round_order,
                              round_summary, server_sums, table, tenant_keys)


def _report(mean, p50, p99, completed=10, requests=10, ttft=(0.01, 0.02)):
    stats = lambda m, a, b: {"mean": m, "p50": a, "p90": b, "p99": b}    # noqa: E731
    return {"overall": {"e2e_s": stats(mean, p50, p99), "ttft_s": stats(None, *ttft),
                        "requests": requests, "completed": completed, "errors_by_type": {},
                        "output_tokens_per_s": 100.0, "completed_per_s": completed / 8.0},
            "generator_lag_ms": {"p99": 1.0},
            "samples": {"overall": {"e2e_s": [mean] * completed}}}


@pytest.mark.parametrize("base, new, want", [
    (2.0, 1.5, 0.25),          # laps 25% lower
    (1.0, 1.0, 0.0),
    (1.0, 1.2, -0.2),          # laps slower: negative
    (0.0, 1.0, None),          # no base to divide by
    (None, 1.0, None),
    (1.0, None, None),
])
def test_reduction_table(base, new, want):
    got = reduction(base, new)
    assert got == pytest.approx(want) if want is not None else got is None


def test_comparison_rows_and_laps_reductions():
    reps = {"fcfs": _report(2.0, 1.8, 8.0), "sjf": _report(1.0, 0.9, 5.0),
            "laps": _report(1.5, 1.0, 4.0, completed=9)}
    cmp = comparison(reps, {"rate": 1, "duration": 1})
    laps = cmp["policies"]["laps"]
    assert laps["mean_latency_s"] == 1.5 and laps["p50_latency_s"] == 1.0
    assert laps["p99_latency_s"] == 4.0 and laps["completed"] == 9 and laps["errors"] == 1
    assert laps["ttft_p50_s"] == 0.01 and laps["ttft_p99_s"] == 0.02
    assert laps["completed_per_s"] == 9 / 8.0 and "1.12" in table(cmp)
    assert cmp["laps_reduction_vs"] == pytest.approx({"fcfs": 0.25, "sjf": -0.5})
    assert cmp["laps_p99_reduction_vs"] == pytest.approx({"fcfs": 0.5, "sjf": 0.2})
    assert len(cmp["samples"]["laps"]) == 9
    assert "+25.0%" in table(cmp) and "-50.0%" in table(cmp)
    # without laps there is nothing to reduce against
    assert "laps_reduction_vs" not in comparison({"fcfs": reps["fcfs"]}, {})
    assert policy_row(reps["fcfs"])["errors"] == 0


def test_the_latency_split_comes_from_the_gateways_own_histograms():
    from prometheus_client.exposition import generate_latest
    from gateway.metrics import GatewayMetrics

    m = GatewayMetrics()
    for tenant, e2e, in_steps in (("a", 3.0, 2.0), ("a", 5.0, 1.0), ("b", 4.0, 3.0)):
        m.e2e.labels(tenant).observe(e2e)
        m.in_steps.labels(tenant).observe(in_steps)
    m.queue_time.labels("a").observe(9.0)                  # another histogram: left out
    sums = server_sums(generate_latest(m.registry).decode())
    assert sums == pytest.approx({"e2e_sum": 12.0, "e2e_count": 3, "in_steps_sum": 6.0,
                                  "in_steps_count": 3})
    assert latency_split(sums) == pytest.approx(
        {"server_mean_latency_s": 4.0, "mean_in_steps_s": 2.0, "mean_wait_s": 2.0})
    assert latency_split(None) == {"server_mean_latency_s": None, "mean_in_steps_s": None,
                                   "mean_wait_s": None}
    # rounds pool sums and counts, not means
    a, b = _report(1.0, 1.0, 1.0), _report(1.0, 1.0, 1.0)
    a["server"] = sums
    b["server"] = {"e2e_sum": 2.0, "e2e_count": 1, "in_steps_sum": 2.0, "in_steps_count": 1}
    row = policy_row(pooled([a, b]))
    assert row["mean_wait_s"] == pytest.approx(14 / 4 - 8 / 4)
    line = table(comparison({"fcfs": pooled([a, b])}, {})).splitlines()[1]
    assert line.split()[-2:] == ["1500.0", "2000.0"]                  # wait ms, steps ms


def test_rounds_alternate_the_order():
    assert [round_order(["fcfs", "sjf", "laps"], r) for r in range(3)] == [
        ["fcfs", "sjf", "laps"], ["laps", "sjf", "fcfs"], ["fcfs", "sjf", "laps"]]


def test_pooled_rounds_count_every_request_once():
    a, b = _report(1.0, 1.0, 1.0, completed=3), _report(4.0, 4.0, 4.0, completed=1, requests=2)
    a["samples"]["overall"]["e2e_s"] = [0.5, 1.0, 1.5]
    b["overall"]["errors_by_type"] = {"timeout": 1}
    b["generator_lag_ms"]["p99"] = 7.0
    row = policy_row(pooled([a, b]))
    assert row["mean_latency_s"] == pytest.approx(7.0 / 4)          # over the 4 requests, not 2 means
    assert (row["p50_latency_s"], row["p99_latency_s"]) == (1.0, 4.0)
    assert (row["requests"], row["completed"], row["errors"]) == (12, 4, 8)
    assert row["errors_by_type"] == {"timeout": 1} and row["generator_lag_p99_ms"] == 7.0
    assert row["completed_per_s"] == pytest.approx((3 / 8 + 1 / 8) / 2)
    assert pooled([a]) is a


def test_a_round_reports_laps_against_the_others_in_its_order():
    reps = {"laps": _report(3.0, 3.0, 3.0), "fcfs": _report(4.0, 4.0, 4.0)}
    r = round_summary(["laps", "fcfs"], reps)
    assert r["order"] == ["laps", "fcfs"] and r["mean_latency_s"] == {"laps": 3.0, "fcfs": 4.0}
    assert r["laps_reduction_vs"] == pytest.approx({"fcfs": 0.25})
    assert "laps_reduction_vs" not in round_summary(["fcfs"], reps)


def test_tenant_keys_are_fixed():
    assert tenant_keys(2) == [("t0", "sk-loadtest-0"), ("t1", "sk-loadtest-1")]
    with pytest.raises(ValueError):
        tenant_keys(0)


def run_compare(tmp_path, *argv: str) -> dict:
    """`specgate loadtest compare ARGV --json FILE` through its own argument parser; the report."""
    from loadtest.compare import add_arguments, run

    p = argparse.ArgumentParser()
    add_arguments(p)
    out = tmp_path / "cmp.json"
    assert run(p.parse_args([*argv, "--json", str(out)])) == 0
    return json.loads(out.read_text())


def test_fake_worker_compare_writes_json_and_plot(tmp_path):
    png = tmp_path / "cmp.png"
    rep = run_compare(tmp_path, "--policies", "fcfs,laps", "--fake-worker", "--fake-step-ms", "2",
                      "--rate", "8", "--duration", "1.5", "--seed", "3", "--max-tokens", "8",
                      "--workloads", "chat,copy", "--rounds", "2", "--plot", str(png))
    assert list(rep["policies"]) == ["fcfs", "laps"] and rep["settings"]["rounds"] == 2
    assert [r["order"] for r in rep["rounds"]] == [["fcfs", "laps"], ["laps", "fcfs"]]
    requests = {r["requests"] for r in rep["policies"].values()}
    assert len(requests) == 1 and requests.pop() > 6        # the same arrivals for both, 2 rounds
    for r in rep["rounds"]:                                 # each round's mean is in the pool
        assert set(r["mean_latency_s"]) == {"fcfs", "laps"} and set(r["laps_reduction_vs"]) == {"fcfs"}
    assert len(rep["samples"]["laps"]) == rep["policies"]["laps"]["completed"]
    from loadtest.compare import table
    assert "round 2: mean ms laps " in table(rep)
    for row in rep["policies"].values():
        assert {"mean_latency_s", "p50_latency_s", "p99_latency_s", "completed", "errors",
                "ttft_p50_s", "ttft_p99_s"} <= set(row)
        assert row["errors"] == 0 and row["completed"] == row["requests"], row["errors_by_type"]
        assert 0 < row["p50_latency_s"] <= row["p99_latency_s"]
        # the gateway's own split: steps of at least 2 ms each, within what the client measured
        assert 0.002 < row["mean_in_steps_s"] <= row["server_mean_latency_s"]
        assert row["server_mean_latency_s"] <= row["mean_latency_s"]
        assert row["mean_wait_s"] == pytest.approx(row["server_mean_latency_s"]
                                                   - row["mean_in_steps_s"])
    assert set(rep["laps_reduction_vs"]) == {"fcfs"}
    assert png.stat().st_size > 1000


def test_load_measures_capacity_first_and_offers_that_share_of_it(tmp_path):
    """`--load F`: one fcfs pass at --rate (saturating the paced fake worker) measures capacity,
    then every policy gets F x capacity."""
    from loadtest.compare import table

    rep = run_compare(tmp_path, "--policies", "fcfs", "--fake-worker", "--fake-step-ms", "20",
                      "--rate", "60", "--duration", "2", "--max-tokens", "16", "--load", "0.5")
    cap = rep["settings"]["capacity"]
    assert cap["probe_rate"] == 60 and cap["load"] == 0.5
    assert 0 < cap["completed_per_s"] < 60                  # saturated: fewer done than offered
    assert rep["settings"]["rate"] == pytest.approx(0.5 * cap["completed_per_s"])
    row = rep["policies"]["fcfs"]
    assert row["errors"] == 0 and row["completed"] == row["requests"]
    assert "offered 0.5 x capacity" in table(rep)
    with pytest.raises(ValueError, match="load"):
        from loadtest.compare import compare
        compare(["fcfs"], {}, rate=1, duration=1, load=0)


def test_unknown_policy_is_refused():
    from loadtest.compare import compare

    with pytest.raises(ValueError, match="unknown policy"):
        compare(["fifo"], {}, rate=1, duration=1)


def test_srpt_gets_a_truth_pass_and_knows_every_length(tmp_path):
    """srpt among the policies: a truth pass asks every prompt once, and the srpt gateway ranks
    by that table; the fake worker runs every answer to its limit, so the table is exact."""
    from loadtest.compare import add_arguments, run, table

    p = argparse.ArgumentParser()
    add_arguments(p)
    out = tmp_path / "cmp.json"
    args = p.parse_args(["--policies", "fcfs,laps,srpt", "--fake-worker", "--fake-step-ms", "2",
                         "--rate", "8", "--duration", "1.5", "--seed", "3", "--max-tokens", "4-8",
                         "--workloads", "chat,copy", "--json", str(out)])
    assert run(args) == 0
    rep = json.loads(out.read_text())
    assert rep["oracle"] == {"prompts": 28, "cap": 8, "ran_to_cap": 28}
    srpt = rep["policies"]["srpt"]
    assert srpt["errors"] == 0 and srpt["completed"] == srpt["requests"] > 6
    assert srpt["oracle_exact"] == 1.0
    assert "laps_share_of_srpt" in rep and "srpt" in table(rep)


def test_chunk_variants_run_every_policy_under_each_value(tmp_path):
    """`--prefill-chunk-tokens 0,16`: chunked against whole prefill on the same arrivals."""
    from loadtest.compare import table

    rep = run_compare(tmp_path, "--policies", "fcfs", "--fake-worker", "--fake-step-ms", "2",
                      "--rate", "8", "--duration", "1.5", "--max-tokens", "8",
                      "--prefill-chunk-tokens", "0,16")
    assert list(rep["policies"]) == ["fcfs@chunk0", "fcfs@chunk16"]
    for row in rep["policies"].values():
        assert row["errors"] == 0 and row["completed"] == row["requests"] > 3
        assert row["itl_p99_s"] is None or row["itl_p99_s"] > 0
    assert len({r["requests"] for r in rep["policies"].values()}) == 1      # the same arrivals
    assert "fcfs@chunk16" in table(rep)


def test_seeds_are_parsed_and_runs_never_share_arrivals():
    from loadtest.compare import parse_seeds, units

    assert parse_seeds("1, 4,7") == [1, 4, 7]
    for bad in ("1,x", "", "2,2"):
        with pytest.raises(ValueError, match="--seeds"):
            parse_seeds(bad)
    assert units([1, 4], 2) == [(1, 0, 1), (1, 1, 2), (4, 0, 4), (4, 1, 5)]
    assert units([7], 3) == [(7, 0, 7), (7, 1, 8), (7, 2, 9)]          # one seed: as before
    with pytest.raises(ValueError, match="at least 2 apart"):
        units([1, 2], 2)                                               # seed 1 round 1 is seed 2


def test_intervals_are_over_each_runs_requests_and_bracket_the_rows_figures():
    """compare's aggregation on recorded-shaped per-request data: every figure of the rows gets
    an interval around the same figure, and every policy a ratio against fcfs and sjf."""
    import numpy as np

    from loadtest.compare import comparison_intervals, interval_lines
    from loadtest.loadgen import stats

    rng = np.random.default_rng(4)
    runs = [f"seed {s} round {r}" for s in (1, 4) for r in (0, 1)]
    scale = {"fcfs": 2.0, "sjf": 1.5, "laps": 1.0}
    by_unit = {p: {u: {"e2e_s": list(k * rng.exponential(1.0, 30)),
                       "ttft_s": list(k * rng.exponential(0.1, 30))} for u in runs}
               for p, k in scale.items()}
    iv = comparison_intervals(by_unit, resamples=300)
    assert iv["units"] == runs and iv["level"] == 0.95
    for p in scale:
        pooled = {s: [x for u in runs for x in by_unit[p][u][s]] for s in ("e2e_s", "ttft_s")}
        e2e, ttft = stats(pooled["e2e_s"]), stats(pooled["ttft_s"])
        for key, want in (("mean_latency_s", e2e["mean"]), ("p99_latency_s", e2e["p99"]),
                          ("ttft_p50_s", ttft["p50"]), ("ttft_p99_s", ttft["p99"])):
            ci = iv[key]["policies"][p]
            assert ci["estimate"] == pytest.approx(want) and ci["low"] <= want <= ci["high"]
    ratios = iv["mean_latency_s"]["ratios"]
    assert set(ratios) == {"sjf/fcfs", "laps/fcfs", "fcfs/sjf", "laps/sjf"}
    assert ratios["laps/fcfs"]["high"] < 1.0 < ratios["fcfs/sjf"]["estimate"]   # laps: half fcfs
    lines = "\n".join(interval_lines(iv))
    assert "over 4 runs" in lines and "laps/fcfs" in lines


def test_several_seeds_in_one_go(tmp_path):
    from loadtest.compare import table

    rep = run_compare(tmp_path, "--policies", "fcfs,laps", "--fake-worker", "--fake-step-ms", "2",
                      "--rate", "8", "--duration", "1.5", "--seeds", "3,5", "--max-tokens", "8")
    assert rep["settings"]["seeds"] == [3, 5] and rep["settings"]["seed"] == 3
    assert [(r["seed"], r["arrivals_seed"]) for r in rep["rounds"]] == [(3, 3), (5, 5)]
    assert [r["order"] for r in rep["rounds"]] == [["fcfs", "laps"], ["laps", "fcfs"]]
    iv = rep["intervals"]
    assert iv["units"] == ["seed 3 round 0", "seed 5 round 0"]
    ci = iv["mean_latency_s"]["policies"]["laps"]
    assert ci["estimate"] == pytest.approx(rep["policies"]["laps"]["mean_latency_s"])
    assert 0 < ci["low"] <= ci["estimate"] <= ci["high"]
    assert set(iv["mean_latency_s"]["ratios"]) == {"laps/fcfs"}
    assert "bootstrap intervals over 2 runs" in table(rep)
