"""A follower wakes when the step loop commits, not on a clock (gateway/replay.py,
gateway/responses/service.py; scheduler/store/watch.py, redis_watch.py): on the embedded gateway
and its fake worker, in memory and on a real Redis, a request runs a dozen slow steps while it is
followed (a chat resume, a streamed GET of a background response, and a follower of another
instance's store over the same Redis), and the follower's store reads are counted. A follower
that polled would read about once per 20 ms; one that wakes on commits reads about once a step.
Each follower's safety-net read is set far beyond the test, so a follower that missed its
notifications would hang, not pass slowly."""
from __future__ import annotations

import asyncio
import json
import threading
from typing import Any, Callable

import httpx
import pytest

from gateway.assembly.replica import scheduler_prefix
from gateway.replay import Cursor, Replayer
from gateway.settings import Settings
from gateway.service import GenerateOutput
from scheduler.store.redis_store import RedisStore
from tests.helpers import serving

MODEL = "smollm2-135m"
ACME = "sk-acme-wakeups-0001"
STEPS = 12              # one token a step (no speculation)
STEP_MS = 200.0
# reads beyond one a step: the first after the watch begins, the subscription's, the commits that
# write no token (the request's start, its end); polling every 20 ms would read ~120 times
SLACK = 8
NEVER_S = 120.0         # the followers' safety-net read: beyond the test's timeouts
HEADERS = {"Authorization": f"Bearer {ACME}"}


@pytest.fixture
def gw(store):
    url, prefix = store
    settings = Settings(fake_worker=True, fake_step_ms=STEP_MS, log_level="critical",
                        redis_url=url, store_prefix=prefix)
    with serving(settings, {"acme": [ACME]}, log_level="critical") as (emb, base):
        emb.replayer.fallback_s = NEVER_S
        emb.responses.fallback_s = NEVER_S
        yield emb, base


class Reads:
    """Counts a store's `tail` calls (a follower's reads) while it serves them."""

    def __init__(self, store: Any) -> None:
        self.n, self._tail, self._lock = 0, store.tail, threading.Lock()
        store.tail = self

    def __call__(self, *args: Any, **kw: Any) -> Any:
        with self._lock:
            self.n += 1
        return self._tail(*args, **kw)


def slow_chat(base: str) -> str:
    """A resumable chat stream of STEPS slow steps, left running (its client goes at once)."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "stream": True,
            "max_tokens": STEPS, "speculation": {"enabled": False},
            "stream_options": {"resumable": True}}
    with httpx.stream("POST", base + "/v1/chat/completions", json=body, headers=HEADERS,
                      timeout=30) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: "):
                return json.loads(line[6:])["id"]
    raise AssertionError("no event")


def sse_data(r: httpx.Response) -> list[dict]:
    return [json.loads(line[6:]) for line in r.iter_lines()
            if line.startswith("data: ") and line != "data: [DONE]"]


def followed_reads(store: Any, follow: Callable[[], Any]) -> tuple[int, Any]:
    reads = Reads(store)
    got = follow()
    return reads.n, got


def test_a_chat_resume_reads_the_store_once_a_step_not_on_a_clock(gw):
    emb, base = gw
    rid = slow_chat(base)

    def follow() -> list[dict]:
        with httpx.stream("GET", f"{base}/v1/chat/completions/{rid}/stream", headers=HEADERS,
                          timeout=30) as r:
            assert r.status_code == 200
            return sse_data(r)

    reads, events = followed_reads(emb.replayer.records, follow)
    final = [e for e in events if e["choices"] and e["choices"][0]["finish_reason"]]
    assert final and final[-1]["specgate"]["steps"] == STEPS
    assert reads <= STEPS + SLACK, reads


def test_a_streamed_get_of_a_background_response_reads_once_a_step(gw):
    emb, base = gw
    created = httpx.post(base + "/v1/responses", headers=HEADERS, timeout=30, json={
        "model": MODEL, "input": "hello", "max_output_tokens": STEPS, "background": True,
        "speculation": {"enabled": False}}).json()

    def follow() -> list[dict]:
        with httpx.stream("GET", f"{base}/v1/responses/{created['id']}?stream=true",
                          headers=HEADERS, timeout=30) as r:
            assert r.status_code == 200
            return sse_data(r)

    reads, events = followed_reads(emb.responses.records, follow)
    assert events[-1]["type"] == "response.incomplete"          # max_output_tokens reached
    assert [e for e in events if e["type"] == "response.output_text.delta"]
    assert reads <= STEPS + SLACK, reads


def test_a_follower_on_another_instance_over_the_same_redis_wakes_on_each_commit(redis_url,
                                                                                   redis_prefix):
    """Ray mode's shape: the request runs in one process's step loop, and is followed through a
    store of another's (its own connections and subscription) over the same Redis."""
    settings = Settings(fake_worker=True, fake_step_ms=STEP_MS, log_level="critical",
                        redis_url=redis_url, store_prefix=redis_prefix)
    with serving(settings, {"acme": [ACME]}, log_level="critical") as (emb, base):
        rid = slow_chat(base)
        elsewhere = RedisStore.from_url(redis_url, scheduler_prefix(settings))
        try:
            replayer = Replayer(elsewhere, emb.service.tokenizer, fallback_s=NEVER_S)
            tenant = emb.tenants.authenticate(ACME)

            async def follow() -> list:
                record = await replayer.open(tenant, rid)
                return [item async for item in replayer.stream(record, Cursor())]

            reads, items = followed_reads(elsewhere, lambda: asyncio.run(
                asyncio.wait_for(follow(), 30)))
        finally:
            elsewhere.close()
    out = items[-1]
    assert isinstance(out, GenerateOutput) and out.finish_reason == "length"
    assert out.speculation.steps == STEPS and len(out.token_ids) == STEPS
    assert reads <= STEPS + SLACK, reads
