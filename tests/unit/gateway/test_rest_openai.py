"""The official `openai` client against a live server on loopback (uvicorn on a thread), backed by
the fake worker: completions and chat, streamed and not, usage, finish_reason, include_usage,
`[DONE]`, stop strings, the specgate extensions, and /v1/models."""
from __future__ import annotations

import httpx
import openai
import pytest

from gateway.http.server import background_server

from gateway.builders.embedded import build_embedded
from gateway.settings import Settings
from gateway.text import ToyTokenizer
from workers.fake_worker import token_at

MODEL = "smollm2-135m"
TOK = ToyTokenizer()


@pytest.fixture(scope="module")
def server():
    emb = build_embedded(Settings(fake_worker=True, fake_context=512))
    emb.start()
    with background_server(emb.app) as url:
        yield emb, url
    emb.stop()


@pytest.fixture(scope="module")
def client(server):
    emb, url = server
    return openai.OpenAI(base_url=url + "/v1", api_key=emb.dev_key, max_retries=0, timeout=10)


def truth(rid: str, n: int) -> str:
    return TOK.decode([token_at(rid, p) for p in range(n)], skip_special_tokens=True)


def test_completion(client):
    r = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=16)
    choice = r.choices[0]
    assert r.object == "text_completion" and r.model == MODEL and r.id.startswith("cmpl-")
    assert choice.finish_reason == "length"
    assert choice.text == truth(r.id, 16)                  # the fake worker's tokens, decoded
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (16, 16, 32)
    spec = r.model_extra["specgate"]
    assert spec["steps"] >= 1 and spec["accepted"] <= spec["drafted"]
    assert spec["tau"] == pytest.approx(16 / spec["steps"], abs=1e-3)


def test_chat_completion(client):
    r = client.chat.completions.create(model=MODEL, max_completion_tokens=9,
                                       messages=[{"role": "system", "content": "Be brief."},
                                                 {"role": "user", "content": "Hi!"}])
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    msg = r.choices[0].message
    assert msg.role == "assistant" and msg.content == truth(r.id, 9)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 9


def test_streamed_completion_with_usage(client):
    chunks = list(client.completions.create(model=MODEL, prompt="Stream me", max_tokens=20,
                                            stream=True, stream_options={"include_usage": True}))
    text_chunks, final, usage_chunk = chunks[:-2], chunks[-2], chunks[-1]
    rid = final.id
    assert all(c.id == rid for c in chunks)
    assert "".join(c.choices[0].text for c in text_chunks) == truth(rid, 20)
    assert all(c.choices[0].finish_reason is None and c.usage is None for c in text_chunks)
    assert final.choices[0].finish_reason == "length" and final.model_extra["specgate"]["steps"] >= 1
    assert usage_chunk.choices == [] and usage_chunk.usage.completion_tokens == 20
    assert usage_chunk.usage.prompt_tokens == len("Stream me")


def test_streamed_chat_without_usage(client):
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hello"}], max_tokens=12, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices[0].finish_reason == "length"
    assert all(c.usage is None for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text == truth(chunks[0].id, 12)


def test_the_stream_ends_with_done(server):
    emb, url = server
    with httpx.stream("POST", url + "/v1/chat/completions", timeout=10,
                      headers={"Authorization": f"Bearer {emb.dev_key}"},
                      json={"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                            "max_tokens": 5, "stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert events[-1] == "data: [DONE]"
    # each event's data, the chunks' after an id line (resumable: gateway/http/chat_stream.py)
    assert all(e.startswith("data: ") for e in events[1::2])
    assert [e.split(": ")[0] for e in events[:-1:2]] == ["id"] * (len(events) // 2)


@pytest.mark.parametrize("stream", [False, True])
def test_stop_strings_are_never_emitted(client, server, stream):
    emb, _ = server
    # Pin the request id, so the fake worker's text is known in advance.
    rid = f"cmpl-pinned-{stream}"
    full = truth(rid, 30)
    stop = full[5:12]                                  # spans tokens
    assert full.find(stop) == 5
    original, emb.service.preparer.request_id = emb.service.preparer.request_id, lambda kind: rid
    try:
        if stream:
            chunks = list(client.completions.create(model=MODEL, prompt="abc", max_tokens=30,
                                                    stop=[stop, "zzz"], stream=True))
            text = "".join(c.choices[0].text for c in chunks)
            reason = chunks[-1].choices[0].finish_reason
        else:
            r = client.completions.create(model=MODEL, prompt="abc", max_tokens=30, stop=stop)
            text, reason = r.choices[0].text, r.choices[0].finish_reason
    finally:
        emb.service.preparer.request_id = original
    assert text == full[:5] and reason == "stop"


def test_speculation_switch_and_budget_extensions(client, server):
    emb, _ = server
    r = client.completions.create(model=MODEL, prompt="no speculation", max_tokens=10,
                                  extra_body={"speculation": {"enabled": False}})
    spec = r.model_extra["specgate"]
    assert spec["drafted"] == 0 and spec["accepted"] == 0 and spec["steps"] == 10
    assert spec["tau"] == 1.0
    r = client.completions.create(model=MODEL, prompt="small trees", max_tokens=10,
                                  extra_body={"speculation": {"max_tree_tokens": 1}})
    spec = r.model_extra["specgate"]
    assert spec["drafted"] <= spec["steps"]            # at most one node per step


def test_models_lists_what_the_key_may_use(client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")


def test_client_errors_surface_as_openai_exceptions(client, server):
    emb, url = server
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="gpt-4", prompt="x", max_tokens=1)
    assert e.value.body["code"] == "model_not_found" and e.value.body["param"] == "model"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="x", n=9)      # past max_choices
    assert e.value.body["param"] == "n"
    bad = openai.OpenAI(base_url=url + "/v1", api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model=MODEL, prompt="x", max_tokens=1)
