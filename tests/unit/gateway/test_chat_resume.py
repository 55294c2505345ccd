"""Resumable chat completion streams over HTTP (gateway/http/chat_stream.py, gateway/replay.py), on
the embedded gateway and the fake worker: every SSE event's id, a stream resumed after each id
says what the live one said after it, stop strings, tenant isolation, a `resumable` stream that
survives its client's disconnect (and one that does not), and the streams that cannot resume."""
from __future__ import annotations

import json
import time

import httpx
import pytest

from gateway.settings import Settings
from gateway.text import ToyTokenizer
from scheduler.request import Status
from tests.helpers import serving
from workers.fake_worker import token_at

MODEL = "smollm2-135m"
ACME, OTHER = "sk-acme-resume-0001", "sk-other-resume-0001"
TOK = ToyTokenizer()
MESSAGES = [{"role": "user", "content": "hello"}]


@pytest.fixture(scope="module")
def gw():
    settings = Settings(fake_worker=True, fake_step_ms=5.0, log_level="critical")
    with serving(settings, {"acme": [ACME], "other": [OTHER]}, log_level="critical") as (emb, url):
        yield emb, url


def truth(rid: str, n: int) -> str:
    return TOK.decode([token_at(rid, p) for p in range(n)], skip_special_tokens=True)


def parse(lines, keep: int | None = None) -> list[tuple[str | None, object]]:
    """(id, data) of each event; data parsed from JSON ("[DONE]" kept as is); the first `keep`
    only (then the connection is dropped)."""
    events, event_id = [], None
    for line in lines:
        if line.startswith("id: "):
            event_id = line[4:]
        elif line.startswith("data: "):
            data = line[6:]
            events.append((event_id, data if data == "[DONE]" else json.loads(data)))
            event_id = None
            if keep is not None and len(events) >= keep:
                break
    return events


def post(url: str, body: dict, key: str = ACME, keep: int | None = None) -> list:
    body = {"model": MODEL, "messages": MESSAGES, "stream": True, **body}
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=20,
                      headers={"Authorization": f"Bearer {key}"}) as r:
        assert r.status_code == 200, r.read()
        return parse(r.iter_lines(), keep)


def resume(url: str, rid: str, last: str | None = None, key: str = ACME, query: str = "") -> list:
    headers = {"Authorization": f"Bearer {key}", **({"Last-Event-ID": last} if last is not None else {})}
    with httpx.stream("GET", f"{url}/v1/chat/completions/{rid}/stream{query}", headers=headers,
                      timeout=20) as r:
        assert r.status_code == 200, r.read()
        return parse(r.iter_lines())


def get(url: str, rid: str, key: str = ACME, last: str | None = None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}", **({"Last-Event-ID": last} if last is not None else {})}
    return httpx.get(f"{url}/v1/chat/completions/{rid}/stream", headers=headers, timeout=20)


def is_content(data) -> bool:
    return isinstance(data, dict) and bool(data["choices"]) and "content" in data["choices"][0]["delta"] \
        and "role" not in data["choices"][0]["delta"]


def content(events) -> str:
    return "".join(d["choices"][0]["delta"]["content"] for _, d in events if is_content(d))


def assert_resumes_match(url: str, live: list) -> None:
    """Resumed after each id the live stream sent (and from the start), the stream says the
    same text, then the same final and usage events with the same ids."""
    rid = live[0][1]["id"]
    assert resume(url, rid)[:1] == live[:1]                   # from the start: the opening too
    assert content(resume(url, rid)) == content(live)
    for j, (event_id, _) in enumerate(live[:-1]):
        after = live[j + 1:]
        got = resume(url, rid, event_id)
        assert content(got) == content(after), event_id
        assert [e for e in got if not is_content(e[1])] == [e for e in after if not is_content(e[1])]
        # each content id is the characters shown once it is read, counted from the cursor
        shown = int(event_id) if event_id.isdigit() else None
        for got_id, data in got:
            if is_content(data):
                shown += len(data["choices"][0]["delta"]["content"])
                assert got_id == str(shown)
        if shown is not None and any(is_content(d) for _, d in after):
            assert shown == int([i for i, d in after if is_content(d)][-1])


