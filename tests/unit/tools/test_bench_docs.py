"""`specgate docs`' benchmark page (tools/bench_docs.py, tools/bench_tables.py): every result file is
shown with its machine, date and commit, figures come only from the files, the simulator's
format renders, and a result nobody describes is an error rather than a silent omission."""
from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import pytest

from specgate import docs as docs_cmd
from tools import bench_docs, bench_tables

ROOT = Path(__file__).resolve().parents[3]


def _tree(tmp_path: Path, results: dict[str, dict]) -> Path:
    (tmp_path / "results").mkdir()
    (tmp_path / "docs").mkdir()
    for name, doc in results.items():
        (tmp_path / "results" / name).write_text(json.dumps(doc))
    return tmp_path


META = {"command": "specgate sim --json results/sim_default.json", "date": "2026-12-07T10:00:00Z",
        "commit": "abc1234-dirty", "torch": "2.13.0",
        "machine": {"cpu": "AMD EPYC 9R14", "cores": 2,
                    "flags": {"avx2": True, "fma": True, "avx512f": True, "avx512bw": True,
                              "avx512vl": True, "avx512_bf16": True, "amx": False}}}


def _policy(mean: float, p99: float, wait: float) -> dict:
    """One policy's entry as tools/sim.py's `summarize` writes it (the keys the page reads)."""
    return {"policy": "x", "mean_latency_s": mean, "p50_latency_s": mean * 0.8,
            "p99_latency_s": p99, "max_latency_s": p99 * 1.2, "max_wait_s": 57.7,
            "mean_wait_s": wait, "mean_in_steps_s": mean - wait, "p99_first_step_wait_s": 3.0,
            "per_tenant_mean_latency_s": {"chat": mean}, "finished": 100, "refused": 0,
            "steps": 900, "mean_batch": 5.1, "utilization": 0.98, "prefill_share": 0.4,
            "reprefills": 0, "max_step_s": 0.25, "committed_tokens_per_s": 118.1,
            "aged_promotions": 2, "aging_bound_s": 60.0, "wall_s": 1.0}


SIM = {"meta": META,
       "settings": {"n_requests": 100, "load": 0.85, "seed": 1, "max_batch": 8,
                    "prefill_chunk_tokens": 24, "arrival_cv": 2.0, "profile_source": "default"},
       "policies": {"fcfs": _policy(17.85, 141.5, 3.66), "laps": _policy(17.21, 138.2, 3.16)}}


def test_a_sim_result_shows_each_policys_latency_and_its_split(tmp_path):
    root = _tree(tmp_path, {"sim_bursty_chunked.json": SIM})
    page = bench_docs.render(root)
    section = page[page.index("## sim"):]
    assert "### `results/sim_bursty_chunked.json`" in section
    assert "| policy | mean s | p50 s | p99 s | max wait s | mean waiting s | mean in steps s |" in section
    assert "| fcfs | 17.85 | 14.28 | 141.5 | 57.7 | 3.66 | 14.19 |" in section
    assert "| laps | 17.21 |" in section
    assert "arrival_cv 2.000" in section and "prefill_chunk_tokens 24" in section
    assert ("**Machine** AMD EPYC 9R14, 2 cores; avx2 yes, fma yes, avx512f yes, avx512bw yes, "
            "avx512vl yes, avx512_bf16 yes, amx no. **Date** 2026-12-07T10:00:00Z. "
            "**Commit** abc1234-dirty.") in section
    assert "- [sim](#sim)\n" in page                        # listed with a result


def test_a_benchmark_without_a_result_says_so_and_a_result_without_meta_says_that(tmp_path):
    doc = dict(SIM)
    del doc["meta"]
    page = bench_docs.render(_tree(tmp_path, {"sim_default.json": doc}))
    assert "- [bench gateway](#bench-gateway) (no current result)" in page
    assert "No `meta` block: machine, date and commit unknown" in page


def test_a_result_no_benchmark_claims_is_an_error(tmp_path):
    root = _tree(tmp_path, {"mystery_bench.json": {"x": 1}})
    with pytest.raises(ValueError, match="results/mystery_bench.json"):
        bench_docs.render(root)


