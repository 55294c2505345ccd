"""Backpressure from a stream's client to the scheduler (gateway/service/stream.py), end to end on
loopback with the fake worker: a client that opens a stream and never reads gets its request
paused in the scheduler once its unread tokens pass the bound; another tenant is served
meanwhile; once the client reads, it gets every token, in order, to the end.

Every wait is on a condition with a generous deadline (the machine may be busy); nothing is
asserted about how long anything took."""
from __future__ import annotations

import json
import socket
import time

import httpx
import pytest

from gateway.builders.embedded import build_embedded
from gateway.http.server import background_server
from gateway.service.stream import Backlog
from gateway.settings import Settings
from gateway.tenancy.records import Tenant
from gateway.text import ToyTokenizer
from workers.fake_worker import token_at

MODEL = "smollm2-135m"
TOK = ToyTokenizer()
TOKENS = 3000                    # far more than the connection's buffers hold
VICTIM_KEY = "sk-victim-0123456789"


def truth(rid: str, n: int) -> str:
    return TOK.decode([token_at(rid, p) for p in range(n)], skip_special_tokens=True)


def wait_for(cond, what: str, timeout: float = 120.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = cond()
        if got:
            return got
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def dechunk(body: bytes) -> bytes:
    out, i = b"", 0
    while True:
        j = body.index(b"\r\n", i)
        size = int(body[i:j].split(b";")[0], 16)
        if size == 0:
            return out
        out += body[j + 2:j + 2 + size]
        i = j + 2 + size + 2


def unread_stream(url: str, key: str, n: int = 1) -> socket.socket:
    """A streamed chat asking for TOKENS (in `n` choices) on a socket with a small receive
    buffer, sent and not read (as `loadtest hostile`'s idle pattern does)."""
    host, port = url.removeprefix("http://").split(":")
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.connect((host, int(port)))
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "a long story"}],
                       "max_tokens": TOKENS, "stream": True, "n": n}).encode()
    s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: %s\r\nAuthorization: Bearer %s\r\n"
              b"Content-Type: application/json\r\nContent-Length: %d\r\nConnection: close\r\n\r\n%s"
              % (url.encode(), key.encode(), len(body), body))
    return s


def sse_events(raw: bytes) -> list[str]:
    """The data lines of a raw streamed HTTP 200 response, its final `[DONE]` checked and cut."""
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200")
    events = [line[6:] for line in dechunk(body).decode().split("\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return events


def read_all(s: socket.socket) -> bytes:
    s.settimeout(120)
    data = b""
    while chunk := s.recv(65536):
        data += chunk
    return data


@pytest.fixture
def server():
    emb = build_embedded(Settings(fake_worker=True, fake_context=TOKENS + 256,
                                  stream_backlog_tokens=32, stream_resume_tokens=8))
    emb.tenants.put(Tenant("victim"), [VICTIM_KEY])
    emb.start()
    try:
        with background_server(emb.app) as url:
            yield emb, url
    finally:
        emb.stop()


def test_an_unread_stream_is_paused_others_run_and_a_late_reader_gets_everything(server):
    emb, url = server
    loop = emb.service.step_loop
    s = unread_stream(url, emb.dev_key)
    try:
        # paused once its unread tokens pass the bound (while the connection's buffers still
        # take what the writer pulls it may resume and pause again a few times)
        paused = wait_for(lambda: dict(loop.state.paused), "the unread stream to be paused")
        (rid, _), = paused.items()
        assert emb.metrics.registry.get_sample_value("specgate_stream_pauses_total") >= 1

        # another tenant is served meanwhile
        r = httpx.post(url + "/v1/chat/completions", headers={"Authorization": f"Bearer {VICTIM_KEY}"},
                       json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                             "max_tokens": 40}, timeout=120)
        assert r.status_code == 200, r.text
        out = r.json()
        assert out["choices"][0]["message"]["content"] == truth(out["id"], 40)

        # once the buffers are full it stays paused, short of its end: no steps, no KV
        seen: list[int] = []

        def settled() -> bool:
            s_ = loop.state.paused.get(rid)
            seen.append(-1 if s_ is None else s_.committed)
            time.sleep(0.5)
            return len(seen) >= 3 and seen[-1] == seen[-2] == seen[-3] >= 0
        wait_for(settled, "the paused stream to stay paused")
        held = loop.state.paused[rid]
        assert 0 < held.committed < TOKENS and held.kv_tokens == 0 and rid not in loop.state.requests
        metrics = httpx.get(url + "/metrics", headers={"Authorization": f"Bearer {emb.admin_key}"})
        assert "specgate_paused_requests 1.0" in metrics.text

        # the client reads at last: every token, in order, to the end
        raw = read_all(s)
    finally:
        s.close()
    events = sse_events(raw)
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["id"] == rid for c in chunks)
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    assert text == truth(rid, TOKENS)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    wait_for(lambda: not loop.state.paused and rid not in loop.state.requests, "the request to end")


def test_backlog_bounds_are_checked():
    Backlog(0, 0)                                   # off
    with pytest.raises(ValueError, match="resume_tokens < pause_tokens"):
        Backlog(32, 32)


def test_an_unread_stream_of_several_choices_pauses_each_and_a_late_reader_gets_everything(server):
    """`n` = 2: each choice's request is paused once the reader stops (the choices' merge holds
    one item a stream, so each backlog builds in its own stream), and every token of both
    choices reaches the reader at last."""
    emb, url = server
    loop = emb.service.step_loop
    s = unread_stream(url, emb.dev_key, n=2)
    try:
        seen: list[tuple] = []

        def settled() -> bool:                 # both paused, neither moving, short of its end
            p = loop.state.paused
            seen.append(tuple(sorted((r, x.committed) for r, x in p.items())))
            time.sleep(0.5)
            return len(seen[-1]) == 2 and len(seen) >= 3 and seen[-1] == seen[-2] == seen[-3]
        wait_for(settled, "both choices to be paused")
        rids = [r for r, _ in seen[-1]]
        assert all(0 < c < TOKENS for _, c in seen[-1])
        raw = read_all(s)
    finally:
        s.close()
    events = sse_events(raw)
    texts = ["", ""]
    for e in events[:-1]:
        for c in json.loads(e)["choices"]:
            texts[c["index"]] += c["delta"].get("content") or ""
    assert sorted(texts) == sorted(truth(r, TOKENS) for r in rids)
    wait_for(lambda: not loop.state.paused and not loop.state.requests, "the requests to end")
