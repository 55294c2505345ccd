"""Fuzz both generation endpoints over real HTTP with random bodies (hypothesis): never a 5xx,
and every 4xx is an OpenAI error object. Bodies range from random bytes and random JSON to
requests with the real fields holding random values (the inputs most likely to reach deep code)."""
from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.http.server import background_server

from gateway.builders.embedded import build_embedded
from gateway.settings import Settings

MODEL = "smollm2-135m"

scalars = st.one_of(st.none(), st.booleans(), st.integers(), st.integers(-10, 10),
                    st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=20))
json_values = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)),
    max_leaves=12)
messages = st.lists(st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant", "developer", "tool", 3]),
     "content": st.one_of(st.text(max_size=30), json_values)}), max_size=3)
FIELDS = {
    "model": st.one_of(st.just(MODEL), json_values),
    "prompt": st.one_of(st.text(max_size=40), st.lists(st.integers(-5, 1200), max_size=5),
                        st.lists(st.text(max_size=5), max_size=2), json_values),
    "messages": st.one_of(messages, json_values),
    "max_tokens": st.one_of(st.integers(-3, 40), st.integers(), json_values),
    "max_completion_tokens": st.one_of(st.integers(-3, 40), json_values),
    "temperature": st.one_of(st.floats(-1, 3, allow_nan=False), json_values),
    "top_p": st.one_of(st.floats(-1, 2, allow_nan=False), json_values),
    "top_k": st.one_of(st.integers(-3, 100), json_values),
    "seed": st.one_of(st.integers(), json_values),
    "stop": st.one_of(st.text(max_size=3), st.lists(st.text(max_size=3), max_size=20), json_values),
    "n": st.one_of(st.integers(-1, 3), json_values),
    "stream": st.one_of(st.booleans(), json_values),
    "stream_options": st.one_of(st.fixed_dictionaries({"include_usage": st.booleans()}), json_values),
    "user": st.one_of(st.text(max_size=10), json_values),
    "speculation": st.one_of(st.fixed_dictionaries(
        {"enabled": st.one_of(st.booleans(), json_values),
         "max_tree_tokens": st.one_of(st.integers(-2, 64), json_values)}), json_values),
    "logprobs": json_values, "echo": json_values, "best_of": json_values, "logit_bias": json_values,
    "frequency_penalty": json_values, "tools": json_values, "response_format": json_values,
}
requests = st.fixed_dictionaries({"model": FIELDS["model"]},
                                 optional={k: v for k, v in FIELDS.items() if k != "model"})
bodies = st.one_of(
    requests.map(lambda d: json.dumps(d).encode()),
    json_values.map(lambda v: json.dumps(v).encode()),
    st.binary(max_size=64),
    requests.map(lambda d: json.dumps(d).encode()[:-3]),            # cut short
)


@pytest.fixture(scope="module")
def http():
    emb = build_embedded(Settings(fake_worker=True, fake_context=64))
    emb.start()
    with background_server(emb.app) as url, httpx.Client(
            base_url=url, timeout=10, headers={"Authorization": f"Bearer {emb.dev_key}",
                                               "Content-Type": "application/json"}) as c:
        yield c
    emb.stop()


def check(r: httpx.Response) -> None:
    assert r.status_code < 500, r.text
    if r.status_code >= 400:
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"}
        assert isinstance(err["message"], str) and isinstance(err["type"], str)
        assert err["param"] is None or isinstance(err["param"], str)
        assert err["code"] is None or isinstance(err["code"], str)
    elif r.headers["content-type"].startswith("text/event-stream"):
        events = [e for e in r.text.split("\n\n") if e]
        assert events[-1] == "data: [DONE]"
        assert not any('"error"' in e for e in events)
    else:
        body = r.json()
        assert body["choices"][0]["finish_reason"] in ("stop", "length")


FUZZ = settings(max_examples=150, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


@FUZZ
@given(body=bodies)
def test_completions_never_5xx(http, body):
    check(http.post("/v1/completions", content=body))


@FUZZ
@given(body=bodies)
def test_chat_never_5xx(http, body):
    check(http.post("/v1/chat/completions", content=body))