def test_every_committed_result_is_on_the_page_with_its_machine():
    page = (ROOT / "docs" / "benchmarks.md").read_text(encoding="utf-8")
    results = sorted((ROOT / "results").glob("*.json"))
    assert results
    for path in results:
        assert json.loads(path.read_text())["meta"]["machine"]["flags"], path.name
        assert f"### `results/{path.name}`" in page


def test_cells_escape_pipes_and_missing_figures_show_a_dash():
    assert bench_tables.table(("a",), [("x|y",)])[-1] == "| x\\|y |"
    assert bench_tables.num(None) == "–" and bench_tables.num(1234) == "1,234"
    assert bench_tables.num(True) == "yes" and bench_tables.times(1.0512, 2) == "1.05×"


def test_specgate_docs_writes_both_pages_and_check_reports_drift(tmp_path, monkeypatch, capsys):
    root = _tree(tmp_path, {"sim_default.json": SIM})
    monkeypatch.setattr(docs_cmd, "render_cli", lambda: "# cli\n")      # the parsers: tested apart
    args = argparse.Namespace(root=root, check=True)
    assert docs_cmd.run(args) == 1                          # nothing written yet
    assert docs_cmd.run(argparse.Namespace(root=root, check=False)) == 0
    assert (root / "docs" / "cli.md").read_text() == "# cli\n"
    assert "## sim" in (root / "docs" / "benchmarks.md").read_text()
    assert docs_cmd.run(args) == 0
    shutil.copy(root / "docs" / "cli.md", root / "docs" / "benchmarks.md")
    assert docs_cmd.run(args) == 1
    assert "docs/benchmarks.md is not what `specgate docs` writes" in capsys.readouterr().err


def test_a_compare_result_with_intervals_shows_them_and_one_without_renders_as_before():
    from loadtest.compare import comparison_intervals

    row = {"mean_latency_s": 2.0, "p50_latency_s": 1.5, "p99_latency_s": 9.0, "completed": 40,
           "requests": 40, "errors": 0}
    doc = {"settings": {"rounds": 1}, "policies": {"fcfs": row, "laps": {**row, "mean_latency_s": 1.0}}}
    before = bench_tables.compare(doc)
    assert not any("bootstrap" in line for line in before)
    runs = {"seed 1 round 0": 1.0, "seed 4 round 0": 1.3}
    by_unit = {p: {u: {"e2e_s": [k * f * (1 + i % 7) for i in range(30)],
                       "ttft_s": [0.1 * k * f] * 30} for u, f in runs.items()}
               for p, k in (("fcfs", 2.0), ("laps", 1.0))}
    iv = comparison_intervals(by_unit, resamples=200)
    lines = bench_tables.compare({**doc, "intervals": iv})
    assert lines[:len(before)] == before                      # the rows as before, then the intervals
    text = "\n".join(lines)
    assert "95% bootstrap intervals over 2 runs (seed 1 round 0, seed 4 round 0)" in text
    assert "| policy | mean_latency s | p99_latency s | ttft_p50 s | ttft_p99 s |" in text
    laps = iv["mean_latency_s"]["ratios"]["laps/fcfs"]
    assert (f"| laps/fcfs | {laps['estimate']:.3f} [{laps['low']:.3f}, {laps['high']:.3f}] |"
            in text)


def test_a_scheduler_bench_result_shows_each_configuration_and_the_growth(tmp_path):
    cfg = lambda q, r, ms: {"waiting": q, "running": r, "homes": r // 8, "median_ms": ms,   # noqa: E731
                            "p99_ms": 2 * ms, "plan_median_ms": ms / 2, "update_median_ms": ms / 2,
                            "cpu_median_ms": ms / 3, "mean_batch": float(r)}
    doc = {"meta": META, "settings": {"policy": "laps"},
           "configs": [cfg(100, 1000, 40.0), cfg(10000, 1000, 52.0)],
           "growth": {"running 1000: waiting 100 -> 10000": 1.3}}
    page = bench_docs.render(_tree(tmp_path, {"bench_scheduler.json": doc}))
    section = page[page.index("## bench scheduler"):]
    assert "| 10,000 | 1,000 | 125 | 52.000 | 104.000 | 26.000 | 26.000 | 17.333 | 1,000 |" in section
    assert "running 1000: waiting 100 -> 10000, 1.30×" in section
