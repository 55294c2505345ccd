"""Followers are requests (gateway/followers.py), on the embedded gateway and its fake worker, in
memory and on a real Redis: a tenant's followers (chat resumes, streamed GETs of responses, gRPC
`Resume`) hold one of its follower slots each while they stream, and one past the cap gets the
429 a generation over its limits gets, at once; a follower that goes away gives its slot back;
every follow, and a plain GET of a stored response, is charged to the tenant's rpm."""
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

from gateway.errors import ApiError
from gateway.followers import FollowerGate
from gateway.grpc_api.proto import specgate_pb2 as pb
from gateway.grpc_api.proto import specgate_pb2_grpc as pb_grpc
from gateway.grpc_api.server import start_grpc_server
from gateway.settings import Settings
from gateway.tenancy.limits import LimitExceeded, Limiter
from gateway.tenancy.records import Tenant
from tests.helpers import serving

MODEL = "smollm2-135m"
ACME, OTHER, LIMITED = "sk-acme-followers-01", "sk-other-followers-1", "sk-limited-follower1"
CAP = 2
FREED_WITHIN_S = 15.0     # a released slot is free again within this (load-proof: usually ms)


@pytest.fixture
def gw(store):
    url, prefix = store
    settings = Settings(fake_worker=True, fake_step_ms=20.0, log_level="critical",
                        redis_url=url, store_prefix=prefix, max_followers_per_tenant=CAP)
    with serving(settings, {"acme": [ACME], "other": [OTHER], "limited": [LIMITED]},
                 tenant_options={"limited": {"rpm": 3}}, log_level="critical") as (emb, base):
        yield emb, base


def auth(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


def background(base: str, key: str = ACME) -> str:
    """A background response that runs for the whole test (cancelled at its end)."""
    r = httpx.post(base + "/v1/responses", headers=auth(key), timeout=30, json={
        "model": MODEL, "input": "hello", "max_output_tokens": 3000, "background": True,
        "speculation": {"enabled": False}})
    assert r.status_code == 200, r.text
    return r.json()["id"]


def resumable_chat(base: str, key: str = ACME) -> str:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "stream": True,
            "max_tokens": 3000, "speculation": {"enabled": False},
            "stream_options": {"resumable": True}}
    with httpx.stream("POST", base + "/v1/chat/completions", json=body, headers=auth(key),
                      timeout=30) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: "):
                return json.loads(line[6:])["id"]
    raise AssertionError("no event")


@contextlib.contextmanager
def following(url: str, key: str) -> Iterator[httpx.Response]:
    """A follower that has received its first event, held open until the block ends."""
    with httpx.stream("GET", url, headers=auth(key), timeout=30) as r:
        assert r.status_code == 200, r.read()
        lines = r.iter_lines()          # kept while the block runs: dropping it closes the response
        for line in lines:
            if line.startswith("data: "):
                break
        yield r


def refused(url: str, key: str) -> httpx.Response:
    t0 = time.monotonic()
    r = httpx.get(url, headers=auth(key), timeout=30)
    assert time.monotonic() - t0 < 10           # at once, not after the followed request ends
    return r


def check_429(r: httpx.Response, code: str) -> None:
    assert r.status_code == 429, r.text
    assert r.json()["error"]["code"] == code and r.json()["error"]["type"] == "rate_limit_error"
    assert int(r.headers["Retry-After"]) >= 1


def until_accepted(url: str, key: str) -> None:
    deadline = time.monotonic() + FREED_WITHIN_S
    while True:
        with httpx.stream("GET", url, headers=auth(key), timeout=30) as r:
            if r.status_code == 200:
                return
            r.read()
            check_429(r, "concurrency_exceeded")
        assert time.monotonic() < deadline, "the slot of a follower that left never came back"
        time.sleep(0.1)


def test_followers_past_the_cap_get_429_and_a_leaving_one_gives_its_slot_back(gw):
    emb, base = gw
    chat, resp = resumable_chat(base), background(base)
    chat_url = f"{base}/v1/chat/completions/{chat}/stream"
    resp_url = f"{base}/v1/responses/{resp}?stream=true"
    try:
        with following(chat_url, ACME), contextlib.ExitStack() as second:
            second.enter_context(following(resp_url, ACME))
            for url in (chat_url, resp_url):               # the cap is per tenant, both kinds
                check_429(refused(url, ACME), "concurrency_exceeded")
            # another tenant is not held back by acme's followers
            theirs = background(base, OTHER)
            with following(f"{base}/v1/responses/{theirs}?stream=true", OTHER):
                pass
            emb.service.cancel(theirs)
            second.close()                                  # one follower leaves...
            until_accepted(resp_url, ACME)                  # ...and its slot comes back
        until_accepted(chat_url, ACME)
    finally:
        emb.service.cancel(chat)
        emb.service.cancel(resp)


