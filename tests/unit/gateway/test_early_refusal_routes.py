"""Early refusals beyond REST's generation routes (gateway/http/early_refusal.py,
gateway/grpc_api/early.py): followers (chat resumes, GETs of a stored response, gRPC `Resume`)
and gRPC's generation calls are refused at their front's gate for the limits their own full
path checks, before authentication, with the same refusal; the book is one, so a key refused on
one front or route is refused early on the others that check the same limit, and never for a
limit its route does not check. On the fake worker over a real Redis, the calls counted on the
real tenant registry."""
from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from typing import Iterator

import grpc
import httpx
import pytest

from gateway.grpc_api.proto import specgate_pb2 as pb
from gateway.grpc_api.proto import specgate_pb2_grpc as pb_grpc
from gateway.grpc_api.server import start_grpc_server
from gateway.http.early_refusal import route_of
from gateway.http.refusal_book import RefusalBook
from gateway.settings import Settings
from gateway.tenancy.records import Tenant
from tests.helpers import serving
from tests.unit.gateway.test_early_refusals import Clock, Counting, assert_refused
from tests.unit.gateway.test_followers import background, following, stopped, until_accepted

MODEL = "smollm2-135m"
LIMITED, ACME, CAPPED, OTHER = ("sk-routes-limited-001", "sk-routes-acme-000001",
                                "sk-routes-capped-0001", "sk-routes-other-00001")
CAP = 1                          # follower slots a tenant may hold


