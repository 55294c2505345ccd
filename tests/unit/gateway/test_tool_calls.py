"""gateway/tool_calls.py as pure functions: request checks, the forced-call schema (checked with
jsonschema against calls that must pass and must fail), the fallback prompt rendering, output
parsing, and streamed deltas that assemble (as the official client's accumulator does) to exactly
the non-streamed answer however the text is split."""
from __future__ import annotations

import itertools
import json
import random

import jsonschema
import pytest
from openai.lib.streaming._deltas import accumulate_delta

from gateway import tool_calls
from gateway.text import ToyTokenizer

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"enum": ["c", "f"]}},
                   "required": ["city"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"tz": {"type": "string"}}, "required": ["tz"]}}}
TOOLS = [WEATHER, TIME]


def ids():
    counter = itertools.count()
    return lambda: f"call_{next(counter)}"


# ---- request checks ------------------------------------------------------------------------------
@pytest.mark.parametrize("tools_, choice, parallel, param", [
    (None, "auto", None, "tool_choice"),
    (None, "none", None, "tool_choice"),
    (None, {"type": "function", "function": {"name": "get_weather"}}, None, "tool_choice"),
    (None, None, True, "parallel_tool_calls"),
    (TOOLS, {"type": "function", "function": {"name": "nope"}}, None, "tool_choice"),
    ([WEATHER, TIME, WEATHER], None, None, "tools.2.function.name"),
])
def test_check_request_refuses(tools_, choice, parallel, param):
    with pytest.raises(tool_calls.ToolError) as e:
        tool_calls.check_request(tools_, choice, parallel)
    assert e.value.param == param


@pytest.mark.parametrize("choice", [None, "none", "auto", "required",
                                    {"type": "function", "function": {"name": "get_time"}}])
def test_check_request_accepts(choice):
    tool_calls.check_request(TOOLS, choice, False)
    tool_calls.check_request(None, None, None)


@pytest.mark.parametrize("tools_, choice, mode", [
    (None, None, None), (TOOLS, "none", None), (TOOLS, None, "auto"), (TOOLS, "auto", "auto"),
    (TOOLS, "required", "forced"),
    (TOOLS, {"type": "function", "function": {"name": "get_time"}}, "forced"),
])
def test_call_mode(tools_, choice, mode):
    assert tool_calls.call_mode(tools_, choice) == mode


# ---- the forced-call constraint ------------------------------------------------------------------------
def test_no_constraint_unless_a_call_is_forced():
    for choice in (None, "auto", "none"):
        assert tool_calls.forced_constraint(TOOLS, choice) is None
    assert tool_calls.forced_constraint(None, None) is None


def test_named_function_schema_admits_only_that_function_with_valid_arguments():
    c = json.loads(tool_calls.forced_constraint(TOOLS, {"type": "function",
                                                   "function": {"name": "get_weather"}}))
    assert c["type"] == "json_schema"
    check = jsonschema.Draft202012Validator(c["schema"])
    assert check.is_valid({"name": "get_weather", "arguments": {"city": "Oslo"}})
    assert check.is_valid({"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}})
    for bad in ({"name": "get_time", "arguments": {"tz": "UTC"}},
                {"name": "get_weather", "arguments": {}},                  # city required
                {"name": "get_weather", "arguments": {"city": "Oslo", "unit": "k"}},
                {"name": "get_weather", "arguments": {"city": "Oslo"}, "extra": 1},
                {"name": "get_weather"}, ["get_weather"]):
        assert not check.is_valid(bad), bad


def test_required_schema_admits_any_declared_function_with_its_own_arguments():
    check = jsonschema.Draft202012Validator(tool_calls.forced_schema(TOOLS, "required"))
    assert check.is_valid({"name": "get_weather", "arguments": {"city": "Oslo"}})
    assert check.is_valid({"name": "get_time", "arguments": {"tz": "UTC"}})
    assert not check.is_valid({"name": "get_time", "arguments": {"city": "Oslo"}})
    assert not check.is_valid({"name": "other", "arguments": {}})


def test_a_function_without_parameters_takes_an_object():
    bare = [{"type": "function", "function": {"name": "ping"}}]
    check = jsonschema.Draft202012Validator(tool_calls.forced_schema(bare, "required"))
    assert check.is_valid({"name": "ping", "arguments": {}})
    assert not check.is_valid({"name": "ping", "arguments": "x"})


# ---- the prompt (fallback format, on the toy tokenizer: "role: content" lines) -------------------------
TOY = ToyTokenizer()
CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Oslo and the time in Tokyo?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_a", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}},
        {"id": "call_b", "type": "function",
         "function": {"name": "get_time", "arguments": '{"tz": "Asia/Tokyo"}'}}]},
    {"role": "tool", "tool_call_id": "call_a", "content": "3C, snow"},
    {"role": "tool", "tool_call_id": "call_b", "content": "21:04"},
]


