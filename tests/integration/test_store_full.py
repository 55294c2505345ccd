"""A Redis filling up under a running gateway: the embedded gateway over HTTP (the fake worker paced
by `fake_step_ms`) over a redis-server of the test's own with `maxmemory 8mb` and `noeviction`,
as the chart runs it. Filled past the watermark (`SPECGATE_REDIS_MEMORY_WATERMARK`, 90%) while a
stream runs: new requests get 503 `store_full` with Retry-After and /ready says the store is
full, while the stream in flight finishes with every token (it writes into the room between the
watermark and maxmemory); once room is freed, new requests are served again."""
from __future__ import annotations

import asyncio
import time
import uuid

import httpx
import pytest
import redis

from gateway.assembly.replica import scheduler_prefix
from gateway.http.server import background_server
from gateway.tenancy.records import Tenant
from redis_server import private_redis_server
from scheduler.store.redis_store import RedisStore
from test_faults import TOK, body, check_refused, check_stored, expected_ids, post
from test_redis_faults import gateway, stream_text

pytestmark = pytest.mark.slow          # a gateway and a Redis of its own, seconds of streaming

MAXMEMORY = 8 * 2**20
FILLER = 16 * 1024


class Own:
    def __init__(self, url: str) -> None:
        self.url = url


def fill_to(client: redis.Redis, share: float) -> int:
    """Write filler until Redis uses `share` of its maxmemory; returns the keys written."""
    n = 0
    while client.info("memory")["used_memory"] < share * MAXMEMORY:
        client.set(f"filler:{n}", b"x" * FILLER)
        n += 1
    return n


async def until(call, status: int, timeout_s: float = 20.0) -> httpx.Response:
    deadline = time.monotonic() + timeout_s
    while (r := await call()).status_code != status and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    return r


def test_a_full_redis_refuses_new_work_while_the_stream_in_flight_finishes():
    with private_redis_server() as url, redis.Redis.from_url(url) as client:
        client.config_set("maxmemory", MAXMEMORY)
        client.config_set("maxmemory-policy", "noeviction")
        emb = gateway(Own(url), f"sf:{uuid.uuid4().hex}:", fake_step_ms=20.0)
        emb.tenants.put(Tenant("acme"), ["sk-acme"])
        emb.start()
        max_tokens = 1000
        try:
            with background_server(emb.app, log_level="critical") as base:
                async def scenario():
                    seen: dict = {}

                    async def on_chunk(text: str) -> None:
                        if "filled" in seen:
                            return
                        seen["filled"] = await asyncio.to_thread(fill_to, client, 0.93)
                        seen["live"] = len(emb.step_loop.state.requests)
                        seen["new"] = await until(lambda: post(c, base, "sk-acme", body(5)), 503)
                        seen["response"] = await c.post(
                            base + "/v1/responses", headers={"Authorization": "Bearer sk-acme"},
                            json={"model": "smollm2-135m", "input": "hi"})
                        seen["ready"] = await until(lambda: c.get(base + "/ready"), 503)
                        seen["stream_at"] = len(text)

                    async with httpx.AsyncClient(timeout=60) as c:
                        out = await stream_text(c, base, "sk-acme", max_tokens, on_chunk)
                        for n in range(seen["filled"]):             # room again
                            await asyncio.to_thread(client.delete, f"filler:{n}")
                        seen["again"] = await until(lambda: post(c, base, "sk-acme", body(5)), 200)
                        seen["ready_again"] = await until(lambda: c.get(base + "/ready"), 200)
                    return out, seen

                (rid, text, reason), seen = asyncio.run(scenario())
            for refused in (seen["new"], seen["response"], seen["ready"]):
                check_refused(refused, (503,))
                assert refused.json()["error"]["code"] == "store_full", refused.text
            # the stream was in flight across it, and got every token, once, in order
            assert seen["live"] == 1 and seen["stream_at"] < len(text)
            assert reason == "length" and text == TOK.decode(expected_ids(rid, max_tokens))
            store = RedisStore.from_url(url, scheduler_prefix(emb.settings))
            try:
                check_stored(store, rid, max_tokens)
            finally:
                store.close()
            assert seen["again"].status_code == 200, seen["again"].text
            assert seen["ready_again"].status_code == 200
            assert emb.step_loop.store_writing()
        finally:
            emb.stop()
