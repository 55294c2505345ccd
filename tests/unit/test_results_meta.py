"""The `meta` block every benchmark's --json carries (loadtest/results.py): what docs/benchmarks.md
prints beside each figure, so it must say the command, the date, the commit and the machine."""
from __future__ import annotations

import json
import re
import subprocess

import pytest

from loadtest import results
from loadtest.results import FLAGS, command_line, commit, machine, write_result

CPUINFO = """processor\t: 0
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) Platinum 8480+
flags\t\t: fpu sse avx2 fma avx512f avx512bw avx512vl avx512_bf16 amx_tile amx_bf16

processor\t: 1
model name\t: something else
flags\t\t: fpu
"""


def test_write_result_puts_a_fresh_meta_first_and_keeps_the_figures(tmp_path):
    path = tmp_path / "r.json"
    written = write_result(path, {"runs": {"24": {"ratio": 2.75}}, "meta": {"stale": True}},
                           argv=["/opt/venv/bin/specgate", "bench", "stall", "--json", str(path)])
    doc = json.loads(path.read_text())
    assert doc == written and list(doc) == ["meta", "runs"]
    assert doc["runs"] == {"24": {"ratio": 2.75}}
    m = doc["meta"]
    assert "stale" not in m
    assert m["command"] == f"specgate bench stall --json {path}"
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", m["date"])
    assert set(m["machine"]) == {"cpu", "cores", "flags"} and set(m["machine"]["flags"]) == set(FLAGS)
    assert m["machine"]["cores"] >= 1 and m["machine"]["cpu"]
    assert "torch" in m and "commit" in m


def test_machine_reads_the_first_processor_and_the_flags_the_engine_needs():
    m = machine(CPUINFO)
    assert m["cpu"] == "Intel(R) Xeon(R) Platinum 8480+"
    assert m["flags"] == {f: True for f in FLAGS}
    plain = machine("model name : AMD EPYC 7B12\nflags : avx2 fma amx_tile\n")
    assert plain["flags"]["avx2"] and plain["flags"]["fma"]
    assert plain["flags"]["avx512f"] is False
    assert plain["flags"]["amx"] is False          # tiles without their bf16 multiply
    unknown = machine("")                             # no /proc/cpuinfo: unknown, not absent
    assert set(unknown["flags"].values()) == {None}


def test_command_line_names_the_program_and_quotes_its_arguments():
    assert command_line(["/x/bin/specgate", "sim", "--laps", '{"wait_weight": 0.05}']) == \
        "specgate sim --laps '{\"wait_weight\": 0.05}'"
    assert command_line(["/repo/specgate/cli.py", "bench", "kv"]) == "specgate bench kv"
    assert command_line([]) == ""


def _git(repo, *args):
    subprocess.run(["git", "-c", "user.email=t@t", "-c", "user.name=t", *args], cwd=repo,
                   check=True, capture_output=True)


def test_commit_marks_uncommitted_changes_to_tracked_files(tmp_path):
    assert commit(tmp_path) is None                        # not a checkout
    _git(tmp_path, "init", "-q")
    (tmp_path / "a.py").write_text("x = 1\n")
    _git(tmp_path, "add", "a.py")
    _git(tmp_path, "commit", "-q", "-m", "a")
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=tmp_path,
                          capture_output=True, text=True, check=True).stdout.strip()
    assert commit(tmp_path) == head
    (tmp_path / "new.json").write_text("{}")               # an untracked result: still clean
    assert commit(tmp_path) == head
    (tmp_path / "a.py").write_text("x = 2\n")
    assert commit(tmp_path) == head + "-dirty"


def test_meta_says_the_commit_of_the_code_being_measured(monkeypatch, tmp_path):
    seen = []
    monkeypatch.setattr(results, "commit", lambda root=results.REPO: seen.append(root) or "abc1234")
    assert write_result(tmp_path / "r.json", {}, argv=["specgate"])["meta"]["commit"] == "abc1234"
    assert seen == [results.REPO] and (results.REPO / "loadtest" / "results.py").is_file()


@pytest.mark.parametrize("module", ["tools.bench_stall", "tools.sim", "loadtest.compare",
                                    "tools.bench_plan", "tools.bench_profile"])
def test_benchmark_writers_go_through_write_result(module):
    import importlib
    assert importlib.import_module(module).write_result is write_result
