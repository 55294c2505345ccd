"""logprobs, n > 1, penalties and logit_bias through the official `openai` client against a live
server backed by the fake worker (its tokens and logprobs are known: workers/fake_worker.py), so
the shapes, the rendering (tokens, bytes, text offsets), the stop-string cut, choices' indices,
usage, limits and cancellation are checked exactly. The numbers themselves against transformers:
tests/unit/test_logprobs.py and tests/integration/test_serve_features.py."""
from __future__ import annotations

import time

import httpx
import openai
import pytest

from gateway.settings import Settings
from gateway.text import ToyTokenizer
from tests.helpers import serving
from workers.fake_worker import fake_logprob, token_at

MODEL = "smollm2-135m"
TOK = ToyTokenizer()


@pytest.fixture(scope="module")
def server():
    with serving(Settings(fake_worker=True, fake_context=512, fake_step_ms=2.0),
                 {"main": ["sk-main"], "limited": ["sk-limited"], "narrow": ["sk-narrow"]},
                 tenant_options={"limited": {"tpm": 100}, "narrow": {"max_concurrent": 2}}) as (emb, url):
        yield emb, url


@pytest.fixture(scope="module")
def client(server):
    _, url = server
    return openai.OpenAI(base_url=url + "/v1", api_key="sk-main", max_retries=0, timeout=20)


def text_of(rid: str, n: int) -> str:
    return TOK.decode([token_at(rid, p) for p in range(n)], skip_special_tokens=True)


def wait_idle(emb, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while emb.step_loop.state.requests and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not emb.step_loop.state.requests, "requests left running"


def test_completion_logprobs_legacy_shape(client):
    r = client.completions.create(model=MODEL, prompt="Once upon", max_tokens=12, logprobs=3)
    choice, rid = r.choices[0], r.id
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 12
    assert "".join(lp.tokens) == choice.text
    for p, (tok, value, top, offset) in enumerate(zip(lp.tokens, lp.token_logprobs, lp.top_logprobs,
                                                      lp.text_offset)):
        want, want_top = fake_logprob(rid, p, 3)
        assert tok == TOK.decode([token_at(rid, p)]) and value == pytest.approx(want)
        assert top == {TOK.decode([t]): pytest.approx(v) for t, v in want_top}
        assert choice.text[offset:].startswith(tok)


def test_chat_logprobs_with_bytes_streamed_and_not(client):
    msgs = [{"role": "user", "content": "Hi"}]
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=10, logprobs=True,
                                       top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert "".join(c.token for c in content) == r.choices[0].message.content
    assert bytes(b for c in content for b in c.bytes) == r.choices[0].message.content.encode()
    assert all(len(c.top_logprobs) == 2 and c.top_logprobs[0].token == c.token for c in content)
    want = [fake_logprob(r.id, p, 2)[0] for p in range(10)]
    assert [c.logprob for c in content] == pytest.approx(want)

    chunks = list(client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=10,
                                                 logprobs=True, top_logprobs=2, stream=True))
    rid = chunks[0].id
    streamed = [c for ch in chunks for choice in ch.choices if choice.logprobs
                for c in choice.logprobs.content]
    text = "".join(choice.delta.content or "" for ch in chunks for choice in ch.choices)
    assert text == text_of(rid, 10) and "".join(c.token for c in streamed) == text
    assert [c.logprob for c in streamed] == pytest.approx([fake_logprob(rid, p, 2)[0] for p in range(10)])


def test_no_logprobs_unless_asked(client):
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                       max_tokens=3)
    assert r.choices[0].logprobs is None
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                       max_tokens=3, logprobs=True)
    assert all(c.top_logprobs == [] for c in r.choices[0].logprobs.content)


def test_a_stop_string_cuts_the_logprobs_with_the_text(client):
    # the fake worker's words are consonant-vowel(-consonant): "a" stops most texts mid-way
    # (the text depends on the request id, so try until one is cut after some text)
    for _ in range(20):
        r = client.completions.create(model=MODEL, prompt="cut here", max_tokens=12, logprobs=0,
                                      stop=["a"])
        text, lp = r.choices[0].text, r.choices[0].logprobs
        if r.choices[0].finish_reason == "stop" and text:
            break
    else:
        pytest.fail("no text was cut by the stop string: the test could not fail")
    full = text_of(r.id, 12)
    assert full.startswith(text) and len(full) > len(text) and "a" not in text
    # the tokens whose text starts before the cut, and no more
    assert 0 < len(lp.tokens) <= 12 and all(o < len(text) for o in lp.text_offset)
    assert "".join(lp.tokens).startswith(text) and len("".join(lp.tokens[:-1])) < len(text)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("kind", ["chat", "completions"])