def test_every_event_has_an_id_and_a_resume_after_any_of_them_says_the_rest(gw):
    emb, url = gw
    live = post(url, {"max_tokens": 40, "stream_options": {"include_usage": True}})
    assert live[-1] == (None, "[DONE]")
    ids = [i for i, _ in live[:-1]]
    assert ids[0] == "0" and ids[-2:] == ["end", "usage"]
    rid = live[0][1]["id"]
    assert content(live) == truth(rid, 40)
    assert [int(i) for i in ids[1:-2]] == [len(content(live[:k + 2])) for k in range(len(ids) - 3)]
    assert_resumes_match(url, live)
    # ?after= is the same cursor as the header, which wins when both come
    middle = ids[len(ids) // 2]
    assert resume(url, rid, query=f"?after={middle}") == resume(url, rid, middle)
    assert resume(url, rid, "end", query="?after=0") == resume(url, rid, "end")


def test_a_stop_string_ends_a_resumed_stream_where_it_ended_the_live_one(gw):
    emb, url = gw
    rid = "chatcmpl-pinned-resume"
    full = truth(rid, 60)
    stop = full[10:17]                                  # spans tokens
    assert full.find(stop) == 10
    original, emb.service.preparer.request_id = emb.service.preparer.request_id, lambda kind: rid
    try:
        live = post(url, {"max_tokens": 60, "stop": [stop, "zzz"],
                          "stream_options": {"include_usage": True}})
    finally:
        emb.service.preparer.request_id = original
    assert content(live) == full[:10] and live[-3][1]["choices"][0]["finish_reason"] == "stop"
    assert_resumes_match(url, live)


def test_another_tenants_stream_is_not_found_as_an_unknown_one_is(gw):
    emb, url = gw
    live = post(url, {"max_tokens": 8})
    rid = live[0][1]["id"]
    theirs, unknown = get(url, rid, key=OTHER), get(url, rid + "x")
    assert theirs.status_code == unknown.status_code == 404
    assert theirs.json() == json.loads(json.dumps(unknown.json()).replace(rid + "x", rid))
    assert theirs.json()["error"]["code"] == "request_not_found"
    # a completion (not a chat stream) is not found here either
    r = httpx.post(url + "/v1/completions", headers={"Authorization": f"Bearer {ACME}"},
                   json={"model": MODEL, "prompt": "x", "max_tokens": 3}, timeout=20)
    assert get(url, r.json()["id"]).status_code == 404
    assert get(url, rid, key="sk-nobody").status_code == 401


def wait_terminal(emb, rid: str, timeout: float = 20.0):
    deadline = time.monotonic() + timeout
    while True:
        stats = emb.step_loop.store.get(rid).stats
        if stats.status.terminal:
            return stats
        assert time.monotonic() < deadline, f"{rid} did not end"
        time.sleep(0.01)


def test_a_resumable_stream_survives_its_clients_disconnect_and_finishes(gw):
    emb, url = gw
    live = post(url, {"max_tokens": 400, "stream_options": {"resumable": True}}, keep=4)
    rid, last = live[0][1]["id"], live[-1][0]
    assert not emb.step_loop.store.get(rid).stats.status.terminal      # left while it ran
    got = resume(url, rid, last)               # follows it: committed tokens, then new ones
    stats = wait_terminal(emb, rid)
    assert (stats.status, stats.committed) == (Status.FINISHED, 400)
    assert content(live) + content(got) == truth(rid, 400)
    assert got[-2][1]["choices"][0]["finish_reason"] == "length" and got[-1] == (None, "[DONE]")


def test_without_resumable_a_disconnect_cancels_and_a_resume_gets_what_was_committed(gw):
    emb, url = gw
    live = post(url, {"max_tokens": 400}, keep=4)
    rid, last = live[0][1]["id"], live[-1][0]
    stats = wait_terminal(emb, rid)
    assert stats.status is Status.CANCELLED and stats.committed < 400
    got = resume(url, rid, last)
    assert content(live) + content(got) == truth(rid, stats.committed)
    assert got[-2][1]["choices"][0]["finish_reason"] == "abort"


def test_streams_that_cannot_resume_carry_no_ids_and_say_why(gw):
    emb, url = gw
    live = post(url, {"max_tokens": 6, "n": 2})
    assert all(i is None for i, _ in live)
    r = get(url, live[0][1]["id"])
    assert r.status_code == 400 and r.json()["error"]["code"] == "stream_not_resumable"
    assert "n > 1" in r.json()["error"]["message"]
    for extra in ({"n": 2}, {"logprobs": True}):
        r = httpx.post(url + "/v1/chat/completions", headers={"Authorization": f"Bearer {ACME}"},
                       json={"model": MODEL, "messages": MESSAGES, "max_tokens": 4, "stream": True,
                             "stream_options": {"resumable": True}, **extra}, timeout=20)
        assert r.status_code == 400 and r.json()["error"]["param"] == "stream_options.resumable"
    rid = post(url, {"max_tokens": 4})[0][1]["id"]
    r = get(url, rid, last="12abc")
    assert r.status_code == 400 and r.json()["error"]["param"] == "Last-Event-ID"


def test_a_resumable_stream_outlives_its_gateway_and_stops_at_its_stop_string(redis_url, redis_prefix):
    # The first gateway streams to a client who leaves, then goes away itself; a second one over
    # the same Redis takes the request over, ends it at its stop string (which the first never
    # reached), and the client resumes from the second, after the last id it had.
    from gateway.builders.embedded import build_embedded
    from gateway.http.server import background_server
    from gateway.tenancy.records import Tenant

    settings = Settings(fake_worker=True, fake_step_ms=5.0, redis_url=redis_url,
                        store_prefix=redis_prefix, log_level="critical")
    rid = "chatcmpl-pinned-restart"
    full = truth(rid, 400)
    stop = full[200:207]
    assert full.find(stop) == 200
    first = build_embedded(settings, progress=False)
    first.tenants.put(Tenant("acme"), [ACME])
    first.service.preparer.request_id = lambda kind: rid
    first.start()
    with background_server(first.app, log_level="critical") as url:
        live = post(url, {"max_tokens": 400, "stop": stop, "stream_options": {"resumable": True}},
                    keep=3)
        first.stop()                                   # the gateway goes, the request stays live
    assert len(content(live)) < 200
    second = build_embedded(settings, progress=False)
    assert rid in second.recovered and rid not in second.cancelled
    second.start()
    try:
        with background_server(second.app, log_level="critical") as url:
            got = resume(url, rid, live[-1][0])
        stats = wait_terminal(second, rid)
        assert content(live) + content(got) == full[:200]
        assert got[-2][1]["choices"][0]["finish_reason"] == "stop"
        assert (stats.status, stats.cause) == (Status.FINISHED, "stop_string") and stats.committed < 400
    finally:
        second.stop()
