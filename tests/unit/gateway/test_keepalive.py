"""A stream that waits is not cut by a proxy's idle timeout (issue 50): every SSE stream (chat,
completions, Responses, the resume and follow endpoints) sends a keep-alive comment, and a gRPC
stream an empty delta (and HTTP/2 pings), each time `stream_keepalive_s` passes with nothing
else sent (gateway/keepalive.py).

Through `IdleProxy`, a TCP proxy that closes a connection idle for `IDLE_S` (what load balancers
do at 60 s, scaled down), a request waits in the queue behind a longer one (one request a step,
`max_batch=1`, and the one ahead runs for about twice `IDLE_S`): with keep-alive the client gets
every token; without it (`stream_keepalive_s=0`) the proxy cuts the stream."""
from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
from typing import Iterator

import grpc
import httpx
import pytest

from gateway.grpc_api.proto import specgate_pb2 as pb
from gateway.grpc_api.proto import specgate_pb2_grpc as pb_grpc
from gateway.grpc_api.server import start_grpc_server
from gateway.settings import Settings
from gateway.text import ToyTokenizer
from tests.helpers import serving
from workers.fake_worker import token_at

MODEL = "smollm2-135m"
KEY = "sk-acme-keepalive-0001"
IDLE_S = 0.8                 # the proxy's idle timeout
BEAT_S = 0.2                 # the keep-alive interval under test: well within it
STEP_MS = 20.0
AHEAD = 80                   # tokens of the request ahead, one a step: about 2 IDLE_S
TOKENS = 5                   # tokens of the waiting request
NO_SPEC = {"speculation": {"enabled": False}}      # one token a step: a predictable pace
TOK = ToyTokenizer()