def test_a_stand_in_template_without_tools_gets_the_fallback():
    assert tool_calls.template_renders_tools(TOY) is False


def test_fallback_puts_tools_in_the_system_message_and_writes_back_calls_and_results():
    text = tool_calls.render_chat(TOY, CONVERSATION, TOOLS, "auto", None, native=False)
    lines = text.split("\n")
    assert lines[0] == "system: Be brief."                  # the client's system text comes first
    assert json.dumps(WEATHER) in lines and json.dumps(TIME) in lines
    assert text.count("system: ") == 1 and "<tool_call></tool_call>" in text
    turn = lines[lines.index("assistant: " + tool_calls.TOOL_OPEN):]        # the assistant's turn
    calls = [json.loads(turn[i + 1]) for i, ln in enumerate(turn) if ln.endswith(tool_calls.TOOL_OPEN)]
    assert {"name": "get_weather", "arguments": {"city": "Oslo"}} in calls
    assert {"name": "get_time", "arguments": {"tz": "Asia/Tokyo"}} in calls
    # both results in one user turn, in order, after the assistant's calls
    results = text[text.index("user: <tool_response>"):]
    assert results.index("3C, snow") < results.index("21:04")
    assert results.count("user: ") == 1 and text.endswith("assistant:")


def test_fallback_without_a_system_message_adds_one_and_none_leaves_tools_out():
    chat = [{"role": "user", "content": "hi"}]
    text = tool_calls.render_chat(TOY, chat, TOOLS, None, None, native=False)
    assert text.startswith("system: # Tools") and "get_time" in text
    assert tool_calls.render_chat(TOY, chat, TOOLS, "none", None, native=False) == "user: hi\nassistant:"


def test_fallback_states_the_choice():
    chat = [{"role": "user", "content": "hi"}]
    named = tool_calls.render_chat(TOY, chat, TOOLS, {"type": "function",
                                                 "function": {"name": "get_time"}}, None, native=False)
    assert "You must call the function 'get_time'" in named and "<tool_call></tool_call>" not in named
    one = tool_calls.render_chat(TOY, chat, TOOLS, "auto", False, native=False)
    assert "at most one function" in one
    assert "at most one function" not in tool_calls.render_chat(TOY, chat, TOOLS, "auto", True, native=False)


# ---- the output ---------------------------------------------------------------------------------------------
def call(name, args):
    return f'{tool_calls.TOOL_OPEN}\n{json.dumps({"name": name, "arguments": args})}\n{tool_calls.TOOL_CLOSE}'


