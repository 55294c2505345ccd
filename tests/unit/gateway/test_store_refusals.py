"""A Redis that refuses writes, a real one of the test's own at `maxmemory` (noeviction): every
path answers 503 `store_full` with Retry-After, never a 500 (the REST fronts, the Responses API,
the admin API, gRPC's status, Ray mode's wire); reads and deletions still go through, since they
are what a full store takes (and deletions what frees it); /ready says why it is not ready."""
from __future__ import annotations

import time

import grpc
import httpx
import pytest
import redis

from gateway.builders.embedded import build_embedded
from gateway.errors import store_refusal
from gateway.grpc_api.status import status_of
from gateway.http.server import background_server
from gateway.ray_serve.remote import refusal_of
from gateway.responses.objects import Header
from gateway.responses.redis_store import RedisResponses
from gateway.settings import Settings
from gateway.tenancy.records import Tenant
from redis_server import private_redis_server, unique_prefix

MODEL = "smollm2-135m"
ADMIN = "sk-admin-refusals-01"
KEY = "sk-acme-refusals-001"


@pytest.fixture
def full_redis():
    """(url, client, fill): `fill()` makes the server full from then on (a limit below what it
    uses), `fill(0)` gives it room again."""
    with private_redis_server() as url, redis.Redis.from_url(url) as client:
        client.config_set("maxmemory-policy", "noeviction")

        def fill(limit: int = 1) -> None:
            client.config_set("maxmemory", limit)
        yield url, client, fill
        fill(0)


def until(call, status: int, timeout_s: float = 15.0) -> httpx.Response:
    deadline = time.monotonic() + timeout_s
    while (r := call()).status_code != status and time.monotonic() < deadline:
        time.sleep(0.1)
    return r


def refused_as_full(r: httpx.Response) -> None:
    assert r.status_code == 503, (r.status_code, r.text)
    assert r.json()["error"]["code"] == "store_full" and int(r.headers["Retry-After"]) >= 1


def test_a_refused_write_is_a_503_store_full_on_every_path(full_redis):
    url, client, fill = full_redis
    settings = Settings(fake_worker=True, redis_url=url, store_prefix=unique_prefix(),
                        admin_key=ADMIN, log_level="critical")
    emb = build_embedded(settings)
    emb.tenants.put(Tenant("acme"), [KEY])
    emb.start()
    try:
        with background_server(emb.app, log_level="critical") as base, \
                httpx.Client(base_url=base, timeout=30) as c:
            auth = {"Authorization": f"Bearer {KEY}"}
            done = c.post("/v1/responses", headers=auth,
                          json={"model": MODEL, "input": "hi", "max_output_tokens": 3})
            assert done.status_code == 200, done.text
            assert c.get("/ready").status_code == 200
            fill()
            body = {"model": MODEL, "prompt": "hi", "max_tokens": 3}
            refused_as_full(c.post("/v1/completions", headers=auth, json=body))
            refused_as_full(c.post("/v1/responses", headers=auth,
                                   json={"model": MODEL, "input": "hi"}))
            refused_as_full(c.post("/admin/tenants", headers={"Authorization": f"Bearer {ADMIN}"},
                                   json={"name": "newcomer"}))
            ready = until(lambda: c.get("/ready"), 503)   # Redis's memory is read once a second
            refused_as_full(ready)
            assert "full" in ready.json()["error"]["message"]
            rid = done.json()["id"]                    # what a full store still does
            assert c.get(f"/v1/responses/{rid}", headers=auth).status_code == 200
            assert c.delete(f"/v1/responses/{rid}", headers=auth).status_code == 200
            assert c.get(f"/v1/responses/{rid}", headers=auth).status_code == 404
    finally:
        emb.stop()


def test_a_put_refused_for_memory_is_a_503_not_a_500_on_create(full_redis):
    """The response store alone in a Redis that is full (generation in memory, so no watermark
    turns the request away first): the put's own refusal."""
    url, client, fill = full_redis
    emb = build_embedded(Settings(fake_worker=True, log_level="critical"))
    emb.responses.responses = RedisResponses(client, unique_prefix(), 60.0)
    emb.tenants.put(Tenant("acme"), [KEY])
    emb.start()
    try:
        with background_server(emb.app, log_level="critical") as base, \
                httpx.Client(base_url=base, timeout=30) as c:
            fill()
            r = c.post("/v1/responses", headers={"Authorization": f"Bearer {KEY}"},
                       json={"model": MODEL, "input": "hi", "max_output_tokens": 3})
            refused_as_full(r)
            fill(0)
            r = c.post("/v1/responses", headers={"Authorization": f"Bearer {KEY}"},
                       json={"model": MODEL, "input": "hi", "max_output_tokens": 3})
            assert r.status_code == 200, r.text
    finally:
        emb.stop()


def test_redis_refusals_are_503s_for_grpc_and_ray_mode_too(full_redis):
    url, client, fill = full_redis
    fill()
    with pytest.raises(redis.ResponseError) as oom:
        client.set("k", "v")
    with pytest.raises(redis.ResponseError) as script_oom:          # a script's own refusal
        client.eval("redis.call('SET', KEYS[1], 'v')", 1, "k")
    for exc in (oom.value, script_oom.value):
        assert store_refusal(exc).code == "store_full"
        code, _, trailers = status_of(exc)
        assert code is grpc.StatusCode.UNAVAILABLE and ("error-code", "store_full") in trailers
        assert refusal_of(exc).status == 503
    other = redis.ResponseError("WRONGTYPE Operation against a key holding the wrong kind")
    assert store_refusal(other) is None and status_of(other)[0] is grpc.StatusCode.INTERNAL
    with pytest.raises(redis.ResponseError):
        refusal_of(other)                                            # a bug stays a 500
    store = RedisResponses(client, unique_prefix(), 60.0)
    with pytest.raises(redis.ResponseError) as put_oom:              # refused whole: no header
        store.put(Header("resp_1", "t-1", MODEL, 1, []))
    assert store_refusal(put_oom.value).code == "store_full"
    fill(0)
    assert store.get("resp_1") is None and store.put(Header("resp_1", "t-1", MODEL, 1, []))
