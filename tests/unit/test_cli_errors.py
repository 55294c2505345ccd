"""`specgate generate` refuses bad input with a clear message before loading any model."""
from __future__ import annotations

import json

import pytest

from specgate.cli import main


@pytest.fixture
def prompts_file(tmp_path):
    p = tmp_path / "p.jsonl"
    p.write_text(json.dumps({"prompt": "hello"}) + "\n")
    return p


@pytest.mark.parametrize("extra,message", [
    (["--max-tokens", "0"], "--max-tokens must be >= 1"),
    (["--temperature", "-1"], "temperature must be >= 0"),
    (["--top-p", "0"], "top_p"),
    (["--drafter", "nope"], "unknown drafter 'nope'"),
])
def test_bad_arguments(prompts_file, capsys, extra, message):
    assert main(["generate", "--prompts", str(prompts_file), *extra]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("content,message", [
    ("", "holds no prompts"),
    ("{not json\n", "not valid JSON"),
    ("[1, 2]\n", "must be a JSON object"),
])
def test_bad_prompt_files(tmp_path, capsys, content, message):
    p = tmp_path / "bad.jsonl"
    p.write_text(content)
    assert main(["generate", "--prompts", str(p)]) == 2
    assert message in capsys.readouterr().err


def test_missing_prompt_file(tmp_path, capsys):
    assert main(["generate", "--prompts", str(tmp_path / "nope.jsonl")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_the_command_table_is_the_parser_and_the_dispatch():
    """Every row of the table parses as `specgate <words> --help` and names a module with the
    functions it says; the parser offers exactly the table's commands."""
    import importlib

    from specgate.cli import COMMANDS, build_parser, parse

    for cmd in COMMANDS:
        module = importlib.import_module(cmd.module)
        assert callable(getattr(module, cmd.add)) and callable(getattr(module, cmd.run)), cmd
        with pytest.raises(SystemExit) as exit_:
            parse([*cmd.words, "--help"])
        assert exit_.value.code == 0, cmd
    top = {a.dest: a for a in build_parser()._actions}["command"].choices
    assert set(top) == {c.words[0] for c in COMMANDS}
    assert COMMANDS[parse(["loadtest", "compare", "--policies", "fcfs"]).command_index].module == "loadtest.compare"
    assert COMMANDS[parse(["loadtest", "--url", "http://x", "--tenants", "a=k", "--rate", "1",
                          "--duration", "1", "--json", "o.json"]).command_index].module == "loadtest.loadgen"
    assert COMMANDS[parse(["bench", "plan"]).command_index].module == "tools.bench_plan"
