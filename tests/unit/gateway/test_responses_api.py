"""The Responses API through the official `openai` client, over the embedded gateway and the
fake worker (gateway/responses): create (plain, streamed, background), retrieve, resume a stream
with `starting_after`, cancel during steps, delete, continue with `previous_response_id`, expiry,
tenant isolation, and refusals of what is not supported."""
from __future__ import annotations

import time

import httpx
import openai
import pytest

from gateway.settings import Settings
from tests.helpers import serving

MODEL = "smollm2-135m"
ACME, OTHER = "sk-acme-responses-0001", "sk-other-responses-0001"


@pytest.fixture(scope="module")
def gw():
    settings = Settings(fake_worker=True, fake_step_ms=5.0, responses_ttl_s=3.0, log_level="critical")
    with serving(settings, {"acme": [ACME], "other": [OTHER]}, log_level="critical") as (emb, url):
        yield emb, url


def client(url: str, key: str = ACME) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0)


def text(events) -> str:
    return "".join(e.delta for e in events if e.type == "response.output_text.delta")


def test_a_response_its_stream_and_a_resumed_stream_say_the_same(gw):
    emb, url = gw
    c = client(url)
    done = c.responses.create(model=MODEL, input="hello", max_output_tokens=20)
    assert done.status == "incomplete" and done.incomplete_details.reason == "max_output_tokens"
    assert done.usage.output_tokens == 20 and done.output_text
    events = list(c.responses.create(model=MODEL, input="hello", max_output_tokens=20, stream=True))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].type == "response.created" and events[-1].type == "response.incomplete"
    assert text(events) == events[-1].response.output_text
    # the fake worker's tokens depend on the request id: the same response read three ways
    rid = events[0].response.id
    kept = c.responses.retrieve(rid)
    assert kept.output_text == text(events) and kept.status == "incomplete"
    for after in (-1, 0, 5, len(events) - 2):
        resumed = list(c.responses.retrieve(rid, stream=True, starting_after=after))
        assert [e.model_dump() for e in resumed] == [e.model_dump() for e in events[after + 1:]]


def test_a_background_response_runs_with_nobody_connected_and_is_resumed_from_the_store(gw):
    emb, url = gw
    c = client(url)
    bg = c.responses.create(model=MODEL, input="hello", max_output_tokens=60, background=True)
    assert bg.status in ("queued", "in_progress") and bg.background
    steps = emb.step_loop.steps
    deadline = time.monotonic() + 20
    while c.responses.retrieve(bg.id).status not in ("completed", "incomplete"):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert emb.step_loop.steps > steps
    whole = list(c.responses.retrieve(bg.id, stream=True))
    steps = emb.step_loop.steps
    tail = list(c.responses.retrieve(bg.id, stream=True, starting_after=10))
    assert emb.step_loop.steps == steps                   # resuming costs no verification step
    assert [e.sequence_number for e in tail] == list(range(11, len(whole)))
    assert text(whole) == c.responses.retrieve(bg.id).output_text
    assert whole[-1].response.usage.output_tokens == 60


def test_cancel_during_steps_ends_it_at_a_boundary_and_keeps_what_was_committed(gw):
    emb, url = gw
    c = client(url)
    bg = c.responses.create(model=MODEL, input="hello", max_output_tokens=3000, background=True)
    deadline = time.monotonic() + 20
    while not c.responses.retrieve(bg.id).output_text:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    cancelled = c.responses.cancel(bg.id)
    assert cancelled.status == "cancelled"
    n = cancelled.usage.output_tokens
    assert 0 < n < 3000
    time.sleep(0.1)
    again = c.responses.retrieve(bg.id)
    assert again.status == "cancelled" and again.usage.output_tokens == n      # nothing after
    assert c.responses.cancel(bg.id).status == "cancelled"                     # idempotent
    events = list(c.responses.retrieve(bg.id, stream=True))
    assert events[-1].type == "response.incomplete" and events[-1].response.status == "cancelled"
    assert text(events) == again.output_text