def test_n_choices_usage_and_indices(client, kind, stream):
    kw = dict(model=MODEL, max_tokens=8, n=3, stream=stream)
    if stream:
        kw["stream_options"] = {"include_usage": True}
    if kind == "chat":
        r = client.chat.completions.create(messages=[{"role": "user", "content": "Hello"}], **kw)
    else:
        r = client.completions.create(prompt="Hello", **kw)
    if not stream:
        assert [c.index for c in r.choices] == [0, 1, 2]
        texts = [c.message.content if kind == "chat" else c.text for c in r.choices]
        usage = r.usage
        assert all(c.finish_reason == "length" for c in r.choices)
    else:
        chunks = list(r)
        texts = ["", "", ""]
        finished = set()
        for ch in chunks:
            for c in ch.choices:
                texts[c.index] += (c.delta.content or "") if kind == "chat" else c.text
                if c.finish_reason:
                    finished.add(c.index)
        assert finished == {0, 1, 2}
        usage = chunks[-1].usage
        assert chunks[-1].choices == [] and all(ch.usage is None for ch in chunks[:-1])
    assert len(set(texts)) == 3 and all(texts)            # each choice is its own request
    assert usage.completion_tokens == 3 * 8               # summed over the choices
    if kind == "completions":
        assert usage.prompt_tokens == len("Hello")        # the prompt once, not three times


def test_tpm_is_charged_for_every_choice(server):
    emb, url = server
    limited = openai.OpenAI(base_url=url + "/v1", api_key="sk-limited", max_retries=0, timeout=20)
    # 5 prompt tokens + 30: one choice fits a TPM of 100, three do not
    with pytest.raises(openai.RateLimitError):
        limited.completions.create(model=MODEL, prompt="Hello", max_tokens=30, n=3)
    wait_idle(emb)                                          # the admitted choices were closed


def test_a_choice_refused_closes_the_others(server):
    emb, url = server
    narrow = openai.OpenAI(base_url=url + "/v1", api_key="sk-narrow", max_retries=0, timeout=20)
    with pytest.raises(openai.RateLimitError):              # 3 choices, 2 concurrent allowed
        narrow.completions.create(model=MODEL, prompt="Hello", max_tokens=200, n=3)
    wait_idle(emb)
    r = narrow.completions.create(model=MODEL, prompt="Hello", max_tokens=5, n=2)
    assert len(r.choices) == 2


def test_a_disconnect_cancels_every_choice(server):
    emb, url = server
    loop = emb.step_loop
    submitted, cancelled = [], []
    submit, cancel = loop.submit, loop.cancel
    loop.submit = lambda req, sink=None: (submitted.append(req.request_id), submit(req, sink))[1]
    loop.cancel = lambda rid, **kw: (cancelled.append(rid), cancel(rid, **kw))[1]
    # no drafts: 400 tokens take 400 steps of the fake worker, far more than the test's few
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 400, "n": 4, "stream": True,
            "speculation": {"enabled": False}}
    try:
        with httpx.Client(base_url=url, headers={"Authorization": "Bearer sk-main"}, timeout=20) as http:
            with http.stream("POST", "/v1/completions", json=body) as r:
                assert r.status_code == 200
                next(r.iter_lines())
        wait_idle(emb)
    finally:
        loop.submit, loop.cancel = submit, cancel
    assert len(submitted) == 4 and set(cancelled) == set(submitted)


def test_logit_bias_and_penalties_reach_the_worker(server, client):
    emb, _ = server
    seen = []
    prefill = emb.step_loop.worker.prefill

    def spy(request_id, token_ids, **kw):
        seen.append(kw["sampling"])
        return prefill(request_id, token_ids, **kw)

    emb.step_loop.worker.prefill = spy
    try:
        client.completions.create(model=MODEL, prompt="x", max_tokens=2, presence_penalty=0.5,
                                  frequency_penalty=-1.25, logit_bias={"7": -100, "12": 3.5}, seed=9)
    finally:
        emb.step_loop.worker.prefill = prefill
    (s,) = seen
    assert (s.presence_penalty, s.frequency_penalty, s.logit_bias) == (0.5, -1.25, ((7, -100.0), (12, 3.5)))
