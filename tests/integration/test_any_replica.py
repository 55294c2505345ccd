"""Any replica answers for any response: two real `specgate serve` processes (the fake worker,
paced by `--fake-step-ms`) over one real Redis of our own. Requests are created on replica A;
replica B retrieves, streams, cancels and deletes them, and resumes a chat stream of A's, as a
load balancer may send a client's next call anywhere (gateway/assembly/fleet.py)."""
from __future__ import annotations

import json
import time
import uuid

import httpx
import pytest
import redis

from gateway.assembly.replica import replica_prefix
from gateway.http.server import free_port
from gateway.tenancy.records import Tenant
from gateway.tenancy.tenants import TenantRegistry
from scheduler.request import Status
from scheduler.store.redis_store import RedisStore
from test_faults import MODEL, TOK, expected_ids
from test_replicas import kill, serve, wait_ready

pytestmark = pytest.mark.slow

KEY = "sk-any-replica-0123456789"
AUTH = {"Authorization": f"Bearer {KEY}"}
STEP_MS = 30.0


@pytest.fixture
def two(own_redis):
    """(A's URL, B's URL, A's scheduler store): two gateways over one Redis and one tenant."""
    prefix = f"any:{uuid.uuid4().hex}:"
    TenantRegistry(own_redis.url, prefix).put(Tenant("acme"), [KEY])
    ports = free_port(), free_port()
    procs = [serve(own_redis.url, prefix, name, port, step_ms=STEP_MS)
             for name, port in zip("ab", ports)]
    try:
        for proc, port in zip(procs, ports):
            wait_ready(proc, port, timeout_s=180)      # shared cores: starts may be slow
        a_store = RedisStore(redis.Redis.from_url(own_redis.url), replica_prefix(prefix, "a"))
        yield f"http://127.0.0.1:{ports[0]}", f"http://127.0.0.1:{ports[1]}", a_store
    finally:
        for proc in procs:
            kill(proc)


def create(url: str, max_tokens: int) -> str:
    r = httpx.post(url + "/v1/responses", headers=AUTH, timeout=30,
                   json={"model": MODEL, "input": "hello", "background": True,
                         "max_output_tokens": max_tokens})
    assert r.status_code == 200, r.text
    return r.json()["id"]


def get(url: str, rid: str) -> httpx.Response:
    return httpx.get(f"{url}/v1/responses/{rid}", headers=AUTH, timeout=30)


def text(obj: dict) -> str:
    return "".join(c["text"] for item in obj["output"] for c in item.get("content", []))


def truth(rid: str, n: int) -> str:
    return TOK.decode(expected_ids(rid, n), skip_special_tokens=True)


def events(url: str, path: str, seen=None) -> list:
    """Every SSE data line of a stream, parsed ("[DONE]" kept as is); `seen(event)` is called as
    each arrives."""
    out = []
    with httpx.stream("GET", url + path, headers=AUTH, timeout=60) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: "):
                out.append(line[6:] if line[6:] == "[DONE]" else json.loads(line[6:]))
                if seen is not None:
                    seen(out[-1])
    return out


def until(check, timeout_s: float = 30.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def test_b_retrieves_and_streams_what_a_generates(two):
    a, b, a_store = two
    n = 400
    rid = create(a, n)
    until(lambda: len(a_store.get(rid).output_ids) > 0, what="A never ran it")   # on A, not B
    mid = get(b, rid)
    assert mid.status_code == 200, mid.text
    assert mid.json()["status"] == "in_progress"        # A's record, read from B
    live: list[bool] = []

    def seen(event) -> None:                            # is A still generating as B streams?
        if event["type"] == "response.output_text.delta" and not live:
            live.append(not a_store.get(rid).stats.status.terminal)

    streamed = events(b, f"/v1/responses/{rid}?stream=true", seen)
    assert live == [True]                               # followed live, not read at the end
    seqs = [e["sequence_number"] for e in streamed]
    assert seqs == list(range(len(seqs)))                 # every event, once, in order
    assert streamed[-1]["type"] == "response.incomplete"  # its length reached: the fake never stops
    deltas = "".join(e["delta"] for e in streamed if e["type"] == "response.output_text.delta")
    assert deltas == truth(rid, n)                        # every token, once
    done = get(b, rid).json()
    assert done["status"] == "incomplete" and text(done) == truth(rid, n)
    assert done["usage"]["output_tokens"] == n
    assert get(a, rid).json() == done


def test_b_cancels_and_deletes_what_runs_on_a(two):
    a, b, a_store = two
    n = 3000                                             # far longer than the test waits
    cancelled, deleted = create(a, n), create(a, n)

    def committed(rid: str) -> int:
        return len(a_store.get(rid).output_ids)

    until(lambda: committed(cancelled) > 0 and committed(deleted) > 0, what="A never ran them")
    r = httpx.post(f"{b}/v1/responses/{cancelled}/cancel", headers=AUTH, timeout=30)
    assert r.status_code == 200, r.text
    assert r.json()["status"] == "cancelled"
    rec = a_store.get(cancelled)
    assert rec.stats.status is Status.CANCELLED          # A's request itself ended
    held = len(rec.output_ids)
    assert held < n
    time.sleep(10 * STEP_MS / 1000)
    assert committed(cancelled) == held                  # no more tokens
    on_a = get(a, cancelled).json()
    assert on_a["status"] == "cancelled" and on_a["usage"]["output_tokens"] == held

    r = httpx.delete(f"{b}/v1/responses/{deleted}", headers=AUTH, timeout=30)
    assert r.status_code == 200 and r.json()["deleted"] is True, r.text
    assert get(a, deleted).status_code == 404            # gone on A too
    until(lambda: a_store.get(deleted).stats.status is Status.CANCELLED, 10,
          "A's request ran on after its response was deleted")
    held = committed(deleted)
    time.sleep(10 * STEP_MS / 1000)
    assert committed(deleted) == held < n


def test_b_resumes_a_chat_stream_that_runs_on_a(two):
    a, b, _ = two
    n = 80
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "stream": True,
            "max_tokens": n, "stream_options": {"resumable": True}}
    with httpx.stream("POST", a + "/v1/chat/completions", json=body, headers=AUTH,
                      timeout=30) as r:                  # left after its first event
        assert r.status_code == 200, r.read()
        first = next(line for line in r.iter_lines() if line.startswith("data: "))
    rid = json.loads(first[6:])["id"]
    resumed = events(b, f"/v1/chat/completions/{rid}/stream")
    assert resumed[-1] == "[DONE]"
    content = "".join(d["choices"][0]["delta"].get("content") or "" for d in resumed[:-1]
                      if isinstance(d, dict) and d["choices"])
    assert content == truth(rid, n)
    assert httpx.get(f"{b}/v1/chat/completions/missing-{rid}/stream", headers=AUTH,
                     timeout=30).status_code == 404
