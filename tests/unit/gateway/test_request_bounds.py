"""Every request's work bounded before it starts: the one measure (gateway/service/sizes.py)
against the caps before any templating, tokenizing or compiling, over a real step loop and the
fake worker; all of that work off the event loop; a chat template's refusal as the client's 400.
The tokenizers here are the toy tokenizer watched (how often, and on which thread, it is asked to
render or tokenize) and the default model's own, given a template that refuses some messages."""
from __future__ import annotations

import asyncio
import json
import threading

import pytest

from gateway.errors import ApiError
from gateway.service import GenerateInput
from gateway.service.sizes import MAX_SCHEMA_CHARS, RequestSize, measure
from gateway.tenancy.records import Tenant
from gateway.text import ToyTokenizer
from tests.unit.gateway.test_service import Rig, inp

FILLER = "the tool reads the ledger, checks each entry twice and reports what it found. "


class WatchedTokenizer(ToyTokenizer):
    """The toy tokenizer, noting each call to render a template or to tokenize, and its thread."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, int]] = []

    def __call__(self, text, add_special_tokens=True):
        self.calls.append(("tokenize", threading.get_ident()))
        return super().__call__(text, add_special_tokens)

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=False):
        self.calls.append(("render", threading.get_ident()))
        return super().apply_chat_template(messages, add_generation_prompt, tokenize)


def tools_bomb(count: int = 28, chars: int = 60_000) -> tuple[dict, ...]:
    """`count` function tools with `chars`-character descriptions (28 × 60 000: about 1.6 MiB,
    under the default 2 MiB body cap)."""
    return tuple({"type": "function", "function": {
        "name": f"lookup_{i}", "description": (FILLER * (chars // len(FILLER) + 1))[:chars],
        "parameters": {"type": "object", "properties": {"query": {"type": "string"}}}}}
        for i in range(count))


def chat(tenant=None, **kw) -> GenerateInput:
    kw.setdefault("messages", [{"role": "user", "content": "Look up entry 7."}])
    return inp(tenant, prompt=None, **kw)


def refusal(rig: Rig, i: GenerateInput) -> ApiError:
    with pytest.raises(ApiError) as err:
        asyncio.run(rig.service.generate(i))
    assert not rig.loop.state.requests
    return err.value


# ---- the measure ---------------------------------------------------------------------------------
def test_the_measure_counts_every_part_that_reaches_the_prompt():
    tools = ({"type": "function", "function": {"name": "f", "description": "d" * 10,
                                               "parameters": {"type": "object"}}},)
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"q": 1}'}}
    messages = [{"role": "user", "content": "x" * 100},
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": "y" * 50}]
    size = measure(chat(messages=messages, tools=tools))
    assert (size.field, size.text, size.tool_calls) == ("messages", 150, 1 + 8)
    assert size.tools == 1 + 10 + len('{"type":"object"}')
    assert size.prompt_chars == 150 + 9 + size.tools and size.heaviest == "messages"
    # tool_choice "none": the template writes no tools, so none are counted as prompt text
    assert measure(chat(messages=messages, tools=tools, tool_choice="none")).tools == 0
    assert measure(inp(prompt=None, prompt_ids=(1, 2, 3))).token_ids == 3
    forced = measure(chat(tools=tools, tool_choice="required"))
    assert (forced.schema, forced.schema_param) == (len('{"type":"object"}'), "tools")
    assert measure(chat(constraint='{"type": "json_object"}')).schema == 23
    assert RequestSize("messages", 10, tools=11).heaviest == "tools"


# ---- refused before work -------------------------------------------------------------------------
def test_tools_too_large_for_the_context_are_refused_without_rendering_or_tokenizing():
    tok = WatchedTokenizer()
    rig = Rig(context=4096, tokenizer=tok)
    try:
        err = refusal(rig, chat(tools=tools_bomb(count=2, chars=3000)))
        assert (err.status, err.code, err.param) == (413, "context_length_exceeded", "tools")
        assert "tool definitions" in err.message
        err = refusal(rig, chat(Tenant("capped", max_prompt_tokens=500), tools=tools_bomb(1, 600)))
        assert (err.status, err.code, err.param) == (413, "max_prompt_tokens_exceeded", "tools")
        calls = [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "a" * 5000}}]
        err = refusal(rig, chat(messages=[{"role": "user", "content": "hi"},
                                          {"role": "assistant", "content": None, "tool_calls": calls}]))
        assert (err.status, err.code, err.param) == (413, "context_length_exceeded", "messages")
        assert tok.calls == []                              # nothing rendered, nothing tokenized
    finally:
        rig.close()


def test_token_ids_beyond_the_context_are_refused_before_any_is_validated():
    rig = Rig(context=256)
    try:
        # an id outside the vocabulary at the start: validating first would say 400 prompt.0
        err = refusal(rig, inp(prompt=None, prompt_ids=(10**6,) + (5,) * 300))
        assert (err.status, err.code, err.param) == (413, "context_length_exceeded", "prompt")
        err = refusal(rig, inp(Tenant("capped", max_prompt_tokens=10), prompt=None,
                               prompt_ids=(10**6,) + (5,) * 20))
        assert (err.status, err.code) == (413, "max_prompt_tokens_exceeded")
        err = refusal(rig, inp(prompt=None, prompt_ids=(10**6,) + (5,) * 20))
        assert (err.status, err.param) == (400, "prompt.0")       # within the caps: validated
    finally:
        rig.close()


def test_a_schema_over_the_cap_is_refused_before_it_is_compiled():
    rig = Rig(context=100_000)
    try:
        big = {"type": "object", "description": "z" * MAX_SCHEMA_CHARS}
        err = refusal(rig, chat(constraint=json.dumps({"type": "json_schema", "schema": big})))
        assert (err.status, err.code, err.param) == (413, "schema_too_large", "response_format")
        tool = {"type": "function", "function": {"name": "f", "parameters": big}}
        err = refusal(rig, chat(tools=(tool,), tool_choice="required"))
        assert (err.status, err.code, err.param) == (413, "schema_too_large", "tools")
    finally:
        rig.close()


# ---- off the event loop ------------------------------------------------------------------------------
def test_a_large_tools_payload_is_rendered_and_tokenized_off_the_event_loop():
    """A short message with 1.6 MiB of tools (a context that holds them): the template and the
    tokenizer run on a worker thread, never on the event loop's."""
    tok = WatchedTokenizer()
    rig = Rig(context=2_000_000, tokenizer=tok)
    try:
        async def go() -> tuple[int, object]:
            return threading.get_ident(), await rig.service.generate(chat(tools=tools_bomb(),
                                                                          max_tokens=1))

        loop_thread, out = asyncio.run(go())
        assert out.prompt_tokens > 1_600_000
        assert {kind for kind, _ in tok.calls} == {"render", "tokenize"}
        assert all(thread != loop_thread for _, thread in tok.calls)
    finally:
        rig.close()