def test_another_tenants_response_is_a_404_as_a_missing_one(gw):
    emb, url = gw
    mine = client(url).responses.create(model=MODEL, input="hello", max_output_tokens=5)
    theirs = client(url, OTHER)
    for call in (lambda: theirs.responses.retrieve(mine.id),
                 lambda: list(theirs.responses.retrieve(mine.id, stream=True, starting_after=0)),
                 lambda: theirs.responses.cancel(mine.id),
                 lambda: theirs.responses.delete(mine.id),
                 lambda: theirs.responses.create(model=MODEL, input="x", previous_response_id=mine.id),
                 lambda: theirs.responses.retrieve("resp_" + "0" * 32)):
        with pytest.raises(openai.NotFoundError) as e:
            call()
        assert e.value.body["code"] == "response_not_found"
    assert client(url).responses.retrieve(mine.id).id == mine.id       # untouched by the tries


def test_previous_response_id_continues_the_stored_conversation(gw):
    emb, url = gw
    c = client(url)
    first = c.responses.create(model=MODEL, input="hello", instructions="Be brief.", max_output_tokens=8)
    second = c.responses.create(model=MODEL, input="and then?", previous_response_id=first.id,
                                max_output_tokens=8)
    assert second.previous_response_id == first.id
    rec = emb.step_loop.store.get(second.id)
    prompt = emb.service.tokenizer.decode(rec.prompt_ids)
    # the earlier turn and its answer come first; earlier instructions are not carried over
    assert "hello" in prompt and first.output_text.strip() in prompt and "and then?" in prompt
    assert "Be brief." not in prompt
    assert prompt.index("hello") < prompt.index(first.output_text.strip()) < prompt.index("and then?")


def test_delete_forgets_a_response_and_cancels_it_if_it_runs(gw):
    emb, url = gw
    c = client(url)
    bg = c.responses.create(model=MODEL, input="hello", max_output_tokens=3000, background=True)
    c.responses.delete(bg.id)
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve(bg.id)
    deadline = time.monotonic() + 10
    while (rec := emb.step_loop.store.get(bg.id)) is None or not rec.stats.status.terminal:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    assert rec.stats.status.value == "cancelled"


def test_stored_responses_expire(gw):
    emb, url = gw
    c = client(url)
    r = c.responses.create(model=MODEL, input="hello", max_output_tokens=3)
    assert c.responses.retrieve(r.id).status == "incomplete"
    time.sleep(3.2)                                       # responses_ttl_s=3
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve(r.id)


def test_an_unstored_response_is_answered_but_not_kept(gw):
    emb, url = gw
    c = client(url)
    r = c.responses.create(model=MODEL, input="hello", max_output_tokens=3, store=False)
    assert r.usage.output_tokens == 3
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve(r.id)


@pytest.mark.parametrize("body, param", [
    ({"background": True, "store": False}, "store"),
    ({"tools": [{"type": "function", "name": "f", "parameters": {}}]}, "tools"),
    ({"text": {"format": {"type": "json_object"}}}, "text.format.type"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": "x"}]}, "input"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"temperature": 3.0}, "temperature"),
    ({"model": "nope"}, "model"),
])
def test_what_is_not_supported_or_out_of_range_is_a_400_naming_the_field(gw, body, param):
    emb, url = gw
    r = httpx.post(url + "/v1/responses", headers={"Authorization": f"Bearer {ACME}"},
                   json={"model": MODEL, "input": "hello", **body})
    assert r.status_code in (400, 404), r.text
    err = r.json()["error"]
    assert err["param"] == param, err


def test_starting_after_without_stream_is_refused(gw):
    emb, url = gw
    r = client(url).responses.create(model=MODEL, input="hello", max_output_tokens=3)
    got = httpx.get(f"{url}/v1/responses/{r.id}?starting_after=2",
                    headers={"Authorization": f"Bearer {ACME}"})
    assert got.status_code == 400 and got.json()["error"]["param"] == "starting_after"
