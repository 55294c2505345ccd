"""`specgate bench scheduler` (tools/bench_scheduler.py): the planner's cost per step at scale, and
the guard that makes optimising it safe: on seeded workloads the plans are step for step those
the planner made before any optimisation (digests recorded in data/scheduler_plans.json)."""
from __future__ import annotations

import argparse
import hashlib
import json
from pathlib import Path

import pytest

from tools import bench_scheduler
from tools.bench_scheduler import Workload

GOLDEN = Path(__file__).parent / "data" / "scheduler_plans.json"
# KV short (headroom below one start per batch slot: deferred starts and evictions), steps long
# enough for aging to promote, several homes; once whole prefill, once chunked
WORKLOADS = {"laps_kv_short": {"seed": 3},
             "laps_chunked": {"seed": 4, "prefill_chunk_tokens": 32},
             "fcfs_kv_short": {"seed": 5, "policy": "fcfs"}}


def plan_digests(steps: int = 80, **kw) -> list[str]:
    """One digest per step of everything a plan decides: ids in order, tree budgets, aged count,
    prefill chunks, evictions and homes."""
    # the digests predate tenants' row shares, an intended change of plans with their own tests
    # (tests/unit/scheduler/test_row_shares.py); without them every plan must be as recorded
    w = Workload(300, 40, kv_headroom=0.8, step_s=1.0, tenant_row_share=None, **kw)
    out = []
    for _ in range(steps):
        p = w.step_plan()[4]
        text = json.dumps([p.request_ids, [[b.max_nodes, b.max_depth] for b in p.budgets], p.aged,
                           p.prefill, p.warm, p.evict, sorted(p.homes.items())])
        out.append(hashlib.sha256(text.encode()).hexdigest()[:16])
    return out


@pytest.mark.parametrize("name", WORKLOADS)
def test_plans_are_those_made_before_the_planner_was_optimised(name):
    want = json.loads(GOLDEN.read_text())[name]
    got = plan_digests(**WORKLOADS[name])
    first = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)
    assert first is None, f"{name}: the plan differs from step {first} on"
    assert len(got) == len(want)


def test_the_workload_keeps_its_live_count_and_fills_the_batch():
    w = Workload(200, 16, seed=1)
    for _ in range(30):
        w.step()
    assert len(w.state.requests) == 216
    r = bench_scheduler.bench_scheduler(200, 16, steps=20, warmup=5)
    assert r["mean_batch"] == 16 and r["homes"] == 2
    assert 0 < r["median_ms"] <= r["p99_ms"]
    assert r["plan_median_ms"] + r["update_median_ms"] == pytest.approx(r["median_ms"], rel=0.5)


def test_bench_cli_writes_configs_and_growth(tmp_path, capsys):
    parser = argparse.ArgumentParser()
    bench_scheduler.add_arguments(parser)
    out = tmp_path / "s.json"
    args = parser.parse_args(["--waiting", "50,400", "--running", "16", "--steps", "10",
                              "--warmup", "3", "--json", str(out)])
    assert bench_scheduler.run(args) == 0
    doc = json.loads(out.read_text())
    assert [(c["waiting"], c["running"]) for c in doc["configs"]] == [(50, 16), (400, 16)]
    assert list(doc["growth"]) == ["running 16: waiting 50 -> 400"] and "meta" in doc
    assert "| 400 | 16 | 2 |" in capsys.readouterr().out
    with pytest.raises(ValueError, match="positive"):
        bench_scheduler.run(parser.parse_args(["--waiting", "0"]))