class IdleProxy:
    """A TCP proxy to `127.0.0.1:upstream` that closes a connection, both ways, once no byte has
    crossed it in either direction for `idle_s` seconds. `cut`: how many it closed so."""

    def __init__(self, upstream: int, idle_s: float) -> None:
        self.upstream, self.idle_s, self.cut = upstream, idle_s, 0
        self._conns: set[asyncio.Task] = set()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)

    def __enter__(self) -> "IdleProxy":
        self._thread.start()
        self._server = asyncio.run_coroutine_threadsafe(
            asyncio.start_server(self._handle, "127.0.0.1", 0), self._loop).result(10)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    def __exit__(self, *exc) -> None:
        async def stop():
            self._server.close()
            for task in self._conns:
                task.cancel()
            await asyncio.gather(*self._conns, return_exceptions=True)
            await self._server.wait_closed()
        asyncio.run_coroutine_threadsafe(stop(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._conns.add(asyncio.current_task())
        writers, pipes, last = [writer], [], [self._loop.time()]

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            while data := await src.read(65536):
                last[0] = self._loop.time()
                dst.write(data)
                await dst.drain()
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.upstream)
            writers.append(up_writer)
            pipes = [asyncio.create_task(pipe(reader, up_writer)),
                     asyncio.create_task(pipe(up_reader, writer))]
            while True:
                done, _ = await asyncio.wait(pipes, timeout=0.02, return_when=asyncio.FIRST_COMPLETED)
                if done:
                    break                               # one side closed: close the other
                if self._loop.time() - last[0] > self.idle_s:
                    self.cut += 1
                    break
        finally:
            for task in pipes:
                task.cancel()
            await asyncio.gather(*pipes, return_exceptions=True)
            for w in writers:
                w.close()
            self._conns.discard(asyncio.current_task())


@contextlib.contextmanager
def gateway(keepalive_s: float) -> Iterator[tuple]:
    settings = Settings(fake_worker=True, fake_step_ms=STEP_MS, max_batch=1, policy="fcfs",
                        stream_keepalive_s=keepalive_s, log_level="critical")
    with serving(settings, {"acme": [KEY]}, log_level="critical") as (emb, url):
        yield emb, url


@pytest.fixture(scope="module")
def kept():
    with gateway(BEAT_S) as gw:
        yield gw


def ahead(url: str) -> str:
    """A request that holds the only batch slot for about 2 IDLE_S, with nobody connected."""
    r = httpx.post(url + "/v1/responses", headers={"Authorization": f"Bearer {KEY}"}, timeout=10,
                   json={"model": MODEL, "input": "hold", "max_output_tokens": AHEAD,
                         "background": True, **NO_SPEC})
    assert r.status_code == 200, r.text
    return r.json()["id"]


def until_done(url: str, rid: str) -> None:
    """Wait for a background response to end (a test leaves no request running behind it)."""
    deadline = time.monotonic() + 20
    while httpx.get(f"{url}/v1/responses/{rid}", headers={"Authorization": f"Bearer {KEY}"},
                    timeout=10).json()["status"] in ("queued", "in_progress"):
        assert time.monotonic() < deadline
        time.sleep(0.05)


def read_sse(method: str, url: str, body: dict | None = None) -> tuple[list[str], list[dict], bool]:
    """(comment lines, data events, whether the stream ended whole) of one SSE request."""
    comments, events, whole = [], [], False
    try:
        with httpx.stream(method, url, json=body, headers={"Authorization": f"Bearer {KEY}"},
                          timeout=httpx.Timeout(10.0)) as r:
            assert r.status_code == 200, r.read()
            for line in r.iter_lines():
                if line.startswith(":"):
                    comments.append(line)
                elif line.startswith("data: "):
                    data = line[6:]
                    if data == "[DONE]":
                        whole = True
                        continue
                    events.append(json.loads(data))
                    whole = whole or events[-1].get("type") in ("response.completed", "response.incomplete")
    except httpx.HTTPError:
        pass                                            # cut by the proxy mid-stream
    return comments, events, whole


def chat_text(events: list[dict]) -> str:
    return "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e.get("choices"))


def truth(rid: str) -> str:
    return TOK.decode([token_at(rid, p) for p in range(TOKENS)], skip_special_tokens=True)


def chat(base: str, proxied: str) -> tuple[list[str], str, bool, str]:
    comments, events, whole = read_sse("POST", proxied + "/v1/chat/completions", {
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": True,
        "max_tokens": TOKENS, **NO_SPEC})
    return comments, chat_text(events), whole, events[0]["id"]


def completions(base: str, proxied: str) -> tuple[list[str], str, bool, str | None]:
    comments, events, whole = read_sse("POST", proxied + "/v1/completions", {
        "model": MODEL, "prompt": "hi", "stream": True, "max_tokens": TOKENS, **NO_SPEC})
    text = "".join(c["text"] for e in events for c in e["choices"])
    return comments, text, whole, events[0]["id"] if events else None


def responses(base: str, proxied: str) -> tuple[list[str], str, bool, str]:
    comments, events, whole = read_sse("POST", proxied + "/v1/responses", {
        "model": MODEL, "input": "hi", "stream": True, "max_output_tokens": TOKENS, **NO_SPEC})
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    return comments, text, whole, events[0]["response"]["id"]


def chat_resume(base: str, proxied: str) -> tuple[list[str], str, bool, str]:
    """A resumable chat stream left at its opening chunk (it waits in the queue), followed
    through the proxy from the start."""
    with httpx.stream("POST", base + "/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"},
                      json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                            "stream": True, "max_tokens": TOKENS, "stream_options": {"resumable": True},
                            **NO_SPEC}, timeout=10) as r:
        rid = json.loads(next(line for line in r.iter_lines() if line.startswith("data: "))[6:])["id"]
    comments, events, whole = read_sse("GET", f"{proxied}/v1/chat/completions/{rid}/stream")
    return comments, chat_text(events), whole, rid


def responses_follow(base: str, proxied: str) -> tuple[list[str], str, bool, str]:
    """A background response queued behind the one ahead, followed through the proxy."""
    r = httpx.post(base + "/v1/responses", headers={"Authorization": f"Bearer {KEY}"}, timeout=10,
                   json={"model": MODEL, "input": "hi", "max_output_tokens": TOKENS,
                         "background": True, **NO_SPEC})
    rid = r.json()["id"]
    comments, events, whole = read_sse("GET", f"{proxied}/v1/responses/{rid}?stream=true")
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    return comments, text, whole, rid


@pytest.mark.parametrize("endpoint", [chat, completions, responses, chat_resume, responses_follow],
                         ids=lambda f: f.__name__)
