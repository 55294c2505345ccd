"""Tools through the official `openai` client against a live server (uvicorn on a thread), on a
fake worker that commits a scripted text: the tools reach the prompt, a tagged call comes back as
`message.tool_calls` with `finish_reason: "tool_calls"`, streamed (assembled by the client's own
stream helper) and not, a forced choice carries its constraint to the engine, the conversation
goes on with the call and its result, and every misuse is an OpenAI-shaped 400."""
from __future__ import annotations

import dataclasses
import json

import openai
import pytest

from gateway import tool_calls
from gateway.assembly.target import Target
from gateway.builders.embedded import build_embedded
from gateway.http.server import background_server
from gateway.settings import Settings
from gateway.text import ToyTokenizer
from workers.fake_worker import PacedFakeWorker

MODEL = "smollm2-135m"
TOK = ToyTokenizer()
EOS = TOK.eos_token_id
CONTEXT = 4096

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city", "strict": True,
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "strict": True,
    "parameters": {"type": "object", "properties": {"tz": {"type": "string"}},
                   "required": ["tz"], "additionalProperties": False}}}
ASK = [{"role": "user", "content": "Weather in Oslo?"}]


class ScriptedWorker(PacedFakeWorker):
    """The fake worker, committing `script` (then eos) instead of its own tokens, and keeping
    each request's prompt and sampling params as they reached the worker."""

    def __init__(self, **kw):
        super().__init__(0.0, context_limit=CONTEXT, **kw)
        self.script: list[int] = []
        self.prompts: dict[str, list[int]] = {}
        self.sampling: dict[str, object] = {}

    def prefill(self, request_id, token_ids, *args, **kw):
        self.prompts[request_id] = list(token_ids)
        self.sampling[request_id] = kw.get("sampling")
        return super().prefill(request_id, token_ids, *args, **kw)

    def step(self, items):
        out = []
        for r in super().step(items):
            if r.tokens:
                start = self._resident[r.request_id].output_len - len(r.tokens)
                script = self.script + [EOS]
                r = dataclasses.replace(r, tokens=tuple(
                    script[min(start + k, len(script) - 1)] for k in range(len(r.tokens))))
            out.append(r)
        return out


@pytest.fixture(scope="module")
def server():
    worker = ScriptedWorker()
    emb = build_embedded(Settings(fake_worker=True), target=Target(TOK, worker, frozenset({EOS})))
    emb.start()
    with background_server(emb.app) as url:
        yield emb, worker, url
    emb.stop()


@pytest.fixture(scope="module")
def client(server):
    emb, _, url = server
    # the first forced call starts the gateway's grammar compile processes (seconds, under load)
    return openai.OpenAI(base_url=url + "/v1", api_key=emb.dev_key, max_retries=0, timeout=60)


def say(worker: ScriptedWorker, text: str) -> None:
    worker.script = TOK.encode(text)


def tagged(name: str, args: dict) -> str:
    return f"{tool_calls.TOOL_OPEN}\n{json.dumps({'name': name, 'arguments': args})}\n{tool_calls.TOOL_CLOSE}"


def prompt_of(worker: ScriptedWorker, rid: str) -> str:
    return TOK.decode(worker.prompts[rid])


def shown_tools(prompt: str) -> list[dict]:
    """The tool definitions the fallback wrote into the prompt, one JSON object a line."""
    lines = prompt.split("\n")
    return [json.loads(ln) for ln in lines[lines.index("<tools>") + 1:lines.index("</tools>")]]


def test_auto_call_round_trip(client, server):
    _, worker, _ = server
    say(worker, tagged("get_weather", {"city": "Oslo"}))
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, TIME])
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Oslo"}
    prompt = prompt_of(worker, r.id)
    assert shown_tools(prompt) == [WEATHER, TIME]
    assert worker.sampling[r.id].constraint is None                 # auto: nothing forced

    # the conversation goes on: the call (content null) and its result, through the template
    say(worker, "It is 3C in Oslo.")
    history = ASK + [choice.message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": "3C, snow"}]
    r2 = client.chat.completions.create(model=MODEL, messages=history, tools=[WEATHER, TIME])
    assert r2.choices[0].message.content == "It is 3C in Oslo."
    assert r2.choices[0].finish_reason == "stop" and not r2.choices[0].message.tool_calls
    prompt = prompt_of(worker, r2.id)
    assert '{"name": "get_weather", "arguments": {"city": "Oslo"}}' in prompt
    assert "<tool_response>\n3C, snow\n</tool_response>" in prompt


def test_text_and_two_calls_streamed_through_the_clients_stream_helper(client, server):
    _, worker, _ = server
    say(worker, "Checking.\n" + tagged("get_weather", {"city": "Oslo"}) + "\n"
        + tagged("get_time", {"tz": "Europe/Oslo"}))
    with client.chat.completions.stream(model=MODEL, messages=ASK, tools=[WEATHER, TIME]) as s:
        events = list(s)
        done = s.get_final_completion()
    choice = done.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Checking."
    calls = choice.message.tool_calls
    assert [(c.function.name, c.function.parsed_arguments) for c in calls] == [
        ("get_weather", {"city": "Oslo"}), ("get_time", {"tz": "Europe/Oslo"})]
    assert len({c.id for c in calls}) == 2
    done_names = [e.name for e in events if e.type == "tool_calls.function.arguments.done"]
    assert done_names == ["get_weather", "get_time"]
    # the same text, not streamed, gives the same message (ids aside)
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, TIME])
    assert r.choices[0].message.content == "Checking."
    assert [(c.function.name, c.function.arguments) for c in r.choices[0].message.tool_calls] == [
        (c.function.name, c.function.arguments) for c in calls]