W = call("get_weather", {"city": "Oslo"})
T = call("get_time", {"tz": "UTC"})
OUTPUTS = [                           # (output, mode, parallel, content, [(name, arguments)])
    ("Just text.", "auto", True, "Just text.", []),
    ("  spaced \n", "auto", True, "  spaced \n", []),
    (W, "auto", True, None, [("get_weather", '{"city": "Oslo"}')]),
    ("\n" + W + "\n" + T + "\n", "auto", True, None,
     [("get_weather", '{"city": "Oslo"}'), ("get_time", '{"tz": "UTC"}')]),
    ("Let me check.\n" + W, "auto", True, "Let me check.", [("get_weather", '{"city": "Oslo"}')]),
    ("A " + W + " B", "auto", True, "A  B", [("get_weather", '{"city": "Oslo"}')]),
    (W + T, "auto", False, None, [("get_weather", '{"city": "Oslo"}')]),     # first call only
    ("<tool_call>{not json}</tool_call>", "auto", True, "<tool_call>{not json}</tool_call>", []),
    (call("unknown_fn", {}), "auto", True, call("unknown_fn", {}), []),
    ('<tool_call>{"name": "get_time", "arguments": "{\\"tz\\": \\"UTC\\"}"}</tool_call>', "auto",
     True, None, [("get_time", '{"tz": "UTC"}')]),                             # arguments as text
    ('<tool_call>{"name": "get_time", "arguments": {"tz"', "auto", True,       # cut short
     '<tool_call>{"name": "get_time", "arguments": {"tz"', []),
    ('<tool_call>{"name": "get_time", "arguments": {}}', "auto", True, None,   # whole, unclosed
     [("get_time", "{}")]),
    ("a < b <tool", "auto", True, "a < b <tool", []),                          # a tag's start
    ('{"name": "get_time", "arguments": {"tz": "UTC"}}', "forced", True, None,
     [("get_time", '{"tz": "UTC"}')]),
    (T, "forced", True, None, [("get_time", '{"tz": "UTC"}')]),
    ("I cannot.", "forced", True, "I cannot.", []),
]


@pytest.mark.parametrize("text, mode, parallel, content, calls", OUTPUTS)
def test_parse_output(text, mode, parallel, content, calls):
    got_content, got = tool_calls.parse_output(text, TOOLS, mode, parallel=parallel, new_id=ids())
    assert got_content == content
    assert [(c.name, c.arguments) for c in got] == calls
    assert [c.id for c in got] == [f"call_{i}" for i in range(len(calls))]


def assemble(deltas: list[dict]) -> dict:
    """The message the official client's stream accumulator builds from these deltas."""
    acc: dict = {"role": "assistant", "content": ""}
    for d in deltas:
        acc = accumulate_delta(acc, d)
    return acc


@pytest.mark.parametrize("text, mode, parallel, content, calls", OUTPUTS)
def test_streamed_deltas_assemble_to_the_whole_answer_however_split(text, mode, parallel,
                                                                     content, calls):
    rng = random.Random(len(text))
    splits = [[text], list(text)] + [
        [text[a:b] for a, b in itertools.pairwise([0, *sorted(rng.sample(range(1, len(text)),
                                                                          k)), len(text)])]
        for k in (1, 3, 7) if len(text) > k]
    for pieces in splits:
        p = tool_calls.ToolStreamParser(TOOLS, mode, parallel=parallel, new_id=ids())
        deltas = [d for piece in pieces for d in p.push(piece)] + p.finish()
        msg = assemble(deltas)
        assert (msg["content"] or None) == (content or None), pieces
        got = [(c["function"]["name"], c["function"]["arguments"]) for c in msg.get("tool_calls", [])]
        assert got == calls, pieces
        for c, i in zip(msg.get("tool_calls", []), itertools.count()):
            assert (c["index"], c["id"], c["type"]) == (i, f"call_{i}", "function")
        for d in deltas:                         # each call: its name first, then its arguments
            for tc in d.get("tool_calls", []):
                assert ("id" in tc) == ("name" in tc["function"])


def test_call_ids_are_random_and_openai_shaped():
    a = tool_calls.parse_output(W, TOOLS, "auto")[1][0].id
    b = tool_calls.parse_output(W, TOOLS, "auto")[1][0].id
    assert a != b and a.startswith("call_") and len(a) > 10


def test_doctests():
    import doctest

    result = doctest.testmod(tool_calls)
    assert result.failed == 0 and result.attempted >= 3
