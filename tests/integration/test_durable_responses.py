"""Kill -9 the gateway in the middle of a streamed background response, start it again, resume
with `starting_after`: real `specgate serve` processes over a real Redis, on a tiny random model
that speaks the default model's tokenizer (tools/bench_resume.py is the harness; `specgate bench
resume` runs it at 20 kill points per mode on the default model: results/bench_resume_*.json)."""
from __future__ import annotations

import pytest

from tests.helpers import tiny_model_dir
from tools.bench_resume import bench_resume

pytestmark = pytest.mark.slow


def test_a_stream_resumed_after_kill_9_and_restart_is_whole_and_numbered_once(tmp_path, redis_url):
    model = tiny_model_dir(tmp_path / "tiny")
    report = bench_resume(model=str(model), redis_url=redis_url, tries=2, max_tokens=48,
                          modes=["greedy", "seeded"], seed=7, log_path=tmp_path / "serve.log")
    for mode, got in report["modes"].items():
        assert got["reference_deltas"] >= 10, (mode, got)
        for row in got["rows"]:
            assert row["identical"] and row["numbered"], (mode, row)
            assert row["events_before"] > 4 and row["events_after"] > 0