def test_a_queued_sse_stream_outlives_an_idle_timeout(kept, endpoint):
    emb, url = kept
    ahead(url)
    with IdleProxy(int(url.rsplit(":", 1)[1]), IDLE_S) as proxy:
        comments, text, whole, rid = endpoint(url, f"http://127.0.0.1:{proxy.port}")
    assert whole and proxy.cut == 0
    assert text == truth(rid)                           # every token, once
    assert comments and set(comments) == {": keep-alive"}


def test_without_keepalive_the_proxy_cuts_a_queued_stream():
    """The set-up above can fail: with no keep-alive the same wait is cut."""
    with gateway(0.0) as (emb, url):
        first = ahead(url)
        with IdleProxy(int(url.rsplit(":", 1)[1]), IDLE_S) as proxy:
            comments, text, whole, _ = completions(url, f"http://127.0.0.1:{proxy.port}")
        assert not whole and not comments and proxy.cut == 1
        until_done(url, first)


# ---- gRPC ----------------------------------------------------------------------------------------------
@contextlib.contextmanager
def grpc_through_proxy(emb, keepalive_s: float) -> Iterator[tuple[pb_grpc.GenerationStub, IdleProxy]]:
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    server = asyncio.run_coroutine_threadsafe(start_grpc_server(
        emb.service, emb.tenants, None, port=0, keepalive_s=keepalive_s), loop).result(10)
    try:
        with IdleProxy(server.port, IDLE_S) as proxy:
            channel = grpc.insecure_channel(f"127.0.0.1:{proxy.port}")
            try:
                yield pb_grpc.GenerationStub(channel), proxy
            finally:
                channel.close()
    finally:
        asyncio.run_coroutine_threadsafe(server.stop(0), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


def grpc_stream(stub: pb_grpc.GenerationStub) -> tuple[list, grpc.RpcError | None]:
    request = pb.GenerateRequest(model=MODEL, prompt="hi", max_tokens=TOKENS, speculation=False)
    messages = []
    try:
        for m in stub.GenerateStream(request, metadata=(("authorization", f"Bearer {KEY}"),), timeout=10):
            messages.append(m)
    except grpc.RpcError as e:
        return messages, e
    return messages, None


@pytest.mark.parametrize("keepalive_s", [BEAT_S, 0.0])
def test_a_queued_grpc_stream_outlives_an_idle_timeout_only_with_keepalive(kept, keepalive_s):
    emb, url = kept
    first = ahead(url)
    with grpc_through_proxy(emb, keepalive_s) as (stub, proxy):
        messages, error = grpc_stream(stub)
    until_done(url, first)
    if keepalive_s == 0:
        assert error is not None and error.code() == grpc.StatusCode.UNAVAILABLE and proxy.cut == 1
        return
    assert error is None and proxy.cut == 0
    final = messages[-1].final
    assert len(final.token_ids) == TOKENS and final.text == truth(final.id)
    deltas = [m.delta for m in messages[:-1]]
    assert "".join(d.text for d in deltas) == final.text
    assert [t for d in deltas for t in d.token_ids] == list(final.token_ids)
    assert any(not d.text and not d.token_ids for d in deltas)      # the keep-alives, ignorable


# ---- the wrapper itself ------------------------------------------------------------------------------
def test_keepalive_beats_only_while_idle_passes_errors_and_closes_its_source():
    from gateway.keepalive import with_keepalive
    closed = []

    async def source(fail: bool):
        try:
            yield "a"
            await asyncio.sleep(0.25)                  # idle: beats
            yield "b"
            if fail:
                raise ValueError("boom")
            await asyncio.sleep(10)                    # never reached in full: closed early below
            yield "c"
        finally:
            closed.append(fail)

    async def go():
        got = []
        with pytest.raises(ValueError, match="boom"):
            async for item in with_keepalive(source(True), 0.1, "."):
                got.append(item)
        assert got[0] == "a" and got[-1] == "b" and 1 <= got.count(".") <= 3
        early = with_keepalive(source(False), 0.1, ".")
        assert [await anext(early) for _ in range(2)] == ["a", "."]
        await early.aclose()                           # the consumer leaves: the source is closed
        assert closed == [True, False]
    asyncio.run(go())
