"""Every command that loads the engine here takes `serve`'s --device and --dtype choices
(workers/model/placement.py), and `generate` runs a model with them."""
from __future__ import annotations

import json

import pytest

from specgate.cli import main, parse
from workers.model.device import DTYPES
from workers.model.placement import DTYPE_NAMES

COMMANDS = [["serve"], ["generate", "--prompts", "p.jsonl"], ["bench", "engine", "--workload", "copy"],
            ["bench", "structured"], ["bench", "profile"]]


def test_the_choices_are_the_names_the_engine_resolves():
    assert DTYPE_NAMES == tuple(DTYPES)


@pytest.mark.parametrize("words", COMMANDS, ids=lambda w: " ".join(w[:2]))
@pytest.mark.parametrize("dtype", DTYPE_NAMES)
def test_each_command_takes_every_dtype_and_a_device(words, dtype):
    args = parse([*words, "--device", "cpu", "--dtype", dtype])
    assert (args.device, args.dtype) == ("cpu", dtype)


@pytest.mark.parametrize("words", COMMANDS, ids=lambda w: " ".join(w[:2]))
def test_an_unknown_dtype_is_refused_by_every_command(words, capsys):
    with pytest.raises(SystemExit) as exit_:
        parse([*words, "--dtype", "float64"])
    assert exit_.value.code == 2 and "float64" in capsys.readouterr().err


def test_generate_runs_on_the_device_and_dtype_it_is_given(tmp_path):
    from tests.helpers import tiny_model_dir
    model = tiny_model_dir(tmp_path / "tiny")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "The cat sat on the"}) + "\n")
    out = tmp_path / "out.json"
    assert main(["generate", "--model", str(model), "--prompts", str(prompts), "--max-tokens", "4",
                 "--device", "cpu", "--dtype", "float16", "--json", str(out)]) == 0
    rec = json.loads(out.read_text())[0]
    assert 1 <= len(rec["token_ids"]) <= 4


def test_generate_refuses_a_device_it_cannot_use(tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "hi"}) + "\n")
    assert main(["generate", "--prompts", str(prompts), "--device", "tpu"]) == 2
    assert "unknown device 'tpu'" in capsys.readouterr().err