def test_every_follow_and_a_plain_get_of_a_response_is_charged_to_rpm(gw):
    emb, base = gw
    resp = background(base, LIMITED)                       # 1 of 3 a minute
    try:
        assert httpx.get(f"{base}/v1/responses/{resp}", headers=auth(LIMITED),
                         timeout=30).status_code == 200    # 2
        with following(f"{base}/v1/responses/{resp}?stream=true", LIMITED):   # 3
            pass
        for url in (f"{base}/v1/responses/{resp}", f"{base}/v1/responses/{resp}?stream=true",
                    f"{base}/v1/chat/completions/{resp}/stream"):
            check_429(refused(url, LIMITED), "rpm_exceeded")
        # the other tenants are not
        assert httpx.get(f"{base}/v1/responses/{resp}", headers=auth(ACME),
                         timeout=30).status_code == 404
    finally:
        emb.service.cancel(resp)


async def stopped(server) -> None:
    """Stop the server, then end what its calls left on the loop (as `asyncio.run` would)."""
    await server.stop(0)
    tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    await asyncio.get_running_loop().shutdown_asyncgens()


@contextlib.contextmanager
def grpc_front(emb) -> Iterator[pb_grpc.GenerationStub]:
    """The embedded gateway's gRPC front (as `specgate serve --grpc-port` starts it, sharing the
    REST front's followers), on a loop thread of its own."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    server = asyncio.run_coroutine_threadsafe(start_grpc_server(
        emb.service, emb.tenants, emb.limiter, port=0, replayer=emb.replayer,
        followers=emb.followers), loop).result(30)
    channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
    try:
        yield pb_grpc.GenerationStub(channel)
    finally:
        channel.close()
        asyncio.run_coroutine_threadsafe(stopped(server), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(30)
        loop.close()


def test_a_grpc_resume_is_a_follower_of_the_same_cap_and_charged_to_rpm(gw):
    emb, base = gw
    chat = resumable_chat(base)
    limited = background(base, LIMITED)                      # 1 of 3 a minute
    metadata = (("authorization", f"Bearer {ACME}"),)
    try:
        with grpc_front(emb) as stub:
            resume = stub.Resume(pb.ResumeRequest(request_id=chat, after=0), metadata=metadata,
                                 timeout=30)
            next(resume)
            with following(f"{base}/v1/chat/completions/{chat}/stream", ACME):
                with pytest.raises(grpc.RpcError) as err:       # REST's and gRPC's together
                    next(stub.Resume(pb.ResumeRequest(request_id=chat, after=0), metadata=metadata,
                                     timeout=30))
            assert err.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
            trailers = dict(err.value.trailing_metadata())
            assert trailers["error-code"] == "concurrency_exceeded"
            assert int(trailers["retry-after"]) >= 1
            resume.cancel()                                     # its slot comes back
            until_accepted(f"{base}/v1/chat/completions/{chat}/stream", ACME)
            # rpm: two Resumes pass, the third is refused
            lim = (("authorization", f"Bearer {LIMITED}"),)
            for _ in range(2):
                call = stub.Resume(pb.ResumeRequest(request_id=limited, after=0), metadata=lim,
                                   timeout=30)
                next(call)
                call.cancel()
            with pytest.raises(grpc.RpcError) as err:
                next(stub.Resume(pb.ResumeRequest(request_id=limited, after=0), metadata=lim,
                                 timeout=30))
            assert err.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
            assert dict(err.value.trailing_metadata())["error-code"] == "rpm_exceeded"
    finally:
        emb.service.cancel(chat)
        emb.service.cancel(limited)


def test_follower_slots_are_a_pool_of_their_own_beside_max_concurrent(store):
    """A tenant at its `max_concurrent` (its one generation running) may still follow it, and
    its followers take none of its generation slots: the two caps count apart, in memory and
    in Redis, on every replica's limiter over one store."""
    url, prefix = store
    solo = Tenant("solo", max_concurrent=1)
    limiters = [Limiter(url, prefix)]
    if url is not None:
        limiters.append(Limiter(url, prefix))                    # a second replica's
    generation = limiters[0].acquire(solo, 10)                   # its one generation slot
    with pytest.raises(LimitExceeded):
        limiters[-1].acquire(solo, 10)

    async def go() -> None:
        gate, other = FollowerGate(limiters[0], 2), FollowerGate(limiters[-1], 2)
        held = [await gate.enter(solo), await other.enter(solo)]
        with pytest.raises(ApiError) as err:
            await gate.enter(solo)
        assert err.value.code == "concurrency_exceeded" and err.value.retry_after_s >= 1
        await gate.leave(held.pop())
        held.append(await other.enter(solo))
        for grant in held:
            await gate.leave(grant)

    asyncio.run(go())
    limiters[0].release(generation, 10)
    limiters[-1].release(limiters[-1].acquire(solo, 10), 10)     # its generation slot was free
