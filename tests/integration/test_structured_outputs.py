"""Structured outputs through the served gateway with the official `openai` client (issue 34,
item 1): response_format json_schema (the client's pydantic `parse` path) and json_object, streamed
and not, on a tiny random Llama that speaks the default model's tokenizer; greedy output equals
plain constrained decoding; a schema the engine cannot use is a 400 naming response_format."""
from __future__ import annotations

import json
from typing import Annotated, Literal

import openai
import pytest
from pydantic import BaseModel, Field

from gateway.settings import Settings
from tests.helpers import openai_client_on, tiny_model_dir
from tests.unit.test_grammar import constrained_reference
from workers.prompts import encode_record

MODEL = "tiny"
MESSAGES = [{"role": "user", "content": "Pick a colour and a number, as JSON."}]


class Pick(BaseModel):
    # bounded fields: a random model's string or number would otherwise run past max_tokens
    colour: Literal["red", "green", "blue"]
    sure: bool
    number: Annotated[int, Field(ge=0, le=99)]
    label: Annotated[str, Field(max_length=5)]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from workers.runtime import load_runtime

    rt = load_runtime(str(tiny_model_dir(tmp_path_factory.mktemp("tiny"))), keep_hf=True, progress=False)
    settings = Settings(model=str(rt.tokenizer.name_or_path), served_model_name=MODEL, max_batch=4)
    with openai_client_on(rt, settings, timeout=120) as (_, client):
        yield rt, client


def test_the_clients_parse_path_returns_a_valid_object_equal_to_plain_constrained_decoding(served):
    rt, client = served
    r = client.chat.completions.parse(model=MODEL, messages=MESSAGES, response_format=Pick,
                                      temperature=0, max_tokens=80)
    choice = r.choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(choice.message.parsed, Pick)
    schema = openai.lib._pydantic.to_strict_json_schema(Pick)
    ref = constrained_reference(rt, encode_record(rt.tokenizer, {"messages": MESSAGES}),
                                json.dumps({"type": "json_schema", "schema": schema}), 80)
    assert choice.message.content == rt.tokenizer.decode(ref, skip_special_tokens=True)


def test_json_object_streamed_equals_not_streamed_and_stays_json(served):
    rt, client = served
    kw = dict(model=MODEL, messages=MESSAGES, temperature=0, max_tokens=60,
              response_format={"type": "json_object"})
    whole = client.chat.completions.create(**kw).choices[0].message.content
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(stream=True, **kw)
                       if c.choices)
    assert streamed == whole and whole.startswith("{")
    m = rt.grammars.matcher('{"type": "json_object"}')
    assert m.accept_string(whole), "the output left the grammar"      # a prefix, if cut by max_tokens


@pytest.mark.parametrize("fmt", [
    {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "no-such-type"}}},
    {"type": "json_schema", "json_schema": {"name": "x"}},
    {"type": "regex", "pattern": "a+"},
])
def test_a_schema_that_cannot_be_served_is_a_400_naming_response_format(served, fmt):
    _, client = served
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=5, response_format=fmt)
    assert e.value.body["param"] == "response_format"


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather for a city",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
                   "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]},
                                  "unit": {"type": "string", "enum": ["c", "f"]},
                                  "days": {"type": "integer", "minimum": 1, "maximum": 7}}}}}


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_a_forced_tool_call_has_arguments_that_follow_the_functions_schema(served, choice):
    # a random model left to itself writes text; forced, the grammar makes it a valid call
    import jsonschema

    _, client = served
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "Weather in Oslo?"}], tools=[WEATHER],
              tool_choice=choice, temperature=0, max_tokens=80)
    r = client.chat.completions.create(**kw)
    (call,) = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls" and call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    streamed = {}
    for c in client.chat.completions.create(stream=True, **kw):
        for d in (c.choices[0].delta.tool_calls or []) if c.choices else []:
            part = streamed.setdefault(d.index, {"name": "", "arguments": ""})
            part["name"] += d.function.name or ""
            part["arguments"] += d.function.arguments or ""
    assert streamed == {0: {"name": "get_weather", "arguments": call.function.arguments}}
