"""Tools on the real default model (SmolLM2-135M-Instruct), through its real tokenizer and chat
template and the official `openai` client on a live loopback server.

The model is tiny and may or may not call a tool on its own, so nothing here assumes what it
says: greedy output through the API is compared with transformers' greedy `generate` on the
prompt the tool_calls module renders, read by the same parser; the parser itself is checked on calls
written through the real template and tokenizer, token by token; and a template that does
render tools (set on a copy of the real tokenizer) goes through the native path."""
from __future__ import annotations

import copy
import json

import openai
import pytest
from openai.lib.streaming._deltas import accumulate_delta

from gateway import schemas, tool_calls
from gateway.text import IncrementalDetokenizer
from gateway.settings import Settings
from tests.helpers import hf_greedy, openai_client_on

pytestmark = pytest.mark.slow
MODEL = "smollm2-135m"
MAX_NEW = 40
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city", "strict": True,
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"], "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What is the weather in Paris right now?"}]
CALL = {"id": "call_abc", "type": "function",
        "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris"})}}
FOLLOW_UP = ASK + [{"role": "assistant", "content": None, "tool_calls": [CALL]},
                   {"role": "tool", "tool_call_id": "call_abc", "content": "18C and sunny"}]


@pytest.fixture(scope="module")
def served(real_runtime):
    with openai_client_on(real_runtime, Settings(max_batch=4)) as served:
        yield served


def test_smollm2s_template_renders_no_tools_so_the_fallback_serves(real_runtime, served):
    emb, _ = served
    assert tool_calls.template_renders_tools(real_runtime.tokenizer) is False
    assert emb.service.template_tools is False


def test_calls_written_through_the_real_template_parse_back_token_by_token(real_runtime):
    """The fallback's own rendering of an assistant turn with two calls, tokenized by the real
    tokenizer and detokenized one token at a time into the stream parser, gives both calls."""
    tok = real_runtime.tokenizer
    second = {"id": "call_def", "type": "function",
              "function": {"name": "get_weather", "arguments": json.dumps({"city": "Café Zürich"})}}
    chat = ASK + [{"role": "assistant", "content": "Let me look.", "tool_calls": [CALL, second]}]
    text = tool_calls.render_chat(tok, chat, [WEATHER], "auto", None, native=False)
    head = "<|im_start|>assistant\n"
    turn = text.split(head)[-2].split("<|im_end|>")[0]       # the last is the generation prompt
    ids = tok(turn, add_special_tokens=False)["input_ids"]
    detok = IncrementalDetokenizer(tok)
    parser = tool_calls.ToolStreamParser([WEATHER], "auto")
    for i in ids:
        parser.push(detok.push([i]))
    parser.push(detok.flush())
    parser.finish()
    assert parser.content == "Let me look."
    assert [(c.name, json.loads(c.arguments)) for c in parser.calls] == [
        ("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Café Zürich"})]


def expected(real_runtime, messages, tool_choice="auto"):
    """(prompt ids, content, [(name, arguments)], finish_reason) transformers' greedy output on
    the prompt the tool_calls module renders, read by the same parser."""
    rt = real_runtime
    shown = [schemas.ToolDef.model_validate(WEATHER).model_dump(exclude_none=True)]  # as served
    text = tool_calls.render_chat(rt.tokenizer, messages, shown, tool_choice, None, native=False)
    ids = rt.tokenizer(text, add_special_tokens=False)["input_ids"]
    ref = hf_greedy(rt.hf_model, ids, MAX_NEW, eos=sorted(rt.stop_token_ids))
    out = rt.tokenizer.decode(ref, skip_special_tokens=True)
    content, calls = tool_calls.parse_output(out, [WEATHER], tool_calls.call_mode([WEATHER], tool_choice))
    reason = "stop" if ref and ref[-1] in rt.stop_token_ids else "length"
    reason = "tool_calls" if calls and reason == "stop" else reason
    return ids, content, [(c.name, c.arguments) for c in calls], reason


@pytest.mark.parametrize("messages", [ASK, FOLLOW_UP], ids=["ask", "after_a_tool_result"])
def test_greedy_with_tools_is_transformers_greedy_read_by_the_parser(served, real_runtime,
                                                                     messages):
    _, client = served
    ids, content, calls, reason = expected(real_runtime, messages)
    r = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER],
                                       tool_choice="auto", temperature=0, max_tokens=MAX_NEW)
    msg = r.choices[0].message
    assert r.usage.prompt_tokens == len(ids)           # the tools reached the prompt
    assert msg.content == content and r.choices[0].finish_reason == reason
    assert [(c.function.name, c.function.arguments) for c in msg.tool_calls or []] == calls

    # streamed: assembled by the official client's own delta accumulator (its `.stream()`
    # helper refuses to finish a completion cut by max_tokens, which the tiny model often is)
    msg: dict = {}
    reasons = []
    for chunk in client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER],
                                                temperature=0, max_tokens=MAX_NEW, stream=True):
        msg = accumulate_delta(msg, chunk.choices[0].delta.to_dict())
        reasons.append(chunk.choices[0].finish_reason)
    assert (msg.get("content") or None) == (content or None) and reasons[-1] == reason
    assert [(c["function"]["name"], c["function"]["arguments"])
            for c in msg.get("tool_calls", [])] == calls


def test_misuse_on_the_real_model_is_a_400(served, real_runtime):
    emb, client = served
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=ASK, tool_choice="auto")
    assert e.value.body["param"] == "tool_choice"
    context = emb.step_loop.worker.context_limit
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=context)
    assert (e.value.body["code"], e.value.body["param"]) == ("context_length_exceeded", "max_tokens")


NATIVE = (
    "{% if tools %}<|im_start|>system\nTOOLS:{% for t in tools %} {{ t.function.name }}"
    "{% endfor %}<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{% for c in m.tool_calls or [] %}CALL {{ c.function.name }} {{ c.function.arguments | tojson }}"
    "{% endfor %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_a_template_that_renders_tools_gets_them_and_the_calls_natively(real_runtime):
    tok = copy.deepcopy(real_runtime.tokenizer)
    tok.chat_template = NATIVE
    assert tool_calls.template_renders_tools(tok) is True
    text = tool_calls.render_chat(tok, FOLLOW_UP, [WEATHER], "auto", None, native=True)
    assert "TOOLS: get_weather" in text
    assert 'CALL get_weather {"city": "Paris"}' in text      # arguments as an object
    assert "<|im_start|>tool\n18C and sunny" in text
    assert "# Tools" not in text                             # not the fallback