def auth(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


def meta(key: str) -> tuple:
    return (("authorization", f"Bearer {key}"),)


@contextlib.contextmanager
def gateway(redis_url: str, redis_prefix: str, hold_s: float = 0.0) -> Iterator[tuple]:
    """The embedded gateway on both fronts, as `specgate serve --grpc-port` runs it (the gRPC
    front sharing the REST app's followers and early refusals), the book on a clock that moves
    only when the test says, and the tenant registry's `authenticate` counted."""
    settings = Settings(fake_worker=True, fake_step_ms=20.0, log_level="critical",
                        redis_url=redis_url, store_prefix=redis_prefix, early_refusal_hold_s=hold_s,
                        max_followers_per_tenant=CAP)
    with serving(settings, {"limited": [LIMITED], "acme": [ACME], "capped": [CAPPED],
                            "other": [OTHER]},
                 tenant_options={"limited": {"rpm": 2}, "capped": {"max_concurrent": 1}},
                 log_level="critical") as (emb, url):
        book: RefusalBook = emb.app.state.refusal_book
        clock = Clock(time.monotonic())
        book._clock = clock
        loop = asyncio.new_event_loop()
        thread = threading.Thread(target=loop.run_forever, daemon=True)
        thread.start()
        server = asyncio.run_coroutine_threadsafe(start_grpc_server(
            emb.service, emb.tenants, emb.limiter, port=0, replayer=emb.replayer,
            followers=emb.followers, early=emb.app.state.early_refusals), loop).result(30)
        channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
        try:
            yield (emb, url, pb_grpc.GenerationStub(channel), channel, clock,
                   Counting(emb.tenants, "authenticate"))
        finally:
            channel.close()
            asyncio.run_coroutine_threadsafe(stopped(server), loop).result(30)
            loop.call_soon_threadsafe(loop.stop)
            thread.join(30)
            loop.close()


@pytest.fixture
def gw(redis_url, redis_prefix) -> Iterator[tuple]:
    with gateway(redis_url, redis_prefix) as g:
        yield g


def request(max_tokens: int = 1) -> pb.GenerateRequest:
    return pb.GenerateRequest(model=MODEL, prompt="hi", max_tokens=max_tokens)


def grpc_refused(call, code: str) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as err:
        result = call()
        if not isinstance(result, pb.GenerateResponse):
            list(result)
    assert err.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED, err.value.details()
    trailers = dict(err.value.trailing_metadata())
    assert trailers["error-code"] == code and trailers["error-type"] == "rate_limit_error"
    assert int(trailers["retry-after"]) >= 1
    return err.value


def post(url: str, key: str) -> httpx.Response:
    return httpx.post(url + "/v1/completions", headers=auth(key), timeout=60,
                      json={"model": MODEL, "prompt": "hi", "max_tokens": 1})


# ---- which routes are gated, and for what ----------------------------------------------------------
@pytest.mark.parametrize("method,path,query,route", [
    ("POST", "/v1/completions", b"", "generate"),
    ("GET", "/v1/chat/completions/chatcmpl-1/stream", b"after=3", "follow"),
    ("GET", "/v1/responses/resp_1", b"", "read"),
    ("GET", "/v1/responses/resp_1", b"stream=true&starting_after=2", "follow"),
    ("GET", "/v1/responses/resp_1", b"stream=1&stream=no", "read"),       # the last one counts
    ("GET", "/v1/responses/resp_1", b"stream=maybe", None),               # the full path's 422
    ("POST", "/v1/responses/resp_1/cancel", b"", None),                   # uncharged
    ("DELETE", "/v1/responses/resp_1", b"", None),
    ("GET", "/v1/responses/", b"", None),
    ("GET", "/v1/chat/completions/a/b/stream", b"", None),
    ("GET", "/v1/models", b"", None),
])
def test_a_route_is_gated_as_its_full_path_is_charged(method, path, query, route):
    assert route_of({"method": method, "path": path, "query_string": query}) == route


def test_a_key_holds_a_verdict_of_each_kind_and_a_route_gets_only_its_own():
    held, followers = {"t": 1}, {"t": 1}
    book = RefusalBook(lambda n: held.get(n, 0), follower_held=lambda n: followers.get(n, 0),
                       follower_cap=1, clock=Clock())
    tenant = Tenant("t", max_concurrent=1)
    assert book.note("d", tenant, "concurrency", 1.0) and book.note("d", tenant, "followers", 1.0)
    assert book.refusal("d", ("rpm",)) is None
    assert book.refusal("d", ("rpm", "concurrency"))[1] == "concurrency"
    name, kind, exc = book.refusal("d", ("rpm", "followers"))
    assert (name, kind, exc.kind) == ("t", "followers", "concurrency")
    assert exc.message.startswith("Too many streams followed at once: at most 1")
    followers["t"] = 0                                # its follower ended here: that verdict goes
    assert book.refusal("d", ("rpm", "followers")) is None
    assert book.refusal("d", ("concurrency",))[1] == "concurrency" and len(book) == 1
    assert not book.note("e", tenant, "followers", 1.0)               # not all held here


# ---- followers ----------------------------------------------------------------------------------------
def test_rpm_refuses_early_on_every_route_that_charges_it_and_no_other(gw):
    emb, url, stub, _, clock, auth_calls = gw
    resp = background(url, LIMITED)                                   # 1 of 2 a minute
    get = f"{url}/v1/responses/{resp}"
    try:
        assert httpx.get(get, headers=auth(LIMITED), timeout=30).status_code == 200     # 2
        full = httpx.get(get, headers=auth(LIMITED), timeout=30)       # refused, and noted
        assert_refused(full, "rpm_exceeded")
        calls = auth_calls.calls
        for r in (httpx.get(get, headers=auth(LIMITED), timeout=30),
                  httpx.get(get + "?stream=true", headers=auth(LIMITED), timeout=30),
                  httpx.get(f"{url}/v1/chat/completions/{resp}/stream", headers=auth(LIMITED),
                            timeout=30),
                  post(url, LIMITED)):                                 # one bucket for all
            assert_refused(r, "rpm_exceeded")
            assert r.json()["error"]["message"].startswith("Rate limit reached: 2 requests per minute")
        grpc_refused(lambda: stub.Resume(pb.ResumeRequest(request_id=resp), metadata=meta(LIMITED),
                                         timeout=30), "rpm_exceeded")
        assert auth_calls.calls == calls                                # none of them authenticated
        # an uncharged route is not gated: cancelling it takes the full path, and succeeds
        cancel = httpx.post(get + "/cancel", headers=auth(LIMITED), timeout=30)
        assert cancel.status_code == 200 and auth_calls.calls == calls + 1
        clock.now += emb.app.state.refusal_book.max_age_s
        assert_refused(httpx.get(get, headers=auth(LIMITED), timeout=30), "rpm_exceeded")
        assert auth_calls.calls == calls + 2
    finally:
        emb.service.cancel(resp)


def test_a_follower_past_its_cap_is_refused_early_until_one_of_its_followers_ends(gw):
    emb, url, stub, _, clock, auth_calls = gw
    resp = background(url, ACME)
    get = f"{url}/v1/responses/{resp}"
    try:
        with following(get + "?stream=true", ACME):
            full = httpx.get(get + "?stream=true", headers=auth(ACME), timeout=30)
            assert_refused(full, "concurrency_exceeded")
            calls = auth_calls.calls
            for _ in range(3):
                early = httpx.get(get + "?stream=true", headers=auth(ACME), timeout=30)
                assert_refused(early, "concurrency_exceeded")
                assert early.json()["error"]["message"] == full.json()["error"]["message"]
            err = grpc_refused(lambda: stub.Resume(pb.ResumeRequest(request_id=resp),
                                                   metadata=meta(ACME), timeout=30),
                               "concurrency_exceeded")
            assert err.details() == full.json()["error"]["message"]
            assert auth_calls.calls == calls
            # what the followers' cap does not bound is served: a plain read, a generation
            assert httpx.get(get, headers=auth(ACME), timeout=30).status_code == 200
            assert post(url, ACME).status_code == 200
            assert auth_calls.calls == calls + 2
        until_accepted(get + "?stream=true", ACME)        # no verdict outlives the slot
    finally:
        emb.service.cancel(resp)


def test_a_tenant_at_its_max_concurrent_may_still_follow(gw):
    # the generation's concurrency verdict is not a follower's: they are counted apart
    emb, url, stub, _, clock, auth_calls = gw
    resp = background(url, CAPPED)                                  # its one slot
    try:
        assert_refused(post(url, CAPPED), "concurrency_exceeded")
        calls = auth_calls.calls
        assert_refused(post(url, CAPPED), "concurrency_exceeded")
        assert auth_calls.calls == calls                            # refused early
        with following(f"{url}/v1/responses/{resp}?stream=true", CAPPED):
            pass
    finally:
        emb.service.cancel(resp)


# ---- gRPC -------------------------------------------------------------------------------------------
def test_a_key_over_its_rpm_is_refused_early_on_both_fronts_whichever_refused_it(gw):
    emb, url, stub, channel, clock, auth_calls = gw
    stub.Generate(request(), metadata=meta(LIMITED), timeout=30)
    stub.Generate(request(), metadata=meta(LIMITED), timeout=30)          # its 2 a minute
    full = grpc_refused(lambda: stub.Generate(request(), metadata=meta(LIMITED), timeout=30),
                        "rpm_exceeded")                                   # noted, over gRPC
    assert full.details().startswith("Rate limit reached: 2 requests per minute")
    calls = auth_calls.calls
    for rpc in (lambda: stub.Generate(request(), metadata=meta(LIMITED), timeout=30),
                lambda: stub.GenerateStream(request(), metadata=meta(LIMITED), timeout=30)):
        early = grpc_refused(rpc, "rpm_exceeded")
        assert early.details().startswith("Rate limit reached: 2 requests per minute")
    # the message is not even parsed: bytes no servicer could read get the same refusal
    raw = channel.unary_unary("/specgate.v1.Generation/Generate")
    grpc_refused(lambda: raw(b"\xff\xff\xff", metadata=meta(LIMITED), timeout=30), "rpm_exceeded")
    assert_refused(post(url, LIMITED), "rpm_exceeded")                    # and on REST
    assert auth_calls.calls == calls
    # another tenant is served as before; the verdict ends, and the full path answers again
    assert stub.Generate(request(), metadata=meta(OTHER), timeout=30).finish_reason == "length"
    clock.now += emb.app.state.refusal_book.max_age_s
    grpc_refused(lambda: stub.Generate(request(), metadata=meta(LIMITED), timeout=30),
                 "rpm_exceeded")
    assert auth_calls.calls == calls + 2


def test_a_key_refused_on_rest_is_refused_early_on_grpc_after_the_hold(redis_url, redis_prefix):
    hold = 0.5
    with gateway(redis_url, redis_prefix, hold_s=hold) as (emb, url, stub, _, clock, auth_calls):
        resp = background(url, CAPPED)                              # its one slot
        try:
            assert_refused(post(url, CAPPED), "concurrency_exceeded")   # noted, over REST
            calls = auth_calls.calls
            started = time.monotonic()
            err = grpc_refused(lambda: stub.Generate(request(), metadata=meta(CAPPED), timeout=30),
                               "concurrency_exceeded")
            assert time.monotonic() - started >= hold
            assert err.details().startswith("Too many concurrent requests: at most 1")
            assert auth_calls.calls == calls
        finally:
            emb.service.cancel(resp)