def test_streamed_chunks_carry_name_first_then_arguments(client, server):
    _, worker, _ = server
    say(worker, tagged("get_time", {"tz": "UTC"}))
    chunks = list(client.chat.completions.create(model=MODEL, messages=ASK, tools=[TIME],
                                                 stream=True))
    deltas = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or [])]
    assert deltas[0].index == 0 and deltas[0].id.startswith("call_")
    assert deltas[0].function.name == "get_time"
    assert json.loads("".join(d.function.arguments or "" for d in deltas)) == {"tz": "UTC"}
    assert all(d.id is None and d.function.name is None for d in deltas[1:])
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_parallel_tool_calls_false_keeps_the_first_call(client, server):
    _, worker, _ = server
    say(worker, tagged("get_weather", {"city": "Oslo"}) + tagged("get_time", {"tz": "UTC"}))
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, TIME],
                                       parallel_tool_calls=False)
    assert [c.function.name for c in r.choices[0].message.tool_calls] == ["get_weather"]
    assert "at most one function" in prompt_of(worker, r.id)


def test_tool_choice_none_reads_no_calls_and_shows_no_tools(client, server):
    _, worker, _ = server
    text = tagged("get_weather", {"city": "Oslo"})
    say(worker, text)
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER],
                                       tool_choice="none")
    assert r.choices[0].message.content == text and r.choices[0].message.tool_calls is None
    assert r.choices[0].finish_reason == "stop"
    assert "get_weather" not in prompt_of(worker, r.id)


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_a_forced_call_sends_its_schema_to_the_engine(client, server, choice):
    _, worker, _ = server
    say(worker, json.dumps({"name": "get_time", "arguments": {"tz": "UTC"}}))
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, TIME],
                                       tool_choice=choice)
    (call,) = r.choices[0].message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_time", {"tz": "UTC"})
    assert r.choices[0].finish_reason == "tool_calls"
    sent = worker.sampling[r.id].constraint
    assert sent == tool_calls.forced_constraint([WEATHER, TIME], choice)
    assert json.loads(sent)["type"] == "json_schema"


def test_a_call_cut_short_by_max_tokens_is_text_and_length(client, server):
    _, worker, _ = server
    text = tagged("get_weather", {"city": "Oslo"})
    say(worker, text)
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], max_tokens=20)
    assert r.choices[0].finish_reason == "length" and r.choices[0].message.tool_calls is None
    assert r.choices[0].message.content == text[:20]


BAD = [
    ({"tool_choice": "auto"}, "tool_choice"),
    ({"tool_choice": {"type": "function", "function": {"name": "get_weather"}}}, "tool_choice"),
    ({"parallel_tool_calls": True}, "parallel_tool_calls"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [WEATHER, WEATHER]}, "tools.1.function.name"),
    ({"tools": []}, "tools"),
    ({"tools": [{"type": "retrieval"}]}, "tools.0.type"),
    ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools.0.function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]},
     "tools.0.function.parameters"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages.0.tool_call_id"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]},
     "messages.0.tool_calls"),
    ({"messages": [{"role": "assistant", "content": None}]}, "messages.0.content"),
]


@pytest.mark.parametrize("extra, param", BAD)
def test_misuse_is_an_openai_shaped_400(client, extra, param):
    body = {"model": MODEL, "messages": ASK, **extra}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(**body)
    err = e.value.body
    assert e.value.status_code == 400 and err["type"] == "invalid_request_error"
    assert err["param"] == param and err["message"] and "Traceback" not in err["message"]


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens"])
def test_max_tokens_past_the_context_is_context_length_exceeded(client, field):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=ASK, **{field: CONTEXT})
    err = e.value.body
    assert (err["code"], err["type"], err["param"]) == ("context_length_exceeded",
                                                        "invalid_request_error", "max_tokens")
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="abc", max_tokens=CONTEXT - 2)
    assert e.value.body["code"] == "context_length_exceeded"
    r = client.completions.create(model=MODEL, prompt="abc", max_tokens=CONTEXT - 3)
    assert r.usage.prompt_tokens + r.usage.completion_tokens <= CONTEXT