# ---- a template's refusal --------------------------------------------------------------------------
# The shape of many chat templates' guard (Mistral's, Llama 2's): roles must alternate.
ALTERNATING = ("{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
               "{{ raise_exception('Conversation roles must alternate user/assistant/user/"
               "assistant/...') }}{% endif %}{{ m['role'] + ': ' + m['content'] + '\n' }}"
               "{% endfor %}{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}")


@pytest.fixture(scope="module")
def strict_tokenizer():
    """The default model's tokenizer with a template that refuses roles out of turn."""
    from workers.model.loader import load_tokenizer, resolve_model

    tok = load_tokenizer(str(resolve_model(progress=False)), progress=False)
    tok.chat_template = ALTERNATING
    return tok


def test_a_template_that_refuses_the_messages_is_a_400_in_our_words(strict_tokenizer):
    rig = Rig(context=4096, tokenizer=strict_tokenizer)
    twice = [{"role": "user", "content": "one"}, {"role": "user", "content": "two"}]
    try:
        for i in (chat(messages=twice),                                    # no tools
                  chat(messages=twice, tools=tools_bomb(count=1, chars=20))):   # with tools
            err = refusal(rig, i)
            assert (err.status, err.code, err.param) == (400, "invalid_value", "messages")
            assert "chat template cannot render" in err.message
            assert "raise_exception" not in err.message and "alternate" not in err.message
        out = asyncio.run(rig.service.generate(chat(max_tokens=3)))
        assert out.completion_tokens == 3
    finally:
        rig.close()

