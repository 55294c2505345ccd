"""A response's events as a function of its tokens (gateway/responses/events.py): numbered 0, 1, 2,
… whatever the grouping of the tokens that made them, text whole across multi-byte characters,
and closed by the event its end calls for."""
from __future__ import annotations

import random

import pytest

from gateway.responses.events import EventLog, text_of
from gateway.responses.objects import Header, Outcome
from scheduler.request import Status
from workers.model.loader import load_tokenizer, resolve_model


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(str(resolve_model(progress=False)), progress=False)


def header(**kw) -> Header:
    return Header("resp_abc", "t1", "m", 1_700_000_000, [{"role": "user", "content": "hi"}], **kw)


def run(tok, ids: list[int], groups: list[int], outcome: Outcome) -> list[dict]:
    log = EventLog(header(), tok, tok.encode("Say:"))
    events, i = log.start(), 0
    for g in groups:
        events += log.push(ids[i:i + g])
        i += g
    events += log.push(ids[i:])
    return events + log.finish(outcome)


def test_the_events_of_a_token_sequence_do_not_depend_on_how_its_tokens_arrived(tok):
    text = "Héllo wörld 🌍🚀 — ça va? 日本語のテキスト, and some plain words at the end."
    ids = tok.encode(text, add_special_tokens=False) + [tok.eos_token_id]
    done = Outcome(Status.FINISHED, "stop", "", 4, len(ids))
    one_by_one = run(tok, ids, [1] * len(ids), done)
    rng = random.Random(0)
    for _ in range(5):
        groups = [rng.randint(1, 6) for _ in range(len(ids) // 3)]
        assert run(tok, ids, groups, done) == one_by_one
    assert [e["sequence_number"] for e in one_by_one] == list(range(len(one_by_one)))
    deltas = "".join(e["delta"] for e in one_by_one if e["type"] == "response.output_text.delta")
    assert deltas == text == text_of(tok, tok.encode("Say:"), ids)      # no character split or lost
    assert "\ufffd" not in deltas
    kinds = [e["type"] for e in one_by_one]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.completed"]
    last = one_by_one[-1]["response"]
    assert last["status"] == "completed" and last["output"][0]["content"][0]["text"] == text
    assert last["usage"] == {"input_tokens": 4, "input_tokens_details": {"cached_tokens": 0},
                             "output_tokens": len(ids), "output_tokens_details": {"reasoning_tokens": 0},
                             "total_tokens": 4 + len(ids)}


@pytest.mark.parametrize("status, reason, event, shown", [
    (Status.FINISHED, "length", "response.incomplete", "incomplete"),
    (Status.CANCELLED, "abort", "response.incomplete", "cancelled"),
    (Status.FAILED, "error", "response.failed", "failed"),
])
def test_an_end_other_than_a_stop_closes_with_its_own_event(tok, status, reason, event, shown):
    ids = tok.encode(" one two three", add_special_tokens=False)
    events = run(tok, ids, [2], Outcome(status, reason, "", 3, len(ids)))
    assert events[-1]["type"] == event
    resp = events[-1]["response"]
    assert resp["status"] == shown
    assert (resp["incomplete_details"] is not None) == (shown == "incomplete")
    assert (resp["error"] is not None) == (shown == "failed")
    assert events[-2]["item"]["status"] == "incomplete"


def test_a_background_response_is_created_queued(tok):
    log = EventLog(header(background=True), tok)
    created, in_progress = log.start()[:2]
    assert created["response"]["status"] == "queued" and in_progress["response"]["status"] == "in_progress"
    assert created["response"]["background"] is True and created["response"]["output"] == []
